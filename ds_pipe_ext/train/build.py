"""``build(cfg)``: from a validated ``RunConfig`` to an engine, its data and its sinks.

Read top-down: validate what needs no process group (model, topology), start the
process group, build the layers (megatron's TP layers when tp > 1), the model (a
``PipelineModule`` with a pipeline section, ``SequentialGPT`` without), the engine,
instrumentation, and finally the data stream (after a resume, so it continues where
the checkpoint stopped).  Decisions that only rank 0 can make go through
``decide_and_broadcast``: every rank gets the same result or the same error.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist

from ..adamw import torch_adamw
from ..config_model import ConfigError
from ..device import build_device, select_rank_device, use_tf32
from ..mfu import Throughput
from ..pipe.config import engine_dtype
from ..models import family_of, load_model
from ..layout import Layout, LayoutError
from ..pipe.decide import decide_and_broadcast
from . import checkpoint
from .config import RunConfig
from .data import SyntheticTokens, token_stream
from .grad_norm import clip_by_the_whole_pipeline, global_grad_norm


@dataclass
class Built:
    cfg: RunConfig
    model_cfg: object  # the model family's config (models.registry)
    layout: Layout
    rank: int
    dp_rank: int
    model: torch.nn.Module
    engine: object
    parts: list[int] | None  # the pipeline's boundaries (None without a pipeline)
    start_step: int = 0
    data: object = None
    sink: object = None
    recorder: object = None  # data-parallel runs with instrumentation: instrument.data_parallel
    grad_norms: list[float] = field(default_factory=list)
    device: torch.device = torch.device("cpu")  # where this rank's parameters live
    peak_measure: str = ""  # what "peak memory" means in this run (instrument.memory.reset_process_peak)
    cap_measure: str = ""  # what train.memory_cap_gib is compared with (trainer.rank_peak_bytes)
    throughput: object = None  # mfu.Throughput: samples/s and MFU of a step (its peak on rank 0 only)

    @property
    def expert_parallel(self) -> bool:
        """Whether the model's family runs expert parallelism (its groups and its checkpoints' expert files)."""
        return family_of(self.model_cfg).expert_parallel


def run_layout(cfg: RunConfig, model_cfg, world: int) -> Layout:
    """The run's layout, read from its validated ds.json sections by ``Layout.from_ds_config`` (pipeline
    stages "auto" resolved: every rank a stage of its TP group), and checked against the model, all
    before any process group."""
    ds = {**cfg.deepspeed, "train": {"recompute": cfg.train.recompute},
          "tensor_parallel": cfg.tensor_parallel.model_dump(), "moe": cfg.moe.model_dump()}
    if cfg.pipelined:
        stages = cfg.pipeline.stages
        ds["pipeline"] = {"stages": max(world // cfg.tensor_parallel.size, 1) if stages == "auto" else stages,
                          "schedule": cfg.pipeline.schedule,
                          "activation_checkpoint_interval": cfg.pipeline.activation_checkpoint_interval}
    try:
        layout = Layout.from_ds_config(ds, world)
        layout.check(model_cfg)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    return layout


def init_process_group() -> None:
    import deepspeed

    from ..compat.cpu_shims import skip_deepspeed_shm_op, steady_host_allocator

    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    select_rank_device()  # cuda:LOCAL_RANK before NCCL starts: every rank on its own GPU
    steady_host_allocator()  # CPU only: a step's page faults must not depend on what ran before it
    skip_deepspeed_shm_op()  # CPU only: no C++ JIT build (and no stale build locks) at start-up
    deepspeed.init_distributed()


def build_layers(cfg: RunConfig, model_cfg, layout: Layout):
    """(layer specs, loss, layer implementation, DeepSpeed topology or None), from the model's family."""
    family = family_of(model_cfg)
    topology = None
    if layout.tp > 1:
        from ..parallel import topology as topo

        topology = topo.initialize(layout, dist.get_world_size())  # megatron's groups, laid out as DeepSpeed's
    impl = family.tensor_parallel(layout.tp, layout.sp)
    experts = {"ep": layout.ep} if family.expert_parallel else {}
    specs = family.layer_specs(model_cfg, impl, selective_recompute=cfg.train.recompute == "selective", **experts)
    if cfg.train.frozen_layers:
        from ..pipe.freeze import freeze_layers, parse_layer_set

        try:
            specs = freeze_layers(specs, parse_layer_set(cfg.train.frozen_layers, len(specs)))
        except ValueError as e:  # the same on every rank: a clean exit, no hang
            raise ConfigError(f"train.frozen_layers: {e}") from None
    return specs, family.loss_fn(model_cfg, impl), impl, topology


def build_pipeline(cfg: RunConfig, model_cfg, layout: Layout, specs, loss_fn, impl, topology):
    from ..pipe.module import DualPipeVPipelineModule, PipelineModule

    profile_batch = next(SyntheticTokens(model_cfg.vocab_size, cfg.micro_batch, model_cfg.seq_len, seed=0))
    # DeepSpeed runs a DualPipeVModule with its DualPipeVEngine
    module_cls = DualPipeVPipelineModule if cfg.pipeline.schedule == "dualpipev" else PipelineModule
    cost_model = family_of(model_cfg).cost_model(model_cfg, impl)
    if layout.ep > 1:  # the analytic costs of a rank's E / ep experts and their all-to-all
        cost_model = replace(cost_model, expert_parallel=layout.ep)
    # profiled as the run will run the layers: compiled where train.compile compiles them
    settings = cfg.pipeline.model_copy(update={"profile": cfg.pipeline.profile.model_copy(
        update={"compile": cfg.train.compile})})
    return module_cls(
        specs, num_stages=None if topology is not None else layout.pp, topology=topology, loss_fn=loss_fn,
        settings=settings, profile_batch=profile_batch, micro_batches=cfg.grad_accum,
        cost_key={"model": model_cfg.to_dict()}, cost_model=cost_model,
        zero_stage=layout.zero, zero_optimization=cfg.deepspeed.get("zero_optimization"), expert_parallel=layout.ep,
        dtype=engine_dtype(cfg.deepspeed),  # profiled in the precision the engine trains in
        recompute=cfg.train.recompute if isinstance(cfg.train.recompute, list) or cfg.train.recompute == "auto" else None,
        seed_layers=True,  # layer i starts from seed + i: the same weights under any partition
        base_seed=cfg.train.seed,
    )


def build_data_parallel(cfg: RunConfig, model_cfg, specs, loss_fn):
    return family_of(model_cfg).sequential(specs, loss_fn, base_seed=cfg.train.seed,
                                           recompute=cfg.train.recompute == "full")


def load_full_state(model: torch.nn.Module, path: str, *, tp: int, pipelined: bool) -> None:
    """Copy a SequentialGPT state dict ("layers.<i>.…") into this rank's model, TP-sliced."""
    first = next(iter(model.parameters()), None)
    full = torch.load(path, map_location=first.device if first is not None else "cpu", weights_only=True)
    if pipelined:  # a PipelineModule names its layers "<i>.…"
        full = {k.removeprefix("layers."): v for k, v in full.items()}
    from ..models.moe import global_expert_names

    experts = global_expert_names(model)  # EP: this rank's experts are a slice of the model's
    full = {k: full[experts.get(k, k)] for k in model.state_dict() if experts.get(k, k) in full}
    missing = [k for k in model.state_dict() if k not in full and not k.endswith("_extra_state")]
    if missing:
        raise ConfigError(f"--init-from {path}: no weights for {missing[:3]}...; it must come from the same model")
    if tp > 1:  # by this rank's names: an expert under EP is named by its local index
        from ..models.tensor_parallel import shard_like

        full = shard_like(full, model)
    model.load_state_dict({k: full.get(k, v) for k, v in model.state_dict().items()})


def make_adamw(params, *, lr: float, offload: bool = False):
    """AdamW when ds.json names no optimizer: DeepSpeed's CPU Adam where ZeRO-Offload keeps the optimizer's
    states in CPU memory (DeepSpeed refuses any other client optimizer there; its op is compiled on first
    use, about a minute); else torch's, fused on CUDA (``adamw.torch_adamw``, which the profiler times too)."""
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=lr, adamw_mode=True)
    return torch_adamw(params, lr=lr, device_type="cuda" if torch.cuda.is_available() else "cpu")


def optimizer_groups(model: torch.nn.Module) -> list:
    """The trained parameters as one group, or, with DeepSpeed MoE layers, split into DeepSpeed's MoE groups
    (expert parameters reduce over their expert-data-parallel group; ZeRO and BF16_Optimizer need this)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not any(getattr(p, "allreduce", True) is False for p in params):  # DeepSpeed's mark on expert params
        return params
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "dense"})


def compile_layers(model: torch.nn.Module, *, pipelined: bool) -> int:
    """``torch.compile`` each of this rank's layers in place (``nn.Module.compile``: parameters and state-dict
    keys stay as they are, so a checkpoint loads compiled or not); returns how many.  Layer by layer, as
    torchtitan compiles its blocks: a pipeline stage's boundaries stay eager code DeepSpeed drives."""
    from ..compat.engine import local_layers

    layers = [layer for _, layer in local_layers(model)] if pipelined else list(model.layers)
    for layer in layers:
        layer.compile()
    return len(layers)


def build_engine(cfg: RunConfig, model: torch.nn.Module, layout: Layout, *, boundary_grads: int = 1):
    """``boundary_grads``: the tensors a stage boundary carries that need a gradient (``ModelFamily.boundary_grads``).
    DeepSpeed's pipeline splits only the first over TP and asserts the rest need none, so with more its split of
    the boundary is turned off (each TP rank sends the whole tensors)."""
    import deepspeed

    ds = cfg.deepspeed_config()
    if cfg.pipelined and layout.tp > 1 and boundary_grads > 1:
        ds["pipeline"].update(pipe_partitioned=False, grad_partitioned=False)
    optimizer = None
    if "optimizer" not in ds:
        optimizer = make_adamw(optimizer_groups(model), lr=cfg.train.lr, offload=layout.offload)
    mpu = None
    if layout.tp > 1 and not cfg.pipelined:  # data-parallel engine: reduce over the DP group only
        from ..compat.mpu import MegatronMPU

        mpu = MegatronMPU()
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds, mpu=mpu,
                                      model_parameters=None if optimizer else model.parameters())
    return engine


def configure_pipeline_engine(engine, settings) -> None:
    """The ``"pipeline"`` section's runtime choices: the schedule the engine runs and an emulated link."""
    from ..compat.engine import set_train_schedule
    from ..pipe.schedules import TRAIN_SCHEDULES

    if settings.schedule == "gpipe":  # 1F1B: DeepSpeed's own TrainSchedule; DualPipeV: its own engine
        set_train_schedule(engine, TRAIN_SCHEDULES[settings.schedule], losses_per_micro_batch=True)
    link = settings.link_emulation
    if link is not None:
        from ..compat.link_emulator import emulate_links

        emulate_links(link.latency_ms / 1e3, link.bandwidth_gbs * 1e9 if link.bandwidth_gbs else None)


def prediction_costs(built: Built) -> list:
    """Layer costs for the instrumentation's prediction: the partition's, else profiled now (TP group together)."""
    from ..compat.engine import profiling_peers

    model = built.model
    if model.layer_costs is not None:
        return model.layer_costs
    return decide_and_broadcast(lambda: model.compute_layer_costs("profiled"), what="profiling for the prediction",
                                peers=profiling_peers(model))


def start_instrumentation(built: Built, overheads: dict | None):
    """Rank 0 writes what the partition predicts; every rank records its stage."""
    from ..instrument.hooks import instrument_engine
    from ..instrument.rundir import Predicted, RunDir, host_record
    from ..instrument.sink import RunSink

    settings, model = built.cfg.pipeline, built.model
    costs = prediction_costs(built)
    if built.rank == 0:
        RunDir(settings.instrument.run_dir).write_predicted(Predicted(
            method=settings.partition_method, parts=list(model.parts), micro_batches=built.cfg.grad_accum,
            layer_costs=costs, recompute=settings.activation_checkpoint_interval > 0,
            layer_recompute=model.layer_recompute, memory_cap_gib=settings.memory_cap_gib,
            link_bandwidth=settings.link_bandwidth, refined_from=settings.refine_from, overheads=overheads,
            layout=built.layout.to_dict(), throughput=asdict(built.throughput),
            host=host_record(built.device.type)))
    sink = RunSink(settings.instrument.run_dir, built.rank, every=settings.instrument.every,
                   monitor=getattr(built.engine, "monitor", None))
    instrument_engine(built.engine, sink.emit, peak_step=settings.instrument.peak_step,
                      per_layer=settings.instrument.per_layer)
    return sink


def start_data_parallel_instrumentation(built: Built):
    """Every rank records its phases and memory into the run directory (no partition to predict)."""
    from ..instrument.data_parallel import DataParallelRecorder
    from ..instrument.sink import RunSink

    settings = built.cfg.instrument
    sink = RunSink(settings.run_dir, built.rank, every=settings.every, monitor=getattr(built.engine, "monitor", None))
    recorder = DataParallelRecorder(built.engine, sink.emit, rank=built.rank, micro_batches=built.cfg.grad_accum,
                                    peak_step=settings.peak_step)
    return sink, recorder


def refine_overheads(cfg: RunConfig) -> dict | None:
    """What the refine_from run measured besides layer compute: read on rank 0, the same answer (or error) everywhere."""
    if not (cfg.pipelined and cfg.pipeline.refine_from):
        return None
    from ..instrument.refine import load_run, measured_overheads

    return decide_and_broadcast(lambda: measured_overheads(load_run(cfg.pipeline.refine_from)),
                                what=f"pipeline.refine_from = {cfg.pipeline.refine_from!r}")


def build_model(cfg: RunConfig, model_cfg, layout: Layout) -> torch.nn.Module:
    torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
    specs, loss_fn, impl, topology = build_layers(cfg, model_cfg, layout)
    if cfg.pipelined:  # its stage's layers built on the rank's GPU (PipelineModule._build)
        model = build_pipeline(cfg, model_cfg, layout, specs, loss_fn, impl, topology)
    else:
        with build_device(layout.zero, engine_dtype(cfg.deepspeed)):
            model = build_data_parallel(cfg, model_cfg, specs, loss_fn)
    if cfg.options.init_from:
        load_full_state(model, cfg.options.init_from, tp=layout.tp, pipelined=cfg.pipelined)
    return model


def build(cfg: RunConfig) -> Built:
    if torch.cuda.is_available():  # before anything is profiled; a CPU's matmuls are left as they are
        use_tf32(cfg.train.tf32)
    model_cfg = load_model(cfg.train.model)
    layout = run_layout(cfg, model_cfg, int(os.environ.get("WORLD_SIZE", "1")))  # before any process group
    init_process_group()
    rank = dist.get_rank()
    if rank == 0:
        print(f"ds_pipe_ext: process group up, {layout.world_size} ranks = pp {layout.pp} x tp {layout.tp} x dp {layout.dp}"
              + (" (sequence parallel)" if layout.sp else ""), flush=True)
    overheads = refine_overheads(cfg)
    manifest = None
    if cfg.options.load:  # a checkpoint that cannot be resumed is refused before any model is built
        manifest = checkpoint.check(cfg.options.load, vocabulary=checkpoint.vocabulary_of(model_cfg),
                                    trust=cfg.options.trust_checkpoint)
    model = build_model(cfg, model_cfg, layout)
    family = family_of(model_cfg)
    if family.expert_parallel:  # every rank, stages without MoE layers too (a hang otherwise)
        from ..compat.engine import ensure_expert_groups

        ensure_expert_groups(layout.ep, layout.pp)
    engine = build_engine(cfg, model, layout, boundary_grads=family.boundary_grads)
    if layout.ep > 1:
        from ..models.moe import check_expert_groups

        check_expert_groups(model)
    clip_norms: list[float] = []  # the norms before the clip, where ours clips (a pipeline in fp32)
    if cfg.pipelined:
        configure_pipeline_engine(engine, cfg.pipeline)
        clip_by_the_whole_pipeline(engine, model, layout, clip_norms, dtype=engine_dtype(cfg.deepspeed))
    if cfg.train.compile:
        compiled = compile_layers(model, pipelined=cfg.pipelined)
        if rank == 0:
            print(f"ds_pipe_ext: train.compile: {compiled} layers compiled in place (the first step compiles them)",
                  flush=True)
    parts = [int(b) for b in model.parts] if cfg.pipelined else None
    from ..compat.engine import parallel_ranks

    built = Built(cfg, model_cfg, layout, rank, parallel_ranks(model, layout)[0],
                  model, engine, parts)
    first = next(iter(model.parameters()), None)
    if first is not None:  # where the engine put this rank's parameters
        built.device = first.device
    built.throughput = Throughput.of(model_cfg, samples_per_step=cfg.micro_batch * cfg.grad_accum * layout.dp,
                                     world_size=layout.world_size, device_type=built.device.type,
                                     dtype=engine_dtype(cfg.deepspeed), with_peak=rank == 0)
    if cfg.pipelined and cfg.pipeline.instrument.enabled:
        built.sink = start_instrumentation(built, overheads)
    elif not cfg.pipelined and cfg.instrument.enabled:
        built.sink, built.recorder = start_data_parallel_instrumentation(built)
    if cfg.options.load:
        built.start_step = int(checkpoint.load(
            engine, cfg.options.load, manifest, layout=layout, parts=parts, trust=cfg.options.trust_checkpoint,
            method=cfg.pipeline.partition_method if cfg.pipelined else None)["step"])
    if cfg.zero_stage == 0:  # under ZeRO the gradients are partitioned (and freed) before the inner step
        from ..compat.optimizer import unwrap_optimizer

        # the norm before clipping: the one our pipeline clip measured this step, else measured here
        def record_norm(*_):
            built.grad_norms.append(clip_norms.pop() if clip_norms else global_grad_norm(model, layout))

        unwrap_optimizer(engine.optimizer).register_step_pre_hook(record_norm)
    from ..instrument.memory import reset_process_peak

    built.peak_measure = reset_process_peak(built.device)
    if cfg.train.memory_cap_gib is not None:
        built.cap_measure = ("allocator peak" if built.device.type == "cuda" else
                             "tensors held: model states at the optimizer step + saved-activation peak")
    built.data = token_stream(cfg.train.data, vocab=model_cfg.vocab_size, micro_batch=cfg.micro_batch,
                              seq=model_cfg.seq_len, seed=cfg.train.seed, dp_rank=built.dp_rank, dp=layout.dp,
                              position=built.start_step * cfg.grad_accum)
    return built
