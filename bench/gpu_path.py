"""The GPU path checked in one run, on one GPU (<= 80 GB): the user's command and its neighbours.

Each part is real launches through ``ds_pipe_ext.runner.launch`` (a line per launch as it ends);
``--parts`` reruns any of them alone:

  train    the root ds.json job on one rank (1 stage, ``tiny``); then a bf16 GPT-2 medium 1-stage pipeline,
           ``profiled``, under ZeRO-0 and ZeRO-1, instrumented; then ``ds-pipe-ext report`` on that run
  compare  ``compare``'s data-parallel rows ZeRO-0, 1, 2, 3 (gpt2-medium fp32, micro-batch 8 x 2): samples/s,
           the model states and the peak, measured against predicted
  offload  ZeRO-3 with its states in CPU memory (DeepSpeed's CPU Adam compiles on first use, about a minute)
  hf       a small random Hugging Face Llama written here, as a 1-stage pipeline through ``ds_pipe_ext.hf``
  oom      a layout the peak rule says needs at least 1.5x the device's memory: an ``oom`` row, every
           process gone within 60 s
  layers   per-layer times and bytes of GPT blocks, profiled against the analytic model on the spec of the
           device it runs on (``h100``/``h200``/``a100`` by name); no launch
  speed    train.py data parallel ZeRO-1 bf16: gpt3-1.3b (4 x 4, seq 2048), a 4-block Llama-3-8B (1 x 4, seq 8192),
           gpt2-medium (8 x 4), each without and with ``train.compile``, uninstrumented: samples/s, MFU; the last
           step profiled (``train.profile_step``): the optimizer step's time and share, the device's idle time,
           the top kernels, the host syncs; speed-records.json
  pipe     the same models, eager, through DeepSpeed's pipeline engine with one stage (ZeRO-1; the first also
           ZeRO-0, DeepSpeed's BF16_Optimizer on a GPU): against speed's rows
  backends which SDPA backend each family's attention runs (GPT; Llama with grouped-query heads; Mistral's
           sliding window) beside the cost model's selector, and the chunked head + loss (liger-kernel's where
           installed) against the plain one in bf16; no launch
  costs    gpt2-medium and llama3-8b in bf16, per distinct layer: the profile against an independent loop timing
           and against a second profile, the analytic model on the measured ``cuda`` spec, saved bytes and the
           layer's peak; the simulated step of ``profiled`` against ``uniform`` and ``parameters`` at 4 and 8 stages
  today    Mixtral-8x7B, DeepSeek-V3, gpt-oss-20b and Nemotron-H-8B at their published widths, cut to one layer of
           each kind (bf16): every distinct layer's profile against the analytic model on the device's datasheet
           spec (its kernel table), saved bytes; each routed block taken apart (attention, routed MLP, DeepSpeed's
           MoE layer, the experts alone on the slots their measured capacity gives, shared experts), each piece's
           kernels and their device time under torch.profiler, priced at that capacity; no launch

``--cpu-dry-run`` runs the same plan on CPU ranks with ``tiny-tied`` (``tiny`` with gpt2-medium's tied head and
dropout) in fp32, its train part's pipelines in bf16 as on a GPU (no offload; the layer part on the
``cpu`` spec; the ``oom`` part against a memory cap standing in for the device's memory): ``make test`` runs it,
so the script cannot rot between GPU runs.

    python bench/gpu_path.py [--parts train,compare,offload,hf,oom,layers,today] [--out DIR] [--cpu-dry-run]

Last line: RESULT device=... launches_ok=K/N oom_row=oom oom_exit_s=S zero_states_worst_error_pct=V
pipeline_states_worst_error_pct=P
[block_time_error_pct_datasheet=X block_time_error_pct_planner=Y timer_agreement_pct=Z activation_bytes_worst_error_pct=W]
[profile_vs_loop_worst_pct=.. profile_repeat_worst_pct=.. analytic_vs_profile_worst_pct=.. analytic_peak_worst_pct=..
 profiled_vs_uniform_min=.. profiled_vs_parameters_min=..]
[today_activation_bytes_worst_error_pct=.. today_moe_layer_worst_error_pct=.. today_<kind>_worst_error_pct=..]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ds_pipe_ext.compare.configs import CompareConfig  # noqa: E402
from ds_pipe_ext.runner import SMOKE_HELP  # noqa: E402
from ds_pipe_ext.compare.run import (Comparison, DeepSpeedLauncher, LaunchResult, launch_status,  # noqa: E402
                                     model_state_error_pct, run_comparison)
from ds_pipe_ext.layout import Layout  # noqa: E402
from ds_pipe_ext.models.gpt_config import load_model_config  # noqa: E402
from ds_pipe_ext.models.registry import load_model  # noqa: E402
from ds_pipe_ext.partition.report import render_table  # noqa: E402
from ds_pipe_ext.pipe import schedules as _deepspeed_order  # noqa: E402,F401  (the engine's order, for the simulator)
from ds_pipe_ext.runner import ROOT, launch  # noqa: E402

PARTS = ("train", "compare", "offload", "hf", "oom", "layers", "costs", "speed", "pipe", "backends", "today")
MiB = 2**20
OOM_EXIT_LIMIT_S = 60


@dataclass(frozen=True)
class Target:
    """What the plan runs on: one GPU, or CPU ranks standing in for it."""

    cuda: bool
    gpt: str  # the GPT of the train and compare parts
    dtype: str  # the train part's pipeline precision
    big: str  # the oom part's model
    micro_batch: int
    steps: int
    timeout: int

    @classmethod
    def for_run(cls, cpu_dry_run: bool) -> "Target":
        if cpu_dry_run:
            # tiny-tied: tiny with gpt2-medium's tied embedding/head and dropout
            return cls(cuda=False, gpt="tiny-tied", dtype="bf16", big="tiny", micro_batch=2, steps=3, timeout=240)
        return cls(cuda=True, gpt="gpt2-medium", dtype="bf16", big="gpt3-1.3b", micro_batch=8, steps=6, timeout=600)

    # A GPU's layers are timed as the package times them (2 warm-ups, the median of 5 repeats; do_bench's loops);
    # a CPU dry run checks the path, not the figures: one warm-up, one repeat, short loops, one profiled call
    def profile_settings(self):
        from ds_pipe_ext.costs.types import ProfileSettings

        return ProfileSettings(warmup=2 if self.cuda else 1, repeats=5 if self.cuda else 1, cache_dir=None,
                               progress=False)

    def timer(self):
        from ds_pipe_ext.costs.gpu_timing import cuda_timer  # do_bench on a GPU, torch's Timer without triton

        return cuda_timer(min_run_time=0.2 if self.cuda else 0.02)

    @property
    def profiled_calls(self) -> int:  # per torch.profiler trace (kernel_profile)
        return 3 if self.cuda else 1


@dataclass
class Run:
    part: str
    name: str
    status: str
    seconds: float
    samples_per_s: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    def line(self) -> str:
        speed = f"{self.samples_per_s:.2f} samples/s" if self.samples_per_s else "-"
        return f"  [{self.part}] {self.name}: {self.status} in {self.seconds:.0f} s, {speed} {self.note}".rstrip()


def _report(run: Run) -> Run:
    print(run.line(), flush=True)
    return run


def launch_train(part: str, name: str, ds: dict, out: Path, t: Target, *, instrument: bool = False,
                 user_command: bool = False) -> Run:
    """One rank of train.py with DS in OUT/PART/NAME; through ``deepspeed --num_gpus 1`` itself if user_command."""
    work = out / part / name
    work.mkdir(parents=True, exist_ok=True)
    config = work / "ds.json"
    config.write_text(json.dumps(ds, indent=1))
    args = ["--instrument", str(work / "run")] if instrument else []
    t0 = time.perf_counter()
    try:
        proc, ranks = launch(1, config, *args, out_dir=work, cwd=work, timeout=t.timeout, user_command=user_command)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-4000:]
        (work / "launch.log").write_text(proc.stdout + proc.stderr)  # the whole of a failure, not its tail
    except subprocess.TimeoutExpired:
        rc, ranks, tail = 124, {}, f"timed out after {t.timeout} s"
    seconds = time.perf_counter() - t0
    metrics = ranks.get(0)
    status = launch_status(LaunchResult(rc, metrics, None, tail))
    run = Run(part, name, status, seconds, metrics.get("samples_per_s") if metrics else None,
              extra={"work": str(work), "metrics": metrics})
    if status != "ok":
        run.note = "\n" + tail[-1500:]
    return _report(run)


def pipeline_config(t: Target, zero: int) -> dict:
    """A 1-stage ``profiled`` pipeline of the target's GPT in its precision, as a GPU user's ds.json says it."""
    ds = json.loads((ROOT / "launch_scripts" / "ds_gpu_bf16.json").read_text())
    ds.update(train_micro_batch_size_per_gpu=t.micro_batch, gradient_accumulation_steps=2,
              zero_optimization={"stage": zero})
    ds["pipeline"] = {**ds["pipeline"], "stages": 1, "profile": {"warmup": 2, "repeats": 5, "cache_dir": None}}
    ds["train"] = {"model": t.gpt, "steps": t.steps, "seed": 1234, "log": "json"}
    if t.dtype != "bf16":
        ds.pop("bf16")
    return ds


def train_part(t: Target, out: Path) -> list[Run]:
    root = json.loads((ROOT / "ds.json").read_text())
    root["pipeline"]["stages"] = 1
    root["train"] = {**root["train"], "steps": t.steps, "log": "json"}
    runs = [launch_train("train", "ds.json-1-rank", root, out, t, user_command=True)]  # the README's command
    for zero in (0, 1):
        runs.append(launch_train("train", f"{t.gpt}-{t.dtype}-pp1-z{zero}", pipeline_config(t, zero), out, t,
                                 instrument=True))
    for run, zero in zip(runs[1:], (0, 1)):
        if run.status == "ok":
            run.extra["states_error_pct"] = pipeline_states_error_pct(t, Path(run.extra["work"]) / "run", zero)
            run.note = f"model states {run.extra['states_error_pct']:+.3f}% off the rule"
            print(f"  [train] {run.name}: {run.note}", flush=True)
    run_dir = Path(runs[-1].extra["work"]) / "run"
    t0 = time.perf_counter()
    cli = "import sys; from ds_pipe_ext.cli import main; sys.exit(main(sys.argv[1:]))"  # ds-pipe-ext, wherever installed
    proc = subprocess.run([sys.executable, "-c", cli, "report", str(run_dir), "--png", str(run_dir / "report.png")],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    report = Run("train", f"report {run_dir.parent.name}", "ok" if proc.returncode == 0 else "failed",
                 time.perf_counter() - t0, note="" if proc.returncode == 0 else "\n" + proc.stderr[-1500:])
    if proc.returncode == 0:
        print(proc.stdout, flush=True)
    return [*runs, _report(report)]


def pipeline_states_error_pct(t: Target, run_dir: Path, zero: int) -> float:
    """Worst |measured - predicted| / measured of the 1-stage pipeline's parameter, gradient and optimizer
    bytes (what the rank held around its optimizer step, against DeepSpeed's allocation rule)."""
    from ds_pipe_ext.compare.predict import model_shape, predicted_ranks

    model_cfg = load_model_config(t.gpt)
    shape = model_shape(model_cfg)
    cfg = CompareConfig("pp1", Layout(pp=1, dp=1, zero=zero, micro_batch=t.micro_batch, micro_batches=2,
                                      schedule="1f1b"), "profiled")
    (pred,) = predicted_ranks(cfg, shape, [0.0] * len(shape.layer_numels), parts=[0, len(shape.layer_numels)],
                              element_bytes=2 if t.dtype == "bf16" else 4)
    (rank,) = json.loads((run_dir / "summary.json").read_text())["ranks"]
    return max((100 * abs(pred[k] - rank[k]) / rank[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")
                if rank[k]), key=abs, default=0.0)


def comparison(t: Target, out: Path, model: str, cap_gib: float | None = None) -> Comparison:
    from ds_pipe_ext.compare.predict import model_shape

    model_cfg = load_model_config(model)
    return Comparison(out, model=model, model_cfg=model_cfg, shape=model_shape(model_cfg), steps=t.steps,
                      memory_cap_gib=cap_gib, launcher=DeepSpeedLauncher(timeout=t.timeout), cpu_only=not t.cuda)


def rows_as_runs(part: str, rows: list[dict], seconds: list[float]) -> list[Run]:
    return [_report(Run(part, r["config"], r["status"], s, r.get("samples_per_s"),
                        note=("\n" + r.get("error", "")[-1500:]) if r["status"] == "failed" else "", extra={"row": r}))
            for r, s in zip(rows, seconds)]


def run_rows(part: str, configs: list[CompareConfig], cmp: Comparison) -> list[Run]:
    runs = []
    for cfg in configs:  # one at a time: a line per launch as it ends
        t0 = time.perf_counter()
        rows = run_comparison([cfg], cmp, progress=False)
        runs += rows_as_runs(part, rows, [time.perf_counter() - t0])
    return runs


def memory_table(runs: list[Run], title: str) -> None:
    table = []
    for run in runs:
        r = run.extra["row"]
        mb, pb = r.get("measured_bytes") or {}, r.get("predicted_bytes") or {}
        cell = lambda d, k: f"{d[k] / MiB:.0f}" if k in d else "-"  # noqa: E731
        table.append([r["config"], r["status"], f"{r['samples_per_s']:.1f}" if r.get("samples_per_s") else "-",
                      *(f"{cell(mb, k)} / {cell(pb, k)}" for k in ("param_bytes", "grad_bytes", "optimizer_bytes",
                                                                  "activation_bytes")),
                      f"{r['peak_memory_bytes'] / MiB:.0f}" if r.get("peak_memory_bytes") else "-",
                      f"{r['predicted_peak_memory_bytes'] / MiB:.0f}" if r.get("predicted_peak_memory_bytes") else "-"])
    print(f"\n{title} (measured / predicted MiB)")
    print("\n".join(render_table(["config", "status", "samples/s", "params", "grads", "optimizer", "activations",
                                  "peak measured", "peak predicted"], table)), flush=True)


def compare_part(t: Target, out: Path) -> list[Run]:
    """gpt2-medium fp32, as the first GPU run measured it: its rows predicted 22-25% high then (the tied
    embedding counted twice, 4-byte dropout masks where CUDA keeps 1-byte ones)."""
    configs = [CompareConfig(f"zero{z}", Layout(dp=1, zero=z, micro_batch=t.micro_batch, micro_batches=2))
               for z in (0, 1, 2, 3)]
    runs = run_rows("compare", configs, comparison(t, out / "compare", t.gpt))
    memory_table(runs, f"compare, {t.gpt} fp32, micro-batch {t.micro_batch} x 2, data parallel on one rank")
    peak_trace(runs, out)
    return runs


def peak_trace(runs: list[Run], out: Path) -> None:
    """The memory traces of the heaviest row and ZeRO-3's, summarized where they ran (each traced step's blocks
    alive at its peak, by kind and the op that made them) and their difference by op: compare-trace.json (a few
    KiB).  The first GPU run's ZeRO-0/1/2 rows held 771 MiB more activations than ZeRO-3's."""
    rows = {run.name: run.extra["row"] for run in runs if run.extra["row"].get("peak_by_op")}
    if not rows:
        return
    others = [name for name in rows if name != "zero3"]
    heaviest = max(others or rows, key=lambda name: rows[name]["peak_memory_bytes"] or 0)
    (out / "compare-trace.json").write_text(json.dumps(
        {name: {"peak_bytes": rows[name]["peak_memory_bytes"], "peak_phase": rows[name]["peak_phase"],
                "by_op": rows[name]["peak_by_op"]} for name in rows} | {"heaviest": heaviest}, indent=1))
    for name in dict.fromkeys([heaviest, "zero3"]):
        if name not in rows:
            continue
        r = rows[name]
        print(f"\n{name}: the traced step's peak {r['peak_memory_bytes'] / MiB:.0f} MiB in {r['peak_phase']}; "
              f"what the step made and held there, by the op that made it")
        print("\n".join(render_table(["kind", "op", "MiB", "blocks"],
                                     [[kind, op[:90], f"{n / MiB:.1f}", str(k)] for n, kind, op, k in r["peak_by_op"]])),
              flush=True)
    if heaviest != "zero3" and "zero3" in rows:
        held = lambda name: {(kind, op): n for n, kind, op, _ in rows[name]["peak_by_op"]}  # noqa: E731
        a, b = held(heaviest), held("zero3")
        diff = sorted(((a.get(key, 0) - b.get(key, 0), key) for key in a.keys() | b.keys()), key=lambda d: -abs(d[0]))
        print(f"\n{heaviest} less zero3 at their peaks, by op (MiB; the listed ops of each)")
        print("\n".join(render_table(["kind", "op", "MiB"], [[kind, op[:90], f"{d / MiB:+.1f}"]
                                                             for d, (kind, op) in diff[:8] if d])), flush=True)


def offload_part(t: Target, out: Path) -> list[Run]:
    cfg = CompareConfig("zero3-offload", Layout(dp=1, zero=3, micro_batch=t.micro_batch, micro_batches=2,
                                                offload=True))
    runs = run_rows("offload", [cfg], comparison(t, out / "compare", t.gpt))
    memory_table(runs, f"ZeRO-3 + offload, {t.gpt} fp32")
    return runs


def hf_part(t: Target, out: Path) -> list[Run]:
    """A random Llama saved with save_pretrained, trained as a 1-stage pipeline by examples/hf_pipeline.py."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    work = out / "hf"
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(work / "llama")
    t0 = time.perf_counter()
    proc, ranks = launch(1, None, "--model", str(work / "llama"), "--stages", "1", "--steps", "2", "--checkpoint",
                         str(work / "ckpt"), out_dir=work, cwd=work, script="examples/hf_pipeline.py",
                         timeout=t.timeout)
    ok = proc.returncode == 0 and 0 in ranks and all(l == l for l in ranks[0]["losses"])  # noqa: E741 - not NaN
    return [_report(Run("hf", "llama-2-layers-pp1", "ok" if ok else "failed", time.perf_counter() - t0,
                        note="" if ok else "\n" + (proc.stdout + proc.stderr)[-1500:]))]


def device_memory_bytes() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def predicted_peak(cmp: Comparison, cfg: CompareConfig, cuda: bool) -> int:
    """What runs out of memory, predicted: on a GPU the allocator's peak over the step; on CPU ranks what
    ``train.memory_cap_gib`` is compared with there (the tensors held at the step: states + saved activations)."""
    from ds_pipe_ext.compare.predict import layer_activation_bytes, predicted_ranks

    device = "cuda" if cuda else "cpu"  # the attention kernel and the dropout masks the device runs
    acts = layer_activation_bytes(cmp.model_cfg, cfg, device=device)
    key = "peak_bytes" if cuda else "total_bytes"
    return max(r[key] for r in predicted_ranks(cfg, cmp.shape, acts, model_cfg=cmp.model_cfg, device=device))


def oom_part(t: Target, out: Path) -> list[Run]:
    """The smallest micro-batch of ``t.big`` (data parallel, ZeRO-0, fp32) whose predicted peak is at least
    1.5x the device's memory, launched: it must end as an ``oom`` row, every process gone within 60 s of the
    rank's out-of-memory error.
    On CPU ranks ``train.memory_cap_gib`` stands in for the device's memory (predicted peak / 1.5)."""
    cmp = comparison(t, out / "oom", t.big)
    layout = lambda b: Layout(dp=1, zero=0, micro_batch=b, micro_batches=1)  # noqa: E731
    if t.cuda:
        memory, b = device_memory_bytes(), 1
        while predicted_peak(cmp, CompareConfig("zero0", layout(b)), True) < 1.5 * memory:
            b *= 2
    else:
        b = t.micro_batch
        memory = int(predicted_peak(cmp, CompareConfig("zero0", layout(b)), False) / 1.5)
        cmp.cap = memory / 2**30
    cfg = CompareConfig(f"zero0-mb{b}", layout(b))
    peak = predicted_peak(cmp, cfg, t.cuda)
    print(f"  [oom] {t.big} micro-batch {b}: predicted {peak / MiB:.0f} MiB = {peak / memory:.2f}x the "
          f"{'device' if t.cuda else 'cap standing in for the device'}'s {memory / MiB:.0f} MiB", flush=True)
    t0 = time.perf_counter()
    (run,) = run_rows("oom", [cfg], cmp)
    run.seconds = time.perf_counter() - t0
    ended = time.time()
    left = leftover_processes(str(out / "oom"))
    # from the rank's out-of-memory error (or the cap's stop) to the launcher's return; the whole launch
    # where the rank recorded no time
    at = (run.extra["row"].get("oom") or {}).get("at_unix")
    exit_s = ended - at if at is not None else run.seconds
    run.extra.update(left=left, predicted_over_memory=peak / memory, exit_s=exit_s, exit_from_error=at is not None)
    if left:
        run.status, run.note = "hung", f"processes left: {left}"
    print(f"  [oom] launch {run.seconds:.0f} s; every process gone {exit_s:.1f} s after the "
          f"{'error' if at is not None else 'start (no error time recorded)'} (limit {OOM_EXIT_LIMIT_S}), "
          f"processes left: {left or 'none'}", flush=True)
    return [run]


def oom_exit_s(run: Run) -> float:
    return run.extra.get("exit_s", run.seconds)


def leftover_processes(marker: str) -> list[int]:
    """Processes whose command line names ``marker`` (this run's directory): a launch must leave none."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if marker in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def spec_name(t: Target) -> str:
    """The datasheet spec of the device this runs on, by its name."""
    from ds_pipe_ext.costs.hardware import datasheet_name

    if not t.cuda:
        return "cpu"
    spec = datasheet_name(torch.cuda.get_device_name(), device_memory_bytes())
    if spec is None:
        raise SystemExit(f"bench/gpu_path.py: no datasheet spec for {torch.cuda.get_device_name()!r}: add one to "
                         f"costs/hardware.py")
    return spec


def recorded_overrides(model: str, overrides: dict | None = None) -> dict:
    """A record's config beside its model's name: its overrides, and always the vocabulary's padding, the
    loss's chunking and a sinks model's core (records before them ran without: gpu_fidelity reads their absence
    so)."""
    cfg = load_model(model)
    sinks = {"sink_attention": cfg.sink_attention} if getattr(cfg, "attention_sinks", False) else {}
    return {"vocab_pad_to": cfg.vocab_pad_to, "loss_chunk_tokens": cfg.loss_chunk_tokens, **sinks, **(overrides or {})}


def layer_record(model: str, b: int, seq: int, dtype: str, layer: str, timings_ms: list[float], *,
                 overrides: dict | None = None, **extra) -> dict:
    """One layer's timings as bench/gpu_fidelity.py reads them back: the full config it ran with (model,
    shape, dtype, TF32, compiled or not, its config overrides) and every timing, so no label is parsed."""
    return {"model": model, "b": b, "s": seq, "dtype": dtype, "layer": layer, "ms": statistics.median(timings_ms),
            "timings_ms": list(timings_ms), "tf32": bool(torch.backends.cuda.matmul.allow_tf32), "compiled": False,
            "overrides": recorded_overrides(model, overrides), "torch": torch.__version__, **extra}


def write_records(out: Path, part: str, records: list[dict]) -> None:
    """``OUT/<part>-records.json``: the part's per-layer records (bench/gpu_fidelity.py reads every one)."""
    (out / f"{part}-records.json").write_text(json.dumps({"layers": records}, indent=1))


def layers_part(t: Target, out: Path) -> dict:
    """Embedding, one block and head + loss profiled, against the analytic model on the device's datasheet
    spec and on the planner's (calibrated) spec; the block's forward against a host clock."""
    from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs
    from ds_pipe_ext.costs.hardware import get_device
    from ds_pipe_ext.costs.layers import build_for_profiling
    from ds_pipe_ext.costs.profiler import profile_layers
    from ds_pipe_ext.costs.types import ProfileSettings
    from ds_pipe_ext.models.gpt_config import GPTConfig
    from ds_pipe_ext.models.gpt import gpt_layer_specs
    from ds_pipe_ext.models.layers import LOCAL, loss_fn_for

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    if t.cuda:  # fp32 as train.py runs it (train.tf32)
        from ds_pipe_ext.device import use_tf32

        use_tf32(True)
    cases = ([("gpt2-medium", 8, 1024, "bf16"), ("gpt2-medium", 8, 1024, "fp32"), ("gpt3-1.3b", 4, 2048, "bf16"),
              ("gpt3-1.3b", 4, 2048, "fp32")] if t.cuda else [("tiny", 2, None, "fp32")])
    device = "cuda" if t.cuda else "cpu"
    spec = spec_name(t)
    datasheet = get_device(spec, calibrated=False, cache_dir=str(out / "cache"))
    planner = get_device(spec, cache_dir=str(out / "cache"))
    rows, block_dat, block_plan, timer, acts, records = [], [], [], [], [], []
    for name, b, seq, dtype in cases:
        cfg = load_model_config(name)
        seq = seq or cfg.seq_len
        cfg = GPTConfig.from_dict({**cfg.to_dict(), "seq_len": seq, "tie_embeddings": False}, name=cfg.name)
        specs = gpt_layer_specs(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (b, seq + 1), generator=torch.Generator().manual_seed(0))
        measured = profile_layers([specs[0], specs[1], specs[-1]], tokens[:, :-1], labels=tokens[:, 1:],
                                  loss_fn=loss_fn_for(LOCAL, cfg), settings=ProfileSettings(warmup=3, repeats=10, cache_dir=None,
                                                                            progress=False),
                                  device=device, dtype=dtypes[dtype])
        req = EstimateRequest(micro_batch=b, seq=seq, dtype=dtype)
        a_dat, a_plan = ([r[0], r[1], r[-1]] for r in (analytic_layer_costs(cfg, req, d) for d in (datasheet, planner)))
        for label, m, ad, ap in zip(("embedding", "block", "head+loss"), measured, a_dat, a_plan):
            total = m.forward_s + m.backward_s
            err_d = 100 * ((ad.forward_s + ad.backward_s) / total - 1)
            err_p = 100 * ((ap.forward_s + ap.backward_s) / total - 1)
            act_err = 100 * (ad.activation_bytes / m.activation_bytes - 1) if m.activation_bytes else 0.0
            rows.append([f"{name} b{b} s{seq} {dtype}", label, f"{1e3 * m.forward_s:.3f}", f"{1e3 * m.backward_s:.3f}",
                         f"{1e3 * (ad.forward_s + ad.backward_s):.3f}", f"{err_d:+.1f}",
                         f"{1e3 * (ap.forward_s + ap.backward_s):.3f}", f"{err_p:+.1f}",
                         f"{m.activation_bytes / MiB:.1f}", f"{ad.activation_bytes / MiB:.1f}", f"{act_err:+.1f}",
                         f"{m.peak_bytes / MiB:.1f}"])
            acts.append(abs(act_err))
            records.append(layer_record(name, b, seq, dtype, label, [1e3 * total], overrides={"tie_embeddings": False},
                                        fwd_ms=1e3 * m.forward_s, bwd_ms=1e3 * m.backward_s,
                                        saved_bytes=int(m.activation_bytes)))
            if label == "block":
                block_dat.append(abs(err_d))
                block_plan.append(abs(err_p))
        x = torch.randn(b, seq, cfg.hidden, generator=torch.Generator().manual_seed(1)).to(dtypes[dtype])
        wall = host_clock_forward(build_for_profiling(specs[1]), x, device, dtypes[dtype])
        timer.append(100 * abs(measured[1].forward_s / wall - 1))
    write_records(out, "layers", records)
    print(f"\nlayers on {spec} ({device}): profiled against analytic (datasheet, planner)")
    print("\n".join(render_table(["case", "layer", "fwd ms", "bwd ms", "analytic datasheet ms", "err %",
                                  "analytic planner ms", "err %", "saved MiB (hooks)", "saved MiB (analytic)", "err %",
                                  "allocator peak MiB"], rows)), flush=True)
    return {"block_time_error_pct_datasheet": round(statistics.median(block_dat), 1),
            "block_time_error_pct_planner": round(statistics.median(block_plan), 1),
            "timer_agreement_pct": round(max(timer), 1),
            "activation_bytes_worst_error_pct": round(max(acts), 1)}


# (model, its overrides, micro-batch, micro-batches) of the speed part: the first GPU run's two rows and GPT-2
# medium, bf16, data parallel ZeRO-1 on one GPU; on CPU ranks their tiny stand-ins
SPEED_CASES = {True: [("gpt3-1.3b", {}, 4, 4), ("llama3-8b", {"layers": 4}, 1, 4), ("gpt2-medium", {}, 8, 4)],
               False: [("tiny-tied", {}, 2, 2), ("llama-tiny", {"layers": 4}, 2, 2)]}


def model_file(out: Path, name: str, overrides: dict) -> str:
    """A model name, or a .toml of it with ``overrides`` (the 4-block Llama-3-8B shape)."""
    if not overrides:
        return name
    from ds_pipe_ext.models.config import CONFIG_DIR

    path = out / f"{name}-{'-'.join(f'{k}{v}' for k, v in overrides.items())}.toml"
    lines = [line for line in (CONFIG_DIR / f"{name}.toml").read_text().splitlines()
             if line.split("=")[0].strip() not in overrides]
    path.write_text("\n".join(lines + [f"{k} = {v}" for k, v in overrides.items()]) + "\n")
    return str(path)


def speed_config(t: Target, model: str, micro_batch: int, micro_batches: int, *, compiled: bool,
                 pipeline: bool = False, zero: int = 1) -> dict:
    """A speed run's ds.json: ZeRO-1 (or ``zero``) on one device, uninstrumented, its last step profiled
    (``train.profile_step``); ``pipeline``: DeepSpeed's pipeline engine with one stage in place of data
    parallelism (ZeRO-0 there in bf16: DeepSpeed's BF16_Optimizer)."""
    ds = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": micro_batches,
          "steps_per_print": 10**6, "zero_optimization": {"stage": zero},
          "train": {"model": model, "steps": t.steps, "seed": 1234, "log": "json", "compile": compiled,
                    "profile_step": t.steps}}
    if pipeline:
        ds["pipeline"] = {"stages": 1, "partition_method": "parameters"}
    if t.cuda:  # without DeepSpeed's per-tensor overflow check, as launch_scripts/ds_gpu_bf16.json
        ds["bf16"] = {"enabled": True, "check_grad_overflow": False}
    return ds


def speed_record(run: Run, *, model: str, overrides: dict, micro_batch: int, micro_batches: int, compiled: bool,
                 pipeline: bool, zero: int = 1) -> dict:
    """A speed run as bench/gpu_fidelity.py reads it back: its config, step, MFU and the profiled step."""
    metrics = run.extra.get("metrics") or {}
    profile_path = Path(run.extra["work"]) / "step_profile.json"
    profile = json.loads(profile_path.read_text()) if profile_path.is_file() else {}
    optimizer = (profile.get("phases") or {}).get("optimizer_step", {}).get("ms")
    return {"run": run.name, "status": run.status, "model": load_model(model).name,
            "overrides": recorded_overrides(model, overrides),
            "micro_batch": micro_batch, "micro_batches": micro_batches, "compiled": compiled, "pipeline": pipeline,
            "zero": zero, "instrumented": False,
            "step_ms": 1e3 * metrics["step_s_median"] if "step_s_median" in metrics else None,
            "step_ms_each": [1e3 * x for x in metrics.get("step_s_each", [])],
            "samples_per_s": metrics.get("samples_per_s"), "mfu": metrics.get("mfu"),
            "optimizer_ms": optimizer, "profile": profile, "torch": torch.__version__, "device_spec": device_spec()}


def device_spec() -> str | None:
    """The datasheet spec of this GPU (``costs.hardware.datasheet_name``), None on a CPU."""
    if not torch.cuda.is_available():
        return None
    from ds_pipe_ext.costs.hardware import datasheet_name

    return datasheet_name(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)


def speed_runs(part: str, t: Target, out: Path, *, pipeline: bool) -> tuple[list[Run], list[dict]]:
    runs, records = [], []
    # on CPU ranks the pipeline rows keep to the first case: the dry run checks the path, not the speed
    cases = SPEED_CASES[t.cuda][:1] if pipeline and not t.cuda else SPEED_CASES[t.cuda]
    for i, (name, overrides, micro_batch, micro_batches) in enumerate(cases):
        model = model_file(out, name, overrides)
        # the pipeline's first model under ZeRO-0 too: a bf16 pipeline without ZeRO runs DeepSpeed's BF16_Optimizer
        variants = [(False, 0), (False, 1)] if pipeline and i == 0 else \
            [(False, 1)] + ([(True, 1)] if t.cuda and not pipeline else [])
        for compiled, zero in variants:
            label = f"{name}{'-' + '-'.join(f'{k}{v}' for k, v in overrides.items()) if overrides else ''}" \
                    f"-{'pp1-' if pipeline else ''}z{zero}-mb{micro_batch}x{micro_batches}{'-compiled' if compiled else ''}"
            ds = speed_config(t, model, micro_batch, micro_batches, compiled=compiled, pipeline=pipeline, zero=zero)
            run = launch_train(part, label, ds, out, t)
            record = speed_record(run, model=model, overrides=overrides, micro_batch=micro_batch,
                                  micro_batches=micro_batches, compiled=compiled, pipeline=pipeline, zero=zero)
            record["check_grad_overflow"] = bool(ds.get("bf16", {}).get("check_grad_overflow", "bf16" in ds))
            if run.status == "ok":
                step = record["step_ms"]
                run.extra.update(mfu=record["mfu"], optimizer_share=(record["optimizer_ms"] or 0.0) / step)
            runs.append(run)
            records.append(record)
    (out / f"{part}-records.json").write_text(json.dumps({"steps": records}, indent=1))
    return runs, records


def _speed_table(records: list[dict], title: str) -> None:
    def cell(r, key, fmt):
        return fmt.format(r[key]) if r.get(key) is not None else "-"

    rows = [[r["run"], cell(r, "samples_per_s", "{:.2f}"),
             f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-", cell(r, "step_ms", "{:.1f}"),
             cell(r, "optimizer_ms", "{:.1f}"),
             f"{100 * r['optimizer_ms'] / r['step_ms']:.1f}%" if r.get("optimizer_ms") and r.get("step_ms") else "-",
             f"{(r.get('profile') or {}).get('wall_ms'):.1f}" if (r.get("profile") or {}).get("wall_ms") else "-",
             f"{100 * r['profile']['device_idle_ms'] / r['profile']['wall_ms']:.0f}%"
             if (r.get("profile") or {}).get("wall_ms") else "-"] for r in records]
    print(f"\n{title}")
    # the profiled step is the instrumented figure, printed beside the uninstrumented median step
    print("\n".join(render_table(["run", "samples/s", "MFU", "step ms", "optimizer step ms (profiled)",
                                  "optimizer share", "profiled step ms", "device idle (profiled step)"], rows)),
          flush=True)
    for r in records:  # where the optimizer's time goes: the profiled step's top kernels and syncs
        prof = r.get("profile") or {}
        if prof.get("top_kernels"):
            top = ", ".join(f"{k['name'][:48]} {k['ms']:.1f} ms x{k['calls']}" for k in prof["top_kernels"][:4])
            syncs = sum(v["calls"] for v in (prof.get("syncs") or {}).values())
            print(f"  {r['run']}: {top}; {syncs} syncs", flush=True)


def speed_part(t: Target, out: Path) -> list[Run]:
    """train.py's data-parallel ZeRO-1 steps in bf16 on one GPU, without and with train.compile, uninstrumented:
    samples/s, MFU, and the last step profiled (``train.profile_step``: the optimizer step's time, the device's
    idle time, the top kernels and the host syncs, summarized on the device).  CPU ranks: fp32, no compile
    (inductor's C++ builds cost minutes there)."""
    runs, records = speed_runs("speed", t, out, pipeline=False)
    _speed_table(records, "train.py, data parallel ZeRO-1 on one device, uninstrumented (the last step profiled)")
    return runs


def pipe_part(t: Target, out: Path, speed_records: Path | None = None) -> list[Run]:
    """The speed part's models, eager, through DeepSpeed's pipeline engine with one stage (ZeRO-1, the first
    also ZeRO-0: BF16_Optimizer in bf16 on a GPU): its samples/s against the speed part's data-parallel ZeRO-1
    row, read from ``speed_records`` (default: where the speed part wrote them in the same OUT)."""
    runs, records = speed_runs("pipe", t, out, pipeline=True)
    _speed_table(records, "train.py, DeepSpeed's pipeline engine with one stage, uninstrumented")
    dp_path = speed_records or out / "speed-records.json"
    if dp_path.is_file():
        dp = {(r["model"], r["micro_batch"], r["micro_batches"]): r for r in json.loads(dp_path.read_text())["steps"]
              if not r["compiled"] and r.get("samples_per_s")}
        for r in records:
            other = dp.get((r["model"], r["micro_batch"], r["micro_batches"]))
            if other and r.get("samples_per_s"):
                ratio = r["samples_per_s"] / other["samples_per_s"]
                print(f"  {r['run']}: {ratio:.3f}x the data-parallel row's samples/s", flush=True)
                for run in runs:
                    if run.name == r["run"]:
                        run.extra["pipeline_vs_dp"] = ratio
    return runs


# (model, its overrides, micro-batch, sequence) of the backends part: GPT, Llama with grouped-query heads, a
# sliding window (Mistral's); one block each
GPT_OSS_TINY = dict(qkv_bias=True, attention_sinks=True, sliding_window=8, window_pattern="WFWF", swiglu_limit=7.0)
BACKEND_CASES = {True: [("gpt2-medium", {}, 8, 1024), ("llama3-8b", {"layers": 1}, 1, 4096),
                        ("mistral-7b", {"layers": 1}, 1, 4096),
                        ("gpt-oss-20b", {"layers": 2, "window_pattern": "WF"}, 1, 4096)],
                 False: [("tiny-tied", {}, 2, 32), ("llama-tiny", {}, 2, 32),
                         ("llama-tiny", {"sliding_window": 16}, 2, 32), ("moe-tiny", GPT_OSS_TINY, 2, 32)]}
# the aten op each SDPA backend dispatches to (host events: the same names on every device), most specific first
SDPA_OPS = (("_scaled_dot_product_flash_attention_for_cpu", "cpu"), ("_scaled_dot_product_cudnn_attention", "cudnn"),
            ("_scaled_dot_product_flash_attention", "flash"), ("_scaled_dot_product_efficient_attention", "efficient"),
            ("_scaled_dot_product_attention_math", "math"), ("_scaled_dot_product_fused_attention_overrideable", "other"),
            ("_flash_attention_forward", "flash"), ("flex_attention", "flex"))


def attention_backend_run(names: set[str]) -> str:
    """Which backend a block's attention ran, from the op names of its profiled forward and backward: an SDPA
    backend's op, flex_attention's, else "eager" (the core written out)."""
    for op, backend in SDPA_OPS:
        if any(op in n for n in names):
            return backend
    return "eager"


def liger_alignment(fused, weight: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor, vocab: int,
                    timer) -> dict:
    """liger-kernel's fused loss (``fused(weight, hidden, labels, bias)``) over a padded head's real rows (``vocab``
    rows: misaligned GEMMs) against its padded rows with a bias of -inf on the padded columns
    (``padded_head_operands``, what ``layers.ChunkedLinearLoss`` hands it): the two losses and each one's forward +
    backward ms by ``timer``."""
    from ds_pipe_ext.models.linear_cross_entropy import padded_head_operands

    mask = padded_head_operands(weight, vocab)[1]
    w = weight.detach().requires_grad_(True)
    h = hidden.detach().requires_grad_(True)
    variants = {"real rows": lambda: fused(w[:vocab], h, labels), "padded, masked": lambda: fused(w, h, labels, mask)}
    out = {}
    for name, loss in variants.items():
        out[f"{name} loss"] = loss().item()
        out[f"{name} ms"] = 1e3 * timer(lambda loss=loss: loss().backward())
    return out


def backends_part(t: Target, out: Path) -> dict:
    """What runs where the cost model has to choose: each family's attention backend, as a block's forward and
    backward under torch.profiler shows it, beside what ``arch.attention_backend`` (the cost model's selector)
    says; and the chunked head + loss (``models.linear_cross_entropy``, liger-kernel's where installed) against
    the plain one, in the run's precision.  No launch."""
    from torch.profiler import ProfilerActivity, profile

    from ds_pipe_ext.arch import attention_backend, as_description
    from ds_pipe_ext.costs.layers import build_for_profiling
    from ds_pipe_ext.costs.probes import detach_input, tensors_of
    from ds_pipe_ext.models import family_of, load_model
    from ds_pipe_ext.models.layers import ChunkedLinearLoss, RealVocabLoss
    from ds_pipe_ext.models.linear_cross_entropy import linear_cross_entropy, liger_loss

    device = torch.device("cuda" if t.cuda else "cpu")
    dtype = torch.bfloat16 if t.cuda else torch.float32
    records, rows, agree = [], [], 0
    for name, overrides, b, seq in BACKEND_CASES[t.cuda]:
        cfg = replace(load_model(name, **overrides), seq_len=seq)
        specs = family_of(cfg).layer_specs(cfg)
        embedding, embed = build_for_profiling(specs[0], device.type)
        block, call = build_for_profiling(specs[1], device.type)
        for module in (embedding, block):
            module.to(device=device, dtype=dtype)
        with torch.no_grad():  # the block's input as the pipeline hands it over (a MoE block's: with its aux loss)
            x = embed(torch.randint(0, cfg.vocab_size, (b, seq), device=device))
        del embedding

        def step():
            outs = [o for o in tensors_of(call(detach_input(x))) if o.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if t.cuda else [])
        step()  # warm-up: lazy initialisation, the backends' first calls
        with profile(activities=activities) as prof:
            step()
            if t.cuda:
                torch.cuda.synchronize()
        ran = attention_backend_run({e.key for e in prof.key_averages()})
        att = as_description(cfg).blocks[0].attention
        head_dim = att.head_dim or cfg.hidden // att.heads
        predicted = attention_backend(att.kernel, device.type, dtype="bf16" if t.cuda else "fp32", head_dim=head_dim,
                                      gqa=att.kv_heads != att.heads, masked=bool(getattr(cfg, "sliding_window", 0)),
                                      sinks=att.sinks)
        agree += ran == predicted
        label = f"{name}{'-' + '-'.join(f'{k}{v}' for k, v in overrides.items()) if overrides else ''}"
        records.append({"case": label, "b": b, "s": seq, "dtype": str(dtype).removeprefix("torch."), "ran": ran,
                        "selector": predicted})
        rows.append([label, f"b{b} s{seq}", ran, predicted, "yes" if ran == predicted else "NO"])
    print("\nattention backend per family, as it ran (torch.profiler) and as the cost model's selector says")
    print("\n".join(render_table(["case", "shape", "ran", "selector", "agree"], rows)), flush=True)

    # the loss: plain (fp32 logits), chunked, liger's where installed; a GPT head's shape at 8 x 1,024 on a GPU
    tokens, hidden, vocab, padded = (8192, 1024, 50257, 50304) if t.cuda else (64, 64, 500, 512)
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(tokens, 1, hidden, generator=g).to(device=device, dtype=dtype)
    w = (0.02 * torch.randn(padded, hidden, generator=g)).to(device=device, dtype=dtype)
    labels = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    plain = RealVocabLoss(vocab)(torch.nn.functional.linear(h, w), labels).item()
    chunked = linear_cross_entropy(h, w, labels, vocab_size=vocab, chunk_tokens=2048).item()
    fused = liger_loss() if t.cuda else None
    # liger-kernel's loss as the chunked head runs it on CUDA (every row, the padded columns masked)
    liger = ChunkedLinearLoss(vocab, 2048)((h, w), labels).item() if fused is not None else None
    loss = {"plain": plain, "chunked": chunked, "liger": liger, "chunked_rel_err": abs(chunked / plain - 1),
            "liger_rel_err": abs(liger / plain - 1) if liger is not None else None}
    if fused is not None:  # the real rows' GEMMs are misaligned: the padded rows, their columns masked, against them
        loss["alignment"] = liger_alignment(fused, w, h.reshape(-1, hidden), labels.t().reshape(-1), vocab, t.timer())
        print(f"liger over the real rows against the padded rows with their columns masked: {loss['alignment']}")
    fused_note = "not installed" if liger is None else f"{liger:.5f} (rel. {loss['liger_rel_err']:.2e})"
    print(f"\nhead + loss, {tokens} tokens x {vocab} words ({str(dtype).removeprefix('torch.')}): plain {plain:.5f}, "
          f"chunked {chunked:.5f} (rel. {loss['chunked_rel_err']:.2e}), liger {fused_note}", flush=True)
    sinks = sinks_kernels(t, t.timer())
    (out / "backends-records.json").write_text(json.dumps({"attention": records, "loss": loss, "sinks": sinks},
                                                          indent=1))
    result = {"attention_backends_agree": f"{agree}/{len(records)}",
              "chunked_loss_rel_err": f"{loss['chunked_rel_err']:.1e}",
              **{f"sinks_{core}_worst_rel_err": "failed" if any(f"{core} error" in r for r in sinks)
                 else f"{max(r[f'{core} worst rel err'] for r in sinks):.1e}" for core in ("fused", "eager")}}
    if loss["liger_rel_err"] is not None:
        result["liger_loss_rel_err"] = f"{loss['liger_rel_err']:.1e}"
    return result


def sinks_kernels(t: Target, timer) -> list[dict]:
    """gpt-oss's attention core (``models.sinks``) fused (the kernel's output rescaled by its log-sum-exp) and
    written out, in the run's precision, each against the written-out core in fp32: the output's and q's, k's,
    v's and the sinks' gradients' worst relative error, and each one's forward + backward ms by ``timer``;
    full and in a 128-token window, gpt-oss-20b's heads at b 1 s 4,096 on a GPU (tiny on a CPU)."""
    from ds_pipe_ext.arch import attention_backend
    from ds_pipe_ext.models.sinks import FusedSinkAttention, eager_sink_attention

    device = "cuda" if t.cuda else "cpu"
    dtype = torch.bfloat16 if t.cuda else torch.float32
    b, heads, kv_heads, s, d = (1, 64, 8, 4096, 64) if t.cuda else (2, 6, 2, 64, 16)
    kernel = attention_backend("fused", device, dtype="bf16" if t.cuda else "fp32", head_dim=d, sinks=True)
    g = torch.Generator(device="cpu").manual_seed(0)
    base = [torch.randn(b, n, s, d, generator=g) for n in (heads, kv_heads, kv_heads)]
    base.append(torch.randn(heads, generator=g))
    grad = torch.randn(b, heads, s, d, generator=g).to(device)
    rows = []
    for window in (None, 128 if t.cuda else 16):
        def run(core, dt):
            inputs = [x.to(device=device, dtype=dt).requires_grad_() for x in base]
            y = core(*inputs)
            return [y, *torch.autograd.grad(y, inputs, grad.to(dt))], inputs

        cores = {"eager": lambda q, k, v, sk: eager_sink_attention(q, k, v, sk, window),
                 "fused": lambda q, k, v, sk: FusedSinkAttention.apply(q, k, v, sk, window, kernel)}
        reference = run(cores["eager"], torch.float32)[0]
        row = {"window": window or "full", "shape": f"b{b} heads {heads}/{kv_heads} s{s} d{d}", "kernel": kernel}
        for name, core in cores.items():
            try:  # the fused core's GPU path is new: its failure is a row (with the error), not the part's end
                got, inputs = run(core, dtype)
                row[f"{name} worst rel err"] = max(((x.float() - r).abs().max() / r.abs().max()).item()
                                                   for x, r in zip(got, reference))
                row[f"{name} ms"] = 1e3 * timer(lambda core=core, inputs=inputs: core(*inputs).backward(grad.to(dtype)))
            except RuntimeError as e:
                row[f"{name} worst rel err"], row[f"{name} ms"] = float("nan"), float("nan")
                row[f"{name} error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"the {name} sinks core failed: {row[name + ' error']}", flush=True)
        rows.append(row)
        del reference
    print("\ngpt-oss's attention core, fused and written out, against the written-out core in fp32")
    columns = [c for c in rows[0] if not c.endswith("error")]
    print("\n".join(render_table(columns, [[f"{r[c]:.3g}" if isinstance(r[c], float) else r[c] for c in columns]
                                           for r in rows])), flush=True)
    return rows


# (model, micro-batch, sequence) of the costs part: a GPT and a Llama in bf16 on a GPU; their tiny stand-ins on CPU
COST_CASES = {True: [("gpt2-medium", 8, 1024), ("llama3-8b", 1, 4096)], False: [("tiny-tied", 2, 32), ("llama-tiny", 2, 32)]}


def costs_part(t: Target, out: Path) -> dict:
    """Per distinct layer of each model, in the run's precision (bf16 on a GPU): the profiler's forward +
    backward against an independent timing of the same layer (``costs.gpu_timing``'s timer: do_bench on a
    GPU), two profiles against each other, the analytic model on the measured spec of this device
    (``cuda``; ``cpu`` on CPU ranks) against the profile, analytic saved bytes and peak against the hooks' and
    the allocator's; then, from the profiles, the simulated step of ``profiled`` against ``uniform`` and
    ``parameters`` at 4 and 8 stages (2 and 4 on CPU ranks): what a user would gain, predicted."""
    from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs
    from ds_pipe_ext.costs.hardware import get_device
    from ds_pipe_ext.costs.layers import build_for_profiling
    from ds_pipe_ext.costs.profiler import TORCH_DTYPES, profile_layers
    from ds_pipe_ext.models import family_of, load_model
    from ds_pipe_ext.partition.methods import decide_offline
    from ds_pipe_ext.partition.report import build_plan

    device, dtype = ("cuda", "bf16") if t.cuda else ("cpu", "fp32")
    spec = get_device(device, cache_dir=str(out / "cache"))
    timer = t.timer()
    settings = t.profile_settings()
    rows, splits, records = [], [], []
    worst = {"bench": 0.0, "repeat": 0.0, "analytic": 0.0, "peak": 0.0}
    for name, b, seq in COST_CASES[t.cuda]:
        cfg = load_model(name)
        family = family_of(cfg)
        specs, loss_fn = family.layer_specs(cfg), family.loss_fn(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (b, seq + 1), generator=torch.Generator().manual_seed(0))
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        profile = lambda: profile_layers(specs, inputs, labels=labels, loss_fn=loss_fn, settings=settings,  # noqa: E731
                                         device=device, dtype=TORCH_DTYPES[dtype])
        first, second = profile(), profile()
        analytic = analytic_layer_costs(cfg, EstimateRequest(micro_batch=b, seq=seq, dtype=dtype), spec)
        # the distinct layers: the embedding, the first block, the last layer (head + loss)
        picks = {"embedding": (0, 0), "block": (1, 1), "head+loss": (len(specs) - 1, len(analytic) - 1)}
        hidden = torch.randn(seq, b, cfg.hidden, generator=torch.Generator().manual_seed(1))
        for label, (i, a) in picks.items():
            m, again, an = first[i], second[i], analytic[a]
            x = inputs if i == 0 else hidden
            bench = reference_seconds(build_for_profiling(specs[i]), x, device, TORCH_DTYPES[dtype], timer,
                                      (loss_fn, labels) if i == len(specs) - 1 else None)
            total = m.forward_s + m.backward_s
            errs = {"bench": 100 * (total / bench - 1),
                    "repeat": 100 * ((again.forward_s + again.backward_s) / total - 1),
                    "analytic": 100 * ((an.forward_s + an.backward_s) / total - 1),
                    "peak": 100 * (an.peak_bytes / m.peak_bytes - 1) if m.peak_bytes else 0.0}
            for k, v in errs.items():
                worst[k] = max(worst[k], abs(v))
            records.append(layer_record(name, b, seq, dtype, label, [1e3 * total, 1e3 * bench,
                                                                     1e3 * (again.forward_s + again.backward_s)],
                                        saved_bytes=int(m.activation_bytes)))
            rows.append([f"{name} b{b} s{seq} {dtype}", label, f"{1e3 * total:.3f}", f"{1e3 * bench:.3f}",
                         f"{errs['bench']:+.1f}", f"{errs['repeat']:+.1f}", f"{1e3 * (an.forward_s + an.backward_s):.3f}",
                         f"{errs['analytic']:+.1f}", f"{m.activation_bytes / MiB:.1f}", f"{an.activation_bytes / MiB:.1f}",
                         f"{m.peak_bytes / MiB:.1f}" if m.peak_bytes else "-", f"{an.peak_bytes / MiB:.1f}"])
        for stages in ((4, 8) if t.cuda else (2, 4)):
            steps = {}
            for method in ("profiled", "uniform", "parameters"):
                parts = decide_offline(method, first, stages, micro_batches=2 * stages)
                steps[method] = build_plan(method, parts, first, micro_batches=2 * stages).predicted_step_ms
            splits.append([name, str(stages), *(f"{steps[k]:.1f}" for k in steps),
                           f"{steps['uniform'] / steps['profiled']:.3f}", f"{steps['parameters'] / steps['profiled']:.3f}"])
    write_records(out, "costs", records)
    print(f"\ncosts on {device} ({dtype}): profiled against an independent loop timing, a second profile, the "
          f"analytic model on the measured '{device}' spec; saved bytes and the layer's peak, hooks/allocator vs analytic")
    print("\n".join(render_table(["case", "layer", "profiled ms", "loop-timed ms", "err %", "2nd profile %",
                                  "analytic ms", "err %", "saved MiB", "analytic saved MiB", "peak MiB",
                                  "analytic peak MiB"], rows)))
    print("\nsimulated step (ms, 2 micro-batches a stage) from these profiles: what `profiled` gains, predicted")
    print("\n".join(render_table(["model", "stages", "profiled", "uniform", "parameters", "uniform / profiled",
                                  "parameters / profiled"], splits)), flush=True)
    return {"profile_vs_loop_worst_pct": round(worst["bench"], 1), "profile_repeat_worst_pct": round(worst["repeat"], 1),
            "analytic_vs_profile_worst_pct": round(worst["analytic"], 1),
            "analytic_peak_worst_pct": round(worst["peak"], 1),
            "profiled_vs_uniform_min": min(float(r[-2]) for r in splits),
            "profiled_vs_parameters_min": min(float(r[-1]) for r in splits)}


# (model, its overrides, micro-batch, sequence) of the today part: issue 77's and 78's families at their published
# widths, each cut to one layer of every kind, bf16 on one GPU (DeepSeek-V3 with 64 of its 256 routed experts: a
# rank's share under EP 4 and within one GPU's memory with the layer's optimizer step); on CPU ranks their bench
# stand-ins, cut alike, in fp32
TODAY_CASES = {True: [("mixtral-8x7b", {"layers": 1}, 1, 4096),
                      ("deepseek-v3", {"layers": 2, "dense_layers": 1, "experts": 64}, 1, 4096),
                      ("gpt-oss-20b", {"layers": 2, "window_pattern": "WF"}, 1, 4096),
                      ("nemotron-h-8b", {"layers": 3, "pattern": "M*-"}, 1, 4096)],
               False: [("bench-cpu-deepseek", {"layers": 2, "dense_layers": 1}, 1, 64),
                       ("bench-cpu-gptoss", {"layers": 2, "window_pattern": "WF"}, 1, 64),
                       ("hybrid-tiny", {"layers": 3, "pattern": "M*-"}, 1, 32)]}
def kernel_profile(step, device: str, n: int = 3) -> tuple[float, float, list]:
    """(kernels launched, their summed device seconds, the six longest kernels by name with their ms) per call of
    ``step`` under torch.profiler (CPU ranks: the aten ops the host ran, their CPU seconds)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    if device == "cuda":
        kernels = [(e.name, e.device_time) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        kernels = [(e.name, e.cpu_time) for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    by_name: dict = {}
    for name, us in kernels:
        by_name[name] = by_name.get(name, 0.0) + us / n
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:6]
    return len(kernels) / n, sum(us for _, us in kernels) * 1e-6 / n, [[k[:90], round(v / 1e3, 3)] for k, v in top]


def layer_kernels(specs: list, kinds: list[str], tokens: torch.Tensor, device: str, dtype: torch.dtype,
                  calls: int = 3) -> dict:
    """Per distinct kind of layer before the first routed one and the head (the routed blocks are taken apart by
    ``routed_pieces``): the kernels its forward + backward launches and their device time, each layer fed the
    previous layers' output as the pipeline feeds it."""
    from ds_pipe_ext.costs.layers import build_for_profiling
    from ds_pipe_ext.costs.probes import detach_input, tensors_of

    found, x = {}, tokens.to(device)
    for spec, kind in zip(specs[:-1], kinds[:-1]):
        if " routed" in kind:
            break
        module, call = build_for_profiling(spec, device)
        module.to(device=device, dtype=dtype)
        if kind not in found:
            def step(module=module, call=call, x=x):
                outs = [t for t in tensors_of(call(detach_input(x))) if t.requires_grad]
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            found[kind] = kernel_profile(step, device, calls)
        with torch.no_grad():
            x = call(x)
        del module
    return found


def routed_pieces(block, cfg, b: int, seq: int, device: str, dtype: torch.dtype, timer, calls: int = 3) -> dict:
    """A routed block taken apart as DeepSpeed runs it: fwd + bwd seconds of the block, its attention (with its
    input norm), its routed MLP (the
    MoE layer, the shared experts), the MoE layer alone, the experts alone on the slots DeepSpeed hands them,
    the shared experts alone; and the MoE layer's kernels and their device time (host-bound where the wall
    exceeds it)."""
    from ds_pipe_ext.costs.gpu_timing import forward_backward_s
    from ds_pipe_ext.costs.moe_ops import slots_per_expert

    block.to(device=device, dtype=dtype)
    mlp = block.mlp
    moe = mlp.moe.deepspeed_moe
    experts = moe.experts.deepspeed_experts
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(seq, b, cfg.hidden, generator=gen).to(device=device, dtype=dtype).requires_grad_(True)
    desc = next(d for d in cfg.describe().blocks if d.experts is not None)
    slots = slots_per_expert(b * seq, desc.experts)
    if not desc.experts.capacity_factor:  # dropless: C is the largest expert's load on this input
        with torch.no_grad():
            slots = int(mlp.moe(h)[2].max())
    imbalance = slots / (desc.experts.top_k * b * seq / desc.experts.count)
    chunk = torch.randn(1, 1, slots, cfg.hidden, generator=gen).to(device=device, dtype=dtype).requires_grad_(True)

    def grads(out):
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    pieces = {"block": lambda: block((h, torch.zeros((), device=device))),
             "attention": lambda: block.attn(block.input_norm(h)),
             "routed MLP": lambda: mlp(h)[0], "MoE layer": lambda: mlp.moe(h)[0],
             "experts": lambda: torch.cat([e(chunk) for e in experts], dim=1)}
    if mlp.shared is not None:
        pieces["shared"] = lambda: mlp.shared(h)
    seconds = {k: sum(forward_backward_s(f, grads, timer)) for k, f in pieces.items()}
    kernels_of = {k: kernel_profile(lambda f=f: grads(f()), device, calls) for k, f in pieces.items()}
    step = lambda: grads(mlp.moe(h)[0])  # noqa: E731
    kernels, kernel_s, _ = kernels_of["MoE layer"]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    walls = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            step()
        sync()
        walls.append((time.perf_counter() - t0) / 5)
    return {"seconds": seconds, "kernels": kernels_of, "slots": slots, "imbalance": imbalance,
            "experts": len(experts), "moe_kernels": kernels,
            "moe_kernel_s": kernel_s, "moe_wall_s": statistics.median(walls)}


class RoutedLoads:
    """The busiest expert's load over the mean (DeepSpeed's dropless capacity over the mean) of each routed block a
    profile runs, from the block's ``tokens_per_expert`` after its last forward with gradients (a global forward
    hook: the profiler builds its own modules), in the order the blocks first run.  The hook keeps the counts
    tensor and reads nothing back, so the timed calls pay no device sync; a block is matched by a weak reference
    (a freed block's id may be reused by the next one, and a strong one would keep its weights)."""

    def __init__(self):
        self.seen: list[tuple[weakref.ref, torch.Tensor]] = []

    def __enter__(self):
        from torch.nn.modules.module import register_module_forward_hook

        def seen(module, inputs, output) -> None:
            counts = getattr(module, "tokens_per_expert", None)
            if not getattr(module, "routed", False) or counts is None or not torch.is_grad_enabled():
                return
            for i, (ref, _) in enumerate(self.seen):
                if ref() is module:
                    self.seen[i] = (ref, counts)
                    return
            self.seen.append((weakref.ref(module), counts))
        self.handle = register_module_forward_hook(seen)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def for_layers(self, kinds: list[str]) -> dict[int, float]:
        """{layer index: imbalance} for the routed layers of ``kinds``, where the profile ran one block each (else
        nothing: a block built twice would misplace them)."""
        routed = [i for i, kind in enumerate(kinds) if " routed" in kind]
        if len(routed) != len(self.seen):
            return {}
        return {i: int(c.max()) * len(c) / int(c.sum()) for i, (_, c) in zip(routed, self.seen) if int(c.sum())}


def today_part(t: Target, out: Path) -> dict:
    """Issue 77's and 78's families (DeepSeek-V3, gpt-oss, Mixtral, Nemotron-H), every distinct layer at its
    published width: the profile against the analytic model on this device's datasheet spec (its kernel table
    where one is kept), saved bytes against the hooks'; then each routed block taken apart (``routed_pieces``)
    beside the priced ops of each part, and the MoE layer's kernels counted against the priced count."""
    from dataclasses import replace

    from bench.gpu_fidelity import layer_kinds, price_pieces  # the records' pricer prices the live table too
    from ds_pipe_ext.costs.estimate import EstimateRequest, estimate_layers
    from ds_pipe_ext.costs.hardware import get_device
    from ds_pipe_ext.costs.layers import build_for_profiling
    from ds_pipe_ext.costs.profiler import TORCH_DTYPES, profile_layers
    from ds_pipe_ext.models import family_of

    device, dtype = ("cuda", "bf16") if t.cuda else ("cpu", "fp32")
    spec = get_device(spec_name(t), calibrated=False, cache_dir=str(out / "cache"))
    timer = t.timer()
    settings = t.profile_settings()
    rows, piece_rows, records, worst_time, worst_bytes, worst_moe = [], [], [], {}, 0.0, 0.0
    failed = []
    for name, overrides, b, seq in TODAY_CASES[t.cuda]:
        try:  # a model that fails is a line with its error; the others still run
            t0 = time.perf_counter()
            cfg = replace(load_model(name, **overrides), seq_len=seq)
            family = family_of(cfg)
            specs, loss_fn = family.layer_specs(cfg), family.loss_fn(cfg)
            tokens = torch.randint(0, cfg.vocab_size, (b, seq + 1), generator=torch.Generator().manual_seed(0))
            with RoutedLoads() as loads:  # the profile's routed blocks run on the previous layers' output
                measured = profile_layers(specs, tokens[:, :-1], labels=tokens[:, 1:], loss_fn=loss_fn,
                                          settings=settings, device=device, dtype=TORCH_DTYPES[dtype])
            req = EstimateRequest(micro_batch=b, seq=seq, dtype=dtype)
            est = estimate_layers(cfg, req, spec)
            kinds = layer_kinds(cfg)
            assert len(kinds) == len(measured) == len(est), (len(kinds), len(measured), len(est))
            kernels_of = layer_kernels(specs, kinds, tokens[:, :-1], device, TORCH_DTYPES[dtype], t.profiled_calls)
            profile_imbalance = loads.for_layers(kinds)
            seen = set()
            for i, (kind, m, e) in enumerate(zip(kinds, measured, est)):
                if kind in seen:
                    continue
                seen.add(kind)
                total, priced = m.forward_s + m.backward_s, e["fwd_s"] + e["bwd_s"]
                err = 100 * (priced / total - 1)
                berr = 100 * (e["activation_bytes"] / m.activation_bytes - 1) if m.activation_bytes else 0.0
                worst_time[kind.split()[0]] = max(worst_time.get(kind.split()[0], 0.0), abs(err))
                worst_bytes = max(worst_bytes, abs(berr))
                rows.append([f"{name} b{b} s{seq} {dtype}", kind, f"{1e3 * m.forward_s:.2f}",
                             f"{1e3 * m.backward_s:.2f}",
                             f"{1e3 * priced:.2f}", f"{err:+.1f}", f"{m.activation_bytes / MiB:.1f}",
                             f"{e['activation_bytes'] / MiB:.1f}", f"{berr:+.1f}",
                             f"{m.peak_bytes / MiB:.0f}" if m.peak_bytes else "-",
                             f"{kernels_of[kind][0]:.0f} ({1e3 * kernels_of[kind][1]:.2f})"
                             if kind in kernels_of else "-"])
                records.append(layer_record(name, b, seq, dtype, kind, [1e3 * total], overrides=overrides,
                                            fwd_ms=1e3 * m.forward_s, bwd_ms=1e3 * m.backward_s,
                                            saved_bytes=int(m.activation_bytes)))
                if kind in kernels_of:  # its kernels, their device ms and the longest six
                    k, ks, top = kernels_of[kind]
                    records[-1]["kernels"] = [k, 1e3 * ks, top]
                if i in profile_imbalance:  # the busiest expert over the mean, as the profile's input routed
                    records[-1]["profile_imbalance"] = profile_imbalance[i]
                if " routed" not in kind or kind.startswith("mtp"):
                    continue
                module, _ = build_for_profiling(specs[i], device)
                got = routed_pieces(module, cfg, b, seq, device, TORCH_DTYPES[dtype], timer, t.profiled_calls)
                del module
                priced_ms, priced_kernels = price_pieces(cfg, replace(req, expert_imbalance=got["imbalance"]), spec, i)
                priced_of = {piece: ms / 1e3 for piece, ms in priced_ms.items()}
                for piece, s in got["seconds"].items():
                    p = priced_of.get(piece)
                    k, ks, _ = got["kernels"][piece]
                    piece_rows.append([name, piece, f"{1e3 * s:.2f}", f"{1e3 * p:.2f}" if p is not None else "-",
                                       f"{100 * (p / s - 1):+.1f}" if p else "-", f"{k:.0f}", f"{1e3 * ks:.2f}"])
                worst_moe = max(worst_moe, abs(100 * (priced_of["MoE layer"] / got["seconds"]["MoE layer"] - 1)))
                piece_rows.append([name, f"MoE layer (E {got['experts']} x C {got['slots']}, imbalance "
                                   f"{got['imbalance']:.2f}): host wall", f"{1e3 * got['moe_wall_s']:.2f}", "", "",
                                   f"{priced_kernels} priced", ""])
                records[-1]["pieces_ms"] = {k: 1e3 * v for k, v in got["seconds"].items()}
                records[-1]["pieces_kernels"] = {k: [v[0], 1e3 * v[1], v[2]] for k, v in got["kernels"].items()}
                records[-1]["slots"], records[-1]["imbalance"] = got["slots"], got["imbalance"]
                records[-1]["moe_kernels"] = got["moe_kernels"]
                records[-1]["moe_kernel_ms"] = 1e3 * got["moe_kernel_s"]
                records[-1]["moe_wall_ms"] = 1e3 * got["moe_wall_s"]
            del measured
            if t.cuda:
                torch.cuda.empty_cache()
            print(f"  [today] {name}: {time.perf_counter() - t0:.0f} s", flush=True)
        except RuntimeError as e:
            failed.append(name)
            print(f"  [today] {name} FAILED: {type(e).__name__}: {str(e)[:500]}", flush=True)
            if t.cuda:
                torch.cuda.empty_cache()
    write_records(out, "today", records)
    print(f"\ntoday's families on {spec.name} ({device}, {dtype}): every distinct layer profiled against the analytic "
          f"model (datasheet spec{', its kernel table' if getattr(spec, 'gpu', None) is not None else ''})")
    print("\n".join(render_table(["case", "layer", "fwd ms", "bwd ms", "analytic ms", "err %", "saved MiB (hooks)",
                                  "saved MiB (analytic)", "err %", "allocator peak MiB", "kernels (their ms)"],
                                 rows)))
    print("\nrouted blocks taken apart: fwd + bwd ms measured (a loop of calls) against the priced ops of each part "
          "(at the slots measured); the kernels each launches (torch.profiler) and their device ms")
    print("\n".join(render_table(["model", "part", "measured ms", "priced ms", "err %", "kernels", "kernel ms"],
                                  piece_rows)), flush=True)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", flush=True)
    return {"today_activation_bytes_worst_error_pct": round(worst_bytes, 2),
            "today_moe_layer_worst_error_pct": round(worst_moe, 1), "today_failed": ",".join(failed) or "none",
            **{f"today_{k}_worst_error_pct": round(v, 1) for k, v in worst_time.items()}}


def reference_seconds(built, x: torch.Tensor, device: str, dtype: torch.dtype, timer, loss=None) -> float:
    """A layer's forward + backward, timed on its own by ``timer`` as a loop (the profiler's own figure is
    set against it)."""
    from ds_pipe_ext.costs.gpu_timing import forward_backward_s

    module, call = built
    module.to(device=device, dtype=dtype)
    x = x.to(device=device, dtype=dtype if x.is_floating_point() else None)
    if x.is_floating_point():
        x.requires_grad_(True)

    def forward():
        out = call(x)
        return loss[0](out, loss[1].to(device)) if loss is not None else out

    def backward(out):
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    return sum(forward_backward_s(forward, backward, timer))


def host_clock_forward(built, x: torch.Tensor, device: str, dtype: torch.dtype, n: int = 20) -> float:
    """The block's forward timed by the host clock around synchronised loops (the profiler's own clock is
    CUDA events on a GPU): the median of 5 loops of ``n`` calls after 3 warm-ups."""
    module, call = built
    module.to(device=device, dtype=dtype)
    x = x.to(device).detach().requires_grad_(True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        call(x)
    times = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            call(x)
        sync()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def keep_records(out: Path, limit_bytes: int = 2 * MiB) -> None:
    """Every small JSON record under ``out`` (ds.json, metrics, summaries, rows) copied flat into
    OUT/records/, its path joined by "__": a device machine hands back only shallow folders."""
    records = out / "records"
    records.mkdir(exist_ok=True)
    for f in sorted(out.rglob("*.json")):
        rel = f.relative_to(out)
        if rel.parts[0] not in ("records", "cache") and len(rel.parts) > 1 and f.stat().st_size <= limit_bytes:
            (records / "__".join(rel.parts)).write_bytes(f.read_bytes())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--out", default="runs/gpu-path")
    ap.add_argument("--cpu-dry-run", action="store_true", help="the same plan on CPU ranks with tiny-tied")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP + " (as --cpu-dry-run: the GPU's part of the plan "
                    "cannot run on CPU; tests/test_gpu_path.py runs it so)")
    ap.add_argument("--speed-records", type=Path, default=None,
                    help="pipe: the speed part's records to compare with (default OUT/speed-records.json)")
    args = ap.parse_args(argv)
    args.cpu_dry_run = args.cpu_dry_run or args.smoke
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"bench/gpu_path.py: unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    if not args.cpu_dry_run and not torch.cuda.is_available():
        raise SystemExit("bench/gpu_path.py checks the CUDA path: run it where a GPU is present, or pass --cpu-dry-run")
    t = Target.for_run(args.cpu_dry_run)
    if not t.cuda and "offload" in parts:
        parts.remove("offload")
        print("offload: skipped on CPU ranks (ZeRO-3's states are in CPU memory already)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if t.cuda else "cpu-dry-run"
    print(f"device: {device}, torch {torch.__version__}, parts: {', '.join(parts)}", flush=True)
    runs, result = [], {}
    handlers = {"train": train_part, "compare": compare_part, "offload": offload_part, "hf": hf_part, "oom": oom_part,
                "speed": speed_part, "pipe": lambda t, out: pipe_part(t, out, args.speed_records)}
    for part in parts:
        t0 = time.perf_counter()
        if part == "layers":
            result |= layers_part(t, out)
        elif part == "costs":
            result |= costs_part(t, out)
        elif part == "backends":
            result |= backends_part(t, out)
        elif part == "today":
            result |= today_part(t, out)
        else:
            runs += handlers[part](t, out)
        print(f"{part}: {time.perf_counter() - t0:.0f} s", flush=True)
    keep_records(out)
    expected_oom = [r for r in runs if r.part == "oom"]
    ok = [r for r in runs if r.status == ("oom" if r.part == "oom" else "ok")]
    (out / "runs.json").write_text(json.dumps([{k: v for k, v in r.__dict__.items() if k != "extra"} for r in runs],
                                              indent=1))
    if runs:
        print("\n".join(render_table(["part", "run", "status", "s", "samples/s"],
                                     [[r.part, r.name, r.status, f"{r.seconds:.0f}",
                                       f"{r.samples_per_s:.2f}" if r.samples_per_s else "-"] for r in runs])))
        result["launches_ok"] = f"{len(ok)}/{len(runs)}"
    if expected_oom:
        result |= {"oom_row": expected_oom[0].status, "oom_exit_s": round(oom_exit_s(expected_oom[0]), 1)}
    rows = [r.extra["row"] for r in runs if "row" in r.extra and r.part in ("compare", "offload")]
    if rows:
        result["zero_states_worst_error_pct"] = round(model_state_error_pct(rows), 3)
    pipes = [r.extra["pipeline_vs_dp"] for r in runs if "pipeline_vs_dp" in r.extra]
    if pipes:
        result["pipeline_vs_dp_min"] = round(min(pipes), 3)
    speeds = {r.name: r.extra for r in runs if r.part == "speed" and "optimizer_share" in r.extra}
    for key, prefix in (("gpt3-1.3b-z1-mb4x4", "gpt3_1.3b"), ("llama3-8b-layers4-z1-mb1x4", "llama3_8b_4blocks")):
        best = [e["mfu"] for name, e in speeds.items() if name.startswith(key) and e.get("mfu") is not None]
        if best:
            result[f"{prefix}_mfu"] = round(max(best), 3)
    if speeds:
        result["optimizer_share_max"] = round(max(e["optimizer_share"] for e in speeds.values()), 3)
    pipelines = [r.extra["states_error_pct"] for r in runs if "states_error_pct" in r.extra]
    if pipelines:
        result["pipeline_states_worst_error_pct"] = round(max(pipelines), 3)
    print("RESULT device=" + device.replace(" ", "_") + " " + " ".join(f"{k}={v}" for k, v in result.items()))
    passed = len(ok) == len(runs) and all(oom_exit_s(r) <= OOM_EXIT_LIMIT_S for r in expected_oom)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
