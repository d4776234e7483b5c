"""Iteration time of a GPT layout on a GPU cluster, from the analytic model alone.

    per-layer roofline times (costs/estimate.py, TP collectives included)
      -> stages (blocks split evenly, the embedding on the first, the head + loss on the last)
      -> the pipeline step (the 1F1B event simulator; interleaved: closed form, see below)
      + data-parallel gradient reduction (ring over the DP group, on the network the group spans)
      + the optimizer step (memory-bound Adam over this rank's parameters)

This is the model ``bench/calibrate_at_scale.py`` fits to published Megatron-LM runs and
the planner will rank layouts with.  Interleaved 1F1B (v model chunks per rank) still
uses its closed form here, m T + (p - 1) T / v for a slowest stage time T (Narayanan et
al. 2021, Sec. 2.2.2), which the event simulator reproduces for uniform stages
(tests/test_schedule.py); moving this model onto the simulator is the step model's work.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout import Layout
from ..simulate.schedule import simulate_1f1b
from .estimate import EstimateRequest, estimate_layers
from .hardware import DeviceSpec, ring_time


@dataclass(frozen=True)
class ClusterSpec:
    """Links per GPU (bytes/s, one direction): NVLink inside a node, the GPU's own NIC between nodes."""

    gpus_per_node: int = 8
    intra_node_bandwidth: float = 300e9  # A100 NVLink 3: 600 GB/s both ways
    inter_node_bandwidth: float = 25e9  # one 200 Gb/s HDR InfiniBand NIC per GPU


@dataclass(frozen=True)
class IterationTime:
    step_s: float
    pipeline_s: float  # forward + backward of every micro-batch through the pipeline, bubbles included
    dp_comm_s: float  # exposed gradient (and parameter) collectives
    optimizer_s: float
    bubble_fraction: float

    def tflops_per_gpu(self, flops: float, gpus: int) -> float:
        return flops / (self.step_s * gpus) / 1e12


def adam_step_s(params: float, device: DeviceSpec, *, bytes_per_param: float = 30.0, fresh_sizes=()) -> float:
    """A memory-bound Adam step over ``params`` parameters: in mixed precision a fused one reads param,
    grad, m, v and writes param, m, v and the 16-bit copy (~30 bytes a parameter; 28 in fp32).
    ``fresh_sizes``: bytes of temporaries mapped afresh (a CPU's page faults, ``fresh_alloc_time``)."""
    return bytes_per_param * params / (device.hbm_bandwidth * device.memory_efficiency) + device.fresh_alloc_time(fresh_sizes)


def _stage_times(cfg, layout: Layout, device: DeviceSpec, dtype: str) -> tuple[list[float], list[float], list[float]]:
    """(forward s, backward s, parameters) of each pipeline rank, per micro-batch."""
    req = EstimateRequest(micro_batch=layout.micro_batch, seq=cfg.seq_len, tp=layout.tp, sp=layout.sp, dtype=dtype,
                          selective_recompute=layout.recompute == "selective")
    emb, block, head = (lambda rows: (rows[0], rows[1], rows[-1]))(estimate_layers(cfg, req, device))
    block_bwd = block["bwd_s"] + (block["fwd_s"] if layout.recompute == "full" else 0.0)  # the replayed forward
    per_rank = cfg.layers // layout.pp
    fwd, bwd, params = [], [], []
    for s in range(layout.pp):
        ends = [r for r, on in ((emb, s == 0), (head, s == layout.pp - 1)) if on]
        fwd.append(per_rank * block["fwd_s"] + sum(r["fwd_s"] for r in ends))
        bwd.append(per_rank * block_bwd + sum(r["bwd_s"] for r in ends))
        params.append(per_rank * block["params"] + sum(r["params"] for r in ends))
    return fwd, bwd, params


def _dp_bandwidth(layout: Layout, cluster: ClusterSpec) -> float:
    """A DP group's ranks are tp * pp apart: inside one node only if the whole group fits in it."""
    inside = layout.tp * layout.pp * layout.dp <= cluster.gpus_per_node
    return cluster.intra_node_bandwidth if inside else cluster.inter_node_bandwidth


def predict_iteration(cfg, layout: Layout, device: DeviceSpec, cluster: ClusterSpec, *, dtype: str = "bf16",
                      grad_bytes: int = 2) -> IterationTime:
    """One training iteration of ``cfg`` (a GPTConfig-like shape) under ``layout`` as Megatron-LM runs it:
    ZeRO-1 is its distributed optimizer, ``overlap_comm`` its overlapped gradient reduce-scatter and
    parameter all-gather, ``interleaved:V`` its virtual pipeline stages."""
    m, p, v = layout.micro_batches, layout.pp, layout.chunks_per_rank
    if cfg.layers % p or (cfg.layers // p) % v:
        raise ValueError(f"{cfg.layers} layers do not split into pp {p} x {v} chunks")
    fwd, bwd, params = _stage_times(cfg, layout, device, dtype)
    # stage boundaries cross nodes once a stage's TP group fills a node; Megatron sends 1/t of the
    # activation over the network and all-gathers it over NVLink (its scatter/gather optimisation)
    boundary = layout.micro_batch * cfg.seq_len * cfg.hidden * grad_bytes / layout.tp
    crossing = device.comm_efficiency * (cluster.inter_node_bandwidth if layout.tp * 2 > cluster.gpus_per_node
                                         else cluster.intra_node_bandwidth)
    p2p = boundary / crossing if p > 1 else 0.0
    if v == 1:
        sim = simulate_1f1b(fwd, bwd, m, p2p_s=[p2p] * (p - 1))
        pipeline, bubble = sim.step_s, sim.bubble_fraction
    else:
        slowest = max(f + b for f, b in zip(fwd, bwd))
        pipeline = m * slowest + (p - 1) * (slowest / v + 2 * p2p)
        bubble = 1.0 - m * sum(f + b for f, b in zip(fwd, bwd)) / (p * pipeline)  # the simulator's definition
    # data parallel: the heaviest rank's gradients, all-reduced (or reduce-scattered + all-gathered) over DP
    heaviest = max(range(p), key=lambda s: params[s])
    reduce = ring_time(params[heaviest] * grad_bytes, "all-reduce", layout.dp,
                       _dp_bandwidth(layout, cluster) * device.comm_efficiency)
    if layout.overlap_comm:  # hidden under the last micro-batch's backward and the next step's first forward
        reduce = max(0.0, reduce / 2 - bwd[heaviest]) + max(0.0, reduce / 2 - fwd[heaviest])
    sharded = params[heaviest] / (layout.dp if layout.zero >= 1 else 1)
    optimizer = adam_step_s(sharded, device)
    return IterationTime(step_s=pipeline + reduce + optimizer, pipeline_s=pipeline, dp_comm_s=reduce,
                         optimizer_s=optimizer, bubble_fraction=bubble)
