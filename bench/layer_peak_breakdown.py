"""What a layer holds at its memory peak, by the op that allocated it: the allocator's peak over a forward and
backward (as the profiler measures it, ``costs.profiler.profile_layer``) taken apart, beside the analytic count.

The profiler's peak is one number; where it and the analytic model disagree, this says which tensors make the
difference (on an H200, 2026-11-27: the Llama-3-8B block's 318 MiB were the profiler's own AdamW states, read
into the peak; the GPT-2 medium block's 80 MiB include 64 MiB a bias gradient's sum holds, docs/results/2026-11-27-gpu-path.md).  One
forward + backward runs untraced (lazy initialisation, the previous call's output still referenced, as in the
profiler's loop), then one under ``torch.profiler`` with ``profile_memory``: its allocation events, each under
the op that made it, are replayed to the highest ``total_allocated``, and the blocks live there are summed by
their op (autograd's node and the ATen op below it).  Memory held before the traced call (parameters, the
input, the previous output) is one line, "held before".

    python bench/layer_peak_breakdown.py                      # on a GPU: gpt2-medium and llama3-8b blocks, bf16
    python bench/layer_peak_breakdown.py --cases tiny:block:2:64:fp32   # anywhere: MODEL:LAYER:BATCH:SEQ:DTYPE

Last line: RESULT worst_unexplained_pct=X (the largest share of a peak not attributed to an allocation seen in
the trace or held before it; near 0 when the replay is complete).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs  # noqa: E402
from ds_pipe_ext.costs.hardware import get_device  # noqa: E402
from ds_pipe_ext.costs.layers import build_for_profiling  # noqa: E402
from ds_pipe_ext.costs.probes import allocation_events, detach_input, tensors_of  # noqa: E402
from ds_pipe_ext.costs.profiler import TORCH_DTYPES  # noqa: E402
from ds_pipe_ext.runner import SMOKE_HELP  # noqa: E402
from ds_pipe_ext.instrument.peak import allocating_op  # noqa: E402
from ds_pipe_ext.models import family_of, load_model  # noqa: E402
from ds_pipe_ext.partition.report import render_table  # noqa: E402

MiB = 2**20
GPU_CASES = ["gpt2-medium:block:8:1024:bf16", "llama3-8b:block:1:4096:bf16", "gpt2-medium:head:8:1024:bf16"]
SMOKE_CASES = "tiny:embedding:2:32:fp32,tiny:block:2:32:fp32,tiny:head:2:32:fp32"


def peak_breakdown(run, device: torch.device) -> tuple[int, int, dict[str, int]]:
    """(allocator bytes at the traced call's highest point, bytes from before the trace still held there,
    live bytes there by the op that allocated them)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with profile(activities=activities, profile_memory=True, record_shapes=False) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    live: dict[int, tuple[int, str]] = {}
    best_total, best_live, best_before = -1, {}, 0
    before = None
    for event, fields in allocation_events(prof, device.type):
        ptr, size, total = fields.ptr, fields.alloc_size, fields.total_allocated
        if before is None:
            before = total - size  # what the allocator held before the first event
        if size > 0:
            live[ptr] = (size, allocating_op(event))
        elif ptr in live:
            del live[ptr]
        else:
            before += size  # a block from before the trace, freed during it (the previous call's output)
        if total > best_total:
            best_total, best_live, best_before = total, dict(live), before
    by_op: dict[str, int] = defaultdict(int)
    for size, chain in best_live.values():
        by_op[chain] += size
    return best_total, best_before, dict(by_op)


def case_run(model: str, layer: str, b: int, seq: int, dtype: str, device: torch.device):
    """The layer's forward + backward as the profiler's loop runs it: the previous call's output still held."""
    cfg = load_model(model)
    family = family_of(cfg)
    specs, loss_fn = family.layer_specs(cfg), family.loss_fn(cfg)
    index = {"embedding": 0, "block": 1, "head": len(specs) - 1}[layer]
    module, call = build_for_profiling(specs[index])
    module.to(device=device, dtype=TORCH_DTYPES[dtype])
    tokens = torch.randint(0, cfg.vocab_size, (b, seq + 1), generator=torch.Generator().manual_seed(0))
    labels = tokens[:, 1:].to(device)
    x = tokens[:, :-1] if index == 0 else torch.randn(seq, b, cfg.hidden, generator=torch.Generator().manual_seed(1))
    x = x.to(device=device, dtype=None if index == 0 else TORCH_DTYPES[dtype])
    trainable = [p for p in module.parameters() if p.requires_grad]
    state: dict = {}

    def run():
        for p in trainable:
            p.grad = None
        out = call(detach_input(x))
        if index == len(specs) - 1:
            out = loss_fn(out, labels)
        outs = [t for t in tensors_of(out) if t.requires_grad]
        grads = state.setdefault("grads", [torch.randn_like(t) if t.dim() else None for t in outs])
        torch.autograd.backward(outs, grads)
        state["out"] = out  # held into the next call, as the profiler's loop holds it

    analytic = analytic_layer_costs(cfg, EstimateRequest(micro_batch=b, seq=seq, dtype=dtype),
                                    get_device("h200" if device.type == "cuda" else "a100"),
                                    runs_on=device.type)
    a_index = {"embedding": 0, "block": 1, "head": len(analytic) - 1}[layer]
    return run, analytic[a_index], sum(p.numel() * p.element_size() for p in trainable)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=None, help="comma-separated MODEL:LAYER:BATCH:SEQ:DTYPE (default: the GPU cases)")
    ap.add_argument("--top", type=int, default=12, help="ops listed per case")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP + f" (cases {SMOKE_CASES}, on any device)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.cases = SMOKE_CASES
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.cases is None and device.type != "cuda":
        sys.exit("no GPU here: name CPU-sized cases with --cases, e.g. tiny:block:2:64:fp32")
    worst = 0.0
    for case in (args.cases.split(",") if args.cases else GPU_CASES):
        model, layer, b, seq, dtype = case.split(":")
        run, analytic, grad_bytes = case_run(model, layer, int(b), int(seq), dtype, device)
        run()  # lazy initialisation; its output stays held, as in the profiler
        total, before, by_op = peak_breakdown(run, device)
        traced = sum(by_op.values())
        unexplained = total - before - traced
        worst = max(worst, abs(unexplained) / total * 100 if total else 0.0)
        print(f"\n{case} on {device.type}: allocator peak {total / MiB:.1f} MiB = held before {before / MiB:.1f} + "
              f"live traced blocks {traced / MiB:.1f} (+{unexplained / MiB:.1f} unattributed); above the held: "
              f"{(total - before) / MiB:.1f} MiB (of it the parameters' gradients {grad_bytes / MiB:.1f}); "
              f"analytic layer peak {analytic.peak_bytes / MiB:.1f} MiB, saved activations "
              f"{analytic.activation_bytes / MiB:.1f} MiB", flush=True)
        rows = sorted(by_op.items(), key=lambda kv: -kv[1])
        print("\n".join(render_table(["allocated by", "MiB live at the peak"],
                                     [[k[:110], f"{v / MiB:.1f}"] for k, v in rows[:args.top]]
                                     + [[f"({len(rows) - args.top} more ops)", f"{sum(v for _, v in rows[args.top:]) / MiB:.1f}"]]
                                     * (len(rows) > args.top))), flush=True)
    print(f"RESULT worst_unexplained_pct={worst:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
