"""The gen section's breakdown on the tiny Qwen3.5 (hybrid) model on the CPU: every repeat's row says where its
seconds went (the paged engine's phases, each with its calls), each program's compiled memory gets a row, and
`--profile` adds a traced generate's rows."""

import pytest

from jaxrl_llm.bench import gen
from jaxrl_llm.bench.harness import ROWS
from jaxrl_llm.rollout.shard import PHASES


@pytest.mark.slow
def test_gen_rows_break_a_hybrid_generation_into_phases_and_a_profile(own_rows, tmp_path):
    gen.one("tiny_qwen35", "paged", "gen", repeats=0, attention="auto", max_num_seqs=16, out_dir=str(tmp_path),
            do_profile=True, prompts=2, phase_timing=True, max_new=48)  # the rows' form, not the seed's lengths
    by = {}
    for r in ROWS.rows:
        by.setdefault(r["section"], []).append(r)
    (row,) = by["gen"]
    assert "error" not in row
    phases, calls = row["phase_s"], row["phase_calls"]
    assert set(PHASES) | {"prepare", "loop_other", "outside"} == set(phases)
    assert all(v >= 0 for v in phases.values())
    assert phases["decode"] > 0 and phases["prefill"] > 0 and phases["copy"] > 0  # 5 samples a prompt: state forks
    assert calls["decode"] == row["kv_segments"] and calls["prefill"] == row["kv_prefill_calls"]
    assert calls["copy"] >= 1 and row["kv_state_copies"] == 2 * 4  # each prompt's 4 later samples copy its state
    assert sum(phases.values()) <= row["seconds"] + 1e-3  # the engine's call inside the bench's clock
    assert sum(phases.values()) >= 0.9 * row["seconds"]  # and nothing large unaccounted for
    (traced,) = by["gen_profile_phases"]
    assert traced["phase_s"]["decode"] > 0
    (where,) = by["gen_profile_sorted"]
    assert where["span_ms"] > 0 and where["matmul_ms"] > 0
    assert by["gen_profile"] and by["gen_profile_by_kind"]
    programs = {r["program"] for r in by["gen_programs"]}  # each program's compiled memory, after repeat 0
    assert {"_decode", "_prefill", "_copy"} <= programs
    assert all(r["temp_gib"] >= 0 and r["args_gib"] > 0 for r in by["gen_programs"])
