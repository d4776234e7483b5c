"""Timing on a CUDA device: a loop of calls, not one call between two events.

One forward between two CUDA events, repeated after a synchronisation, reads the launch gaps of each
repeat and whatever clock the GPU came back to while the host waited: on an H200 the same GPT-2 medium
block read 2.02 + 2.58 ms in one profile and 1.13 + 1.54 ms in another, while triton's ``do_bench``
read 0.654 ms forward and 2.595 ms forward + backward.  So a layer is timed here as kernels run in
training, back to back: ``triton.testing.do_bench`` where triton is importable (it ships with CUDA
builds of torch: warm-up 25 ms, 100 ms of repetitions, the L2 cache flushed before every call, the
median call), else ``torch.utils.benchmark.Timer.blocked_autorange`` (the median of blocks of calls,
at least 0.2 s).  The backward is never timed alone: autograd needs a fresh forward for each, so
forward + backward is timed as a loop and the forward loop is taken off.
"""

from __future__ import annotations

from collections.abc import Callable

Timer = Callable[[Callable[[], object]], float]  # seconds per call of a function, timed as a loop


def cuda_timer(min_run_time: float = 0.2) -> Timer:
    """``do_bench`` (its defaults, the median call) where triton imports, else torch's ``blocked_autorange`` over
    at least ``min_run_time`` seconds."""
    try:
        from triton.testing import do_bench
    except ImportError:
        from torch.utils.benchmark import Timer as TorchTimer

        return lambda fn: TorchTimer(stmt="fn()", globals={"fn": fn}).blocked_autorange(
            min_run_time=min_run_time).median
    return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def forward_backward_s(forward: Callable[[], object], backward: Callable[[object], None],
                       timer: Timer) -> tuple[float, float]:
    """(forward, backward) seconds of a layer: ``forward()`` as a loop, ``backward(forward())`` as a loop,
    the backward their difference (never below zero: the two loops are timed apart)."""
    fwd = timer(forward)
    both = timer(lambda: backward(forward()))
    return fwd, max(both - fwd, 0.0)
