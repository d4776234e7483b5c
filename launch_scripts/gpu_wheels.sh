#!/usr/bin/env bash
# Wheels for a GPU machine without a package registry.  Such an image (Python 3.12, its own CUDA torch,
# numpy, scipy, matplotlib, tqdm, transformers) usually lacks DeepSpeed, pydantic, hjson and megatron-core.
# Run on a machine with a registry, from the project root, after `make install` (versions follow .venv):
#     bash launch_scripts/gpu_wheels.sh .whl [PYTHON_VERSION]          (docs/GPU.md: what to run there)
set -euo pipefail
dest=${1:-.whl}; py=${2:-3.12}
pip=${PIP:-.venv/bin/pip}
mkdir -p "$dest"
ver() { "$pip" show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
want=()
for p in pydantic pydantic-core annotated-types typing-inspection hjson megatron-core transformers; do
  v=$(ver "$p"); [[ -n $v ]] || { echo "gpu_wheels.sh: $p is not installed in $pip's environment" >&2; exit 1; }
  want+=("$p==$v")
done
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$pip" download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp "${plat[@]}" \
  -d "$dest" "${want[@]}"
# liger-kernel (setup.py's [gpu] extra: the fused linear cross-entropy on CUDA), never in the CPU venv: its
# newest pure-Python wheel within the extra's range
"$pip" download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp "${plat[@]}" \
  -d "$dest" "liger-kernel>=0.5,<1"
# DeepSpeed ships a source archive; built with DS_BUILD_OPS=0 it is pure Python (its ops compile on first use)
DS_BUILD_OPS=0 "$pip" wheel -q --no-deps --no-build-isolation "deepspeed==$(ver deepspeed)" -w "$dest"
ls -1 "$dest"
