"""`RunConfig`: everything a training run needs, parsed and validated once, before any process group.

ds.json holds DeepSpeed's own sections (DeepSpeed validates those) and three of ours:

    "train":           {"model": "tiny", "steps": 10, "seed": 1234, "lr": 3e-4, "data": null,
                        "save_interval": 0, "keep_last": 2, "recompute": "none", "log": "auto"}
    "tensor_parallel": {"size": 1, "sequence_parallel": false}
    "moe":             {"ep_size": 1}   expert parallelism of DeepSpeed's MoE layers (DeepSpeed's own
                       "expert_parallel" section is AutoEP, for Hugging Face models, and not ours)
    "pipeline":        see ds_pipe_ext/pipe/config.py (absent: plain data parallel, e.g. under ZeRO-3)
    "instrument":      {"enabled": false, "run_dir": "runs/latest", "every": 0}   (data-parallel runs;
                       a pipeline's is "pipeline": {"instrument": ...})

Command-line overrides are written into the same sections before validation, so
they pass the same checks.  The result is frozen: nothing downstream mutates it,
and ``deepspeed_config()`` derives the dict handed to ``deepspeed.initialize``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Literal

from pydantic import Field

from ..config_model import ConfigError, ConfigModel, parse_section
from ..pipe.config import InstrumentSettings, PipelineSettings


class TrainSection(ConfigModel):
    model: str = "tiny"  # a name in model_configs/, a .toml path, or a Hugging Face GPT-2 config.json
    steps: int = Field(10, ge=0)  # 0: build, resume and report only (benches drive the engine themselves)
    seed: int = 1234  # the same initial weights on every rank, and under every partition
    lr: float = Field(3e-4, gt=0)
    data: str | None = None  # a Megatron indexed dataset (PATH.bin + PATH.idx); None: synthetic tokens
    save_interval: int = Field(0, ge=0)  # with --save: every N steps (0: after the last step only)
    keep_last: int = Field(2, ge=1)  # complete checkpoints kept; older ones are deleted
    # activation recomputation: one mode for every layer, or one per pipeline layer (a plan's choice per
    # stage; selective where the layer has an attention core, full through DeepSpeed's own checkpointing),
    # or "auto": each layer's mode chosen with the split to fit pipeline.memory_cap_gib
    recompute: Literal["none", "selective", "full", "auto"] | list[Literal["none", "selective", "full"]] = "none"
    log: Literal["auto", "progress", "json"] = "auto"  # auto: a progress bar on a terminal, JSON lines otherwise
    # per-rank memory cap: after every step each rank compares its peak with it (allocator peak on
    # GPU; on CPU the tensors it held, counted by the instrumentation, which it therefore needs);
    # above it, every rank stops after that step and the run reports "oom" with what it measured
    # (a safe OOM on CPU; `ds-pipe-ext compare` uses it)
    memory_cap_gib: float | None = Field(None, gt=0)
    # layers whose parameters do not train, as pipeline layer indices ("1-6", "0,3,5-7"; the embedding
    # is layer 0): no weight gradients, gradients or optimizer states, and the partition follows
    frozen_layers: str | None = None
    # torch.compile each layer in place (nn.Module.compile: the state-dict keys stay, so checkpoints load
    # either way); the first step compiles, and is left out of the step timings as every first step is.
    # Off by default: on a CPU, inductor's C++ builds cost more than they save on these models
    compile: bool = False
    # fp32 matmuls and convolutions on CUDA run on TF32 tensor cores (torch's default is CUDA cores; an H200
    # ran a GPT-2 medium fp32 block at 46 TFLOP/s there, against 494 TF32 on its datasheet): the datasheet
    # specs price fp32 GEMMs at TF32, and MFU takes the fp32 peak by this setting.  No effect on a CPU or in bf16
    tf32: bool = True
    # profile this step (1-based; 0: none) under torch.profiler and write its summary (top kernels, the device's
    # idle time, host syncs, the optimizer step: ``instrument.step_profile``) to step_profile.json in the
    # working directory (rank 0's).  Uninstrumented: no sync is added around the phases
    profile_step: int = Field(0, ge=0)


class TensorParallelSection(ConfigModel):
    size: int = Field(1, ge=1)
    sequence_parallel: bool = False


class MoESection(ConfigModel):
    ep_size: int = Field(1, ge=1)  # ranks of a stage's data-parallel group that split each MoE layer's experts


class RunOptions(ConfigModel):
    """Command-line only: where things are read and written."""

    init_from: str | None = None  # a single-process state dict to start from (parity checks)
    save: str | None = None  # checkpoint directory
    load: str | None = None  # resume from this directory's ``latest`` checkpoint
    trust_checkpoint: bool = False  # unpickle whatever --load's files hold (train/safe_load.py)
    metrics_out: str | None = None  # rank 0 writes a JSON summary here, every rank NAME.rankR.json beside it


class RunConfig(ConfigModel):
    train: TrainSection
    tensor_parallel: TensorParallelSection
    moe: MoESection = MoESection()
    pipeline: PipelineSettings | None  # None: data parallel (no pipeline)
    data_parallel_instrument: InstrumentSettings = InstrumentSettings()  # ds.json's top-level "instrument"
    options: RunOptions
    deepspeed: dict  # DeepSpeed's own sections, for deepspeed.initialize (never mutated)

    @property
    def pipelined(self) -> bool:
        return self.pipeline is not None

    @property
    def micro_batch(self) -> int:
        return int(self.deepspeed.get("train_micro_batch_size_per_gpu", 1))

    @property
    def grad_accum(self) -> int:
        return int(self.deepspeed.get("gradient_accumulation_steps", 1))

    @property
    def instrument(self) -> InstrumentSettings:
        """Where this run's instrumentation is configured: the pipeline's section, or the top-level one."""
        return self.pipeline.instrument if self.pipeline is not None else self.data_parallel_instrument

    @property
    def zero_stage(self) -> int:
        return int(self.deepspeed.get("zero_optimization", {}).get("stage", 0))

    def deepspeed_config(self) -> dict:
        """A fresh dict for ``deepspeed.initialize``: DeepSpeed's sections and the pipeline section."""
        cfg = copy.deepcopy(self.deepspeed)
        if self.pipeline is not None:
            pipe = cfg.setdefault("pipeline", {})
            if self.tensor_parallel.sequence_parallel:
                # DeepSpeed splits each boundary tensor across the TP group and re-gathers it, assuming
                # TP ranks hold the same activation; under SP each holds its own sequence shard.
                pipe.update(pipe_partitioned=False, grad_partitioned=False)
            pipe["activation_checkpoint_interval"] = self.pipeline.activation_checkpoint_interval
        return cfg


def read_ds_json(path: str) -> dict:
    try:
        cfg = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--deepspeed_config {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed_config {path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"--deepspeed_config {path}: expected a JSON object")
    return cfg


def _merge(section, overrides: dict, name: str) -> dict:
    if section is not None and not isinstance(section, dict):
        raise ConfigError(f'"{name}" must be an object (a JSON dict), got {section!r}')
    return {**(section or {}), **{k: v for k, v in overrides.items() if v is not None}}


def build_run_config(ds: dict, *, train: dict | None = None, pipeline: dict | None = None,
                     options: dict | None = None, instrument: dict | None = None) -> RunConfig:
    """Validate ds.json's sections with command-line overrides applied (``None`` values: not given)."""
    ds = copy.deepcopy(ds)
    if isinstance(ds.get("checkpoint"), dict) and ds["checkpoint"].get("load_universal"):
        raise ConfigError("checkpoint.load_universal = true: DeepSpeed's universal checkpoint loader unpickles its "
                          "files with torch.load(weights_only=False), outside any checkpoint engine; remove it: "
                          "--load resumes on another data-parallel size or pipeline split from the full states "
                          "every save writes (docs/CONFIG.md)")
    train_cfg = parse_section(TrainSection, _merge(ds.pop("train", None), train or {}, "train"), "train")
    tp_cfg = parse_section(TensorParallelSection, ds.pop("tensor_parallel", None), "tensor_parallel")
    moe_cfg = parse_section(MoESection, ds.pop("moe", None), "moe")
    instrument_section = ds.pop("instrument", None)
    if instrument_section is not None and "pipeline" in ds:
        raise ConfigError('a pipeline run is instrumented by "pipeline": {"instrument": {...}}; '
                          'move the top-level "instrument" section there')
    pipe_overrides = {k: v for k, v in (pipeline or {}).items() if v is not None}
    if instrument and "pipeline" in ds:
        pipe_overrides["instrument"] = {**(ds["pipeline"].get("instrument") or {}
                                           if isinstance(ds["pipeline"], dict) else {}), **instrument}
    if pipe_overrides and "pipeline" not in ds:
        raise ConfigError(f"{sorted(pipe_overrides)} set pipeline options, but this ds.json has no \"pipeline\" "
                          f"section (it trains data parallel); add one to train a pipeline")
    pipe_cfg = None
    if "pipeline" in ds:
        merged = _merge(ds.get("pipeline"), pipe_overrides, "pipeline")
        if train_cfg.recompute == "auto":
            from ..partition import PartitionError
            from ..pipe.recompute import check_auto_recompute

            settings = parse_section(PipelineSettings, merged, "pipeline")  # the one record of the section
            try:
                check_auto_recompute(settings.method[0].needs_costs, settings.memory_cap_gib,
                                     settings.activation_checkpoint_interval, settings.schedule)
            except PartitionError as e:
                raise ConfigError(str(e)) from None
        if isinstance(train_cfg.recompute, list) or train_cfg.recompute == "auto":
            if merged.get("activation_checkpoint_interval", 0):
                raise ConfigError("train.recompute gives a mode per layer and pipeline.activation_checkpoint_interval "
                                  "checkpoints every run of layers: keep one (remove the interval, or make "
                                  "train.recompute one mode)")
            if "activation_checkpointing" in ds:
                raise ConfigError("train.recompute gives a mode per layer, recomputed by DeepSpeed's non-reentrant "
                                  "checkpoint, and DeepSpeed's activation_checkpointing section configures its "
                                  "reentrant one (partition_activations, cpu_checkpointing): keep one")
        if train_cfg.recompute == "full":
            if merged.get("activation_checkpoint_interval", 1) not in (0, 1):
                raise ConfigError('train.recompute = "full" recomputes every layer: remove '
                                  'pipeline.activation_checkpoint_interval or set it to 1')
            merged["activation_checkpoint_interval"] = 1
        pipe_cfg = parse_section(PipelineSettings, merged, "pipeline")
        ds["pipeline"] = merged
    if (isinstance(train_cfg.recompute, list) or train_cfg.recompute == "auto") and pipe_cfg is None:
        raise ConfigError("train.recompute gives a mode per pipeline layer, but this ds.json has no \"pipeline\" "
                          "section (it trains data parallel): give one mode, or add a pipeline")
    modes = train_cfg.recompute if isinstance(train_cfg.recompute, list) else [train_cfg.recompute]
    if pipe_cfg is not None and pipe_cfg.instrument.per_layer and (
            any(m != "none" for m in modes) or pipe_cfg.activation_checkpoint_interval):
        raise ConfigError("pipeline.instrument.per_layer times each layer by module hooks, and a recomputed layer "
                          "runs its forward again in the backward, which they would count as a second forward: "
                          "turn per_layer off, or train without recompute")
    instrumented = (pipe_cfg.instrument.enabled if pipe_cfg is not None
                    else bool({**(instrument_section or {}), **(instrument or {})}.get("enabled")))
    if train_cfg.memory_cap_gib is not None and not instrumented:
        raise ConfigError("train.memory_cap_gib counts the tensors each rank holds, which the instrumentation "
                          "records: turn it on (train.py --instrument RUN_DIR)")
    if tp_cfg.sequence_parallel and tp_cfg.size == 1:
        raise ConfigError("tensor_parallel.sequence_parallel = true needs tensor_parallel.size > 1")
    dp_instrument = _merge(instrument_section, (instrument or {}) if pipe_cfg is None else {}, "instrument")
    if (dp_instrument or {}).get("per_layer"):
        raise ConfigError('instrument.per_layer times the layers of a pipeline stage; a data-parallel run records '
                          'its phases: remove it, or add a "pipeline" section')
    return RunConfig(train=train_cfg, tensor_parallel=tp_cfg, moe=moe_cfg, pipeline=pipe_cfg,
                     data_parallel_instrument=parse_section(InstrumentSettings, dp_instrument, "instrument"),
                     options=parse_section(RunOptions, options or {}, "options"), deepspeed=ds)
