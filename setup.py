"""ds_pipe_ext: cost-aware pipeline partitioning for DeepSpeed and Megatron-core."""

from setuptools import find_packages, setup

setup(
    name="ds_pipe_ext",
    version="0.1.0",
    description="Profiled and analytic pipeline partitioning for DeepSpeed PipelineModule, with Megatron-core TP/SP",
    packages=find_packages(include=["ds_pipe_ext", "ds_pipe_ext.*"]),
    package_data={"ds_pipe_ext": ["py.typed"]},
    python_requires=">=3.11,<3.12",
    # Tested ranges.  Install torch first (CPU: `pip install torch==2.13.0`), or an
    # unpinned resolver pulls the CUDA build; the Makefile does it in that order.
    install_requires=[
        "torch>=2.13.0,<2.14",
        # ds_pipe_ext/compat/ reads private DeepSpeed/megatron names (listed in its docstring):
        # these are the ranges it was tested on (compat.DEEPSPEED_TESTED, compat.MEGATRON_CORE_TESTED)
        "deepspeed>=0.19.0,<0.20",
        "megatron-core>=0.16.0,<=0.16.1",  # 0.16.1 is the last release for Python 3.11
        "packaging>=23",  # compat/ checks the installed DeepSpeed and megatron-core against the tested ranges
        "numpy>=1.26,<3",
        "scipy>=1.11,<2",  # least squares for fitting device specs (bench/calibrate_at_scale.py)
        "pydantic>=2.5,<3",  # config sections, validated as DeepSpeed validates its own
        "matplotlib>=3.8,<4",
        "tqdm>=4.66,<5",
    ],
    extras_require={
        # Hugging Face models as pipelines (ds_pipe_ext.hf); the tested range is compat.TRANSFORMERS_TESTED
        "hf": ["transformers>=5.23,<5.30", "safetensors>=0.4"],
        "test": ["pytest>=8,<10", "hypothesis>=6.100,<7", "transformers>=5.23,<5.30", "safetensors>=0.4"],
        # apex is not on PyPI: build it from NVIDIA's repository for fused LayerNorm/Adam on GPU.
    },
    entry_points={"console_scripts": ["ds-pipe-ext=ds_pipe_ext.cli:main"]},
)
