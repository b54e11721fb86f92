"""A stand-in training process for the launcher's tests (`--module tests.launch_child`): it prints a line,
then does what argv[1] says in the process whose JAX_PROCESS_ID is argv[2]: 'crash' (a traceback), 'usage'
(an `error:` line, exit code 2). The others wait; stopped (SIGTERM), they print a traceback, as the survivor
of a dead peer does."""

import os
import signal
import sys
import time


def _stopped(signum, frame):
    print("Traceback (most recent call last):\n  File 'step.py', line 1\nXlaRuntimeError: gloo: connection reset",
          file=sys.stderr, flush=True)
    sys.exit(1)


me = int(os.environ["JAX_PROCESS_ID"])
print(f"process {me} started", flush=True)
if me == int(sys.argv[2]):
    time.sleep(1.5)
    if sys.argv[1] == "crash":
        raise RuntimeError("boom in the step")
    print("error: config: data.train_files: no training files given", file=sys.stderr, flush=True)
    sys.exit(2)
signal.signal(signal.SIGTERM, _stopped)
time.sleep(60)
