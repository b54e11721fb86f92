# Sourced by the session scripts: installs the carried wheels (gin, tensorboardX) and defines
# run NAME TIMEOUT COMMAND...: runs COMMAND with `--out /tmp/out_NAME`, logs to $OUT/NAME.log, prints
# its progress and result rows, and copies its JSON results (and the rows written before any timeout) to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
run() {
  local name=$1 t=$2; shift 2
  echo "=== $name"
  timeout "$t" "$@" --out "/tmp/out_$name" > "$OUT/$name.log" 2>&1
  echo "rc=$?"; grep -E '^  \[|RLTrainer built|"(e2e|e2e_build|sync|seed_gen|gen|long|memory|sync_split|async_longtail|async_longtail_summary)"|Error' "$OUT/$name.log" | cut -c1-420
  cp "/tmp/out_$name/bench.json" "$OUT/$name.json" 2>/dev/null
  cp "/tmp/out_$name/rows.jsonl" "$OUT/$name.rows.jsonl" 2>/dev/null  # the rows so far, if it timed out
  return 0
}
# The persistent compilation cache across calls and sessions. A lent machine starts bare, and a cold call spent
# most of its time compiling (the 9B's generation: 210-246 s of its first repeat, 2026-11-28). A call may bring the
# cache back: PACK_CACHE=<max MB> (45 leaves room beside .bench_data in the 64 MiB a call carries) packs it into
# $OUT when the script exits, in parts of at most 15 MB (a call brings back 8 files at most: the parts count). Copy
# them into .xla_cache/ here (git ignores it) and name .xla_cache in the next call's `carry`: `restore_cache`
# unpacks them. Programs whose code changed since miss and compile as before.
XLA_CACHE=${XLA_CACHE:-/tmp/jaxrl_xla_cache}
restore_cache() {
  mkdir -p "$XLA_CACHE"
  if ls .xla_cache/xla_cache.tgz.part_* > /dev/null 2>&1; then
    cat .xla_cache/xla_cache.tgz.part_* | tar -xz -C "$XLA_CACHE" && \
      echo "xla cache: $(find "$XLA_CACHE" -type f | wc -l) files restored ($(du -sm "$XLA_CACHE" | cut -f1) MB)"
  fi
}
pack_cache() {  # pack_cache [MAX_MB]: the cache into $OUT's parts, where it fits what a call brings back
  local max=${1:-45} mb
  mb=$(du -sm "$XLA_CACHE" 2>/dev/null | cut -f1)
  if [[ -z "$mb" ]]; then return 0; fi
  if (( mb > max )); then echo "xla cache: ${mb} MB, over the ${max} MB to bring back: not packed"; return 0; fi
  tar -cz -C "$XLA_CACHE" . | split -b 15m - "$OUT/xla_cache.tgz.part_"
  echo "xla cache: ${mb} MB packed into $(ls "$OUT"/xla_cache.tgz.part_* | wc -l) parts"
}
restore_cache
if [[ -n "${PACK_CACHE:-}" ]]; then trap 'pack_cache "$PACK_CACHE"' EXIT; fi
