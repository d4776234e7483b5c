"""The ``cuda`` device spec: measured on the GPU this process runs on, as ``cpu`` is measured on the CPU.

A datasheet spec (``a100``, ``h100``, ``h200``) plans clusters we cannot run, with efficiencies fitted on
published runs; a run on a GPU is costed on what this GPU, this torch and this cuBLAS do:

* matrix peak per dtype: the best of square GEMMs of 4,096 and 8,192 (fp32 under the process's TF32
  setting, which decides whether fp32 GEMMs use tensor cores), efficiency 1 against it;
* ``matrix_half_dim``: from a GEMM whose token dimension is 512 against the 8,192 one (a GEMM with a
  small dimension fills the device less; ``DeviceSpec``'s own form, eff x d / (d + half));
* ``attention_efficiency``: causal SDPA (batch 4, 16 heads of 64, sequence 2,048, bf16) against the
  matrix peak;
* memory bandwidth: a copy between two 1 GiB buffers; vector rate: an add on 1 GiB operands, a lower bound
  (an eager elementwise op is bound by its traffic or its launch, never by its arithmetic: an add on 8 MiB
  timed by ``do_bench``, which flushes the L2 before each call, read 0.23 TFLOP/s on an H200, a launch and a
  flush; so no loop of torch ops measures the arithmetic rate).

The vector rate and the links (NCCL is not measured here) are the datasheet's where ``hardware.get_device``
knows the device by name.  Each figure is a loop of calls timed by ``costs.gpu_timing``.  Cached per device
name, torch and CUDA versions and the TF32 setting (``cache_dir``): a malformed cache file is an error naming it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .op_cost import AnalyticError

GEMM_SIZES = (4096, 8192)
SMALL_DIM = 512


def cuda_spec_key() -> dict:
    """What the measured figures depend on: the device, torch, CUDA and the fp32 matmul setting."""
    import torch

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "tf32": bool(torch.backends.cuda.matmul.allow_tf32)}


def cache_path(cache_dir: str, key: dict) -> Path:
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{key['device']}-torch{key['torch']}-cuda{key['cuda']}")
    return Path(cache_dir) / f"cuda-spec-v2-{slug}-tf32{int(key['tf32'])}.json"


def measure_cuda(cache_dir: str | None = ".ds_pipe_ext_cache", *, measure=None) -> tuple[str, dict]:
    """(the device's name, the measured fields of its ``DeviceSpec``: peaks, efficiencies, bandwidth,
    memory), from the cache or measured now (``measure``: what measures, ``_measure`` by default)."""
    import torch

    if not torch.cuda.is_available():
        raise AnalyticError("device 'cuda' is measured on a CUDA GPU, and this machine has none: use 'cpu' "
                            "(measured here) or a datasheet spec (a100, a100-40gb, h100, h200)")
    key = cuda_spec_key()
    path = cache_path(cache_dir, key) if cache_dir else None
    if path is not None and path.exists():
        try:
            stored = json.loads(path.read_text())
            return stored["key"]["device"], dict(stored["spec"])
        except (TypeError, ValueError, KeyError) as e:
            raise AnalyticError(f"{path}: not a cuda spec this version reads ({type(e).__name__}: {e}); delete "
                                f"it and the spec is measured again") from None
    fields = (measure or _measure)()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "spec": fields}, indent=1))
    return key["device"], fields


def _measure() -> dict:  # pragma: no cover - needs a GPU (bench/gpu_path.py runs it)
    import torch
    import torch.nn.functional as F

    from .gpu_timing import cuda_timer

    timer = cuda_timer()
    dev = torch.device("cuda", torch.cuda.current_device())
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

    def gemm_flops(m: int, k: int, n: int, dtype) -> float:
        a, b = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype)
        return 2 * m * k * n / timer(lambda: a @ b)

    matrix = {name: max(gemm_flops(s, s, s, dt) for s in GEMM_SIZES) for name, dt in dtypes.items()}
    big = GEMM_SIZES[-1]
    small = gemm_flops(SMALL_DIM, big, big, torch.bfloat16) / gemm_flops(big, big, big, torch.bfloat16)
    # eff(d) = d / (d + half), relative to the big GEMM's: r = eff(512) / eff(8192), solved for half
    half = max(0.0, SMALL_DIM * big * (1 - small) / (small * big - SMALL_DIM)) if small * big > SMALL_DIM else 0.0
    q = torch.randn(4, 16, 2048, 64, device=dev, dtype=torch.bfloat16)
    sdpa_flops = 4 * 4 * 16 * 2048 * 2048 * 64 / 2  # QK^T and PV, half of them under the causal mask
    attention = sdpa_flops / timer(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)) / matrix["bf16"]
    bandwidth = _copy_bandwidth(dev, timer)
    u = torch.randn(2**28, device=dev)  # 1 GiB: the add's traffic, a lower bound on its arithmetic rate
    vector = u.numel() / timer(lambda: torch.add(u, u))
    return {"matrix_flops": matrix, "vector_flops": {name: vector for name in dtypes}, "hbm_bandwidth": bandwidth,
            "memory_bytes": float(torch.cuda.get_device_properties(dev).total_memory), "matrix_efficiency": 1.0,
            "attention_efficiency": min(attention, 1.0), "vector_efficiency": 1.0, "memory_efficiency": 1.0,
            "comm_efficiency": 1.0, "matrix_half_dim": half}


def _copy_bandwidth(dev, timer) -> float:  # pragma: no cover - needs a GPU
    """Bytes/s a copy between two 1 GiB buffers moves (read + write), beyond any cache."""
    import torch

    x = torch.empty(2**28, device=dev, dtype=torch.float32)
    y = torch.empty_like(x)
    return 2 * x.nbytes / timer(lambda: y.copy_(x))
