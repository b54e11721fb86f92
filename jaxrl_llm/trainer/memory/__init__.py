"""The step's programs and the device memory they need, known before the first step.

A step's shapes come from config, never from the data: the packing puts every pass on a fixed ladder of
micro-batch shapes (trainer/packing.py), so the programs of a whole run are known when it starts. This wing turns
that into two guarantees. The memory check (`check.py`) compiles each program of the step at its full shape
against the run's states as shapes alone (`programs.py`), reads XLA's own account of what it needs beside what
stays resident, and fails the run before any work when a program cannot fit, naming the keys that shrink it; it
also settles the automatic choices (`model.remat='auto'`, the log-prob budget, the fused passes), offered first
by a fast arithmetic estimate (`estimate.py`). Compile-ahead (`warm_programs.py`) compiles every program at every
shape of its ladder while the worker starts, so that no later step compiles.

Floors: `estimate` and `warm_programs` read shapes and configs; `programs` builds on `warm_programs`' lists;
`check` on both. The worker (trainer/roles/worker.py) calls `check.plan` with a builder of its abstract self.
"""
