"""Split and recompute chosen together, measured on 2 CPU ranks where activations decide what fits (issues 36, 55).

    OMP_NUM_THREADS=1 python bench/recompute_split.py [--rounds 3] [--steps 4] [--out runs/recompute-split]
    python bench/recompute_split.py --smoke     (SMOKE_MODEL, one round of 2-step runs: a check that it runs)

bench-cpu-long (bench-cpu at sequence 1,024: GPT, V 50,257, h 512, 12 blocks; eager attention, whose s x s
probabilities are most of a block's saved bytes and a small part of its time) on 2 stages, micro-batch 1 x 4
(stage 0 holds 2 in flight): an activation-bound shape, fixed before any launch (at part 1's bench-cpu 1 x 16,
seq 256, a stage's peak was its optimizer step's and recompute could buy nothing).  Its layers are profiled
here first (the layers as built, and the blocks built to replay their attention core), and two caps are
fixed by rule from them before any launch:

    cap 1  the midpoint of the two smallest feasible caps: the smallest at which any split fits without
           recompute, and the smallest at which any split fits with a recompute mode per layer (so no split
           fits cap 1 without recompute)
    cap 2  the largest cap (in 0.5% steps down from the best split's peak) at which the memory-capped split
           without recompute fits but moves at least 2 blocks from the best split

The caps are on the partitioner's peak rule (``costs.peak_rule.PipelinePeakRule``: states as held in a backward,
in-flight activations, buckets, pipe buffers, temporaries), and every run also checks them as
``train.memory_cap_gib``, which on CPU counts the tensors a rank holds (model states at the optimizer step +
saved activations, from the instrumentation), not the process's RSS.

Runs, each its own ``train.py`` launch, alternating in rotated order for ``--rounds`` rounds:

    a  the best split that fits cap 1 under DeepSpeed's global checkpointing (activation_checkpoint_interval 1)
    d  Megatron's block method under cap 1: full recompute of the first k layers of each stage, the smallest k
       that fits, on the split where that is fastest (a recompute mode per layer)
    e  global selective recompute (every block replays its attention core) on the fastest split that fits
       cap 1 so, if any does
    c1 recompute = "auto" under cap 1 (the split and each layer's mode chosen together, partition "profiled")
    b  the memory-capped split without recompute ("profiled", pipeline.memory_cap_gib), under cap 2
    c2 recompute = "auto" under cap 2

"Fastest" among fixed-mode splits: the smallest slowest stage, the layers' profiled times with their replays,
as the joint partitioner chooses.  Scores are ratios of medians of step times (step 1 of each launch is
warm-up), per round: X = a / c1, Y = b / c2, W = the better of d and e / c1, and Z = the largest measured
per-rank peak over its cap (%).  Predicted X, Y and W beside them: the runs' own splits and modes through the
step model ``launch_scripts/step_model_cpu.json`` on the costs profiled here (calibrated on
bench/prediction_transfer.py's calibration runs; none of these runs calibrated it: all are predictions).

Last line: RESULT joint_vs_global_recompute=X joint_vs_split_only=Y joint_vs_megatron_block=W
joint_peak_over_cap_max_pct=Z (targets X >= 1.10, Y >= 1.03, W >= 1.0, Z <= 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds_pipe_ext.runner import SMOKE_HELP  # noqa: E402

MODEL, MICRO_BATCH, MICRO_BATCHES = "bench-cpu-long", 1, 4
# --smoke: tiny's width at sequence 512 with 8 blocks, eager attention (so that activations decide the caps)
SMOKE_MODEL = {"vocab_size": 512, "hidden": 64, "layers": 8, "heads": 4, "seq_len": 512, "dropout": 0.0,
               "attention": "eager"}
GIB = 2**30


def profiled_costs():
    """bench-cpu's layers profiled here (cached), their selective mode measured too, with the model states
    train.py's pipeline holds (fp32, ZeRO-0, dp 1), and the peak rule the partitioner applies."""
    from ds_pipe_ext.costs.peak import ZeroSettings
    from ds_pipe_ext.costs.peak_rule import PipelinePeakRule
    from ds_pipe_ext.costs.profiler import profile_layers
    from ds_pipe_ext.costs.types import ProfileSettings
    from ds_pipe_ext.costs.zero import layer_states_by_rule
    from ds_pipe_ext.models import family_of, load_model
    from ds_pipe_ext.pipe.recompute import with_measured_selective
    from ds_pipe_ext.train.data import SyntheticTokens

    cfg = load_model(MODEL)
    family = family_of(cfg)
    specs = family.layer_specs(cfg)
    x, y = next(SyntheticTokens(cfg.vocab_size, MICRO_BATCH, cfg.seq_len, seed=0))
    settings = ProfileSettings(cache_dir=str(ROOT / ".ds_pipe_ext_cache"))
    key = {"model": cfg.to_dict()}

    def profile(layers):
        return profile_layers(layers, x, labels=y, loss_fn=family.loss_fn(cfg), settings=settings, key_fields=key)

    costs = with_measured_selective(profile(specs), specs, profile)
    costs = layer_states_by_rule(costs, stage=0, dp=1, element_bytes=4)
    return costs, PipelinePeakRule(ZeroSettings.from_ds_config({"zero_optimization": {"stage": 0}}), 1, 4)


def stage_peaks(costs, rule, parts, modes=None) -> list[float]:
    """Each stage's peak by the joint partitioner's rule (``partition.joint_stage_memory``), its layers run
    under ``modes`` (None: none)."""
    from ds_pipe_ext.partition import joint_stage_memory

    return joint_stage_memory(costs, parts, modes, micro_batches=MICRO_BATCHES, peak_rule=rule)


def smallest_caps(costs, rule) -> tuple[float, float]:
    """(the smallest cap any split fits without recompute, with a recompute mode per layer), by the rule the
    partitioners hold to their caps."""
    from ds_pipe_ext.partition import InfeasibleMemoryCap, partition_jointly, partition_min_max

    try:
        partition_min_max(costs, 2, micro_batches=MICRO_BATCHES, memory_cap_bytes=1.0, peak_rule=rule)
    except InfeasibleMemoryCap as e:
        plain = e.min_feasible_cap
    try:
        partition_jointly(costs, 2, memory_cap_gib=1.0 / GIB, micro_batches=MICRO_BATCHES, peak_rule=rule)
    except InfeasibleMemoryCap as e:
        joint = e.min_feasible_cap
    return plain, joint


def slowest_stage(costs, parts, modes) -> float:
    """The slowest stage's time, its layers' profiled forward + backward with each mode's replay."""
    from ds_pipe_ext.costs.stage import with_layer_recompute

    ran = with_layer_recompute(costs, modes, selective_built=False)
    return max(sum(c.time_s() for c in ran[i:j]) for i, j in zip(parts[:-1], parts[1:]))


def fastest_fitting(costs, rule, cap: float, modes_of) -> tuple[list[int], list[str]] | None:
    """The 2-stage split, among those whose ``modes_of(parts)`` (None: none fits) fit ``cap``, with the smallest
    slowest stage; None where no split fits."""
    n, fits = len(costs), []
    for cut in range(1, n):
        parts = [0, cut, n]
        modes = modes_of(parts)
        if modes is not None and max(stage_peaks(costs, rule, parts, modes)) <= cap:
            fits.append((slowest_stage(costs, parts, modes), parts, modes))
    return min(fits)[1:] if fits else None


def megatron_block(costs, rule, cap: float):
    """Megatron's block method: full recompute of the first k layers of every stage, the smallest k that fits."""
    def modes_of(parts):
        for k in range(0, max(j - i for i, j in zip(parts[:-1], parts[1:])) + 1):
            modes = [("full" if idx - i < k else "none") for i, j in zip(parts[:-1], parts[1:]) for idx in range(i, j)]
            if max(stage_peaks(costs, rule, parts, modes)) <= cap:
                return modes
        return None

    return fastest_fitting(costs, rule, cap, modes_of)


def global_selective(costs, rule, cap: float):
    """Every block replaying its attention core (a layer without one runs none), where a split fits."""
    modes = ["selective" if c.selective_kept_bytes is not None else "none" for c in costs]
    return fastest_fitting(costs, rule, cap, lambda parts: modes)


def fixed_caps(costs, rule, min_move: int = 2) -> dict:
    from ds_pipe_ext.partition import InfeasibleMemoryCap, partition_min_max

    best = partition_min_max(costs, 2, micro_batches=MICRO_BATCHES)
    peak = max(stage_peaks(costs, rule, best))
    plain, joint = smallest_caps(costs, rule)
    cap1 = (plain + joint) / 2
    global_full = partition_min_max(costs, 2, micro_batches=MICRO_BATCHES, recompute=True,
                                    memory_cap_bytes=cap1, peak_rule=rule)
    block = megatron_block(costs, rule, cap1)
    selective = global_selective(costs, rule, cap1)
    cap2 = None
    for k in range(1, 200):
        cap = peak * (1 - 0.005 * k)
        try:
            parts = partition_min_max(costs, 2, micro_batches=MICRO_BATCHES, memory_cap_bytes=cap, peak_rule=rule)
        except InfeasibleMemoryCap:
            break
        if abs(parts[1] - best[1]) >= min_move:
            cap2 = cap
            break
    if cap2 is None:
        raise SystemExit(f"no cap moves the split without recompute by {min_move} blocks and still fits: nothing to "
                         f"measure")
    return {"best_parts": best, "best_peak_bytes": peak, "smallest_cap_without_recompute": plain,
            "smallest_cap_with_recompute": joint, "cap1_bytes": cap1, "cap2_bytes": cap2,
            "a_parts": global_full, "d_parts": block[0] if block else None, "d_modes": block[1] if block else None,
            "e_parts": selective[0] if selective else None, "e_modes": selective[1] if selective else None}


CAP1_RUNS = ("a", "d", "e", "c1")


def ds_config(run: str, caps: dict, run_dir: Path, steps: int) -> dict:
    cap = caps["cap1_bytes"] if run in CAP1_RUNS else caps["cap2_bytes"]
    pipeline = {"stages": 2, "instrument": {"enabled": True, "run_dir": str(run_dir)},
                "profile": {"cache_dir": str(ROOT / ".ds_pipe_ext_cache")}}
    train = {"model": MODEL, "steps": steps, "seed": 1234, "log": "json", "memory_cap_gib": cap / GIB}
    if run == "a":
        pipeline.update(partition_method="parts:" + ",".join(map(str, caps["a_parts"])),
                        activation_checkpoint_interval=1)
        train["recompute"] = "full"
    elif run in ("d", "e"):  # a fixed split and a mode per layer (Megatron's block method; global selective)
        pipeline.update(partition_method="parts:" + ",".join(map(str, caps[f"{run}_parts"])))
        train["recompute"] = caps[f"{run}_modes"]
    else:
        pipeline.update(partition_method="profiled", memory_cap_gib=cap / GIB)
        if run in ("c1", "c2"):
            train["recompute"] = "auto"
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": MICRO_BATCHES,
            "steps_per_print": 10**6, "pipeline": pipeline, "train": train}


def launch_run(run: str, rnd: int, caps: dict, out: Path, steps: int) -> dict:
    from ds_pipe_ext.instrument.rundir import RunDir
    from ds_pipe_ext.runner import launch

    where = out / f"round{rnd}" / run
    done = where / "metrics.json"
    if not done.exists():
        where.mkdir(parents=True, exist_ok=True)
        ds = where / "ds.json"
        ds.write_text(json.dumps(ds_config(run, caps, where / "run", steps), indent=1))
        proc, _ = launch(2, ds, out_dir=where, timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"run {run} round {rnd} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads(done.read_text())
    rd = RunDir(where / "run")
    peaks = []
    for rank in range(2):
        last = json.loads(rd.rank_path(rank).read_text().splitlines()[-1])
        peaks.append(sum(last[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_peak_bytes")))
    predicted = rd.read_predicted()
    return {"run": run, "round": rnd, "status": summary["status"], "parts": summary["parts"],
            "modes": predicted.layer_recompute, "step_s": statistics.median(summary["step_s_each"][1:]),
            "rank_peak_bytes": peaks,
            "cap_bytes": caps["cap1_bytes"] if run in CAP1_RUNS else caps["cap2_bytes"]}


def predicted_step(costs, parts, modes, *, full: bool = False) -> float:
    import ds_pipe_ext.pipe.schedules  # noqa: F401 - DeepSpeed's order of 1F1B, for the step model
    from ds_pipe_ext.costs.stage import stage_costs, with_layer_recompute
    from ds_pipe_ext.simulate.step_model import StepModel

    ran = costs if full or modes is None else with_layer_recompute(costs, modes, selective_built=False)
    model = StepModel.load(ROOT / "launch_scripts" / "step_model_cpu.json")
    return model.predict(stage_costs(ran, parts, micro_batches=MICRO_BATCHES, recompute=full), MICRO_BATCHES).step_s


def main() -> None:
    from ds_pipe_ext.partition.report import render_table

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="steps a launch (the first is warm-up)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "recompute-split"))
    ap.add_argument("--caps-only", action="store_true", help="fix and print the caps and the fixed runs, launch nothing")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    if args.smoke:
        import tempfile

        global MODEL
        args.rounds, args.steps, args.out = 1, 2, tempfile.mkdtemp(prefix="ds_pipe_ext_recompute_")
        MODEL = str(Path(args.out) / "smoke-long.toml")
        Path(MODEL).write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in SMOKE_MODEL.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    costs, rule = profiled_costs()
    caps_file = out / "caps.json"
    if caps_file.exists():
        caps = json.loads(caps_file.read_text())
    else:
        caps = fixed_caps(costs, rule, min_move=1 if args.smoke else 2)
        caps_file.write_text(json.dumps(caps, indent=1))  # fixed before the first launch
    print(f"best split {caps['best_parts']}: heaviest stage's predicted peak {caps['best_peak_bytes'] / 2**20:.1f} MiB; "
          f"smallest caps {caps['smallest_cap_without_recompute'] / 2**20:.1f} MiB without recompute, "
          f"{caps['smallest_cap_with_recompute'] / 2**20:.1f} MiB with; cap 1 {caps['cap1_bytes'] / 2**20:.1f} MiB, "
          f"cap 2 {caps['cap2_bytes'] / 2**20:.1f} MiB", flush=True)
    print(f"fixed before any launch: a {caps['a_parts']}; d {caps['d_parts']} {caps['d_modes']}; "
          f"e {caps['e_parts'] or 'no split fits cap 1'}", flush=True)
    if args.caps_only:
        return

    if not caps["d_parts"]:
        raise SystemExit("Megatron's block method fits cap 1 on no split: nothing to compare the joint choice with")
    runs = ["a", "d", "c1", "b", "c2"] + (["e"] if caps["e_parts"] else [])
    records = []
    for rnd in range(args.rounds):
        order = runs[rnd % len(runs):] + runs[:rnd % len(runs)]
        for run in order:
            rec = launch_run(run, rnd, caps, out, args.steps)
            records.append(rec)
            print(f"round {rnd} {run}: {rec['step_s']:.3f} s/step, parts {rec['parts']}, peak "
                  f"{max(rec['rank_peak_bytes']) / 2**20:.1f} / {rec['cap_bytes'] / 2**20:.1f} MiB, {rec['status']}",
                  flush=True)
    (out / "records.json").write_text(json.dumps(records, indent=1))

    def steps(run):
        return {r["round"]: r["step_s"] for r in records if r["run"] == run}

    x_each = [steps("a")[k] / steps("c1")[k] for k in range(args.rounds)]
    y_each = [steps("b")[k] / steps("c2")[k] for k in range(args.rounds)]
    w_each = [min(steps(r)[k] for r in ("d", "e") if k in steps(r)) / steps("c1")[k] for k in range(args.rounds)]
    over = max(100 * (p - r["cap_bytes"]) / r["cap_bytes"] for r in records for p in r["rank_peak_bytes"])
    last = {r["run"]: r for r in records if r["round"] == args.rounds - 1}
    pred_x = predicted_step(costs, last["a"]["parts"], None, full=True) / predicted_step(costs, last["c1"]["parts"],
                                                                                         last["c1"]["modes"])
    pred_y = predicted_step(costs, last["b"]["parts"], None) / predicted_step(costs, last["c2"]["parts"], last["c2"]["modes"])
    pred_w = min(predicted_step(costs, caps[f"{r}_parts"], caps[f"{r}_modes"]) for r in ("d", "e") if caps[f"{r}_parts"]) \
        / predicted_step(costs, last["c1"]["parts"], last["c1"]["modes"])
    rows = [[r["run"], str(r["round"]), str(r["parts"]),
             "-" if not r["modes"] else " ".join(m[0] for m in r["modes"]), f"{r['step_s']:.3f}",
             f"{max(r['rank_peak_bytes']) / 2**20:.1f}", f"{r['cap_bytes'] / 2**20:.1f}", r["status"]] for r in records]
    print("\n".join(render_table(["run", "round", "parts", "modes (n/s/f)", "s/step", "peak MiB", "cap MiB", "status"],
                                 rows)))
    print(f"X = a / c1 each round: {', '.join(f'{v:.3f}' for v in x_each)} (spread {max(x_each) - min(x_each):.3f}); "
          f"predicted {pred_x:.3f}")
    print(f"Y = b / c2 each round: {', '.join(f'{v:.3f}' for v in y_each)} (spread {max(y_each) - min(y_each):.3f}); "
          f"predicted {pred_y:.3f}")
    print(f"W = best of d, e / c1 each round: {', '.join(f'{v:.3f}' for v in w_each)} "
          f"(spread {max(w_each) - min(w_each):.3f}); predicted {pred_w:.3f}")
    print(f"RESULT joint_vs_global_recompute={statistics.median(x_each):.3f} "
          f"joint_vs_split_only={statistics.median(y_each):.3f} joint_vs_megatron_block={statistics.median(w_each):.3f} "
          f"joint_peak_over_cap_max_pct={over:.1f}")


if __name__ == "__main__":
    main()
