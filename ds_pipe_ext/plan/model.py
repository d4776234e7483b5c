"""What one layout costs: its exact memory-capped partition (``plan.split``, mixed in), peak memory per rank, step time.

Per-layer costs are the analytic ones (``costs.estimate``: roofline per op, Megatron's TP and SP
collectives inside the layer), computed once per (tp, sp, micro-batch, recompute) and shared by
every layout with those four.  Everything is per TP rank.

Memory per rank: ``costs.zero.rank_memory`` (the one rule; ``estimate`` reads it from here) over the
tensors of the layers the rank holds: DeepSpeed's allocation rules, per parameter in mixed precision
(bf16 weights and gradients, fp32 master weights and Adam moments), padding aside

    ZeRO-0: 2 (weights) + 6 (bf16 gradient + fp32 copy) + 12 (master, m, v) bytes per parameter
    ZeRO-1/2: 2 + (4 + 12) / dp          ZeRO-3: (2 + 6 + 12) / dp, plus two gathered layers

plus the activations the schedule holds (``Schedule.held_peak``: per rank, from its order).  The
cap is ``USABLE_MEMORY`` of the device: CUDA context, NCCL buffers and allocator fragmentation
take the rest.

The step: ``StepModel.predict`` (the one step prediction; its engine terms zero unless fitted on
this device) runs the layout's runtime's order over the partitioned chunks (p2p on the link
between neighbouring stages); each rank's work after its last backward is ``plan.update``'s
(``RankUpdate``): its data-parallel collectives as its runtime runs them, the runtime's own passes over
the gradients, Adam over the parameters it owns.  Collectives are ring formulas over the group's link,
or, where the device has measured ones (CPU ranks over gloo, ``costs.cpu_comm``), its measured latency
and bandwidth per kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from ..arch import as_description
from ..costs.estimate import (DTYPE_BYTES, EstimateRequest, analytic_layer_costs, rank_steps, runs_efficient_sdpa,
                              shape_for)
from ..costs.layer_ops import layer_ops
from ..costs.hardware import DeviceSpec
from ..costs.stage import LayerColumns, held_activation_bytes, stage_costs, with_layer_recompute
from ..costs.peak import ZeroSettings, step_peak, walks_schedule
from ..costs.peak_rule import PipelinePeakRule
from ..costs.zero import RankMemory, rank_memory
from ..layout import Layout, zero_settings_for
from ..simulate.events import Link, Network
from ..simulate.step_model import StepModel
from .groups import placements
from .split import LayoutSplits, OutOfMemory  # noqa: F401  (OutOfMemory: the plan's error)
from .update import RankUpdate

# Adam's memory traffic per parameter: fused (apex, Megatron) reads param, grad, m, v and writes
# param, m, v and the 16-bit copy (~30 bytes); torch's single-tensor AdamW makes eight elementwise
# passes over fp32 tensors (decay, two moment updates, sqrt, two scalings, the update): ~80 bytes.
FUSED_ADAM_BYTES, UNFUSED_ADAM_BYTES = 30.0, 80.0
USABLE_MEMORY = 0.9  # of the device's memory; the rest: CUDA context, NCCL buffers, fragmentation


@dataclass
class LayoutCost:
    layout: Layout
    parts: list[int]
    step_s: float
    pipeline_s: float  # the simulated schedule, optimizer work included
    peak_memory_bytes: float  # the heaviest rank
    memory: dict  # the heaviest rank's bytes by kind
    bubble_fraction: float
    ranks: list[dict] = field(default_factory=list)  # every pipeline rank's bytes by kind (``costs.zero.rank_memory``)
    simulation: object = field(default=None, repr=False)  # the step's ``StepSimulation`` (its timeline where asked)
    samples_per_s: float = 0.0
    mfu: float = 0.0
    notes: list[str] = field(default_factory=list)
    layer_recompute: list[str] | None = None  # a recompute mode per layer, chosen with the split (plan.recompute)
    stage_recompute: "LayoutCost | None" = None  # the layout under per-stage recompute, where that is faster

    def to_dict(self) -> dict:
        extra = {"layer_recompute": self.layer_recompute} if self.layer_recompute else {}
        if self.stage_recompute is not None:
            extra["stage_recompute"] = self.stage_recompute.to_dict()
        return {**self.layout.to_dict(), **extra, "parts": self.parts, "step_s": self.step_s, "notes": self.notes,
                "samples_per_s": self.samples_per_s, "mfu": self.mfu, "peak_memory_bytes": self.peak_memory_bytes,
                "memory": self.memory, "ranks": self.ranks, "bubble_fraction": self.bubble_fraction,
                "pipeline_s": self.pipeline_s}


def boundary_split(lay: Layout) -> int:
    """How many pieces a boundary tensor crosses between stages in: each TP rank sends 1/t of it and the next
    stage all-gathers it over TP, in both engines (Megatron's scatter/gather optimisation; DeepSpeed's
    ``pipe_partitioned`` and ``grad_partitioned``, on wherever TP is).  Under SP the activation is already the
    rank's shard (``train.config`` turns DeepSpeed's off there): one piece."""
    return lay.tp if lay.tp > 1 and not lay.sp else 1


class PlanModel(LayoutSplits, RankUpdate):
    """Costs of layouts of one model on one device and cluster, with per-layer costs cached."""

    def __init__(self, cfg, device: DeviceSpec, cluster: Cluster, *, seq: int, global_batch: int,
                 dtype: str = "bf16", memory_fraction: float = USABLE_MEMORY, step_model: StepModel | None = None,
                 network: Network | None = None, expert_imbalance: float | None = None,
                 zero_settings: dict | None = None,
                 runtime_terms: bool = True, grad_accum_dtype: str | None = None, execution: str = "eager",
                 check_grad_overflow: bool = False, lp_grads_to_none: bool = False, zero3_synchronized: bool = False):
        # every collective, TP's and EP's inside the layers too, on this cluster's network
        self.cfg, self.device, self.cluster = as_description(cfg), replace(device, network=cluster), cluster
        device = self.device
        # the run's ZeRO buckets and thresholds (ours: what the emitted ds.json sets; a published run's: its own)
        self.zero_settings = {**zero_settings_for(self.cfg.hidden, device.name,
                                                  largest_module=self._largest_module(seq, dtype)),
                              **(zero_settings or {})}
        # DeepSpeed's runtime at scale as its source runs it (ZeRO-3's prefetch, BF16_Optimizer's fp32
        # reduction and partitioned step, the tied-gradient all-reduce); False: the model without these
        # terms, which bench/calibrate_at_scale.py sets beside it
        self.runtime_terms = runtime_terms
        # ds.json's data_types.grad_accum_dtype: the dtype BF16_Optimizer accumulates and reduces gradients in
        # (DeepSpeed 0.19: the training dtype unless set; the 2022 branch BLOOM ran: fp32)
        self.grad_accum_dtype = grad_accum_dtype or dtype
        # ds.json's bf16.check_grad_overflow: DeepSpeed's ZeRO-1/2 step checks every 16-bit gradient for inf/NaN
        # (its default; a host-bound loop of kernels a tensor on a GPU).  The ds.json plan emits and the GPU
        # configs here set it off, as Megatron runs bf16 (no step is skipped for a non-finite gradient)
        self.check_grad_overflow = check_grad_overflow
        # how BF16_Optimizer's pipeline clears the 16-bit gradients before each backward: DeepSpeed 0.19 zeroes
        # them (``clear_lp_grads``: a pass); the 2022 code BLOOM ran (PR #1801) set them to None (no pass)
        self.lp_grads_to_none = lp_grads_to_none
        # DeepSpeed 0.3.12-0.4.x's ZeRO-3 (2021): a NCCL call a parameter, each gather after
        # torch.cuda.synchronize(), so the reduce-scatter never hides under the backward (``plan.zero3``)
        self.zero3_synchronized = zero3_synchronized
        # dropless routing: the busiest expert's load over the mean; None: a uniformly random router's (moe_ops)
        self.expert_imbalance = expert_imbalance
        # how the layers run on a GPU: "eager" (train.py), "compiled" (train.compile) ("costs.gpu_pricing")
        self.execution = execution
        # whether ZeRO-3's own linear changes a layer's costs here (it keeps the memory-efficient attention's
        # output as handed, where torch's linear keeps a copy): else ZeRO-3 layouts share the others' layer costs
        self._zero3_linear_matters = execution == "eager" and runs_efficient_sdpa(
            self.cfg, EstimateRequest(micro_batch=1, seq=seq, dtype=dtype), device.name)
        self.network = network  # the links between pipeline ranks where given (simulate's flags), else the cluster's
        # the engine's own terms per instruction and layer (fitted on instrumented runs of this device;
        # zero until measured on it), through which every step is predicted
        self.step_model = step_model or StepModel()
        self.seq, self.global_batch, self.dtype = seq, global_batch, dtype
        self.memory_fraction = memory_fraction
        self.e = DTYPE_BYTES[dtype]
        per_node = cluster.gpus_per_node if device.name == "cpu" else 1  # a CPU's ranks share its memory
        self.memory_cap = device.memory_bytes * memory_fraction / per_node
        self.flops_per_step = global_batch * self._model_flops_per_sample()
        # Megatron's GPUs run a fused Adam (one pass); train.py on CPU runs torch's single-tensor AdamW
        self.adam_bytes_per_param = UNFUSED_ADAM_BYTES if device.name == "cpu" else FUSED_ADAM_BYTES

    @classmethod
    def on_its_cluster(cls, cfg, device: DeviceSpec, **kwargs) -> "PlanModel":
        """A model of ``device`` on its own default cluster (its GPUs a node, its link bandwidths): what
        `estimate` and `simulate` evaluate a layout on when no cluster is named."""
        return cls(cfg, device, device.cluster, **kwargs)

    def on_device(self, device: DeviceSpec) -> "PlanModel":
        """The same plan on another device (a fresh model: layer costs are cached per model), on the device's
        network where it has one (``plan.speed.at_speed`` scales it), else this plan's cluster."""
        return PlanModel(self.cfg, device, device.network or self.cluster, seq=self.seq, global_batch=self.global_batch,
                         dtype=self.dtype,
                         memory_fraction=self.memory_fraction, step_model=self.step_model, network=self.network,
                         expert_imbalance=self.expert_imbalance, zero_settings=self.zero_settings,
                         runtime_terms=self.runtime_terms, grad_accum_dtype=self.grad_accum_dtype,
                         execution=self.execution, check_grad_overflow=self.check_grad_overflow,
                         lp_grads_to_none=self.lp_grads_to_none, zero3_synchronized=self.zero3_synchronized)

    def _model_flops_per_sample(self) -> float:
        """Matrix and attention FLOPs of forward + backward of one sample (no recompute): MFU's numerator,
        the one count every throughput is printed with (``mfu``)."""
        from ..mfu import model_flops_per_sample

        return model_flops_per_sample(self.cfg, self.seq)

    @lru_cache(maxsize=None)
    def layer_costs(self, tp: int, sp: bool, micro_batch: int, recompute: str, ep: int = 1,
                    zero3: bool = False) -> tuple:
        """Per-layer ``LayerCost`` of one micro-batch on one TP (and EP) rank; alike blocks computed once.
        ``zero3``: DeepSpeed's ZeRO-3 runs the linears (``EstimateRequest.zero3_linear``)."""
        req = EstimateRequest(micro_batch=micro_batch, seq=self.seq, tp=tp, sp=sp, dtype=self.dtype,
                              selective_recompute=recompute == "selective", ep=ep,
                              expert_imbalance=self.expert_imbalance, execution=self.execution, zero3_linear=zero3)
        return tuple(analytic_layer_costs(self.cfg, req, self.device))

    def zero3_linear(self, lay: Layout) -> bool:
        """``layer_costs``' ``zero3`` for ``lay``: DeepSpeed's ZeRO-3 runs it, where that changes a cost."""
        return lay.deepspeed_zero3 and self._zero3_linear_matters

    def costs_of(self, lay: Layout) -> tuple:
        return self.layer_costs(lay.tp, lay.sp, lay.micro_batch, lay.recompute, lay.ep, self.zero3_linear(lay))

    @lru_cache(maxsize=None)
    def _columns(self, tp: int, sp: bool, micro_batch: int, recompute: str, ep: int, zero3: bool) -> LayerColumns:
        return LayerColumns(self.layer_costs(tp, sp, micro_batch, recompute, ep, zero3), recompute=recompute == "full")

    def columns_of(self, lay: Layout) -> LayerColumns:
        """``costs_of(lay)`` read into columns once (``costs.stage.LayerColumns``): the search prices many splits
        of each layout's layers."""
        return self._columns(lay.tp, lay.sp, lay.micro_batch, lay.recompute, lay.ep, self.zero3_linear(lay))

    @lru_cache(maxsize=None)
    def totals(self, tp: int, sp: bool, micro_batch: int, recompute: str,
               ep: int = 1, zero3: bool = False) -> tuple[float, float, float, float]:
        """(time of all layers for one micro-batch, parameters, largest layer's parameters, largest
        layer's static + held activation bytes at 1 byte/param) for the bounds."""
        costs = self.layer_costs(tp, sp, micro_batch, recompute, ep, zero3)
        full = recompute == "full"
        params = [c.param_bytes / self.e for c in costs]
        return (sum(c.time_s(recompute=full) for c in costs), sum(params), max(params),
                max(held_activation_bytes(costs, recompute=full)))

    @lru_cache(maxsize=None)
    def whole_model(self, tp: int, sp: bool, micro_batch: int, recompute: str, ep: int = 1):
        """Every layer as one stage (``StageCost``): the bounds' totals in the step model's terms."""
        costs = self.layer_costs(tp, sp, micro_batch, recompute, ep)
        return stage_costs(costs, [0, len(costs)], micro_batches=1, recompute=recompute == "full")[0]

    # -- collectives and the optimizer, per rank ------------------------------------------------
    def placements(self, lay: Layout) -> dict:
        """Where each of ``lay``'s groups sits on the cluster (``costs.network.Placement``), the slowest-placed
        group of each kind: "tp", "dp", "ep" and "expert_dp" (DeepSpeed's expert groups), "tied" (first and last
        stage), "pp_pair" (neighbouring stages), from the ranks as DeepSpeed orders them
        (``parallel.topology.rank_groups``; Megatron's default order gives the same groups)."""
        return placements(self.cluster, lay.pp, lay.tp, lay.dp, lay.ep)

    def _stage_network(self, lay: Layout) -> Network:
        return self.network or Network(self._p2p_link(lay))

    def split_link(self, lay: Layout) -> Link:
        """The link a split's boundary transfers are costed on: between nodes where the given network has
        them (inside a node, transfers are free), else the one link between neighbouring stages."""
        if self.network is None:
            return self._p2p_link(lay)
        return self.network.inter or self.network.intra

    def _p2p_link(self, lay: Layout) -> Link:
        measured = (self.device.collectives or {}).get("p2p")
        if measured:  # CPU ranks: gloo's measured send, not the memory copy
            return Link(measured[0], measured[1])
        # neighbouring stages are tp x dp ranks apart: NVLink inside a node, a rail's NIC between nodes
        send = self.device.group_collective("p2p", 1.0, self.placements(lay)["pp_pair"])
        return Link(0.0, send.bus_bandwidth if send.time_s else None)

    def _largest_module(self, seq: int, dtype: str) -> int:
        """Elements of the model's largest module (one op's weights, what ZeRO-3 gathers at once), unsharded."""
        shp = shape_for(self.cfg, EstimateRequest(micro_batch=1, seq=seq, tp=1, dtype=dtype), self.device)
        return max((sum(op.weights) for _, _, ops in layer_ops(self.cfg, shp) for op in ops), default=0)

    # -- one layout ----------------------------------------------------------------------------
    def zero_of(self, lay: Layout) -> ZeroSettings:
        """The ZeRO settings ``lay`` runs with: its stage, this plan's buckets and thresholds, and whether
        DeepSpeed runs it with its BF16_Optimizer."""
        accum = DTYPE_BYTES[self.grad_accum_dtype] if self.bf16_optimizer(lay) else 0
        return ZeroSettings.of_layout(lay, self.zero_settings, bf16_accum_bytes=accum)

    def peak_rule(self, lay: Layout) -> PipelinePeakRule | None:
        """The partitioner's form of the peak rule for this layout (``costs.peak_rule.PipelinePeakRule``), where
        it applies: one model chunk a rank; None elsewhere (the additive form at the step)."""
        if not walks_schedule(lay.schedule_spec):
            return None
        return PipelinePeakRule(self.zero_of(lay), lay.dp, self.e,
                                fused_adam=self.adam_bytes_per_param == FUSED_ADAM_BYTES, ep=lay.ep, tp=lay.tp)

    def rank_peaks(self, lay: Layout, parts: list[int], rank_layers: list[list], held: list[float], *,
                   modes: list[str] | None = None) -> list[dict]:
        """Every pipeline rank's memory at its peak (``costs.peak``: its step walked op by op in the
        schedule's order), the model states at the step beside; where the rule does not walk the schedule
        (several chunks a rank, a split backward), the additive form (``costs.zero.rank_memory``) over the
        schedule's held activations."""
        # beside each: the activations its schedule holds at most (the simulator's ``held_peak_bytes``)
        if not walks_schedule(lay.schedule_spec):
            threshold = int(self.zero_settings["stage3_param_persistence_threshold"])
            return [{**rank_memory(layers, activation_bytes=held[r], zero=lay.zero, dp=lay.dp, element_bytes=self.e,
                                   persistence_threshold=threshold, offload=lay.offload).to_dict(),
                     "held_activation_bytes": held[r]}
                    for r, layers in enumerate(rank_layers)]
        steps = rank_steps(self.cfg, lay, parts=parts, seq=self.seq, dtype=self.dtype, device=self.device.name,
                           fused_adam=self.adam_bytes_per_param == FUSED_ADAM_BYTES, modes=modes,
                           zero=self.zero_of(lay), expert_imbalance=self.expert_imbalance)
        return [{**RankMemory.from_peak(step_peak(step)).to_dict(), "held_activation_bytes": held[r]}
                for r, step in enumerate(steps)]

    def evaluate_named(self, lay: Layout, *, split: str = "analytic") -> LayoutCost:
        """A layout the user named, evaluated whatever its memory, on the split an ``analytic`` run chooses
        (``split`` "even": Megatron's, the blocks evenly, ``partition.hand_rules.even_blocks``; "uniform":
        DeepSpeed's, the layers evenly by count); a peak over the cap is noted ("over the cap by X GiB"), not
        refused."""
        from ..partition.hand_rules import even_blocks, uniform_layers

        chunks = lay.num_chunks
        if chunks > 1 and split == "even":
            parts = even_blocks(self.cfg.layers, chunks)
        elif chunks > 1 and split == "uniform":
            parts = uniform_layers(self.cfg.layers + 2, chunks)
        else:
            parts = self.run_split(lay)
        cost = self.evaluate(lay, parts, check_memory=False)
        over = cost.peak_memory_bytes - self.memory_cap
        if over > 0:
            cost.notes.append(f"over the cap by {over / 2**30:.2f} GiB")
        return cost

    def evaluate(self, lay: Layout, parts: list[int] | None = None, *, check_memory: bool = True,
                 update: bool = True, timeline: bool = False, modes: list[str] | None = None) -> LayoutCost:
        """The layout's partition (the exact memory-capped min-max one unless given), memory and step
        (``update=False``: without the work after each rank's last backward; ``timeline``: keep the
        simulation's timeline, for a chart; ``modes``: a recompute mode per layer, on the layout's costs
        without recompute)."""
        costs, columns = self.costs_of(lay), self.columns_of(lay)
        if modes is not None:
            costs = with_layer_recompute(costs, modes, selective_built=False)
            columns = LayerColumns(costs, recompute=False)
        parts = parts or self.partition(lay)
        stages = columns.stages(parts, micro_batches=lay.micro_batches, schedule=lay.schedule_spec.name)
        m = lay.micro_batches
        spec = lay.schedule_spec
        chunk_rank = spec.chunk_rank(lay.pp)
        rank_params, rank_experts = [0.0] * lay.pp, [0.0] * lay.pp
        rank_layers: list[list] = [[] for _ in range(lay.pp)]
        rank_time = [[0.0, 0.0] for _ in range(lay.pp)]  # a micro-batch's forward and backward on the rank
        for st in stages:
            r = chunk_rank[st.stage]
            rank_params[r] += st.param_bytes / self.e
            rank_experts[r] += sum(c.expert_param_bytes for c in costs[parts[st.stage]:parts[st.stage + 1]]) / self.e
            rank_layers[r] += costs[parts[st.stage]:parts[st.stage + 1]]
            rank_time[r][0] += st.forward_s
            rank_time[r][1] += st.backward_s
        rank_layer_params = [[c.param_bytes / self.e for c in layers] for layers in rank_layers]
        rank_tensors = [[n for c in layers for n in c.param_numels] for layers in rank_layers]
        split = boundary_split(lay)
        if split > 1:
            stages = [replace(st, boundary_out_bytes=st.boundary_out_bytes / split) for st in stages]
        exposed = self.zero3_exposed_s(lay) if self.zero3_prefetched(lay) and update else None
        tied = [0.0] * lay.pp  # DeepSpeed's tied embedding: its gradient all-reduced between first and last rank
        first, last = chunk_rank[0], chunk_rank[len(parts) - 2]
        if self.runtime_terms and lay.runtime == "deepspeed" and self.cfg.tied_head and first != last:
            tied[first] = tied[last] = costs[0].param_bytes / self.e
        pred = self.step_model.predict(
            stages, m, schedule=spec.name if lay.pipelined else "none", runtime=lay.runtime,
            network=self._stage_network(lay), timeline=timeline, peers=lay.tp * lay.dp,
            update_s=[self.update_s(lay, p, lp, hide_under=tuple(t), expert_params=x, zero3_exposed_s=exposed,
                                    tied_params=tp_, tensors=ts) if update else 0.0
                      for p, lp, t, x, tp_, ts in zip(rank_params, rank_layer_params, rank_time, rank_experts, tied,
                                                      rank_tensors)])
        pipeline_s, bubble = pred.step_s, pred.simulation.bubble_fraction
        held = pred.simulation.held_peak_bytes  # per rank: what its schedule holds at its peak
        memory = self.rank_peaks(lay, list(parts), rank_layers, held, modes=modes)
        heaviest = max(memory, key=lambda mem: mem["total_bytes"])
        if check_memory and heaviest["total_bytes"] > self.memory_cap:
            raise OutOfMemory(heaviest["total_bytes"])
        out = LayoutCost(lay, list(parts), pipeline_s, pipeline_s, heaviest["total_bytes"], heaviest, bubble,
                         ranks=memory, simulation=pred.simulation)
        out.samples_per_s = lay.global_batch / out.step_s
        peak = self.device.matrix_flops[self.dtype] if self.dtype in self.device.matrix_flops else math.nan
        out.mfu = self.flops_per_step / (out.step_s * lay.world_size * peak)
        return out


__all__ = ["LayoutCost", "OutOfMemory", "PlanModel", "USABLE_MEMORY"]
