"""Measure one GPU's kernel table: the GEMMs, attention, streaming ops and launches the cost model prices.

Writes ``ds_pipe_ext/costs/kernels/<device>.json`` (``--out`` elsewhere), which ``costs.kernel_table`` reads
for that datasheet device: GEMMs interpolated over M, K and N, attention by backend over the sequence, the
achieved streaming bandwidth, the launch floor and the host's dispatch.  About two minutes on one H100/H200
(``launch_scripts/gpu_session.sh kernels``).  ``--dry-run`` runs the same code on the CPU at shapes 64x
smaller (``make test`` runs it) and writes nothing into the package.

- GEMMs: the products the model families make (gpt2-medium, gpt3-1.3b, llama3-8b: q/k/v, out, MLP, head) at
  TP 1, 2, 4, 8 and 1,024-16,384 tokens, and the odd widths beside their aligned twins (50,257 / 50,304;
  10,922 / 10,944); each forward product with its two backward ones as autograd runs them, the input's
  gradient (tokens x N)(N x K) and the weight's (N x tokens)(tokens x K), recorded as the cost model asks for
  them (``gpu_pricing.gemm_s``: M x N x K and K x M x N).  The weight's gradient sums over the tokens into an
  output as small as the layer's weight, whatever the batch: fewer tiles than SMs at small widths and high
  TP, where cuBLAS splits K;
- attention: SDPA on each backend that runs (cuDNN, flash, memory-efficient; grouped-query on flash), causal,
  head dims 64 and 128, sequences 512-16,384, forward and backward; the GPT cores again with attention
  dropout 0.1 (d 64 at 1,024 and 2,048, d 128 at 2,048 and 4,096);
- streaming: add, LayerNorm and softmax from 1 MiB to 1 GiB; the sinks core's passes over (heads, s, s) scores
  against their aligned twins (a broadcast mask added, a column concatenated, softmax over rows of s + 1, a
  slice's gradient): records, no price reads them yet;
- an empty op: the launch floor on the device and the dispatch on the host; an op with its autograd node; a module
  call and a Python autograd Function's, forward and backward (what DeepSpeed's expert loop wraps its kernels in).

Ends: RESULT device=... gemms=N attention=N bandwidth_fraction=... launch_us=... host_us=... host_op_us=...
host_op_bwd_us=... module_call_us=F/B python_function_us=F/B
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ds_pipe_ext.costs.cpu_spec import host_op_s  # noqa: E402
from ds_pipe_ext.costs.hardware import DEVICES, datasheet_name  # noqa: E402
from ds_pipe_ext.costs.kernel_table import TABLE_DIR, KernelTable  # noqa: E402
from ds_pipe_ext.runner import SMOKE_HELP  # noqa: E402

# (hidden, ffn, vocab, heads, kv heads, gated) of the families measured
FAMILIES = {"gpt2-medium": (1024, 4096, 50257, 16, 16, False), "gpt3-1.3b": (2048, 8192, 50257, 16, 16, False),
            "llama3-8b": (4096, 14336, 128256, 32, 8, True)}
TOKENS = (1024, 2048, 4096, 8192, 16384)
ODD_PAIRS = [(1024, 50257), (1024, 50304), (2048, 50257), (2048, 50304), (4096, 10922), (4096, 10944)]
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
STREAM_MIB = (1, 4, 16, 64, 256, 1024)
DROPOUT = 0.1  # GPT-2's and Megatron's attention dropout


def gemm_shapes(scale: int = 1) -> list[tuple[int, int, int]]:
    """(M, K, N) forward products, deduplicated, smallest first; ``scale`` divides every dimension (dry run)."""
    shapes = set()
    for h, f, v, _heads, _kv, gated in FAMILIES.values():
        for t in (1, 2, 4, 8):
            kn = [(h, 3 * h // t), (h // t, h), (h, (2 if gated else 1) * f // t), (f // t, h), (h, -(-v // t))]
            for tokens in TOKENS[1:4] if t > 1 else TOKENS:
                shapes.update((tokens, k, n) for k, n in kn)
    shapes.update((8192, k, n) for k, n in ODD_PAIRS)
    return sorted({(max(m // scale, 1), max(k // scale, 1), max(n // scale, 1)) for m, k, n in shapes})


def make_timer(device: torch.device):
    """Seconds a call takes: triton's do_bench on CUDA (L2 flushed, median), the fastest of a few host-timed
    calls on a CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=5, rep=20, return_mode="median") / 1e3

    def cpu_time(fn):
        fn()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    return cpu_time


def measure_gemms(device, dtype, timer, scale: int) -> list[dict]:
    """Per forward product (M tokens, K in, N out): the forward, the input's gradient and the weight's, each a
    row keyed as the cost model prices it (M x K x N of the product it computes)."""
    rows, kind = [], "bf16" if dtype == torch.bfloat16 else "fp32"
    for m, k, n in gemm_shapes(scale):
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)
        g = torch.randn(m, n, device=device, dtype=dtype)
        for pass_, shape, fn in (("forward", (m, k, n), lambda: F.linear(x, w)),
                                 ("input-grad", (m, n, k), lambda: torch.mm(g, w)),
                                 ("weight-grad", (k, m, n), lambda: torch.mm(g.t(), x))):
            rows.append({"dtype": kind, "pass": pass_, "m": shape[0], "k": shape[1], "n": shape[2],
                         "seconds": timer(fn)})
        del x, w, g
    return rows


def measure_attention(device, dtype, timer, scale: int) -> list[dict]:
    """SDPA on each backend that accepts the case; a backend that refuses one is skipped."""
    from torch.nn.attention import SDPBackend

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION} if device.type == "cuda" else {"math": SDPBackend.MATH}
    rows, tokens = [], max(16384 // scale, 64)
    for name, backend in backends.items():
        for d in (64, 128):
            for s in (max(s // scale, 16) for s in SEQS):
                b, heads = max(tokens // s, 1), max(2048 // d // scale, 2)
                for gqa in ((False, True) if name == "flash" else (False,)):
                    rows.append(attention_row(name, backend, device, dtype, timer, b=b, heads=heads,
                                              kv=heads // 4 if gqa else heads, s=s, d=d))
    return [r for r in rows if r] + measure_attention_dropout(backends, device, dtype, timer, scale)


def measure_attention_dropout(backends: dict, device, dtype, timer, scale: int) -> list[dict]:
    """The GPT families' cores with attention dropout (gpt2-medium: d 64, s 1,024; gpt3-1.3b: d 128, s 2,048;
    p = 0.1) on each backend that takes it: the dropout's cost, and which backend trains a GPT fastest."""
    rows, tokens = [], max(16384 // scale, 64)
    for name, backend in backends.items():
        for d, s in ((64, max(1024 // scale, 16)), (64, max(2048 // scale, 16)), (128, max(2048 // scale, 16)),
                     (128, max(4096 // scale, 16))):
            b, heads = max(tokens // s, 1), max(2048 // d // scale, 2)
            rows.append(attention_row(name, backend, device, dtype, timer, b=b, heads=heads, kv=heads, s=s, d=d,
                                      dropout=DROPOUT))
    return [r for r in rows if r]


def attention_row(name: str, backend, device, dtype, timer, *, b: int, heads: int, kv: int, s: int, d: int,
                  dropout: float = 0.0) -> dict | None:
    """One causal SDPA case forced onto ``backend``, forward and backward timed; None where the backend does
    not run it here."""
    from torch.nn.attention import sdpa_kernel

    gqa = kv != heads
    q = torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, kv, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))

    def core():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, dropout_p=dropout)

    try:
        with sdpa_kernel([backend]):
            grad = torch.randn_like(core())
            fwd = timer(core)
            both = timer(lambda: torch.autograd.grad(core(), (q, k, v), grad))
    except RuntimeError:
        return None
    return {"backend": name, "dtype": "bf16" if dtype == torch.bfloat16 else "fp32", "s": s, "d": d, "gqa": gqa,
            "dropout": dropout, "fwd_s": fwd, "bwd_s": max(both - fwd, 1e-9),
            "fwd_flops": 4.0 * b * heads * s * s * d / 2}  # causal: half the scores


def measure_streaming(device, dtype, timer, scale: int) -> list[dict]:
    rows = []
    for mib in STREAM_MIB:
        n = max(mib * 2**20 // torch.tensor([], dtype=dtype).element_size() // scale, 1024)
        x = torch.randn(n // 1024, 1024, device=device, dtype=dtype)
        z, y = torch.randn_like(x), torch.empty_like(x)
        nbytes = x.nbytes
        # two tensors read, one written (an add of x to itself reads x from memory once: 2 x nbytes, not 3)
        for op, fn, moved in (("add", lambda: torch.add(x, z, out=y), 3 * nbytes),
                              ("layer_norm", lambda: F.layer_norm(x, (1024,)), 2 * nbytes),
                              ("softmax", lambda: torch.softmax(x, dim=-1), 2 * nbytes)):
            rows.append({"op": op, "bytes": moved, "seconds": timer(fn)})
        del x, y, z
    return rows


def measure_launch(device) -> tuple[float, float]:
    """(the device's time per tiny kernel back to back, the host's dispatch per op), seconds."""
    x = torch.zeros(1, device=device)
    n = 2000
    for _ in range(50):
        x.add_(1)
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(n):
            x.add_(1)
        end.record()
        host = (time.perf_counter() - t0) / n
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / n, host
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    host = (time.perf_counter() - t0) / n
    return host, host


class _Scaled(torch.autograd.Function):
    """A product by a constant written as a Python autograd Function (as ``llama.SwiGLU`` and gpt-oss's activation
    are): its forward and its backward each one kernel, the rest the Function's Python."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0001

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.0001


def measure_host_calls(device, calls: int = 100, runs: int = 20) -> dict:
    """Seconds of host a call costs where eager code wraps its kernels in Python (DeepSpeed's expert loop: each
    expert a module call whose activation is a Python autograd Function), forward and backward, by the host clock
    over a chain of ``calls`` on 16-element tensors (the kernels nothing beside the host's work); the fastest of
    ``runs``: an ``nn.Linear`` module's call (one GEMM forward, two backward) and a Python Function's (one kernel
    each way)."""
    linear = torch.nn.Linear(16, 16, bias=False, device=device)
    out = {}
    for name, step in (("module_call", linear), ("python_function", _Scaled.apply)):
        forward, backward = host_op_s(device, calls, runs, step=step, shape=(1, 16))
        out[name] = {"fwd_s": forward, "bwd_s": backward}
    return out


def measure_odd_rows(device, dtype, timer, scale: int) -> list[dict]:
    """The passes of a written-out attention core with a sink (``models.sinks``) over (heads, s, s) scores, against
    their aligned twins: a mask of (s, s) added by broadcast, a column concatenated (rows of s + 1), the softmax
    over rows of s + 1 and of s, the gradient of a slice (zeros, then a copy into them); bytes as each pass moves
    them, seconds by ``timer``."""
    heads, s = max(16 // scale, 1), max(4096 // scale, 64)
    x, y = (torch.randn(heads, s, s, device=device, dtype=dtype) for _ in range(2))
    mask = torch.randn(s, s, device=device, dtype=dtype)
    col = torch.randn(heads, s, 1, device=device, dtype=dtype)
    wide = torch.cat((x, col), dim=-1)
    n, e = x.numel(), x.element_size()

    def slice_grad():
        z = torch.zeros_like(wide)
        z[..., :-1].copy_(x)
        return z

    cases = (("broadcast_add", lambda: x + mask, 2 * n * e + mask.numel() * e),
             ("add", lambda: x + y, 3 * n * e),
             ("cat_column", lambda: torch.cat((x, col), dim=-1), 2 * n * e),
             ("softmax_odd_rows", lambda: torch.softmax(wide, dim=-1), 2 * wide.numel() * e),
             ("softmax_rows", lambda: torch.softmax(x, dim=-1), 2 * n * e),
             ("slice_gradient", slice_grad, 3 * n * e))
    rows = [{"op": op, "heads": heads, "s": s, "bytes": moved, "seconds": timer(fn)} for op, fn, moved in cases]
    del x, y, wide
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="on the CPU at 64x smaller shapes; nothing in the package")
    ap.add_argument("--out", default=None, help="the table's path (default: ds_pipe_ext/costs/kernels/<device>.json)")
    ap.add_argument("--smoke", action="store_true",
                    help=SMOKE_HELP + " (as --dry-run: the kernels it times are a GPU's)")
    args = ap.parse_args(argv)
    args.dry_run = args.dry_run or args.smoke
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        raise SystemExit("bench/gpu_kernels.py measures a CUDA GPU and this machine has none: --dry-run runs it on "
                         "the CPU at small shapes")
    device = torch.device("cuda" if cuda else "cpu")
    scale = 1 if cuda else 64
    dtype = torch.bfloat16 if cuda else torch.float32
    name = torch.cuda.get_device_name() if cuda else "cpu (dry run)"
    key = datasheet_name(name, torch.cuda.get_device_properties(0).total_memory) if cuda else "dry-run"
    if cuda and key is None:
        raise SystemExit(f"{name}: no datasheet spec here to attach a table to (known: {sorted(DEVICES)})")
    out = Path(args.out) if args.out else (TABLE_DIR / f"{key}.json" if cuda else None)
    if out is None and args.smoke:
        import tempfile

        out = Path(tempfile.mkdtemp(prefix="ds_pipe_ext_kernels_")) / "dry-run.json"
    if out is None:
        raise SystemExit("--dry-run writes nowhere in the package: pass --out")
    t0 = time.time()
    timer = make_timer(device)
    gemm = measure_gemms(device, dtype, timer, scale)
    print(f"gemm: {len(gemm)} shapes in {time.time() - t0:.0f} s", flush=True)
    attention = measure_attention(device, dtype, timer, scale)
    print(f"attention: {len(attention)} cases in {time.time() - t0:.0f} s", flush=True)
    streaming = measure_streaming(device, dtype, timer, scale)
    launch, host = measure_launch(device)
    host_op, host_op_bwd = host_op_s(device)  # an op with its autograd node, as the cpu spec measures it
    host_calls = measure_host_calls(device)
    odd_rows = measure_odd_rows(device, dtype, timer, scale)
    peak_bw = DEVICES[key].hbm_bandwidth if cuda else max(r["bytes"] / r["seconds"] for r in streaming)
    big = [r["bytes"] / r["seconds"] for r in streaming if r["op"] == "add" and r["bytes"] >= 3 * 64 * 2**20 // scale]
    fraction = min(statistics.median(big) / peak_bw, 1.0) if big else None
    table = {"device": key, "device_name": name, "date": datetime.date.today().isoformat(),
             "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
             "source": f"bench/gpu_kernels.py on {name}, torch {torch.__version__}", "gemm": gemm,
             "attention": attention, "streaming": streaming, "bandwidth_fraction": fraction,
             "launch_s": launch, "host_kernel_s": host, "host_op_s": host_op, "host_op_bwd_s": host_op_bwd,
             # measured for the expert loop's host and the sinks core's kernels; no price reads them yet
             "host_calls": host_calls, "odd_rows": odd_rows}
    KernelTable.from_json(table, "the measured table")  # what the cost model will read back
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1))
    print(f"wrote {out} in {time.time() - t0:.0f} s")
    for r in odd_rows:  # the sinks core's passes against their aligned twins
        print(f"  {r['op']:18s} {r['bytes'] / 2**20:8.1f} MiB {r['bytes'] / r['seconds'] / 1e9:8.1f} GB/s")
    print(f"RESULT device={key} gemms={len(gemm)} attention={len(attention)} "
          f"bandwidth_fraction={fraction if fraction is None else round(fraction, 3)} "
          f"launch_us={1e6 * launch:.2f} host_us={1e6 * host:.2f} host_op_us={1e6 * host_op:.2f} "
          f"host_op_bwd_us={1e6 * host_op_bwd:.2f} "
          f"module_call_us={1e6 * host_calls['module_call']['fwd_s']:.2f}/{1e6 * host_calls['module_call']['bwd_s']:.2f} "
          f"python_function_us={1e6 * host_calls['python_function']['fwd_s']:.2f}/"
          f"{1e6 * host_calls['python_function']['bwd_s']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
