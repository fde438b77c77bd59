#!/usr/bin/env bash
# One device call: GPU test areas, then bench groups, each under its own time limit, with the
# machine's cold costs carried between calls (FlashInfer's JIT modules, Triton's kernel cache).
#
#   carry: [".device"]   (.device/ is git-ignored: site.tar.xz from ../shared/device/make-site.sh,
#                         flashinfer-aot.tar.xz.part-*, triton-cache.tar.xz(.part-*) from earlier calls)
#   command: AREAS="extend:300 fp8:90 pool:60" BENCH="ttft:300 quant-decode:200" bash bench/gpu_suite.sh
#
# Write the commit first (the tree there has no git): git rev-parse --short HEAD > .device/commit
# AREAS: name:seconds of the test areas below (pytest -m gpu, faulthandler dump after FH seconds,
# XDIST workers if set);
# BENCH: group:budget of `python -m bench.run` (bench/run.py lists them). What comes back under
# $OUT: each area's pytest log, each group's archive, the FlashInfer modules and the Triton cache
# (copy both into .device/ for the next call). A fresh machine JIT-builds FlashInfer (about 25 s a
# module) and compiles every Triton kernel: the first call of a session pays minutes for that.
set -u
t00=$(date +%s)
[ -f .device/site.tar.xz ] && tar -xJf .device/site.tar.xz -C /tmp && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .device/triton-cache.tar.xz ] && tar -xJf .device/triton-cache.tar.xz -C "$TRITON_CACHE_DIR"
ls .device/triton-cache.tar.xz.part-* >/dev/null 2>&1 && cat .device/triton-cache.tar.xz.part-* | tar -xJ -C "$TRITON_CACHE_DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "from bench.run import prepare; print(*prepare(), sep='\n')"
OUT=${OUT:-$(mktemp -d)}
# NOTE: .device/commit first: the machine's copy of the tree may carry a stale git (2026-12-07: the
# session's first commit)
commit=$(cat .device/commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)

declare -A FILES=(
  [extend]="tests/gpu/test_extend_graphs_gpu.py tests/gpu/test_piecewise_gpu.py tests/lora/test_lora_extend_graphs.py tests/gpu/test_one_token_extend_gpu.py tests/executor/test_replay_inputs.py tests/gpu/test_overlap_gpu.py"
  [fp8]="tests/plugins/quant_fp8 tests/gpu/test_fp8_kv_gpu.py tests/attention/test_fp8_kv_decode_gpu.py tests/lora/test_lora_fp8_base.py"
  [models]="-k graphs tests/models/test_model_conformance.py tests/plugins/model_gemma tests/plugins/model_phi3 tests/plugins/test_newcomer_olmo2.py tests/plugins/model_moe/test_model_moe_conformance.py"
  [moe]="tests/plugins/moe_triton/test_moe_triton_gpu.py tests/plugins/moe_triton/test_moe_triton_fp8_gpu.py tests/plugins/model_moe/test_moe_gpu.py tests/testing/test_moe_conformance.py tests/moe"
  [windows]="tests/attention/test_tree_verify_window.py"
  [hostpath]="--deselect tests/gpu/test_graph_runner_gpu.py::test_second_runner_shares_the_pool tests/gpu/test_attention_flashinfer_gpu.py tests/gpu/test_greedy_sample_gpu.py tests/scheduler/test_launch_copy.py tests/gpu/test_attention_triton_gpu.py tests/gpu/test_graph_runner_gpu.py"
  [pool]="-k shares_the_pool tests/gpu/test_graph_runner_gpu.py"
  # what no GPU has run since the eleventh session's last call (ccd375d): the triggers in the triton decode
  # kernel and ops_triton's norm and SiLU (d0bda95, ece58ec; they ran inside engines and the matrix, not
  # under their own tests), the ROCm guard (9a2ed71), and the GPU modules moved onto tests/helpers_gpu.py
  # and tests/helpers_kv.py (71340d7)
  [recheck]="tests/gpu/test_attention_triton_gpu.py tests/gpu/test_ops_triton_gpu.py tests/attention/test_fp8_kv_decode_gpu.py tests/gpu/test_fp8_kv_gpu.py tests/plugins/quant_fp8/test_pdl_gpu.py"
)
# Areas that never run under XDIST: tests that read the device's free memory or the graph pool's growth
# (pytest workers share the one device: test_second_runner_shares_the_pool failed that way at 201eb06
# and passed alone at c27bdcf).
SERIAL=" pool "
for spec in ${AREAS:-}; do
  name=${spec%%:*} limit=${spec##*:} t0=$(date +%s)
  [ -z "${FILES[$name]:-}" ] && { echo "unknown area $name (known: ${!FILES[*]})"; continue; }
  # The CPU moe_triton files set TRITON_INTERPRET: never in the same run as these.
  # XDIST=n: n pytest workers on the one GPU (pytest-xdist is on the machine): a bare machine's cold
  # Triton compiles and FlashInfer JIT builds (most of a first call) then run n at a time.
  workers=${XDIST:-}; [[ "$SERIAL" == *" $name "* ]] && workers=
  timeout -s INT "$limit" python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=${FH:-120} ${workers:+-n $workers} \
    --durations=15 -rfE ${FILES[$name]} > "$OUT/pytest-$name.txt" 2>&1
  rc=$?
  echo "== $name rc $rc in $(( $(date +%s) - t0 )) s: $(grep -c ' PASSED' "$OUT/pytest-$name.txt") passed," \
       "$(grep -cE ' FAILED| ERROR' "$OUT/pytest-$name.txt") failed, $(grep -c ' SKIPPED' "$OUT/pytest-$name.txt") skipped"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest-$name.txt" | cut -c1-300 | head -8
done
for spec in ${BENCH:-}; do
  echo "== group ${spec%%:*} (budget ${spec##*:} s) at $(( $(date +%s) - t00 )) s"
  python3 -m bench.run "${spec%%:*}" --budget "${spec##*:}" --commit "$commit" 2>&1 | tail -${TAILN:-40}
done
python3 -c "from bench.run import save_flashinfer_aot; from pathlib import Path; import os; print(save_flashinfer_aot(Path(os.environ['OUT'])))"
tar -cf - -C "$TRITON_CACHE_DIR" . | xz -T0 -3 > /tmp/triton-cache.tar.xz
size=$(stat -c %s /tmp/triton-cache.tar.xz)
if [ "$size" -lt 15000000 ]; then cp /tmp/triton-cache.tar.xz "$OUT/"; echo "triton cache: $size bytes saved"
elif [ "$size" -lt 30000000 ]; then  # a file comes back up to 16 MB: two parts
  split -b 15000000 /tmp/triton-cache.tar.xz "$OUT/triton-cache.tar.xz.part-"; echo "triton cache: $size bytes saved in two parts"
else echo "triton cache: $size bytes, too large to bring back"; fi
n=$(find "$OUT" -maxdepth 1 -type f | wc -l)
if [ "$n" -gt 8 ]; then  # a call brings back 8 files: the rest would be lost
  tar -czf /tmp/suite-all.tar.gz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/suite-all.tar.gz "$OUT/"
  echo "$n files packed into all of $OUT/suite-all.tar.gz"
fi
echo "total $(( $(date +%s) - t00 )) s"
