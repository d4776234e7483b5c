"""The layouts a cluster admits: pp x tp x dp = N, ZeRO, micro-batch, recompute, SP, schedule.

What DeepSpeed can run decides the space: ZeRO 0 or 1 under a pipeline (its PipelineEngine refuses
ZeRO-2/3), ZeRO 1, 2 or 3 without one; 1F1B, GPipe and DualPipeV as its engine runs them.  Megatron's
interleaved 1F1B and zero-bubble ZB-H1 are kept as *simulated-only* alternatives (ranked, never
emitted as a ds.json).  TP stays inside a node and divides the attention heads.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

RECOMPUTE = ("none", "selective", "full")
RUNNABLE_SCHEDULES = ("1f1b", "gpipe", "dualpipev")  # DeepSpeed's engines (pipe/schedules.py)
SIMULATED_SCHEDULES = ("interleaved:2", "interleaved:3", "zb-h1")  # ranked, not emitted
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)


class PlanError(ValueError):
    """A planning request no layout can satisfy; the message names the argument to change."""


@dataclass(frozen=True)
class PlanLayout:
    pp: int
    tp: int
    dp: int
    zero: int
    micro_batch: int
    micro_batches: int  # per step and data-parallel rank: gradient accumulation, a pipeline's m
    recompute: str = "none"  # none | selective (attention core, Korthikanti et al.) | full (every layer)
    sp: bool = False
    schedule: str = "1f1b"  # "none" without a pipeline

    @property
    def gpus(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.micro_batches * self.dp

    @property
    def chunks_per_rank(self) -> int:
        if self.schedule.startswith("interleaved:"):
            return int(self.schedule.split(":")[1])
        return 2 if self.schedule == "dualpipev" else 1

    @property
    def runnable(self) -> bool:
        """DeepSpeed runs it as is (train.py); otherwise it is a simulated alternative."""
        return self.pp == 1 or self.schedule in RUNNABLE_SCHEDULES

    @property
    def name(self) -> str:
        return (f"pp{self.pp}-tp{self.tp}-dp{self.dp}-z{self.zero}-mb{self.micro_batch}-{self.recompute}"
                + ("-sp" if self.sp else "") + (f"-{self.schedule}" if self.pp > 1 else ""))

    def to_dict(self) -> dict:
        return {"pp": self.pp, "tp": self.tp, "dp": self.dp, "zero": self.zero, "micro_batch": self.micro_batch,
                "micro_batches": self.micro_batches, "recompute": self.recompute, "sp": self.sp,
                "schedule": self.schedule, "runnable": self.runnable}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _schedules(pp: int, m: int, layers: int) -> list[str]:
    """The schedules a pp-stage pipeline over ``layers`` pipeline layers can run with m micro-batches."""
    if pp == 1:
        return ["none"]
    out = ["1f1b", "gpipe"]
    if m >= 2 * pp and layers >= 2 * pp:  # DeepSpeed's DualPipeV: 2 chunks a rank, m >= 2p
        out.append("dualpipev")
    for v in (2, 3):  # Megatron's rule: m a multiple of p; every chunk needs a layer
        if m % pp == 0 and layers >= v * pp:
            out.append(f"interleaved:{v}")
    out.append("zb-h1")
    return out


def enumerate_layouts(cfg, gpus: int, *, gpus_per_node: int, global_batch: int,
                      micro_batch_sizes=MICRO_BATCHES) -> tuple[list[PlanLayout], Counter]:
    """Every layout of ``gpus`` GPUs for ``cfg`` at ``global_batch``, and counts of the factorisations
    that are no layout (why: indivisible heads, more stages than layers, a batch dp does not divide)."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise PlanError(f"--gpus {gpus!r}: give a positive number of GPUs")
    if global_batch < 1:
        raise PlanError(f"--global-batch {global_batch}: give a positive number of samples per step")
    layers = cfg.num_pipeline_layers
    dropped: Counter = Counter()
    out: list[PlanLayout] = []
    for tp in _divisors(gpus):
        if tp > gpus_per_node or cfg.heads % tp:
            dropped["indivisible: TP leaves the node or does not divide the heads"] += 1
            continue
        if cfg.padded_vocab % tp:  # the embedding and head rows split over TP ranks
            dropped[f"indivisible: TP does not divide the vocabulary ({cfg.padded_vocab}; pad it as Megatron "
                    f"does: vocab_pad_to = 128 x tp in the model config)"] += 1
            continue
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            if pp > layers:
                dropped["indivisible: more stages than layers"] += 1
                continue
            mbs = [b for b in micro_batch_sizes if global_batch % (b * dp) == 0]
            if not mbs:
                dropped["indivisible: dp x micro-batch does not divide the global batch"] += 1
                continue
            zeros = (0,) if dp == 1 else ((0, 1) if pp > 1 else (1, 2, 3))
            for mb in mbs:
                m = global_batch // (mb * dp)
                for schedule in _schedules(pp, m, layers):
                    for zero in zeros:
                        for recompute in RECOMPUTE:
                            for sp in ((False, True) if tp > 1 else (False,)):
                                out.append(PlanLayout(pp, tp, dp, zero, mb, m, recompute, sp, schedule))
    if not out:
        reasons = "; ".join(f"{k} ({v})" for k, v in dropped.items())
        raise PlanError(f"no layout of {gpus} GPUs fits {cfg.name} at global batch {global_batch}: {reasons}. "
                        f"Choose a GPU count whose factors divide the heads ({cfg.heads}) and the global batch, "
                        f"or a global batch that is a multiple of the data-parallel degree")
    return out, dropped


def parse_only(text: str, *, gpus: int, global_batch: int) -> PlanLayout:
    """``--only "pp=8,tp=8,dp=16,mb=1,recompute=full,sp=on,zero=1,schedule=1f1b"``: one given layout.
    Left out: dp from --gpus, mb 1, recompute none, sp off, zero 0 (1 without a pipeline), 1f1b."""
    keys = {"pp", "tp", "dp", "mb", "recompute", "sp", "zero", "schedule"}
    spec: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        k, sep, v = item.partition("=")
        if not sep or k.strip() not in keys:
            raise PlanError(f"--only {text!r}: {item!r} is not KEY=VALUE with KEY one of {sorted(keys)}")
        spec[k.strip()] = v.strip()
    try:
        pp, tp = int(spec.get("pp", 1)), int(spec.get("tp", 1))
        dp = int(spec["dp"]) if "dp" in spec else gpus // max(pp * tp, 1)
        mb = int(spec.get("mb", 1))
        zero = int(spec.get("zero", 0 if pp > 1 or dp == 1 else 1))
    except ValueError as e:
        raise PlanError(f"--only {text!r}: {e}") from None
    if pp * tp * dp != gpus:
        raise PlanError(f"--only {text!r}: pp x tp x dp = {pp * tp * dp}, but --gpus is {gpus}")
    if global_batch % (mb * dp):
        raise PlanError(f"--only {text!r}: --global-batch {global_batch} is not a multiple of mb x dp = {mb * dp}")
    recompute = spec.get("recompute", "none")
    if recompute not in RECOMPUTE:
        raise PlanError(f"--only {text!r}: recompute={recompute!r}; use one of {RECOMPUTE}")
    sp = spec.get("sp", "off")
    if sp not in ("on", "off"):
        raise PlanError(f"--only {text!r}: sp={sp!r}; use on or off")
    schedule = spec.get("schedule", "1f1b" if pp > 1 else "none")
    known = (*RUNNABLE_SCHEDULES, *SIMULATED_SCHEDULES, "none")
    if schedule.startswith("interleaved:") and schedule.split(":")[1].isdigit() and int(schedule.split(":")[1]) >= 2:
        pass
    elif schedule not in known:
        raise PlanError(f"--only {text!r}: schedule={schedule!r}; use one of {known} (interleaved:V for any V >= 2)")
    if pp > 1 and zero > 1:
        raise PlanError(f"--only {text!r}: DeepSpeed runs ZeRO-0 or 1 under a pipeline, not ZeRO-{zero}")
    if pp == 1:
        schedule = "none"
    return PlanLayout(pp, tp, dp, zero, mb, global_batch // (mb * dp), recompute, sp == "on", schedule)
