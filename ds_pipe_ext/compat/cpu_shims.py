"""CPU shims for megatron-core's tensor/sequence-parallel layers, DeepSpeed's MoE layer under TP, DeepSpeed's
start-up and glibc's malloc.  Active only without CUDA.

megatron-core 0.16 allocates sequence-parallel all-gather buffers (and a few others)
with ``device=torch.cuda.current_device()``, which fails on a CPU-only torch.  Rather
than patch ``torch.cuda`` for the whole process (DeepSpeed and torch would see it too),
``install()`` replaces the module-level name ``torch`` in just the megatron modules
that do this with a proxy whose ``cuda.current_device()`` is the CPU.  Everything
else on the proxy is torch itself.

DeepSpeed's MoE layer under TP gathers the experts' output over the TP group into a flat buffer
(``moe.mappings._gather_tokens``: ``all_gather_into_tensor`` of an (E, C/t, h) input into t x its elements), which
NCCL takes and gloo refuses ("invalid tensor size": it wants the output shaped t x the input's first dimension).
``install()`` gives that module a ``deepspeed`` whose ``comm.all_gather_into_tensor`` hands gloo the same buffer
viewed in that shape; the bytes and their order are NCCL's.

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


class _Forward(types.ModuleType):
    """A module that is ``target`` except for the names given."""

    def __init__(self, target, **names):
        super().__init__(target.__name__)
        self._target = target
        self.__dict__.update(names)

    def __getattr__(self, name):
        return getattr(self._target, name)


def _gloo_all_gather_into_tensor(output, input_, group=None, async_op=False):
    import deepspeed.comm as ds_comm

    if output.dim() == 1 and input_.dim() > 1:  # DeepSpeed's flat buffer, seen as gloo wants it
        output = output.view(-1, *input_.shape[1:])
    return ds_comm.all_gather_into_tensor(output, input_, group=group, async_op=async_op)


def _deepspeed_for_gloo():
    import deepspeed
    import deepspeed.comm

    return _Forward(deepspeed, comm=_Forward(deepspeed.comm, all_gather_into_tensor=_gloo_all_gather_into_tensor))


MOE_MAPPINGS = "deepspeed.moe.mappings"


def install() -> bool:
    """Patch the megatron modules and DeepSpeed's MoE mappings if CUDA is absent; returns whether anything was
    patched.  Idempotent."""
    if torch.cuda.is_available():
        return False
    proxy = _CpuTorch()
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        if not isinstance(getattr(module, "torch", None), _CpuTorch):
            module.torch = proxy
    mappings = importlib.import_module(MOE_MAPPINGS)
    if not isinstance(mappings.deepspeed, _Forward):
        mappings.deepspeed = _deepspeed_for_gloo()
    return True


def uninstall() -> None:
    """Give the megatron modules back their ``torch`` and DeepSpeed's mappings their ``deepspeed`` (tests restore
    what they patch)."""
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        if isinstance(getattr(module, "torch", None), _CpuTorch):
            module.torch = torch
    mappings = importlib.import_module(MOE_MAPPINGS)
    if isinstance(mappings.deepspeed, _Forward):
        import deepspeed

        mappings.deepspeed = deepspeed


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


# glibc's malloc hands each allocation above its mmap threshold (128 KiB at start) fresh pages from
# the kernel and gives them back on free, and it moves that threshold and trims its heap as the
# process frees memory: how much of a step is page faults depends on what the process allocated
# before.  A bench-cpu stage (activations of 0.5-50 MB) measured 4.10-4.18 s per step with glibc's
# defaults and 3.55-3.67 s with fixed thresholds; 2-rank launches trained 1.20-1.23x faster
# (bench/host_allocator.py).  Fixed thresholds keep freed memory for reuse whatever ran before (the
# profile, another build), at the price of a heap that never shrinks (peak RSS stays).
MALLOC_MMAP_THRESHOLD = 1 << 30  # bytes: allocations below this come from the heap, reused
MALLOC_TRIM_THRESHOLD = (1 << 31) - 1  # bytes: never give freed heap back (a C int's largest)
KEEP_GLIBC_MALLOC_ENV = "DS_PIPE_EXT_GLIBC_MALLOC"  # "default": leave glibc's dynamic thresholds


def _keeps_glibc_thresholds() -> bool:
    """Left to glibc: asked for (``DS_PIPE_EXT_GLIBC_MALLOC=default``), or thresholds the environment
    already fixed (``MALLOC_MMAP_THRESHOLD_``, as `compare --compact-malloc` sets for memory runs)."""
    import os

    return os.environ.get(KEEP_GLIBC_MALLOC_ENV) == "default" or "MALLOC_MMAP_THRESHOLD_" in os.environ


def training_mmap_threshold() -> float:
    """The size above which a CPU training process maps a buffer afresh (page faults every step), as
    ``steady_host_allocator`` leaves it: its fixed threshold, or the environment's, or glibc's largest
    dynamic one (32 MiB on 64-bit).  The analytic CPU spec charges page faults above it."""
    import os

    if not _keeps_glibc_thresholds():
        return float(MALLOC_MMAP_THRESHOLD)
    return float(os.environ.get("MALLOC_MMAP_THRESHOLD_", 32 * 2**20))


def steady_host_allocator() -> bool:
    """Without CUDA, on glibc: fix malloc's mmap and trim thresholds (``mallopt``), as setting
    ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` before start would.  Returns whether it did;
    ``DS_PIPE_EXT_GLIBC_MALLOC=default`` keeps glibc's own behaviour, and thresholds the environment
    set are kept.  Idempotent."""
    import ctypes

    if torch.cuda.is_available() or _keeps_glibc_thresholds():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to fix
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD)) and bool(mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD))
