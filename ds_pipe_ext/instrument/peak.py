"""The live-tensor peak of one training step, measured from allocation events, and what it held.

The model-state probe counts what a rank holds at the optimizer step; what runs out of memory is
the peak over the whole step.  ``step_peak`` finds it from the allocator's own events (on CPU,
``torch.profiler``'s with ``profile_memory=True``): every allocation and free in time order, the
tensors alive when the step began, and markers the step drops on its way (``StepTrace``):

- phase markers say when each tensor was made: the forward of micro-batch k, its backward, the
  gradient reduction, the optimizer step;
- sightings say what a tensor is: at a marker the trace is shown DeepSpeed's own tensors (its
  parameters, gradients, optimizer states, ZeRO's buffers) and the tensors autograd saved, and a
  live allocation whose address is among them takes that kind.

A tensor never sighted is a temporary of the phase that made it.  Nothing here knows the model or
its predicted terms: the kinds come from the tensors the engine and autograd hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LARGEST = 12  # blocks listed from the peak, to say what filled it
# what a sighted tensor is; anything else made in the step is "temporary"
KINDS = ("param_bytes", "grad_bytes", "optimizer_bytes", "buffer_bytes", "gathered_bytes", "activation_bytes")


@dataclass(frozen=True)
class Alloc:
    """One allocator event: ``nbytes`` > 0 an allocation, < 0 the free of the block at ``ptr``."""

    t_ns: int
    ptr: int
    nbytes: int
    op: str = ""  # the ops that made it, outermost first (``allocating_op``)


@dataclass(frozen=True)
class Marker:
    """A point the step passed at ``t_ns``: entering ``phase`` (None: a sighting only), with the
    ``(ptr, kind)`` of the tensors shown to the trace there."""

    t_ns: int
    phase: str | None = None
    sightings: tuple[tuple[int, str], ...] = ()
    reachable: frozenset | None = None  # the storage addresses Python reached there (None: not looked)


@dataclass
class StepPeak:
    """The most bytes alive at once in the step, when, and what they were."""

    peak_bytes: int
    phase: str  # the phase the peak fell in ("forward 3", "backward 0", "reduce", "optimizer_step", ...)
    by_kind: dict[str, int] = field(default_factory=dict)  # KINDS, "temporary", "other" (held at the start, unsighted)
    temporary_by_phase: dict[str, int] = field(default_factory=dict)  # phase kind -> temporaries made in it
    start_bytes: int = 0  # alive when the step began
    unmatched_free_bytes: int = 0  # frees of blocks the trace never saw allocated (kept alive in the count)
    unseen_free_bytes: int = 0  # blocks made in the step whose free the trace did not see (see step_peak)
    largest: list[tuple[int, str, str]] = field(default_factory=list)  # the step's blocks alive at the peak, largest first: (nbytes, kind, phase made)
    # the step's blocks alive at the peak summed by what they are and the op that made them, largest first:
    # (nbytes, kind, op, blocks); says which op's tensors a kind's bytes are
    by_op: list[tuple[int, str, str, int]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "phase": self.phase, "by_kind": dict(self.by_kind),
                "temporary_by_phase": dict(self.temporary_by_phase), "start_bytes": self.start_bytes,
                "unmatched_free_bytes": self.unmatched_free_bytes, "unseen_free_bytes": self.unseen_free_bytes,
                "largest": [list(b) for b in self.largest], "by_op": [list(b) for b in self.by_op]}


def _phase_kind(phase: str) -> str:
    """'forward 3' -> 'forward'."""
    return phase.split(" ", 1)[0]


def step_peak(events: list[Alloc], markers: list[Marker], *, start_ns: int, start_held: dict[int, tuple[int, str]],
              start_bytes: int, end_ns: int | None = None) -> StepPeak:
    """The peak of the step that began at ``start_ns`` (and ends at ``end_ns``, or the last event).

    ``events`` and ``markers`` may begin earlier (a warm-up step traced before it): an allocation made
    then and freed in the step is a free the trace can match.  ``start_bytes`` were alive at ``start_ns``
    (every tensor, counted apart from the events); ``start_held`` maps the addresses of those of them
    that are model states or buffers to ``(nbytes, kind)``.

    A free the trace does not see (the profiler records only the threads it profiles, and gloo's worker
    thread may drop a collective's buffer last) leaves a block that never dies, or whose address a later
    allocation takes.  Such a block was freed by the first phase marker after it was made at which
    Python no longer reached it (``Marker.reachable``), else by the allocation that took its address
    (``unseen_free_bytes`` counts them).  A block freed where the trace sees it keeps that free: autograd
    holds saved tensors where Python does not reach them."""
    events = sorted(events, key=lambda e: e.t_ns)
    markers = sorted(markers, key=lambda m: m.t_ns)
    end_ns = end_ns if end_ns is not None else max([e.t_ns for e in events] + [start_ns])

    # every block's life [made, freed): the phase that made it and, from the sightings inside its
    # life, its kind.  A free of a block made before the trace has made None.
    blocks: list[dict] = []
    live: dict[int, dict] = {}
    phase = "before"
    looked = [m for m in markers if m.reachable is not None]
    unseen: list[dict] = []

    def unreached(b: dict, limit: int | None) -> int | None:
        """The first marker after ``b`` was made where Python no longer reached it, before ``limit``."""
        for m in looked:
            if m.t_ns > b["made"] and (limit is None or m.t_ns <= limit) and b["ptr"] not in m.reachable:
                return m.t_ns
        return limit

    timeline = sorted([(e.t_ns, 1, e) for e in events] + [(m.t_ns, 0, m) for m in markers], key=lambda x: (x[0], x[1]))
    for t, is_event, item in timeline:
        if not is_event:
            phase = item.phase or phase
            for ptr, kind in item.sightings:
                if ptr in live and live[ptr]["kind"] is None:
                    live[ptr]["kind"] = kind
        elif item.nbytes > 0:
            if item.ptr in live:  # the block there was freed unseen
                old = live.pop(item.ptr)
                old["freed"] = unreached(old, t)
                unseen.append(old)
            live[item.ptr] = {"made": t, "freed": None, "nbytes": item.nbytes, "phase": phase, "kind": None,
                              "ptr": item.ptr, "op": item.op}
            blocks.append(live[item.ptr])
        elif item.ptr in live:
            live.pop(item.ptr)["freed"] = t
        else:
            blocks.append({"made": None, "freed": t, "nbytes": -item.nbytes, "phase": phase, "kind": None,
                           "ptr": item.ptr})

    for ptr, b in list(live.items()):  # never freed in the trace: freed unseen if Python let it go
        if b["made"] is not None and b["made"] >= start_ns and (gone := unreached(b, None)) is not None:
            b["freed"] = gone
            unseen.append(live.pop(ptr))
    in_step = lambda t: t is not None and start_ns <= t <= end_ns  # noqa: E731
    from_before = [b for b in blocks if (b["made"] is None or b["made"] < start_ns) and in_step(b["freed"])]
    # a free of a block nobody counted at the start (made before the trace, not a held tensor): the
    # start's count may or may not include it, so it is left out and reported
    unmatched = sum(b["nbytes"] for b in from_before if b["made"] is None and b["ptr"] not in start_held)
    from_before = [b for b in from_before if b["made"] is not None or b["ptr"] in start_held]

    changes = sorted([(b["made"], b["nbytes"]) for b in blocks if in_step(b["made"])]
                     + [(b["freed"], -b["nbytes"]) for b in blocks if in_step(b["made"]) and in_step(b["freed"])]
                     + [(b["freed"], -b["nbytes"]) for b in from_before], key=lambda c: c[0])
    total = peak = start_bytes
    peak_t = start_ns
    for t, delta in changes:
        total += delta
        if total > peak:
            peak, peak_t = total, t

    # what was alive at the peak: the start's tensors not yet freed, and the step's own
    by_kind = {k: 0 for k in (*KINDS, "temporary", "other")}
    gone = {b["ptr"] for b in from_before if b["freed"] <= peak_t}
    for ptr, (nbytes, kind) in start_held.items():
        if ptr not in gone:
            by_kind[kind] += nbytes
    by_kind["other"] = start_bytes - sum(n for n, _ in start_held.values()) - sum(
        b["nbytes"] for b in from_before if b["freed"] <= peak_t and b["ptr"] not in start_held)
    temporary: dict[str, int] = {}
    alive = []
    by_op: dict[tuple[str, str], list[int]] = {}
    for b in blocks:
        if in_step(b["made"]) and b["made"] <= peak_t and (b["freed"] is None or b["freed"] > peak_t):
            alive.append((b["nbytes"], b["kind"] or "temporary", b["phase"]))
            tally = by_op.setdefault((b["kind"] or "temporary", b.get("op") or "(no op)"), [0, 0])
            tally[0] += b["nbytes"]
            tally[1] += 1
            if b["kind"] is not None:
                by_kind[b["kind"]] += b["nbytes"]
            else:
                by_kind["temporary"] += b["nbytes"]
                key = _phase_kind(b["phase"])
                temporary[key] = temporary.get(key, 0) + b["nbytes"]
    at = "before"
    for m in markers:
        if start_ns <= m.t_ns <= peak_t and m.phase is not None:
            at = m.phase
    return StepPeak(peak_bytes=int(peak), phase=at, by_kind={k: int(v) for k, v in by_kind.items()},
                    temporary_by_phase=temporary, start_bytes=int(start_bytes), unmatched_free_bytes=int(unmatched),
                    largest=sorted(alive, reverse=True)[:LARGEST],
                    by_op=sorted(((n, kind, op, k) for (kind, op), (n, k) in by_op.items()), reverse=True)[:LARGEST],
                    unseen_free_bytes=int(sum(b["nbytes"] for b in unseen if in_step(b["made"]))))


# -- the trace: torch.profiler's allocation events, markers and sightings on a running step ------------

_MARK = "ds_pipe_ext.mark."


def allocating_op(event) -> str:
    """The ops an allocation event was made under, outermost first, autograd's wrapper names shortened and
    this module's markers left out; at most three (the outermost, then the two innermost)."""
    names = []
    node = event.parent
    while node is not None:
        if not node.name.startswith(_MARK):
            names.append(node.name.replace("autograd::engine::evaluate_function: ", ""))
        node = node.parent
    names = names[::-1]
    return " > ".join(names if len(names) <= 3 else [names[0], "..", *names[-2:]]) or "(no op)"


def live_storages(device) -> dict[int, int]:
    """Every tensor storage alive on ``device`` that Python can reach, ``{data_ptr: nbytes}``, each once."""
    import gc

    import torch

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if issubclass(type(obj), torch.Tensor) and obj.device.type == device.type and not obj.is_meta:
                s = obj.untyped_storage()
                if s.nbytes():
                    seen[s.data_ptr()] = s.nbytes()
        except (RuntimeError, ReferenceError):  # a tensor without storage (sparse, functorch wrappers)
            continue
    return seen


def live_tensor_bytes(device) -> int:
    """Bytes of every tensor storage alive on ``device`` that Python can reach, each storage once: the
    count at a step's start, apart from any model (between steps autograd holds no graph)."""
    return sum(live_storages(device).values())


class StepTrace:
    """Allocation events of a warm-up step and the measured step after it, with markers.

    ``with trace:`` around both steps; ``trace.phase("forward 0")`` as each phase begins;
    ``trace.sight(kind, tensors)`` where tensors of a known kind are alive; ``trace.step_begins(held)``
    between the two steps (``held``: ``compat.zero.held_storages`` of the engine then).  After the
    ``with``, ``trace.peak()`` is the measured step's ``StepPeak``.
    """

    def __init__(self, device):
        self.device = device
        self._markers: list[tuple[str | None, tuple]] = []
        self._start: tuple[int, int, dict] | None = None  # (marker index, live bytes, held)
        self._prof = None

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._prof = profile(activities=activities, profile_memory=True, record_shapes=False, with_stack=False)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)

    def _mark(self, phase: str | None, sightings: tuple) -> None:
        from torch.profiler import record_function

        # in the measured step, each phase says which storages Python still reaches (for frees the trace misses)
        reach = frozenset(live_storages(self.device)) if phase is not None and self._start is not None else None
        self._markers.append((phase, sightings, reach))
        with record_function(f"{_MARK}{len(self._markers) - 1}"):
            pass

    def phase(self, name: str) -> None:
        self._mark(name, ())

    def sight(self, kind: str, tensors) -> None:
        ptrs = []
        for t in tensors:
            if t is not None and t.device.type == self.device.type:
                s = t.untyped_storage()
                if s.nbytes():
                    ptrs.append(s.data_ptr())
        self.sight_ptrs(kind, ptrs)

    def sight_ptrs(self, kind: str, ptrs) -> None:
        if ptrs:
            self._mark(None, tuple((p, kind) for p in ptrs))

    def sight_held(self, held: dict[str, dict[tuple[int, int], int]]) -> None:
        """Sight what ``compat.zero.held_storages`` found, each under its kind."""
        for kind, storages in held.items():
            self.sight_ptrs(kind, [ptr for ptr, _ in storages])

    def step_begins(self, held: dict[str, dict[tuple[int, int], int]]) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        total = live_tensor_bytes(self.device)
        start_held = {ptr: (n, kind) for kind, storages in held.items() for (ptr, n) in storages}
        self._mark("step", ())
        self._start = (len(self._markers) - 1, total, start_held)

    def peak(self) -> StepPeak:
        if self._start is None:
            raise RuntimeError("StepTrace.peak(): step_begins() was never called between the two steps")
        from torch._C._profiler import _EventType

        allocs, times = [], {}
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            tag, fields = e.typed
            if tag == _EventType.Allocation:
                if fields.device.type == self.device.type:
                    allocs.append(Alloc(e.start_time_ns, fields.ptr, fields.alloc_size,
                                        allocating_op(e) if fields.alloc_size > 0 else ""))
                continue
            if e.name.startswith(_MARK):
                times[int(e.name[len(_MARK):])] = e.start_time_ns
            stack.extend(e.children)
        markers = [Marker(times[i], phase, sightings, reach) for i, (phase, sightings, reach) in enumerate(self._markers)
                   if i in times]
        index, total, start_held = self._start
        return step_peak(allocs, markers, start_ns=times[index], start_held=start_held, start_bytes=total)


class PeakTracer:
    """Traces step ``peak_step`` of a run (the step before it warms the trace) for a rank's engine.

    The recorders call ``step_starting(n)`` before step n and ``step_ended(n)`` after it (the traced
    step's ``StepPeak`` as a dict, else None), ``enter(kind)`` as a phase begins (numbered within the
    step: "forward 0", "forward 1", ...) and ``sight_held()`` / ``sight_ptrs`` where tensors of a kind
    are alive; outside the two steps every call returns at once.
    While tracing, every parameter's gradient is sighted as it is accumulated (before ZeRO reduces and
    frees it) and, under ZeRO-3, every gathered parameter as its module runs forward."""

    def __init__(self, module, optimizer, device, peak_step: int):
        if peak_step < 2:
            raise ValueError(f"peak_step = {peak_step}: the traced step needs a step before it (use >= 2)")
        self.module, self.optimizer, self.device, self.peak_step = module, optimizer, device, peak_step
        self.trace: StepTrace | None = None
        self._handles: list = []
        self._entered: dict[str, int] = {}  # phases entered this step, by kind

    def _held(self):
        from ..compat.zero import held_storages

        return held_storages(self.module, self.optimizer)

    def step_starting(self, step: int) -> None:
        self._entered.clear()
        if step == self.peak_step - 1:
            self.trace = StepTrace(self.device).__enter__()
            self._install()
        elif step == self.peak_step and self.trace is not None:
            self.trace.step_begins(self._held())

    def step_ended(self, step: int) -> dict | None:
        if step != self.peak_step or self.trace is None:
            return None
        self.sight_held()
        trace, self.trace = self.trace, None
        trace.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return trace.peak().to_dict()

    def enter(self, kind: str) -> None:
        if self.trace is not None:
            n = self._entered.get(kind, 0)
            self._entered[kind] = n + 1
            self.trace.phase(f"{kind} {n}")
            # ZeRO-1/2 make their reduction buckets inside a phase and free them before the step ends
            self.trace.sight_held({"buffer_bytes": self._held()["buffer_bytes"]})

    def sight_held(self) -> None:
        if self.trace is not None:
            self.trace.sight_held(self._held())

    def sight_ptrs(self, kind: str, ptrs) -> None:
        if self.trace is not None:
            self.trace.sight_ptrs(kind, ptrs)

    def _install(self) -> None:
        import torch

        params = list({id(p): p for p in self.module.parameters()}.values())
        zero3 = any(hasattr(p, "ds_tensor") for p in params)

        def on_grad(p):
            if self.trace is not None:
                self.trace.sight("grad_bytes", [p.grad])
                if zero3:
                    self.trace.sight("gathered_bytes", [p.data])

        self._handles = [p.register_post_accumulate_grad_hook(on_grad) for p in params if p.requires_grad]
        # the gradients the inner optimizer steps on (a 16-bit engine's fp32 copies, made inside its step)
        from ..compat.optimizer import unwrap_optimizer

        self._handles.append(unwrap_optimizer(self.optimizer).register_step_pre_hook(lambda *_: self.sight_held()))
        if zero3:
            def on_forward(module, args, out):
                if self.trace is not None:
                    self.trace.sight("gathered_bytes", [p.data for p in module.parameters(recurse=False)])

            self._handles.append(torch.nn.modules.module.register_module_forward_hook(on_forward))
