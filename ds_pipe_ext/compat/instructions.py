"""Wrapping a PipelineEngine's instructions on one engine instance.

DeepSpeed's ``PipelineEngine`` runs its schedule by looking each instruction class up
in the class attribute ``_INSTRUCTION_MAP`` (class -> unbound method) and calls
``_aggregate_total_loss`` after the schedule.  Both are private: see ``ds_pipe_ext.compat``.
A wrapped copy put on the instance shadows the class map for that engine only, so
nothing changes, and nothing costs anything, for an engine that is not wrapped.
Wrapping composes: it wraps whatever the instance runs now (GPipe's per-micro-batch
losses, ``compat.engine``), and unwrapping puts that back.
"""

from __future__ import annotations

from collections.abc import Callable

_WRAPPED = ("_INSTRUCTION_MAP", "train_batch", "_aggregate_total_loss")
_SAVED = "_ds_pipe_ext_before_wrap"


def wrap_engine(
    engine,
    *,
    instruction: Callable[[str, Callable], Callable],
    train_batch: Callable[[Callable], Callable],
    aggregate_loss: Callable[[Callable], Callable],
) -> None:
    """Replace, on ``engine`` only: each instruction's method by ``instruction(class name, method)``,
    ``train_batch`` by ``train_batch(bound method)``, and the loss aggregation likewise."""
    engine.__dict__[_SAVED] = {name: engine.__dict__[name] for name in _WRAPPED if name in engine.__dict__}
    engine._INSTRUCTION_MAP = {cls: instruction(cls.__name__, fn) for cls, fn in engine._INSTRUCTION_MAP.items()}
    engine.train_batch = train_batch(engine.train_batch)
    engine._aggregate_total_loss = aggregate_loss(engine._aggregate_total_loss)


def unwrap_engine(engine) -> None:
    """Undo ``wrap_engine``: the engine runs what it ran before."""
    saved = engine.__dict__.pop(_SAVED, {})
    for name in _WRAPPED:
        engine.__dict__.pop(name, None)
    engine.__dict__.update(saved)
