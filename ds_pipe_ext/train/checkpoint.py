"""Checkpoints that lose nothing: per-step tags, committed by a manifest, then the ``latest`` pointer.

Saving step N (every rank calls ``save``):

1. every rank writes its files into ``DIR/global_stepN/``: DeepSpeed's own (weights; ZeRO's
   partitioned optimizer state), ours (every layer's full fp32 masters and Adam moments,
   ``full_states``; this rank's RNG state);
2. a barrier: no rank goes on until every rank has written every file;
3. rank 0 lists the files with their sizes in ``manifest.json`` (written atomically),
   then moves DeepSpeed's ``latest`` pointer to the tag (atomically), then deletes all
   but the newest ``keep_last`` complete checkpoints.

A run killed at any point before (3) leaves ``latest`` on the previous complete
checkpoint.

Resuming: on the layout that wrote it, DeepSpeed loads its own files (bit-identical).  On
another data-parallel size or pipeline split, every rank sets its parameters, masters and
moments from the full states (``full_states.load``): what moves and what is refused is
``check_move``'s table, docs/CONFIG.md.  Either way nothing is unpickled but tensors and
DeepSpeed's own records (``safe_load``).  ``resolve`` refuses a tag without a manifest, or whose files are missing
or shorter than the manifest says, naming the file; rank 0 checks and every rank
receives the same verdict.

Fault injection, for tests: ``DS_PIPE_EXT_FAULT_SAVE=RANK:FILES[:STEP[:hang]]`` makes rank RANK exit
abruptly during the save of step STEP (default: any) once it has written FILES of its own
files (0: right after DeepSpeed's), so a crash mid-save is deterministic; with ``hang`` it
stops there instead, for a test to kill its node's launch from outside.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..compat.engine import parallel_ranks
from ..layout import Layout
from ..pipe.decide import decide_and_broadcast, run_everywhere
from . import full_states
from .safe_load import check_files, guard, safe_load

MANIFEST, LATEST = "manifest.json", "latest"
FAULT_ENV = "DS_PIPE_EXT_FAULT_SAVE"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names the file."""


def _depends_on(layout: Layout, parts: list[int] | None) -> dict:
    """What DeepSpeed's own files depend on: a resume where any of it differs moves the full states instead."""
    return {"pipelined": layout.pipelined, "zero": layout.zero, "world_size": layout.world_size, "parts": parts,
            "ep": layout.ep}


def _saved_depends_on(manifest: dict) -> dict:
    saved = manifest["layout"]
    if "zero_stage" in saved:  # a manifest written before the layout record: its four fields
        return {"pipelined": saved["pipelined"], "zero": saved["zero_stage"], "world_size": saved["world_size"],
                "parts": saved["parts"], "ep": 1}
    return _depends_on(Layout.from_dict(saved), manifest.get("parts"))


# What a move onto another layout keeps fixed: (key, why).  Everything else may change: the data-parallel
# size, the number of stages and the split, the ZeRO stage within one DeepSpeed optimizer wrapper.
FIXED_IN_A_MOVE = (
    ("tp", "each tensor-parallel rank's full states hold its shard of every parameter"),
    ("ep", "each expert-parallel rank holds its own experts"),
    ("pipelined", "a pipeline's and the sequential model's layers are built apart"),
)


def tag_for(step: int) -> str:
    return f"global_step{step}"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


class _FaultInjector:
    def __init__(self, rank: int, step: int):
        spec = os.environ.get(FAULT_ENV, "")
        target, files, at_step, mode = ([*spec.split(":"), "", "", ""])[:4] if spec else ("", "", "", "")
        self.armed = bool(spec) and int(target) == rank and (not at_step or int(at_step) == step)
        self.files, self.hang = int(files or 0), mode == "hang"
        self.written = 0

    def check(self) -> None:
        if self.armed and self.written >= self.files:
            if self.hang:
                print(f"{FAULT_ENV}: rank hangs during the save after {self.written} of its files", flush=True)
                while True:
                    time.sleep(60)
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


def read_rng(path: Path, *, trust: bool = False) -> dict:
    """What ``write_rng`` wrote, read without unpickling anything but tensors; RNG states are CPU byte tensors
    whatever device saved them (torch and torch.cuda take them so)."""
    meta_path = Path(f"{path}.json")
    if not meta_path.is_file():
        raise CheckpointError(f"{meta_path} is missing: {path} is an RNG file of an older checkpoint (a pickle, which "
                              f"is not loaded); resume from a checkpoint this version wrote")
    tensors = safe_load(path, map_location="cpu", trust=trust)
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
    dp_rank, tp_rank = parallel_ranks(engine.module, layout)
    full_states.save(engine, ckpt, pipelined=layout.pipelined, writer=dp_rank == 0, tp_rank=tp_rank,
                     after_each=fault.wrote)
    write_rng(ckpt / f"rng_rank{rank:03d}.pt", rng_state())
    fault.wrote()
    dist.barrier()  # every rank has written every file
    if rank == 0:
        files = {str(p.relative_to(ckpt)): p.stat().st_size for p in sorted(ckpt.rglob("*")) if p.is_file()
                 and p.name != MANIFEST}
        manifest = {"step": step, "tag": tag, "layout": layout.to_dict(), "parts": parts, "experts": experts,
                    "vocabulary": vocabulary, "full_states": True, "files": files}
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


def check_move(manifest: dict, layout: Layout, ckpt: Path) -> None:
    """A checkpoint resumed on another layout: what must stay as it was (``FIXED_IN_A_MOVE``)."""
    if not manifest.get("full_states"):
        raise CheckpointError(f"{ckpt} holds no full states (written before they were saved), and DeepSpeed's own "
                              f"files only fit the layout that wrote them: resume with its layout, "
                              f"{_layout_words(manifest['layout'])}")
    saved = _saved_layout(manifest)
    for key, why in FIXED_IN_A_MOVE:
        if saved[key] != getattr(layout, key):
            raise CheckpointError(f"{ckpt} was written with {key} = {saved[key]}, this run has "
                                  f"{getattr(layout, key)}: {why}; resume with {key} = {saved[key]} (it can "
                                  f"change the data-parallel size and the pipeline split)")


def _saved_layout(manifest: dict) -> dict:
    saved = Layout.from_dict(manifest["layout"])
    return {key: getattr(saved, key) for key, _ in FIXED_IN_A_MOVE}


def _layout_words(saved: dict) -> str:
    return (f"pp {saved.get('pp', '?')} x tp {saved.get('tp', 1)} x dp {saved.get('dp', '?')}, "
            f"zero {saved.get('zero', saved.get('zero_stage'))}")


def _move_words(manifest: dict, layout: Layout, parts: list[int] | None, method: str | None) -> str:
    saved = manifest["layout"]
    before = saved.get("micro_batch", 0) * saved.get("micro_batches", 0) * saved.get("dp", 0)
    after = layout.micro_batch * layout.micro_batches * layout.dp
    split = f", split {parts} by partition_method {method!r} for the ranks this run has" if parts else ""
    batch = (f"; the global batch stays {after} samples" if before == after else
             f"; the global batch changes from {before} to {after} samples a step")
    return (f"written by {_layout_words(saved)} (parts {manifest.get('parts')}), resumed on "
            f"{_layout_words(layout.to_dict())}{split}: weights, fp32 masters and Adam moments set from its "
            f"full states{batch}")


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


def check(load_dir: str | Path, *, vocabulary: dict | None = None, trust: bool = False) -> dict:
    """``latest``'s manifest, once its files are complete, its vocabulary this run's, and no file needs an unsafe
    global (rank 0 reads, every rank gets the verdict): before any model is built."""
    def checked() -> dict:
        manifest = verify(load_dir)
        ckpt = Path(load_dir) / manifest["tag"]
        check_vocabulary(manifest, vocabulary, ckpt)
        if not trust:
            check_files(ckpt / name for name in manifest["files"] if not name.endswith(".json"))
        return manifest

    return decide_and_broadcast(checked, what=f"--load {load_dir}")


def load(engine, load_dir: str | Path, manifest: dict, *, layout: Layout, parts: list[int] | None,
         trust: bool = False, method: str | None = None) -> dict:
    """Resume from ``manifest``'s checkpoint (``check``'s): weights, optimizer state, this rank's RNG; returns the
    client state (``step``).  On the layout that wrote it through DeepSpeed's own files, else through the full
    states (``check_move``); ``trust``: unpickle whatever the files hold (``safe_load``)."""
    ckpt = Path(load_dir) / manifest["tag"]
    moved = _saved_depends_on(manifest) != _depends_on(layout, parts)
    guard(engine, trust=trust)
    if moved:
        decide_and_broadcast(lambda: check_move(manifest, layout, ckpt), what=f"--load {load_dir}")
        if dist.get_rank() == 0:
            print(f"ds_pipe_ext: --load {load_dir}: {_move_words(manifest, layout, parts, method)}", flush=True)
        _, tp_rank = parallel_ranks(engine.module, layout)
        run_everywhere(lambda: full_states.load(engine, ckpt, pipelined=layout.pipelined, tp_rank=tp_rank),
                       what=f"--load {load_dir} (full states)")
        client_state = None
    else:
        _, client_state = engine.load_checkpoint(str(load_dir), tag=manifest["tag"])
    rng = ckpt / f"rng_rank{dist.get_rank():03d}.pt"
    if rng.is_file():  # absent when resuming on more ranks than wrote the checkpoint
        restore_rng(read_rng(rng, trust=trust))
    return client_state or {"step": manifest["step"]}
