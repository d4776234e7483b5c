"""Calibrate the A100 and H100 specs on published Megatron-LM runs; predict published runs never fitted.

    python bench/calibrate_at_scale.py [--out runs/calibration/CALIBRATION.md]   (docs/CALIBRATION.md: the committed copy)

For every row of bench/data's fitted tables (Narayanan et al. 2021 Table 1 on A100;
Megatron-core's H100 table) the planner's own model predicts one iteration
(``plan.model.PlanModel.evaluate`` under the ``megatron`` runtime, Megatron's even split: per-layer
roofline with TP collectives, the stage model, the event simulator, the DP gradient reduction as
the row's settings run it, the optimizer step) and from it the TFLOP/s per GPU *as each source
counts them*; the planner then uses the efficiencies fitted through it.  Each device's factors are fitted
by least squares on log throughput, each bounded by what the hardware measurably reaches (``CEILINGS``):
the GEMM efficiency on both, and on H100 the attention kernel's too (Megatron-core runs a flash kernel
there; the datasheet default of 0.5 is an unfused one).  The GEMM size at which the efficiency halves and
the links' efficiency are fixed (0 and 1), not fitted: free, the first drifted between 1e-11 and 2.5e-6
with the same errors and the second sat on its bound, so the data cannot pin them down.  *before*: the
fit this replaced (the GEMM efficiency alone, bounded by 1: 0.889 on H100, beyond any H100's GEMMs).
Leave-one-out: each row is predicted by a fit that did not see it; the bench prints the fitted
parameter's range over those fits.  The 22B-layer table (Korthikanti et al. 2022) is predicted with
the A100 fit, never fitted.

The **predicted set** (``bench/data/published_at_scale.csv``, never fitted): published A100 runs of
DeepSpeed's pipeline engine (MT-NLG, BLOOM, GPT-NeoX-20B), ZeRO-3 without model parallelism and
Megatron-LM's deep pipelines, each with its source, cluster, FLOP convention and the fields it leaves
open ("assumed": reported apart).  Each is predicted by the A100 fit through the current model and the
model without this issue's runtime terms (``PlanModel(runtime_terms=False)``), errors on iteration time.

Ends with ``RESULT fitted_mean_error_pct=A predicted_mean_error_pct=B predicted_max_error_pct=C``
(A: leave-one-out over both fitted tables; B, C: every predicted row).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_pipe_ext.costs.estimate import EstimateRequest, estimate_layers  # noqa: E402
from ds_pipe_ext.costs.gpu_pricing import gpu_kernels  # noqa: E402
from ds_pipe_ext.costs.hardware import DEVICES  # noqa: E402
from ds_pipe_ext.plan.machine import Cluster  # noqa: E402
from ds_pipe_ext.plan.model import PlanModel  # noqa: E402
from ds_pipe_ext.layout import DEEPSPEED_ZERO3_DEFAULTS, Layout  # noqa: E402
from ds_pipe_ext.models.gpt_config import GPTConfig  # noqa: E402
from ds_pipe_ext.partition.hand_rules import even_blocks, uniform_layers  # noqa: E402
from ds_pipe_ext.partition.report import render_table  # noqa: E402
from ds_pipe_ext.pipe import schedules as _deepspeed_order  # noqa: E402,F401  (registers DeepSpeed's engine order)
from ds_pipe_ext.runner import SMOKE_HELP  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "bench" / "data"  # the published tables (bench/data/README.md: their sources)
PREDICTED = ROOT / "bench" / "data" / "published_at_scale.csv"
SMOKE = False  # --smoke: three rows a fitted table, one a predicted group
FIXED = {"matrix_half_dim": 0.0, "comm_efficiency": 1.0}  # not pinned down by the data: fixed, not fitted
# DeepSpeed's defaults (a published ZeRO-3 row states none of them): reduce bucket, prefetch, persistence
DEEPSPEED_ZERO_DEFAULTS = DEEPSPEED_ZERO3_DEFAULTS  # `plan --only ...,buckets=deepspeed`

def flops_with_recompute(B: int, s: int, L: int, h: int, V: int) -> float:
    """Narayanan et al.'s count, the recomputed forward included (Megatron-DeepSpeed's and GPT-NeoX's logs
    use it too): 96 B s L h^2 (1 + s / 6h + V / 16Lh)."""
    return 96.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def model_flops(B: int, s: int, L: int, h: int, V: int) -> float:
    """The count without the recomputed forward (model FLOPs): 72 B s L h^2 (1 + s / 6h + V / 12Lh)."""
    return 72.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


# What each source leaves open, and what we assume (stated in the report)
SOURCES = {
    "a100": dict(
        file="megatron_2021_table1.csv", device="a100-80gb", vocab=51200, seq=2048, dropout=0.1, dtype="fp16",
        attention="eager",  # 2021: Megatron's fused scale-mask-softmax over the written-out s x s scores
        # Megatron-LM of August 2021 (sc21's scripts): each weight gradient added into main_grad by its hook (local
        # DDP) or by autograd (torch DDP), gradient_accumulation_fusion came in February 2022
        execution="megatron-2021",
        # Selene: DGX A100 (AMD hosts), 8 x 200 Gb/s HDR rails; NCCL 2.8 (v2.8.4, February 2021: the paper's runs)
        cluster=Cluster(8, 300e9, 25e9, compute_capability=80, name="DGX A100", nccl_version="2.8", host_cpu="amd"),
        layout=lambda r: dict(micro_batch=int(r["micro_batch"]), interleave=int(r["interleave_chunks"]),
                              recompute="full", sp=False, overlap_comm=False, zero=0),
        flops=flops_with_recompute,  # the paper counts the recomputed forward
        assumptions=["micro-batch and interleaving from Megatron-LM's sc21/run_table_1.sh (given in the table)",
                     "full activation recompute on every row (the paper's setting); fp16 with fp32 master weights",
                     "dropout 0.1 (Megatron's default), fused (1-byte masks); vocabulary 51200, sequence 2048",
                     "gradient all-reduce in fp16, not overlapped with backward (Megatron-LM 2021)",
                     "each micro-batch's weight gradients added into the accumulated ones in fp16 by a pass of their "
                     "own (Megatron-LM 2021: no fused accumulation; --accumulate-allreduce-grads-in-fp32 not set)",
                     "8 x A100-80GB per node on NVLink (300 GB/s a direction), one 200 Gb/s HDR NIC per GPU"]),
    "h100": dict(
        file="megatron_core_h100.csv", device="h100-sxm", vocab=131072, seq=4096, dropout=0.0, dtype="bf16",
        attention="sdpa",  # Megatron-core: Transformer Engine's fused attention
        execution="megatron",  # weight gradients accumulated inside the GEMMs (gradient_accumulation_fusion)
        cluster=Cluster(8, 450e9, 50e9, name="DGX H100"),
        layout=lambda r: dict(micro_batch=1, interleave=1, recompute="selective", sp=int(r["tp"]) > 1,
                              overlap_comm=True, zero=1),  # ZeRO-1: Megatron's distributed optimizer
        # model FLOPs without recompute (Megatron-LM's num_floating_point_operations; MFU = this / 989 TFLOP/s)
        flops=model_flops,
        assumptions=["micro-batch 1 (not stated)", "selective recompute, sequence parallelism whenever TP > 1 "
                     "(not stated; Megatron-core's recommended settings)", "no interleaving (not stated)",
                     "DP gradient reduce-scatter and parameter all-gather overlapped (the README: overlap on), "
                     "distributed optimizer", "bf16 with fp32 master weights; no dropout; vocabulary 131072, "
                     "sequence 4096", "8 x H100 SXM per node on NVLink 4 (450 GB/s a direction), one 400 Gb/s NIC "
                     "per GPU"]),
}

# What each device's fit frees: the GEMM ceiling of its kernels (``costs.gpu_pricing``), at most what cuBLAS
# measurably reaches on it (the kernel figures' own value, stas00/ml-engineering's table); every other kernel
# figure (alignment, waves, fill, attention, streaming) is the device's as the planner prices it
FITS = {"a100": ("gemm_efficiency",), "h100": ("gemm_efficiency",)}
CEILINGS = {name: {k: getattr(gpu_kernels(SOURCES[name]["device"]), k) for k in params}
            for name, params in FITS.items()}
BEFORE = {"gemm_efficiency": 1.0}  # the fit unbounded by the hardware: what the rows alone would ask for


def kernel_device(name: str, params: dict, **changes):
    """A datasheet spec with its GPU kernel figures, ``params`` (the fitted ones) in place."""
    kern = gpu_kernels(name)
    return replace(DEVICES[name], **FIXED, **changes, gpu=replace(kern, **params))
LOWER = 0.2


def megatron_layout(tp: int, pp: int, dp: int, global_batch: int, *, micro_batch: int, interleave: int,
                    **rest) -> Layout:
    """A published row's layout as Megatron-LM ran it (interleave: virtual stages a rank)."""
    schedule = f"interleaved:{interleave}" if interleave > 1 else None
    return Layout(tp=tp, pp=pp, dp=dp, micro_batch=micro_batch, micro_batches=global_batch // (micro_batch * dp),
                  schedule=schedule, runtime="megatron", **rest)


def load_rows(name: str) -> list[dict]:
    src = SOURCES[name]
    rows = []
    with open(DATA / src["file"]) as f:
        for r in csv.DictReader(f):
            cfg = GPTConfig(name=f"{r['params_b']}B", vocab_size=src["vocab"], hidden=int(r["hidden"]),
                            layers=int(r["layers"]), heads=int(r["heads"]), seq_len=src["seq"], dropout=src["dropout"],
                            attention=src["attention"])
            layout = megatron_layout(int(r["tp"]), int(r["pp"]), int(r["dp"]), int(r["global_batch"]),
                                     **src["layout"](r))
            flops = src["flops"](layout.global_batch, cfg.seq_len, cfg.layers, cfg.hidden, cfg.vocab_size)
            rows.append({"cfg": cfg, "layout": layout, "flops": flops, "published": float(r["tflops_per_gpu"])})
    return rows[:3] if SMOKE else rows


def megatron_parts(layers: int, chunks: int) -> list[int]:
    """Megatron-LM's split: the blocks evenly over the model chunks, the embedding with the first, the
    head and loss with the last (pipeline layers: embedding, blocks, head): `plan --only ...,split=even`."""
    return even_blocks(layers, chunks)


def accumulating(execution: str, lay: Layout) -> str:
    """``execution`` where a step accumulates micro-batches; one micro-batch accumulates nothing: torch DDP's
    and DeepSpeed's gradient is then autograd's own tensor (Megatron's local DDP adds it into ``main_grad``
    even then, but its rows here all accumulate)."""
    return "megatron" if lay.micro_batches == 1 else execution


def predict(rows: list[dict], name: str, x: np.ndarray, fitted: dict) -> np.ndarray:
    """Each row's step through the planner's own model (runtime megatron) on the device with ``x``, the
    values of ``fitted``'s parameters in its order."""
    src = SOURCES[name]
    device = kernel_device(src["device"], dict(zip(fitted, map(float, x))))
    out = []
    for r in rows:
        cfg, lay = r["cfg"], r["layout"]
        model = PlanModel(cfg, device, src["cluster"], seq=cfg.seq_len, global_batch=lay.global_batch,
                          dtype=src["dtype"], execution=accumulating(src["execution"], lay))
        step = model.evaluate(lay, megatron_parts(cfg.layers, lay.num_chunks), check_memory=False).step_s
        out.append(r["flops"] / (step * lay.world_size) / 1e12)
    return np.array(out)


def fit(rows: list[dict], name: str, ceilings: dict) -> np.ndarray:
    """Least squares on log throughput, each parameter between LOWER and its ceiling."""
    published = np.array([r["published"] for r in rows])
    upper = np.array(list(ceilings.values()))
    res = least_squares(lambda x: np.log(predict(rows, name, x, ceilings) / published), 0.95 * upper,
                        bounds=(np.full(len(upper), LOWER), upper), x_scale=np.full(len(upper), 0.1))
    return res.x


def calibrate(name: str, ceilings: dict | None = None) -> dict:
    ceilings = ceilings or CEILINGS[name]
    rows = load_rows(name)
    x = fit(rows, name, ceilings)
    fitted = predict(rows, name, x, ceilings)
    loo_fits = [fit(rows[:i] + rows[i + 1:], name, ceilings) for i in range(len(rows))]
    loo = [float(predict([r], name, xi, ceilings)[0]) for r, xi in zip(rows, loo_fits)]
    table = []
    for r, f, held_out in zip(rows, fitted, loo):
        lay = r["layout"]
        table.append({"model": r["cfg"].name, "layout": f"tp{lay.tp} pp{lay.pp} dp{lay.dp} b{lay.micro_batch} "
                      f"B{lay.global_batch}" + (f" v{lay.chunks_per_rank}" if lay.chunks_per_rank > 1 else ""),
                      "published": r["published"], "fitted": float(f), "fit_error_pct": 100 * (f / r["published"] - 1),
                      "loo": held_out, "loo_error_pct": 100 * (held_out / r["published"] - 1)})
    ranges = {k: (float(min(xi[j] for xi in loo_fits)), float(max(xi[j] for xi in loo_fits)))
              for j, k in enumerate(ceilings)}
    return {"name": name, "params": dict(zip(ceilings, map(float, x))), "ceilings": dict(ceilings), "rows": table,
            "loo_ranges": ranges,
            "loo_mean_abs_error_pct": statistics.fmean(abs(t["loo_error_pct"]) for t in table),
            "fit_mean_abs_error_pct": statistics.fmean(abs(t["fit_error_pct"]) for t in table)}


GROUPS = {"deepspeed-engine": "DeepSpeed's pipeline engine", "deep-pipeline": "deep pipelines (35+ stages)",
          "zero3": "ZeRO-3 without model parallelism", "megatron": "Megatron-LM, shallower"}


def load_predicted() -> list[dict]:
    """The predicted set: every row's model, layout, cluster and published iteration time (a TFLOP/s figure
    converted by its source's own FLOP count)."""
    rows = []
    with open(PREDICTED) as f:
        for r in csv.DictReader(f):
            i = {k: int(r[k]) for k in ("layers", "hidden", "heads", "vocab", "seq", "tp", "pp", "dp", "global_batch",
                                         "micro_batch", "interleave", "sp", "zero", "overlap_comm", "gpus_per_node")}
            # every predicted row ran in 2021-2022 on A100s: the attention written out, before FlashAttention
            cfg = GPTConfig(name=r["name"], vocab_size=i["vocab"], hidden=i["hidden"], layers=i["layers"],
                            heads=i["heads"], seq_len=i["seq"], dropout=float(r["dropout"]),
                            tie_embeddings=bool(int(r["tied"])), attention="eager")
            lay = Layout(tp=i["tp"], pp=i["pp"], dp=i["dp"], micro_batch=i["micro_batch"], sp=bool(i["sp"]),
                         micro_batches=i["global_batch"] // (i["micro_batch"] * i["dp"]), zero=i["zero"],
                         recompute=r["recompute"], overlap_comm=bool(i["overlap_comm"]), runtime=r["runtime"],
                         schedule=f"interleaved:{i['interleave']}" if i["interleave"] > 1 else None)
            if r["lp_grads"] not in ("", "none", "zero"):
                raise ValueError(f"{PREDICTED.name}: {r['name']}: lp_grads {r['lp_grads']!r} (none: BF16_Optimizer set "
                                 f"the 16-bit gradients to None before each backward, zero: zeroed them, as 0.19 does)")
            published = float(r["published"])
            if r["convention"] in ("tflops96", "tflops72"):
                count = model_flops if r["convention"] == "tflops72" else flops_with_recompute
                flops = count(lay.global_batch, cfg.seq_len, cfg.layers, cfg.hidden, cfg.vocab_size)
                published = flops / (published * 1e12 * lay.world_size)
            elif r["convention"] != "iter_s":
                raise ValueError(f"{PREDICTED.name}: {r['name']}: convention {r['convention']!r} "
                                 f"(iter_s | tflops96 | tflops72)")
            if r["zero3_gather"] not in ("", "synchronized"):
                raise ValueError(f"{PREDICTED.name}: {r['name']}: zero3_gather {r['zero3_gather']!r} (synchronized: "
                                 f"DeepSpeed 0.3.12-0.4.x, a gather a parameter after torch.cuda.synchronize())")
            # every predicted row ran on A100 nodes of 8 on NVLink, its cluster's NICs, its era's NCCL
            nics = int(r["nics_per_node"])  # the node's NICs, inter_gbs_per_gpu being each GPU's share of them
            cluster = Cluster(i["gpus_per_node"], float(r["intra_gbs"]) * 1e9,
                              float(r["inter_gbs_per_gpu"]) * i["gpus_per_node"] / nics * 1e9, nics_per_node=nics,
                              compute_capability=80, name="DGX A100" if r["cluster"] == "selene" else r["cluster"],
                              nccl_version=r["nccl"] or "2.30", host_cpu="amd")  # A100 nodes: AMD EPYC hosts
            rows.append({"row": r, "cfg": cfg, "layout": lay, "cluster": cluster, "published_s": published,
                         "assumed": [a for a in r["assumed"].split(";") if a]})
    if SMOKE:  # a row of each group, a complete one (no assumed field) where the group has one
        return [min((r for r in rows if r["row"]["group"] == g), key=lambda r: len(r["assumed"]))
                for g in dict.fromkeys(r["row"]["group"] for r in rows)]
    return rows


def row_parts(r: dict) -> list[int]:
    """The split the run used: Megatron's (and Megatron-DeepSpeed's ``type:transformer``) blocks evenly with
    the embedding first and the head last; ``uniform-N``: DeepSpeed's uniform split of N weighted layers."""
    lay, layers = r["layout"], r["cfg"].layers
    if r["row"]["split"].startswith("uniform"):  # `plan --only ...,split=uniform`
        return uniform_layers(layers + 2, lay.num_chunks)
    return megatron_parts(layers, lay.num_chunks)  # `split=even`


def predict_row(r: dict, params: dict, *, runtime_terms: bool = True) -> float:
    """A predicted-set row's iteration time with the A100 fit's ``params`` (without the runtime terms where
    ``runtime_terms`` is off)."""
    row, lay, cfg, cluster = r["row"], r["layout"], r["cfg"], r["cluster"]
    # the row's cluster prices every collective, TP's inside the layers too (PlanModel hands it to the device)
    device = kernel_device(row["device"], params)
    model = PlanModel(cfg, device, cluster, seq=cfg.seq_len, global_batch=lay.global_batch, dtype=row["dtype"],
                      zero_settings=DEEPSPEED_ZERO_DEFAULTS, runtime_terms=runtime_terms,
                      grad_accum_dtype=row["grad_accum_dtype"] or None, execution=accumulating(row["execution"], lay),
                      lp_grads_to_none=row["lp_grads"] == "none",
                      zero3_synchronized=runtime_terms and row["zero3_gather"] == "synchronized")
    return model.evaluate(lay, row_parts(r), check_memory=False).step_s


def check_disjoint(predicted: list[dict]) -> None:
    """No predicted row is a fitted one: the same model shape on the same degrees and batch."""
    def key(hidden, layers, tp, pp, dp, batch):
        return tuple(int(v) for v in (hidden, layers, tp, pp, dp, batch))

    fitted = {key(r["cfg"].hidden, r["cfg"].layers, r["layout"].tp, r["layout"].pp, r["layout"].dp,
                  r["layout"].global_batch) for name in SOURCES for r in load_rows(name)}
    for r in predicted:
        lay = r["layout"]
        if key(r["cfg"].hidden, r["cfg"].layers, lay.tp, lay.pp, lay.dp, lay.global_batch) in fitted:
            raise SystemExit(f"{r['row']['name']}: this run is in the fitted set; a predicted row must not be")


def predicted_table(a100: dict) -> list[dict]:
    eff = a100["params"]
    rows = load_predicted()
    check_disjoint(rows)
    out = []
    for r in rows:
        now, before = predict_row(r, eff), predict_row(r, eff, runtime_terms=False)
        out.append({**r, "predicted_s": now, "before_s": before,
                    "error_pct": 100 * (now / r["published_s"] - 1), "before_error_pct": 100 * (before / r["published_s"] - 1)})
    return out


def layer_table(a100: dict) -> list[list[str]]:
    """Korthikanti Table 4: one 22B layer (h 6144, 64 heads, s 2048, b 4, TP 8), predicted with the A100 fit."""
    device = kernel_device("a100-80gb", a100["params"])
    cfg = GPTConfig(name="22B", vocab_size=51200, hidden=6144, layers=48, heads=64, seq_len=2048, dropout=0.1,
                    attention="eager")
    out = []
    with open(DATA / "megatron_2022_table4_layer.csv") as f:
        for r in csv.DictReader(f):
            v = r["variant"]
            req = EstimateRequest(micro_batch=4, seq=2048, tp=8, sp="sequence_parallel" in v, dtype="fp16",
                                  selective_recompute="selective" in v, execution="megatron")
            block = estimate_layers(cfg, req, device)[1]
            fwd, bwd = 1e3 * block["fwd_s"], 1e3 * (block["bwd_s"] + (block["fwd_s"] if v == "full_recompute" else 0))
            out.append([v, r["forward_ms"], f"{fwd:.1f}", r["backward_ms"], f"{bwd:.1f}",
                        f"{100 * ((fwd + bwd) / float(r['combined_ms']) - 1):+.1f}"])
    return out


def report(results: list[dict], layers: list[list[str]], before: dict[str, dict]) -> str:
    lines = ["# Calibration at scale: what was fitted, and what was predicted", "",
             "Produced by `python bench/calibrate_at_scale.py` (analytic model only; no GPU was used).",
             "TFLOP/s per GPU as each source counts them. *fitted*: the fit on all rows of the table; "
             "*leave-one-out*: the row predicted by a fit on the other rows. The **fitted set** is these two tables "
             "(`bench/data`: Narayanan et al. 2021's Table 1, Megatron-core's H100 table), nothing else; the **predicted set** (last section) was never fitted.", ""]
    for res in results:
        src, old = SOURCES[res["name"]], before[res["name"]]
        at_ceiling = [k for k, v in res["params"].items() if v >= res["ceilings"][k] - 1e-3]
        lines += [f"## {res['name'].upper()} ({src['file']})", "", "Fitted (everything else is the "
                  f"datasheet's `{src['device']}` spec): " + ", ".join(
                      f"`{k}` = {v:.3f} (its ceiling {res['ceilings'][k]:.2f}; leave-one-out fits: "
                      f"{res['loo_ranges'][k][0]:.3f} to {res['loo_ranges'][k][1]:.3f})"
                      for k, v in res["params"].items()) + "; fixed, not fitted: "
                  + ", ".join(f"`{k}` = {v:g}" for k, v in FIXED.items())
                  + (f". At its ceiling: {', '.join(f'`{k}`' for k in at_ceiling)} (the rows ask for more)"
                     if at_ceiling else "") + ". *before*: " + ", ".join(
                      f"`{k}` = {v:.3f}" for k, v in old["params"].items()) + " (bounded by 1)",
                  "", "Assumptions: " + "; ".join(src["assumptions"]) + ".", "", "```"]
        lines += render_table(["model", "layout", "published", "fitted", "err %", "leave-one-out", "err %",
                               "before fitted err %", "before leave-one-out err %"],
                              [[t["model"], t["layout"], f"{t['published']:.1f}", f"{t['fitted']:.1f}",
                                f"{t['fit_error_pct']:+.1f}", f"{t['loo']:.1f}", f"{t['loo_error_pct']:+.1f}",
                                f"{b['fit_error_pct']:+.1f}", f"{b['loo_error_pct']:+.1f}"]
                               for t, b in zip(res["rows"], old["rows"])])
        lines += ["```", "", f"Mean |error|: fitted {res['fit_mean_abs_error_pct']:.1f}%, leave-one-out "
                  f"{res['loo_mean_abs_error_pct']:.1f}% (before: {old['fit_mean_abs_error_pct']:.1f}%, "
                  f"{old['loo_mean_abs_error_pct']:.1f}%).", ""]
    lines += ["## One 22B layer (Korthikanti et al. 2022, Table 4), predicted with the A100 fit (not fitted)", "", "```"]
    lines += render_table(["variant", "fwd ms pub", "fwd ms pred", "bwd ms pub", "bwd ms pred", "total err %"], layers)
    lines += ["```", ""]
    from ds_pipe_ext.plan.published import PUBLISHED

    lines += ["## Published runs set beside `plan --only` (predicted, never fitted)", "",
              "No parameter above was fitted to these rows; `plan --only` with a row's layout prints the prediction "
              "beside the published figure (docs/results/2026-11-25-llama-and-hugging-face.md has Llama 3 405B's, with the assumed schedule).", "", "```"]
    lines += render_table(["run", "model", "GPUs", "layout", "precision", "published TFLOP/s", "source"],
                          [[r.name, r.model, str(r.gpus), f"tp{r.tp} pp{r.pp} dp{r.dp}", r.precision,
                            f"{r.tflops_per_gpu:.0f}" if r.tflops_per_gpu else f"not modelled: {r.not_modelled}",
                            r.source] for r in PUBLISHED])
    lines += ["```", ""]
    return "\n".join(lines)


def mean_abs(values) -> float:
    values = [abs(v) for v in values]
    return statistics.fmean(values) if values else float("nan")


def predicted_report(rows: list[dict]) -> str:
    """The predicted set, row by row and by group, beside the model before this issue's terms."""
    lines = ["## Predicted set: published A100 runs no parameter was fitted to", "",
             f"`{PREDICTED.relative_to(ROOT)}` (one row per run: source, cluster, FLOP convention, settings). Iteration "
             "time in seconds: a source giving TFLOP/s per GPU is converted by its own FLOP count (`tflops96`: "
             "96 B s L h^2 (1 + s/6h + V/16Lh), the recomputed forward counted, as Megatron-LM 2021, "
             "Megatron-DeepSpeed and GPT-NeoX log it; `tflops72`: 72 B s L h^2 (1 + s/6h + V/12Lh), model FLOPs); "
             "`iter_s`: the source's own seconds. Predicted with the "
             "A100 fit above; *before*: the same model without DeepSpeed's runtime terms (`runtime_terms=False`: ZeRO-3 serial, "
             "BF16_Optimizer's reduction in bf16 and no tied-gradient all-reduce). "
             "*assumed*: a field the source leaves open (reported apart; see the notes below the table).", "", "```"]
    table = []
    for r in rows:
        row, lay = r["row"], r["layout"]
        table.append([row["name"], row["group"], row["runtime"], f"{lay.world_size}",
                      f"tp{lay.tp} pp{lay.pp} dp{lay.dp} b{lay.micro_batch} B{lay.global_batch}"
                      + (f" v{lay.chunks_per_rank}" if lay.chunks_per_rank > 1 else ""),
                      f"{row['recompute']}{' +sp' if lay.sp else ''}", f"zero{lay.zero}", row["cluster"],
                      row["convention"], f"{r['published_s']:.2f}", f"{r['predicted_s']:.2f}", f"{r['error_pct']:+.1f}",
                      f"{r['before_error_pct']:+.1f}", ",".join(r["assumed"]) or "-"])
    lines += render_table(["run", "group", "runtime", "GPUs", "layout", "recompute", "ZeRO", "cluster", "convention",
                           "published s", "predicted s", "err %", "before %", "assumed"], table)
    lines += ["```", "", "By group (mean |error| %, now / before this issue's terms; complete rows: no assumed field):", "", "```"]
    group_rows = []
    for key, title in GROUPS.items():
        members = [r for r in rows if r["row"]["group"] == key]
        complete = [r for r in members if not r["assumed"]]
        group_rows.append([title, str(len(members)), f"{mean_abs(r['error_pct'] for r in members):.1f}",
                           f"{mean_abs(r['before_error_pct'] for r in members):.1f}",
                           f"{max(abs(r['error_pct']) for r in members):.1f}", str(len(complete)),
                           f"{mean_abs(r['error_pct'] for r in complete):.1f}"])
    lines += render_table(["group", "rows", "mean now", "mean before", "max now", "complete", "complete mean now"],
                          group_rows)
    lines += ["```", ""]
    sources = sorted({r["row"]["source"] for r in rows})
    lines += ["Sources:", ""] + [f"- {s}" for s in sources] + [""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "runs" / "calibration" / "CALIBRATION.md"),
                    help="where the report goes (docs/CALIBRATION.md is the committed copy, with its notes)")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    global SMOKE
    SMOKE = args.smoke
    if SMOKE:  # never over a real run's report
        import tempfile

        args.out = str(Path(tempfile.mkdtemp(prefix="ds_pipe_ext_calibration_")) / "CALIBRATION.md")
    results = [calibrate("a100"), calibrate("h100")]
    before = {name: calibrate(name, BEFORE) for name in SOURCES}
    predicted = predicted_table(results[0])
    text = report(results, layer_table(results[0]), before) + "\n" + predicted_report(predicted)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    fitted = [t["loo_error_pct"] for res in results for t in res["rows"]]
    before_fitted = [t["loo_error_pct"] for res in before.values() for t in res["rows"]]
    before_predicted = [100 * (predict_row(r, before["a100"]["params"]) / r["published_s"] - 1) for r in predicted]
    print(f"before (the GEMM efficiency alone, bounded by 1): fitted_mean_error_pct={mean_abs(before_fitted):.2f} "
          f"predicted_mean_error_pct={mean_abs(before_predicted):.2f} "
          f"predicted_max_error_pct={max(map(abs, before_predicted)):.2f}")
    complete = [r for r in predicted if not r["assumed"]]
    print(f"complete rows only ({len(complete)}): mean |error| {mean_abs(r['error_pct'] for r in complete):.2f}%, "
          f"max {max(abs(r['error_pct']) for r in complete):.2f}%")
    print(f"before this issue's terms (all {len(predicted)} rows): mean |error| "
          f"{mean_abs(r['before_error_pct'] for r in predicted):.2f}%, max "
          f"{max(abs(r['before_error_pct']) for r in predicted):.2f}%")
    print(f"RESULT fitted_mean_error_pct={mean_abs(fitted):.2f} "
          f"predicted_mean_error_pct={mean_abs(r['error_pct'] for r in predicted):.2f} "
          f"predicted_max_error_pct={max(abs(r['error_pct']) for r in predicted):.2f}")


if __name__ == "__main__":
    main()
