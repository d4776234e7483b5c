"""The GPU path on a CUDA device (run where a GPU is lent; no test depends on it).

1. Layer times: the embedding, one block and the head + loss of GPT models profiled with CUDA
   events (bf16 and fp32), against the analytic roofline on the datasheet spec of the device
   ("h100": efficiencies at their 0.7 defaults) and on the planner's spec (matrix efficiency fitted
   on published Megatron-LM runs, docs/CALIBRATION.md).  Nothing here was fitted to these layers.
2. The profiler's timer: its CUDA-event forward time against a synchronised wall-clock loop of
   the same block (an independent clock).
3. Memory: saved-activation bytes, analytic against the profiler's saved-tensor hooks, and the
   allocator peak above resting memory during one layer's forward + backward (what the next
   issue, memory at the peak, must predict).
4. (--launches) single-GPU train.py per ZeRO stage (0, 1, 2, 3, 3 + offload) through the same
   launcher and row builder as `ds-pipe-ext compare`, instrumented: the allocator peak and the
   model states each rank recorded, beside the ZeRO rule's prediction.

Not yet run on a GPU: the task that wrote it had none lent (its launch part ran on CPU with
`tiny`: every ZeRO row ok, model states exact).  The first session with a GPU runs it and puts the
figures in docs/RESULTS.md.

    python bench/gpu_path.py [--launches] [--out DIR]

Last line: RESULT device=... block_time_error_pct_datasheet=X block_time_error_pct_planner=Y
timer_agreement_pct=Z activation_bytes_worst_error_pct=W [zero_states_worst_error_pct=V]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs  # noqa: E402
from ds_pipe_ext.costs.hardware import get_device  # noqa: E402
from ds_pipe_ext.costs.layers import build_for_profiling  # noqa: E402
from ds_pipe_ext.costs.profiler import profile_layers  # noqa: E402
from ds_pipe_ext.costs.types import ProfileSettings  # noqa: E402
from ds_pipe_ext.models.config import GPTConfig, load_model_config  # noqa: E402
from ds_pipe_ext.models.gpt import gpt_layer_specs, lm_loss  # noqa: E402
from ds_pipe_ext.partition.report import render_table  # noqa: E402

# (model, micro-batch, sequence, dtype): a block of 1024 and of 2048 hidden, both precisions
CASES = [("gpt2-medium", 8, 1024, "bf16"), ("gpt2-medium", 8, 1024, "fp32"),
         ("gpt3-1.3b", 4, 2048, "bf16"), ("gpt3-1.3b", 4, 2048, "fp32")]
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LAYERS = ("embedding", "block", "head+loss")
MiB = 2**20


def profile_case(name: str, b: int, seq: int, dtype: str):
    cfg = load_model_config(name)
    cfg = GPTConfig.from_dict({**cfg.to_dict(), "seq_len": seq, "tie_embeddings": False}, name=cfg.name)
    specs = gpt_layer_specs(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (b, seq + 1), generator=torch.Generator().manual_seed(0))
    settings = ProfileSettings(warmup=3, repeats=10, cache_dir=None, progress=False)
    measured = profile_layers([specs[0], specs[1], specs[-1]], tokens[:, :-1], labels=tokens[:, 1:],
                              loss_fn=lm_loss, settings=settings, device="cuda", dtype=TORCH_DTYPES[dtype])
    return cfg, specs, measured


def analytic_case(cfg, b: int, seq: int, dtype: str, device):
    rows = analytic_layer_costs(cfg, EstimateRequest(micro_batch=b, seq=seq, dtype=dtype), device)
    return [rows[0], rows[1], rows[-1]]


def wall_clock_forward(spec, x: torch.Tensor, dtype: torch.dtype, n: int = 20) -> float:
    """The block's forward timed by the host clock around synchronised loops: the profiler's
    CUDA events should read the same."""
    module, call = build_for_profiling(spec)
    module.to(device="cuda", dtype=dtype)
    x = x.to("cuda").detach().requires_grad_(True)
    for _ in range(3):
        call(x)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            call(x)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def layer_part() -> dict:
    datasheet, planner = get_device("h100", calibrated=False), get_device("h100")
    rows, block_dat, block_plan, timer, acts = [], [], [], [], []
    for name, b, seq, dtype in CASES:
        cfg, specs, measured = profile_case(name, b, seq, dtype)
        a_dat = analytic_case(cfg, b, seq, dtype, datasheet)
        a_plan = analytic_case(cfg, b, seq, dtype, planner)
        for label, m, ad, ap in zip(LAYERS, measured, a_dat, a_plan):
            t = m.forward_s + m.backward_s
            err_d = 100 * ((ad.forward_s + ad.backward_s) / t - 1)
            err_p = 100 * ((ap.forward_s + ap.backward_s) / t - 1)
            act_err = 100 * (ad.activation_bytes / m.activation_bytes - 1) if m.activation_bytes else 0.0
            rows.append([f"{name} b{b} s{seq} {dtype}", label, f"{1e3 * m.forward_s:.3f}", f"{1e3 * m.backward_s:.3f}",
                         f"{1e3 * m.recompute_s:.3f}", f"{1e3 * (ad.forward_s + ad.backward_s):.3f}", f"{err_d:+.1f}",
                         f"{1e3 * (ap.forward_s + ap.backward_s):.3f}", f"{err_p:+.1f}",
                         f"{m.activation_bytes / MiB:.1f}", f"{ad.activation_bytes / MiB:.1f}", f"{act_err:+.1f}",
                         f"{m.peak_bytes / MiB:.1f}"])
            acts.append(abs(act_err))
            if label == "block":
                block_dat.append(abs(err_d))
                block_plan.append(abs(err_p))
        # the timer check on the block, at its real input (the embedding's output)
        x = torch.randn(b, seq, cfg.hidden, generator=torch.Generator().manual_seed(1))
        wall = wall_clock_forward(specs[1], x.to(TORCH_DTYPES[dtype]), TORCH_DTYPES[dtype])
        timer.append(100 * abs(measured[1].forward_s / wall - 1))
        print(f"  {name} b{b} s{seq} {dtype}: block forward {1e3 * measured[1].forward_s:.3f} ms (CUDA events) vs "
              f"{1e3 * wall:.3f} ms (host clock around synchronised loops)", flush=True)
    print("\n".join(render_table(["case", "layer", "fwd ms", "bwd ms", "recompute ms", "analytic datasheet ms", "err %",
                        "analytic planner ms", "err %", "saved MiB (hooks)", "saved MiB (analytic)", "err %",
                        "allocator peak MiB"], rows)))
    return {"block_time_error_pct_datasheet": round(statistics.median(block_dat), 1),
            "block_time_error_pct_planner": round(statistics.median(block_plan), 1),
            "timer_agreement_pct": round(max(timer), 1),
            "activation_bytes_worst_error_pct": round(max(acts), 1)}


def launch_part(out: Path, model: str, micro_batch: int, steps: int) -> dict:
    """One single-GPU train.py per ZeRO stage, rows as `ds-pipe-ext compare` builds them."""
    from ds_pipe_ext.compare.configs import CompareConfig
    from ds_pipe_ext.compare.predict import model_shape
    from ds_pipe_ext.compare.run import Comparison, DeepSpeedLauncher, model_state_error_pct, run_comparison
    from ds_pipe_ext.layout import Layout

    configs = [CompareConfig(f"zero{z}", Layout(dp=1, zero=z, micro_batch=micro_batch, micro_batches=2))
               for z in (0, 1, 2, 3)]
    configs.append(CompareConfig("zero3-offload", Layout(dp=1, zero=3, micro_batch=micro_batch, micro_batches=2,
                                                         offload=True)))
    model_cfg = load_model_config(model)
    comparison = Comparison(out, model=model, model_cfg=model_cfg, shape=model_shape(model_cfg), steps=steps,
                            memory_cap_gib=None, launcher=DeepSpeedLauncher(timeout=300), cpu_only=False)
    rows = run_comparison(configs, comparison, progress=False)
    table = []
    for r in rows:
        mb = r.get("measured_bytes") or {}
        pb = r.get("predicted_bytes") or {}
        cell = lambda d, k: f"{d[k] / MiB:.0f}" if k in d else "-"  # noqa: E731
        table.append([r["config"], r["status"], f"{r['samples_per_s']:.1f}" if r.get("samples_per_s") else "-",
                      *(f"{cell(mb, k)} / {cell(pb, k)}" for k in ("param_bytes", "grad_bytes", "optimizer_bytes",
                                                                  "activation_bytes")),
                      f"{r['peak_memory_bytes'] / MiB:.0f}" if r.get("peak_memory_bytes") else "-",
                      f"{r['predicted_peak_memory_bytes'] / MiB:.0f}" if r.get("predicted_peak_memory_bytes") else "-"])
        if r["status"] != "ok":
            print(f"  {r['config']}: {r['status']}\n{r.get('error', '')[-1200:]}")
    print(f"\nsingle-GPU train.py, {model}, micro-batch {micro_batch} x 2, fp32 (measured / predicted MiB)")
    print("\n".join(render_table(["config", "status", "samples/s", "params", "grads", "optimizer", "activations",
                        "allocator peak", "predicted total"], table)))
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    return {"zero_states_worst_error_pct": round(model_state_error_pct(rows), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", action="store_true", help="also one single-GPU train.py per ZeRO stage")
    ap.add_argument("--model", default="gpt2-medium", help="the launches' model")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default="runs/gpu-path")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_path.py measures the CUDA path: run it where a GPU is present")
    device = torch.cuda.get_device_name()
    print(f"device: {device}, torch {torch.__version__}", flush=True)
    result = layer_part()
    if args.launches:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result |= launch_part(out, args.model, args.micro_batch, args.steps)
    print("RESULT device=" + device.replace(" ", "_") + " " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
