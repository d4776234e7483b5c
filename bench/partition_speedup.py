"""Measured throughput of 2-stage splits: `profiled` against every split and DeepSpeed's built-ins.

Two models, 2 pipeline stages on 2 ranks (OMP_NUM_THREADS=1 each), micro-batch 1 x 16 micro-batches
(``--micro-batch``, ``--micro-batches``):
  bench-cpu         GPT (V=50257, h=512, 12 alike blocks, seq 256): a cheap embedding, a costly head
  bench-cpu-pruned  the same with one FFN width per block (4096 down to 1024): blocks not alike

`profiled` profiles its layers afresh (no cache) and picks the split with the smallest step
predicted by the fitted step model `launch_scripts/step_model_cpu.json` (calibrated on
bench/prediction_transfer.py's two calibration runs; none of these measurements calibrated it).

Two phases (bench/splits_in_one_launch.py: each method built afresh, 1 warm-up step, then timed steps):

1. **Screen**: every split [0, k, n] (k = 1..n-1) and `profiled`, one launch per model and round (so
   the methods it compares sit a minute apart),
   rounds alternating the order (forward, backward, ...); each split's median and spread over the
   rounds.  This is the whole curve, and it says which splits contend for the top.
2. **Playoff**: `profiled`, DeepSpeed's built-in splits, the screen's three best splits and the
   splits `profiled` chose in the screen, for ``--cycles`` cycles (A B C .., then B C .. A, ...).
   Each build is its own launch (``--playoff-launch build``, the default), measured as a user's
   launch runs it: step 1 the warm-up, the median of the other ``--playoff-steps`` - 1.  A launch of
   several builds favours splits unevenly: its later builds slow down, the balanced ones most (one
   rank's slowdown is on the critical path of a balanced split and hidden in the idle time of an
   unbalanced one; bench-cpu-llama's best split ran 11.9 s a step as a later build and 11.4 s alone,
   while the uniform split ran 12.5 s either way).  ``--playoff-launch cycle`` keeps the older form
   (a cycle's builds in one launch).  Scores are ratios *within a cycle* (profiled's build against
   the best split's build beside it), medians over the cycles.  The best split is the contender with
   the highest playoff median; a split outside the screen's top three could only beat it by being
   under-measured by more than the screen's spread, which the screen table shows.  Each record keeps
   its step times (``step_s_each``, step 1 the warm-up).  docs/results/2026-11-27-profiled-generalization.md has the measurements behind
   each of these choices.

Scores: `profiled` by its own builds (a fresh profile and decision each, as a user's launch would),
DeepSpeed's `uniform` and `parameters` by the splits their own functions choose.

    python bench/partition_speedup.py [--rounds 2] [--cycles 6] [--playoff-steps 4] [--playoff-launch build|cycle] [--out DIR]
    python bench/partition_speedup.py --model bench-cpu           (one of the pair: its X and Y alone)
    python bench/partition_speedup.py --model bench-cpu-llama    (Llama: adds Megatron's accounting to the
        built-ins, and a simulated 4- and 8-stage comparison of the hand rules on llama3-8b; docs/results/
        2026-11-25-llama-and-hugging-face.md has it at the default 16 micro-batches and at --micro-batches 32 --cycles 12)
    python bench/partition_speedup.py --model bench-cpu-moe      (Mixture-of-Experts at ep 1: first records
        the step model's prediction from layers profiled here, prediction.json, before any launch)
    python bench/partition_speedup.py --model bench-cpu-moe --predict-only
    python bench/partition_speedup.py --model bench-cpu-hybrid  (Mamba-2, attention and MLP layers: the prediction
        first, as for MoE, and a simulated 4- and 8-stage comparison of the hand rules on nemotron-h-8b)
    python bench/partition_speedup.py --smoke     (tiny and tiny-tied, one round, one playoff cycle a launch: a check
        that it runs; --smoke --model moe-tiny / llama-tiny for the one-model paths)

At few micro-batches per step a 2-stage pipeline's fill and drain are a large share of the step
whatever the split, and a step's fixed costs (engine, optimizer, p2p) weigh more at small micro-
batches, which hides the split's effect.  At 16 micro-batches (the default) the balanced split's
bubble is 1/17 of the step, and a step long enough that 3 timed steps a playoff build
(``--playoff-steps 4``) time well.

Resumable: a launch whose metrics exist in --out is not run again.
Last line: RESULT profiled_vs_builtin=X profiled_vs_best_split=Y second_model_profiled_vs_best_split=Z
(targets: X >= 1.25 on bench-cpu, Y and Z >= 0.98); with --model bench-cpu-llama: RESULT
llama_profiled_vs_best_heuristic=X llama_profiled_vs_best_split=Y (targets X >= 1.08, Y >= 0.97); with
--model bench-cpu-moe: RESULT moe_profiled_vs_builtin=X moe_profiled_vs_best_split=Y (targets X >= 1.15,
Y >= 0.97), the pre-launch prediction printed beside; with --model bench-cpu-hybrid: RESULT
hybrid_profiled_vs_builtin=X hybrid_profiled_vs_best_split=Y (targets X >= 1.15, Y >= 0.97, fixed before measuring);
--model bench-cpu-deepseek / bench-cpu-gptoss: deepseek_ / gptoss_profiled_vs_builtin (>= 1.10) and _vs_best_split
(>= 0.97), their hand rules simulated on deepseek-v3 / gpt-oss-20b
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_pipe_ext.models import family_of, load_model  # noqa: E402
from ds_pipe_ext.partition.hand_rules import even_blocks, fewer_at_the_ends, megatron_accounting  # noqa: E402
from ds_pipe_ext.partition.report import render_table  # noqa: E402
from ds_pipe_ext.runner import ROOT, SMOKE_HELP, measure_in_one_launch  # noqa: E402

MODELS = ["bench-cpu", "bench-cpu-pruned"]
SMOKE_MODELS = ["tiny", "tiny-tied"]
STEP_MODEL = ROOT / "launch_scripts" / "step_model_cpu.json"
SCREEN_STEPS = 2  # per build: step 1 is warm-up, step 2 is timed
SCREEN_TOP = 3  # the screen's best splits that go on to the playoff


def layer_specs(model: str) -> list:
    cfg = load_model(model)
    return family_of(cfg).layer_specs(cfg)


def builtin_parts(model: str) -> dict[str, str]:
    """What DeepSpeed's uniform and parameters choose (its own functions, trainable parameters), and, for the
    Llama family, Megatron's embedding-and-loss accounting (= Llama 3's one layer fewer at the ends), as methods."""
    from deepspeed.runtime import utils as ds_utils

    specs = layer_specs(model)
    params = [sum(p.numel() for p in spec.build().parameters()) for spec in specs]
    parts = {"uniform": ds_utils.partition_uniform(len(specs), 2), "parameters": ds_utils.partition_balanced(params, 2)}
    if family_of(load_model(model)).name == "llama":
        parts["megatron"] = megatron_accounting(len(specs) - 2, 2)
    return {name: split_method(p) for name, p in parts.items()}


def simulated_rules(model: str = "llama3-8b", stages=(4, 8), micro_batches: int = 32) -> list[list[str]]:
    """Predicted steps (no launch) of the hand rules against the analytic split on ``model``'s analytic costs:
    H100, TP 1, micro-batch 1 x ``micro_batches``, 1F1B under DeepSpeed's engine order, the step model's
    terms; each split's heaviest rank at its peak against the cap (0.9 of 80 GiB), which a run's split honours."""
    from deepspeed.runtime import utils as ds_utils

    import ds_pipe_ext.pipe.schedules  # noqa: F401 - hands the step model DeepSpeed's order of instructions
    from ds_pipe_ext.costs.hardware import get_device
    from ds_pipe_ext.layout import Layout
    from ds_pipe_ext.partition import PartitionError
    from ds_pipe_ext.plan.model import PlanModel

    cfg = load_model(model)
    rows = []
    for p in stages:
        lay = Layout(pp=p, micro_batch=1, micro_batches=micro_batches)
        plan = PlanModel.on_its_cluster(cfg, get_device("h100"), seq=cfg.seq_len, global_batch=micro_batches,
                                        dtype="bf16")
        costs = plan.layer_costs(1, False, 1, "none")
        splits = {"analytic (ours)": plan.run_split(lay),
                  "uniform (DeepSpeed)": ds_utils.partition_uniform(len(costs), p),
                  "parameters (DeepSpeed)": ds_utils.partition_balanced([c.param_bytes for c in costs], p)}
        blocks = len(costs) - 2  # the blocks between embedding and head (an MTP layer counted as one)
        if family_of(cfg).name == "hybrid":  # Megatron-core's MambaModel: the layers evenly, no accounting
            if blocks % p == 0:
                splits["Megatron-core even split"] = even_blocks(blocks, p)
            else:
                splits[f"Megatron-core even split: not applicable ({p} stages do not divide {blocks} layers)"] = None
        else:
            try:
                splits["Megatron accounting = Llama 3 rule"] = megatron_accounting(blocks, p)
            except PartitionError as e:
                splits[f"Megatron accounting: not applicable ({e})"] = None
        try:
            splits["first/last stage one fewer, as Megatron runs it"] = fewer_at_the_ends(blocks, p)
        except PartitionError as e:
            splits[f"first/last stage one fewer: not applicable ({e})"] = None
        best = plan.evaluate(lay, splits["analytic (ours)"], check_memory=False).step_s
        for name, parts in splits.items():
            if parts is None:
                rows.append([str(p), name, "-", "-", "-", "-"])
                continue
            cost = plan.evaluate(lay, [int(b) for b in parts], check_memory=False)
            peak = max(r["total_bytes"] for r in cost.ranks)
            rows.append([str(p), name, ",".join(str(int(b)) for b in parts), f"{cost.step_s:.3f}",
                         f"{best / cost.step_s:.3f}",
                         f"{peak / 2**30:.1f}" + ("" if peak <= plan.memory_cap else " (over)")])
    return rows


PREDICTED_FAMILIES = ("moe", "hybrid")  # their benches record the step model's prediction before any launch
RESULT_PREFIX = {"bench-cpu-moe": "moe", "bench-cpu-hybrid": "hybrid", "bench-cpu-deepseek": "deepseek",
                 "bench-cpu-gptoss": "gptoss"}  # each one's RESULT keys
# the published model each bench's hand rules are simulated on (4 and 8 stages)
SIMULATED = {"bench-cpu-llama": "llama3-8b", "bench-cpu-hybrid": "nemotron-h-8b", "bench-cpu-deepseek": "deepseek-v3",
             "bench-cpu-gptoss": "gpt-oss-20b"}
PREDICTION_PROFILES = 3  # a layer's profile moves by 10-20% between profiles on this machine: the median of 3


def predict_before_launch(model: str, micro_batches: int) -> dict:
    """What the step model predicts for each split of ``model`` from layers profiled here (no launch): the
    built-ins' splits, every split, and the best; the ratio best / best built-in is the prediction.  The
    layers are profiled ``PREDICTION_PROFILES`` times, each a fresh build: the prediction uses each layer's
    median time, and the ratio each profile alone gives is kept beside it (its spread)."""
    import dataclasses

    import torch

    import ds_pipe_ext.pipe.schedules  # noqa: F401 - DeepSpeed's engine order for the step model
    from ds_pipe_ext.costs.profiler import ProfileSettings, profile_layers
    from ds_pipe_ext.costs.stage import stage_costs
    from ds_pipe_ext.simulate.step_model import StepModel

    cfg = load_model(model)
    family = family_of(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    settings = ProfileSettings(warmup=2, repeats=5, cache_dir=None, progress=False)
    profiles = [profile_layers(family.layer_specs(cfg), tokens[:, :-1], labels=tokens[:, 1:],
                               loss_fn=family.loss_fn(cfg), settings=settings) for _ in range(PREDICTION_PROFILES)]
    median = [dataclasses.replace(layers[0], **{f: statistics.median(getattr(c, f) for c in layers)
                                                for f in ("forward_s", "backward_s", "recompute_s")})
              for layers in zip(*profiles)]
    step_model, methods = StepModel.load(STEP_MODEL), builtin_parts(model)

    def predict(costs: list) -> dict:
        n = len(costs)
        splits = {f"parts:0,{k},{n}": step_model.predict(stage_costs(costs, [0, k, n], micro_batches=micro_batches),
                                                          micro_batches, timeline=False).step_s for k in range(1, n)}
        best = min(splits, key=splits.get)
        builtin = {name: splits[method] for name, method in methods.items()}
        return {"splits": splits, "builtin": builtin, "best_split": best,
                "profiled_vs_builtin": min(builtin.values()) / splits[best]}

    return {**predict(median), "each_profile": [predict(costs)["profiled_vs_builtin"] for costs in profiles],
            "layers": [[c.name, c.forward_s, c.backward_s, c.param_bytes] for c in median]}


def split_method(parts) -> str:
    return "parts:" + ",".join(str(int(b)) for b in parts)


def run_launch(model: str, methods: list[str], out: Path, args, steps: int, warm_build: bool = True) -> list[dict]:
    """One launch measuring ``methods`` in this order (a method may repeat); the records in order."""
    measured = measure_in_one_launch(out, methods, train={"model": model, "steps": steps, "seed": 1234},
                                     micro_batch=args.micro_batch, micro_batches=args.micro_batches,
                                     step_model=STEP_MODEL, label=model, warm_build=warm_build)
    for r in measured:
        print(f"    {r['method']:<14} parts={r['parts']}  {r['samples_per_s']:.3f} samples/s", flush=True)
    return measured


def slug(method: str) -> str:
    return method.replace(":", "-").replace(",", "_")


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def playoff_contenders(screened: dict[str, list[dict]], builtin: dict[str, str]) -> list[str]:
    med = {m: statistics.median(r["samples_per_s"] for r in rs) for m, rs in screened.items() if m.startswith("parts:")}
    top = sorted(med, key=med.get, reverse=True)[:SCREEN_TOP]
    chosen = [split_method(r["parts"]) for r in screened["profiled"]]
    return list(dict.fromkeys(["profiled", *builtin.values(), *top, *chosen]))


def playoff(model: str, contenders: list[str], args, out: Path) -> list[dict[str, dict]]:
    """``--cycles`` cycles of every contender, one launch a cycle, each rotated by one: per cycle, method -> record.

    One launch a cycle, not one for all: v8's single playoff launch (30-36 builds) slowed as it went,
    by up to 22% from its first cycle to its last, unevenly across splits (the balanced ones most),
    and a fresh launch right after measured the first cycle's figures again.  A launch's builds
    leave process state behind (5 process groups, 15 gloo threads and 23 sockets a build, and the
    last stage's heap grows), so a cycle's builds share a young process instead."""
    orders = [contenders[c % len(contenders):] + contenders[:c % len(contenders)] for c in range(args.cycles)]
    if args.playoff_launch == "build":
        print(f"playoff: {model}, {len(contenders)} contenders x {args.cycles} cycles, one launch a build", flush=True)
        return [{m: run_launch(model, [m], out / "playoff-builds" / model / f"cycle{c}" / slug(m), args,
                               args.playoff_steps, warm_build=False)[0] for m in order}
                for c, order in enumerate(orders)]
    if (out / "playoff" / model / "metrics.json").is_file():  # v7, v8: every cycle in one launch, read back
        records = run_launch(model, [m for order in orders for m in order], out / "playoff" / model, args,
                             args.playoff_steps)
        n = len(contenders)
        return [{r["method"]: r for r in records[c * n:(c + 1) * n]} for c in range(args.cycles)]
    print(f"playoff: {model}, {len(contenders)} contenders x {args.cycles} cycles, one launch a cycle", flush=True)
    return [{r["method"]: r for r in run_launch(model, order, out / "playoff" / model / f"cycle{c}", args,
                                                 args.playoff_steps)} for c, order in enumerate(orders)]


def score(model: str, screened: dict[str, list[dict]], cycles: list[dict[str, dict]], builtin: dict[str, str],
          rounds: int) -> dict:
    sps = lambda recs: [r["samples_per_s"] for r in recs]  # noqa: E731
    # the screen: the whole curve
    best_screen = max((m for m in screened if m.startswith("parts:")), key=lambda m: statistics.median(sps(screened[m])))
    top = statistics.median(sps(screened[best_screen]))
    label = lambda m: m + "".join(f" ({k})" for k, v in builtin.items() if v == m)  # noqa: E731 - uniform, parameters
    rows = [[label(m), " ".join(sorted({str(r["parts"]) for r in recs})), spread(sps(recs)),
             f"{statistics.median(sps(recs)) / top:.3f}"] for m, recs in screened.items()]
    print(f"\n{model}, screen: samples/s, median [min-max] over {rounds} rounds (one build each)")
    print("\n".join(render_table(["method", "parts", "samples/s", "vs best split"], rows)))
    noisy = max(max(v) / min(v) for v in (sps(screened[m]) for m in screened if m.startswith("parts:")))
    print(f"largest round-to-round ratio of one split: {noisy:.2f}x")
    # the playoff: ratios within a cycle
    contenders = list(cycles[0])
    med = {m: statistics.median(c[m]["samples_per_s"] for c in cycles) for m in contenders}
    splits = [m for m in contenders if m.startswith("parts:")]
    best = max(splits, key=med.get)
    best_builtin = max(set(builtin.values()), key=med.get)
    ratio = lambda a, b: [c[a]["samples_per_s"] / c[b]["samples_per_s"] for c in cycles]  # noqa: E731
    vs_best, vs_builtin = ratio("profiled", best), ratio("profiled", best_builtin)
    rows = [[label(m) + (" (best split)" if m == best else ""),
             " ".join(sorted({str(c[m]["parts"]) for c in cycles})), spread([c[m]["samples_per_s"] for c in cycles]),
             spread(ratio("profiled", m)) if m != "profiled" else "-"] for m in contenders]
    print(f"\n{model}, playoff: samples/s, median [min-max] over {len(cycles)} cycles")
    print("\n".join(render_table(["method", "parts", "samples/s", "profiled / it, per cycle"], rows)))
    print(f"profiled / best split {best}: {spread(vs_best)}; / best built-in {best_builtin}: {spread(vs_builtin)}; "
          f"best split / best built-in: {spread(ratio(best, best_builtin))}")
    return {"vs_best": statistics.median(vs_best), "vs_builtin": statistics.median(vs_builtin),
            "cycles_vs_best": vs_best, "cycles_vs_builtin": vs_builtin, "best_split": best,
            "best_builtin": best_builtin, "screen_best_split": best_screen}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="screen rounds (every split once a round)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=16, help="micro-batches per step (gradient accumulation)")
    ap.add_argument("--cycles", type=int, default=6, help="playoff cycles (every contender once a cycle)")
    ap.add_argument("--playoff-steps", type=int, default=4,
                    help="steps per playoff build: 1 warm-up, the median of the others (one timed step moves by 5-10%%)")
    ap.add_argument("--playoff-launch", choices=["build", "cycle"], default="build",
                    help="build: each playoff build its own launch, as a user runs it (A B C .. launches); "
                         "cycle: a cycle's builds in one launch (faster; the launch's later builds drift)")
    ap.add_argument("--out", default=None, help="default runs/partition-speedup-v9 (runs/partition-speedup-MODEL)")
    ap.add_argument("--model", default=None, help="one model (bench-cpu-llama, bench-cpu-moe) instead of the GPT pair")
    ap.add_argument("--predict-only", action="store_true", help="print the step model's prediction and stop")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    if args.smoke:
        import tempfile

        args.rounds, args.cycles, args.playoff_steps, args.playoff_launch = 1, 1, 2, "cycle"
        args.micro_batches, args.out = 4, args.out or tempfile.mkdtemp(prefix="ds_pipe_ext_speedup_")
    models = [args.model] if args.model else SMOKE_MODELS if args.smoke else MODELS
    out = Path(args.out or ("runs/partition-speedup-" + args.model if args.model else "runs/partition-speedup-v9")).resolve()
    prediction = None
    if args.model and family_of(load_model(args.model)).name in PREDICTED_FAMILIES:
        prediction = recorded_prediction(args.model, args.micro_batches, out)
        if args.predict_only:
            return
    methods = {model: ["profiled"] + [f"parts:0,{k},{n}" for k in range(1, n)]
               for model, n in ((model, len(layer_specs(model))) for model in models)}
    print(f"{len(models)} models: screen of {'/'.join(str(len(m)) for m in methods.values())} methods x {args.rounds} "
          f"rounds, then a playoff of "
          f"{args.cycles} cycles; micro-batch {args.micro_batch} x {args.micro_batches}; in {out}", flush=True)
    screened: dict[str, dict[str, list[dict]]] = {model: {} for model in models}
    for rnd in range(args.rounds):  # rounds outermost, the models interleaved, so drift hits both alike
        for model in (models if rnd % 2 == 0 else models[::-1]):
            order = methods[model] if rnd % 2 == 0 else methods[model][::-1]
            print(f"screen round {rnd}: {model}", flush=True)
            for r in run_launch(model, order, out / f"round{rnd}" / model, args, SCREEN_STEPS):
                screened[model].setdefault(r["method"], []).append(r)
    results = {}
    for model in models:
        builtin = builtin_parts(model)
        contenders = playoff_contenders(screened[model], builtin)
        cycles = playoff(model, contenders, args, out)
        results[model] = score(model, {m: screened[model][m] for m in methods[model]}, cycles, builtin, args.rounds)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"screen": screened, "scores": results}, indent=1))
    if args.model:
        return report_one(args.model, results[args.model], builtin_parts(args.model), prediction)
    a, b = results[models[0]], results[models[1]]
    print(f"\nsecond model: profiled / best built-in {b['vs_builtin']:.3f}")
    print(f"RESULT profiled_vs_builtin={a['vs_builtin']:.3f} profiled_vs_best_split={a['vs_best']:.3f} "
          f"second_model_profiled_vs_best_split={b['vs_best']:.3f}")


def recorded_prediction(model: str, micro_batches: int, out: Path) -> dict:
    """The step model's prediction for ``model``, made once before the first launch and kept in
    OUT/prediction.json (a later run reads it: the prediction is the one made before measuring)."""
    path = out / "prediction.json"
    if path.is_file():
        prediction = json.loads(path.read_text())
        print(f"prediction recorded before the first launch ({path}):")
    else:
        if any(out.glob("round*")):
            raise SystemExit(f"{out} holds launches but no prediction.json: the prediction must come first")
        print(f"{model}: profiling its layers here (no launch) for the step model's prediction", flush=True)
        prediction = predict_before_launch(model, micro_batches)
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(prediction, indent=1))
    best = prediction["best_split"]
    rows = [[name, builtin_parts(model)[name], f"{s:.2f}", f"{s / prediction['splits'][best]:.3f}"]
            for name, s in prediction["builtin"].items()]
    rows.append(["best split", best, f"{prediction['splits'][best]:.2f}", "1.000"])
    print("\n".join(render_table(["method", "parts", "predicted step s", "/ best split"], rows)))
    print(f"predicted profiled / best built-in: {prediction['profiled_vs_builtin']:.3f} (median layer times of "
          f"{len(prediction['each_profile'])} profiles; each alone: "
          f"{', '.join(f'{r:.3f}' for r in prediction['each_profile'])})", flush=True)
    return prediction


def report_one(model: str, result: dict, builtin: dict[str, str], prediction: dict | None = None) -> None:
    """--model: the prediction made before the launches (MoE, hybrid), the heuristics' names and the simulated 4-
    and 8-stage comparison of the hand rules on the family's published model (Llama, hybrid), then the RESULT line."""
    family = family_of(load_model(model)).name
    if prediction is not None:  # the measurement beside the prediction made before it
        print(f"\npredicted before the first launch (step model {STEP_MODEL.name} on layers profiled here): "
              f"profiled / best built-in {prediction['profiled_vs_builtin']:.3f}, best split {prediction['best_split']}")
    simulated = SIMULATED.get(model) or (SIMULATED["bench-cpu-llama"] if family == "llama" else None)
    if simulated:
        same = [k for k, v in builtin.items() if v == builtin["uniform"] and k != "uniform"]
        if same:
            print(f"\nat 2 stages {', '.join(same)} = DeepSpeed's uniform ({builtin['uniform']}): Megatron's "
                  f"embedding-and-loss accounting and Llama 3's one layer fewer at the ends give each stage "
                  f"(blocks + 2) / 2 units")
        print(f"\nsimulated (no launch), {simulated}'s analytic costs on H100, 1F1B, micro-batch 1 x 32: "
              f"predicted step; '(over)': the split's heaviest rank above the memory cap (0.9 of the H100's), which the analytic split honours where it can")
        print("\n".join(render_table(["stages", "rule", "parts", "step s", "analytic / it", "peak GiB"],
                                      simulated_rules(simulated))))
    print(f"calibrated: the step model {STEP_MODEL.name} (bench/prediction_transfer.py's two GPT calibration runs) "
          f"and the cpu spec; predicted: every {model} measurement above")
    if family == "llama":
        print(f"RESULT llama_profiled_vs_best_heuristic={result['vs_builtin']:.3f} "
              f"llama_profiled_vs_best_split={result['vs_best']:.3f}")
    elif model in RESULT_PREFIX:
        key = RESULT_PREFIX[model]
        print(f"RESULT {key}_profiled_vs_builtin={result['vs_builtin']:.3f} {key}_profiled_vs_best_split={result['vs_best']:.3f}")
    else:  # one of the GPT pair alone: its two figures
        print(f"RESULT profiled_vs_builtin={result['vs_builtin']:.3f} profiled_vs_best_split={result['vs_best']:.3f}")


if __name__ == "__main__":
    main()
