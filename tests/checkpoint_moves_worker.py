"""Rank worker of tests/test_checkpoint_moves.py: every checkpoint kind train.py writes, several in a launch.

    deepspeed --num_gpus 4 tests/checkpoint_moves_worker.py --root DIR --case PHASE:NAME=DS.json ...

Each ``--case`` in turn, in one of three phases, with its ds.json:

* ``save``: train 2 steps and save to ROOT/NAME; rank 0 lists each file's globals beyond tensors
  (``torch.serialization.get_unsafe_globals_in_checkpoint``);
* ``move``: resume ROOT/NAME (on however many ranks this launch has) and compare this rank's parameters, fp32
  masters and Adam moments, gathered again through DeepSpeed, with the full states the save wrote, to the
  element; then save what was loaded to ROOT/NAME-moved;
* ``crafted``: resume ROOT/NAME, expecting the refusal (the test put a crafted file there).

Rank 0 writes --metrics-out: {case: {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from models_in_turn import fresh_build  # noqa: E402


def allow_fp16_on_this_cpu() -> None:
    """DeepSpeed refuses fp16 on a CPU without mkldnn's fp16 kernels; torch's CPU matmuls run it anyway, slowly,
    which is all a checkpoint of fp16's dynamic loss scaler needs here."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        type(get_accelerator()).is_fp16_supported = lambda self: True


def build(ds: str, args: list[str]):
    return fresh_build(["--deepspeed_config", ds, *args])


def globals_of(ckpt: Path) -> dict:
    found = {}
    for path in sorted(ckpt.glob("*.pt")):
        found[path.name] = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    return found


def compare(built, ckpt: Path) -> dict:
    """This rank's layers against the saved full states: what differs, and how many tensors were checked."""
    from ds_pipe_ext.train import full_states

    layout, engine = built.layout, built.engine
    masters = full_states._Masters(engine)
    from ds_pipe_ext.compat.engine import parallel_ranks

    _, tp_rank = parallel_ranks(engine.module, layout)
    differ, checked = [], 0
    for idx, layer in full_states.model_layers(engine.module, pipelined=layout.pipelined):
        for name, (p, where, saved) in full_states.read_layer(ckpt, idx, tp_rank, layer).items():
            for key, value in masters.get(p).items():
                checked += 1
                if not torch.equal(value, saved[key]):
                    differ.append(f"{where}.{key}")
            weight = full_states._frozen_weight(p)  # the model's copy (gathered under ZeRO-3)
            if not torch.equal(weight, saved["fp32"].to(p.dtype).float()):
                differ.append(f"{where} (model weight)")
            checked += 1
    return {"differ": differ, "checked": checked}


def loss_scale(engine) -> float | None:
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    return None if scaler is None else float(scaler.cur_scale)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--case", action="append", required=True)
    ap.add_argument("--metrics-out", required=True)
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = ap.parse_args()

    from ds_pipe_ext.pipe.decide import DecisionError
    from ds_pipe_ext.train import checkpoint
    from ds_pipe_ext.train.trainer import Trainer

    allow_fp16_on_this_cpu()
    root, results = Path(args.root), {}
    for case in args.case:
        phase, case = case.split(":", 1)
        name, ds = case.split("=", 1)
        if phase == "save":
            built = build(ds, ["--steps", "2", "--save", str(root / name)])
            summary = Trainer(built).run()
            results[name] = {"losses": summary["losses"], "wrapper": type(built.engine.optimizer).__name__,
                             "loss_scale": loss_scale(built.engine),
                             "globals": globals_of(root / name / "global_step2") if built.rank == 0 else None}
        elif phase == "move":
            built = build(ds, ["--load", str(root / name)])
            ckpt = root / name / checkpoint.tag_for(built.start_step)
            mine = compare(built, ckpt)
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            checkpoint.save(built.engine, root / f"{name}-moved", step=built.start_step, layout=built.layout,
                            parts=built.parts, keep_last=1, client_state={})
            results[name] = {"differ": [d for r in everyone for d in r["differ"]],
                             "checked": sum(r["checked"] for r in everyone), "parts": built.parts,
                             "dp": built.layout.dp, "start_step": built.start_step,
                             "wrapper": type(built.engine.optimizer).__name__, "loss_scale": loss_scale(built.engine)}
        else:
            built = None
            try:
                build(ds, ["--load", str(root / name)])
                results[name] = {"error": None}
            except DecisionError as e:
                results[name] = {"error": str(e)}
        del built
    out = Path(args.metrics_out)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
