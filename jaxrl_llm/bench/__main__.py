"""python -m jaxrl_llm.bench --sections NAME[,NAME...] [--out DIR] [options]: every benchmark, one command.

`--sections list` prints the sections, what each measures and its defaults. Rows go to stdout (JSON lines)
and to DIR/rows.jsonl, bench.json ({"meta", "results"}) and bench.md. `--small` swaps in tiny shapes to
check a section on a CPU.

Sections that need their own process (their own environment, device-memory share, or one process per
preset so each reports its own peak) make every section of the command run in a child process of its own;
otherwise they run here, in order, sharing what earlier ones measured (the ceilings, the attention choice).
Multi-process (one process per GPU): `python -m jaxrl_llm.launch --num_processes 4 --gpus_per_process 1
--module jaxrl_llm.bench -- --sections e2e ...`; every process runs the sections, process 0 writes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import traceback

from jaxrl_llm.bench import harness
from jaxrl_llm.bench.harness import OPTIONS, ROWS, SECTIONS, emit

MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxrl_llm.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", required=True, help="comma-separated section names, or 'list'")
    ap.add_argument("--out", default="/tmp/bench_out", help="the results' directory")
    ap.add_argument("--small", action="store_true", help="tiny shapes, to check a section on a CPU")
    ap.add_argument("--small_preset", default="tiny", help="--small: the tiny preset (tiny, or tiny_moe for a MoE)")
    ap.add_argument("--compile_cache", default="", help="JAX's persistent compilation cache dir ('' = off)")
    ap.add_argument("--append", default=None, help="also append the markdown tables to this file")
    ap.add_argument("--xla_gpu_overlap", action="store_true",
                    help="XLA's collective-overlap options on a GPU (train.xla_gpu_overlap: jaxrl_llm/xla_flags.py)")
    ap.add_argument("--log_level", default="INFO", help="the log's level (INFO shows where a build's time goes: the "
                    "memory check, the programs compiled ahead on both sides)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # run here, whatever the sections
    for flag, (_, kw) in OPTIONS.items():
        ap.add_argument(flag, **({} if kw.get("action") == "store_true" else {"default": None}), **kw)
    return ap


def resolve(opts: argparse.Namespace, sec) -> argparse.Namespace:
    """`opts` with every option left unset taken from `sec`'s defaults, else the option's own default."""
    values = vars(opts).copy()
    for flag, (default, _) in OPTIONS.items():
        dest = flag.lstrip("-").replace("-", "_")
        if values.get(dest) is None:
            values[dest] = sec.defaults.get(dest, default)
    return argparse.Namespace(**values)


def units(sec, opts) -> list[dict]:
    """The per-process splits of `sec`: one dict of option values per process (one `{}` when it has none)."""
    if not sec.per_process:
        return [{}]
    r = resolve(opts, sec)
    values = [str(getattr(r, k)).split(",") for k in sec.per_process]
    return [dict(zip(sec.per_process, combo)) for combo in itertools.product(*values)]


def run_here(secs, opts) -> None:
    for s in secs:
        for k, v in s.env.items():
            os.environ.setdefault(k, v)
    fractions = {s.mem_fraction for s in secs}
    if len(fractions) == 1 and None not in fractions:
        os.environ.setdefault(MEM_FRACTION, fractions.pop())
    uses_jax = all(s.uses_jax for s in secs)
    if not uses_jax and any(s.uses_jax for s in secs):
        raise SystemExit("jaxrl_llm.bench: the torch section runs in a command of its own (JAX would hold the "
                         "GPU's memory)")
    if uses_jax:
        import jax

        from jaxrl_llm import distributed
        from jaxrl_llm.trainer.processes.process import enable_compilation_cache

        if os.environ.get("JAX_PLATFORMS"):
            jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
        distributed.initialize(distributed.spec_from_env())  # the launcher's processes join here
        enable_compilation_cache(opts.compile_cache)
    meta = harness.meta(uses_jax)
    print(json.dumps(meta), flush=True)
    ROWS.path = os.path.join(opts.out, "rows.jsonl")
    if opts.torch_results:
        from jaxrl_llm.bench.model import torch_rows

        torch_rows(opts.torch_results)
    for s in secs:
        try:
            s.fn(resolve(opts, s))
        except Exception as e:  # one section failing does not stop the others
            traceback.print_exc()
            emit(section=s.name, error=f"{type(e).__name__}: {str(e)[:300]}")
        if harness.process_index() == 0:
            harness.write_results(opts.out, meta, ROWS.rows)
    finish(opts, meta)


def run_children(secs, opts, argv: list[str]) -> None:
    """Each section (and each of its per-process splits) in a child process with its own environment."""
    meta = None
    for s in secs:
        for unit in units(s, opts):
            tag = "_".join([s.name] + list(unit.values()))
            out = os.path.join(opts.out, tag)
            extra = [x for k, v in unit.items() for x in (f"--{k}", v)]
            cmd = [sys.executable, "-m", "jaxrl_llm.bench", *argv, "--sections", s.name, "--out", out, "--child",
                   *extra]
            env = dict(os.environ)
            for k, v in s.env.items():
                env.setdefault(k, v)
            if s.mem_fraction:
                env.setdefault(MEM_FRACTION, s.mem_fraction)
            rc = subprocess.run(cmd, env=env).returncode
            path = os.path.join(out, "bench.json")
            if os.path.exists(path):
                with open(path) as f:
                    got = json.load(f)
                meta = meta or got["meta"]
                ROWS.rows += got["results"]
            if rc:
                emit(section=s.name, **unit, error=f"process exited {rc}")
            if meta:
                harness.write_results(opts.out, meta, ROWS.rows)
    if meta:
        finish(opts, meta)


def finish(opts, meta: dict) -> None:
    if harness.process_index() != 0:
        return
    md = harness.markdown(ROWS.rows, meta)
    if opts.append:
        with open(opts.append, "a") as f:
            f.write("\n" + md)
    print(md)


def list_sections() -> str:
    lines = []
    for name, s in SECTIONS.items():
        defaults = ", ".join(f"{k}={v}" for k, v in s.defaults.items())
        lines.append(f"{name:<20} {s.help}" + (f"\n{'':<20} defaults: {defaults}" if defaults else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parser().parse_args(argv)
    if opts.sections == "list":
        print(list_sections())
        return
    names = opts.sections.split(",")
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise SystemExit(f"jaxrl_llm.bench: unknown section(s) {unknown}; known:\n{list_sections()}")
    secs = [SECTIONS[n] for n in names]
    os.makedirs(opts.out, exist_ok=True)
    if opts.xla_gpu_overlap and not opts.child:  # before JAX starts here or in a child (which inherits them)
        from jaxrl_llm.xla_flags import apply_gpu_overlap

        apply_gpu_overlap(True)
    from jaxrl_llm.trainer.processes.process import setup_logging

    setup_logging(opts.log_level)
    if opts.child or (all(s.in_process for s in secs) and len({s.mem_fraction for s in secs}) == 1):
        run_here(secs, opts)
    else:
        run_children(secs, opts, [a for a in argv])


if __name__ == "__main__":
    main()
