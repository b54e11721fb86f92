"""The benchmark harness: options resolve per section, sections that need their own process get one, and a
section runs end to end through the command line into bench.json."""

import json

import pytest

from jaxrl_llm.bench import __main__ as cli
from jaxrl_llm.bench.harness import OPTIONS, SECTIONS


def _opts(*argv):
    return cli.parser().parse_args(["--sections", "e2e", *argv])


def test_every_section_default_is_a_declared_option():
    dests = {flag.lstrip("-") for flag in OPTIONS} | {"out", "small", "small_preset", "compile_cache"}
    for name, sec in SECTIONS.items():
        assert set(sec.defaults) <= dests, (name, set(sec.defaults) - dests)
    assert {"e2e", "gen", "memory", "moe_update", "decode_kernel", "torch"} <= set(SECTIONS)


def test_an_option_comes_from_the_command_line_then_the_section_then_its_own_default():
    e2e, gen = SECTIONS["e2e"], SECTIONS["gen"]
    assert cli.resolve(_opts(), e2e).token_budget == 32768  # the e2e section's default
    assert cli.resolve(_opts("--token_budget", "16384"), e2e).token_budget == 16384
    assert cli.resolve(_opts(), gen).presets == "qwen2p5_7b" and cli.resolve(_opts(), gen).repeats == 2
    assert cli.resolve(_opts(), SECTIONS["lora_sync"]).repeats == 3
    assert cli.resolve(_opts(), e2e).steps == 3  # no section sets it: the option's default


def test_per_process_sections_split_into_one_process_each():
    opts = _opts("--presets", "qwen2p5_7b,qwen3_8b", "--engines", "paged")
    assert cli.units(SECTIONS["gen"], opts) == [{"presets": "qwen2p5_7b", "engines": "paged", "devices": "1"},
                                                {"presets": "qwen3_8b", "engines": "paged", "devices": "1"}]
    two = _opts("--presets", "qwen2p5_7b", "--engines", "paged", "--devices", "1,2")  # one GPU, then two
    assert [u["devices"] for u in cli.units(SECTIONS["gen"], two)] == ["1", "2"]
    assert cli.units(SECTIONS["e2e"], opts) == [{}]
    assert SECTIONS["e2e"].in_process and not SECTIONS["gen"].in_process
    assert SECTIONS["lora_sync"].env["JAX_PLATFORMS"] == "cpu"  # vLLM on the CPU, set before JAX starts


def test_a_section_runs_from_the_command_line(tmp_path, capsys):
    cli.main(["--sections", "logprob", "--small", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = report["results"]
    assert [r["impl"] for r in rows] == ["chunked", "naive"] and all(r["section"] == "logprob" for r in rows)
    assert all(r["fwd_ms"] > 0 and r["fwd_gb"] > 0 for r in rows)
    assert report["meta"]["device"] and report["meta"]["commit"]
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 2
    assert "**logprob**" in (tmp_path / "bench.md").read_text()


def test_an_unknown_section_is_one_clear_error():
    with pytest.raises(SystemExit, match="unknown section.*'e2f'.*known"):
        cli.main(["--sections", "e2f"])


def test_the_results_go_where_out_says_whatever_the_environment(monkeypatch):
    """$OUT is a variable of the lent GPU machines' tool, meaningless to a user: the directory comes from --out."""
    monkeypatch.setenv("OUT", "/somewhere/else")
    assert cli.parser().parse_args(["--sections", "list"]).out == "/tmp/bench_out"
    assert cli.parser().parse_args(["--sections", "list", "--out", "/tmp/x"]).out == "/tmp/x"
