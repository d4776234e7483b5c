"""The plans whose picks the cluster's network decides: `ds-pipe-ext plan` on the layouts issue 76 lists.

Each row runs the CLI's own route (``cli.plan.build_model`` and its search) on one question, and prints
the pick, its step, MFU and where the step goes (``plan.shares``), and the best layout DeepSpeed runs.
Simulated only (analytic costs on the named GPU's spec; nothing here was measured), so it calibrates
nothing and checks nothing: it records what the planner answers, before and after a change to its network.

    python bench/network_picks.py [--json OUT.json] [--quick] [--smoke]

The last line: ``RESULT key=value ...`` with each question's pick and step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_pipe_ext.runner import SMOKE_HELP  # noqa: E402

# (key, plan arguments): issue 76's list
QUESTIONS = [
    ("llama3-8b_8xh100_gb256", "--model llama3-8b --gpus 8 --device h100 --global-batch 256"),
    ("llama3-8b_64xh100_gb256", "--model llama3-8b --gpus 64 --device h100 --global-batch 256"),
    ("llama3-8b_64xh100_gb1024", "--model llama3-8b --gpus 64 --device h100 --global-batch 1024"),
    ("llama3-8b_512xh100_gb1024", "--model llama3-8b --gpus 512 --device h100 --global-batch 1024"),
    ("llama3-70b_64xh100_gb256", "--model llama3-70b --gpus 64 --device h100 --global-batch 256"),
    ("llama3-70b_512xh100_gb1024", "--model llama3-70b --gpus 512 --device h100 --global-batch 1024"),
    ("gpt3-175b_1024xa100_gb1536", "--model gpt3-175b --gpus 1024 --device a100 --global-batch 1536"),
]
# the user's comparison: DeepSpeed ZeRO-3 data parallel against the best pipeline, 2 to 16 H100 nodes
ZERO3_VS_PIPE = [(nodes, f"--model llama3-8b --gpus {8 * nodes} --device h100 --global-batch {32 * nodes}")
                 for nodes in (2, 4, 8, 16)]
ZERO3_ONLY = "pp=1,tp=1,dp={dp},mb=4,recompute=none,zero=3"


def _plan(argv: list[str]):
    from ds_pipe_ext.cli import build_parser
    from ds_pipe_ext.cli.plan import _search, build_model
    from ds_pipe_ext.plan.model import PlanModel  # noqa: F401

    args = build_parser().parse_args(["plan", *argv, "--top", "10"])
    cfg, model = build_model(args)
    return args, cfg, model, _search(args, cfg, model)


def _row(model, cost) -> dict:
    from ds_pipe_ext.plan.shares import step_shares

    shares = step_shares(model, cost)
    total = sum(shares.values()) or 1.0
    return {"layout": cost.layout.name, "runnable": cost.layout.runnable, "step_s": round(cost.step_s, 4),
            "mfu": round(cost.mfu, 4), "shares": {k: round(v / total, 4) for k, v in shares.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write every row here")
    ap.add_argument("--quick", action="store_true", help="the first question and one node count only")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP + " (as --quick)")
    opts = ap.parse_args()
    opts.quick = opts.quick or opts.smoke
    with contextlib.redirect_stdout(sys.stderr):
        from ds_pipe_ext.pipe import schedules  # noqa: F401 - DeepSpeed's engine order for the deepspeed runtime
    questions = QUESTIONS[:1] if opts.quick else QUESTIONS
    rows, result = {}, []
    t0 = time.perf_counter()
    for key, argv in questions:
        args, cfg, model, res = _plan(argv.split())
        pick, best = res.top[0], res.best_runnable()
        rows[key] = {"pick": _row(model, pick), "deepspeed_runs": _row(model, best) if best else None}
        print(f"{key:30s} pick {pick.layout.name:52s} {pick.step_s:8.3f} s MFU {100 * pick.mfu:5.1f}%"
              + (f" | DeepSpeed runs {best.layout.name} {best.step_s:.3f} s" if best and best is not pick else ""))
        result.append(f"{key}={pick.layout.name}@{pick.step_s:.3f}s")
    for nodes, argv in ZERO3_VS_PIPE[:1] if opts.quick else ZERO3_VS_PIPE:
        args, cfg, model, res = _plan(argv.split())
        from ds_pipe_ext.plan.space import parse_only

        lay = parse_only(ZERO3_ONLY.format(dp=8 * nodes), gpus=8 * nodes, global_batch=model.global_batch)
        z3 = model.evaluate_named(lay)
        best = res.best_runnable()
        key = f"zero3_vs_pipe_{nodes}nodes"
        rows[key] = {"zero3": _row(model, z3), "deepspeed_runs": _row(model, best) if best else None}
        print(f"{key:30s} ZeRO-3 dp{8 * nodes} {z3.step_s:.3f} s MFU {100 * z3.mfu:5.1f}% | best DeepSpeed runs "
              f"{best.layout.name} {best.step_s:.3f} s ({z3.step_s / best.step_s:.2f}x)")
        result.append(f"{key}={z3.step_s / best.step_s:.3f}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"planned in {time.perf_counter() - t0:.1f} s")
    print("RESULT " + " ".join(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
