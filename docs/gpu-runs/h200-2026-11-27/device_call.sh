#!/usr/bin/env bash
# One prepared device call (not committed): install, then gpu_path parts; every log under $OUT.
set -u
cd "$(dirname "$0")"
start=$(date +%s)
el() { echo "[+$(( $(date +%s) - start )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | grep -v WARNING | tail -3
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c "import sys, torch, deepspeed; print(sys.version.split()[0], torch.__version__, torch.version.cuda, deepspeed.__version__, torch.cuda.get_device_name())"
O=$OUT/gpu-path; mkdir -p $O
part() { local p=$1 lim=$2; el "start $p (limit $lim s)"; timeout -k 10 $lim python3 bench/gpu_path.py --parts $p --out $O > $OUT/$p.log 2>&1; el "end $p rc=$?"; grep -E "^\s+\[|RESULT|^[a-z]+: [0-9]+ s" $OUT/$p.log | cut -c1-300; }
case ${1:-one} in
one)
  # train and compare measure bytes, not time: they share the GPU; oom and costs run alone after
  part train 200 & part compare 200 & wait
  part oom 70
  part costs 200 ;;
two)
  part speed ${2:-400} ;;
esac
el done
