"""`python -m jaxrl_llm.train --gin_file=gin/grpo_qwen7b.gin [--gin_param='train.total_epochs=3'] ...`

Flags: `--gin_file` (repeatable), `--gin_param` (repeatable), and the t5x shorthand
`--gin.train.total_epochs=3`. Config errors (a bad binding, an unknown name, a missing required
value, an invalid value) fail in the first second, before any model is loaded, with one line that
names the binding. The operative config is written to `<run_dir>/operative_config.gin`.

Several processes (one per host or per GPU; SLURM, mpirun, `python -m jaxrl_llm.launch`) each run this
command with `--coordinator_address`, `--num_processes` and `--process_id` (or the environment variables
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID; SLURM's are read too). With
`train.driver = 'ray'` and `train.num_processes > 1`, one command starts the processes as Ray actors.
"""

from __future__ import annotations

import argparse
import glob
import io
import logging
import os
import re
import shutil
import sys
import tokenize

import gin

from jaxrl_llm.trainer.config.keys import LIST_HINT, format_keys, hint, operative_config
from jaxrl_llm.trainer.processes.process import run_process, setup_logging

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

log = logging.getLogger("jaxrl_llm")


class UsageError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage and sys.exit(2) out of main()
        raise UsageError(f"{message} (see --help)")


def _epilog() -> str:
    recipes = sorted(os.path.relpath(p, REPO_ROOT) for p in glob.glob(os.path.join(REPO_ROOT, "gin", "*.gin"))
                     if os.path.basename(p) != "base.gin")
    return ("Keys: every gin key (actor.lr, train.total_epochs, ...) with its default and doc:\n"
            "  python -m jaxrl_llm.train --list_keys          (or --list_keys=actor for the keys containing 'actor')\n"
            "Bindings: --gin_param='train.total_epochs=3' or the shorthand --gin.train.total_epochs=3; strings\n"
            "  keep their gin quotes: --gin.model.path=\"'/models/Qwen2.5-7B'\". veRL's trainer.* is train.* here,\n"
            "  actor_rollout_ref.actor.* is actor.*, actor_rollout_ref.rollout.* is rollout.*.\n"
            "Recipes (--gin_file): " + ", ".join(recipes))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _ArgumentParser(prog="python -m jaxrl_llm.train", description=__doc__.split("\n")[0],
                             epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gin_file", action="append", default=[], help="gin file (repeatable)")
    parser.add_argument("--gin_param", action="append", default=[], help="gin binding (repeatable)")
    parser.add_argument("--list_keys", nargs="?", const="", default=None, metavar="FILTER",
                        help="print every config key (or those containing FILTER) with its default and doc, then exit")
    parser.add_argument("--log_level", default="INFO")
    parser.add_argument("--coordinator_address", default=None, help="HOST:PORT of process 0 (multi-process)")
    parser.add_argument("--num_processes", type=int, default=None, help="processes in the run")
    parser.add_argument("--process_id", type=int, default=None, help="this process's index, 0-based")
    parser.add_argument("--local_device_ids", default=None, help="this process's devices, e.g. 0,1")
    args, rest = parser.parse_known_args(argv)
    for arg in rest:  # t5x shorthand: --gin.train.total_epochs=3
        if arg.startswith("--gin.") and "=" in arg:
            args.gin_param.append(arg[len("--gin."):])
        elif not arg.startswith("-") and "=" in arg:  # veRL's (Hydra's) KEY=VALUE
            advice = hint(arg.split("=", 1)[0])
            parser.error(f"unrecognized argument {arg!r}: bindings go in --gin.KEY=VALUE or --gin_param='KEY=VALUE'"
                         + (f"; {advice}" if advice else ""))
        else:
            parser.error(f"unrecognized argument {arg!r}")
    if args.list_keys is not None:
        return args
    if not args.gin_file:
        parser.error("give at least one --gin_file (e.g. gin/grpo_tiny.gin)")
    return args


def parse_config(gin_files: list[str], gin_params: list[str]):
    """Parses gin files and bindings, then builds and validates the RunConfig."""
    import jaxrl_llm.configurables  # noqa: F401  (registers every configurable)
    from jaxrl_llm.trainer.config import ConfigValueError, build_run_config

    gin.add_config_file_search_path(REPO_ROOT)
    gin.add_config_file_search_path(os.getcwd())
    for path in gin_files:
        if not os.path.exists(path) and not os.path.exists(os.path.join(REPO_ROOT, path)):
            raise UsageError(f"--gin_file {path}: no such file")
    try:
        gin.parse_config_files_and_bindings(gin_files, gin_params, finalize_config=False)
        return build_run_config()
    except ConfigValueError as e:
        raise UsageError(f"config: {e}") from None
    except tokenize.TokenError:  # an unclosed bracket or quote; gin's message names no binding
        bad = [p for p in gin_params if not _tokenizes(p)] or gin_files
        raise UsageError(f"config: cannot parse {bad[0]!r}: an unclosed bracket or quote") from None
    except (ValueError, KeyError, TypeError, OSError, SyntaxError) as e:
        msg = [m.strip() for m in str(e).strip().splitlines() if m.strip()]
        raise UsageError(_unknown_key(msg) or f"config: {' / '.join(msg)}") from None


def _unknown_key(msg: list[str]) -> str | None:
    """gin's 'no such configurable / parameter' error as one line naming the key, where it was bound, and the
    nearest key (or ours for a veRL spelling)."""
    m = re.match(r"Configurable '([\w.]+)' doesn't have a parameter named '(\w+)'", msg[0])
    if m:
        key = f"{m.group(1)}.{m.group(2)}"
    elif msg[0].startswith("No configurable matching"):
        binding = next((line for line in reversed(msg) if re.match(r"^[\w.]+\s*=", line)), "")
        key = binding.split("=", 1)[0].strip()
    else:
        return None
    where = next((line[3:] for line in msg if line.startswith("In ")), "")
    advice = hint(key) if key else ""
    where = f" ({where})" if where else ""
    return f"config: unknown key {key or msg[0]}{where}{'; ' + advice if advice else ''} ({LIST_HINT})"


def _tokenizes(text: str) -> bool:
    try:
        list(tokenize.generate_tokens(io.StringIO(text).readline))
        return True
    except tokenize.TokenError:
        return False


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that describe bad input (printed as one line), as opposed to bugs (tracebacks)."""
    from jaxrl_llm.agent.env import EnvError
    from jaxrl_llm.agent.loop import AgentLoopError
    from jaxrl_llm.agent.render import RenderError
    from jaxrl_llm.agent.tool_schema import ToolSchemaError
    from jaxrl_llm.agent.tools import ToolConfigError
    from jaxrl_llm.checkpoint import CheckpointSaveError
    from jaxrl_llm.data import DataError
    from jaxrl_llm.distributed import DistributedError
    from jaxrl_llm.models import CheckpointError, ConfigError
    from jaxrl_llm.rewards import RewardConfigError, RewardError
    from jaxrl_llm.rollout import RolloutError
    from jaxrl_llm.sharding import MeshError
    from jaxrl_llm.trainer.config import ConfigValueError

    return (DataError, CheckpointError, ConfigError, ConfigValueError, RewardConfigError, RewardError, RolloutError,
            MeshError, CheckpointSaveError, FileNotFoundError, UsageError, DistributedError, EnvError, AgentLoopError,
            RenderError, ToolSchemaError, ToolConfigError)


def _one_line(e: BaseException) -> str:
    """The message on one line, without the "In call to configurable ..." lines that gin appends."""
    lines = [line.strip() for line in str(e).splitlines()]
    return " / ".join(line for line in lines if line and not line.startswith("In call to configurable"))


def main(argv: list[str] | None = None) -> int:
    # The trainer owns its GPUs (a vLLM pool runs in other processes): let XLA use more of the memory
    # than its 75% default, which decides whether remat 'dots' fits (model.remat = 'auto').
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        from jaxrl_llm import distributed

        spec = distributed.spec_from_env(args.coordinator_address, args.num_processes, args.process_id,
                                         args.local_device_ids)
    except (UsageError, ValueError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    if args.list_keys is not None:
        print(format_keys(args.list_keys or None))
        return 0
    setup_logging(args.log_level, spec.process_id)
    run_dir = None
    created = False
    try:
        run = parse_config(args.gin_file, args.gin_param)
        simulate_async_devices(run)
        run_dir = run.trainer.run_dir
        # Checked before the processes join, so no other process of this run has made it yet.
        created = not os.path.exists(run_dir) and spec.process_id == 0
        n = run.trainer.num_processes
        if spec.multi and n not in (1, spec.num_processes):
            raise UsageError(f"train.num_processes={n} but {spec.num_processes} processes were started "
                             "(--num_processes); make them agree or leave train.num_processes at 1")
        try:
            if not spec.multi and n > 1:
                if run.trainer.driver != "ray":
                    raise UsageError(f"train.num_processes={n} with train.driver='inprocess': start the processes "
                                     f"with `python -m jaxrl_llm.launch --num_processes {n} -- <these flags>` (or "
                                     "once per host with --coordinator_address/--num_processes/--process_id), "
                                     "or use train.driver='ray'")
                from jaxrl_llm.trainer.processes.ray_driver import fit_on_ray

                fit_on_ray(run, operative_config(run), log_level=args.log_level)
            else:
                run_process(run, operative_config(run), spec)
        except BaseException:
            if created and _is_stub(run_dir):  # failed before any step was logged or saved: leave no stub
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
    except UsageError as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except user_errors() as e:
        print(f"error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 2
    return 0


def simulate_async_devices(run) -> None:
    """An async run on a CPU needs a device for the rollout beside the trainer's: unless XLA_FLAGS says otherwise,
    the CPU backend gets as many simulated devices as the split asks for (no effect on a GPU backend)."""
    a, r, t = run.async_training, run.rollout, run.trainer
    flags = os.environ.get("XLA_FLAGS", "")
    if not a.enabled or "xla_force_host_platform_device_count" in flags or not t.n_gpus_per_node:
        return
    count = r.n_gpus_per_node * r.nnodes + t.n_gpus_per_node * t.nnodes
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def _is_stub(run_dir: str) -> bool:
    """A run dir with nothing a rerun or a reader needs: no checkpoint, no logged step."""
    ckpt = os.path.join(run_dir, "checkpoints")
    if os.path.isdir(ckpt) and os.listdir(ckpt):
        return False
    metrics = os.path.join(run_dir, "metrics.jsonl")
    return not (os.path.exists(metrics) and os.path.getsize(metrics) > 0)


if __name__ == "__main__":
    sys.exit(main())
