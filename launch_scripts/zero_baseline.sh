#!/usr/bin/env bash
# The same model as plain data parallel under ZeRO-3 (no pipeline).  Usage: launch_scripts/zero_baseline.sh [NUM_GPUS] [train.py args...]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-4}; shift $(( $# > 0 ? 1 : 0 ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec deepspeed --num_gpus "$n" train.py --deepspeed_config launch_scripts/ds_zero3.json "$@"
