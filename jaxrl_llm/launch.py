"""`python -m jaxrl_llm.launch --num_processes N [...] -- <train flags>`: N local training processes.

Starts `python -m jaxrl_llm.train <train flags>` N times on this host, joined by `jax.distributed`
through a coordinator on 127.0.0.1 (each child gets JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID). On GPUs, `--gpus_per_process K` gives process i the GPUs iK..iK+K-1
(CUDA_VISIBLE_DEVICES); on CPU, `--devices_per_process D` simulates D devices in each process.

It watches the children: when one fails or dies, it stops the others (SIGTERM, then SIGKILL) and exits
with that child's code and one line that says which process it was. A killed run resumes from its
last checkpoint when started again. For several hosts, run `python -m jaxrl_llm.train` once per host
with --coordinator_address/--num_processes/--process_id instead (or use the Ray driver).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(i: int, n: int, port: int, *, gpus_per_process: int | None,
              devices_per_process: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i))
    if gpus_per_process:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(i * gpus_per_process,
                                                                       (i + 1) * gpus_per_process))
    if devices_per_process:
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}".strip()
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(train_args: list[str], num_processes: int, *, gpus_per_process: int | None = None,
           devices_per_process: int | None = None, port: int | None = None, grace_s: float = 10.0,
           finish_timeout_s: float = 600.0, module: str = "jaxrl_llm.train") -> int:
    """Runs the processes to the end; returns 0, or the exit code of the first one that failed."""
    port = port or _free_port()

    def on_term(signum, frame):  # stopping the launcher stops its processes too
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    procs = [subprocess.Popen([sys.executable, "-m", module, *train_args],
                              env=child_env(i, num_processes, port, gpus_per_process=gpus_per_process,
                                            devices_per_process=devices_per_process))
             for i in range(num_processes)]
    first_exit = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                others = [p for p in procs if p.poll() is None]
                print(f"error: training process {i} of {num_processes} {_describe(code)}; stopping the other "
                      f"{len(others)} process(es). Rerun the same command to resume from the last checkpoint",
                      file=sys.stderr, flush=True)
                _stop(procs, grace_s)
                return code if code > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            if any(c == 0 for c in codes):
                first_exit = first_exit or time.time()
                if time.time() - first_exit > finish_timeout_s:
                    waiting = [i for i, c in enumerate(codes) if c is None]
                    print(f"error: processes {waiting} did not finish within {finish_timeout_s:.0f}s of the others; "
                          "stopping them", file=sys.stderr, flush=True)
                    _stop(procs, grace_s)
                    return 1
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(procs, grace_s)
        return 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        split = argv.index("--")
        own, train_args = argv[:split], argv[split + 1:]
    else:
        own, train_args = argv, []
    parser = argparse.ArgumentParser(prog="python -m jaxrl_llm.launch", description=__doc__.split("\n")[0])
    parser.add_argument("--num_processes", type=int, required=True)
    parser.add_argument("--gpus_per_process", type=int, default=None, help="GPUs of each process (CUDA)")
    parser.add_argument("--devices_per_process", type=int, default=None, help="simulated CPU devices a process")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    parser.add_argument("--grace_s", type=float, default=10.0, help="SIGTERM-to-SIGKILL wait when stopping")
    parser.add_argument("--module", default="jaxrl_llm.train",
                        help="the module each process runs (e.g. scripts.bench for a multi-process benchmark)")
    args = parser.parse_args(own)
    if args.num_processes < 1:
        parser.error("--num_processes must be >= 1")
    if not train_args:
        parser.error("give the training flags after `--`, e.g. -- --gin_file=gin/grpo_tiny.gin")
    return launch(train_args, args.num_processes, gpus_per_process=args.gpus_per_process,
                  devices_per_process=args.devices_per_process, port=args.port, grace_s=args.grace_s,
                  module=args.module)


if __name__ == "__main__":
    sys.exit(main())
