"""What one layout costs: its exact memory-capped partition, peak memory per rank, step time.

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
between neighbouring stages); each rank's optimizer work after its last backward is its
data-parallel collective plus Adam over the parameters it owns.  Collectives are ring formulas
over the group's link, or, where the device has measured ones (CPU ranks over gloo,
``costs.cpu_comm``), its measured latency and bandwidth per kind.  As DeepSpeed runs them: ZeRO-1
all-reduces the gradient buckets at the boundary and all-gathers the updated weights, ZeRO-2 does
the all-reduce every micro-batch (``use_multi_rank_bucket_allreduce``), ZeRO-3 gathers the weights
forward and backward and reduce-scatters every micro-batch.  On CPU ranks none of it is hidden under
compute (gloo runs on the cores that compute).  On a GPU, ZeRO-3 without a pipeline is priced by
DeepSpeed's own prefetch (``plan.zero3``: the next module's all-gather under the current module's
compute, with NCCL's latency per collective, ``costs.nccl``, and the run's buckets, ``zero_settings``);
ZeRO-1/2's reductions stay serial after the last backward, as DeepSpeed's pipeline engine runs them.
Adam is memory-bound: one fused pass on GPUs (~30 bytes a parameter), torch's unfused AdamW on CPU
(~80), plus the page faults of its temporaries on a CPU (``adam_fresh_bytes``).  DeepSpeed's own
passes over the gradients (flattening for the reduction, ZeRO's float64 norm, the flat partition)
are counted as memory traffic too (``engine_passes_s``): on CPU ranks they are a tenth of a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from ..arch import as_description
from ..costs import analytic as A
from ..costs.estimate import DTYPE_BYTES, EstimateRequest, analytic_layer_costs, layer_ops, rank_steps, shape_for
from ..costs.hardware import DEVICES, DeviceSpec, adam_step_s, get_device
from ..costs.nccl import ring_latency_s
from ..costs.stage import held_activation_bytes, stage_costs, with_layer_recompute
from ..costs.peak import PipelinePeakRule, ZeroSettings, step_peak, walks_schedule
from ..costs.zero import RankMemory, layer_states_by_rule, rank_memory, state_bytes_per_param
from ..layout import ZERO_SETTINGS, Layout
from ..partition.algorithms import InfeasibleMemoryCap, partition_min_max_lists, smallest_feasible_cap_lists
from ..partition.methods import decide_offline
from ..simulate.events import Link, Network
from ..simulate.step_model import StepModel
from .space import PlanError
from .zero3 import ModuleTraffic, microbatch_s

# Adam's memory traffic per parameter: fused (apex, Megatron) reads param, grad, m, v and writes
# param, m, v and the 16-bit copy (~30 bytes); torch's single-tensor AdamW makes eight elementwise
# passes over fp32 tensors (decay, two moment updates, sqrt, two scalings, the update): ~80 bytes.
FUSED_ADAM_BYTES, UNFUSED_ADAM_BYTES = 30.0, 80.0
USABLE_MEMORY = 0.9  # of the device's memory; the rest: CUDA context, NCCL buffers, fragmentation

def plan_device(name: str) -> DeviceSpec:
    """A named device (``get_device``: with its calibrated efficiencies), "cpu" (measured here), or a
    SPEC.toml whose keys are ``DeviceSpec``'s fields (a ``base`` key starts from a named device)."""
    if name.endswith(".toml"):
        import tomllib
        from pathlib import Path

        try:
            data = tomllib.loads(Path(name).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise PlanError(f"--device {name}: cannot read the device spec ({e})") from None
        base = data.pop("base", None)
        try:
            return replace(plan_device(base), **data) if base else DeviceSpec(**data)
        except TypeError as e:
            raise PlanError(f"--device {name}: {e}; the keys are DeviceSpec's fields "
                            f"({', '.join(DeviceSpec.__dataclass_fields__)}) or base = \"a100\"") from None
    try:
        device = get_device(name)
    except A.AnalyticError as e:
        raise PlanError(f"--device: {e}, or a SPEC.toml") from None
    return device


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int
    intra_node_bandwidth: float  # bytes/s per GPU, one direction
    inter_node_bandwidth: float

    def bandwidth(self, span: int) -> float:
        """A group whose ranks span ``span`` consecutive GPUs stays inside a node only if they fit."""
        return self.intra_node_bandwidth if span <= self.gpus_per_node else self.inter_node_bandwidth


@lru_cache(maxsize=256)
def _analytic_split(states: tuple, chunks: int, micro_batches: int, recompute: bool, schedule: str,
                    step_model: StepModel, link_bandwidth: float | None, memory_cap_gib: float | None,
                    peak_rule: PipelinePeakRule | None = None) -> list[int]:
    """``decide_offline("analytic", ...)`` under the cap where a split fits it, else with none.  Cached: the
    step search takes seconds on a large model, and `plan` and `estimate` ask it of the same layout."""
    kw = dict(micro_batches=micro_batches, recompute=recompute, schedule=schedule, step_model=step_model,
              link_bandwidth=link_bandwidth, peak_rule=peak_rule)
    if memory_cap_gib is not None:
        try:
            return decide_offline("analytic", list(states), chunks, memory_cap_gib=memory_cap_gib, **kw)
        except InfeasibleMemoryCap:
            pass
    return decide_offline("analytic", list(states), chunks, **kw)


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


class OutOfMemory(Exception):
    def __init__(self, needed_bytes: float | None):
        self.needed_bytes = needed_bytes  # what the heaviest rank needs (None: not computed; least_memory)


class PlanModel:
    """Costs of layouts of one model on one device and cluster, with per-layer costs cached."""

    def __init__(self, cfg, device: DeviceSpec, cluster: Cluster, *, seq: int, global_batch: int,
                 dtype: str = "bf16", memory_fraction: float = USABLE_MEMORY, step_model: StepModel | None = None,
                 network: Network | None = None, expert_imbalance: float = 1.0, zero_settings: dict | None = None,
                 runtime_terms: bool = True, grad_accum_dtype: str | None = None):
        self.cfg, self.device, self.cluster = as_description(cfg), device, cluster  # what the model computes
        # the run's ZeRO buckets and thresholds (ours: what the emitted ds.json sets; a published run's: its own)
        self.zero_settings = {**ZERO_SETTINGS, **(zero_settings or {})}
        # DeepSpeed's runtime at scale as its source runs it (ZeRO-3's prefetch, BF16_Optimizer's fp32
        # reduction and partitioned step, the tied-gradient all-reduce); False: the model without these
        # terms, which bench/calibrate_at_scale.py sets beside it
        self.runtime_terms = runtime_terms
        # ds.json's data_types.grad_accum_dtype: the dtype BF16_Optimizer accumulates and reduces gradients in
        # (DeepSpeed 0.19: the training dtype unless set; the 2022 branch BLOOM ran: fp32)
        self.grad_accum_dtype = grad_accum_dtype or dtype
        self.expert_imbalance = expert_imbalance  # dropless routing: the busiest expert's load over the mean
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
        cluster = Cluster(device.gpus_per_node, device.intra_node_bandwidth, device.inter_node_bandwidth)
        return cls(cfg, device, cluster, **kwargs)

    def on_device(self, device: DeviceSpec) -> "PlanModel":
        """The same plan on another device (a fresh model: layer costs are cached per model)."""
        return PlanModel(self.cfg, device, self.cluster, seq=self.seq, global_batch=self.global_batch, dtype=self.dtype,
                         memory_fraction=self.memory_fraction, step_model=self.step_model, network=self.network,
                         expert_imbalance=self.expert_imbalance, zero_settings=self.zero_settings,
                         runtime_terms=self.runtime_terms, grad_accum_dtype=self.grad_accum_dtype)

    def _model_flops_per_sample(self) -> float:
        """Matrix and attention FLOPs of forward + backward of one sample (no recompute): MFU's numerator."""
        shp = shape_for(self.cfg, EstimateRequest(micro_batch=1, seq=self.seq, dtype=self.dtype), self.device)
        return sum(op.fwd_flops + op.bwd_flops for _, _, ops in layer_ops(self.cfg, shp) for op in ops
                   if op.kind != "vector")

    @lru_cache(maxsize=None)
    def layer_costs(self, tp: int, sp: bool, micro_batch: int, recompute: str, ep: int = 1) -> tuple:
        """Per-layer ``LayerCost`` of one micro-batch on one TP (and EP) rank; alike blocks computed once."""
        req = EstimateRequest(micro_batch=micro_batch, seq=self.seq, tp=tp, sp=sp, dtype=self.dtype,
                              selective_recompute=recompute == "selective", ep=ep,
                              expert_imbalance=self.expert_imbalance)
        return tuple(analytic_layer_costs(self.cfg, req, self.device))

    def costs_of(self, lay: Layout) -> tuple:
        return self.layer_costs(lay.tp, lay.sp, lay.micro_batch, lay.recompute, lay.ep)

    @lru_cache(maxsize=None)
    def totals(self, tp: int, sp: bool, micro_batch: int, recompute: str,
               ep: int = 1) -> tuple[float, float, float, float]:
        """(time of all layers for one micro-batch, parameters, largest layer's parameters, largest
        layer's static + held activation bytes at 1 byte/param) for the bounds."""
        costs = self.layer_costs(tp, sp, micro_batch, recompute, ep)
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
    def _dp_bandwidth(self, lay: Layout) -> float:
        # Megatron's rank order (tp innermost, then dp): a DP group spans tp x dp consecutive GPUs
        return self.cluster.bandwidth(lay.tp * lay.dp) * self.device.comm_efficiency

    def _p2p_bandwidth(self, lay: Layout) -> float:
        # neighbouring stages are tp x dp ranks apart: the same node only if both fit in it
        return self.cluster.bandwidth(2 * lay.tp * lay.dp) * self.device.comm_efficiency

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
        return Link(0.0, self._p2p_bandwidth(lay))

    def update_s(self, lay: Layout, params: float, layer_params: list[float] | tuple = (),
                 hide_under: tuple[float, float] | None = None, expert_params: float = 0.0,
                 zero3_exposed_s: float | None = None, tied_params: float = 0.0) -> float:
        """A rank's work after its last backward for ``params`` parameters: its DP collectives, DeepSpeed's
        own passes over the gradients (``engine_passes_s``) and Adam over the parameters it owns
        (ZeRO-2/3's per-micro-batch collectives too: with no overlap, where they sit does not change
        the step of one rank's serial work).  ``layer_params``: the rank's layers' parameter counts,
        for the page faults of the large tensors a CPU maps afresh every step (none on GPUs).

        Under the ``megatron`` runtime: the gradients' all-reduce (reduce-scatter, then the parameters'
        all-gather, with its distributed optimizer, ZeRO-1), and no DeepSpeed passes; with
        ``overlap_comm`` half of it hides under the rank's last backward and half under its first
        forward, ``hide_under`` = (forward s, backward s) of a micro-batch on the rank (None: all of it
        hides, the least it can cost: the bounds' case).  ``expert_params``: of ``params``, a rank's experts,
        whose gradients reduce over their expert-data-parallel group (dp / ep ranks) and whose optimizer
        states partition over it.  ``zero3_exposed_s``: ZeRO-3's traffic a micro-batch leaves exposed
        (``zero3_exposed_s``), where the prefetch chain prices it, in place of the serial formula.
        ``tied_params``: a tied embedding's parameters on this rank, whose gradients DeepSpeed's pipeline
        engine all-reduces between the first and last stage (``ReduceTiedGrads``) before the DP reduction."""
        if lay.runtime == "megatron":
            return self._megatron_update_s(lay, params, hide_under)
        experts = expert_params if lay.ep > 1 else 0.0  # at ep 1 the experts reduce with the rest
        dense = params - experts
        sharded = lay.zero >= 1 or self.bf16_optimizer(lay)  # BF16_Optimizer partitions its fp32 states like ZeRO-1
        owned = dense / (lay.dp if sharded else 1) + experts / (lay.dp // lay.ep if sharded else 1)
        if zero3_exposed_s is not None:
            comm = lay.micro_batches * zero3_exposed_s
        else:
            comm = self._dp_comm_s(lay, dense, lay.dp) + self._dp_comm_s(lay, experts, lay.dp // lay.ep)
        if tied_params:
            comm += self.device.collective_time(tied_params * self.grad_reduce_bytes(lay), "all-reduce", 2,
                                                self._tied_bandwidth(lay))
        return comm + self.engine_passes_s(lay, params, layer_params) + adam_step_s(
            owned, self.device, bytes_per_param=self.adam_bytes_per_param,
            fresh_sizes=self.adam_fresh_bytes(lay, layer_params))

    def _dp_comm_s(self, lay: Layout, params: float, n: int) -> float:
        """DeepSpeed's data-parallel collectives of ``params`` parameters' gradients over ``n`` ranks (the
        dp group; a rank's experts: their expert-data-parallel group of dp / ep)."""
        m, grads, bw = lay.micro_batches, params * self.e, self._dp_bandwidth(lay)

        def coll(kind: str) -> float:
            return self.device.collective_time(grads, kind, n, bw)

        # DeepSpeed's ZeRO-1/2 reduce gradients by all-reducing buckets that span every rank's
        # slice (``use_multi_rank_bucket_allreduce``, on by default), then each keeps its slice
        if self.bf16_optimizer(lay):  # its gradient buffers all-reduced, then the updated bf16 partitions gathered
            return (self.device.collective_time(params * self.grad_reduce_bytes(lay), "all-reduce", n, bw)
                    + self.device.collective_time(grads, "all-gather", n, bw))
        if lay.zero == 0:
            return coll("all-reduce")
        if lay.zero == 1:  # at the boundary: all-reduce, then all-gather the updated weights
            return coll("all-reduce") + coll("all-gather")
        if lay.zero == 2:  # all-reduce every micro-batch's gradients, all-gather once
            return m * coll("all-reduce") + coll("all-gather")
        return m * (2 * coll("all-gather") + coll("reduce-scatter"))  # ZeRO-3: every micro-batch

    def bf16_optimizer(self, lay: Layout) -> bool:
        """Whether DeepSpeed runs this layout with its ``BF16_Optimizer`` (a bf16 pipeline without ZeRO:
        ``_do_optimizer_sanity_check``): it accumulates gradients in flat buffers of ``grad_accum_dtype``,
        all-reduces those (``_bf16_reduce_grads`` -> ``get_grads_for_reduction``) and partitions the fp32
        master weights and moments over DP like ZeRO-1, all-gathering the updated bf16 partitions."""
        return (self.runtime_terms and lay.runtime == "deepspeed" and self.dtype == "bf16" and lay.zero == 0
                and lay.pipelined)

    def grad_reduce_bytes(self, lay: Layout) -> float:
        """Bytes of a gradient element as DeepSpeed reduces it: ``grad_accum_dtype`` under ``BF16_Optimizer``
        (the tied weights' ``_hp_grad`` too), else the training dtype."""
        return DTYPE_BYTES[self.grad_accum_dtype] if self.bf16_optimizer(lay) else self.e

    def _tied_bandwidth(self, lay: Layout) -> float:
        # the first and last stage are (pp - 1) tp x dp ranks apart: the same node only if they fit in it
        return self.cluster.bandwidth((lay.pp - 1) * lay.tp * lay.dp + 1) * self.device.comm_efficiency

    def zero3_prefetched(self, lay: Layout) -> bool:
        """Whether ZeRO-3's traffic is priced by the prefetch chain (``plan.zero3``): DeepSpeed without a
        pipeline on a GPU, whose NCCL kernels run beside the compute.  A CPU's gloo collectives run on the
        cores that compute (ranks share two of them here, and were measured so): the serial formula.
        ``runtime_terms=False``: the serial formula everywhere."""
        return (self.runtime_terms and lay.zero == 3 and lay.runtime == "deepspeed" and not lay.pipelined
                and lay.ep == 1 and self.device.name != "cpu")

    def zero3_exposed_s(self, lay: Layout) -> float:
        """ZeRO-3's traffic one micro-batch leaves exposed beside its compute (``plan.zero3.microbatch_s``
        minus the compute alone): per module, the all-gather of its parameters and the reduce-scatter of
        its gradients over the DP group, ring bandwidth plus NCCL's latency (``costs.nccl``)."""
        costs = self.costs_of(lay)
        full = lay.recompute == "full"
        shp = shape_for(self.cfg, EstimateRequest(micro_batch=lay.micro_batch, seq=self.seq, tp=lay.tp, sp=lay.sp,
                                                  dtype=self.dtype), self.device)
        n, bw = lay.dp, self._dp_bandwidth(lay)
        per_node = self.cluster.gpus_per_node

        settings = self.zero_settings
        persistent = float(settings["stage3_param_persistence_threshold"])  # kept whole on every rank: never gathered
        bucket = float(settings["reduce_bucket_size"])  # gradients reduce-scatter a full bucket at a time

        def gather(elements: float) -> float:
            if not elements:
                return 0.0
            return (self.device.collective_time(elements * self.e, "all-gather", n, bw)
                    + ring_latency_s("all-gather", n, per_node))

        def reduce(elements: float) -> float:
            return (self.device.collective_time(elements * self.e, "reduce-scatter", n, bw)
                    + ring_latency_s("reduce-scatter", n, per_node) * elements / bucket)

        layers = []
        for cost, (_, _, ops) in zip(costs, layer_ops(self.cfg, shp)):
            owners = [op for op in ops if op.weights]
            flops = sum(op.fwd_flops for op in owners) or 1.0
            layers.append([ModuleTraffic(cost.forward_s * op.fwd_flops / flops, cost.backward_s * op.fwd_flops / flops,
                                         gather(sum(w for w in op.weights if w > persistent)), reduce(sum(op.weights)))
                           for op in owners])
        compute = sum(c.time_s(recompute=full) for c in costs)
        return max(0.0, microbatch_s(layers, recompute=full, overlap_reduce=lay.overlap_comm) - compute)

    def _megatron_update_s(self, lay: Layout, params: float, hide_under: tuple[float, float] | None) -> float:
        grads, bw = params * self.e, self._dp_bandwidth(lay)
        kinds = ("reduce-scatter", "all-gather") if lay.zero >= 1 else ("all-reduce",)
        comm = sum(self.device.collective_time(grads, kind, lay.dp, bw) for kind in kinds)
        if lay.overlap_comm:
            fwd, bwd = hide_under if hide_under is not None else (math.inf, math.inf)
            comm = max(0.0, comm / 2 - bwd) + max(0.0, comm / 2 - fwd)
        owned = params / (lay.dp if lay.zero >= 1 else 1)
        return comm + adam_step_s(owned, self.device, bytes_per_param=self.adam_bytes_per_param)

    def engine_passes_s(self, lay: Layout, params: float, layer_params: list[float] | tuple = ()) -> float:
        """DeepSpeed's own memory passes over a rank's gradients each step, beside the collectives and
        Adam (read from DeepSpeed 0.19's source; on CPU ranks they are a visible share of the step):

        - ZeRO-0 (``engine.allreduce_gradients`` -> ``buffered_allreduce_fallback``, run even when the
          DP group is one rank, as in every pipeline here): the gradients are flattened into a new
          buffer (read + write), scaled by 1/dp when dp > 1 (read + write), all-reduced and copied
          back (read + write); the trainer then reads them once for the gradient norm.  A CPU pays
          first touches for the flat buffer (one per 5e8 elements) every step.
        - ZeRO-1/2/3 (``get_grad_norm_direct``): every owned gradient is converted to float64 for the
          norm (read e, write 8, read 8), the owned gradients are flattened into a new fp32 partition
          (read e, write 4) and the updated fp32 partition is copied into the 16-bit one (read 4,
          write e); ZeRO-1/2 also copy each micro-batch's gradients through the reduction bucket
          (read + write) when they reduce.  A CPU pays first touches for the float64 copies of
          large gradients and for the flat partition.
        """
        e, dp, m = self.e, lay.dp, lay.micro_batches
        if lay.zero == 0:
            traffic = (4 + (2 if dp > 1 else 0) + 1) * e * params
            bucket = 5e8
            fresh = [e * min(bucket, params - i * bucket) for i in range(math.ceil(params / bucket))]
        else:
            owned = params / dp
            reductions = {1: 1, 2: m}.get(lay.zero, 0)
            traffic = (e + 16) * owned + (e + 4) * owned + (4 + e) * owned + reductions * 2 * e * params
            fresh = [8.0 * p / dp for p in layer_params if 8.0 * p / dp > self.device.fresh_alloc_min_bytes]
            fresh.append(4.0 * owned)
        return (traffic / (self.device.hbm_bandwidth * self.device.memory_efficiency)
                + self.device.fresh_alloc_time(fresh))

    def adam_fresh_bytes(self, lay: Layout, layer_params: list[float]) -> tuple:
        """The fp32 tensors whose Adam temporaries are mapped afresh each step on a CPU (glibc: above its
        mmap threshold): under ZeRO the rank's one flat partition, else each layer over the threshold
        counted as one tensor (its embedding or head matrix; a block's matrices are each smaller)."""
        if not self.device.fresh_page_bandwidth:
            return ()
        if lay.zero >= 1:
            return (4.0 * sum(layer_params) / lay.dp,)
        return tuple(4.0 * p for p in layer_params if 4.0 * p > self.device.fresh_alloc_min_bytes)

    # -- one layout ----------------------------------------------------------------------------
    def peak_rule(self, lay: Layout) -> PipelinePeakRule | None:
        """The partitioner's form of the peak rule for this layout (``costs.peak.PipelinePeakRule``), where
        it applies: one model chunk a rank; None elsewhere (the additive form at the step)."""
        if not walks_schedule(lay.schedule_spec):
            return None
        return PipelinePeakRule(ZeroSettings.of_layout(lay), lay.dp, self.e,
                                fused_adam=self.adam_bytes_per_param == FUSED_ADAM_BYTES, ep=lay.ep)

    def _memory_lists(self, lay: Layout, costs) -> dict:
        """The partitioner's memory lists for ``lay``: the peak rule's where it applies, else the states at
        the step by ZeRO's additive form, and the activations a layer keeps per micro-batch."""
        full = lay.recompute == "full"
        rule = self.peak_rule(lay)
        if rule is None:
            per_param = state_bytes_per_param(lay.zero, lay.dp, self.e)
            static = [c.param_bytes / self.e * per_param for c in costs]
            reserve = step = None
        else:
            static = [float(c.static_bytes) for c in rule.layer_states(list(costs))]
            reserve = rule.stage_reserves(list(costs), lay.num_chunks, micro_batches=lay.micro_batches)
            step = rule.step_bytes(list(costs))
        return dict(static_bytes=static, activation_bytes=held_activation_bytes(costs, recompute=full),
                    stage_reserve_bytes=reserve, step_bytes=step)

    def partition(self, lay: Layout, *, capped: bool = True) -> list[int]:
        """The exact min-max split under the memory cap (``capped=False``: with none)."""
        costs = self.costs_of(lay)
        full = lay.recompute == "full"
        chunks = lay.num_chunks
        if chunks == 1:
            return [0, len(costs)]
        link = self.split_link(lay)
        try:  # a rank holds chunks_per_rank chunks: each gets its share of the cap
            return partition_min_max_lists(
                [c.time_s(recompute=full) for c in costs], chunks, **self._memory_lists(lay, costs),
                micro_batches=lay.micro_batches, memory_cap=self.memory_cap / lay.chunks_per_rank if capped else None,
                boundary_time=[link.latency_s + c.output_bytes / link.bandwidth for c in costs], schedule=lay.schedule_spec.name,
                explain_infeasible=False)
        except InfeasibleMemoryCap:
            raise OutOfMemory(None) from None

    def least_memory(self, lay: Layout) -> float:
        """The least memory the heaviest rank of this layout needs over every split: the partitioner's
        smallest feasible cap (a chunk's share times the chunks a rank holds), or without a pipeline
        the one rank's states and activations.  Up to 64 feasibility probes: asked only when nothing fits."""
        costs = self.costs_of(lay)
        chunks = lay.num_chunks
        if chunks == 1:
            return self.evaluate(lay, [0, len(costs)], check_memory=False).peak_memory_bytes
        full = lay.recompute == "full"
        return lay.chunks_per_rank * smallest_feasible_cap_lists(
            [c.time_s(recompute=full) for c in costs], chunks, **self._memory_lists(lay, costs),
            micro_batches=lay.micro_batches, schedule=lay.schedule_spec.name)

    def run_split(self, lay: Layout) -> list[int]:
        """The split a ``PipelineModule`` with ``partition_method: "analytic"`` chooses from these costs for
        this layout: the same decision function (``partition.methods.decide_offline``), on the layers'
        model states by the ZeRO rule (as the module counts them), under each chunk's share of the cap
        where a split fits it, else with none (the step search under 1F1B and GPipe, the min-max split
        under the other schedules)."""
        costs = self.costs_of(lay)
        if lay.num_chunks == 1:
            return [0, len(costs)]
        states = tuple(layer_states_by_rule(list(costs), stage=lay.zero, dp=lay.dp, element_bytes=self.e, ep=lay.ep))
        dualpipev = lay.schedule_spec.kind == "dualpipev"  # it balances each rank's pair by time alone
        return list(_analytic_split(states, lay.num_chunks, lay.micro_batches, lay.recompute == "full",
                               lay.schedule_spec.name, self.step_model,
                               None if dualpipev else self.split_link(lay).bandwidth,
                               None if dualpipev else self.memory_cap / lay.chunks_per_rank / 2**30,
                               None if dualpipev else self.peak_rule(lay)))

    def rank_peaks(self, lay: Layout, parts: list[int], rank_layers: list[list], held: list[float], *,
                   modes: list[str] | None = None) -> list[dict]:
        """Every pipeline rank's memory at its peak (``costs.peak``: its step walked op by op in the
        schedule's order), the model states at the step beside; where the rule does not walk the schedule
        (several chunks a rank, a split backward), the additive form (``costs.zero.rank_memory``) over the
        schedule's held activations."""
        # beside each: the activations its schedule holds at most (the simulator's ``held_peak_bytes``)
        if not walks_schedule(lay.schedule_spec):
            threshold = int(ZERO_SETTINGS["stage3_param_persistence_threshold"])
            return [{**rank_memory(layers, activation_bytes=held[r], zero=lay.zero, dp=lay.dp, element_bytes=self.e,
                                   persistence_threshold=threshold, offload=lay.offload).to_dict(),
                     "held_activation_bytes": held[r]}
                    for r, layers in enumerate(rank_layers)]
        steps = rank_steps(self.cfg, lay, parts=parts, seq=self.seq, dtype=self.dtype,
                           mask_bytes=self.e if self.device.name == "cpu" else 1,
                           fused_adam=self.adam_bytes_per_param == FUSED_ADAM_BYTES, modes=modes)
        return [{**RankMemory.from_peak(step_peak(step)).to_dict(), "held_activation_bytes": held[r]}
                for r, step in enumerate(steps)]

    def evaluate_named(self, lay: Layout) -> LayoutCost:
        """A layout the user named, evaluated whatever its memory, on the split an ``analytic`` run
        chooses; a peak over the cap is noted ("over the cap by X GiB"), not refused."""
        cost = self.evaluate(lay, self.run_split(lay), check_memory=False)
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
        costs = self.costs_of(lay)
        full = lay.recompute == "full"
        if modes is not None:
            costs, full = with_layer_recompute(costs, modes, selective_built=False), False
        parts = parts or self.partition(lay)
        stages = stage_costs(costs, parts, micro_batches=lay.micro_batches, recompute=full,
                             schedule=lay.schedule_spec.name)
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
        if lay.runtime == "megatron" and lay.tp > 1 and not lay.sp:
            # Megatron sends 1/t of a boundary activation between stages and all-gathers it over TP (its
            # scatter/gather optimisation; under SP the activation is already the rank's shard)
            stages = [replace(st, boundary_out_bytes=st.boundary_out_bytes / lay.tp) for st in stages]
        exposed = self.zero3_exposed_s(lay) if self.zero3_prefetched(lay) and update else None
        tied = [0.0] * lay.pp  # DeepSpeed's tied embedding: its gradient all-reduced between first and last rank
        first, last = chunk_rank[0], chunk_rank[len(parts) - 2]
        if self.runtime_terms and lay.runtime == "deepspeed" and getattr(self.cfg, "tied_head", False) and first != last:
            tied[first] = tied[last] = costs[0].param_bytes / self.e
        pred = self.step_model.predict(
            stages, m, schedule=spec.name if lay.pipelined else "none", runtime=lay.runtime,
            network=self._stage_network(lay), timeline=timeline,
            update_s=[self.update_s(lay, p, lp, hide_under=tuple(t), expert_params=x, zero3_exposed_s=exposed,
                                    tied_params=tp_) if update else 0.0
                      for p, lp, t, x, tp_ in zip(rank_params, rank_layer_params, rank_time, rank_experts, tied)])
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


__all__ = ["Cluster", "LayoutCost", "OutOfMemory", "PlanModel", "plan_device", "DEVICES", "USABLE_MEMORY"]
