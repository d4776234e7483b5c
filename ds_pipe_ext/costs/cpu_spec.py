"""The ``cpu`` device spec: measured on the CPU this process runs on, as ``cuda`` is measured on the GPU
(``costs.cuda_spec``).  Short fp32 micro-benchmarks, each the fastest of its timed runs, cached per thread
count and mmap threshold; the processes that ask at once (a launch's ranks on a fresh machine) measure once.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

from .cache import measured_once
from .device_spec import DeviceSpec


def measure_cpu(cache_dir: str | None = ".ds_pipe_ext_cache", *, seconds: float = 0.5) -> DeviceSpec:
    """A 'cpu' spec from short fp32 micro-benchmarks (cached per thread count and mmap threshold),
    each the fastest of its timed runs.

    matmul: 1024^3 GEMMs.  Memory bandwidth: a copy between two warm 64 MiB buffers (beyond the
    caches), and an in-place add over them (``add_bandwidth``: autograd's accumulation).  Vector peak: an
    add on warm 128 KiB buffers (cache-resident, so it measures the arithmetic, not the memory traffic the
    roofline charges separately).  First touches: filling a
    fresh anonymous 64 MiB mapping (what glibc returns above its mmap threshold) against filling a
    warm buffer; the difference is the page faults.  Zeroing a warm 256 MiB buffer (``fill_bandwidth``),
    drawing a dropout mask of 2^20 elements (``random_rate``) and looking up rows of a table beyond the
    caches at random (``row_op_s``) and their backward's row adds (``row_add_s``), a forward GEMM whose
    output width breaks 64-byte row alignment (4,097 against 4,096 columns: ``misaligned_output_efficiency``),
    an exp over the vector peak's cache-resident buffer (``exp_rate``; arguments in float32's normal range,
    as the code keeps them), and what the host spends issuing a tiny op, forward and backward (``host_op_s``,
    ``host_op_bwd_s``).  Faults are charged above the threshold the training processes run with
    (``training_mmap_threshold``: train.py fixes it at 1 GiB).
    """
    import torch

    from ..compat.cpu_shims import steady_host_allocator, training_mmap_threshold

    # measured under the allocator train.py's ranks run with (as the profiler is): else the fill below
    # times page faults or not depending on what this process allocated before
    steady_host_allocator()
    threads = torch.get_num_threads()
    mmap_min = training_mmap_threshold()  # what train.py's ranks map afresh (steady_host_allocator)
    path = Path(cache_dir) / f"cpu-spec-v17-{threads}threads-mmap{int(mmap_min)}.json" if cache_dir else None
    # the ranks of a launch on a fresh machine: one measures, the others read
    return measured_once(path, lambda: _measure_cpu_now(mmap_min, seconds), parse=lambda d: DeviceSpec(**d),
                         dump=asdict)


def _measure_cpu_now(mmap_min: float, seconds: float) -> DeviceSpec:
    """``measure_cpu``'s micro-benchmarks, run here and now; ``mmap_min``: the threshold faults are charged above."""
    import mmap

    import numpy as np
    import torch

    def seconds_per_call(fn, batch: int = 1):
        """The fastest of many timed batches of calls: the machine's speed when neighbours leave it
        alone (on a shared machine they only ever add time), as the fastest profiled pass is."""
        fn()
        best, t_end = float("inf"), time.perf_counter() + seconds / 4
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            best = min(best, (time.perf_counter() - t0) / batch)
        return best

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    mm = 2 * 1024**3 / seconds_per_call(lambda: a @ b)
    x = torch.empty(16 * 2**20)  # 64 MiB: beyond the caches
    y = torch.empty_like(x)
    bw = 2 * x.nbytes / seconds_per_call(lambda: y.copy_(x))
    # autograd's accumulation (grad += new_grad) over the same pair, counted as the copy is: 0.80-0.84 of its time
    add = 2 * x.nbytes / seconds_per_call(lambda: y.add_(x))
    small, small_out = torch.ones(32 * 2**10), torch.ones(32 * 2**10)  # 128 KiB each: cache-resident
    vec = small.numel() / seconds_per_call(lambda: torch.add(small, small_out, out=small_out), batch=20)
    # first touches of an anonymous mapping (what glibc hands out above its threshold), whatever this
    # process's own malloc thresholds are
    warm_pages = y.numpy()  # the copy's warm destination, filled the same way as the fresh mapping

    def fresh_pages():
        region = mmap.mmap(-1, x.nbytes)
        pages = np.frombuffer(region, dtype=np.float32)
        pages.fill(1.0)
        del pages
        region.close()

    warm = seconds_per_call(lambda: warm_pages.fill(1.0))
    fresh = seconds_per_call(fresh_pages)
    faults = x.nbytes / max(fresh - warm, 1e-9)
    # zeroing a dense gradient table: a warm 256 MiB buffer (8x this class of machine's last-level
    # cache; on 64 MiB the tail of the previous pass was still cached and zeroing ran 20-30% faster
    # than on the 100-150 MB tables it stands for).  Warm, as the training allocator hands it back; a
    # fresh torch.zeros of this size came from mmap in some processes (the heap could not grow in
    # place) and timed page faults at a tenth of the rate
    table = torch.empty(64 * 2**20)
    fill = table.nbytes / seconds_per_call(table.zero_)
    del table
    mask = torch.empty(2**20)
    random = mask.numel() / seconds_per_call(lambda: mask.bernoulli_(0.9))  # a dropout mask's draws
    # rows of a 128 MiB table looked up at random with the caches flushed first, as an embedding's are
    # after a backward has zeroed its gradient table
    words, width, tokens = 65536, 512, 4096
    lookup_table, flush = torch.randn(words, width), torch.empty(16 * 2**20)
    ids = torch.randint(0, words, (tokens,), generator=torch.Generator().manual_seed(0))

    def cold_lookup():
        flush.zero_()
        t0 = time.perf_counter()
        torch.nn.functional.embedding(ids, lookup_table)
        return time.perf_counter() - t0

    row_op = min(cold_lookup() for _ in range(12)) / tokens
    # the backward of those lookups (torch's embedding_dense_backward_cpu): a zeroed table, then per token one
    # TensorIterator add of its gradient row into a row at random, a kernel dispatched per row; less the
    # zeroing (``fill_bandwidth``'s), what each token costs
    grad_rows = torch.randn(tokens, width)

    def cold(call) -> float:
        flush.zero_()
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0

    # against the same backward of no tokens (its table allocated and zeroed alike, whatever the heap hands it),
    # the two alternating so that both see the allocator in the same state
    dense_backward = torch.ops.aten.embedding_dense_backward
    backward, zeroed = [], []
    for _ in range(6):
        backward.append(cold(lambda: dense_backward(grad_rows, ids, words, -1, False)))
        zeroed.append(cold(lambda: dense_backward(grad_rows[:0], ids[:0], words, -1, False)))
    row_add = max(min(backward) - min(zeroed), 0.0) / tokens
    del lookup_table, flush, grad_rows
    # the same forward GEMM with its output one column wider: rows no longer 64-byte aligned
    inputs, aligned, ragged = torch.randn(512, 1024), torch.randn(4096, 1024), torch.randn(4097, 1024)
    misaligned = (seconds_per_call(lambda: torch.nn.functional.linear(inputs, aligned)) * 4097 / 4096
                  / seconds_per_call(lambda: torch.nn.functional.linear(inputs, ragged)))
    exps = small.numel() / seconds_per_call(lambda: torch.exp(small, out=small_out), batch=20)
    host_op, host_op_bwd = host_op_s()
    ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    spec = DeviceSpec("cpu", {"fp32": mm, "bf16": mm}, {"fp32": vec, "bf16": vec}, bw, bw, bw, ram, gpus_per_node=1,
                      matrix_efficiency=1.0, attention_efficiency=1.0, vector_efficiency=1.0, memory_efficiency=1.0,
                      comm_efficiency=1.0, fresh_page_bandwidth=faults, fresh_alloc_min_bytes=mmap_min,
                      fill_bandwidth=fill, add_bandwidth=add, random_rate=random, row_op_s=row_op, row_add_s=row_add,
                      misaligned_output_efficiency=min(misaligned, 1.0), exp_rate=exps,
                      host_op_s=host_op, host_op_bwd_s=host_op_bwd)
    return spec


def host_op_s(device="cpu", ops: int = 200, runs: int = 20, *, step=None, shape=(16,)) -> tuple[float, float]:
    """(seconds an eager op costs the host forward, seconds an autograd node's op costs backward) on ``device``, by
    the host clock: a chain of ``ops`` products on a 16-element tensor that requires grad, whose work is nothing
    beside its dispatch, its output's allocation and (forward) the autograd node's recording; the fastest of
    ``runs`` (a CUDA device synchronised around each run; bench/gpu_kernels.py measures a GPU's host so).
    ``step``: another call to chain in place of the product (a module's, a Python autograd Function's), on a
    tensor of ``shape``."""
    import torch

    step = step or (lambda y: y * 1.0001)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    forward = backward = float("inf")
    for _ in range(runs):
        y = torch.ones(shape, device=device, requires_grad=True)
        sync()
        t0 = time.perf_counter()
        for _ in range(ops):
            y = step(y)
        t1 = time.perf_counter()
        y.backward(torch.ones_like(y))
        t2 = time.perf_counter()
        sync()
        forward, backward = min(forward, (t1 - t0) / ops), min(backward, (t2 - t1) / ops)
    return forward, backward


def median_of(specs: list[DeviceSpec]) -> DeviceSpec:
    """Each micro-benchmark's median over several ``measure_cpu`` passes taken between a process's profiles.  The
    first pass of a fresh process copies faster than the later ones (its buffers on pages nothing used before: 20-24
    GB/s where the same copy ran 16-18 after the profiles had allocated and freed; three processes here), and the
    fastest keeps that first pass; the median keeps the rate the profiles' layers ran beside."""
    def median(key: str) -> float:
        return statistics.median(v["fp32"] if isinstance(v := getattr(s, key), dict) else v for s in specs)

    return replace(specs[0], matrix_flops={"fp32": median("matrix_flops"), "bf16": median("matrix_flops")},
                   vector_flops={"fp32": median("vector_flops"), "bf16": median("vector_flops")},
                   **{key: median(key) for key in ("hbm_bandwidth", "fill_bandwidth", "add_bandwidth", "random_rate",
                                                   "row_op_s", "row_add_s", "fresh_page_bandwidth", "exp_rate",
                                                   "host_op_s", "host_op_bwd_s")})
