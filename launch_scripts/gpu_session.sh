#!/usr/bin/env bash
# A lent GPU session's prepared device calls (docs/GPU.md), from the project root, after
# `bash launch_scripts/gpu_wheels.sh .whl` here and with `.whl` carried.  15 device-minutes hold two calls of
# ~8 minutes; the parts are ordered by what the open work needs first:
#   bash launch_scripts/gpu_session.sh one     install; on a GPU without a kernel table in the package, kernels
#                                              first (a record: the rules price the GPU); then backends (which
#                                              attention kernel each family runs; gpt-oss's fused sinks core against
#                                              the written-out one, first run on a GPU; the chunked loss's bf16
#                                              parity and liger-kernel over the head's real rows against its padded
#                                              rows masked; no launch), today (issue 77's families layer by layer,
#                                              their routed blocks taken apart) and layers: ~6 min on an H200
#   bash launch_scripts/gpu_session.sh two     install; speed (uninstrumented, each run's last step profiled), pipe
#                                              (the speed models through DeepSpeed's pipeline engine, one stage,
#                                              against speed's rows), then compare (ZeRO-0..3 bytes, the heaviest
#                                              row's memory trace) where the deadline leaves room: ~8 min
#   bash launch_scripts/gpu_session.sh rest    install; train, oom, hf, costs: what a new kind of GPU checks once
#   bash launch_scripts/gpu_session.sh kernels install; bench/gpu_kernels.py (~1 minute): the GPU's kernel table
#                                              into OUT/kernels/, a record (the package's tables price; it has none)
#   bash launch_scripts/gpu_session.sh PART..  install; those parts one after another
# A part that would run past DEADLINE_S (default 560: a 600 s call with room for the hand-back) is skipped with
# a line saying so, and runs in a later call: nothing is cut off half-written.
# Each part writes OUT/PART.log (OUT: $OUT, the device's hand-back folder) and its records under OUT/gpu-path;
# a line per launch and the part's RESULT are echoed as it ends.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-session}
DEADLINE_S=${DEADLINE_S:-560}
start=$(date +%s)
elapsed() { echo "[+$(( $(date +%s) - start )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | grep -v WARNING | tail -3
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c "import sys, torch, deepspeed; print(sys.version.split()[0], torch.__version__, deepspeed.__version__, torch.cuda.get_device_name())"
mkdir -p "$OUT/gpu-path"
# seconds each part may take (its timeout), and what it took on an H200 (2026-11-27; speed and pipe less the
# host initialisation their models no longer pay, ~20-30 s a gpt3-1.3b or 4-block Llama launch): the deadline
# check uses the second.  A gpt3-1.3b launch needed ~55 s to its first step, so oom's needs more than a minute.
declare -A LIMIT=([train]=200 [compare]=200 [oom]=200 [costs]=200 [speed]=420 [layers]=150 [hf]=120 [offload]=300
                  [kernels]=180 [pipe]=300 [backends]=120 [today]=420)
declare -A EXPECT=([train]=135 [compare]=185 [oom]=50 [costs]=80 [speed]=260 [layers]=40 [hf]=45 [offload]=240
                   [kernels]=60 [pipe]=170 [backends]=80 [today]=200)
fits() {  # whether part $1 is expected to end before the deadline
  local left=$(( DEADLINE_S - ($(date +%s) - start) ))
  [ "${EXPECT[$1]}" -le "$left" ] && return 0
  elapsed "skipped $1: ~${EXPECT[$1]} s expected, $left s left before the ${DEADLINE_S} s deadline; run it in a later call"
  return 1
}
kernels() {  # the GPU's kernel table, handed back as a record (the rules price the GPU: docs/CALIBRATION.md)
  elapsed "start kernels (limit ${LIMIT[kernels]} s)"
  mkdir -p "$OUT/kernels"
  local key
  key=$(python3 -c "import torch; from ds_pipe_ext.costs.hardware import datasheet_name; \
print(datasheet_name(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory) or 'gpu')")
  timeout -k 10 "${LIMIT[kernels]}" python3 bench/gpu_kernels.py --out "$OUT/kernels/$key.json" > "$OUT/kernels.log" 2>&1
  elapsed "end kernels rc=$?"
  grep -E 'RESULT|wrote' "$OUT/kernels.log" | cut -c1-300
}
has_table() {
  python3 -c "import sys, torch; from ds_pipe_ext.costs.hardware import datasheet_name; \
from ds_pipe_ext.costs.kernel_table import load_kernel_table; \
key = datasheet_name(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory); \
sys.exit(0 if key and load_kernel_table(key) else 1)" 2>/dev/null
}
# pipe compares with speed's rows; each call's OUT starts empty, so speed's records are also kept in
# runs/gpu-keep/ (ignored by git: kept on a warm machine, or carried: run's carry ["runs/gpu-keep"]) and pipe
# reads them there when its OUT has none (not copied into OUT: the records come back once)
KEEP=runs/gpu-keep
part() {
  fits "$1" || return 0
  [ "$1" = kernels ] && { kernels; return; }
  local extra=()
  [ "$1" = pipe ] && [ ! -f "$OUT/gpu-path/speed-records.json" ] && [ -f "$KEEP/speed-records.json" ] \
    && extra=(--speed-records "$KEEP/speed-records.json")
  elapsed "start $1 (limit ${LIMIT[$1]} s)"
  timeout -k 10 "${LIMIT[$1]}" python3 bench/gpu_path.py --parts "$1" --out "$OUT/gpu-path" ${extra[@]+"${extra[@]}"} \
    > "$OUT/$1.log" 2>&1
  elapsed "end $1 rc=$?"
  [ "$1" = speed ] && mkdir -p "$KEEP" && cp "$OUT/gpu-path/speed-records.json" "$KEEP/" 2>/dev/null
  grep -E '^\s+\[|RESULT|^[a-z]+: [0-9]+ s' "$OUT/$1.log" | cut -c1-300
}
case ${1:-one} in
  one) has_table || part kernels; part backends; part today; part layers ;;
  two) part speed; part pipe; part compare ;;
  rest) part train; part oom; part hf; part costs ;;
  *) for p in "$@"; do part "$p"; done ;;
esac
elapsed done
