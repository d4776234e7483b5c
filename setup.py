"""ds_pipe_ext: cost-aware pipeline partitioning for DeepSpeed and Megatron-core."""

from setuptools import find_packages, setup

setup(
    name="ds_pipe_ext",
    version="0.1.0",
    description="Profiled and analytic pipeline partitioning for DeepSpeed PipelineModule, with Megatron-core TP/SP",
    packages=find_packages(include=["ds_pipe_ext", "ds_pipe_ext.*"]),
    package_data={"ds_pipe_ext": ["py.typed", "costs/kernels/*.json"]},
    # Tested on Python 3.11 (CPU, CI) and 3.12 (GPU images); megatron-core 0.16.1 and torch ship 3.13 wheels too.
    python_requires=">=3.11,<3.14",
    # torch: the one a GPU image already carries is kept (README: install with a constraint on it).
    # 2.11 ran on the GPU, 2.13 runs CI; the "a0" admits NVIDIA's container builds (2.11.0a0+<sha>.nv25.xx),
    # which sort before 2.11.0.  CPU machines install torch==2.13.0 first (the Makefile): an unpinned
    # resolver would pull the CUDA build.
    install_requires=[
        "torch>=2.11.0a0,<2.14",
        # ds_pipe_ext/compat/ reads private DeepSpeed/megatron names (listed in its docstring):
        # these are the ranges it was tested on (compat.DEEPSPEED_TESTED, compat.MEGATRON_CORE_TESTED)
        "deepspeed>=0.19.0,<0.20",
        "megatron-core>=0.16.0,<0.17",  # 0.17+ needs Python >= 3.12 and moved names compat/ reads
        "packaging>=23",  # compat/ checks the installed DeepSpeed and megatron-core against the tested ranges
        "numpy>=1.26,<3",
        "scipy>=1.11,<2",  # least squares for fitting device specs (bench/calibrate_at_scale.py)
        "pydantic>=2.5,<3",  # config sections, validated as DeepSpeed validates its own
        "matplotlib>=3.8,<4",
        "tqdm>=4.66,<5",
        "filelock>=3.12",  # one measurement of the machine when several processes ask at once (torch needs it too)
    ],
    extras_require={
        # Hugging Face models as pipelines (ds_pipe_ext.hf); the tested range is compat.TRANSFORMERS_TESTED
        "hf": ["transformers>=5.23,<5.30", "safetensors>=0.4"],
        "test": ["pytest>=8,<10", "pytest-xdist>=3.6,<4", "hypothesis>=6.100,<7", "transformers>=5.23,<5.30",
                 "safetensors>=0.4"],
        # on CUDA, liger-kernel's fused linear cross-entropy for a chunked head + loss (loss_chunk_tokens); pure
        # Python (its kernels are triton's), carried to a GPU by launch_scripts/gpu_wheels.sh
        "gpu": ["liger-kernel>=0.5,<1"],
        # apex is not on PyPI: build it from NVIDIA's repository for fused LayerNorm/Adam on GPU.
    },
    entry_points={"console_scripts": ["ds-pipe-ext=ds_pipe_ext.cli:main"]},
)
