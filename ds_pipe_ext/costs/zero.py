"""Model-state bytes per rank as DeepSpeed's ZeRO optimizers allocate them (not as the paper's formula).

The measured side counts the tensors a rank holds at the optimizer step
(``compat.zero.held_model_state_bytes``); this module predicts the same three
figures from the parameter sizes and the ZeRO settings, allocation rule by
allocation rule (DeepSpeed 0.19, one parameter group, Adam):

- ZeRO-0: the parameters, their gradients, Adam's two moments.  In fp32 the
  parameters are the optimizer's own (no master copy).
- ZeRO-1 and -2 (``stage_1_and_2.py``): the parameters live in one flat buffer
  padded to a multiple of ``2 * dp`` elements (``nccl_start_alignment_factor``), every
  rank keeps all of it; each rank owns a partition of ``padded / dp`` elements with an
  fp32 master copy (a copy even when the model is fp32), the two moments and, at the
  step, its fp32 gradient.  Gradients are reduced in buckets during the backward pass
  and the non-owned ones freed, so ZeRO-1 and ZeRO-2 hold the same at the step.
- ZeRO-3 (``stage3.py``, ``partition_parameters.py``): each parameter is padded to a
  multiple of ``dp`` and split, so a rank holds ``sum(ceil(n_i / dp))`` elements of
  parameters, the same again of reduced gradients (``grad_partitions_flat_buffer``),
  and an fp32 master partition with its gradient and two moments.  A parameter at or
  below ``stage3_param_persistence_threshold`` elements also stays whole on every
  rank; `ds-pipe-ext compare` writes the threshold into every ZeRO-3 config.

16-bit training adds, per the same rules, fp32 master copies beside 16-bit
parameters (the measured check covers fp32 training, which is what runs on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelStates:
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def to_dict(self) -> dict[str, int]:
        return {"param_bytes": self.param_bytes, "grad_bytes": self.grad_bytes, "optimizer_bytes": self.optimizer_bytes}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def zero_model_states(param_numels: list[int], *, dp: int, stage: int, element_bytes: int = 4,
                      persistence_threshold: int = 0) -> ModelStates:
    """Bytes one data-parallel rank holds for parameters of these sizes (a stage's, or the whole model's)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage!r}: use 0, 1, 2 or 3")
    if dp < 1:
        raise ValueError(f"dp = {dp}: the data-parallel degree must be >= 1")
    e, n = element_bytes, sum(param_numels)
    master = 0 if e == 4 else 4  # 16-bit training keeps fp32 master weights
    if stage == 0:
        return ModelStates(param_bytes=e * n, grad_bytes=e * n + master * n, optimizer_bytes=(8 + master) * n)
    if stage in (1, 2):
        alignment = 2 * dp
        padded = _ceil_div(n, alignment) * alignment
        part = padded // dp
        return ModelStates(param_bytes=e * padded, grad_bytes=4 * part, optimizer_bytes=12 * part)
    part = sum(_ceil_div(k, dp) for k in param_numels)
    persistent = sum(k for k in param_numels if k <= persistence_threshold)
    return ModelStates(param_bytes=e * (part + persistent), grad_bytes=e * part + 4 * part, optimizer_bytes=12 * part)
