#!/usr/bin/env bash
# Several bench/gpu_suite.sh parts in one device call, each writing under $OUT/<part>/, then one
# archive of everything ($OUT/results.tar.gz, since a call brings back at most 8 files) and every
# part's summary table last.
#   bench/gpu_batch.sh lora-fused http prefix-cache
set -uo pipefail
top=${OUT:-/tmp/out}
status=0
for part in "$@"; do
  OUT="$top/$part" bash "$(dirname "$0")/gpu_suite.sh" "$part" > "$top/$part.stdout" 2>&1 || status=1
done
for part in "$@"; do
  echo "=== $part"; grep -E "^(FAILED|ERROR)" "$top/$part"/*.log 2>/dev/null | head -20
  tail -n "${BATCH_TAIL:-25}" "$top/$part.stdout"
done
(cd "$top" && tar -czf /tmp/results.tar.gz ./* && rm -rf ./* && mv /tmp/results.tar.gz .)
if [ -n "${SAVE_FLASHINFER_AOT:-}" ]; then
  # Every FlashInfer module this machine JIT-built, as <name>/<name>.so (the layout of FlashInfer's
  # AOT directory), xz-compressed in parts of at most 15 MB: move them into .device/ here and
  # bench/device_env.sh installs them on the next machine.
  jit=$(ls -d ~/.cache/flashinfer/*/*/cached_ops 2>/dev/null | head -1)
  if [ -n "$jit" ]; then
    (cd "$jit" && find . -mindepth 2 -maxdepth 2 -name '*.so' | sed 's|^\./||' | sort > /tmp/aot-list)
    tar -cf - -C "$jit" -T /tmp/aot-list | xz -T0 -6 | split -b 15M - "$top/flashinfer-aot.tar.xz.part-"
    echo "flashinfer JIT modules saved: $(wc -l < /tmp/aot-list), $(du -ch "$top"/flashinfer-aot.tar.xz.part-* | tail -1 | cut -f1) compressed"
  fi
fi
exit $status
