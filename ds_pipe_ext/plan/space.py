"""The layouts a cluster admits: pp x tp x dp = N, ZeRO, micro-batch, recompute, SP, schedule, and for a
Mixture-of-Experts model the expert-parallel degree (dividing tp x dp and the experts; DeepSpeed's MoE layer
runs ZeRO 0-2, and TP without SP beside it).

What DeepSpeed can run decides the space: ZeRO 0 or 1 under a pipeline (its PipelineEngine refuses
ZeRO-2/3), ZeRO 1, 2 or 3 without one; 1F1B, GPipe and DualPipeV as its engine runs them.  Megatron's
interleaved 1F1B and zero-bubble ZB-H1 are kept as *simulated-only* alternatives (ranked, never
emitted as a ds.json).  TP stays inside a node and divides the attention heads.
"""

from __future__ import annotations

from collections import Counter

from ..arch import as_description
from ..layout import NO_PIPELINE, RECOMPUTE, Layout, LayoutError, expert_degrees

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)


class PlanError(ValueError):
    """A planning request no layout can satisfy; the message names the argument to change."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _schedules(pp: int, m: int, layers: int) -> list[str]:
    """The schedules a pp-stage pipeline over ``layers`` pipeline layers can run with m micro-batches."""
    if pp == 1:
        return [NO_PIPELINE]
    out = ["1f1b", "gpipe"]
    if m >= 2 * pp and layers >= 2 * pp:  # DeepSpeed's DualPipeV: 2 chunks a rank, m >= 2p
        out.append("dualpipev")
    for v in (2, 3):  # Megatron's rule: m a multiple of p; every chunk needs a layer
        if m % pp == 0 and layers >= v * pp:
            out.append(f"interleaved:{v}")
    out.append("zb-h1")
    return out


def enumerate_layouts(cfg, gpus: int, *, gpus_per_node: int, global_batch: int,
                      micro_batch_sizes=MICRO_BATCHES) -> tuple[list[Layout], Counter]:
    """Every layout of ``gpus`` GPUs for ``cfg`` at ``global_batch``, and counts of the factorisations
    that are no layout (why: indivisible heads, more stages than layers, a batch dp does not divide)."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise PlanError(f"--gpus {gpus!r}: give a positive number of GPUs")
    if global_batch < 1:
        raise PlanError(f"--global-batch {global_batch}: give a positive number of samples per step")
    layers = cfg.num_pipeline_layers
    desc = as_description(cfg)
    experts = desc.experts
    routed = list(dict.fromkeys(b.experts for b in desc.blocks if b.experts is not None))
    dropped: Counter = Counter()
    out: list[Layout] = []
    for tp in _divisors(gpus):
        if tp > gpus_per_node:
            dropped["indivisible: TP leaves the node"] += 1
            continue
        try:  # the model's TP rules, from the one owner (pp 1: no rule about layers yet)
            Layout(tp=tp, dp=gpus // tp, schedule=NO_PIPELINE).check(cfg, capacity=False)  # per micro-batch below
        except LayoutError as e:
            dropped[f"indivisible: {e}"] += 1
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
            if tp > 1 and routed:  # DeepSpeed splits each expert's capacity slots over the TP ranks
                split = [b for b in mbs if all(e.capacity_slots(b * desc.seq_len) % tp == 0 for e in routed)]
                dropped["refused: an expert's capacity slots that TP does not split"] += len(mbs) - len(split)
                if not split:
                    continue
                mbs = split
            zeros = (0,) if dp == 1 else ((0, 1) if pp > 1 else (1, 2, 3))
            if experts and 3 in zeros:  # DeepSpeed's native MoE refuses ZeRO-3 (AutoEP is its path there)
                dropped["refused: native DeepSpeed MoE is not supported with ZeRO Stage 3"] += 1
                zeros = tuple(z for z in zeros if z != 3)
            eps = expert_degrees(tp * dp, experts)
            for mb in mbs:
                m = global_batch // (mb * dp)
                for schedule in _schedules(pp, m, layers):
                    for zero in zeros:
                        for recompute in RECOMPUTE:
                            for sp in ((False, True) if tp > 1 and not experts else (False,)):
                                for ep in eps:
                                    out.append(Layout(pp=pp, tp=tp, dp=dp, sp=sp, zero=zero, micro_batch=mb,
                                                      micro_batches=m, recompute=recompute, schedule=schedule,
                                                      ep=ep))
    if not out:
        reasons = "; ".join(f"{k} ({v})" for k, v in dropped.items())
        raise PlanError(f"no layout of {gpus} GPUs fits {cfg.name} at global batch {global_batch}: {reasons}. "
                        f"Choose a GPU count whose factors divide the heads ({cfg.heads}) and the global batch, "
                        f"or a global batch that is a multiple of the data-parallel degree")
    return out, dropped


# --only's keys beyond the layout: how a published run was set up (``only_settings``)
ONLY_SETTINGS = {"split": ("analytic", "even", "uniform"), "lp_grads": ("zero", "none"),
                 "grad_accum": ("fp32", "bf16", "fp16"), "zero3_gather": ("prefetch", "synchronized"),
                 "buckets": ("plan", "deepspeed")}


def _only_items(text: str) -> dict[str, str]:
    keys = {"pp", "tp", "dp", "mb", "recompute", "sp", "zero", "schedule", "ep", "runtime", "overlap", *ONLY_SETTINGS}
    spec: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        k, sep, v = item.partition("=")
        if not sep or k.strip() not in keys:
            raise PlanError(f"--only {text!r}: {item!r} is not KEY=VALUE with KEY one of {sorted(keys)}")
        spec[k.strip()] = v.strip()
    return spec


def only_settings(text: str) -> dict[str, str]:
    """``--only``'s run settings: ``split`` (analytic: the split an ``analytic`` run chooses; even: Megatron's, the
    blocks evenly; uniform: DeepSpeed's, the layers evenly by count), ``lp_grads`` (BF16_Optimizer's 16-bit
    gradients zeroed before each backward, as DeepSpeed 0.19 does, or set to None, as its 2022 code did), ``grad_accum`` (ds.json's ``data_types.grad_accum_dtype``) and
    ``zero3_gather`` (prefetch: DeepSpeed 0.19's ZeRO-3; synchronized: 0.3.12-0.4.x's, ``plan.zero3``) and
    ``buckets`` (plan: the ZeRO buckets the emitted ds.json sets; deepspeed: DeepSpeed's own defaults, what a run
    that set none ran)."""
    spec = _only_items(text)
    out = {}
    for key, allowed in ONLY_SETTINGS.items():
        if key in spec:
            if spec[key] not in allowed:
                raise PlanError(f"--only {text!r}: {key}={spec[key]!r}; use one of {', '.join(allowed)}")
            out[key] = spec[key]
    return out


def parse_only(text: str, *, gpus: int, global_batch: int, runtime: str = "deepspeed") -> Layout:
    """``--only "pp=8,tp=8,dp=16,mb=1,recompute=full,sp=on,zero=1,schedule=1f1b,ep=1"``: one given layout.
    Left out: dp from --gpus, mb 1, recompute none, sp off, zero 0 (1 without a pipeline), 1f1b
    (no pipeline at pp 1), ep 1, the runtime ``runtime`` (--runtime's), overlap off.  ``Layout`` checks the
    rest (schedules, ZeRO under a pipeline, EP).  ``only_settings`` reads the run's other keys."""
    spec = _only_items(text)
    try:
        pp, tp = int(spec.get("pp", 1)), int(spec.get("tp", 1))
        dp = int(spec["dp"]) if "dp" in spec else gpus // max(pp * tp, 1)
        mb = int(spec.get("mb", 1))
        zero = int(spec.get("zero", 0 if pp > 1 or dp == 1 else 1))
        ep = int(spec.get("ep", 1))
    except ValueError as e:
        raise PlanError(f"--only {text!r}: {e}") from None
    if pp * tp * dp != gpus:
        raise PlanError(f"--only {text!r}: pp x tp x dp = {pp * tp * dp}, but --gpus is {gpus}")
    if global_batch % (mb * dp):
        raise PlanError(f"--only {text!r}: --global-batch {global_batch} is not a multiple of mb x dp = {mb * dp}")
    sp = spec.get("sp", "off")
    if sp not in ("on", "off"):
        raise PlanError(f"--only {text!r}: sp={sp!r}; use on or off")
    schedule = NO_PIPELINE if pp == 1 else spec.get("schedule", "1f1b")
    overlap = spec.get("overlap", "off")
    if overlap not in ("on", "off"):
        raise PlanError(f"--only {text!r}: overlap={overlap!r}; use on or off")
    try:
        return Layout(pp=pp, tp=tp, dp=dp, sp=sp == "on", zero=zero, micro_batch=mb,
                      micro_batches=global_batch // (mb * dp), recompute=spec.get("recompute", "none"),
                      schedule=schedule, ep=ep, runtime=spec.get("runtime", runtime), overlap_comm=overlap == "on")
    except LayoutError as e:
        raise PlanError(f"--only {text!r}: {e}") from None
