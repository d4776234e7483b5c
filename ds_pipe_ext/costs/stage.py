"""The stage model: what a contiguous slice of layers costs as one pipeline stage.

This module is the one owner of three rules that everything else asks:

* ``in_flight(stage, num_stages, micro_batches, schedule)``: how many micro-batches of
  activations a stage holds at its peak, read off the schedule's order.  Under 1F1B
  (DeepSpeed's ``TrainSchedule``, PipeDream-flush) stage s runs min(p - s - 1, m) warm-up
  forwards before its first backward, so it holds min(p - s, m); under GPipe every stage
  holds all m; ZB-H1 holds a micro-batch until its deferred weight gradient.  This is
  *activations held*, not DeepSpeed's ``TrainSchedule.num_pipe_buffers()``, which
  allocates max(2, ...) buffers for the tensors in transit.
* ``held_activation_bytes(costs, recompute)``: bytes a layer keeps per in-flight
  micro-batch (everything autograd saves; with full activation checkpointing only
  the layer's input, which is the previous layer's output).
* ``stage_costs(...)``: per-stage sums (``StageCost``) of time, memory by kind and
  boundary p2p.  The partitioner's objective, the partition plan, ``estimate``'s
  memory table and the run report all read them.

And one definition of imbalance: fastest / slowest stage time (the seed report's;
1.0 is perfect, higher is better).

Pure Python, no torch: costs are any objects with ``LayerCost``'s fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..simulate.schedules import parse_schedule


def in_flight(stage: int, num_stages: int, micro_batches: int, schedule: str = "1f1b") -> int:
    """Micro-batches whose activations stage ``stage`` of ``num_stages`` holds at its peak.

    A micro-batch is held from its forward until its last backward part (the weight gradient
    where the schedule splits it off), and the count follows from the schedule's order
    (``simulate.schedules``).  For schedules with several chunks per rank (interleaved with
    v = 2, DualPipeV) the stages are the chunks: ``num_stages`` = v x ranks, and the count is
    per chunk; the rank holds its chunks' together.
    """
    return parse_schedule(schedule).in_flight(num_stages, micro_batches)[stage]


def held_activation_bytes(costs: Sequence, *, recompute: bool = False) -> list[float]:
    """Bytes each layer keeps per in-flight micro-batch.

    Under full activation checkpointing a layer keeps only its input (the previous
    layer's output) and recomputes the rest in backward.
    """
    if not recompute:
        return [float(c.activation_bytes) for c in costs]
    return [0.0] + [float(c.output_bytes) for c in costs[:-1]]


@dataclass(frozen=True)
class RecomputeMode:
    """One way a layer can run: the bytes it keeps per in-flight micro-batch, what its backward
    re-materialises beside them, and the forward time it replays (``partition.recompute``)."""

    name: str  # "none", "selective", "full"
    kept_bytes: float
    replay_bytes: float = 0.0
    replay_time: float = 0.0


def recompute_modes(costs: Sequence) -> list[list[RecomputeMode]]:
    """Per layer, the recompute modes it offers: none; selective
    where it has an attention core to replay (``LayerCost.selective_kept_bytes``); full, keeping only its
    input (the previous layer's output; the first layer's token ids: nothing) and re-saving the rest in its
    backward."""
    inputs = held_activation_bytes(costs, recompute=True)  # what full recompute keeps: each layer's input
    out = []
    for c, kept in zip(costs, inputs):
        act = float(c.activation_bytes)
        modes = [RecomputeMode("none", act)]
        if c.selective_kept_bytes is not None and c.selective_kept_bytes < act:
            modes.append(RecomputeMode("selective", float(c.selective_kept_bytes), act - c.selective_kept_bytes,
                                       float(c.selective_replay_s)))
        if kept < act:
            modes.append(RecomputeMode("full", kept, act - kept, float(c.recompute_s)))
        out.append(modes)
    return out


def with_layer_recompute(costs: Sequence, modes: Sequence[str], *, selective_built: bool) -> list:
    """``costs`` as each layer runs under its recompute mode: "full" keeps the layer's input (the previous
    layer's output) and replays its forward in the backward; "selective" keeps what its attention core does
    not and replays that core, unless the costs were measured on layers built that way
    (``selective_built``: a profile of the layers as they run)."""
    from dataclasses import replace

    inputs = held_activation_bytes(costs, recompute=True)
    out = []
    for c, mode, kept in zip(costs, modes, inputs):
        if mode == "full":
            c = replace(c, activation_bytes=int(kept), backward_s=c.backward_s + c.recompute_s, recompute_s=0.0)
        elif mode == "selective" and not selective_built and c.selective_kept_bytes is not None:
            c = replace(c, activation_bytes=c.selective_kept_bytes, backward_s=c.backward_s + c.selective_replay_s)
        out.append(c)
    return out


def replayed(cost, *, recompute: bool) -> bool:
    """Whether backward replays this layer's forward: under activation checkpointing, a layer that
    has a replay cost (``StageCost.recomputed_layers``, the step model's cost per replayed layer)."""
    return recompute and cost.recompute_s > 0


def imbalance(times: Sequence[float]) -> float:
    """Fastest / slowest stage time: 1.0 is a perfect balance, higher is better."""
    if len(times) < 2 or max(times) <= 0:
        return 1.0
    return min(times) / max(times)


@dataclass(frozen=True)
class StageCost:
    """One pipeline stage: layers [start, stop) on one rank, per micro-batch unless said otherwise."""

    stage: int
    start: int
    stop: int
    layer_names: tuple[str, ...]
    forward_s: float
    backward_s: float  # including the replayed forward under activation checkpointing
    weight_grad_s: float  # the W part of backward_s (half of a layer's backward where not known)
    p2p_s: float  # boundary transfers per micro-batch: activation in/out and their gradients
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: float  # held per in-flight micro-batch
    inflight: int
    boundary_in_bytes: int  # the activation received from the previous stage (0 for the first)
    boundary_out_bytes: int  # the activation sent to the next stage (0 for the last)
    recomputed_layers: int = 0  # layers whose forward backward_s replays (activation checkpointing)
    optimizer_s: float = 0.0  # the optimizer's step over the stage's parameters, once a step (0 where unmeasured)

    @property
    def time_s(self) -> float:
        """Forward + backward + p2p of one micro-batch: the partitioner's objective."""
        return self.forward_s + self.backward_s + self.p2p_s

    @property
    def static_bytes(self) -> int:
        """Held for the whole step: parameters, gradients, optimizer states."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def activation_peak_bytes(self) -> float:
        return self.inflight * self.activation_bytes

    @property
    def memory_bytes(self) -> float:
        return self.static_bytes + self.activation_peak_bytes


def tied_duplicates(layers: Sequence) -> list[tuple]:
    """(layer, the share of its states to leave out) for each layer whose tied weight an earlier layer of the
    same stage already holds: one process holds a tied weight once (DeepSpeed's ``TiedLayerSpec``)."""
    seen, dup = set(), []
    for c in layers:
        key = getattr(c, "tied_key", "")
        if key and key in seen:
            dup.append((c, c.tied_share()))
        seen.add(key)
    return dup


def stage_costs(
    costs: Sequence,
    parts: Sequence[int],
    *,
    micro_batches: int,
    recompute: bool = False,
    schedule: str = "1f1b",
    link_bandwidth: float | None = None,
) -> list[StageCost]:
    """Per-stage sums of ``costs`` (one ``LayerCost`` per layer) split at ``parts``.

    ``link_bandwidth`` (bytes/s): each boundary a stage has costs it 2 x bytes / bandwidth
    per micro-batch (the activation one way, its gradient back).
    """
    return LayerColumns(costs, recompute=recompute).stages(parts, micro_batches=micro_batches, schedule=schedule,
                                                           link_bandwidth=link_bandwidth)


class LayerColumns:
    """The per-layer figures ``stage_costs`` sums, read off ``costs`` once.  A search that prices thousands of
    splits of one list (``partition.step_search``) then sums slices of plain lists: the same terms in the same
    order as a sum over the layers, so the same bits, without reading every layer's fields for every split."""

    def __init__(self, costs: Sequence, *, recompute: bool = False):
        self.costs, self.recompute = costs, recompute
        self.names = [c.name for c in costs]
        self.forward = [c.forward_s for c in costs]
        self.backward = [c.backward_s + (c.recompute_s if recompute else 0.0) for c in costs]
        self.weight_grad = [c.backward_s / 2 if getattr(c, "weight_grad_s", None) is None else c.weight_grad_s
                            for c in costs]
        self.state_bytes = {kind: [int(getattr(c, kind)) for c in costs]
                            for kind in ("param_bytes", "grad_bytes", "optimizer_bytes")}
        self.held = held_activation_bytes(costs, recompute=recompute)
        self.replayed = [replayed(c, recompute=recompute) for c in costs]
        self.optimizer = [float(getattr(c, "optimizer_step_s", 0.0)) for c in costs]
        self.tied = [i for i, c in enumerate(costs) if getattr(c, "tied_key", "")]  # the only layers a stage dedups

    def stages(self, parts: Sequence[int], *, micro_batches: int, schedule: str = "1f1b",
               link_bandwidth: float | None = None) -> list[StageCost]:
        costs, p = self.costs, len(parts) - 1
        inflight = parse_schedule(schedule).in_flight(p, micro_batches)
        out = []
        for s in range(p):
            i, j = parts[s], parts[s + 1]
            b_in = int(costs[i - 1].output_bytes) if i > 0 else 0
            b_out = int(costs[j - 1].output_bytes) if j < len(costs) else 0
            p2p = 2.0 * (b_in + b_out) / link_bandwidth if link_bandwidth else 0.0
            dup = tied_duplicates([costs[k] for k in self.tied if i <= k < j])

            def held_once(kind: str) -> int:  # the stage's bytes of ``kind``, a tied module counted once
                return sum(self.state_bytes[kind][i:j]) - round(sum(getattr(c, kind) * w for c, w in dup))

            out.append(StageCost(
                stage=s, start=i, stop=j, layer_names=tuple(self.names[i:j]),
                forward_s=sum(self.forward[i:j]), backward_s=sum(self.backward[i:j]),
                weight_grad_s=sum(self.weight_grad[i:j]), p2p_s=p2p,
                param_bytes=held_once("param_bytes"), grad_bytes=held_once("grad_bytes"),
                optimizer_bytes=held_once("optimizer_bytes"),
                activation_bytes=sum(self.held[i:j]),
                inflight=inflight[s],
                boundary_in_bytes=b_in, boundary_out_bytes=b_out,
                recomputed_layers=sum(self.replayed[i:j]),
                optimizer_s=sum(self.optimizer[i:j]),
            ))
        return out


def measured_stages(parts: Sequence[int], forward_s: Sequence[float], backward_s: Sequence[float],
                    output_bytes: Sequence[float]) -> list[StageCost]:
    """Stages whose per-micro-batch forward and backward were measured (an instrumented run's), as the
    step model reads them: no layer costs behind them, the backward's W part taken as half."""
    p = len(parts) - 1
    return [StageCost(stage=s, start=parts[s], stop=parts[s + 1], layer_names=(), forward_s=forward_s[s],
                      backward_s=backward_s[s], weight_grad_s=backward_s[s] / 2, p2p_s=0.0, param_bytes=0,
                      grad_bytes=0, optimizer_bytes=0, activation_bytes=0.0, inflight=0,
                      boundary_in_bytes=int(output_bytes[s - 1]) if s else 0,
                      boundary_out_bytes=int(output_bytes[s]) if s < p - 1 else 0)
            for s in range(p)]
