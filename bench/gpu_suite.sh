#!/usr/bin/env bash
# Runs the GPU tests and benchmarks of one area (or all) in one device call.
#   bench/gpu_suite.sh [tests|bench|all] [pytest -k expression]
# More than one device call's 10 minutes in all: run `tests` and `bench` as two calls on a warm machine.
# Tensor parallelism has its own script: bench/tp.sh.
# Expects the site archive (../shared/device/make-site.sh) carried as .device/.
# Writes logs and JSON under $OUT and prints a short table last.
set -uo pipefail
what=${1:-all}
kexpr=${2:-}
. "$(dirname "$0")/device_env.sh"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
python3 -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' 2>/dev/null || echo "flashinfer: not importable"
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu ${kexpr:+-k "$kexpr"} 2>&1 | tee "$out/gpu_tests.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 bench/attention.py --out "$out/attention.json" 2>&1 | tee "$out/attention.log" | tail -30
  python3 bench/graph_runner.py --out "$out/graph_runner.json" 2>&1 | tee "$out/graph_runner.log" | tail -20
  python3 bench/lora.py --out "$out/lora.json" 2>&1 | tee "$out/lora.log" | tail -10
  python3 bench/spec.py --backend triton --out "$out/spec.json" 2>&1 | tee "$out/spec.log" | tail -10
  python3 bench/e2e.py --out "$out/e2e.json" 2>&1 | tee "$out/e2e.log" | tail -12
fi
grep -E "passed|failed" "$out/gpu_tests.log" 2>/dev/null | tail -1
exit $status
