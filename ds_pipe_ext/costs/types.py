"""`LayerCost`: what one pipeline layer costs, whatever measured or estimated it."""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, fields

from pydantic import Field

from ..config_model import ConfigModel


@dataclass(frozen=True)
class LayerCost:
    """Cost of one layer for one micro-batch on one rank (a TP shard when TP > 1).

    Times are seconds, sizes bytes.  ``activation_bytes`` is what autograd keeps
    alive between this layer's forward and backward (the saved tensors), which is
    what a pipeline stage multiplies by its in-flight micro-batches.
    ``output_bytes`` is the tensor that crosses a stage boundary if the split falls
    right after this layer.
    """

    name: str
    forward_s: float
    backward_s: float
    recompute_s: float = 0.0  # extra forward replayed in backward under activation checkpointing
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    activation_bytes: int = 0
    output_bytes: int = 0
    # the most this layer alone holds above its resting memory during its forward + backward: its saved
    # activations and its temporaries (the GPU allocator's peak where profiled, 0 where unmeasured; the
    # peak rule's where analytic, ``costs.peak.layer_peak_bytes``)
    peak_bytes: int = 0
    # the last layer: the tensor it hands the loss (the logits), which a pipeline's last stage keeps in
    # its buffers (0 elsewhere, and where unknown)
    loss_input_bytes: int = 0
    # the weight-gradient part of backward_s, which zero-bubble schedules run apart (W after the input
    # gradient B); None where neither measured nor modelled: the schedules then take half
    weight_grad_s: float | None = None
    # the element count of each parameter tensor, for the rules that pad or partition per tensor
    # (ZeRO-3, ``costs.zero``); empty where unknown: the layer then counts as one tensor
    param_numels: tuple[int, ...] = ()
    # the part of param_bytes in a Mixture-of-Experts layer's experts (this rank's E / ep of them): under
    # ZeRO-1/2 their gradients and optimizer states partition over the expert-data-parallel group (dp / ep
    # ranks), not over dp (``costs.zero.layer_states_by_rule``)
    expert_param_bytes: int = 0
    # selective recompute (attention's core replayed in the backward): what the layer then keeps, and the
    # forward it replays; None where the layer has no such mode (a Hugging Face layer, the embedding)
    selective_kept_bytes: int | None = None
    selective_replay_s: float = 0.0
    # the optimizer's step over this layer's trainable parameters, once a step (0 where unmeasured): the stage
    # runs it after its last backward (the plan's step without a step model)
    optimizer_step_s: float = 0.0
    # parameters this layer shares with another (DeepSpeed's TiedLayerSpec key, "" for none) and their bytes in
    # param_bytes (a profiled tied spec: its whole module, which a process builds once; analytic: the word
    # table): a stage holding two layers of one key holds them once, gradients and optimizer states too;
    # stages apart each hold a copy
    tied_key: str = ""
    tied_param_bytes: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in ("name", "tied_key"):
                if not isinstance(getattr(self, f.name), str):
                    raise ValueError(f"LayerCost.{f.name} must be a string, got {getattr(self, f.name)!r}")
                continue
            if f.name == "param_numels":
                numels = tuple(self.param_numels)
                # a MoE layer lists hundreds of tensors and the planner builds tens of thousands of costs: the
                # check runs in C (``type(n) is int`` also refuses a bool)
                if numels and (set(map(type, numels)) != {int} or min(numels) < 1):
                    raise ValueError(f"LayerCost({self.name!r}).param_numels = {self.param_numels!r}: "
                                     f"element counts must be positive integers")
                object.__setattr__(self, "param_numels", numels)
                continue
            v = getattr(self, f.name)
            if v is None and f.name in ("weight_grad_s", "selective_kept_bytes"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"LayerCost({self.name!r}).{f.name} = {v!r}: must be a finite number >= 0")
        if self.tied_param_bytes > self.param_bytes:
            raise ValueError(f"LayerCost({self.name!r}).tied_param_bytes = {self.tied_param_bytes} exceeds its "
                             f"param_bytes ({self.param_bytes}): the tied weight is part of the layer's parameters")

    def renamed(self, name: str) -> "LayerCost":
        """This record under another layer's name, its numbers not checked again (alike blocks: a model of
        sixty blocks prices one, and the planner builds its records for hundreds of layouts)."""
        if not isinstance(name, str):
            raise ValueError(f"LayerCost.name must be a string, got {name!r}")
        twin = copy.copy(self)
        object.__setattr__(twin, "name", name)
        return twin

    def time_s(self, *, recompute: bool = False) -> float:
        """Forward + backward time of one micro-batch (plus the replayed forward if checkpointed)."""
        return self.forward_s + self.backward_s + (self.recompute_s if recompute else 0.0)

    def tied_share(self) -> float:
        """The tied weight's share of this layer's parameters (and so of its gradients and optimizer states)."""
        return self.tied_param_bytes / self.param_bytes if self.param_bytes else 0.0

    @property
    def static_bytes(self) -> int:
        """Bytes held for the whole step regardless of micro-batches: params, grads, optimizer states."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LayerCost":
        if not isinstance(d, dict):
            raise ValueError(f"a LayerCost record must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown LayerCost fields {sorted(unknown)}; expected {sorted(known)}")
        if "name" not in d or "forward_s" not in d or "backward_s" not in d:
            raise ValueError("a LayerCost record needs at least name, forward_s and backward_s")
        return cls(**d)


class ProfileSettings(ConfigModel):
    """``"pipeline": {"profile": {...}}``: how layers are profiled."""

    warmup: int = Field(2, ge=0)  # untimed runs first (allocations, caches)
    repeats: int = Field(5, ge=1)  # timed runs; the median is kept
    cache_dir: str | None = ".ds_pipe_ext_cache"  # None: no cache
    optimizer_bytes_per_param: int = Field(8, ge=0)  # Adam: exp_avg + exp_avg_sq in fp32
    progress: bool = True
    compile: bool = False  # profile each layer torch.compile'd, as a run with train.compile runs it
