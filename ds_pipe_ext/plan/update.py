"""A rank's work after its last backward, as each runtime runs it: the data-parallel collectives, the
runtime's own passes over the gradients, the optimizer step.  ``PlanModel`` mixes this in; its methods
read the model's device, cluster, dtype and the run's settings (``zero_settings`` and ``zero_of``, ``runtime_terms``,
``grad_accum_dtype``).

DeepSpeed (read from 0.19's source): ZeRO-0 all-reduces the gradients after the last backward; a bf16
pipeline without ZeRO runs ``BF16_Optimizer`` (its accumulation buffers all-reduced, the updated bf16
partitions all-gathered, 1/dp of the states updated); ZeRO-1 all-reduces the gradient buckets at the
boundary and all-gathers the updated weights, ZeRO-2 all-reduces every micro-batch
(``use_multi_rank_bucket_allreduce``); ZeRO-3 gathers weights forward and backward and reduce-scatters
every micro-batch: serially on CPU ranks, under DeepSpeed's prefetch on a GPU (``plan.zero3``).  A tied
embedding's gradient is all-reduced between the first and last stage (``ReduceTiedGrads``).
Megatron-LM: reduce-scatter and all-gather with its distributed optimizer, half hidden under the last
backward and half under the first forward with ``overlap_comm``.
"""

from __future__ import annotations

import math

from ..costs.estimate import DTYPE_BYTES, EstimateRequest, shape_for
from ..costs.layer_ops import layer_ops
from ..costs.hardware import adam_step_s
from ..costs.zero import runs_bf16_optimizer
from ..layout import Layout
from .zero3 import exposed_s


class RankUpdate:
    """The update-time terms of ``PlanModel`` (a mixin: ``self`` is the model)."""

    def update_s(self, lay: Layout, params: float, layer_params: list[float] | tuple = (),
                 hide_under: tuple[float, float] | None = None, expert_params: float = 0.0,
                 zero3_exposed_s: float | None = None, tied_params: float = 0.0,
                 tensors: list[float] | tuple = ()) -> float:
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
        whose gradients reduce over their expert-data-parallel group (tp x dp / ep ranks) and whose optimizer
        states partition over it.  ``zero3_exposed_s``: ZeRO-3's traffic a micro-batch leaves exposed
        (``zero3_exposed_s``), where the prefetch chain prices it, in place of the serial formula.
        ``tied_params``: a tied embedding's parameters on this rank, whose gradients DeepSpeed's pipeline
        engine all-reduces between the first and last stage (``ReduceTiedGrads``) before the DP reduction.
        ``tensors``: the element count of each of the rank's parameter tensors (``engine_passes_s``)."""
        if lay.runtime == "megatron":
            return self._megatron_update_s(lay, params, hide_under)
        # at ep 1 without TP the experts reduce with the rest; under TP over the stage's tp x dp / ep ranks
        experts = expert_params if lay.expert_dp != lay.dp else 0.0
        dense = params - experts
        sharded = lay.zero >= 1 or self.bf16_optimizer(lay)  # BF16_Optimizer partitions its fp32 states like ZeRO-1
        owned = dense / (lay.dp if sharded else 1) + experts / (lay.expert_dp if sharded else 1)
        if zero3_exposed_s is not None:
            comm = lay.micro_batches * zero3_exposed_s
        else:
            comm = self._dp_comm_s(lay, dense, lay.dp) + self._dp_comm_s(lay, experts, lay.expert_dp)
        if tied_params:
            comm += self.device.group_time("all-reduce", tied_params * self.grad_reduce_bytes(lay),
                                           self.placements(lay)["tied"])
        return comm + self.engine_passes_s(lay, params, layer_params, tensors) + adam_step_s(
            owned, self.device, bytes_per_param=self.adam_bytes_per_param,
            fresh_sizes=self.adam_fresh_bytes(lay, layer_params))

    def _dp_comm_s(self, lay: Layout, params: float, n: int) -> float:
        """DeepSpeed's data-parallel collectives of ``params`` parameters' gradients over ``n`` ranks (the
        dp group; a rank's experts: their expert-data-parallel group of tp x dp / ep)."""
        m, grads = lay.micro_batches, params * self.e
        if n <= 1 or not params:
            return 0.0
        group = self.placements(lay)["dp" if n == lay.dp else "expert_dp"]

        def coll(kind: str) -> float:
            return self.device.group_time(kind, grads, group)

        if self.bf16_optimizer(lay):  # its gradient buffers all-reduced, then the updated bf16 partitions gathered
            return (self.device.group_time("all-reduce", params * self.grad_reduce_bytes(lay), group)
                    + coll("all-gather"))
        if lay.zero == 0:
            return coll("all-reduce")
        # DeepSpeed's ZeRO-1/2 reduce gradients by all-reducing buckets that span every rank's
        # slice (``use_multi_rank_bucket_allreduce``, on by default), then each keeps its slice
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
        return (self.runtime_terms and lay.runtime == "deepspeed"
                and runs_bf16_optimizer(pipelined=lay.pipelined, zero_stage=lay.zero, bf16=self.dtype == "bf16"))

    def grad_reduce_bytes(self, lay: Layout) -> float:
        """Bytes of a gradient element as DeepSpeed reduces it: ``grad_accum_dtype`` under ``BF16_Optimizer``
        (the tied weights' ``_hp_grad`` too), else the training dtype."""
        return DTYPE_BYTES[self.grad_accum_dtype] if self.bf16_optimizer(lay) else self.e

    def zero3_prefetched(self, lay: Layout) -> bool:
        """Whether ZeRO-3's traffic is priced by the prefetch chain (``plan.zero3``): DeepSpeed without a
        pipeline on a GPU, whose NCCL kernels run beside the compute.  A CPU's gloo collectives run on the
        cores that compute (ranks share two of them here, and were measured so): the serial formula.
        ``runtime_terms=False``: the serial formula everywhere."""
        return (self.runtime_terms and lay.deepspeed_zero3 and not lay.pipelined
                and lay.ep == 1 and self.device.name != "cpu")

    def zero3_exposed_s(self, lay: Layout) -> float:
        """ZeRO-3's traffic one micro-batch leaves exposed beside its compute (``plan.zero3.exposed_s``): per
        module, the all-gather of its parameters and the reduce-scatter of its gradients over the DP group as
        NCCL runs them on the cluster (``costs.nccl``: its algorithm, bus bandwidth and latency), under the run's
        buckets (``zero_of``): a reduce-scatter's start-up is paid once a bucket."""
        group = self.placements(lay)["dp"]
        zero = self.zero_of(lay)
        bucket = float(zero.reduce_bucket_size)  # gradients reduce-scatter a bucket at a time
        per_tensor = self.zero3_synchronized  # DeepSpeed 0.3.12-0.4.x: a NCCL call a tensor

        def gather(tensors: list) -> float:
            if per_tensor:
                return sum(self.device.group_time("all-gather", n * self.e, group) for n in tensors)
            return self.device.group_time("all-gather", sum(tensors) * self.e, group)

        def reduce(tensors: list) -> float:
            if per_tensor:
                return sum(self.device.group_time("reduce-scatter", n * self.e, group) for n in tensors)
            elements = sum(tensors)
            if not elements:
                return 0.0
            one = self.device.group_collective("reduce-scatter", elements * self.e, group)
            return one.time_s - one.latency_s + one.latency_s * elements / bucket

        # torch 1.8-1.10's ProcessGroupNCCL ran a list all-gather / reduce-scatter (DeepSpeed 0.3's call) through a
        # flat buffer, copying each rank's chunk out (or in) with a copy_ a rank on the NCCL stream, dispatched by
        # the host one at a time: dp kernels a tensor, the host held meanwhile (after DeepSpeed's synchronize)
        kern = self.device.gpu
        chunk_s = lay.dp * kern.host_kernel_s if (per_tensor and kern is not None) else 0.0

        def host(tensors: list) -> float:
            return chunk_s * len(tensors)

        shp = shape_for(self.cfg, EstimateRequest(micro_batch=lay.micro_batch, seq=self.seq, tp=lay.tp, sp=lay.sp,
                                                  dtype=self.dtype), self.device)
        return exposed_s(self.costs_of(lay), [ops for _, _, ops in layer_ops(self.cfg, shp)], gather=gather,
                         reduce=reduce, persistent=float(zero.persistence_threshold),
                         recompute=lay.recompute == "full",
                         overlap_reduce=lay.overlap_comm and not self.zero3_synchronized,
                         max_reuse=float(zero.max_reuse_distance),
                         host_gather=host if chunk_s else None, host_reduce=host if chunk_s else None,
                         max_live=float(zero.max_live_parameters))

    def _megatron_update_s(self, lay: Layout, params: float, hide_under: tuple[float, float] | None) -> float:
        grads, group = params * self.e, self.placements(lay)["dp"]
        kinds = ("reduce-scatter", "all-gather") if lay.zero >= 1 else ("all-reduce",)
        comm = sum(self.device.group_time(kind, grads, group) for kind in kinds)
        if lay.overlap_comm:
            fwd, bwd = hide_under if hide_under is not None else (math.inf, math.inf)
            comm = max(0.0, comm / 2 - bwd) + max(0.0, comm / 2 - fwd)
        owned = params / (lay.dp if lay.zero >= 1 else 1)
        return comm + adam_step_s(owned, self.device, bytes_per_param=self.adam_bytes_per_param)

    def engine_passes_s(self, lay: Layout, params: float, layer_params: list[float] | tuple = (),
                        tensors: list[float] | tuple = ()) -> float:
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
          large gradients and for the flat partition.  In 16-bit the step first checks every owned
          gradient for overflow (``bf16.check_grad_overflow``, on by default for bf16, ``PlanModel``'s
          ``check_grad_overflow``; always for fp16: ``amax`` and ``amin`` read it, five scalar kernels and
          the count's add follow).

        - ``BF16_Optimizer`` (a bf16 pipeline without ZeRO, ``bf16_optimizer``) in place of ZeRO-0's passes: each
          micro-batch zeroes the 16-bit gradients before its backward (``clear_lp_grads``: write e; none where
          ``lp_grads_to_none``: the 2022 optimizer BLOOM ran set them to None, PR #1801) and adds
          them into the accumulation buffers after it (``update_hp_grads``: read e, read and write a, the
          ``grad_accum_dtype``'s bytes; through a cast's temporary where a != e: write and read a more), a
          tensor at a time; the step reads the buffers for the norm (a), casts the owned partition to fp32
          where a != 4 (read a, write 4: a fresh tensor), copies the updated fp32 partition into the 16-bit
          one (read 4, write e) and zeroes the buffers (write a).

        ZeRO-1/2 loop over the gradients a tensor at a time (the check, the norm's cast and reduction, the
        reduction bucket's copy), and so does ``BF16_Optimizer`` each micro-batch.  On a GPU each such tensor
        takes at least its kernels' host dispatch (``GpuKernels.host_kernel_s`` a kernel), the host waiting on
        no work: ``tensors`` (the rank's parameter tensors' element counts) prices each tensor at the larger
        of its dispatch and its bytes.
        """
        e, dp, m = self.e, lay.dp, lay.micro_batches
        bandwidth = self.device.hbm_bandwidth * self.device.memory_efficiency
        kern = self.device.gpu
        if self.bf16_optimizer(lay):
            a = DTYPE_BYTES[self.grad_accum_dtype]
            cast = a != e
            zero = 0 if self.lp_grads_to_none else e  # 0.19 zeroes them; 2022's set them to None
            micro_bytes = zero + e + 2 * a + (2 * a if cast else 0)  # the add (through the cast's temporary)
            step_bytes = a * params + ((a + 4) if a != 4 else 0) * params / dp + (4 + e) * params / dp + a * params
            fresh = [4.0 * params / dp] if a != 4 else []
            if kern is None or not tensors:
                micro = m * micro_bytes * params / bandwidth
            else:
                micro = m * sum(max(micro_bytes * n / bandwidth, (2 if cast else 1) * kern.host_kernel_s)
                                for n in tensors)
            return micro + step_bytes / bandwidth + self.device.fresh_alloc_time(fresh)
        if lay.zero == 0:
            traffic = (4 + (2 if dp > 1 else 0) + 1) * e * params
            bucket = 5e8
            fresh = [e * min(bucket, params - i * bucket) for i in range(math.ceil(params / bucket))]
            return traffic / bandwidth + self.device.fresh_alloc_time(fresh)
        # DeepSpeed checks fp16 gradients always, bf16 ones where bf16.check_grad_overflow (its default), fp32 never
        overflow_check = e < 4 and (self.dtype == "fp16" or self.check_grad_overflow)
        owned_bytes = (e + 16) + (e + 4) + (4 + e) + (2 * e if overflow_check else 0)  # a parameter it owns
        reductions = {1: 1, 2: m}.get(lay.zero, 0)
        fresh = [8.0 * p / dp for p in layer_params if 8.0 * p / dp > self.device.fresh_alloc_min_bytes]
        fresh.append(4.0 * params / dp)
        if kern is None or not tensors:
            traffic = owned_bytes * params / dp + reductions * 2 * e * params
            return traffic / bandwidth + self.device.fresh_alloc_time(fresh)
        owned_kernels = (7 if overflow_check else 0) + 2  # the check; the norm's fp64 cast and reduction
        owned = sum(max(owned_bytes * n / bandwidth, owned_kernels * kern.host_kernel_s) for n in tensors) / dp
        reduced = reductions * sum(max(2 * e * n / bandwidth, kern.host_kernel_s) for n in tensors)
        return owned + reduced + self.device.fresh_alloc_time(fresh)

    def adam_fresh_bytes(self, lay: Layout, layer_params: list[float]) -> tuple:
        """The fp32 tensors whose Adam temporaries are mapped afresh each step on a CPU (glibc: above its
        mmap threshold): under ZeRO the rank's one flat partition, else each layer over the threshold
        counted as one tensor (its embedding or head matrix; a block's matrices are each smaller)."""
        if not self.device.fresh_page_bandwidth:
            return ()
        if lay.zero >= 1:
            return (4.0 * sum(layer_params) / lay.dp,)
        return tuple(4.0 * p for p in layer_params if 4.0 * p > self.device.fresh_alloc_min_bytes)


__all__ = ["RankUpdate"]
