"""A sandbox for code a model wrote: a separate process group with CPU, memory, process, file-size and
open-file limits, a wall-clock timeout that kills the whole group, an empty environment, a fresh
working directory that is removed afterwards, no network where the OS allows it, and capped output.

    result = run_python("print(6 * 7)", limits=SandboxLimits(timeout_s=5.0))
    result.stdout        # '42\\n'
    result.text()        # what a tool shows the model

How: the parent starts a small launcher (`python -I -S -c LAUNCHER`, a fresh single-threaded process, so
nothing here runs between fork and exec in a multi-threaded trainer, where `preexec_fn` could deadlock).
The launcher
  1. joins the run's pids cgroup, when there is one (see `sandbox_os`: how processes are capped);
  2. enters new namespaces through libc `unshare` (by ctypes: `os.unshare` is Python 3.12+): a network
     namespace (only a loopback that is down: every connection fails) and a PID namespace (when its
     first process ends, the kernel kills every process left in it, even ones that left the process
     group with setsid). As root it needs no more; otherwise it adds a user namespace, where the
     kernel allows unprivileged ones;
  3. when run as root, drops to the user `nobody` if that user can start the interpreter;
  4. sets RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE=0 and, where it binds,
     RLIMIT_NPROC;
  5. execs the program (in a PID namespace, as PID 2: PID 1 is a forked launcher that only reaps, since
     the kernel spares PID 1 the signals it has no handler for, SIGXCPU among them).
It reports what it managed on a pipe; `SandboxResult.network_isolated`, `.pid_namespace` and
`.isolation_note` say what the run had.

Where the OS refuses namespaces (a container without CAP_SYS_ADMIN and without user namespaces), the code
still runs with the limits and the group kill, but it can reach the network, and a process that
double-forks and calls setsid() can outlive the kill unless a pids cgroup holds the run (RLIMIT_CPU
still bounds its CPU time). The result says so and the `python` tool logs it once. RLIMIT_AS is per
process: a program may use up to `max_processes * memory_mb`. Files outside the working directory are
protected only as far as the run's user is: as root without `nobody` (see `sandbox_os`) they are not.
For hostile code, run the tool side in a container or gVisor as well.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from jaxrl_llm.agent.sandbox_os import ProcessCap, plan_process_cap, proc_entries, remove_cgroup

LAUNCHER = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
fd = cfg["status_fd"]
os.set_inheritable(fd, False)
def report(**kw):
    os.write(fd, (json.dumps(kw) + "\n").encode())
if cfg["cgroup_procs"]:
    with open(cfg["cgroup_procs"], "w") as f:
        f.write(str(os.getpid()))
libc = ctypes.CDLL(None, use_errno=True)
NEWNET, NEWPID, NEWUSER = 0x40000000, 0x20000000, 0x10000000
def unshare(flags):
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
net = 0 if cfg["network"] else NEWNET
user = 0 if os.geteuid() == 0 else NEWUSER
got, reason = 0, "unshare is not available"
for flags in (user | net | NEWPID, user | net, user | NEWPID):
    try:
        unshare(flags)
        got = flags
        break
    except OSError as e:
        reason = f"unshare failed: {e.strerror}"
report(network_isolated=bool(got & NEWNET), pid_namespace=bool(got & NEWPID), reason=reason)
try:
    if cfg["uid"] is not None and os.geteuid() == 0:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
    for name, soft, hard in cfg["rlimits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
except (OSError, ValueError) as e:
    report(error=f"setting up the sandbox failed: {type(e).__name__}: {e}")
    os._exit(126)
def run():
    try:
        os.execv(cfg["argv"][0], cfg["argv"])
    except OSError as e:
        report(error=f"cannot start {cfg['argv'][0]!r} as uid {os.getuid()}: {e}")
        os._exit(126)
if not got & NEWPID:
    run()
if os.fork() == 0:
    # PID 1 of the namespace: the kernel spares it signals it has no handler for (SIGXCPU, SIGTERM),
    # so the program runs as PID 2 and this process only reaps, and reports the program's status.
    program = os.fork()
    if program == 0:
        run()
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(0)
        if pid == program:
            report(returncode=os.waitstatus_to_exitcode(status))
            os._exit(0)
os.wait()
os._exit(0)
"""


class SandboxError(RuntimeError):
    """The sandbox could not start the program (not the program's own failure)."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run.

    Attributes:
      timeout_s: wall-clock seconds before the whole process group is killed.
      cpu_s: CPU seconds (RLIMIT_CPU; SIGXCPU at the limit, SIGKILL a second later).
      memory_mb: address space in MiB (RLIMIT_AS); a Python program gets MemoryError past it.
      max_processes: processes/threads the program may add (see `sandbox_os` for how it is enforced).
      max_file_mb: size of any file it writes, in MiB (RLIMIT_FSIZE).
      max_open_files: open file descriptors (RLIMIT_NOFILE).
      max_output_bytes: bytes of stdout and of stderr kept; the rest is read and dropped.
      network: allow the network (default False: a network namespace where the OS allows one).
      user: the user to run as when the parent is root, if it can start the interpreter (None: stay
        root; then only a pids cgroup caps processes).
    """

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    max_processes: int = 32
    max_file_mb: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 16384
    network: bool = False
    user: str | None = "nobody"

    def __post_init__(self):
        for field in ("timeout_s", "cpu_s", "memory_mb", "max_processes", "max_file_mb", "max_open_files",
                      "max_output_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"SandboxLimits.{field}={value!r}: use a positive number")


@dataclasses.dataclass
class SandboxResult:
    """What a sandboxed run gave: its output (capped), how it ended, and what isolation it had."""

    stdout: str
    stderr: str
    returncode: int | None  # negative: killed by that signal (subprocess's convention)
    timed_out: bool
    output_truncated: bool
    seconds: float
    network_isolated: bool
    pid_namespace: bool
    isolation_note: str = ""
    workdir: str = ""  # removed by the time you read it; tests look for processes left inside it

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def text(self, timeout_s: float | None = None) -> str:
        """The run as a tool shows it: stdout, then stderr, then how it ended when it did not exit 0."""
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.stderr:
            parts.append("[stderr]\n" + self.stderr.rstrip("\n"))
        if self.timed_out:
            limit = f" after {timeout_s:g} s" if timeout_s else ""
            parts.append(f"[killed: timed out{limit}]")
        elif self.returncode and self.returncode < 0:
            parts.append(f"[killed by {_signal_name(-self.returncode)}]")
        elif self.returncode:
            parts.append(f"[exit code {self.returncode}]")
        if self.output_truncated:
            parts.append("[output truncated]")
        return "\n".join(parts) if parts else "[no output]"


def _signal_name(number: int) -> str:
    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
    return {"SIGXCPU": "SIGXCPU (CPU time limit)", "SIGKILL": "SIGKILL"}.get(name, name)


def _drain(fd: int, cap: int, out: dict, key: str) -> None:
    """Reads a pipe to its end, keeping the first `cap` bytes (so the child never blocks on it)."""
    kept = bytearray()
    total = 0
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        total += len(chunk)
        if len(kept) < cap:
            kept += chunk[: cap - len(kept)]
    out[key] = (bytes(kept), total > cap)


def _kill_group_and_session(pgid: int) -> None:
    """SIGKILL to the process group, and to anything still in its session (a child that setpgid'd)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    for entry in proc_entries():
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            session = int(stat.rsplit(")", 1)[1].split()[3])  # after "(comm)": state ppid pgrp session
            if session == pgid:
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            continue


def run_command(argv: list[str], *, limits: SandboxLimits = SandboxLimits(), stdin: str | None = None,
                files: dict[str, str] | None = None) -> SandboxResult:
    """Runs `argv` (argv[0] an absolute path: the environment is empty, so there is no PATH) in a fresh
    temp directory holding `files` ({relative name: text}), under `limits`."""
    if not argv or not os.path.isabs(argv[0]):
        raise SandboxError(f"sandbox argv[0] must be an absolute path (the environment is empty), got {argv!r:.200}")
    for name in files or {}:
        if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
            raise SandboxError(f"sandbox file name {name!r} must be relative and stay inside the working directory")
    cap = plan_process_cap(limits.user, limits.max_processes, argv[0])
    workdir = tempfile.mkdtemp(prefix="jaxrl_sandbox_")
    try:
        for name, text in (files or {}).items():
            path = os.path.join(workdir, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        if cap.uid is not None:
            for root, dirs, names in os.walk(workdir):
                for name in [root, *(os.path.join(root, n) for n in dirs + names)]:
                    os.chown(name, cap.uid, cap.gid)
        return _run(argv, limits, stdin, workdir, cap)
    finally:
        if cap.cgroup:
            remove_cgroup(cap.cgroup)
        shutil.rmtree(workdir, ignore_errors=True)


def _run(argv, limits: SandboxLimits, stdin, workdir, cap: ProcessCap) -> SandboxResult:
    mib = 1024 * 1024
    rlimits = [("RLIMIT_CPU", int(limits.cpu_s), int(limits.cpu_s) + 1),
               ("RLIMIT_AS", int(limits.memory_mb * mib), int(limits.memory_mb * mib)),
               ("RLIMIT_FSIZE", int(limits.max_file_mb * mib), int(limits.max_file_mb * mib)),
               ("RLIMIT_NOFILE", int(limits.max_open_files), int(limits.max_open_files)),
               ("RLIMIT_CORE", 0, 0)]
    if cap.nproc is not None:
        rlimits.append(("RLIMIT_NPROC", cap.nproc, cap.nproc))
    status_r, status_w = os.pipe()
    config = {"status_fd": status_w, "network": limits.network, "uid": cap.uid, "gid": cap.gid,
              "cgroup_procs": os.path.join(cap.cgroup, "cgroup.procs") if cap.cgroup else None,
              "rlimits": rlimits, "argv": list(argv)}
    start = time.perf_counter()
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", LAUNCHER, json.dumps(config)], cwd=workdir,
                                env={}, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w,),
                                start_new_session=True)
    except OSError as e:
        os.close(status_r)
        raise SandboxError(f"cannot start the sandbox launcher ({sys.executable}): {e}") from None
    finally:
        os.close(status_w)
    outputs: dict = {}
    readers = [threading.Thread(target=_drain, args=(s.fileno(), limits.max_output_bytes, outputs, k), daemon=True)
               for s, k in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    for reader in readers:
        reader.start()
    if stdin is not None:
        threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
    timed_out = False
    try:
        proc.wait(timeout=limits.timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    _kill_group_and_session(proc.pid)  # on a timeout, and for anything a finished program left behind
    proc.wait()
    seconds = time.perf_counter() - start
    for reader in readers:
        reader.join(timeout=2.0)  # an escaped process may still hold the pipe; its output is dropped
    status = _read_status(status_r)
    for stream in (proc.stdout, proc.stderr):
        stream.close()
    if "error" in status:
        raise SandboxError(f"{status['error']}; if the sandbox user cannot read the interpreter, set "
                           "SandboxLimits.user=None or install Python where every user can read it")
    returncode = status.get("returncode", proc.returncode)
    if timed_out:
        returncode = None
    stdout, cut_out = outputs.get("stdout", (b"", False))
    stderr, cut_err = outputs.get("stderr", (b"", False))
    notes = [cap.note] if cap.note else []
    if not status.get("network_isolated") and not limits.network:
        notes.append(f"network not isolated ({status.get('reason', 'the launcher gave no status')})")
    if not status.get("pid_namespace") and not cap.cgroup:
        notes.append("no PID namespace: a process that double-forks and calls setsid() can outlive the kill")
    note = "; ".join(notes)
    return SandboxResult(stdout=stdout.decode("utf-8", "replace"), stderr=stderr.decode("utf-8", "replace"),
                         returncode=returncode, timed_out=timed_out, output_truncated=cut_out or cut_err,
                         seconds=seconds, network_isolated=bool(status.get("network_isolated")),
                         pid_namespace=bool(status.get("pid_namespace")), isolation_note=note, workdir=workdir)


def _feed(pipe, text: str) -> None:
    try:
        pipe.write(text.encode())
        pipe.close()
    except OSError:  # the program exited without reading it all
        pass


def _read_status(fd: int) -> dict:
    """The launcher's JSON lines, merged (its end is closed once it and the program are gone)."""
    data = b""
    try:
        while select.select([fd], [], [], 2.0)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    status: dict = {}
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            status.update(json.loads(line))
        except json.JSONDecodeError:
            continue
    return status


def run_python(code: str, *, limits: SandboxLimits = SandboxLimits(), stdin: str | None = None,
               python: str | None = None) -> SandboxResult:
    """Runs Python `code` in the sandbox with `python` (default: this interpreter, so the same packages),
    in isolated mode (`-I`: no PYTHON* variables, no user site) and UTF-8 mode."""
    interpreter = os.path.abspath(python or sys.executable)
    return run_command([interpreter, "-I", "-B", "-X", "utf8", "main.py"], limits=limits, stdin=stdin,
                       files={"main.py": code})
