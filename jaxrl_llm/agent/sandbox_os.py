"""What the operating system lets the sandbox use to cap processes: RLIMIT_NPROC (binds only a
non-root user), the unprivileged `nobody` user when the trainer runs as root, or a pids cgroup.

RLIMIT_NPROC counts every thread of the real user, and the kernel ignores it for root. So:
  - run as an ordinary user: RLIMIT_NPROC = that user's threads now + the sandbox's allowance;
  - run as root: drop to `nobody` if `nobody` can start the interpreter (a Python under /root, mode
    0700, it cannot), with RLIMIT_NPROC counted the same way;
  - otherwise, as root: a fresh pids cgroup per run (v1 `pids` hierarchy, or a cgroup v2 directory
    with the pids controller delegated), which also lets us kill every process the run made;
  - otherwise: no process cap; the result's isolation note says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pwd
import signal
import subprocess
import sys
import time
import uuid


@dataclasses.dataclass(frozen=True)
class ProcessCap:
    """How one run's processes are capped: as `uid` (None: unchanged) with RLIMIT_NPROC `nproc`
    (None: not set), or inside the pids cgroup `cgroup` (a directory); `note` names what is missing."""

    uid: int | None = None
    gid: int | None = None
    nproc: int | None = None
    cgroup: str | None = None
    note: str = ""


def proc_entries() -> list[str]:
    """The process ids in /proc (none where there is no /proc, e.g. macOS)."""
    try:
        return [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []


def tasks_of_uid(uid: int) -> int:
    """Threads the user runs now (RLIMIT_NPROC counts all of them, not only the sandbox's)."""
    total = 0
    for entry in proc_entries():
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                total += int(fields.get("Threads", "1").strip() or 1)
        except (OSError, KeyError, ValueError):
            continue
    return total


_CAN_RUN = r"""
import os, sys
os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[1]))
os.execv(sys.argv[3], [sys.argv[3], "-I", "-c", "pass"])
"""


@functools.lru_cache(maxsize=8)
def user_can_run(uid: int, gid: int, interpreter: str) -> bool:
    """Whether `uid` can start `interpreter` (checked once by starting it as that user)."""
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", _CAN_RUN, str(uid), str(gid), interpreter],
                              env={}, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _v1_pids_root() -> str | None:
    with open("/proc/self/mountinfo") as f:  # an OSError without /proc: no cgroup
        for line in f:
            left, _, right = line.partition(" - ")
            fields, opts = left.split(), right.split()
            if len(opts) >= 3 and opts[0] == "cgroup" and "pids" in opts[2].split(","):
                return fields[4]
    return None


def _own_cgroup(controller: str | None) -> str | None:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if (controller is None and controllers == "") or (controller and controller in controllers.split(",")):
                return path
    return None


@functools.lru_cache(maxsize=1)
def pids_cgroup_parent() -> str | None:
    """A cgroup directory where we may create children with `pids.max`, or None."""
    if os.geteuid() != 0:
        return None
    try:
        root, path = _v1_pids_root(), _own_cgroup("pids")
        if root and path is not None:
            parent = os.path.join(root, path.lstrip("/"))
        else:  # cgroup v2: the pids controller must be enabled for our cgroup's children
            path = _own_cgroup(None)
            parent = os.path.join("/sys/fs/cgroup", (path or "/").lstrip("/"))
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                if "pids" not in f.read().split():
                    return None
        probe = os.path.join(parent, f"jaxrl_sandbox_probe_{uuid.uuid4().hex[:8]}")
        os.mkdir(probe)
        os.rmdir(probe)
        return parent
    except (OSError, ValueError):
        return None


def make_pids_cgroup(max_pids: int) -> str | None:
    """A fresh cgroup allowing `max_pids` tasks, or None where none can be made."""
    parent = pids_cgroup_parent()
    if parent is None:
        return None
    path = os.path.join(parent, f"jaxrl_sandbox_{uuid.uuid4().hex[:12]}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(max_pids))
    except OSError:
        remove_cgroup(path)
        return None
    return path


def remove_cgroup(path: str) -> None:
    """Kills every task in the cgroup and removes it (retrying while the kernel reaps them)."""
    procs = os.path.join(path, "cgroup.procs")
    for _ in range(200):
        try:
            with open(procs) as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if not pids:
            try:
                os.rmdir(path)
                return
            except OSError:
                pass
        time.sleep(0.01)


def plan_process_cap(user: str | None, max_processes: int, interpreter: str) -> ProcessCap:
    """How to cap the processes of one run (see the module docstring)."""
    if os.geteuid() != 0:
        return ProcessCap(nproc=tasks_of_uid(os.getuid()) + max_processes)
    note = ""
    if user is not None:
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            entry = None
            note = f"sandbox user {user!r} does not exist"
        if entry is not None:
            if user_can_run(entry.pw_uid, entry.pw_gid, interpreter):
                return ProcessCap(uid=entry.pw_uid, gid=entry.pw_gid,
                                  nproc=tasks_of_uid(entry.pw_uid) + max_processes)
            note = f"sandbox user {user!r} cannot start {interpreter}"
    cgroup = make_pids_cgroup(max_processes + 1)  # + the launcher
    if cgroup is not None:
        return ProcessCap(cgroup=cgroup, note=f"{note}; running as root in a pids cgroup" if note else "")
    why = note or "SandboxLimits.user=None"
    return ProcessCap(note=f"no process limit: running as root ({why}) and no writable pids cgroup")
