"""The live-tensor peak of a training step on 2 CPU ranks, by kind, against the memory rule.

    python bench/peak_memory.py [--dtypes fp32,bf16] [--model compare-cpu] [--smoke]

One 2-rank launch per precision builds each engine in turn with train.py's own builder, on the same
layers: a 2-stage pipeline under ZeRO-0 and ZeRO-1 (pp 2, dp 1: DeepSpeed's ZeRO-1 over one replica)
and data parallel over both ranks under ZeRO-0, 1, 2 and 3 (the ZeRO settings `compare` writes:
``layout.ZERO_SETTINGS``, overlap off).  Each trains 3 steps and traces step 3's allocation events
(``instrument.peak``: torch.profiler with ``profile_memory=True``, the tensors alive at the step's start
counted apart, kinds from the tensors the engine and autograd hold).  Step 2 warms the trace.

Predicted: the peak rule (``costs.peak``: one rank's step walked op by op in its schedule's order, with
DeepSpeed's allocation rules for the ZeRO settings the layout writes), its moment and bytes by kind; the
at-step rule (``compare.predict``: ZeRO's states at the optimizer step + saved activations) beside it.
Nothing is fitted: every figure is a prediction.

Ends with ``RESULT peak_memory_max_error_pct=X peak_memory_kind_max_error_pct=Y`` (targets X <= 5 over the
total peak, Y <= 1 over the kinds DeepSpeed holds: parameters, gradients, optimizer states, buffers).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds_pipe_ext.runner import SMOKE_HELP  # noqa: E402

# data parallel first: a pipeline engine leaves its grid as DeepSpeed's global model-parallel unit, which
# a data-parallel engine built after it in the same process then asks for its ranks
CELLS = [("dp-z0", 1, 0), ("dp-z1", 1, 1), ("dp-z2", 1, 2), ("dp-z3", 1, 3), ("pipe-z0", 2, 0), ("pipe-z1", 2, 1)]
SMOKE_CELLS = ("dp-z3", "pipe-z1")
PEAK_STEP = 3
HELD = ("param_bytes", "grad_bytes", "optimizer_bytes", "buffer_bytes")  # what DeepSpeed itself holds


def cell_layout(pp: int, zero: int, world: int, micro_batch: int, micro_batches: int):
    from ds_pipe_ext.layout import Layout

    if pp > 1:
        return Layout(pp=pp, dp=world // pp, zero=zero, micro_batch=micro_batch, micro_batches=micro_batches,
                      schedule="1f1b")
    return Layout(dp=world, zero=zero, micro_batch=micro_batch, micro_batches=micro_batches)


def cell_only(peak: dict, before: int) -> dict:
    """The peak less what was alive before this cell's engine was built (counted in "other")."""
    gone = min(before, peak["by_kind"]["other"])
    return {**peak, "peak_bytes": peak["peak_bytes"] - gone, "by_kind": {**peak["by_kind"], "other": peak["by_kind"]["other"] - gone}}


def worker(args) -> None:
    """Every cell in turn on this rank, each in every precision of ``args.dtype`` (comma-separated: the data-parallel
    cells come first, whatever the precision); one RESULT-RANK line per cell and precision."""
    import gc

    import torch

    from ds_pipe_ext.instrument.peak import live_tensor_bytes
    from ds_pipe_ext.train.build import build
    from ds_pipe_ext.train.config import build_run_config
    from ds_pipe_ext.train.trainer import Trainer

    work = Path(args.work)
    cells = [c for c in CELLS if c[0] in args.cells.split(",")]
    for (name, pp, zero), dtype in ((cell, dtype) for cell in cells for dtype in args.dtype.split(",")):
        lay = cell_layout(pp, zero, args.world, args.micro_batch, args.micro_batches)
        run_dir = work / dtype / name
        precision = {"bf16": {"bf16": {"enabled": True}}}.get(dtype, {})
        instrument = {"enabled": True, "run_dir": str(run_dir), "peak_step": PEAK_STEP}
        ds = lay.ds_config(train={"model": args.model, "steps": PEAK_STEP, "seed": 1234, "log": "json"},
                           pipeline={"partition_method": "parameters", "instrument": instrument} if pp > 1 else None,
                           steps_per_print=10**6, **precision, **({} if pp > 1 else {"instrument": instrument}))
        gc.collect()
        before = live_tensor_bytes(torch.device("cpu"))  # earlier cells' engines that DeepSpeed keeps alive
        built = build(build_run_config(ds))
        Trainer(built).run()
        rank = built.rank
        records = [json.loads(line) for line in (run_dir / f"rank{rank}.jsonl").read_text().splitlines()]
        peak = next(r for r in records if "peak" in r)
        sys.stdout.write("RESULT-RANK " + json.dumps({"cell": name, "dtype": dtype, "rank": rank,
                                                     "stage": peak["stage"], "peak": cell_only(peak["peak"], before),
                                                     "at_step": {k: peak[k] for k in ("param_bytes", "grad_bytes",
                                                                                       "optimizer_bytes")},
                                                     "activation_peak_bytes": peak["activation_peak_bytes"],
                                                     "parts": built.parts}) + "\n")
        sys.stdout.flush()
        del built  # collected before the next cell counts what is alive
        torch.distributed.barrier()


def predicted(cell: dict, model: str, world: int, micro_batch: int, micro_batches: int) -> tuple[dict, dict]:
    """The peak rule's answer for this cell's rank (``costs.peak``: its phase and bytes by kind), and the
    at-step rule's total beside it (``compare.predict``: ZeRO's states at the step + saved activations)."""
    from ds_pipe_ext.compare.configs import CompareConfig
    from ds_pipe_ext.compare.predict import layer_activation_bytes, model_shape, predicted_ranks
    from ds_pipe_ext.costs.estimate import rank_steps
    from ds_pipe_ext.costs.peak import step_peak
    from ds_pipe_ext.models.registry import load_model

    _, pp, zero = next(c for c in CELLS if c[0] == cell["cell"])
    model_cfg = load_model(model)
    lay = cell_layout(pp, zero, world, micro_batch, micro_batches)
    dp_rank = cell["rank"] % (world // pp)
    fp32 = cell["dtype"] == "fp32"
    peak = step_peak(rank_steps(model_cfg, lay, parts=cell["parts"], dtype=cell["dtype"], dp_rank=dp_rank,
                                device="cpu")[cell["stage"]])
    cfg = CompareConfig(cell["cell"], lay, "parameters" if pp > 1 else None)
    at_step = predicted_ranks(cfg, model_shape(model_cfg), layer_activation_bytes(model_cfg, cfg, dtype=cell["dtype"]),
                              parts=cell["parts"], element_bytes=4 if fp32 else 2, dp_rank=dp_rank)[cell["stage"]]
    return peak.to_dict(), at_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--model", default="compare-cpu")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write every rank's record (with its largest blocks) here")
    ap.add_argument("--smoke", action="store_true",
                    help=SMOKE_HELP + f" (tiny, cells {','.join(SMOKE_CELLS)}, both precisions in one launch)")
    ap.add_argument("--cells", default=",".join(c[0] for c in CELLS), help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    from ds_pipe_ext.partition.report import render_table
    from ds_pipe_ext.runner import launch

    work = Path(tempfile.mkdtemp(prefix="ds_pipe_ext_peak_"))
    if args.smoke:
        args.model, args.cells = "tiny", ",".join(SMOKE_CELLS)
    results = []
    # a launch a precision: nothing one leaves behind in the process reaches the other's peaks
    for dtype in [args.dtypes] if args.smoke else args.dtypes.split(","):
        proc, _ = launch(args.world, None, "--worker", "--dtype", dtype, "--cells", args.cells, "--work", str(work),
                         "--model", args.model,
                         "--world", str(args.world), "--micro-batch", str(args.micro_batch),
                         "--micro-batches", str(args.micro_batches), timeout=900, script="bench/peak_memory.py")
        got = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("RESULT-RANK ")]
        if proc.returncode or len(got) != len(args.cells.split(",")) * args.world * len(dtype.split(",")):
            sys.exit(f"{dtype} launch failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
        results += got
        print(f"  {dtype}: {len(got)} rank records", flush=True)

    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    MIB = 2**20
    rows, worst, worst_kind, at_step_worst = [], 0.0, 0.0, 0.0
    for r in sorted(results, key=lambda r: (r["dtype"], [c[0] for c in CELLS].index(r["cell"]), r["rank"])):
        pred, at_step = predicted(r, args.model, args.world, args.micro_batch, args.micro_batches)
        meas, total = r["peak"]["by_kind"], r["peak"]["peak_bytes"]
        err = 100 * (pred["total_bytes"] - total) / total
        worst = max(worst, abs(err))
        at_step_err = 100 * (at_step["total_bytes"] - total) / total
        at_step_worst = max(at_step_worst, abs(at_step_err))
        cells = []
        for kind in (*HELD, "gathered_bytes", "activation_bytes"):
            got, want = meas[kind], pred[kind]
            if kind in HELD:  # a kind absent on both sides is exact; absent on one, 100% off
                e = 0.0 if got == want == 0 else 100 * abs(want - got) / max(got, want)
                worst_kind = max(worst_kind, e)
            cells.append(f"{got / MIB:.2f} / {want / MIB:.2f}")
        other = (meas["temporary"] + meas["other"]) / MIB
        rows.append([r["dtype"], r["cell"], str(r["rank"]), f"{r['peak']['phase']} / {pred['phase']}", *cells,
                     f"{other:.2f} / {pred['temporary_bytes'] / MIB:.2f}",
                     f"{total / MIB:.2f} / {pred['total_bytes'] / MIB:.2f}", f"{err:+.1f}",
                     f"{at_step['total_bytes'] / MIB:.2f}", f"{at_step_err:+.1f}"])
    print(f"\nlive-tensor peak of step {PEAK_STEP}, MiB, measured (torch.profiler allocation events) / predicted "
          f"(costs.peak), by kind; the at-step rule (compare.predict) beside")
    print("\n".join(render_table(["dtype", "cell", "rank", "peak in", "params", "grads", "optimizer", "buffers",
                                  "gathered", "activations", "temporary+other", "peak", "err %", "at-step",
                                  "at-step err %"], rows)))
    unseen = [f"{r['dtype']} {r['cell']} rank {r['rank']}: {r['peak'].get('unseen_free_bytes', 0) / MIB:.2f}"
              for r in results if r["peak"].get("unseen_free_bytes")]
    print("blocks freed where the trace could not see it (on gloo's thread), dated by the first phase at which "
          "Python no longer reached them, MiB: " + ("; ".join(unseen) if unseen else "none"))
    print(f"calibrated: nothing (every figure is predicted); at-step rule's worst error {at_step_worst:.1f}%")
    print(f"RESULT peak_memory_max_error_pct={worst:.1f} peak_memory_kind_max_error_pct={worst_kind:.1f}")


if __name__ == "__main__":
    main()
