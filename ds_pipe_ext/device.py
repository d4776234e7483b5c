"""Which device a rank computes on, and which device a process group's collectives take.

One rank per GPU: ``deepspeed --num_gpus N`` sets ``LOCAL_RANK`` for each process, and every
rank must select ``cuda:LOCAL_RANK`` before its first CUDA allocation or collective; otherwise
every rank lands on ``cuda:0`` (NCCL then refuses two ranks on one device, or hangs).
DeepSpeed selects it inside ``deepspeed.initialize``, which is too late for what
``PipelineModule.__init__`` does first (profiling, the partition's broadcast).

NCCL takes CUDA tensors only; gloo takes CPU tensors (and forgives CUDA ones by copying).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def local_rank() -> int:
    """This process's index on its node, as the launcher set it (0 outside a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def rank_device() -> torch.device:
    """``cuda:LOCAL_RANK`` where CUDA is available, else the CPU."""
    return torch.device("cuda", local_rank()) if torch.cuda.is_available() else torch.device("cpu")


def select_rank_device() -> torch.device:
    """Make ``rank_device()`` the current CUDA device (as ``deepspeed.initialize`` would later); returns it."""
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def build_device(zero_stage: int = 0, dtype: str = "fp32") -> torch.device:
    """Where a rank builds (and initialises) its layers: on ``rank_device()`` where training holds at least the
    fp32 weights' bytes there anyway (ZeRO-0/1: 16-bit weights and gradients whole; fp32 ZeRO-2: fp32 weights
    whole), so no weight is drawn on the host (one thread: ~5 ns an element) and copied over.
    ZeRO-3 and 16-bit ZeRO-2 hold less than the fp32 model on a GPU: built on the host, as DeepSpeed's engine
    expects, since the model may fit the GPU only partitioned.  Use as a context: ``with build_device(...):``."""
    if zero_stage <= 1 or (zero_stage == 2 and dtype == "fp32"):
        return rank_device()
    return torch.device("cpu")


def collective_device(group=None) -> torch.device:
    """The device of the tensors a collective over ``group`` takes: CUDA under NCCL, the CPU under gloo."""
    return rank_device() if dist.get_backend(group) == "nccl" else torch.device("cpu")


def use_tf32(enabled: bool) -> None:
    """fp32 GEMMs and convolutions on CUDA: TF32 tensor cores or CUDA cores (``train.tf32``).  The legacy
    flags, which ``mfu`` and the ``cuda`` spec's cache key read (torch refuses reads of them once the newer
    ``fp32_precision`` API has set them)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
