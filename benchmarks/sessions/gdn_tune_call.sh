#!/usr/bin/env bash
# Issue 43, one call on one H100: the linear layers' decode step timed at each launch form
# (benchmarks/diag/gdn_decode_tune.py, 256 and 545 rows), then the 9B's and the 7B's generation at the seed's share
# with the fastest correct form at 545 rows (JAXRL_GDN_DECODE_FORM), one measured repeat each.
source "$(dirname "$0")/common.sh"
timeout 150 python3 benchmarks/diag/gdn_decode_tune.py 256 545 > "$OUT/tune.log" 2>&1; echo "tune rc=$?"
grep '^{' "$OUT/tune.log" | cut -c1-260
FORM=$(python3 - "$OUT/tune.log" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{"section": "gdn_decode"') and '"ms"' in l]
ok = [r for r in rows if r["rows"] == 545 and r["err_o"] < 0.05 and r["err_state"] < 0.05]
best = min(ok, key=lambda r: r["ms"]) if ok else None
print(f'{best["block_v"]},{best["num_warps"]},{int(best["skip_dead"])}' if best else "32,4,0")
PY
)
echo "FORM=$FORM"; export JAXRL_GDN_DECODE_FORM=$FORM
C=$XLA_CACHE  # common.sh's: restored from .xla_cache where carried
run gen9b_after "${T_9B:-300}" python3 -m jaxrl_llm.bench --sections gen --presets qwen3_5_9b --engines paged \
  --repeats 1 --compile_cache $C
run gen7b_after "${T_7B:-150}" python3 -m jaxrl_llm.bench --sections gen --presets qwen2p5_7b --engines paged \
  --repeats 1 --compile_cache $C
