"""One registry of partition method names.

A method turns a ``PartitionRequest`` into DeepSpeed ``parts``.  DeepSpeed's own
methods (``uniform``, ``parameters``, ``type:REGEX``) are registered as
``deepspeed_builtin`` so the PipelineModule hands them to DeepSpeed unchanged.
An unknown name is a ``PartitionError`` (a ``ValueError``) that lists the valid ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .algorithms import PartitionError
from .split import partition_min_max


@dataclass(kw_only=True)
class PartitionRequest:
    """What a method partitions, named field by field (no positional construction)."""

    num_stages: int
    num_layers: int
    costs: Callable[[str], list]  # source name ("profiled" | "analytic") -> LayerCost list, computed lazily
    micro_batches: int
    memory_cap_gib: float | None = None
    link_bandwidth: float | None = None  # bytes/s
    recompute: bool = False
    arg: str = ""  # the text after "name:" for prefix methods
    schedule: str = "1f1b"  # how many micro-batches each stage holds (``costs.stage.in_flight``)
    step_model: object = None  # simulate.step_model.StepModel: what a step costs beyond the layers (None: nothing)
    peak_rule: object = None  # costs.peak_rule.PipelinePeakRule: the memory cap applies to each stage's peak


@dataclass(frozen=True)
class PartitionMethod:
    name: str  # "profiled", or "parts:" for a prefix method
    solve: Callable[[PartitionRequest], list[int]] | None  # None: DeepSpeed's own
    help: str
    cost_source: str | None = None  # which LayerCost source it partitions ("profiled", "analytic")

    @property
    def needs_costs(self) -> bool:
        return self.cost_source is not None

    @property
    def deepspeed_builtin(self) -> bool:
        return self.solve is None


_REGISTRY: dict[str, PartitionMethod] = {}
# the schedules whose step the branch and bound's lower bound holds for (one chunk a rank, the whole
# backward on the path back); the others split by the min-max of forward + backward
STEP_SEARCH_SCHEDULES = ("1f1b", "gpipe")


def register(name: str, help: str, *, cost_source: str | None = None):
    def deco(fn):
        _REGISTRY[name] = PartitionMethod(name, fn, help, cost_source)
        return fn

    return deco


for _name, _help in [
    ("uniform", "DeepSpeed: the same number of layers per stage"),
    ("parameters", "DeepSpeed: balance parameter counts (its partition_balanced)"),
    ("type:", "DeepSpeed: balance layers whose class name matches a regex, e.g. type:Block"),
]:
    _REGISTRY[_name] = PartitionMethod(_name, None, _help)


def valid_names() -> list[str]:
    return [n + ("REGEX" if n == "type:" else "B0,B1,...,Bp" if n == "parts:" else "") for n in _REGISTRY]


def lookup(method: str) -> tuple[PartitionMethod, str]:
    """The method for a name (case-insensitive, as DeepSpeed), and its argument for prefix methods."""
    if not isinstance(method, str):
        raise PartitionError(f"partition_method must be a string, got {method!r}; valid methods: {valid_names()}")
    key = method.strip()
    lowered = key.lower()
    if lowered in _REGISTRY and not lowered.endswith(":"):
        return _REGISTRY[lowered], ""
    prefix, sep, arg = key.partition(":")
    if sep and prefix.lower() + ":" in _REGISTRY:
        return _REGISTRY[prefix.lower() + ":"], arg
    raise PartitionError(f"unknown partition_method {method!r}; valid methods: {', '.join(valid_names())}")


def _check_parts(parts: list[int], num_stages: int, num_layers: int) -> list[int]:
    if len(parts) != num_stages + 1 or parts[0] != 0 or parts[-1] != num_layers or any(
        b <= a for a, b in zip(parts, parts[1:])
    ):
        raise PartitionError(
            f"parts {parts} are not {num_stages + 1} strictly increasing boundaries from 0 to {num_layers}; "
            f"e.g. parts:{','.join(str(round(i * num_layers / num_stages)) for i in range(num_stages + 1))}"
        )
    return parts


def _min_max(req: PartitionRequest, source: str) -> list[int]:
    if req.schedule == "dualpipev":  # rank r runs chunks r and 2p - 1 - r: balance the pairs
        from .pairs import partition_pairs_min_max

        if req.memory_cap_gib is not None or req.link_bandwidth is not None:
            raise PartitionError("under DualPipeV the split balances each rank's pair of chunks by time only: "
                                 "drop memory_cap_gib and link_bandwidth_gbs (or use the 1f1b or gpipe schedule)")
        return partition_pairs_min_max([c.time_s(recompute=req.recompute) for c in req.costs(source)],
                                       req.num_stages // 2)
    if req.schedule in STEP_SEARCH_SCHEDULES:  # the smallest predicted step, from the min-max split
        from .step_search import partition_min_step

        return partition_min_step(req.costs(source), req.num_stages, micro_batches=req.micro_batches,
                                  model=req.step_model, schedule=req.schedule, recompute=req.recompute,
                                  memory_cap_gib=req.memory_cap_gib, link_bandwidth=req.link_bandwidth,
                                  peak_rule=req.peak_rule).parts
    return partition_min_max(
        req.costs(source),
        req.num_stages,
        memory_cap_gib=req.memory_cap_gib,
        micro_batches=req.micro_batches,
        link_bandwidth=req.link_bandwidth,
        recompute=req.recompute,
        schedule=req.schedule,
        peak_rule=req.peak_rule,
    )


@register("profiled", "ds_pipe_ext: the split of measured per-layer costs (cached profile) with the smallest predicted step",
          cost_source="profiled")
def _profiled(req: PartitionRequest) -> list[int]:
    return _min_max(req, "profiled")


@register("analytic", "ds_pipe_ext: the split of analytic per-layer costs (roofline on a device spec) with the smallest predicted step",
          cost_source="analytic")
def _analytic(req: PartitionRequest) -> list[int]:
    return _min_max(req, "analytic")


@register("parts:", "explicit boundaries, e.g. parts:0,11,14 (benchmarks, reproducing a run)")
def _explicit(req: PartitionRequest) -> list[int]:
    try:
        parts = [int(b) for b in req.arg.split(",")]
    except ValueError:
        raise PartitionError(f"parts:{req.arg} is not a comma-separated list of integers") from None
    return _check_parts(parts, req.num_stages, req.num_layers)


def decide_offline(
    method: str,
    costs: list,
    num_stages: int,
    *,
    micro_batches: int,
    memory_cap_gib: float | None = None,
    link_bandwidth: float | None = None,
    recompute: bool = False,
    schedule: str = "1f1b",
    step_model=None,
    peak_rule=None,
) -> list[int]:
    """The parts any registered method would choose, without a process group (CLI, benches).

    ``costs`` serve whichever source the method asks for.

    DeepSpeed's methods run DeepSpeed's own functions on what its PipelineModule
    would count: trainable parameters per layer (from ``param_bytes`` of fp32
    layers) and layer class names.
    """
    spec, arg = lookup(method)
    if num_stages > len(costs):
        raise PartitionError(f"{num_stages} stages but only {len(costs)} layers: use at most {len(costs)} stages")
    if not spec.deepspeed_builtin:
        request = PartitionRequest(num_stages=num_stages, num_layers=len(costs), costs=lambda source: costs,
                                   micro_batches=micro_batches, memory_cap_gib=memory_cap_gib,
                                   link_bandwidth=link_bandwidth, recompute=recompute, arg=arg, schedule=schedule,
                                   step_model=step_model, peak_rule=peak_rule)
        return [int(b) for b in spec.solve(request)]
    import re

    from deepspeed.runtime import utils as ds_utils

    if spec.name == "uniform":
        parts = ds_utils.partition_uniform(num_items=len(costs), num_parts=num_stages)
    elif spec.name == "parameters":
        parts = ds_utils.partition_balanced(weights=[c.param_bytes // 4 for c in costs], num_parts=num_stages)
    else:  # type:REGEX, matched like DeepSpeed's _find_layer_type
        regex = re.compile(arg, re.IGNORECASE)
        weights = [1 if regex.search(c.name.split(".")[0]) else 0 for c in costs]
        parts = ds_utils.partition_balanced(weights=weights, num_parts=num_stages)
    return [int(b) for b in parts]
