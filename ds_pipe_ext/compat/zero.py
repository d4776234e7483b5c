"""What a rank holds under DeepSpeed's ZeRO optimizers, counted from the tensors themselves.

``held_model_state_bytes(module, optimizer)`` walks the tensors DeepSpeed keeps for
this rank and sums their storages once each (views of one flat buffer count once):

- **parameters**: the module's parameter storages (under ZeRO-1/2 the padded flat
  ``bit16_groups_flat`` buffer they are views of; under ZeRO-3 each parameter's
  partition ``ds_tensor``, plus the full data of any parameter gathered at the time);
- **optimizer states**: the inner torch optimizer's parameters when they are not the
  module's (ZeRO's fp32 master partitions), and its per-parameter state tensors
  (Adam's exp_avg, exp_avg_sq);
- **gradients**: the module's ``.grad`` storages, the master partitions' ``.grad``,
  and ZeRO's own gradient buffers.

Call it where the gradients are complete: a step pre-hook of the inner optimizer.
The private names read here (DeepSpeed 0.19, ``runtime/zero/stage_1_and_2.py`` and
``stage3.py``): ``ds_tensor`` on ZeRO-3 parameters, and the optimizer attributes in
``_GRAD_BUFFERS``.
"""

from __future__ import annotations

import torch

from .optimizer import unwrap_optimizer

# ZeRO's gradient buffers (a missing or None attribute is skipped)
# (BF16_Optimizer's flat accumulation buffer, in the gradients' accumulation dtype, included)
_GRAD_BUFFERS = ("grads_in_partition", "grad_partitions_flat_buffer", "averaged_gradients",
                 "fp32_groups_gradients_flat")
# ZeRO's fp32 master partitions: the inner optimizer's parameters at its step, but ZeRO-3 swaps them
# out of its param_groups between steps
_MASTER_PARTITIONS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")


def _storages(obj, out: dict) -> None:
    """(data_ptr, nbytes) -> nbytes for every tensor in obj (a tensor, or lists/dicts of them)."""
    if isinstance(obj, torch.Tensor):
        s = obj.untyped_storage()
        if s.nbytes():
            out[(s.data_ptr(), s.nbytes())] = s.nbytes()
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _storages(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _storages(x, out)


def held_storages(module: torch.nn.Module, optimizer) -> dict[str, dict[tuple[int, int], int]]:
    """The storages this rank holds by kind, ``{kind: {(data_ptr, nbytes): nbytes}}``: ``param_bytes``,
    ``optimizer_bytes``, ``grad_bytes`` (ZeRO's gradient partitions included) and ``buffer_bytes`` (its
    reduction buckets).  A storage counts once, under the first kind that holds it (an fp32 model's
    master "copy" under ZeRO-0 is the parameter itself)."""
    params = list({id(p): p for p in module.parameters()}.values())
    held: dict[str, dict] = {"param_bytes": {}, "optimizer_bytes": {}, "grad_bytes": {}, "buffer_bytes": {}}
    for p in params:
        _storages(p.data, held["param_bytes"])
        _storages(getattr(p, "ds_tensor", None), held["param_bytes"])
    inner = unwrap_optimizer(optimizer)
    for name in _MASTER_PARTITIONS:
        _storages(getattr(optimizer, name, None), held["optimizer_bytes"])
    for group in getattr(inner, "param_groups", []):
        _storages(group["params"], held["optimizer_bytes"])
        for q in group["params"]:
            _storages(q.grad, held["grad_bytes"])
    for q, state in getattr(inner, "state", {}).items():
        _storages([v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0], held["optimizer_bytes"])
    for p in params:
        _storages(p.grad, held["grad_bytes"])
    for name in _GRAD_BUFFERS:
        _storages(getattr(optimizer, name, None), held["grad_bytes"])
    # the reduction buckets (``ipg_buckets``: a list of buffers per dtype under ZeRO-1/2, made at a
    # step's first gradient and freed at its end; one buffer allocated once under ZeRO-3)
    for bucket in (getattr(optimizer, "ipg_buckets", None) or {}).values():
        _storages(getattr(bucket, "buffer", None), held["buffer_bytes"])
    seen: set = set()
    for storages in held.values():
        for key in [k for k in storages if k in seen]:
            del storages[key]
        seen.update(storages)
    return held


def held_model_state_bytes(module: torch.nn.Module, optimizer) -> dict[str, int]:
    """``held_storages`` summed over the model states: parameters, gradients and optimizer states (not
    the reduction buckets, which the peak counts apart)."""
    held = {kind: sum(storages.values()) for kind, storages in held_storages(module, optimizer).items()}
    del held["buffer_bytes"]
    return held


def deepspeed_estimate_bytes(total_params: int, largest_module_params: int, *, dp: int, stage: int) -> int | None:
    """DeepSpeed's own estimate of one rank's model-state bytes, for the cross-check of ``costs.zero``.

    ``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs`` (what the
    ``*_all_live`` helpers print), without offload, on one node of ``dp`` devices: 16-bit training only
    (they count 2-byte parameters beside fp32 master weights), no padding, and ZeRO-3 adds the largest
    module's parameters gathered in 32 bits as a working set.  ``None`` for ZeRO-0 and -1, which they
    do not cover.
    """
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        return int(estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node=dp, cpu_offload=False)[1])
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        return int(estimate_zero3_model_states_mem_needs(total_params, largest_module_params, num_gpus_per_node=dp,
                                                         cpu_offload=False)[1])
    return None
