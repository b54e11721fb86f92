"""A run over several processes: one process's life, the Ray driver that starts them, and an async run's two
sides.

Every process of a run does what `process.run_process` says: it joins the others with `jax.distributed`, turns on
the compilation cache and trains as one process of the SPMD program (`python -m jaxrl_llm.launch` starts them on
one host; `ray_driver.fit_on_ray` starts them as Ray actors over a cluster, placed as the launcher places them).
A synchronous run's processes all do everything. An asynchronous run's split into sides (`placement.py`): the
first `train.nnodes` processes train, the others generate, each side its own SPMD program. The rollout process
serves its engine (`server.py`); the training processes drive it through an engine and a stream that look like
the local ones (`remote.py`). Commands and samples go as small host messages through the coordination service's
key-value store (`channel.py`); weights never do: they cross by one program over both sides' devices
(rollout/weight_sync.py).

Floors: `channel` and `placement` import nothing of the trainer; `remote` builds on `channel`; `server` on both;
`process` and `ray_driver` sit on top and are what the CLI imports.
"""
