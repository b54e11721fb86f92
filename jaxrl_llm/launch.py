"""`python -m jaxrl_llm.launch --num_processes N [...] -- <train flags>`: N local training processes.

Starts `python -m jaxrl_llm.train <train flags>` N times on this host, joined by `jax.distributed`
through a coordinator on 127.0.0.1 (each child gets JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID). On GPUs, `--gpus_per_process K` gives process i the GPUs iK..iK+K-1
(CUDA_VISIBLE_DEVICES); on CPU, `--devices_per_process D` simulates D devices in each process.

The training flags are checked once, before any process starts: a bad one is one config error. Each
process's output goes to `<train.run_dir>/logs/process_<i>.log`, and process 0's to the terminal too.
When one fails or dies, the launcher stops the others (SIGTERM, then SIGKILL) and exits with that child's
code and one line naming the process and its cause (its error line, its exception, or the signal); the
others' tracebacks stay in their logs. A killed or crashed run resumes from its last checkpoint when
started again; a process that stopped on bad input (exit code 2) is reported as such. An async run
(`async_training.mode`) places its sides by process: the first `train.nnodes` processes train, the next
`rollout.nnodes` generate (trainer/processes/placement.py), as the Ray driver does. For several hosts,
run `python -m jaxrl_llm.train` once per host with --coordinator_address/--num_processes/--process_id
instead (or use the Ray driver).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
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


class _Output:
    """Every child's stdout and stderr, line by line, into its own log file; process 0's lines also to this
    terminal, each held `hold_s` first. Once a process has failed nothing more reaches the terminal: the
    survivors' tracebacks (Python's, and XLA's or gloo's from C++) stay in their logs, and the launcher says
    in one line what happened."""

    def __init__(self, log_dir: str, n: int, hold_s: float = 1.0):
        os.makedirs(log_dir, exist_ok=True)
        self.paths = [os.path.join(log_dir, f"process_{i}.log") for i in range(n)]
        self.files = [open(p, "a", buffering=1, errors="replace") for p in self.paths]
        for f in self.files:
            f.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv)}\n")
        self.hold_s, self.quiet = hold_s, False
        self.held: collections.deque = collections.deque()  # (time, stream, line) of process 0
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def follow(self, i: int, proc: subprocess.Popen) -> None:
        for pipe, stream in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            t = threading.Thread(target=self._read, args=(i, pipe, stream), daemon=True)
            t.start()
            self.threads.append(t)

    def _read(self, i: int, pipe, stream) -> None:
        for raw in iter(pipe.readline, b""):
            line = raw.decode(errors="replace")
            with self.lock:
                self.files[i].write(line)
                if i == 0 and not self.quiet:
                    if line.startswith(("Traceback (most recent call last)", "error: ")):
                        self.quiet = True  # process 0 is failing: the launcher's line will say how
                    else:
                        self.held.append((time.time(), stream, line))
        pipe.close()

    def flush(self, *, all_: bool = False) -> None:
        """Passes on process 0's lines held at least `hold_s` (all of them with `all_`)."""
        with self.lock:
            while self.held and (all_ or time.time() - self.held[0][0] >= self.hold_s):
                _, stream, line = self.held.popleft()
                if not self.quiet:
                    stream.write(line)
                    stream.flush()

    def silence(self) -> None:
        with self.lock:
            self.quiet = True
            self.held.clear()

    def close(self) -> None:
        for t in self.threads:
            t.join(timeout=5)
        self.flush(all_=True)
        for f in self.files:
            f.close()

    def cause(self, i: int) -> str:
        """What a failed process's log says went wrong: its `error:` line, or the last traceback's last line."""
        with open(self.paths[i], errors="replace") as f:
            lines = [line.rstrip() for line in f.read().split("\n==== ")[-1].splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error: ")]
        if errors:
            return errors[-1][len("error: "):]
        starts = [k for k, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
        if starts:
            return next((line for line in lines[starts[-1] + 1:] if not line.startswith(" ")), "")
        return ""


def _culprit(codes: list[int | None]) -> int:
    """Which of the processes that failed by now to name: one killed by a signal (the others then failed
    because it was gone), else one with bad input (exit code 2), else the first."""
    failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
    return min(failed, key=lambda i: (codes[i] >= 0, codes[i] != 2, i))


def _last_checkpoint(run_dir: str | None) -> str:
    if run_dir is None:  # another --module: its checkpoints are its own business
        return ""
    ckpt = os.path.join(run_dir, "checkpoints")
    steps = [int(d) for d in os.listdir(ckpt) if d.isdigit()] if os.path.isdir(ckpt) else []
    return f" (step {max(steps)})" if steps else " (none yet: it starts from step 0)"


def _failure_line(i: int, n: int, code: int, cause: str, out: _Output, run_dir: str | None) -> str:
    logs = os.path.dirname(out.paths[i])
    if code == 2 and cause:  # bad input: the rerun would fail the same way
        return f"error: training process {i} of {n}: {cause} (every process's output: {logs}/)"
    why = f"{_describe(code)}" + (f": {cause}" if cause else "")
    return (f"error: training process {i} of {n} {why}; stopped the other {n - 1} process(es) (every process's "
            f"output: {logs}/). Rerun the same command to resume from the last checkpoint{_last_checkpoint(run_dir)}")


def check_train_args(train_args: list[str], num_processes: int = 1, devices_per_process: int | None = None) -> str:
    """Parses the training flags as each process will, so a bad one is reported once, before any process
    starts (raises the trainer's UsageError), and checks an async run's split over the processes; returns the
    run dir."""
    from jaxrl_llm.errors import ConfigValueError
    from jaxrl_llm.train import UsageError, parse_args, parse_config
    from jaxrl_llm.trainer.processes.placement import check_processes

    args = parse_args(train_args)
    run = parse_config(args.gin_file, args.gin_param)
    try:
        check_processes(run, num_processes, devices_per_process)
    except ConfigValueError as e:
        raise UsageError(f"config: {e}") from None
    return run.trainer.run_dir


def launch(train_args: list[str], num_processes: int, *, gpus_per_process: int | None = None,
           devices_per_process: int | None = None, port: int | None = None, grace_s: float = 10.0,
           finish_timeout_s: float = 600.0, module: str = "jaxrl_llm.train", log_dir: str | None = None) -> int:
    """Runs the processes to the end; returns 0, or the exit code of the one that failed."""
    run_dir = None
    if module == "jaxrl_llm.train":
        from jaxrl_llm.train import UsageError, _one_line

        try:
            run_dir = check_train_args(train_args, num_processes, gpus_per_process or devices_per_process)
        except UsageError as e:
            print(f"error: {_one_line(e)}", file=sys.stderr)
            return 2
    port = port or _free_port()
    out = _Output(log_dir or os.path.join(run_dir or ".", "logs" if run_dir else "launch_logs"), num_processes)

    def on_term(signum, frame):  # stopping the launcher stops its processes too
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    procs = []
    for i in range(num_processes):
        procs.append(subprocess.Popen([sys.executable, "-m", module, *train_args], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, env=child_env(i, num_processes, port,
                                                                            gpus_per_process=gpus_per_process,
                                                                            devices_per_process=devices_per_process)))
        out.follow(i, procs[-1])
    first_exit = None
    try:
        while True:
            out.flush()
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                out.silence()
                i = _culprit(codes)
                _stop(procs, grace_s)
                out.close()
                print(_failure_line(i, num_processes, codes[i], out.cause(i), out, run_dir), file=sys.stderr,
                      flush=True)
                return codes[i] if codes[i] > 0 else 1
            if all(c == 0 for c in codes):
                out.close()
                return 0
            if any(c == 0 for c in codes):
                first_exit = first_exit or time.time()
                if time.time() - first_exit > finish_timeout_s:
                    waiting = [i for i, c in enumerate(codes) if c is None]
                    out.silence()
                    print(f"error: processes {waiting} did not finish within {finish_timeout_s:.0f}s of the others; "
                          "stopping them", file=sys.stderr, flush=True)
                    _stop(procs, grace_s)
                    out.close()
                    return 1
            time.sleep(0.05)
    except KeyboardInterrupt:
        out.silence()
        _stop(procs, grace_s)
        out.close()
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
    parser.add_argument("--log_dir", default=None, help="each process's output goes to LOG_DIR/process_<i>.log "
                        "(default: <train.run_dir>/logs, or ./launch_logs for another --module)")
    args = parser.parse_args(own)
    if args.num_processes < 1:
        parser.error("--num_processes must be >= 1")
    if not train_args:
        parser.error("give the training flags after `--`, e.g. -- --gin_file=gin/grpo_tiny.gin")
    return launch(train_args, args.num_processes, gpus_per_process=args.gpus_per_process,
                  devices_per_process=args.devices_per_process, port=args.port, grace_s=args.grace_s,
                  module=args.module, log_dir=args.log_dir)


if __name__ == "__main__":
    sys.exit(main())
