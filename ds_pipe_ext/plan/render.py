"""The plan as users read it: an aligned table, JSON, Megatron's layout string and a ds.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from itertools import groupby

from .model import LayoutCost
from .search import PlanResult

GIB = 2**30


def short_parts(parts: list[int]) -> str:
    return ",".join(map(str, parts)) if len(parts) <= 12 else f"{','.join(map(str, parts[:5]))},...,{parts[-1]}"


def render_table(res: PlanResult, *, memory_cap: float) -> str:
    head = ["#", "layout", "pp", "tp", "dp", "zero", "mb", "m", "recompute", "sp", "schedule", "parts",
            "GiB/rank", "step s", "samples/s", "MFU"]
    rows = []
    for i, c in enumerate(res.top, 1):
        lay = c.layout
        rows.append([str(i), lay.name + ("" if lay.runnable else " (sim)"), str(lay.pp), str(lay.tp), str(lay.dp),
                     str(lay.zero), str(lay.micro_batch), str(lay.micro_batches), lay.recompute,
                     "on" if lay.sp else "off", lay.schedule, short_parts(c.parts),
                     f"{c.peak_memory_bytes / GIB:.1f}" + (" (over)" if c.peak_memory_bytes > memory_cap else ""),
                     f"{c.step_s:.3f}", f"{c.samples_per_s:.2f}", f"{100 * c.mfu:.1f}%"])
    numeric = {0, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15}
    if any(c.layout.ep > 1 for c in res.top):  # a Mixture-of-Experts model: its expert-parallel degree after dp
        head.insert(5, "ep")
        for row, c in zip(rows, res.top):
            row.insert(5, str(c.layout.ep))
        numeric = {k + (k >= 5) for k in numeric} | {5}
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
    fmt = lambda r: "  ".join(v.rjust(w) if k in numeric else v.ljust(w)  # noqa: E731
                              for k, (v, w) in enumerate(zip(r, widths)))
    lines = [fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)]
    lines.append(f"{res.candidates} layouts: {res.partitioned} partitioned, {res.simulated} simulated; "
                 f"memory cap {memory_cap / GIB:.1f} GiB per rank; (sim): a schedule DeepSpeed does not run, "
                 f"simulated only")
    for c in res.top:
        lines += [f"  {c.layout.name}: {note}" for note in c.notes]
    for reason, n in sorted(res.dropped.items(), key=lambda kv: -kv[1]):
        lines.append(f"  dropped {n:6d}: {reason}")
    return "\n".join(lines)


def rows_json(res: PlanResult) -> str:
    return json.dumps([c.to_dict() for c in res.top], indent=1)


def megatron_layout(cost: LayoutCost, num_layers: int, checker=None, mtp_layers: int = 0) -> tuple[str | None, str]:
    """Megatron's ``pipeline_model_parallel_layout`` for the split (E: embedding, t: a transformer
    layer, m: a multi-token-prediction layer, the last ``mtp_layers`` blocks, L: the loss with the output layer),
    checked with megatron-core's parser; or why not."""
    lay, parts = cost.layout, cost.parts
    if lay.pp == 1:
        return None, "no pipeline: Megatron needs no layout"
    if lay.schedule == "dualpipev":
        return None, "DualPipeV places chunks in a V (rank r holds chunks r and 2p-1-r): Megatron's layout cannot say it"
    stages = []
    last = parts[-1] - 1
    first_mtp = last - mtp_layers
    for i, j in zip(parts, parts[1:]):
        blocks = sum(1 for k in range(i, j) if 0 < k < first_mtp)
        mtp = sum(1 for k in range(i, j) if first_mtp <= k < last)
        stages.append(("E" if i == 0 else "") + (f"t*{blocks}" if blocks > 1 else "t" * blocks) + "m" * mtp
                      + ("L" if j - 1 == last else ""))
    runs = [(s, len(list(g))) for s, g in groupby(stages)]
    pieces = []
    for k, (s, n) in enumerate(runs):
        last_run = k == len(runs) - 1
        if n == 1:
            pieces.append(s + ("" if last_run else "|"))
        else:  # "(s|)*n" ends in a separator: the last run repeats n - 1 times and ends with s itself
            pieces.append(f"({s}|)*{n - 1}{s}" if last_run else f"({s}|)*{n}")
    text = "".join(pieces)
    verdict = (checker or check_in_process)(text, lay.pp, num_layers, mtp_layers)
    if verdict.get("missing"):
        return text, f"not checked: {verdict['missing']}"
    if "error" in verdict:
        return None, f"megatron-core rejects {text!r}: {verdict['error']}"
    return text, "checked with megatron-core's PipelineParallelLayerLayout"


def megatron_hybrid_split(cost: LayoutCost) -> tuple[str | None, str]:
    """What Megatron-core 0.16 can run of the split for a hybrid model (``MambaModel``): the pattern's layers
    split evenly, or with ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` and the
    stages between even; no interleaving.  (The arguments, or None, and why.)"""
    lay, parts = cost.layout, cost.parts
    if lay.pp == 1:
        return None, "no pipeline: Megatron needs no split"
    if lay.schedule not in (None, "1f1b", "gpipe"):
        return None, (f"the pick runs {lay.schedule}; Megatron-core runs hybrid models without interleaving "
                      f"(their split needs more than it expresses)")
    last = parts[-1] - 1
    blocks = [sum(1 for k in range(i, j) if 0 < k < last) for i, j in zip(parts, parts[1:])]
    if len(set(blocks)) == 1:
        return "an even split", f"{blocks[0]} layers a stage"
    middle = blocks[1:-1]
    if len(set(middle)) <= 1 and (not middle or middle[0] > 0):
        args = []
        if not middle or blocks[0] != middle[0]:
            args.append(f"--decoder-first-pipeline-num-layers {blocks[0]}")
        if not middle or blocks[-1] != middle[0]:
            args.append(f"--decoder-last-pipeline-num-layers {blocks[-1]}")
        return " ".join(args), f"layers a stage {blocks}"
    return None, (f"layers a stage {blocks}: the stages between the first and the last differ, which Megatron-core "
                  f"cannot express for a hybrid model (an even split, or the first and last stage sizes only)")


_CHECK = """
import json, os, sys
try:  # import megatron-core first, while the parent searches; check_in_process then finds it loaded
    import megatron.core.transformer.pipeline_parallel_layer_layout
except ImportError:
    pass  # check_in_process says so
from ds_pipe_ext.plan.render import check_in_process
for line in sys.stdin:
    print(json.dumps(check_in_process(*json.loads(line))), flush=True)
os._exit(0)  # no interpreter teardown: with torch and megatron loaded it takes seconds the parent waits for
"""


def check_in_process(text: str, pp: int, num_layers: int, mtp_layers: int = 0) -> dict:
    """megatron-core's verdict on a layout string: {} (valid), {"error": why} or {"missing": why}."""
    try:
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    except ImportError as e:
        return {"missing": f"megatron-core not importable ({e})"}
    try:
        PipelineParallelLayerLayout(text, pp).validate_layer_layout(num_layers, mtp_num_layers=mtp_layers)
    except (AssertionError, ValueError) as e:
        return {"error": str(e)}
    return {}


class MegatronLayoutChecker:
    """``check_in_process`` in a child interpreter started before the search: importing megatron-core
    takes ~4 s (it pulls in torch.distributed and its TP layers), which then runs on another core
    instead of after the search (the 175B plan stays under 10 s)."""

    def __init__(self):
        root = str(Path(__file__).resolve().parents[2])  # this package, installed or not
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-c", _CHECK], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env)

    def __call__(self, text: str, pp: int, num_layers: int, mtp_layers: int = 0) -> dict:
        try:
            self.proc.stdin.write(json.dumps([text, pp, num_layers, mtp_layers]) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            return json.loads(line) if line else {"missing": f"the checker exited ({self.proc.poll()})"}
        except (OSError, ValueError) as e:
            return {"missing": f"the checker failed ({e})"}

    def close(self) -> None:
        # every answer has been read (calls are synchronous) and the child writes nothing: stop it at once
        # rather than let a plan that ended early (bad input, a small search) wait out megatron-core's import
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


def ds_config(cost: LayoutCost, *, model: str, steps: int = 10, dtype: str = "bf16",
              zero_settings: dict | None = None, compile: bool = False) -> dict:
    """The ds.json that trains this layout with train.py (its split as ``"parts:..."``, ZeRO's buckets as
    the plan priced them: ``PlanModel.zero_settings``)."""
    lay = cost.layout
    if not lay.runnable:
        raise ValueError(f"{lay.name}: DeepSpeed runs no {lay.schedule} schedule; emit a runnable layout")
    # bf16 without DeepSpeed's per-tensor overflow check, as the plan priced it (PlanModel.check_grad_overflow)
    precision = {"bf16": {"bf16": {"enabled": True, "check_grad_overflow": False}},
                 "fp16": {"fp16": {"enabled": True}}}.get(dtype, {})
    train = {"model": model, "steps": steps, "seed": 1234}
    if compile:  # priced compiled: the run compiles its layers too
        train["compile"] = True
    modes = getattr(cost, "layer_recompute", None)
    if modes is not None:  # chosen with the split: train.py builds them, no second decision
        train["recompute"] = modes
    return lay.ds_config(train=train, steps_per_print=10**6, zero_settings=zero_settings, **precision,
                         pipeline={"partition_method": "parts:" + ",".join(map(str, cost.parts))}
                         if lay.pipelined else None)
