#!/usr/bin/env bash
# Tensor parallelism on GPU: greedy equality of tp 2 with tp 1, and the decode step latency of the
# llama-3.1-8b preset (dummy weights, bfloat16) at tp 1 and tp 2, in one device call.
#   bench/tp.sh [1|2|all]    1: the single-GPU part only (tp 1); 2: tp 2 only; all (default): both,
#                            then the comparison and the tensor-parallel GPU tests (needs 2 GPUs)
# Expects the site archive (../shared/device/make-site.sh) carried as .device/, like gpu_suite.sh.
# Writes tp1.json / tp2.json and logs under $OUT; prints the comparison and latency table last.
set -uo pipefail
what=${1:-all}
. "$(dirname "$0")/device_env.sh"
num_gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
case "$what" in
  1) sizes="1" ;;
  2) sizes="2" ;;
  *) sizes="1 2" ;;
esac
status=0
for tp in $sizes; do
  if [ "$tp" -gt "$num_gpus" ]; then
    echo "tp $tp: skipped, this machine has $num_gpus GPU(s)"
    continue
  fi
  python3 bench/tp.py run --tp-size "$tp" --out "$out/tp$tp.json" 2>&1 | tee "$out/tp$tp.log" | tail -8
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
if [ "$what" = all ] && [ -f "$out/tp1.json" ] && [ -f "$out/tp2.json" ]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/distributed/test_tp.py 2>&1 | tee "$out/tp_tests.log" | tail -15
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  python3 bench/tp.py compare "$out/tp1.json" "$out/tp2.json" || status=1
fi
exit $status
