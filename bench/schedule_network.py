"""GPipe against 1F1B under slow networks: seed 004's table, measured and simulated side by side.

Seed 004 ran GPT-3 small on 3 nodes under four network settings (0.1 ms / 10 Gb/s to
10 ms / 1 Gb/s) and three micro-batch sizes.  Here: network-cpu (boundary tensor 0.5 MB
per sample) on 2 CPU ranks, global batch 16, micro-batch 1, 2, 4, DeepSpeed's engine
running 1F1B (its TrainSchedule) and GPipe (ours, through ``_train_schedule``), with every
pipeline transfer slowed by ``compat.link_emulator``.  The seed's settings would add ~1%
to a multi-second step here, so they are scaled until the slowest at least doubles it:

    1 ms + 0.5 GB/s,  20 ms + 0.05 GB/s,  50 ms + 0.02 GB/s,  150 ms + 0.004 GB/s

One launch per micro-batch size runs every (schedule, network) cell in alternating order
(A B ... then reversed) for ROUNDS rounds of STEPS steps, so drift hits every cell alike;
the measured step is the median.  The one step prediction (``StepModel.predict`` under the
deepspeed runtime: DeepSpeed's own instruction streams, with rendezvous transfers) takes
per-stage forward, backward and optimizer times measured in ONE cell of each launch (1F1B
on the fastest network: the calibration cell) and predicts the other seven; the error is
quoted over the predicted cells only.

    python bench/schedule_network.py            (about 15 minutes)
    python bench/schedule_network.py --sizes 4 --rounds 1 --steps 1    (a quick look, not a measurement)
    python bench/schedule_network.py --smoke     (the quick look on tiny, links 100x faster: a check that it runs)

Last line: RESULT network_median_error_pct=X gpipe_vs_1f1b_worst_network=Y
(X over the predicted cells, target <= 10; Y: GPipe / 1F1B measured step under the slowest
setting, the median over micro-batch sizes)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds_pipe_ext.runner import SMOKE_HELP  # noqa: E402
NETWORKS = [(1.0, 0.5), (20.0, 0.05), (50.0, 0.02), (150.0, 0.004)]  # (latency ms, GB/s)
SCHEDULES = ("gpipe", "1f1b")
SIZES = (1, 2, 4)
GLOBAL_BATCH, STAGES = 16, 2
ROUNDS = int(os.environ.get("NETWORK_ROUNDS", 2))  # rounds over every cell, alternating the order
STEPS = int(os.environ.get("NETWORK_STEPS", 2))  # steps per cell and round
CALIBRATION = ("1f1b", 0)  # the cell whose measured stage times feed the simulator
MODEL = "network-cpu"
if os.environ.get("NETWORK_SMOKE") == "1" or "--smoke" in sys.argv:  # the same cells on tiny, 100x faster links
    NETWORKS, MODEL = [(lat / 100, gbs * 100) for lat, gbs in NETWORKS], "tiny"


def worker() -> None:
    """Inside each rank (launched by deepspeed): every cell, alternating, instrumented."""
    sys.path.insert(0, str(ROOT))
    import time

    import torch.distributed as dist

    import train
    from ds_pipe_ext.compat.engine import set_train_schedule
    from ds_pipe_ext.compat.link_emulator import emulate_links, restore
    from ds_pipe_ext.instrument.hooks import instrument_engine, remove_instrumentation
    from ds_pipe_ext.pipe.schedules import TRAIN_SCHEDULES

    out = Path(os.environ["NETWORK_OUT"])
    b = int(os.environ["NETWORK_MICRO_BATCH"])

    def grid(engine, data):
        records = []
        recorder = instrument_engine(engine, records.append)
        for name in SCHEDULES:  # warm-up: each schedule's buffers, no emulated link
            set_train_schedule(engine, TRAIN_SCHEDULES[name], losses_per_micro_batch=True)
            engine.train_batch(data_iter=data)
        cells = [(name, n) for name in SCHEDULES for n in range(len(NETWORKS))]
        results = []
        for r in range(ROUNDS):
            for name, n in (cells if r % 2 == 0 else cells[::-1]):
                set_train_schedule(engine, TRAIN_SCHEDULES[name], losses_per_micro_batch=True)
                emulate_links(NETWORKS[n][0] / 1e3, NETWORKS[n][1] * 1e9)
                for _ in range(STEPS):
                    dist.barrier()
                    t0 = time.perf_counter()
                    engine.train_batch(data_iter=data)
                    step_s = time.perf_counter() - t0
                    rec = records[-1]
                    results.append({"schedule": name, "network": n, "round": r, "step_s": step_s,
                                    "forward_ms": statistics.median(rec["forward_ms"]),
                                    "backward_ms": statistics.median(rec["backward_ms"]),
                                    "load_ms": rec["load_micro_batch_ms"],
                                    "optimizer_ms": rec["optimizer_step_ms"] + rec["reduce_grads_ms"]
                                    + rec["reduce_tied_grads_ms"],
                                    "aggregate_loss_ms": rec["aggregate_loss_ms"]})
                restore()
        remove_instrumentation(engine, recorder)
        (out / f"b{b}.rank{dist.get_rank()}.json").write_text(json.dumps({"stage": engine.stage_id, "cells": results}))

    train.main(["--deepspeed_config", os.environ["NETWORK_CONFIG"], "--steps", "0"], on_engine=grid)
    from ds_pipe_ext.train.trainer import exit_process

    exit_process(0)  # no interpreter teardown under gloo (see exit_process)


def simulate_cell(ranks: list[dict], schedule: str, n: int, b: int) -> float:
    """The step the one step prediction (``StepModel.predict``, DeepSpeed's engine order) gives one
    cell, from the calibration cell's stage times."""
    import ds_pipe_ext.pipe.schedules  # noqa: F401 - hands the step model DeepSpeed's order
    from ds_pipe_ext.costs.stage import measured_stages
    from ds_pipe_ext.models.gpt_config import load_model_config
    from ds_pipe_ext.simulate.step_model import StepModel

    m = GLOBAL_BATCH // b

    def calib(rank, key):
        return statistics.median(c[key] for c in rank["cells"] if (c["schedule"], c["network"]) == CALIBRATION) / 1e3

    by_stage = sorted(ranks, key=lambda r: r["stage"])
    fwd = [calib(r, "forward_ms") + calib(r, "load_ms") / m for r in by_stage]
    bwd = [calib(r, "backward_ms") for r in by_stage]
    # the step ends in collectives every stage joins (the gradient norm over the stages at the
    # optimizer step, the loss broadcast): a stage's time in them includes waiting for the last
    # one, so the smallest is their own cost, paid after the last stage arrives
    opt = [min(calib(r, "optimizer_ms") for r in by_stage)] * STAGES
    tail = min(calib(r, "aggregate_loss_ms") for r in by_stage)
    cfg = load_model_config(MODEL)
    boundary = b * cfg.seq_len * cfg.hidden * 4  # the fp32 activation a stage sends
    parts = list(range(STAGES + 1))  # per-stage times: the layers behind them do not matter here
    stages = measured_stages(parts, fwd, bwd, [boundary] * STAGES)
    lat, gbs = NETWORKS[n]
    model = StepModel(p2p_latency_s=lat / 1e3, p2p_bandwidth=gbs * 1e9, step_fixed_s=tail)
    return model.predict(stages, m, schedule=schedule, update_s=opt).step_s


def main() -> None:
    import argparse

    global ROUNDS, STEPS
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="micro-batch sizes")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    if args.smoke:
        args.sizes, args.rounds, args.steps = "4", 1, 1
    sizes = tuple(int(x) for x in args.sizes.split(","))
    ROUNDS, STEPS = args.rounds, args.steps

    from ds_pipe_ext.partition.report import render_table
    from ds_pipe_ext.runner import launch

    work = Path(tempfile.mkdtemp(prefix="ds_pipe_ext_network_"))
    rows, errors, ratios = {}, [], []
    for b in sizes:
        env = {"NETWORK_OUT": str(work), "NETWORK_MICRO_BATCH": str(b), "NETWORK_ROUNDS": str(ROUNDS),
               "NETWORK_STEPS": str(STEPS), "NETWORK_SMOKE": "1" if args.smoke else "0"}
        cfg = json.loads((ROOT / "launch_scripts" / "network_cpu.json").read_text())
        cfg.update(train_micro_batch_size_per_gpu=b, gradient_accumulation_steps=GLOBAL_BATCH // b)
        cfg["train"]["model"] = MODEL
        (work / "network_cpu.json").write_text(json.dumps(cfg))
        proc, _ = launch(STAGES, None, "--worker", cwd=work, timeout=1800, script="bench/schedule_network.py",
                         env={**env, "NETWORK_CONFIG": str(work / "network_cpu.json")})
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        ranks = [json.loads((work / f"b{b}.rank{r}.json").read_text()) for r in range(STAGES)]
        first = next(r for r in ranks if r["stage"] == 0)
        for name in SCHEDULES:
            for n in range(len(NETWORKS)):
                steps = [c["step_s"] for c in first["cells"] if (c["schedule"], c["network"]) == (name, n)]
                meas, sim = statistics.median(steps), simulate_cell(ranks, name, n, b)
                err = 100 * (sim - meas) / meas
                rows[(name, n, b)] = (meas, sim, err, min(steps), max(steps))
                if (name, n) != CALIBRATION:
                    errors.append(abs(err))
        ratios.append(rows[("gpipe", len(NETWORKS) - 1, b)][0] / rows[("1f1b", len(NETWORKS) - 1, b)][0])
        print(f"micro-batch {b}: {len(first['cells'])} steps measured", flush=True)
    for name in SCHEDULES:
        print(f"\n{name} on {STAGES} ranks, network-cpu, global batch {GLOBAL_BATCH}: step s, measured (median of "
              f"{ROUNDS * STEPS}, [min-max]) / simulated (error %)" + ("   * calibration cell" if name == CALIBRATION[0]
                                                                       else ""))
        table = []
        for n, (lat, gbs) in enumerate(NETWORKS):
            cells = []
            for b in sizes:
                meas, sim, err, lo, hi = rows[(name, n, b)]
                mark = "*" if (name, n) == CALIBRATION else ""
                cells.append(f"{meas:.2f} [{lo:.2f}-{hi:.2f}] / {sim:.2f} ({err:+.1f}%){mark}")
            table.append([f"delay {lat:g} ms, {gbs:g} GB/s"] + cells)
        print("\n".join(render_table(["network"] + [f"micro-batch {b}" for b in sizes], table)))
    base = {b: rows[("1f1b", 0, b)][0] for b in sizes}
    slow = {b: rows[("1f1b", len(NETWORKS) - 1, b)][0] / base[b] for b in sizes}
    print(f"\nslowest setting / fastest, 1F1B measured: {', '.join(f'b={b}: {v:.2f}x' for b, v in slow.items())}")
    print(f"GPipe / 1F1B under the slowest setting, measured: {', '.join(f'b={b}: {r:.3f}' for b, r in zip(sizes, ratios))}")
    print(f"|error| over the {len(errors)} predicted cells: median {statistics.median(errors):.1f}%, "
          f"worst {max(errors):.1f}%")
    print(f"RESULT network_median_error_pct={statistics.median(errors):.1f} "
          f"gpipe_vs_1f1b_worst_network={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
