"""Every parameter's full fp32 master and Adam moments, one tensor file per layer: a checkpoint that any
data-parallel size and any pipeline split can resume.

DeepSpeed's own optimizer files only fit the layout that wrote them: ZeRO keeps flat partitions of
the fp32 masters and moments across the data-parallel group, a pipeline one file per stage in
parameter order.  Its universal checkpoint re-slices them, but needs a conversion pass, unpickles
outside any checkpoint engine, skips DeepSpeed's MoE experts and has no ZeRO-0 loader.  So each
save also writes, per layer and TP rank (``layer_file``), every parameter's
whole ``fp32``, ``exp_avg`` and ``exp_avg_sq``, gathered through DeepSpeed's public
``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` (collectives over the data-parallel
group: every rank of a stage walks the same parameters in the same order), and the optimizer's step
and the engine's counters as JSON (``full_states.json``).  Loading is ``torch.load(weights_only=True)``.

A run on another layout builds its engine for the ranks it has, creates the optimizer states the
first step would, and sets each parameter's slice of them with ``safe_set_full_*``; the bf16/fp16
model weights are the masters cast, as DeepSpeed's step leaves them.  Where no DeepSpeed wrapper
holds a master (ZeRO-0 in fp32) the parameter is its own master; DeepSpeed's unfused fp16/bf16
optimizer keeps one fp32 copy per parameter.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..compat.optimizer import unwrap_optimizer

MOMENTS = ("exp_avg", "exp_avg_sq")
META = "full_states.json"


class FullStateError(ValueError):
    """Full states that cannot be moved onto this run; the message names the file or the setting."""


def layer_file(ckpt: Path, idx: int, tp_rank: int, ep_rank: int | None = None) -> Path:
    """Layer ``idx``'s file of TP rank ``tp_rank``: its dense parameters, or with ``ep_rank`` the experts that EP
    rank holds where a DeepSpeed MoE splits them."""
    ep = "" if ep_rank is None else f"-ep_{ep_rank:02d}"
    return Path(ckpt) / f"layer_{idx:03d}-tp_{tp_rank:02d}{ep}-full_states.pt"


def model_layers(module: nn.Module, *, pipelined: bool) -> Iterator[tuple[int, nn.Module]]:
    """(global layer index, layer) of this rank's layers: a stage's, or the whole sequential model's."""
    if pipelined:
        from ..compat.engine import local_layers

        yield from local_layers(module)
    else:
        yield from enumerate(module.layers)


class _Masters:
    """Where each parameter's fp32 master and moments live in this engine's optimizer."""

    def __init__(self, engine):
        self.wrapper, self.inner = engine.optimizer, unwrap_optimizer(engine.optimizer)
        self.copies = {}  # DeepSpeed's unfused fp16/bf16 optimizer: an fp32 copy per low-precision parameter
        pairs = zip(getattr(self.wrapper, "fp16_groups", ()), getattr(self.wrapper, "fp32_groups", ()))
        for lp_group, hp_group in pairs:
            self.copies.update({id(lp): hp for lp, hp in zip(lp_group, hp_group)})
        if hasattr(self.wrapper, "fp32_groups_flat") and not self.copies:
            raise FullStateError(f"{type(self.wrapper).__name__} keeps its fp32 masters fused in one flat tensor: "
                                 f"full states are not read from it; train with ZeRO-1 or torch's AdamW")

    def relink(self) -> None:
        """Point each parameter's fragment at the optimizer states that exist now.  DeepSpeed 0.19's ZeRO-1/2
        links them once, after stepping the first parameter group, so the fragments of a later group (MoE
        experts') never see their states and ``safe_get_full_optimizer_state`` raises for them."""
        if hasattr(self.wrapper, "_hp_optimizer_states_linked"):  # ZeRO-1/2 and BF16_Optimizer
            self.wrapper._hp_optimizer_states_linked = False
            self.wrapper._lazy_init_hp_params_optimizer_state()

    @staticmethod
    def partitioned(p) -> bool:
        return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")

    def master(self, p):
        return self.copies.get(id(p), p)

    def get(self, p) -> dict:
        """{"fp32": ..., "exp_avg": ..., "exp_avg_sq": ...} of ``p``, whole, on the CPU (collective where ZeRO
        partitions it). A frozen parameter has its weight only."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        if not p.requires_grad:
            return {"fp32": _frozen_weight(p)}
        if self.partitioned(p):
            out = {"fp32": safe_get_full_fp32_param(p)}
            out.update({k: safe_get_full_optimizer_state(p, k) for k in MOMENTS})
        else:
            master = self.master(p)
            state = self.inner.state.get(master, {})
            out = {"fp32": master.detach()}
            out.update({k: state[k] for k in MOMENTS if k in state})
        return {k: v.detach().float().cpu().clone() for k, v in out.items()}

    def set(self, p, saved: dict, where: str) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        fp32 = saved["fp32"]
        if tuple(fp32.shape) != tuple(_full_shape(p)):
            raise FullStateError(f"{where}: saved {tuple(fp32.shape)}, this run's parameter is {tuple(_full_shape(p))}")
        if not p.requires_grad:
            _set_weight(p, fp32)
            return
        missing = [k for k in MOMENTS if k not in saved]
        if missing:
            raise FullStateError(f"{where} has no {missing[0]}: it was saved before its first optimizer step")
        if self.partitioned(p):
            safe_set_full_fp32_param(p, fp32.to(_device(p)))
            for k in MOMENTS:
                safe_set_full_optimizer_state(p, saved[k].to(_device(p)), k)
            _set_weight(p, fp32)
            return
        master = self.master(p)
        with torch.no_grad():
            master.copy_(fp32.view_as(master))
            for k in MOMENTS:
                self.inner.state[master][k].copy_(saved[k].view_as(master))
            if master is not p:
                p.copy_(fp32.view_as(p))

    def step(self) -> float | None:
        steps = {float(s["step"]) for s in self.inner.state.values() if "step" in s}
        if len(steps) > 1:
            raise FullStateError(f"the optimizer's states are at different steps {sorted(steps)}")
        return steps.pop() if steps else None

    def _stepped(self) -> list:
        """(tensor the optimizer steps, its param group): ZeRO-3 puts each flat fp32 partition in its group only
        while it steps it."""
        if hasattr(self.wrapper, "fp32_partitioned_groups_flat"):
            return [(f, self.inner.param_groups[self.wrapper.sub_group_to_group_id[i]])
                    for i, f in enumerate(self.wrapper.fp32_partitioned_groups_flat)]
        return [(f, group) for group in self.inner.param_groups for f in group["params"]]

    def create_states(self, step: float) -> None:
        """The states torch's Adam/AdamW creates at its first step, at ``step``; then DeepSpeed's fragments of
        them linked to each parameter (what its first step links)."""
        if not isinstance(self.inner, (torch.optim.Adam, torch.optim.AdamW)):
            raise FullStateError(f"{type(self.inner).__name__}: full states move torch's Adam and AdamW moments only; "
                                 f"resume on the layout that wrote the checkpoint")
        for f, group in self._stepped():
            on_device = group.get("fused") or group.get("capturable")
            state = self.inner.state[f]
            for k in MOMENTS:
                state.setdefault(k, torch.zeros_like(f, memory_format=torch.preserve_format))
            state["step"] = torch.tensor(step, dtype=torch.float32, device=f.device if on_device else "cpu")
        self.relink()


def _device(p) -> torch.device:
    return p.ds_tensor.device if hasattr(p, "ds_tensor") else p.device


def _full_shape(p) -> torch.Size:
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape


def _frozen_weight(p) -> torch.Tensor:
    """The model's copy of a parameter, whole, in fp32 on the CPU (under ZeRO-3 gathered from its partitions;
    DeepSpeed's context does nothing for any other parameter)."""
    from deepspeed import zero

    with zero.GatheredParameters([p]):
        return p.detach().float().cpu().clone()


def _set_weight(p, fp32: torch.Tensor) -> None:
    """The model's copy of a parameter: the master cast to its dtype; under ZeRO-3 this rank's partition."""
    with torch.no_grad():
        if hasattr(p, "ds_tensor"):
            part = p.ds_tensor
            size, rank = part.numel(), dist.get_rank(group=p.ds_process_group)
            flat = fp32.flatten()
            n = max(0, min(size, flat.numel() - rank * size))
            part.zero_()
            part[:n].copy_(flat[rank * size: rank * size + n])
        else:
            p.copy_(fp32.view_as(p))


def engine_counters(engine) -> dict:
    """What a step's bookkeeping resumes from: DeepSpeed's counters, its LR scheduler, its loss scale."""
    out = {"global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples),
           "skipped_steps": int(getattr(engine, "skipped_steps", 0)), "wrapper": type(engine.optimizer).__name__}
    sched = getattr(engine, "lr_scheduler", None)
    if sched is not None:
        out["lr_scheduler"] = sched.state_dict()
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None:
        out["loss_scaler"] = {k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool))}
    return out


def _experts(layer: nn.Module) -> tuple[dict[str, str], int]:
    """({local name of an expert parameter: its global name}, this rank's EP rank) for a layer whose DeepSpeed
    MoE splits its experts over ep > 1 ranks; ({}, 0) otherwise (experts then live with the dense parameters)."""
    from ..models.moe import expert_parallel_rank, global_expert_names

    names = global_expert_names(layer)
    if not names:
        return {}, 0
    from deepspeed.moe.layer import MoE

    ep = next(m.ep_size for m in layer.modules() if isinstance(m, MoE) and m.ep_size > 1)
    return names, expert_parallel_rank(ep)


def _expert_data_parallel_rank(p) -> int:
    from deepspeed.utils import groups

    return dist.get_rank(group=groups._get_expert_data_parallel_group(p.group_name))


def save(engine, ckpt: Path, *, pipelined: bool, writer: bool, tp_rank: int,
         after_each: Callable[[Path], None] = lambda p: None) -> list[Path]:
    """Every rank calls this (ZeRO gathers are collective); ``writer`` ranks (data-parallel rank 0) write the dense
    parameters, and where experts are split over EP ranks, expert-data-parallel rank 0 of each writes its experts
    under their global names."""
    masters, written = _Masters(engine), []
    step = masters.step()
    if step is not None:  # every state exists once the optimizer has stepped
        masters.relink()
    for idx, layer in model_layers(engine.module, pipelined=pipelined):
        experts, ep_rank = _experts(layer)
        tensors, expert_tensors, expert_writer = {}, {}, False
        for name, p in layer.named_parameters():
            states = masters.get(p)
            if name in experts:
                expert_tensors.update({f"{experts[name]}.{k}": v for k, v in states.items()})
                expert_writer = _expert_data_parallel_rank(p) == 0
            else:
                tensors.update({f"{name}.{k}": v for k, v in states.items()})
        for path, held, writes in ((layer_file(ckpt, idx, tp_rank), tensors, writer),
                                   (layer_file(ckpt, idx, tp_rank, ep_rank), expert_tensors, expert_writer)):
            if writes and held:
                torch.save(held, path)
                written.append(path)
                after_each(path)
    if writer and (not pipelined or _first_stage(engine)) and tp_rank == 0:
        meta = {"step": step, **engine_counters(engine)}
        (Path(ckpt) / META).write_text(json.dumps(meta, indent=1))
    return written


def _first_stage(engine) -> bool:
    return engine.is_first_stage() if hasattr(engine, "is_first_stage") else True


def read_meta(ckpt: Path) -> dict:
    path = Path(ckpt) / META
    if not path.is_file():
        raise FullStateError(f"{path} is missing: this checkpoint holds no full states (written before they were "
                             f"saved); resume on the layout that wrote it")
    return json.loads(path.read_text())


def load(engine, ckpt: Path, *, pipelined: bool, tp_rank: int) -> dict:
    """Set this rank's parameters, masters and moments from the full states; returns the saved counters."""
    meta = read_meta(ckpt)
    masters = _Masters(engine)
    if meta.get("wrapper") and meta["wrapper"] != type(engine.optimizer).__name__:
        raise FullStateError(f"{ckpt} was written through DeepSpeed's {meta['wrapper']}, this run builds "
                             f"{type(engine.optimizer).__name__}: their step counts differ; resume with the same "
                             f"precision and ZeRO stage")
    if meta["step"] is not None:
        masters.create_states(meta["step"])
    for idx, layer in model_layers(engine.module, pipelined=pipelined):
        for name, (p, where, saved) in read_layer(ckpt, idx, tp_rank, layer).items():
            masters.set(p, saved, where)
    _set_counters(engine, meta)
    return meta


def read_layer(ckpt: Path, idx: int, tp_rank: int, layer: nn.Module) -> dict:
    """{name: (parameter, "FILE: saved name", {"fp32": ..., "exp_avg": ..., "exp_avg_sq": ...})} of this rank's
    layer ``idx``: dense parameters from the layer's file, experts split over EP ranks from their EP rank's."""
    from .safe_load import safe_load

    experts, ep_rank = _experts(layer)
    files = {False: layer_file(ckpt, idx, tp_rank)}
    if experts:
        files[True] = layer_file(ckpt, idx, tp_rank, ep_rank)
    tensors = {}
    for is_expert, path in files.items():
        if not path.is_file():
            raise FullStateError(f"{path} is missing: the checkpoint has no full states of layer {idx} (tp rank "
                                 f"{tp_rank}{f', ep rank {ep_rank}' if is_expert else ''}); resume with the "
                                 f"tensor- and expert-parallel degrees that wrote it")
        tensors[is_expert] = (path, safe_load(path, map_location="cpu", mmap=True))
    out = {}
    for name, p in layer.named_parameters():
        path, saved = tensors[name in experts]
        key = experts.get(name, name)
        if f"{key}.fp32" not in saved:
            raise FullStateError(f"{path} has no parameter {key}: it was written by another model")
        out[name] = (p, f"{path}: {key}", {k: saved[f"{key}.{k}"] for k in ("fp32", *MOMENTS) if f"{key}.{k}" in saved})
    return out


def _set_counters(engine, meta: dict) -> None:
    engine.global_steps, engine.global_samples = meta["global_steps"], meta["global_samples"]
    if hasattr(engine, "skipped_steps"):
        engine.skipped_steps = meta["skipped_steps"]
    sched = getattr(engine, "lr_scheduler", None)
    if sched is not None and "lr_scheduler" in meta:
        sched.load_state_dict(meta["lr_scheduler"])
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    for k, v in meta.get("loss_scaler", {}).items():
        if scaler is not None and hasattr(scaler, k):
            setattr(scaler, k, v)
