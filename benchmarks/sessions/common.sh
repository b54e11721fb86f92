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
  echo "rc=$?"; grep -E '^  \[|RLTrainer built|"(e2e|sync|seed_gen|gen|long|memory|sync_split|async_longtail|async_longtail_summary)"|Error' "$OUT/$name.log" | cut -c1-420
  cp "/tmp/out_$name/bench.json" "$OUT/$name.json" 2>/dev/null
  cp "/tmp/out_$name/rows.jsonl" "$OUT/$name.rows.jsonl" 2>/dev/null  # the rows so far, if it timed out
  return 0
}
