"""The sandbox's limits, each with a program that breaks it: a fork bomb, a memory hog, an infinite loop
with children (one escaping the process group), a network call, a flood of output, a big file, many
open files, and a look at the environment."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import threading
import time

import pytest

from jaxrl_llm.agent.builtin_tools import PythonTool
from jaxrl_llm.agent.sandbox import SandboxError, SandboxLimits, run_command, run_python
from jaxrl_llm.agent.tools import ToolCall, ToolRunner, load_tool_config

REPO = pathlib.Path(__file__).resolve().parents[2]
FAST = SandboxLimits(timeout_s=5.0, cpu_s=5)


def left_behind(workdir: str) -> list[int]:
    """Processes still running in the run's (now removed) working directory."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cwd = os.readlink(f"/proc/{entry}/cwd")
            except OSError:
                continue
            if cwd == workdir or cwd.startswith(workdir + " ") or cwd.startswith(workdir + "/"):
                pids.append(int(entry))
    return pids


def wait_gone(workdir: str) -> list[int]:
    deadline = time.monotonic() + 3.0  # the kernel reaps killed processes asynchronously
    while (pids := left_behind(workdir)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def test_runs_code_in_a_fresh_directory_with_an_empty_environment(monkeypatch):
    monkeypatch.setenv("JAXRL_SANDBOX_SECRET", "do-not-leak")
    code = ("import json, os\nopen('scratch.txt', 'w').write('x')\n"
            "print(json.dumps({'env': dict(os.environ), 'cwd': os.getcwd(), 'files': sorted(os.listdir())}))\n"
            "print(input())")
    result = run_python(code, limits=FAST, stdin="from stdin\n")
    assert result.ok, result.text()
    first, second = result.stdout.splitlines()
    seen = json.loads(first)
    # Python itself may add LC_CTYPE (PEP 538 locale coercion); nothing comes from the parent.
    assert set(seen["env"]) <= {"LC_CTYPE"}, seen["env"]
    assert seen["cwd"] == result.workdir and seen["files"] == ["main.py", "scratch.txt"]
    assert second == "from stdin"
    assert not os.path.exists(result.workdir)  # removed afterwards
    assert result.text() == result.stdout.rstrip("\n")


def test_fork_bomb_is_contained():
    limits = SandboxLimits(timeout_s=1.5, cpu_s=5, max_processes=8)
    counted = run_python("import os, time\nn = 0\ntry:\n    for _ in range(100):\n"
                         "        if os.fork() == 0:\n            time.sleep(30)\n            os._exit(0)\n"
                         "        n += 1\nexcept OSError as e:\n    print('stopped', n, type(e).__name__)\n",
                         limits=limits)
    stopped, forks, error = counted.stdout.split()
    assert stopped == "stopped" and int(forks) < 8 and error == "BlockingIOError", counted.text()
    assert wait_gone(counted.workdir) == []  # the sleeping children were killed with the group
    bomb = run_python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                      limits=limits)
    assert bomb.timed_out and "[killed: timed out after 1.5 s]" in bomb.text(1.5)
    assert wait_gone(bomb.workdir) == []


SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON),
                    reason="the drop to 'nobody' happens only as root, with an interpreter 'nobody' can run")
def test_as_root_the_program_runs_as_nobody_with_a_process_cap():
    from jaxrl_llm.agent.sandbox_os import user_can_run

    if not user_can_run(65534, 65534, SYSTEM_PYTHON):
        pytest.skip(f"'nobody' cannot start {SYSTEM_PYTHON} here")
    code = ("import os, time\nprint(os.getuid())\nn = 0\ntry:\n    for _ in range(100):\n"
            "        if os.fork() == 0:\n            time.sleep(30)\n            os._exit(0)\n"
            "        n += 1\nexcept OSError:\n    print(n)\n")
    result = run_python(code, limits=SandboxLimits(timeout_s=5.0, max_processes=8), python=SYSTEM_PYTHON)
    uid, forks = result.stdout.split()
    assert uid == "65534" and int(forks) < 8 and result.isolation_note == "", result.text()
    assert wait_gone(result.workdir) == []


def test_memory_hog_fails_cleanly():
    result = run_python("x = bytearray(4 * 1024 ** 3)\nprint('allocated')", limits=SandboxLimits(memory_mb=512))
    assert not result.timed_out and result.returncode == 1
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout
    assert result.text().endswith("[exit code 1]")


def test_infinite_loop_is_killed_at_the_timeout_with_its_children():
    code = ("import subprocess, sys\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
            "print('started', flush=True)\nwhile True:\n    pass\n")
    result = run_python(code, limits=SandboxLimits(timeout_s=2.0, cpu_s=10))
    assert result.timed_out and result.returncode is None and result.stdout == "started\n", result.text()
    assert wait_gone(result.workdir) == [], "a child outlived the sandbox"


def test_group_kill_reaches_a_child_that_left_the_process_group():
    """The fallback where neither a PID namespace nor a pids cgroup is available."""
    import subprocess
    import sys

    from jaxrl_llm.agent.sandbox import _kill_group_and_session

    code = ("import os, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], process_group=0)\n"
            "print(child.pid, flush=True)\ntime.sleep(60)\n")
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    child = int(leader.stdout.readline())
    assert os.getpgid(child) == child != leader.pid and os.getsid(child) == leader.pid
    _kill_group_and_session(leader.pid)
    assert leader.wait(timeout=5) == -signal.SIGKILL
    deadline = time.monotonic() + 3.0
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.05)  # the orphan is reaped by init once killed
    assert not os.path.exists(f"/proc/{child}") or "Z" in open(f"/proc/{child}/stat").read().split(")")[1][:3]
    leader.stdout.close()


def test_cpu_limit_kills_with_sigxcpu():
    result = run_python("while True:\n    pass\n", limits=SandboxLimits(timeout_s=10.0, cpu_s=1))
    assert not result.timed_out and result.returncode == -signal.SIGXCPU
    assert "SIGXCPU (CPU time limit)" in result.text()


def test_network_is_cut_where_the_os_allows_it():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
            "    print('connected')\nexcept OSError as e:\n    print('blocked', type(e).__name__)\n")
    try:
        cut = run_python(code, limits=FAST)
        if not cut.network_isolated:  # the OS refused a network namespace: the result must say so
            assert "network not isolated" in cut.isolation_note and "unshare" in cut.isolation_note
            pytest.skip(f"no network isolation here: {cut.isolation_note}")
        assert cut.stdout.startswith("blocked"), cut.text()
        allowed = run_python(code, limits=SandboxLimits(timeout_s=5.0, network=True))
        assert allowed.stdout == "connected\n", allowed.text()  # the same program does connect when allowed
    finally:
        server.close()


def test_output_file_size_and_open_files_are_capped():
    flood = run_python("import sys\nsys.stdout.write('x' * 10_000_000)\nprint('done', file=sys.stderr)",
                       limits=SandboxLimits(max_output_bytes=1000))
    assert flood.ok and len(flood.stdout) == 1000 and flood.output_truncated and flood.stderr == "done\n"
    assert flood.text().endswith("[output truncated]")
    big = run_python("open('big.bin', 'wb').write(b'0' * (3 * 1024 * 1024))", limits=SandboxLimits(max_file_mb=1))
    assert big.returncode == 1 and "File too large" in big.stderr
    many = run_python("fs = [open('main.py') for _ in range(100)]", limits=SandboxLimits(max_open_files=16))
    assert many.returncode == 1 and "Too many open files" in many.stderr


def test_python_tool_through_the_runner():
    tools = load_tool_config(str(REPO / "gin" / "tools" / "python_tool_config.yaml"))
    assert isinstance(tools[0], PythonTool) and tools[0].limits.memory_mb == 1024
    slow = PythonTool({"timeout_s": 1.0})
    slow.name = "slow_python"
    slow.tool_schema["function"]["name"] = "slow_python"
    with ToolRunner([*tools, slow], max_parallel_calls=2, timeout_s=20.0) as runner:
        session = runner.open()
        fine, hung = session.call([ToolCall("python", {"code": "print(sum(range(10)))"}),
                                   ToolCall("slow_python", {"code": "while True: pass"})])
    assert (fine.text, fine.error) == ("45", None)
    assert hung.text == "[killed: timed out after 1 s]" and hung.error is None  # the sandbox's timeout


def test_bad_sandbox_input_is_one_clear_error():
    with pytest.raises(SandboxError, match="absolute path"):
        run_command(["python", "-c", "pass"])
    with pytest.raises(SandboxError, match="stay inside the working directory"):
        run_command(["/bin/true"], files={"../escape.py": "x"})
    with pytest.raises(ValueError, match="SandboxLimits.memory_mb=0"):
        SandboxLimits(memory_mb=0)
    with pytest.raises(ValueError, match="python tool config"):
        PythonTool({"memory": 10})
