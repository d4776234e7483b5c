#!/usr/bin/env bash
# One lent GPU session's two prepared device calls (docs/GPU.md), from the project root, after
# `bash launch_scripts/gpu_wheels.sh .whl` here and with `.whl` carried:
#   bash launch_scripts/gpu_session.sh one     install; on a GPU without a kernel table, kernels first (its table
#                                              prices costs and layers); train and compare together (they measure
#                                              bytes, not time), then oom, costs and layers alone: ~6.5 min on an H200
#   bash launch_scripts/gpu_session.sh kernels install; bench/gpu_kernels.py (~2 minutes): the GPU's kernel table
#                                              into ds_pipe_ext/costs/kernels/ and OUT/kernels/
#   bash launch_scripts/gpu_session.sh two     install; backends (which attention kernel each family runs, the
#                                              chunked loss's bf16 parity; no launch), then speed (uninstrumented,
#                                              each run's last step profiled): about 7 minutes
#   bash launch_scripts/gpu_session.sh three   install; pipe: the speed models through DeepSpeed's pipeline engine
#                                              with one stage, against speed's rows in the same OUT: ~4 minutes
#   bash launch_scripts/gpu_session.sh rest    install; train and compare together, then oom, hf and layers: the
#                                              parts a first session left unmeasured, about 8 minutes
#   bash launch_scripts/gpu_session.sh PART..  install; those parts one after another
# Each part writes OUT/PART.log (OUT: $OUT, the device's hand-back folder) and its records under OUT/gpu-path;
# a line per launch and the part's RESULT are echoed as it ends.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-session}
start=$(date +%s)
elapsed() { echo "[+$(( $(date +%s) - start )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | grep -v WARNING | tail -3
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c "import sys, torch, deepspeed; print(sys.version.split()[0], torch.__version__, deepspeed.__version__, torch.cuda.get_device_name())"
mkdir -p "$OUT/gpu-path"
# seconds each part may take: measured on an H200 (2026-11-27) with room; a gpt3-1.3b launch needs ~55 s to
# its first step, so oom's launch needs more than a minute before its out-of-memory error
declare -A LIMIT=([train]=200 [compare]=200 [oom]=200 [costs]=200 [speed]=420 [layers]=150 [hf]=120 [offload]=300
                  [kernels]=180 [pipe]=300 [backends]=120)
kernels() {  # the GPU's kernel table, kept in the package (the cost model reads it) and handed back
  elapsed "start kernels (limit ${LIMIT[kernels]} s)"
  timeout -k 10 "${LIMIT[kernels]}" python3 bench/gpu_kernels.py > "$OUT/kernels.log" 2>&1
  elapsed "end kernels rc=$?"
  mkdir -p "$OUT/kernels" && cp ds_pipe_ext/costs/kernels/*.json "$OUT/kernels/" 2>/dev/null
  grep -E 'RESULT|wrote' "$OUT/kernels.log" | cut -c1-300
}
has_table() {
  python3 -c "import sys, torch; from ds_pipe_ext.costs.hardware import datasheet_name; \
from ds_pipe_ext.costs.kernel_table import load_kernel_table; \
key = datasheet_name(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory); \
sys.exit(0 if key and load_kernel_table(key) else 1)" 2>/dev/null
}
part() {
  [ "$1" = kernels ] && { kernels; return; }
  elapsed "start $1 (limit ${LIMIT[$1]} s)"
  timeout -k 10 "${LIMIT[$1]}" python3 bench/gpu_path.py --parts "$1" --out "$OUT/gpu-path" > "$OUT/$1.log" 2>&1
  elapsed "end $1 rc=$?"
  grep -E '^\s+\[|RESULT|^[a-z]+: [0-9]+ s' "$OUT/$1.log" | cut -c1-300
}
case ${1:-one} in
  one) has_table || kernels; part train & part compare & wait; part oom; part costs; part layers ;;
  two) part backends; part speed ;;
  three) part pipe ;;
  rest) part train & part compare & wait; part oom; part hf; part layers ;;
  *) for p in "$@"; do part "$p"; done ;;
esac
elapsed done
