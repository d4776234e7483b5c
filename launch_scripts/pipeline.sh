#!/usr/bin/env bash
# Pipeline-parallel GPT with ds_pipe_ext partitioning.  Usage: launch_scripts/pipeline.sh [NUM_GPUS] [DS_JSON] [train.py args...]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-4}; cfg=${2:-ds.json}; shift $(( $# > 2 ? 2 : $# ))
# CPU: one thread per rank; on GPUs the setting is harmless
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec deepspeed --num_gpus "$n" train.py --deepspeed_config "$cfg" "$@"
