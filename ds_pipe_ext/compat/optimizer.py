"""The torch optimizer inside DeepSpeed's wrappers (ZeRO, fp16/bf16 optimizers keep it as ``.optimizer``)."""

from __future__ import annotations


def unwrap_optimizer(optimizer):
    """The innermost torch optimizer: what holds ``state`` and ``param_groups``."""
    seen = set()
    while hasattr(optimizer, "optimizer") and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    return optimizer
