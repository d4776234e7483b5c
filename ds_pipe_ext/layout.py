"""One layout of a training run: how the model is split over ranks and how a step runs.

``Layout`` is the one record of a layout (torchtitan's ``ParallelDims`` is the example): the
topology, the planner, ``compare``, ``sweep``, the at-scale prediction and checkpoints all read
it.  It validates itself when built, before any process group exists; ``check(model)`` owns every
rule that depends on the model (what tensor parallelism must divide, how many layers the
pipeline needs).  It reads from and writes to ds.json (``from_ds_config`` / ``ds_config``, the one
writer of the sections a layout decides) and prints as Megatron-LM arguments.

    pp x tp x dp ranks        pipeline stages x tensor-parallel shards x data-parallel replicas
    sp                        Megatron's sequence parallelism inside the TP group
    zero                      DeepSpeed's ZeRO stage (Megatron's distributed optimizer is ZeRO-1)
    micro_batch, micro_batches  samples per micro-batch; micro-batches per step and DP rank
    recompute                 none | selective (attention core) | full (every layer's forward)
    schedule                  a pipeline schedule name (``simulate.schedules.parse_schedule``), or
                              "none": no pipeline engine (data parallel; pp is 1).  Left out: 1f1b
                              with pp > 1, none with pp 1 (a one-stage pipeline is asked for by name)
    ep                        expert-parallel degree: divides tp x dp and the experts (a Mixture-of-Experts
                              model, DeepSpeed's native MoE layer: no ZeRO-3, no SP; an EP group is ep
                              consecutive ranks of a stage, TP ranks first: ``expert_dp`` below)
    offload                   ZeRO's optimizer states in CPU memory (ZeRO-Offload, stage >= 1), and under
                              ZeRO-3 its parameters too
    overlap_comm              gradient reduction overlapped with the backward (DeepSpeed's
                              ``overlap_comm``, Megatron's ``--overlap-grad-reduce``)
    runtime                   deepspeed (its engines and rules) | megatron (Megatron-LM's runtime)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from .arch import as_description
from .simulate.schedules import RUNTIMES, ScheduleSpec, parse_schedule

RECOMPUTE = ("none", "selective", "full")
NO_PIPELINE = "none"

# DeepSpeed's memory-relevant ZeRO settings, written into every ZeRO config so that the cost model
# predicts what DeepSpeed really allocates.  On a CPU: buckets far below DeepSpeed's defaults (5e8
# elements, sized for GPUs) keep the buffers small beside a small model, and persistence threshold 0,
# since DeepSpeed's default (1e5 elements) would keep every parameter of a small model whole on every
# rank under ZeRO-3, which is not ZeRO-3.  ``overlap_comm`` is the layout's own field.
ZERO_SETTINGS = {
    "reduce_bucket_size": 5e6,
    "allgather_bucket_size": 5e6,
    "stage3_prefetch_bucket_size": 5e6,
    "stage3_param_persistence_threshold": 0,
    "contiguous_gradients": True,
}


# DeepSpeed's own defaults for what a plan's ds.json sizes (``zero_optimization``'s reduce bucket, ZeRO-3's prefetch
# bucket, persistence threshold and live parameters): what a run that set none of them ran
DEEPSPEED_ZERO3_DEFAULTS = {"reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7,
                            "stage3_param_persistence_threshold": 1e5, "stage3_max_live_parameters": 1e9}


def zero_settings_for(hidden: int, device: str, *, largest_module: int = 0) -> dict:
    """The ZeRO settings a plan for ``device`` writes: ``ZERO_SETTINGS`` on a CPU; on a GPU, buckets sized to
    the model as transformers' DeepSpeed integration fills its "auto" values (reduce bucket h^2, ZeRO-3's
    prefetch bucket 0.9 h^2 and persistence threshold 10 h) and DeepSpeed's default all-gather bucket.
    CPU-sized buckets on a GPU cluster make every ZeRO-3 collective latency-bound (hundreds of ring steps
    per bucket at hundreds of ranks).  DeepSpeed prefetches nothing while the parameters gathered exceed
    ``stage3_max_live_parameters`` (1e9 elements by default: less than two of GPT-3 175B's MLP matrices), so
    the plan, which prices the prefetch of the next module, lets the largest module (``largest_module``
    elements) and the next one live together."""
    if device == "cpu":
        return dict(ZERO_SETTINGS)
    return {**ZERO_SETTINGS, "reduce_bucket_size": hidden * hidden, "allgather_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
            "stage3_max_live_parameters": max(int(1e9), 2 * largest_module)}


def _overlap_comm(zero_section: dict) -> bool:
    """DeepSpeed's ``overlap_comm`` for a ``zero_optimization`` section: as set, else its default (on
    under ZeRO-3, off below)."""
    value = zero_section.get("overlap_comm")
    return bool(value) if value is not None else int(zero_section.get("stage", 0)) == 3


class LayoutError(ValueError):
    """A layout that cannot run; the message names the setting to change."""


def expert_degrees(ranks: int, experts: int) -> list[int]:
    """The EP degrees a stage of ``ranks`` ranks (tp x dp) admits for ``experts`` experts a block (those
    dividing both, ``check``'s rule); [1] for a dense model."""
    return [d for d in range(1, ranks + 1) if ranks % d == 0 and experts % d == 0] if experts else [1]


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{name} = {value!r}: a positive integer is required")


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    tp: int = 1
    dp: int = 1
    sp: bool = False
    zero: int = 0
    micro_batch: int = 1
    micro_batches: int = 1
    recompute: str = "none"
    schedule: str | None = None  # None: 1f1b with pp > 1, no pipeline with pp 1
    ep: int = 1
    offload: bool = False
    overlap_comm: bool = False
    runtime: str = "deepspeed"

    def __post_init__(self) -> None:
        for name in ("pp", "tp", "dp", "micro_batch", "micro_batches", "ep"):
            _positive(name, getattr(self, name))
        for name in ("sp", "offload", "overlap_comm"):
            if not isinstance(getattr(self, name), bool):
                raise LayoutError(f"{name} = {getattr(self, name)!r}: true or false")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise LayoutError(f"zero = {self.zero!r}: the ZeRO stage is 0, 1, 2 or 3")
        if self.recompute not in RECOMPUTE:
            raise LayoutError(f"recompute = {self.recompute!r}: use one of {', '.join(RECOMPUTE)}")
        if self.runtime not in RUNTIMES:
            raise LayoutError(f"runtime = {self.runtime!r}: use one of {', '.join(RUNTIMES)}")
        if self.sp and self.tp == 1:
            raise LayoutError("sequence parallelism needs tensor parallelism: set tp > 1 or turn sp off")
        if (self.tp * self.dp) % self.ep:
            raise LayoutError(f"ep = {self.ep} does not divide tp x dp = {self.tp * self.dp}: DeepSpeed builds each "
                              f"expert-parallel group from ep consecutive ranks of a stage (its tp x dp ranks, TP "
                              f"fastest); choose ep dividing tp x dp")
        if self.schedule is None:
            object.__setattr__(self, "schedule", "1f1b" if self.pp > 1 else NO_PIPELINE)
        if self.schedule == NO_PIPELINE:
            if self.pp != 1:
                raise LayoutError(f"pp = {self.pp} needs a pipeline schedule (1f1b, gpipe, ...), not 'none'")
        else:
            try:
                spec = parse_schedule(self.schedule)
            except ValueError as e:
                raise LayoutError(f"schedule: {e}; or 'none' for no pipeline") from None
            object.__setattr__(self, "schedule", spec.name)  # one spelling: "interleaved" -> "interleaved:2"
            self._check_schedule(spec)
        if self.pipelined and self.zero > 1 and self.runtime == "deepspeed":
            raise LayoutError(f"DeepSpeed runs ZeRO-0 or 1 under a pipeline, not ZeRO-{self.zero}: use zero <= 1, "
                              f"or no pipeline (schedule 'none')")
        if self.offload and self.zero == 0:
            raise LayoutError("offload moves ZeRO's partitioned states to CPU memory: it needs zero >= 1")

    def _check_schedule(self, spec: ScheduleSpec) -> None:
        p, m = self.pp, self.micro_batches
        if p == 1:
            return
        if spec.kind == "interleaved" and m % p:
            raise LayoutError(f"interleaved 1F1B needs micro-batches a multiple of the stages (Megatron's rule): "
                              f"micro_batches {m}, pp {p}")
        if spec.kind == "dualpipev" and m < 2 * p:
            raise LayoutError(f"DualPipeV needs at least 2 x stages micro-batches (DeepSpeed's rule): "
                              f"micro_batches {m}, pp {p}")

    # -- what follows from the fields --------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.micro_batches * self.dp

    @property
    def deepspeed_zero3(self) -> bool:
        """Whether DeepSpeed's ZeRO-3 runs it: its gathers and prefetch, and its own linear (which keeps the
        input it is handed, where torch's may keep a copy: ``costs.estimate.EstimateRequest.zero3_linear``)."""
        return self.zero == 3 and self.runtime == "deepspeed"

    @property
    def expert_dp(self) -> int:
        """Ranks of a stage holding the same experts (DeepSpeed's expert-data-parallel group, Megatron's expert
        data parallelism at expert TP 1): a stage's tp x dp ranks over ep.  Under TP each TP rank runs its own
        share of every expert's slots (DeepSpeed drops the TP-duplicated tokens), so an expert's gradient sums
        over the TP ranks as over the data-parallel ones."""
        return self.tp * self.dp // self.ep

    @property
    def pipelined(self) -> bool:
        """Whether a pipeline engine runs it (a one-stage pipeline included)."""
        return self.schedule != NO_PIPELINE

    @property
    def schedule_spec(self) -> ScheduleSpec:
        """The schedule's answers (chunks per rank, chunk to rank, micro-batches held); without a
        pipeline, a one-stage 1F1B's (one micro-batch held at a time)."""
        return parse_schedule(self.schedule if self.pipelined else "1f1b")

    @property
    def chunks_per_rank(self) -> int:
        return self.schedule_spec.chunks_per_rank

    @property
    def num_chunks(self) -> int:
        """Model chunks the layers are split into: the partitioner's stages."""
        return self.pp * self.chunks_per_rank

    @property
    def runnable(self) -> bool:
        """DeepSpeed runs it as is (train.py); otherwise a simulated alternative."""
        return not self.pipelined or not self.schedule_spec.simulated_only

    @property
    def name(self) -> str:
        return (f"pp{self.pp}-tp{self.tp}-dp{self.dp}" + (f"-ep{self.ep}" if self.ep > 1 else "")
                + f"-z{self.zero}-mb{self.micro_batch}-{self.recompute}"
                + ("-sp" if self.sp else "") + (f"-{self.schedule}" if self.pp > 1 else "")
                + ("-offload" if self.offload else ""))

    def replace(self, **changes) -> "Layout":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return {**asdict(self), "runnable": self.runnable}

    @classmethod
    def from_dict(cls, data: dict) -> "Layout":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_world(cls, world_size: int, *, pp: int = 1, tp: int = 1, **rest) -> "Layout":
        """The layout of ``world_size`` ranks: data parallelism takes what pp x tp leaves."""
        _positive("pp", pp)
        _positive("tp", tp)
        if world_size % (pp * tp):
            raise LayoutError(f"world size {world_size} is not pipeline ({pp}) x tensor ({tp}) x data parallel: "
                              f"pp * tp must divide the number of processes")
        return cls(pp=pp, tp=tp, dp=world_size // (pp * tp), **rest)

    # -- the model's rules -------------------------------------------------------------------
    def check(self, model, *, capacity: bool = True) -> None:
        """Every rule the model sets: TP divides every block's heads, key/value heads and ffn, the hidden
        and the (padded) vocabulary, and (``capacity``) each expert's capacity slots at this micro-batch; SP
        divides the sequence; every chunk gets a layer.  ``model``: an ``arch.ModelDescription`` or a config that
        describes itself."""
        desc = as_description(model)
        self.check_widths(desc)
        name, t = desc.name, self.tp
        blocks = list(dict.fromkeys(desc.blocks))  # each distinct block once, in order
        experts = [b.experts for b in blocks if b.experts is not None]
        if self.ep > 1 and not experts:
            raise LayoutError(f"ep = {self.ep}: expert parallelism needs a Mixture-of-Experts model, and model "
                              f"{name!r} has no experts; use ep = 1")
        for e in experts:
            if e.count % self.ep:
                raise LayoutError(f"ep = {self.ep} does not divide the {e.count} experts of model {name!r}: each "
                                  f"expert-parallel rank holds experts / ep of them; choose ep dividing {e.count}")
        if experts and self.sp:
            raise LayoutError(f"sp on model {name!r}: DeepSpeed's MoE layer takes the TP ranks to hold the same "
                              f"tokens (it splits their slots among them), which sequence parallelism breaks; "
                              f"turn sp off (TP without SP splits a Mixture-of-Experts model)")
        if experts and t > 1 and self.runtime == "megatron":
            raise LayoutError(f"tp = {t} on model {name!r} with the megatron runtime: Megatron-LM runs a "
                              f"Mixture-of-Experts model's TP with sequence parallelism and its own token "
                              f"dispatcher, which is not modelled; use the deepspeed runtime or tp = 1")
        for e in experts if t > 1 and capacity else ():
            slots = e.capacity_slots(self.micro_batch * desc.seq_len)
            if slots % t:
                raise LayoutError(f"tp = {t} on model {name!r}: capacity_factor {e.capacity_factor} gives {slots} slots "
                                  f"an expert at micro-batch {self.micro_batch}, which DeepSpeed splits over the TP "
                                  f"ranks and tp does not divide; choose a micro-batch or capacity_factor giving a "
                                  f"multiple of {t}, or capacity_factor = 0 (dropless)")
        if experts and self.zero == 3:
            raise LayoutError(f"ZeRO-3 on model {name!r}: DeepSpeed's native MoE layer refuses ZeRO-3 (\"Native "
                              f"DeepSpeed MoE is not supported with ZeRO Stage 3\"; its AutoEP is another path); "
                              f"use ZeRO-1 or 2")
        layers = desc.num_pipeline_layers
        if self.num_chunks > layers:
            what = f"{self.pp} stages" + (f" x {self.chunks_per_rank} chunks" if self.chunks_per_rank > 1 else "")
            raise LayoutError(f"{what} but model {name!r} has only {layers} pipeline layers: use at most "
                              f"{layers // self.chunks_per_rank} stages")

    def check_widths(self, model) -> None:
        """The widths tensor and sequence parallelism split, what a layer built under TP asks whatever else the
        layout says: TP divides every block's heads, key/value heads, ffn and Mamba-2 groups, the hidden and the
        (padded) vocabulary; SP divides the sequence."""
        desc = as_description(model)
        name, t = desc.name, self.tp
        blocks = list(dict.fromkeys(desc.blocks))
        attentions = [b.attention for b in blocks if b.attention is not None]
        widths = [("attention heads", a.heads) for a in attentions]
        widths += [("key/value heads", a.kv_heads) for a in attentions] + [("hidden", desc.hidden)]
        widths += [("ffn hidden", b.mlp.ffn) for b in blocks if b.mlp is not None]
        # Megatron-core's MambaMixer: each rank holds whole groups of heads
        widths += [("Mamba-2 n_groups", b.mamba.groups) for b in blocks if b.mamba is not None]
        for what, n in widths:
            if n % t:
                raise LayoutError(f"tensor parallel degree {t} does not divide the {what} ({n}) of model "
                                  f"{name!r}; choose tp dividing it")
        if desc.vocab % t:
            raise LayoutError(f"tensor parallel degree {t} does not divide the vocabulary ({desc.vocab}) "
                              f"of model {name!r}; pad it as Megatron does: vocab_pad_to = {128 * t}")
        if self.sp and desc.seq_len % t:
            raise LayoutError(f"sequence parallelism splits the sequence ({desc.seq_len}) {t} ways; "
                              f"choose tp dividing seq_len")

    # -- ds.json -----------------------------------------------------------------------------
    @classmethod
    def from_ds_config(cls, ds: dict, world_size: int) -> "Layout":
        """The layout a ds.json runs on ``world_size`` ranks.  An activation checkpoint interval
        without ``train.recompute`` reads as full recompute (every checkpointed layer's forward is
        replayed)."""
        if not isinstance(ds, dict):
            raise LayoutError(f"a ds.json is a JSON object, got {type(ds).__name__}")

        def section(key: str) -> dict:
            value = ds.get(key) or {}
            if not isinstance(value, dict):
                raise LayoutError(f'"{key}" must be an object (a JSON dict), got {value!r}')
            return value

        pipe, tp_section, zero = section("pipeline"), section("tensor_parallel"), section("zero_optimization")
        ep = section("moe").get("ep_size", 1)
        recompute = section("train").get("recompute", "none")
        if isinstance(recompute, list):  # one mode per layer: the layout says the one all share, else none
            recompute = recompute[0] if recompute and len(set(recompute)) == 1 else "none"
        if recompute == "auto":  # decided with the split (the run's summary and report say what)
            recompute = "none"
        if recompute == "none" and pipe.get("activation_checkpoint_interval", 0):
            recompute = "full"
        offload = (zero.get("offload_optimizer") or {}).get("device") == "cpu"
        stages = pipe.get("stages", 1) if "pipeline" in ds else 1
        if stages == "auto":
            raise LayoutError('pipeline.stages = "auto" is resolved from the world size when training; '
                              'give a number of stages')
        return cls.from_world(
            world_size, pp=stages, tp=tp_section.get("size", 1), sp=bool(tp_section.get("sequence_parallel", False)),
            zero=int(zero.get("stage", 0)), micro_batch=int(ds.get("train_micro_batch_size_per_gpu", 1)),
            micro_batches=int(ds.get("gradient_accumulation_steps", 1)), recompute=recompute,
            schedule=pipe.get("schedule", "1f1b") if "pipeline" in ds else NO_PIPELINE,
            offload=offload, overlap_comm=_overlap_comm(zero), ep=ep)

    def zero_section(self, settings: dict | None = None) -> dict:
        """ds.json's ``zero_optimization`` for this layout's stage (offload aside): what the memory rules
        read, for any runtime; ``settings``: the buckets and threshold (``zero_settings_for``), else
        ``ZERO_SETTINGS``."""
        return {"stage": self.zero, **(ZERO_SETTINGS if settings is None else settings), "overlap_comm": self.overlap_comm}

    def ds_config(self, *, train: dict | None = None, pipeline: dict | None = None, zero_settings: dict | None = None,
                  **top) -> dict:
        """The ds.json that runs this layout (the one writer): the sections a layout decides, with
        ``train`` and ``pipeline`` keys of the caller's merged in, ZeRO's buckets from ``zero_settings`` (else
        ``ZERO_SETTINGS``), and other top-level keys as given."""
        if self.runtime != "deepspeed" or not self.runnable:
            raise LayoutError(f"{self.name}: DeepSpeed runs no {self.schedule} schedule ({self.runtime} runtime); "
                              f"write a ds.json for a runnable layout")
        ds: dict = {"train_micro_batch_size_per_gpu": self.micro_batch,
                    "gradient_accumulation_steps": self.micro_batches, **top}
        train = dict(train or {})
        if self.recompute != "none":  # "full" under a pipeline: DeepSpeed's activation_checkpoint_interval 1
            train["recompute"] = self.recompute
        if train:
            ds["train"] = train
        if self.tp > 1:
            ds["tensor_parallel"] = {"size": self.tp, "sequence_parallel": self.sp}
        if self.ep > 1:  # ours: DeepSpeed's own "expert_parallel" section is AutoEP
            ds["moe"] = {"ep_size": self.ep}
        if self.zero:
            ds["zero_optimization"] = self.zero_section(zero_settings)
            if self.offload:  # the optimizer's states at any stage; the parameters too under ZeRO-3
                ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
                if self.zero == 3:
                    ds["zero_optimization"]["offload_param"] = {"device": "cpu"}
        if self.pipelined:
            ds["pipeline"] = {"stages": self.pp, "schedule": self.schedule, **(pipeline or {})}
        elif pipeline:
            raise LayoutError(f"pipeline settings {sorted(pipeline)} for a layout without a pipeline")
        return ds

    # -- Megatron-LM -------------------------------------------------------------------------
    def megatron_args(self) -> list[str]:
        """The same layout as Megatron-LM's ``pretrain_gpt.py`` arguments."""
        args = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp),
                "--micro-batch-size", str(self.micro_batch), "--global-batch-size", str(self.global_batch)]
        if self.sp:
            args.append("--sequence-parallel")
        if self.ep > 1:
            args += ["--expert-model-parallel-size", str(self.ep)]
        if self.pp > 1 and self.schedule_spec.kind == "interleaved":
            args += ["--num-virtual-stages-per-pipeline-rank", str(self.chunks_per_rank)]
        if self.recompute == "selective":
            args += ["--recompute-granularity", "selective"]
        elif self.recompute == "full":
            args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
        if self.zero >= 1:
            args.append("--use-distributed-optimizer")
        if self.overlap_comm:
            args.append("--overlap-grad-reduce")
        return args
