"""The trainer: the RL loop and the rooms it is built from.

`loop.py` reads as one step of the run. The rooms a step passes through sit beside it: the run's configuration
(config/), the roles that own devices and the handles that call them the same way in this process, in a Ray
actor or in another process (roles/), the rollouters that hand the loop its batches in the synchronous and
asynchronous modes (rollouters/), the programs and their memory (memory/), the processes of a multi-process or
two-sided run (processes/), and the step's own pieces, each a module: the packed batch (`batch.py`,
`packing.py`), the jitted steps (`steps.py`), scoring (`step_rewards.py`), dynamic sampling, validation, metrics
and loggers.
"""
