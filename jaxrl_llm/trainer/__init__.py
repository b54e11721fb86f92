"""The trainer: the RL loop, the roles it calls and the rollouters it consumes.

`loop.py` reads as one step of the run: it takes the step's batches from a rollouter, scores them while the worker
runs the log-prob passes, computes advantages, updates, and hands the new weights back to the rollouter. Around it
the trainer is a house of wings, each opening with its design:

* `config/` the run's configuration (gin sections, their checks, `--list_keys`): the trainer's ground floor.
* `memory/` the step's programs and what they need of the device, checked and compiled before the first step.
* `roles/` the worker (actor, reference, critic) and the engine, each behind a Protocol, and the handles that call
  them the same way in this process, in a Ray actor or in another process.
* `rollouters/` the modes: synchronous, one step off, fully asynchronous, each one object behind one interface.
* `processes/` a run over several processes: one process's life, the Ray driver, an async run's rollout process.

The step's own pieces are modules beside the loop: the packed batch (`batch.py`, `packing.py`), the jitted steps
(`steps.py`), a rollout in the trainer's layout (`rollout_batch.py`), scoring (`step_rewards.py`), dynamic sampling,
routing replay, validation, metrics and loggers, and the data's setup. Floors, lowest first: config, the step's
pieces, memory, roles, rollouters, the loop, and a process's life on top (tests/test_import_graph.py holds them).
"""
