"""Checkpoints that lose nothing: per-step tags, committed by a manifest, then the ``latest`` pointer.

Saving step N (every rank calls ``save``):

1. every rank writes its files into ``DIR/global_stepN/``: DeepSpeed's own (weights; ZeRO's
   partitioned optimizer state), ours (per-layer optimizer state of a pipeline, this
   rank's RNG state);
2. a barrier: no rank goes on until every rank has written every file;
3. rank 0 lists the files with their sizes in ``manifest.json`` (written atomically),
   then moves DeepSpeed's ``latest`` pointer to the tag (atomically), then deletes all
   but the newest ``keep_last`` complete checkpoints.

A run killed at any point before (3) leaves ``latest`` on the previous complete
checkpoint.  ``resolve`` refuses a tag without a manifest, or whose files are missing
or shorter than the manifest says, naming the file; rank 0 checks and every rank
receives the same verdict.

Fault injection, for tests: ``DS_PIPE_EXT_FAULT_SAVE=RANK:FILES[:STEP]`` makes rank RANK exit
abruptly during the save of step STEP (default: any) once it has written FILES of its own
files (0: right after DeepSpeed's), so a crash mid-save is deterministic.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..layout import Layout
from ..pipe.checkpoint import load_layer_optimizer_states, save_layer_optimizer_states
from ..pipe.decide import decide_and_broadcast

MANIFEST, LATEST = "manifest.json", "latest"
FAULT_ENV = "DS_PIPE_EXT_FAULT_SAVE"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names the file."""


def repartitionable(layout: Layout, *, experts: bool = False) -> bool:
    """Per-layer files (a pipeline without ZeRO): weights and optimizer state load under any partition.
    Not with DeepSpeed MoE layers: it writes expert files keyed by the stage-local MoE index and EP rank."""
    return layout.pipelined and layout.zero == 0 and not experts


def _depends_on(layout: Layout, parts: list[int] | None) -> dict:
    """What a checkpoint's files depend on; a resume under another layout is refused where it matters."""
    return {"pipelined": layout.pipelined, "zero": layout.zero, "world_size": layout.world_size, "parts": parts,
            "ep": layout.ep}


def _saved_depends_on(manifest: dict) -> dict:
    saved = manifest["layout"]
    if "zero_stage" in saved:  # a manifest written before the layout record: its four fields
        return {"pipelined": saved["pipelined"], "zero": saved["zero_stage"], "world_size": saved["world_size"],
                "parts": saved["parts"], "ep": 1}
    return _depends_on(Layout.from_dict(saved), manifest.get("parts"))


def tag_for(step: int) -> str:
    return f"global_step{step}"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


class _FaultInjector:
    def __init__(self, rank: int, step: int):
        spec = os.environ.get(FAULT_ENV, "")
        target, files, at_step = ([*spec.split(":"), "", ""])[:3] if spec else ("", "", "")
        self.armed = bool(spec) and int(target) == rank and (not at_step or int(at_step) == step)
        self.files = int(files or 0)
        self.written = 0

    def check(self) -> None:
        if self.armed and self.written >= self.files:
            print(f"{FAULT_ENV}: rank exits during the save after {self.written} of its files", flush=True)
            os._exit(17)

    def wrote(self, _path=None) -> None:
        self.written += 1
        self.check()


def rng_state() -> dict:
    """Every generator a step draws from: dropout on a GPU draws from this rank's CUDA generator."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's: this rank's GPU
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def write_rng(path: Path, state: dict) -> None:
    """``state`` as tensors (PATH, loadable with ``weights_only=True``) and numbers (PATH.json): nothing a load
    unpickles but tensors.  numpy's and Python's Mersenne Twister keys are int64 tensors (uint32 words)."""
    name, keys, pos, has_gauss, cached = state["numpy"]
    version, internal, gauss_next = state["python"]
    tensors = {"torch": state["torch"], "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
               "python_internal": torch.tensor(internal, dtype=torch.int64, device="cpu")}
    if "cuda" in state:
        tensors["cuda"] = state["cuda"].cpu()
    torch.save(tensors, path)
    meta = {"numpy": [name, int(pos), int(has_gauss), float(cached)], "python": [version, gauss_next]}
    Path(f"{path}.json").write_text(json.dumps(meta))


def read_rng(path: Path) -> dict:
    """What ``write_rng`` wrote, read without unpickling anything but tensors; RNG states are CPU byte tensors
    whatever device saved them (torch and torch.cuda take them so)."""
    meta_path = Path(f"{path}.json")
    if not meta_path.is_file():
        raise CheckpointError(f"{meta_path} is missing: {path} is an RNG file of an older checkpoint (a pickle, which "
                              f"is not loaded); resume from a checkpoint this version wrote")
    tensors = torch.load(path, map_location="cpu", weights_only=True)
    meta = json.loads(meta_path.read_text())
    name, pos, has_gauss, cached = meta["numpy"]
    version, gauss_next = meta["python"]
    state = {"torch": tensors["torch"],
             "numpy": (name, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached),
             "python": (version, tuple(int(x) for x in tensors["python_internal"].tolist()), gauss_next)}
    if "cuda" in tensors:
        state["cuda"] = tensors["cuda"]
    return state


def vocabulary_of(model_cfg) -> dict | None:
    """What a checkpoint's embedding and head rows depend on: the vocabulary and its padding (None for a model
    that pads nothing: a Hugging Face checkpoint's own rows)."""
    if not hasattr(model_cfg, "vocab_pad_to"):
        return None
    return {"vocab_size": int(model_cfg.vocab_size), "padded_vocab": int(model_cfg.padded_vocab),
            "vocab_pad_to": int(model_cfg.vocab_pad_to)}


def save(engine, save_dir: str | Path, *, step: int, layout: Layout, parts: list[int] | None, keep_last: int,
         client_state: dict, experts: bool = False, vocabulary: dict | None = None) -> Path:
    rank = dist.get_rank()
    tag, root = tag_for(step), Path(save_dir)
    ckpt = root / tag
    engine.save_checkpoint(str(root), tag=tag, client_state={**client_state, "step": step}, save_latest=False)
    fault = _FaultInjector(rank, step)
    fault.check()
    if repartitionable(layout, experts=experts):
        save_layer_optimizer_states(engine, ckpt, after_each=fault.wrote)
    write_rng(ckpt / f"rng_rank{rank:03d}.pt", rng_state())
    fault.wrote()
    dist.barrier()  # every rank has written every file
    if rank == 0:
        files = {str(p.relative_to(ckpt)): p.stat().st_size for p in sorted(ckpt.rglob("*")) if p.is_file()
                 and p.name != MANIFEST}
        manifest = {"step": step, "tag": tag, "layout": layout.to_dict(), "parts": parts, "experts": experts,
                    "vocabulary": vocabulary, "files": files}
        _atomic_write(ckpt / MANIFEST, json.dumps(manifest, indent=1))
        _atomic_write(root / LATEST, tag)
        _prune(root, keep_last=keep_last, newest=step)
    dist.barrier()
    return ckpt


def _prune(root: Path, *, keep_last: int, newest: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints; drop older incomplete ones too."""
    steps = sorted(int(p.name.removeprefix("global_step")) for p in root.glob("global_step*") if p.is_dir())
    complete = [s for s in steps if (root / tag_for(s) / MANIFEST).is_file()]
    keep = set(complete[-keep_last:])
    for s in steps:
        if s not in keep and s < newest:
            shutil.rmtree(root / tag_for(s), ignore_errors=True)


def verify(load_dir: str | Path) -> dict:
    """The manifest of ``latest``'s checkpoint, after checking every file it lists."""
    root = Path(load_dir)
    latest = root / LATEST
    if not latest.is_file():
        raise CheckpointError(f"{latest} is missing: {root} holds no complete checkpoint (save with --save first)")
    ckpt = root / latest.read_text().strip()
    manifest_path = ckpt / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path} is missing: the checkpoint {ckpt} is incomplete")
    manifest = json.loads(manifest_path.read_text())
    for name, size in manifest["files"].items():
        path = ckpt / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: the checkpoint {ckpt} cannot be resumed")
        if path.stat().st_size != size:
            raise CheckpointError(f"{path} is truncated ({path.stat().st_size} of {size} bytes): "
                                  f"the checkpoint {ckpt} cannot be resumed")
    return manifest


def _check_layout(manifest: dict, layout: Layout, parts: list[int] | None, ckpt: Path, *, experts: bool) -> None:
    saved, ours = _saved_depends_on(manifest), _depends_on(layout, parts)
    if repartitionable(layout, experts=experts) and saved["pipelined"] and saved["zero"] == 0:
        return  # per-layer files: any partition, any data-parallel degree
    why = ("DeepSpeed writes each MoE layer's experts to files keyed by the stage-local MoE index and the EP "
           "rank" if experts else "its optimizer state only fits the layout that wrote it")
    for key in ("pipelined", "zero", "world_size", "parts", "ep"):
        if saved[key] != ours[key]:
            raise CheckpointError(f"{ckpt} was written with {key} = {saved[key]}, this run has {ours[key]}: "
                                  f"{why}; resume with the same {key}")


def check_vocabulary(manifest: dict, vocabulary: dict | None, ckpt: Path) -> None:
    """A checkpoint's embedding and head hold ``padded_vocab`` rows: a run that pads the vocabulary otherwise
    cannot load them.  A manifest from before the record says nothing and is not checked."""
    saved = manifest.get("vocabulary")
    if not saved or not vocabulary:
        return
    for key in ("vocab_size", "padded_vocab"):
        if saved[key] != vocabulary[key]:
            raise CheckpointError(
                f"{ckpt} was written with {key} = {saved[key]} (vocab_pad_to = {saved['vocab_pad_to']}), this run "
                f"has {vocabulary[key]} (vocab_pad_to = {vocabulary['vocab_pad_to']}): its embedding and head rows "
                f"differ; resume with the model config's vocab_pad_to = {saved['vocab_pad_to']}")


def load(engine, load_dir: str | Path, *, layout: Layout, parts: list[int] | None, experts: bool = False,
         vocabulary: dict | None = None) -> dict:
    """Resume from ``latest``: weights, optimizer state, this rank's RNG; returns the client state (``step``).
    ``experts``: the model has DeepSpeed MoE layers; ``vocabulary``: this run's (``vocabulary_of``), refused
    where the checkpoint's differs."""
    manifest = decide_and_broadcast(lambda: verify(load_dir), what=f"--load {load_dir}")
    ckpt = Path(load_dir) / manifest["tag"]
    decide_and_broadcast(lambda: _check_layout(manifest, layout, parts, ckpt, experts=experts),
                         what=f"--load {load_dir}")
    decide_and_broadcast(lambda: check_vocabulary(manifest, vocabulary, ckpt), what=f"--load {load_dir}")
    _, client_state = engine.load_checkpoint(str(load_dir), tag=manifest["tag"],
                                             load_module_only=repartitionable(layout, experts=experts))
    if repartitionable(layout, experts=experts):
        load_layer_optimizer_states(engine, ckpt)
    rng = ckpt / f"rng_rank{dist.get_rank():03d}.pt"
    if rng.is_file():  # absent when resuming on more ranks than wrote the checkpoint
        restore_rng(read_rng(rng))
    return client_state or {"step": manifest["step"]}
