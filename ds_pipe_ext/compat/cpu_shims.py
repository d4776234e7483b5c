"""CPU shims for megatron-core's tensor/sequence-parallel layers and DeepSpeed's start-up.  Active only without CUDA.

megatron-core 0.16 allocates sequence-parallel all-gather buffers (and a few others)
with ``device=torch.cuda.current_device()``, which fails on a CPU-only torch.  Rather
than patch ``torch.cuda`` for the whole process (DeepSpeed and torch would see it too),
``install()`` replaces the module-level name ``torch`` in just the megatron modules
that do this with a proxy whose ``cuda.current_device()`` is the CPU.  Everything
else on the proxy is torch itself.

Nothing else from megatron that needs CUDA is used on CPU: not ``TransformerLayer``,
not the CUDA RNG tracker (dropout inside TP regions uses torch's default generator),
and LayerNorm is torch's (or apex's on GPU).
"""

from __future__ import annotations

import importlib
import types

import torch

# the megatron modules that call torch.cuda.current_device() on the TP/SP path
PATCHED_MODULES = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.utils",
)


class _CpuTorch(types.ModuleType):
    """``torch``, except that ``torch.cuda.current_device()`` names the CPU."""

    cuda = types.SimpleNamespace(current_device=lambda: torch.device("cpu"),
                                 is_available=lambda: False)

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)


def install() -> bool:
    """Patch the megatron modules if CUDA is absent; returns whether anything was patched.  Idempotent."""
    if torch.cuda.is_available():
        return False
    proxy = _CpuTorch()
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        if not isinstance(getattr(module, "torch", None), _CpuTorch):
            module.torch = proxy
    return True


def uninstall() -> None:
    """Give the megatron modules back their ``torch`` (tests restore what they patch)."""
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        if isinstance(getattr(module, "torch", None), _CpuTorch):
            module.torch = torch


def installed() -> bool:
    return all(isinstance(getattr(importlib.import_module(n), "torch", None), _CpuTorch) for n in PATCHED_MODULES)


def skip_deepspeed_shm_op() -> bool:
    """Without CUDA, don't let DeepSpeed JIT-build its shared-memory comm op at init_distributed.

    That op speeds up CPU inference all-reduce; gloo training does not use it.  Building it
    compiles C++ in every fresh environment, and a process killed mid-build leaves a lock in
    ~/.cache/torch_extensions that makes every later launch wait forever (seen here).
    Returns whether the build was skipped.
    """
    if torch.cuda.is_available():
        return False
    # importlib: `import deepspeed.comm.torch` would resolve deepspeed.comm's attribute `torch` (torch itself)
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    ds_torch_comm.build_shm_op = lambda: None
    return True
