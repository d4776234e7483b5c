"""The AdamW train.py runs where ds.json names no optimizer, in one place: the trainer builds it and the
profiler times each layer's step with it (``costs.profiler``), so a profile's optimizer step is training's."""

from __future__ import annotations

import torch


def torch_adamw(params, *, lr: float, device_type: str) -> torch.optim.AdamW:
    """torch's AdamW: fused on CUDA (one kernel over every tensor, torchtitan's default; a per-tensor Python loop
    cost 7-10% of a step on an H200), the plain per-tensor loop on a CPU (what the CPU benches were measured
    with)."""
    return torch.optim.AdamW(params, lr=lr, **({"fused": True} if device_type == "cuda" else {"foreach": False}))
