"""The roles of a run, and the handles that carry their calls.

A role owns a part of the run's state and is called through a typed interface (`protocols.py`). The worker
(`worker.py`, with its checkpoint and weight sides in `worker_checkpoints.py` and `worker_weights.py`) is the actor,
reference and critic on the training mesh: their train states (`model_state.py`), where they come from
(`model_load.py`), the optimizer (`optim.py`) and the algorithm's pieces (`algo_setup.py`). The engine is the rollout
role: the JAX engine beside the worker or on the rollout's own devices (`engines.py`), the vLLM pool (`pool.py`), or
another process's engine (trainer/processes/remote.py), all behind `EngineRole`.

The loop holds a handle to each role and calls its methods: `worker.update_actor(batch, step)`,
`engine.sync(version)`. `host.py` decides where the roles live and hands out the handles: the roles themselves in
this process, or proxies of them in a Ray actor (`handles.py`), whose methods are the Protocol's and carry each call
to the actor and its result back. The same proxies carry the rollout process's calls over the host channel
(trainer/processes/service.py). No caller names a method by a string, so a reader follows every call to its
Protocol and from there to the role.

Floors: `handles` and `protocols` import no role; the worker's pieces sit below `worker`; `engines` and `pool` take a
worker (or its handle); `host` builds them all and is what the loop imports.
"""
