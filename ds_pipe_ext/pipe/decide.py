"""Decide on rank 0, tell every rank: the one pattern for anything that can fail or communicate.

A decision that only rank 0 makes (profiling for a partition or a prediction, reading
a run directory, validating a checkpoint) must never leave the other ranks waiting in
a collective that rank 0 will not join because it raised.  ``decide_and_broadcast``
runs ``decide`` on rank 0, lets the ``peers`` that must take part in its collectives
(rank 0's tensor-parallel group when profiling TP layers) run it alongside, then
broadcasts either the result or rank 0's error: every rank returns the same value or
raises the same ``DecisionError``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TypeVar

import torch.distributed as dist

from ..device import collective_device

T = TypeVar("T")


class DecisionError(RuntimeError):
    """Rank 0 could not decide; raised on every rank with rank 0's reason."""


def decide_and_broadcast(decide: Callable[[], T], *, what: str, rank: int | None = None, group=None,
                         peers: Collection[int] = (0,)) -> T:
    rank = dist.get_rank() if rank is None else rank
    outcome: list = [None, None]  # result, error
    if rank == 0:
        try:
            outcome[0] = decide()
        except Exception as e:  # noqa: BLE001 - forwarded to every rank below
            outcome[1] = f"{type(e).__name__}: {e}"
    elif rank in peers:
        try:
            decide()  # takes part in rank 0's collectives; only rank 0's result is used
        except Exception:  # noqa: BLE001 - rank 0 reports the failure to everyone
            pass
    dist.broadcast_object_list(outcome, src=0, group=group, device=collective_device(group))
    result, error = outcome
    if error is not None:
        raise DecisionError(f"{what} failed on rank 0: {error}")
    return result


def run_everywhere(work: Callable[[], T], *, what: str, group=None) -> T:
    """``work`` on every rank, each on its own data (a rank's own files); every rank raises if any rank failed,
    naming the first that did, so no rank goes on with state the others lack."""
    error = None
    try:
        result = work()
    except Exception as e:  # noqa: BLE001 - gathered and raised on every rank below
        result, error = None, f"{type(e).__name__}: {e}"
    errors = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        rank, first = failed[0]
        raise DecisionError(f"{what} failed on rank {rank}" + (f" (and {len(failed) - 1} more)" if len(failed) > 1
                                                                else "") + f": {first}")
    return result
