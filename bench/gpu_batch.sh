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
exit $status
