#!/usr/bin/env bash
# The user's question on their own GPUs: the pipeline partitioned by measured layer costs
# ("profiled") against ZeRO-3 data parallel (and DeepSpeed's "uniform" split), the same model at
# the same global batch, as real launches in one table with memory by kind.
#   launch_scripts/compare_zero3.sh [NUM_GPUS] [MODEL] [extra `ds-pipe-ext compare` args...]
# e.g. launch_scripts/compare_zero3.sh 4 gpt2-small --micro-batch 4 --memory-cap-gib 70
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-4}; model=${2:-compare-cpu}; shift $(( $# > 2 ? 2 : $# ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec ds-pipe-ext compare --model "$model" --world "$n" --configs 'pipe-*-z0' zero3 zero3-offload \
    --out "runs/compare-zero3-$model-w$n" "$@"
