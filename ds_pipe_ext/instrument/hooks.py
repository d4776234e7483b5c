"""Per-stage timing and memory for DeepSpeed's PipelineEngine.

``instrument_engine`` puts a timed copy of the engine's instruction map on the
engine instance (``compat.instructions``; it also wraps ``train_batch`` and the
loss aggregation), so nothing changes, and nothing costs anything, when
instrumentation is off: no hook is installed at all.

Per step it records, for this rank's stage: forward and backward time of every
micro-batch, p2p send/recv time by kind, gradient reduction and optimizer-step
time, and memory (parameters, gradients, optimizer states, peak of saved
activations, process/allocator peak).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch

from ..compat.engine import loss_terms
from ..compat.instructions import unwrap_engine, wrap_engine
from .experts import ExpertLoadMeter
from .layer_timing import LayerTimer
from .memory import ModelStateProbe, SavedActivationMeter, step_memory_fields
from .peak import PeakTracer

# instruction class name -> record key
_KINDS = {
    "ForwardPass": "forward",
    "BackwardPass": "backward",
    "SendActivation": "send_activation",
    "RecvActivation": "recv_activation",
    "SendGrad": "send_grad",
    "RecvGrad": "recv_grad",
    "ReduceGrads": "reduce_grads",
    "ReduceTiedGrads": "reduce_tied_grads",
    "OptimizerStep": "optimizer_step",
    "LoadMicroBatch": "load_micro_batch",
}


class _Clock:
    """perf_counter on CPU; CUDA events on GPU, read once per step (no sync per instruction)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[str, object, object]] = []

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, kind: str, token, out: dict) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((kind, token, end))
        else:
            out[kind].append(1e3 * (time.perf_counter() - token))

    def resolve(self, out: dict) -> None:
        if self.pending:
            self.pending[-1][2].synchronize()
            for kind, start, end in self.pending:
                out[kind].append(start.elapsed_time(end))
            self.pending.clear()


class StageRecorder:
    def __init__(self, engine, emit: Callable[[dict], None], peak_step: int = 0, per_layer: bool = False):
        self.engine = engine
        self.emit = emit
        module = engine.module
        self.device = next(module.parameters()).device if any(True for _ in module.parameters()) else torch.device("cpu")
        self.clock = _Clock(self.device)
        self.meter = SavedActivationMeter(module)
        self.step = 0
        self.times: dict[str, list[float]] = defaultdict(list)
        self.states = ModelStateProbe(module, engine.optimizer)  # counted at the optimizer step
        self.tracer = PeakTracer(module, engine.optimizer, self.device, peak_step) if peak_step else None
        self.experts = ExpertLoadMeter(module)  # Mixture-of-Experts stages: the routers' loads
        self.layers = LayerTimer(module, _Clock(self.device)) if per_layer else None

    def _enter(self, kind: str) -> None:
        if self.tracer is not None:
            self.tracer.enter(kind)

    def wrap_instruction(self, kind: str, fn):
        recorder = self

        if kind == "forward":
            def run(engine, **kw):
                recorder._enter(kind)
                token = recorder.clock.start()
                with recorder.meter.forward(kw.get("buffer_id", 0)):
                    fn(engine, **kw)
                recorder.clock.stop(kind, token, recorder.times)
                if recorder.tracer is not None:
                    recorder.tracer.sight_ptrs("activation_bytes", recorder.meter.last_saved)
        elif kind == "backward":
            def run(engine, **kw):
                recorder._enter(kind)
                token = recorder.clock.start()
                fn(engine, **kw)
                recorder.clock.stop(kind, token, recorder.times)
                recorder.meter.backward_done(kw.get("buffer_id", 0))
                if recorder.tracer is not None:
                    recorder.tracer.sight_held()
        else:
            def run(engine, **kw):
                recorder._enter(kind)
                token = recorder.clock.start()
                fn(engine, **kw)
                recorder.clock.stop(kind, token, recorder.times)
                if recorder.tracer is not None and kind in ("reduce_grads", "reduce_tied_grads", "optimizer_step"):
                    recorder.tracer.sight_held()
        return run

    def wrap_call(self, kind: str, fn):
        recorder = self

        def run(*args, **kwargs):
            token = recorder.clock.start()
            out = fn(*args, **kwargs)
            recorder.clock.stop(kind, token, recorder.times)
            return out

        return run

    def wrap_train_batch(self, train_batch):
        recorder = self

        def run(*args, **kwargs):
            recorder.times.clear()
            recorder.meter.reset_peak()
            if recorder.tracer is not None:
                recorder.tracer.step_starting(recorder.step + 1)
            t0 = time.perf_counter()
            loss = train_batch(*args, **kwargs)
            if recorder.clock.cuda:
                torch.cuda.synchronize(recorder.device)
            step_ms = 1e3 * (time.perf_counter() - t0)
            recorder.clock.resolve(recorder.times)
            recorder.step += 1
            recorder.emit(recorder.record(step_ms, loss))
            return loss

        return run

    def record(self, step_ms: float, loss) -> dict:
        eng = self.engine
        rec = {
            "step": self.step,
            "rank": eng.global_rank,
            "stage": eng.stage_id,
            "num_stages": eng.num_stages,
            "micro_batches": eng.micro_batches,
            "step_ms": step_ms,
            "loss": float(loss) if loss is not None else None,
            "forward_ms": list(self.times.get("forward", [])),
            "backward_ms": list(self.times.get("backward", [])),
        }
        for kind in [*_KINDS.values(), "aggregate_loss"]:
            if kind not in ("forward", "backward"):
                rec[f"{kind}_ms"] = sum(self.times.get(kind, []))
        rec.update(step_memory_fields(self.states, self.meter, self.device))
        if self.layers is not None:
            rec.update(self.layers.take_step())
        if self.experts:
            rec.update(self.experts.read())
        terms = loss_terms(eng)  # the loss's named terms (MoE: lm and aux loss)
        if terms:
            rec["loss_terms"] = {name: float(v) for name, v in terms.items()}
        peak = self.tracer.step_ended(self.step) if self.tracer is not None else None
        if peak is not None:
            rec["peak"] = peak
        return rec


def instrument_engine(engine, emit: Callable[[dict], None], *, peak_step: int = 0,
                      per_layer: bool = False) -> StageRecorder:
    """Install timing on a PipelineEngine; ``emit`` receives one record per step (step ``peak_step``'s
    with its traced live-tensor peak, ``instrument.peak``; with ``per_layer``, each layer's calls)."""
    recorder = StageRecorder(engine, emit, peak_step, per_layer)
    wrap_engine(
        engine,
        instruction=lambda name, fn: recorder.wrap_instruction(_KINDS.get(name, name), fn),
        train_batch=recorder.wrap_train_batch,
        # the loss broadcast after the schedule is part of every step too
        aggregate_loss=lambda fn: recorder.wrap_call("aggregate_loss", fn),
    )
    return recorder


def remove_instrumentation(engine, recorder: StageRecorder | None = None) -> None:
    """Undo ``instrument_engine``: the engine runs DeepSpeed's own methods again."""
    unwrap_engine(engine)
    if recorder is not None:
        recorder.states.remove()
        recorder.experts.remove()
        if recorder.layers is not None:
            recorder.layers.remove()
