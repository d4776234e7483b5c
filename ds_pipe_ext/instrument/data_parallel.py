"""Per-rank timing and memory for a data-parallel (ZeRO) engine, in the pipeline's record format.

The trainer's data-parallel step calls ``phase("forward" | "backward" | "optimizer_step")``
around the engine's calls, and ``end_step`` once per optimizer step.  Collectives are
timed where ZeRO issues them (``compat.comm``): gradient reduce / reduce-scatter as
``reduce_grads_ms`` and ZeRO-3's parameter all-gathers as ``all_gather_ms``; both run
inside the forward, backward and step phases, so they are parts of those, not extra.

A record has the keys of a pipeline stage's (``instrument.hooks``) with ``stage`` 0 of
``num_stages`` 1, so ``RunSink``, the report and the comparison read both alike.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from ..compat.comm import time_collectives
from .experts import ExpertLoadMeter
from .memory import ModelStateProbe, SavedActivationMeter, step_memory_fields
from .peak import PeakTracer


class DataParallelRecorder:
    def __init__(self, engine, emit: Callable[[dict], None], *, rank: int, micro_batches: int, peak_step: int = 0):
        self.engine, self.emit, self.rank, self.micro_batches = engine, emit, rank, micro_batches
        self.device = next(engine.module.parameters()).device
        self.meter = SavedActivationMeter(engine.module)
        self.states = ModelStateProbe(engine.module, engine.optimizer)
        self.times: dict[str, list[float]] = defaultdict(list)
        self._undo_comm = time_collectives(lambda kind, ms: self.times[kind].append(ms))
        self.step = 0
        self._t0 = 0.0
        self.tracer = PeakTracer(engine.module, engine.optimizer, self.device, peak_step) if peak_step else None
        self.experts = ExpertLoadMeter(engine.module)  # Mixture-of-Experts models: the routers' loads

    def begin_step(self) -> None:
        self.times.clear()
        self.meter.reset_peak()
        if self.tracer is not None:
            self.tracer.step_starting(self.step + 1)
        self._t0 = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, kind: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.tracer is not None:
            self.tracer.enter(kind)
        t0 = time.perf_counter()
        with self.meter.forward(0) if kind == "forward" else contextlib.nullcontext():
            yield
        if self.tracer is not None:
            if kind == "forward":
                self.tracer.sight_ptrs("activation_bytes", self.meter.last_saved)
            self.tracer.sight_held()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times[kind].append(1e3 * (time.perf_counter() - t0))
        if kind == "backward":
            self.meter.backward_done(0)

    def end_step(self, loss: float) -> None:
        self.step += 1
        step_ms = 1e3 * (time.perf_counter() - self._t0)
        rec = {"step": self.step, "rank": self.rank, "stage": 0, "num_stages": 1,
               "micro_batches": self.micro_batches, "step_ms": step_ms, "loss": loss,
               "forward_ms": list(self.times["forward"]), "backward_ms": list(self.times["backward"])}
        for kind in ("optimizer_step", "reduce_grads", "all_gather"):
            rec[f"{kind}_ms"] = sum(self.times.get(kind, []))
        rec.update(step_memory_fields(self.states, self.meter, self.device))
        if self.experts:
            rec.update(self.experts.read())
        peak = self.tracer.step_ended(self.step) if self.tracer is not None else None
        if peak is not None:
            rec["peak"] = peak
        self.emit(rec)

    def remove(self) -> None:
        self._undo_comm()
        self.states.remove()
        self.experts.remove()


class NoRecorder:
    """What the step calls when instrumentation is off: nothing."""

    def begin_step(self) -> None:
        pass

    def phase(self, kind: str):
        return contextlib.nullcontext()

    def end_step(self, loss: float) -> None:
        pass
