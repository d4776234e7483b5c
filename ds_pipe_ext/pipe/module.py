"""`PipelineModule`: DeepSpeed's PipelineModule with cost-aware partition methods.

A drop-in subclass for any model DeepSpeed's accepts: ``LayerSpec``, ``TiedLayerSpec``,
``nn.Module`` instances and callables.  DeepSpeed's own methods (``uniform``,
``parameters``, ``type:``) go to DeepSpeed unchanged; the plugin's (``profiled``,
``analytic``, ``parts:``) are decided on rank 0 and broadcast, so every rank builds
identical stages even though profiling timings differ from rank to rank.  If rank 0
fails (an infeasible memory cap, say), every rank raises the same error instead of
waiting forever in a collective.

Private DeepSpeed state is reached through ``ds_pipe_ext.compat`` only; the
``_partition_layers`` and ``_is_checkpointable`` overrides below are the exceptions subclassing requires.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
from deepspeed.runtime.pipe.module import PipelineModule as _DeepSpeedPipelineModule

from ..compat import engine as ds_engine
from ..compat.cpu_shims import steady_host_allocator
from ..device import build_device, rank_device, select_rank_device
from ..costs.frozen import freeze_costs
from ..costs.layers import deepspeed_layer_seeds, is_layer_spec
from ..costs.model import CostModel
from ..costs.profiler import profile_layers
from ..costs.estimate import DTYPE_BYTES
from ..costs.profiler import TORCH_DTYPES
from ..costs.peak import ZeroSettings
from ..costs.peak_rule import PipelinePeakRule
from ..costs.stage import with_layer_recompute
from ..costs.zero import layer_states_by_rule
from ..layout import Layout, LayoutError
from ..partition import InfeasibleMemoryCap, PartitionError, partition_jointly
from ..partition.methods import PartitionRequest, lookup
from ..partition.report import PartitionPlan, build_plan
from ..simulate.step_model import StepModel
from .config import PipelineSettings
from .decide import decide_and_broadcast
from .freeze import frozen_flags
from .recompute import check_auto_recompute, supports_selective, with_measured_selective, with_selective_recompute
from . import schedules as _engine_order  # noqa: F401 - hands the step model DeepSpeed's order of instructions
from ..compat.backward import install_one_pass_backward

install_one_pass_backward()  # a stage handing on several tensors backpropagates once, as it was profiled

log = logging.getLogger(__name__)


class PipelineModule(_DeepSpeedPipelineModule):
    """``deepspeed.pipe.PipelineModule`` that also accepts ``partition_method="profiled"``.

    ``layers`` may mix ``LayerSpec``, ``TiedLayerSpec``, ``nn.Module`` instances and
    callables, as DeepSpeed's.  Extra keyword arguments (all optional):

        settings: a ``PipelineSettings`` (the ``"pipeline"`` section of ds.json);
            its method, checkpoint interval and profile options are the defaults.
        profile_batch: ``(inputs, labels)`` for one micro-batch, as the engine would
            feed it (``inputs`` a tensor or a tuple of tensors); required by
            "profiled" and "analytic".
        micro_batches: micro-batches per step (gradient accumulation steps), for the
            1F1B in-flight memory model; default: the number of stages.
        cost_key: extra fields for the profile cache key (e.g. the model config).
        zero_stage: DeepSpeed's ZeRO stage (0 or 1 under a pipeline; ``zero_optimization.stage``):
            each layer's model-state bytes follow DeepSpeed's allocation rule for it over this
            topology's data-parallel ranks (``costs.zero``), which the memory cap then counts.
        zero_optimization: ds.json's ``zero_optimization`` section (its reduction bucket): the memory
            cap applies to each stage's peak over the step (``costs.peak_rule.PipelinePeakRule``); None:
            DeepSpeed's defaults for ``zero_stage``.
        cost_model: a ``costs.model.CostModel`` describing the layers analytically;
            required by "analytic".  It is the one hook for parallel degrees: the TP
            degree comes from the topology and is passed to it; sequence parallelism
            is the cost model's to know (a family's ``cost_model(cfg, impl)``, ``models.costs``).
        expert_parallel: the EP degree of DeepSpeed MoE layers among ``layers`` (their ``ep_size``): their
            experts' gradients and optimizer states partition over dp / ep ranks.
        dtype: the precision the engine trains in ("fp32", "bf16", "fp16": ds.json's ``bf16``/``fp16`` section,
            ``pipe.config.engine_dtype``): "profiled" measures the layers in it and counts their states at its
            sizes (16-bit weights with DeepSpeed's fp32 master states); the analytic source's default.
        recompute: one mode per layer, "none", "selective" (attention's core replayed: a ``LayerSpec`` whose
            layer takes ``selective_recompute``) or "full" (the layer's forward replayed, through DeepSpeed's
            own checkpointing at interval 1: ``_is_checkpointable`` answers per layer).  Nothing is wrapped,
            so a checkpoint saved under one choice loads under another.  Not with an interval.  "auto":
            chosen with the split under the memory cap ("profiled" / "analytic"; ``partition_jointly``).
    """

    def __init__(
        self,
        layers,
        num_stages: int | None = None,
        topology=None,
        loss_fn=None,
        *,
        partition_method: str | None = None,
        activation_checkpoint_interval: int | None = None,
        settings: PipelineSettings | None = None,
        profile_batch: tuple | None = None,
        micro_batches: int | None = None,
        cost_key: dict | None = None,
        cost_model: CostModel | None = None,
        zero_stage: int = 0,
        zero_optimization: dict | None = None,
        expert_parallel: int = 1,
        recompute: Sequence[str] | None = None,
        dtype: str = "fp32",
        **deepspeed_kwargs,
    ):
        settings = settings or PipelineSettings(stages=num_stages or 1)
        # CPU ranks: every rank trains under the malloc thresholds rank 0 profiles under (costs.profiler sets them
        # for its process).  Left to glibc, a rank that never profiled maps each buffer above its dynamic threshold
        # afresh and pays its page faults on every call: a user's script trained the last stage 13-17% over its
        # profile, and `profiled` moved layers onto it (docs/results/2026-11-27-profiled-generalization.md).  train.py sets them at start.
        steady_host_allocator()
        # DeepSpeed moves the built stage to cuda:LOCAL_RANK; the profile and the partition's broadcast
        # come before that, and must run on that GPU too (a user's script may not have selected it)
        select_rank_device()
        method = partition_method or settings.partition_method
        interval = settings.activation_checkpoint_interval if activation_checkpoint_interval is None else activation_checkpoint_interval
        stages = topology.get_dim("pipe") if topology is not None else num_stages
        layers = list(layers)
        # Everything that can be checked without communication fails here, identically on every rank.
        # The method is resolved once: DeepSpeed hands it back to _partition_layers, which reads this
        spec, arg = settings.method if partition_method is None else lookup(method)
        self._ext_method = (spec, arg)
        self._ext_layer_recompute: list[str] | str | None = None
        if recompute == "auto":
            check_auto_recompute(spec.needs_costs, settings.memory_cap_gib, interval, settings.schedule)
            self._ext_layer_recompute, interval = "auto", 1  # decided with the split, before the layers are built
        elif recompute is not None:
            layers = with_selective_recompute(layers, recompute, interval)
            self._ext_layer_recompute = list(recompute)
            interval = 1 if "full" in recompute else 0  # DeepSpeed asks _is_checkpointable layer by layer
        if stages is not None and stages > len(layers):
            raise PartitionError(
                f"{stages} pipeline stages but only {len(layers)} layers: use at most {len(layers)} stages "
                f"(pipeline.stages in ds.json) or a deeper model"
            )
        if spec.needs_costs and profile_batch is None:
            raise PartitionError(f"partition_method={method!r} needs one micro-batch: pass profile_batch=(inputs, labels)")
        if spec.needs_costs and not (isinstance(profile_batch, (tuple, list)) and len(profile_batch) == 2):
            raise PartitionError(f"profile_batch must be (inputs, labels), as the engine's data iterator yields; "
                                 f"got {type(profile_batch).__name__}")
        if spec.cost_source == "analytic" and not isinstance(cost_model, CostModel):
            raise PartitionError(f"partition_method={method!r} computes costs from a description of the model: pass "
                                 f"cost_model= (a ds_pipe_ext.costs.model.CostModel; for a family in models/, "
                                 f"get_family(name).cost_model(cfg, impl)), or use 'profiled'")
        tp = topology.get_dim("model") if topology is not None and "model" in topology.get_axis_names() else 1
        whole = sorted({layer.typename.__name__ for layer in layers
                        if is_layer_spec(layer) and getattr(layer.typename, "tensor_parallel", True) is False})
        if tp > 1 and whole:
            raise PartitionError(f"{whole[0]} layers hold whole (unsharded) weights: tensor parallelism inside the "
                                 f"pipeline (a 'model' axis of {tp} in the topology, DeepSpeed's AutoTP) is out of "
                                 f"scope for them; run them as PP x DP (model axis 1), or train the model as one of "
                                 f"ds_pipe_ext's families (models/), which run megatron-core TP")
        if dtype not in TORCH_DTYPES:
            raise PartitionError(f"dtype={dtype!r}: use one of {sorted(TORCH_DTYPES)} (the engine's precision)")
        self._ext_dtype = dtype
        self._ext_settings = settings
        self._ext_profile_batch = profile_batch
        self._ext_micro_batches = micro_batches or stages or 1
        self._ext_cost_key = cost_key or {}
        self._ext_cost_model = cost_model
        try:  # the layout's own rule: DeepSpeed runs ZeRO-0 or 1 under a pipeline
            Layout(pp=2, zero=zero_stage)
        except LayoutError as e:
            raise PartitionError(f"zero_stage={zero_stage!r}: {e}") from None
        self._ext_zero_stage = zero_stage
        self._ext_expert_parallel = expert_parallel
        self._ext_zero = ZeroSettings.from_ds_config({"zero_optimization": {**(zero_optimization or {}),
                                                                             "stage": zero_stage}})
        # every layer checkpointed by an interval (a mode per layer is in the layers' costs instead)
        self._ext_recompute = interval > 0 and self._ext_layer_recompute is None
        if interval > 0 and settings.use_reentrant is not True and "activation_checkpoint_func" not in deepspeed_kwargs:
            # DeepSpeed's default (reentrant) checkpoint drops the gradient of a first layer whose input
            # needs none (an embedding's token ids) and so checkpoints only some layers; the
            # non-reentrant one checkpoints every layer with parameters, as the cost model assumes
            from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint

            deepspeed_kwargs["activation_checkpoint_func"] = non_reentrant_checkpoint
        self.partition_plan: PartitionPlan | None = None
        self.layer_costs: list | None = None
        super().__init__(
            layers,
            num_stages=num_stages,
            topology=topology,
            loss_fn=loss_fn,
            partition_method=method,
            activation_checkpoint_interval=interval,
            **deepspeed_kwargs,
        )

    def _is_checkpointable(self, funcs) -> bool:
        """DeepSpeed's question at interval 1 (``_precompute_checkpointable_values``, asked once per layer):
        with a mode per layer, whether this one is "full"."""
        if self._ext_layer_recompute is None:
            return super()._is_checkpointable(funcs)
        if isinstance(self._ext_layer_recompute, str):
            raise RuntimeError('recompute="auto" was not decided before the engine asked which layers recompute')
        return all(self._ext_layer_recompute[ds_engine.layer_index_of(self, f)] == "full" for f in funcs)

    # DeepSpeed calls this from its __init__, after the topology and groups exist.
    def get_additional_losses(self):
        """The loss's named terms (a Mixture-of-Experts model's lm and router losses), for DeepSpeed to report."""
        terms = getattr(self.loss_fn, "additional_losses", None)
        return terms() if terms is not None else None

    def _partition_layers(self, method: str = "parameters") -> None:
        spec, arg = self._ext_method  # what __init__ resolved and handed DeepSpeed as ``method``
        if spec.deepspeed_builtin:
            super()._partition_layers(method=method)
            # DeepSpeed's partition_balanced returns numpy ints, which break seed_layers
            # (random.seed rejects np.int64): normalise to plain ints.
            self._take_parts([int(b) for b in self.parts])
            return
        peers = ds_engine.profiling_peers(self) if spec.cost_source == "profiled" else {0}
        parts, plan, costs, modes = decide_and_broadcast(
            lambda: self._decide(spec, arg, method) if self.global_rank == 0 else self.compute_layer_costs("profiled"),
            what=f"partition_method={method!r}", rank=self.global_rank, group=self.world_group, peers=peers)
        self.partition_plan, self.layer_costs = plan, costs
        if modes is not None:  # recompute="auto": the modes decided with the split, built as the layers are
            ds_engine.set_layer_specs(self, with_selective_recompute(ds_engine.layer_specs(self), modes, 0))
            self._ext_layer_recompute = modes
        if self.global_rank == 0 and plan is not None:
            log.info("ds_pipe_ext partition\n%s", plan.to_table())
            print(plan.to_table(), flush=True)
        self._take_parts(parts)

    @property
    def layer_recompute(self) -> list[str] | None:
        """A recompute mode per layer (given, or what "auto" chose with the split); None without."""
        modes = self._ext_layer_recompute
        return list(modes) if isinstance(modes, list) else None

    @property
    def schedule_name(self) -> str:
        """The schedule the engine will run (the partitioner's memory rule follows it)."""
        return self._ext_settings.schedule

    def _build(self) -> None:
        """DeepSpeed's build of this rank's layers, on the rank's GPU where it moves them next: the stage's
        weights are initialised there, not on the host and copied (``device.build_device``)."""
        with build_device(self._ext_zero_stage):
            super()._build()

    def _take_parts(self, parts: list[int]) -> None:
        """Adopt the boundaries and build only this rank's stage."""
        self.parts = parts
        stage_id = ds_engine.coordinates(self).stage
        ds_engine.set_local_layers(self, parts[stage_id], parts[stage_id + 1])

    def compute_layer_costs(self, source: str = "profiled") -> list:
        """LayerCost per layer from a source (profiling runs here, on the calling rank).

        Under TP, "profiled" must run on all of ``compat.engine.profiling_peers`` at once.
        """
        specs = ds_engine.layer_specs(self)
        frozen = frozen_flags(specs)
        costs = self._source_costs(source, specs)
        if len(costs) != len(specs):
            raise PartitionError(
                f"the cost model describes {len(costs)} layers but the pipeline has {len(specs)}: "
                f"its layer_costs must return one LayerCost per layer (or use partition_method 'profiled')"
            )
        costs = freeze_costs(costs, frozen, measured=source == "profiled") if any(frozen) else costs
        if isinstance(self._ext_layer_recompute, list):  # profiled layers are built as they will run
            costs = with_layer_recompute(costs, self._ext_layer_recompute, selective_built=source == "profiled")
        # model states as DeepSpeed allocates them for this run's ZeRO stage and data-parallel degree, at the
        # costs' element size (16 bits: with fp32 masters)
        element = DTYPE_BYTES[self._costs_dtype(source)]
        return layer_states_by_rule(costs, stage=self._ext_zero_stage, dp=ds_engine.data_parallel_degree(self),
                                    element_bytes=element, ep=self._ext_expert_parallel,
                                    tp=ds_engine.tensor_parallel_degree(self))

    def _source_costs(self, source: str, specs: list) -> list:
        inputs, labels = self._ext_profile_batch
        if source == "analytic":
            return self._analytic_costs(inputs)
        device = rank_device()
        settings = self._ext_settings.profile
        if len(ds_engine.profiling_peers(self)) > 1:
            # a cache hit on one TP rank but not another would leave the other waiting in a collective
            settings = settings.model_copy(update={"cache_dir": None})
        dtype = TORCH_DTYPES[self._ext_dtype]  # the engine's precision: its kernels, its saved bytes
        # each copy built from the seed its stage builds it from (DeepSpeed's seed_layers)
        seeds = dict(layer_seeds=deepspeed_layer_seeds(self.base_seed, len(specs)), seed_fn=self.seed_fn) \
            if self.seed_layers else {}
        costs = profile_layers(specs, inputs, labels=labels, loss_fn=self.loss_fn, settings=settings, device=device,
                               dtype=dtype, key_fields=self._ext_cost_key, **seeds)
        if self._ext_layer_recompute == "auto":  # what the layers that can replay their attention core keep then
            costs = with_measured_selective(costs, specs, lambda sel: profile_layers(
                sel, inputs, labels=labels, loss_fn=self.loss_fn, settings=settings, device=device,
                dtype=dtype, key_fields=self._ext_cost_key, **seeds))
        return costs

    def _analytic_costs(self, inputs) -> list:
        from ..costs.hardware import get_device

        opts = self._ext_settings.analytic
        dtype, cache_dir = self._costs_dtype("analytic"), self._ext_settings.profile.cache_dir
        tp = ds_engine.tensor_parallel_degree(self)  # a TP shard; SP is the cost model's to know
        device = get_device(opts.device or rank_device().type, cache_dir=cache_dir)
        if opts.calibrate:  # fit the roofline's efficiencies to a few layers profiled here
            device = self._ext_cost_model.calibrate(inputs, tp=tp, device=device, dtype=dtype, cache_dir=cache_dir)
        log.info("ds_pipe_ext analytic costs: %s spec, %s, attention as the model runs it there", device.name, dtype)
        return self._ext_cost_model.layer_costs(inputs, tp=tp, device=device, dtype=dtype)

    def _costs_dtype(self, source: str) -> str:
        """The precision of the costs: the engine's, unless ``pipeline.analytic.dtype`` names another."""
        return (self._ext_settings.analytic.dtype or self._ext_dtype) if source == "analytic" else self._ext_dtype

    def _peak_rule(self, spec) -> PipelinePeakRule:
        """The memory cap's rule: each stage's peak over the step, for this run's ZeRO settings, data-parallel
        degree and the costs' element size."""
        element = DTYPE_BYTES[self._costs_dtype(spec.cost_source)]
        return PipelinePeakRule(self._ext_zero, ds_engine.data_parallel_degree(self), element,
                                ep=self._ext_expert_parallel)

    def _decide(self, spec, arg: str, method: str) -> tuple[list[int], PartitionPlan | None, list | None,
                                                            list[str] | None]:
        """(parts, the plan, the layer costs it was made from, the recompute modes "auto" chose)."""
        settings = self._ext_settings
        bandwidth = settings.link_bandwidth
        cache: dict = {}

        def costs(source: str):
            if "costs" not in cache:
                cache["costs"] = self.compute_layer_costs(source)
                if settings.refine_from:
                    from ..instrument.refine import refine_costs

                    cache["costs"] = refine_costs(cache["costs"], settings.refine_from)
            return cache["costs"]

        step_model = StepModel.load(settings.step_model) if settings.step_model and spec.needs_costs else None
        request = PartitionRequest(
            num_stages=self.num_stages,
            num_layers=len(ds_engine.layer_specs(self)),
            costs=costs,
            micro_batches=self._ext_micro_batches,
            memory_cap_gib=settings.memory_cap_gib,
            link_bandwidth=bandwidth,
            recompute=self._ext_recompute,
            arg=arg,
            schedule=self.schedule_name,
            step_model=step_model,
            peak_rule=self._peak_rule(spec),
        )

        def plan_of(parts: list[int], layer_costs: list) -> PartitionPlan:
            return build_plan(method, parts, layer_costs, micro_batches=self._ext_micro_batches,
                              link_bandwidth=bandwidth, recompute=self._ext_recompute, schedule=self.schedule_name,
                              step_model=step_model)

        if self._ext_layer_recompute == "auto":
            # a layer that cannot replay its attention core alone (a Hugging Face layer) is offered none or full
            offered = [c if supports_selective(layer) else replace(c, selective_kept_bytes=None)
                       for c, layer in zip(costs(spec.cost_source), ds_engine.layer_specs(self))]
            joint = partition_jointly(offered, self.num_stages, memory_cap_gib=settings.memory_cap_gib,
                                      micro_batches=self._ext_micro_batches, schedule=self.schedule_name,
                                      peak_rule=request.peak_rule)
            ran = with_layer_recompute(cache["costs"], joint.modes, selective_built=False)
            plan = plan_of(joint.parts, ran)
            # the method's own split without recompute, where it fits and the step model predicts it shorter
            # (the joint choice minimises the slowest stage; the method's split, the predicted step)
            try:
                parts = [int(b) for b in spec.solve(request)]
            except InfeasibleMemoryCap:
                return joint.parts, plan, ran, joint.modes
            alone = plan_of(parts, cache["costs"])
            if alone.predicted_step_ms < plan.predicted_step_ms:
                return parts, alone, cache["costs"], ["none"] * len(cache["costs"])
            return joint.parts, plan, ran, joint.modes
        parts = [int(b) for b in spec.solve(request)]
        if "costs" not in cache:
            return parts, None, None, None
        return parts, plan_of(parts, cache["costs"]), cache["costs"], None


class DualPipeVPipelineModule(DualPipeVModule, PipelineModule):
    """DeepSpeed's ``DualPipeVModule`` with ds_pipe_ext's partition methods.

    ``DualPipeVModule._partition_layers`` doubles ``num_stages`` and hands the cut to the
    next class in line, this package's ``PipelineModule``, so ``profiled`` and ``analytic``
    cut the 2p chunks; under this schedule they balance each rank's pair of chunks (r and
    2p - 1 - r, ``partition.pairs``).  ``deepspeed.initialize`` runs it with DeepSpeed's
    ``DualPipeVEngine`` (it needs at least 2p micro-batches).
    """

    @property
    def schedule_name(self) -> str:
        return "dualpipev"
