"""The named device specs (``costs.device_spec.DeviceSpec``): datasheets, ceilings and fitted efficiencies.

Peak numbers are the vendors' dense (no sparsity) datasheet figures; link
bandwidths are per direction.  The efficiency factors are what a real kernel
reaches of the peak; ``--calibrate`` (profiling on the device) is meant to
replace them with measured ones.  ``get_device`` hands out a named spec, or
the ``cpu`` / ``cuda`` spec measured on this machine.
"""

from __future__ import annotations

from dataclasses import replace

from .device_spec import DeviceSpec
from .gpu_pricing import GpuKernels, gpu_kernels
from .kernel_table import load_kernel_table
from .op_cost import AnalyticError


def adam_step_s(params: float, device: DeviceSpec, *, bytes_per_param: float = 30.0, fresh_sizes=()) -> float:
    """A memory-bound Adam step over ``params`` parameters: in mixed precision a fused one reads param,
    grad, m, v and writes param, m, v and the 16-bit copy (~30 bytes a parameter; 28 in fp32).
    ``fresh_sizes``: bytes of temporaries mapped afresh (a CPU's page faults, ``fresh_alloc_time``)."""
    return bytes_per_param * params / (device.hbm_bandwidth * device.memory_efficiency) + device.fresh_alloc_time(fresh_sizes)


_T = 1e12
_GB = 1e9
DEVICES: dict[str, DeviceSpec] = {
    "a100-40gb": DeviceSpec("a100-40gb", {"bf16": 312 * _T, "fp16": 312 * _T, "fp32": 156 * _T},  # fp32 via TF32
                            {"bf16": 78 * _T, "fp16": 78 * _T, "fp32": 19.5 * _T}, 1555 * _GB, 300 * _GB, 25 * _GB, 40 * 2**30),
    "a100-80gb": DeviceSpec("a100-80gb", {"bf16": 312 * _T, "fp16": 312 * _T, "fp32": 156 * _T},
                            {"bf16": 78 * _T, "fp16": 78 * _T, "fp32": 19.5 * _T}, 2039 * _GB, 300 * _GB, 25 * _GB, 80 * 2**30),
    "h100-sxm": DeviceSpec("h100-sxm", {"bf16": 989 * _T, "fp16": 989 * _T, "fp32": 494 * _T},
                           {"bf16": 134 * _T, "fp16": 134 * _T, "fp32": 67 * _T}, 3350 * _GB, 450 * _GB, 50 * _GB, 80 * 2**30),
    "h200": DeviceSpec("h200", {"bf16": 989 * _T, "fp16": 989 * _T, "fp32": 494 * _T},
                       {"bf16": 134 * _T, "fp16": 134 * _T, "fp32": 67 * _T}, 4800 * _GB, 450 * _GB, 50 * _GB, 141 * 2**30),
    # the other H100s: PCIe (114 SMs at lower clocks, HBM2e, PCIe Gen5 between GPUs) and NVL (94 GB, NVLink
    # bridges between pairs), NVIDIA's H100 datasheet
    "h100-pcie": DeviceSpec("h100-pcie", {"bf16": 756 * _T, "fp16": 756 * _T, "fp32": 378 * _T},
                            {"bf16": 102 * _T, "fp16": 102 * _T, "fp32": 51 * _T}, 2000 * _GB, 64 * _GB, 50 * _GB,
                            80 * 2**30),
    "h100-nvl": DeviceSpec("h100-nvl", {"bf16": 835 * _T, "fp16": 835 * _T, "fp32": 418 * _T},
                           {"bf16": 120 * _T, "fp16": 120 * _T, "fp32": 60 * _T}, 3900 * _GB, 300 * _GB, 50 * _GB,
                           94 * 2**30),
}
ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm"}

# The most each efficiency measurably reaches of a datasheet peak: no fit goes above it (a factor above would
# absorb a term the model lacks).  GEMMs: the best bf16 matmul cuBLAS reaches, stas00/ml-engineering's maximum
# achievable matmul FLOPS table (A100 SXM 271.2 of 312 TFLOP/s; H100 SXM 794.5 of 989, "H200 is the same").
# Attention: FlashAttention-2 reaches up to 73% of an A100's peak (Dao 2023), FlashAttention-3 740 TFLOP/s
# in bf16 on an H100 SXM (0.75; Shah et al. 2024).  The rest: the datasheet itself.
CEILINGS = {
    "a100-80gb": {"matrix_efficiency": 0.87, "attention_efficiency": 0.73},
    "a100-40gb": {"matrix_efficiency": 0.87, "attention_efficiency": 0.73},
    "h100-sxm": {"matrix_efficiency": 0.80, "attention_efficiency": 0.75},
    "h200": {"matrix_efficiency": 0.80, "attention_efficiency": 0.75},
    "h100-pcie": {"matrix_efficiency": 0.80, "attention_efficiency": 0.75},
    "h100-nvl": {"matrix_efficiency": 0.80, "attention_efficiency": 0.75},
}

# Efficiency factors fitted on published Megatron-LM runs under the megatron runtime, each at most its
# ceiling (bench/calibrate_at_scale.py; docs/CALIBRATION.md lists the rows); every other number above is
# the datasheet's.  H100's sit at their ceilings: the published rows ask for more.  H200 has no published
# rows: it takes H100's fit.  ``get_device`` applies them, so every command and the analytic partition
# method cost a layout on the same spec.
# ``gemm_efficiency``: the GPU kernels' GEMM ceiling (``costs.gpu_pricing``), fitted the same way on the same rows
# with every op priced as its kernels run (Megatron's fused kernels of each row's era), at most cuBLAS's measured
# best; the class efficiencies beside it price a GPU spec only where its kernel figures are switched off.
CALIBRATED = {
    "a100-80gb": {"matrix_efficiency": 0.671, "comm_efficiency": 1.0, "gemm_efficiency": 0.861},
    "a100-40gb": {"matrix_efficiency": 0.671, "comm_efficiency": 1.0, "gemm_efficiency": 0.861},
    "h100-sxm": {"matrix_efficiency": 0.80, "attention_efficiency": 0.75, "comm_efficiency": 1.0,
                 "gemm_efficiency": 0.779},
    "h200": {"matrix_efficiency": 0.80, "attention_efficiency": 0.75, "comm_efficiency": 1.0, "gemm_efficiency": 0.779},
    "h100-pcie": {"matrix_efficiency": 0.80, "attention_efficiency": 0.75, "comm_efficiency": 1.0,
                  "gemm_efficiency": 0.779},
    "h100-nvl": {"matrix_efficiency": 0.80, "attention_efficiency": 0.75, "comm_efficiency": 1.0,
                 "gemm_efficiency": 0.779},
}


def get_device(name: str, *, cache_dir: str | None = ".ds_pipe_ext_cache", calibrated: bool = True) -> DeviceSpec:
    """A named spec with its calibrated efficiencies (``calibrated=False``: the datasheet's defaults);
    "cpu" and "cuda" are measured on the spot, on this machine's CPU or current GPU (and cached in ``cache_dir``)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key == "cpu":
        from .cpu_spec import measure_cpu

        return measure_cpu(cache_dir)
    if key == "cuda":
        from .cuda_spec import measure_cuda

        return cuda_device(*measure_cuda(cache_dir))
    if key not in DEVICES:
        raise AnalyticError(f"unknown device {name!r}; use one of {sorted([*DEVICES, *ALIASES, 'cpu', 'cuda'])}")
    fitted = CALIBRATED.get(key, {}) if calibrated else {}
    spec = replace(DEVICES[key], **{k: v for k, v in fitted.items() if k != "gemm_efficiency"})
    kern = gpu_kernels(key, table=load_kernel_table(key))
    if "gemm_efficiency" in fitted:
        kern = replace(kern, gemm_efficiency=fitted["gemm_efficiency"])
    return replace(spec, gpu=kern)


def datasheet_name(device_name: str, memory_bytes: float | None = None) -> str | None:
    """The datasheet spec of a GPU by the name CUDA gives it ("NVIDIA H100 80GB HBM3" -> "h100-sxm"; an A100 by
    its memory, 40 or 80 GB), None for one without a spec here."""
    name = device_name.upper()
    if "H200" in name:
        return "h200"
    if "H100" in name:  # "NVIDIA H100 80GB HBM3" is the SXM part; the PCIe and NVL cards say so
        return "h100-pcie" if "PCIE" in name else "h100-nvl" if "NVL" in name else "h100-sxm"
    if "A100" in name:
        return "a100-40gb" if memory_bytes is not None and memory_bytes < 50e9 else "a100-80gb"
    return None


def cuda_device(device_name: str, measured: dict) -> DeviceSpec:
    """The ``cuda`` spec from its measured fields (``costs.cuda_spec``), with the datasheet's links and
    vector rate where the device is one known by name (NCCL is not measured there, and no torch op measures
    an elementwise op's arithmetic rate), else its own copy bandwidth and measured lower bound."""
    key = datasheet_name(device_name, measured["memory_bytes"])
    known = DEVICES[key] if key else None
    bandwidth = measured["hbm_bandwidth"]
    if known:
        measured = {**measured, "vector_flops": dict(known.vector_flops)}
    spec = DeviceSpec("cuda", intra_node_bandwidth=known.intra_node_bandwidth if known else bandwidth,
                      inter_node_bandwidth=known.inter_node_bandwidth if known else bandwidth,
                      gpus_per_node=known.gpus_per_node if known else 1, **measured)
    return replace(spec, gpu=measured_gpu_kernels(key, spec))


def measured_gpu_kernels(key: str | None, spec: DeviceSpec) -> GpuKernels | None:
    """The kernel figures of a GPU whose GEMM peak and bandwidth were measured (the ``cuda`` spec): its
    datasheet GPU's, with the GEMM ceiling and the streaming share at 1 (they are the measured figures
    themselves) and the attention shares rescaled from the datasheet's peak to the measured one."""
    if key is None:
        return None
    datasheet, kern = DEVICES[key], gpu_kernels(key, table=load_kernel_table(key))
    scale = datasheet.matrix_flops["bf16"] / spec.matrix_flops["bf16"]
    attention = {b: {d: (f * scale, w * scale) for d, (f, w) in effs.items()} for b, effs in kern.attention.items()}
    return replace(kern, gemm_efficiency=1.0, bandwidth_fraction=1.0, attention=attention)
