"""A run directory as a newcomer meets it: checkpoints every `train.save_freq` (20) steps by default, a killed
run resumes from the last one with each step logged once (metrics.jsonl cut back, TensorBoard told to drop the
steps after it), a finished run says what to change, and the progress bar only draws on a terminal."""

import fcntl
import json
import os
import pty
import re
import shlex
import signal
import struct
import subprocess
import sys
import termios

from tensorboardX.proto import event_pb2

from jaxrl_llm.trainer.loggers import MetricsLogger
from tests.trainer import runs

STEPS = 24  # past the default save_freq of 20


def _events(tb_dir) -> list[list[event_pb2.Event]]:
    """The events of each TensorBoard event file, oldest file first (TFRecord: length, crc, data, crc)."""
    out = []
    for name in sorted(os.listdir(tb_dir), key=lambda n: os.path.getmtime(os.path.join(tb_dir, n))):
        with open(os.path.join(tb_dir, name), "rb") as f:
            data = f.read()
        events, pos = [], 0
        while pos + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            events.append(event_pb2.Event.FromString(data[pos + 12:pos + 12 + n]))
            pos += 12 + n + 4
        out.append(events)
    return out


def test_a_killed_run_resumes_from_the_default_checkpoint_and_logs_each_step_once(tmp_path):
    proc = runs.start(tmp_path, "train.logger=('console', 'jsonl', 'tensorboard')", steps=STEPS)
    runs.wait_for_steps(tmp_path, 23, proc, timeout=300)  # steps 21-23 give step 20's async save time to commit
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert re.search(r"no checkpoint in \S+: starting from step 0", proc.stderr.read())
    saved = [d for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()]
    assert saved == ["20"]  # saved by default, without train.save_freq

    out = runs.run(tmp_path, "train.logger=('console', 'jsonl', 'tensorboard')", steps=STEPS)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "at step 20" in out.stderr
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))  # each once: the killed run's steps 21, 22, ... were cut
    aside = [json.loads(line)["step"] for p in tmp_path.glob("metrics.set-aside-*.jsonl")
             for line in p.read_text().splitlines() if line.strip().endswith("}")]
    assert aside[:2] == [21, 22]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["20", "24"]  # train.max_checkpoints_to_keep = 2
    # TensorBoard drops an earlier file's events from the purge step on (SessionLog START, as torch's purge_step).
    first, second = _events(tmp_path / "tensorboard")
    assert max(e.step for e in first if e.summary.value) >= 21  # past the checkpoint (the kill may cut step 22's)
    start = next(e for e in second if e.HasField("session_log"))
    assert start.session_log.status == event_pb2.SessionLog.START and start.step == 21
    assert min(e.step for e in second if e.summary.value) == 21
    assert "\r" not in out.stderr  # stderr is a pipe here: no progress bar to garble it

    again = runs.run(tmp_path, steps=STEPS)
    assert again.returncode == 0, again.stderr[-3000:]
    line = [x for x in again.stderr.splitlines() if "nothing to train" in x]
    assert len(line) == 1 and "resumed at step 24 and train.total_training_steps=24 ends the run at step 24" in line[0]
    assert "raise it to train on" in line[0]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == STEPS


def test_the_progress_bar_draws_only_on_a_terminal(tmp_path, capsys):
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    saved = sys.stderr
    with os.fdopen(secondary, "w") as tty:
        try:
            sys.stderr = tty
            bar = MetricsLogger(str(tmp_path), ("console",), total_steps=3)
            assert bar._bar is not None
            bar.log(1, {"critic/score/mean": 0.5})
            bar.close()
        finally:
            sys.stderr = saved
    drawn = os.read(primary, 65536).decode()
    os.close(primary)
    capsys.readouterr()  # the bar's step line (tqdm.write: stdout)
    assert "\r" in drawn and "train:" in drawn and "/3 [" in drawn
    plain = MetricsLogger(str(tmp_path), ("console",), total_steps=3)  # pytest's stderr is not a terminal
    assert plain._bar is None
    plain.log(1, {"critic/score/mean": 0.5})
    plain.close()
    assert capsys.readouterr().out == "step 1 | score 0.5\n"


def test_the_readme_launcher_example_has_its_own_run_dir():
    """Run after the first demo, as README orders them, the launcher example must train, not resume."""
    import gin

    from jaxrl_llm.launch import check_train_args

    readme = open(os.path.join(runs.REPO, "README.md")).read()
    demo = re.search(r"^python -m jaxrl_llm.train (--gin_file=gin/grpo_tiny.gin)$", readme, re.M)
    launch = re.search(r"^python -m jaxrl_llm.launch --num_processes 2 (.*?)(?<!\\)$", readme, re.M | re.S)
    flags = shlex.split(launch.group(1).replace("\\\n", " "))
    run_dirs = set()
    for args in ([demo.group(1)], flags[flags.index("--") + 1:]):
        gin.clear_config()
        run_dirs.add(check_train_args(args))
    assert len(run_dirs) == 2, run_dirs


def test_the_tensorboard_sink_writes_its_events_without_importing_torch(tmp_path):
    """tensorboardX's writer imports torch when it can (2-4 s of a trainer process's start, to accept torch tensors);
    the logger loads it without torch, and the events are still written. A process with torch keeps it."""
    code = (
        "import sys\n"
        "from jaxrl_llm.trainer.loggers import MetricsLogger\n"
        f"lg = MetricsLogger({str(tmp_path)!r}, ('tensorboard',), total_steps=2, progress_bar=False)\n"
        "lg.log(1, {'actor/pg_loss': 0.5})\n"
        "lg.close()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "import torch\n"
        "print(torch.zeros(1).shape)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=runs.REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "torch.Size([1])"
    [events] = _events(tmp_path / "tensorboard")
    assert [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value] == [(1, "actor/pg_loss", 0.5)]
