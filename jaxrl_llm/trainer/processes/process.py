"""One process of a run, as `python -m jaxrl_llm.train` and a Ray `TrainProcess` both start it: logging,
the compilation cache, joining the other processes, then training. Below the CLI, so both can import it."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("jaxrl_llm")


def setup_logging(level: str, process_id: int = 0) -> None:
    """Process 0 logs at `level`; the other processes of a run only warnings and errors, tagged."""
    tag = f"[p{process_id}] " if process_id else ""
    logging.basicConfig(level=level if process_id == 0 else "WARNING", force=True,
                        format=f"%(asctime)s {tag}%(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src.xla_bridge", "tensorboardX"):  # orbax progress and backend probing
        logging.getLogger(noisy).setLevel(logging.WARNING)


def enable_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache in `path` ("" = off): a repeated or resumed run loads its
    compiled programs instead of compiling them again. `JAXRL_COMPILATION_CACHE_DIR`, where set, takes the place of
    `path`: the test suite points every process it starts at its session's cache, which the in-process tests fill."""
    path = os.environ.get("JAXRL_COMPILATION_CACHE_DIR", path)
    if not path:
        return
    import jax

    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        log.warning("train.compilation_cache_dir %s is not usable (%s); compiling without a cache", path, e)
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def run_process(run, operative_config: str, spec) -> dict:
    """One process of a run: joins the others (if any), then builds the trainer and trains (or, the rollout process
    of an async run over several processes, serves the trainer's rollouts)."""
    from jaxrl_llm import distributed
    from jaxrl_llm.trainer.loop import RLTrainer
    from jaxrl_llm.trainer.processes import placement
    from jaxrl_llm.xla_flags import apply_gpu_overlap

    apply_gpu_overlap(run.trainer.xla_gpu_overlap)  # before the backend starts (it reads XLA_FLAGS once)
    distributed.initialize(spec, heartbeat_timeout_s=run.trainer.heartbeat_timeout_s)
    enable_compilation_cache(run.trainer.compilation_cache_dir)
    if placement.enter_side(run) == placement.ROLLOUT:  # an async run's rollout process: it serves the trainer
        from jaxrl_llm.trainer.processes.server import RolloutServer

        return RolloutServer(run).serve()
    try:
        return RLTrainer(run, operative_config=operative_config).fit()
    except BaseException as e:
        if placement.side(run) == placement.TRAIN:  # the rollout process stops too, rather than wait for calls
            from jaxrl_llm.trainer.processes.channel import Channel
            from jaxrl_llm.trainer.processes.service import CHANNEL

            Channel(CHANNEL).fail(f"training process {spec.process_id} failed: {type(e).__name__}: {e}")
        raise
