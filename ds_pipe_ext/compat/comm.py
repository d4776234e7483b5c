"""Time spent in DeepSpeed's collectives, by kind, for the data-parallel instrumentation.

ZeRO calls its collectives through the ``deepspeed.comm`` package
(``from deepspeed import comm as dist; dist.all_reduce(...)``), so a timed copy of
each function put on that package is what ZeRO calls.  An asynchronous call
(``async_op=True``, ZeRO-3's parameter prefetch) returns a handle whose ``wait()`` is
timed too, so the figure is the time the caller spent issuing and waiting, not the
transfer's duration.  ``time_collectives`` returns the function that puts DeepSpeed's
own functions back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# deepspeed.comm function -> the kind it is recorded under
COLLECTIVE_KINDS = {
    "all_reduce": "reduce_grads", "reduce": "reduce_grads", "reduce_scatter_fn": "reduce_grads",
    "reduce_scatter_tensor": "reduce_grads", "reduce_scatter": "reduce_grads",
    "allgather_fn": "all_gather", "all_gather_into_tensor": "all_gather", "all_gather": "all_gather",
}


class _TimedHandle:
    def __init__(self, handle, kind: str, record: Callable[[str, float], None]):
        self._handle, self._kind, self._record = handle, kind, record

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self._handle.wait(*args, **kwargs)
        self._record(self._kind, 1e3 * (time.perf_counter() - t0))
        return out

    def __getattr__(self, name):
        return getattr(self._handle, name)


def time_collectives(record: Callable[[str, float], None]) -> Callable[[], None]:
    """Report ``record(kind, ms)`` for every collective ZeRO issues; returns the undo."""
    import deepspeed.comm as dist

    originals = {name: getattr(dist, name) for name in COLLECTIVE_KINDS if hasattr(dist, name)}
    depth = [0]  # a collective implemented by another is counted once, at the outer call

    def timed(name, fn):
        kind = COLLECTIVE_KINDS[name]

        def run(*args, **kwargs):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                record(kind, 1e3 * (time.perf_counter() - t0))
                if out is not None and hasattr(out, "wait"):
                    return _TimedHandle(out, kind, record)
            return out

        return run

    for name, fn in originals.items():
        setattr(dist, name, timed(name, fn))

    def undo() -> None:
        for name, fn in originals.items():
            setattr(dist, name, fn)

    return undo
