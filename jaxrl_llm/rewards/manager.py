"""`RewardManager`: scores a batch of responses on the host: in-process, on a pool of Ray workers, or on a
pool of worker processes (for hosts without Ray, such as a GPU machine running the in-process driver).

One bad sample must not stop a training run: a reward function that raises, or returns NaN, inf or
something that is not a number, scores 0.0; the sample is logged (index, data_source, what happened)
and counted in the metrics `reward/num_errors` and `reward/num_nonfinite`. `strict=True` turns a
raise into a `RewardError` instead, for debugging a new reward function. A setup bug (an unknown
data_source, say) always raises `RewardConfigError`, since every sample would fail the same way.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.ray_cluster import local_ray_config
from jaxrl_llm.rewards.errors import RewardConfigError, RewardError
from jaxrl_llm.rewards.registry import registered_rewards, registry_snapshot
from jaxrl_llm.rewards.scoring import RewardWorker, SampleResult, resolve_reward_fn, score_samples

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RewardOutput:
    """The scores of a batch.

    Attributes:
      scores: [B] float32, one per response.
      metrics: batch counts: `reward/num_errors`, `reward/num_nonfinite`.
      extra_info: per-sample extra metrics from functions that return dicts, each a list of length B
        (None where a sample did not report the key); veRL's `reward_extra_info`.
    """

    scores: np.ndarray
    metrics: dict[str, int]
    extra_info: dict[str, list]


class RewardManager:
    """Scores (data_source, response, ground_truth, extra_info) samples with one reward function.

    Args:
      reward_fn: which function; see `jaxrl_llm.rewards.scoring` (None: by data_source, a registered
        name, `CustomRewardFunction(path, name)`, or a callable).
      num_workers: 0 scores in this process; N > 0 splits each batch into N contiguous chunks scored by
        N workers in parallel.
      backend: the workers: "ray" (Ray actors; Ray is initialised locally if the caller has not done it,
        and shut down by `close()`), "process" (spawned Python processes of this host, no Ray needed),
        or "auto" (Ray when it is installed, else processes).
      strict: raise `RewardError` when the function raises, instead of scoring 0.0.
      worker_num_cpus: CPUs that Ray reserves for each worker.
      max_logged_problems: per batch, how many failing samples get their own log line.
    """

    def __init__(self, reward_fn=None, *, num_workers: int = 0, backend: str = "auto", strict: bool = False,
                 worker_num_cpus: float = 1, max_logged_problems: int = 10):
        if not isinstance(num_workers, int) or num_workers < 0:
            raise RewardConfigError(f"RewardManager: num_workers={num_workers!r}; use 0 (in-process) or more")
        if backend not in ("auto", "ray", "process"):
            raise RewardConfigError(f"RewardManager: backend={backend!r}; use 'auto', 'ray' or 'process'")
        self.strict = strict
        self.num_workers = num_workers
        self._by_data_source = reward_fn is None
        self.max_logged_problems = max_logged_problems
        # Resolved here too, so that a bad spec fails at once with one clear error, not inside a worker.
        self._fn = resolve_reward_fn(reward_fn)
        self._workers: list = []
        self._pool = None  # the "process" backend's executor
        self._owns_ray = False
        if num_workers:
            if backend == "auto":
                backend = "ray" if importlib.util.find_spec("ray") is not None else "process"
            if backend == "ray":
                self._start_workers(reward_fn, worker_num_cpus)
            else:
                self._start_processes(reward_fn)

    def _start_processes(self, spec) -> None:
        """`num_workers` spawned processes (never forked: this process runs JAX's threads), each building
        the reward function from `spec` once, with this process's registry."""
        import concurrent.futures
        import multiprocessing

        try:  # by value where cloudpickle is installed (as with Ray): functions defined anywhere travel
            import cloudpickle as pickler
        except ImportError:
            import pickle as pickler
        try:
            payload = pickler.dumps((spec, registry_snapshot()))
        except Exception as e:
            raise RewardConfigError(f"RewardManager: the reward functions cannot be sent to worker processes "
                                    f"({type(e).__name__}: {e}); define them at module level, or use "
                                    "num_workers = 0") from None
        self._pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=self.num_workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_process_worker, initargs=(payload,))

    def _start_workers(self, spec, num_cpus: float) -> None:
        import ray

        if not ray.is_initialized():
            log.info("RewardManager: starting a local Ray instance for %d reward workers", self.num_workers)
            ray.init(num_cpus=max(1, int(self.num_workers * num_cpus + 0.999)), include_dashboard=False,
                     _system_config=local_ray_config())
            self._owns_ray = True
        total_cpus = ray.cluster_resources().get("CPU", 0)
        if self.num_workers * num_cpus > total_cpus:
            if self._owns_ray:
                ray.shutdown()
                self._owns_ray = False
            raise RewardConfigError(
                f"RewardManager: {self.num_workers} workers x {num_cpus} CPU need more than the "
                f"{total_cpus:g} CPUs of the Ray cluster; lower num_workers or worker_num_cpus")
        actor_cls = ray.remote(num_cpus=num_cpus)(RewardWorker)
        registry = registry_snapshot()
        self._workers = [actor_cls.remote(spec, registry) for _ in range(self.num_workers)]

    def check_data_sources(self, data_sources: Iterable[str], where: str = "") -> None:
        """Fails now, before any model is loaded, if the dataset has a data_source that no reward function
        is registered for (only when dispatching by data_source: a custom or named function scores all).

        Args:
          data_sources: the dataset's data_source values (repeats are fine).
          where: the dataset's files, for the message.
        """
        if not self._by_data_source:
            return
        known = set(registered_rewards())
        missing = sorted({s for s in data_sources if s not in known})
        if missing:
            raise RewardConfigError(
                f"{where + ': ' if where else ''}data_source {missing} has no reward function; registered: "
                f"{sorted(known)}. Fix the rows' data_source, register one with "
                "@jaxrl_llm.rewards.register_reward(name), or set a custom reward function "
                "(gin: reward.custom_reward_path / reward.custom_reward_name)")

    def close(self) -> None:
        """Stops the workers (and Ray itself, if this manager started it)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._workers:
            import ray

            for worker in self._workers:
                ray.kill(worker)
            self._workers = []
            if self._owns_ray:
                ray.shutdown()
                self._owns_ray = False

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def score_batch(self, data_sources: Sequence[str], responses: Sequence[str], ground_truths: Sequence[Any],
                    extra_infos: Sequence[dict | None] | None = None) -> RewardOutput:
        """Scores B responses; the four sequences are aligned (sample i is the i-th of each).

        Args:
          data_sources: [B] the dataset of each prompt (picks the function when reward_fn is None).
          responses: [B] decoded responses.
          ground_truths: [B] each prompt's `reward_model.ground_truth`.
          extra_infos: [B] each prompt's `extra_info` dict, or None.
        """
        extra_infos = [None] * len(responses) if extra_infos is None else extra_infos
        lengths = {len(data_sources), len(responses), len(ground_truths), len(extra_infos)}
        if len(lengths) != 1:
            raise ValueError(
                f"RewardManager.score_batch: data_sources ({len(data_sources)}), responses "
                f"({len(responses)}), ground_truths ({len(ground_truths)}) and extra_infos "
                f"({len(extra_infos)}) must all have the same length")
        samples = list(zip(data_sources, responses, ground_truths, extra_infos))
        results = self._score(samples)
        self._report(results, data_sources)
        return RewardOutput(
            scores=np.asarray([r.score for r in results], dtype=np.float32),
            metrics={"reward/num_errors": sum(r.problem == "error" for r in results),
                     "reward/num_nonfinite": sum(r.problem == "nonfinite" for r in results)},
            extra_info=_collect_extras(results))

    def _score(self, samples: list) -> list[SampleResult]:
        if (not self._workers and self._pool is None) or not samples:
            return score_samples(self._fn, samples)
        n_chunks = min(self.num_workers, len(samples))
        bounds = np.linspace(0, len(samples), n_chunks + 1).astype(int)
        if self._pool is not None:
            futures = [self._pool.submit(_score_in_process_worker, samples[bounds[i]:bounds[i + 1]])
                       for i in range(n_chunks)]
            results = []
            for i, future in enumerate(futures):
                try:
                    results.extend(future.result())
                except Exception as e:  # a worker died (BrokenProcessPool) or could not unpickle a sample
                    raise RewardError(f"reward worker process {i} failed while scoring samples "
                                      f"{bounds[i]}..{bounds[i + 1] - 1}: {type(e).__name__}: {e}") from e
            return results
        import ray

        futures = [self._workers[i].score.remote(samples[bounds[i]:bounds[i + 1]]) for i in range(n_chunks)]
        results = []
        for i, future in enumerate(futures):
            try:
                results.extend(ray.get(future))
            except ray.exceptions.RayError as e:
                raise RewardError(f"reward worker {i} failed while scoring samples "
                                  f"{bounds[i]}..{bounds[i + 1] - 1}: {type(e).__name__}: {e}") from e
        return results

    def _report(self, results: list[SampleResult], data_sources: Sequence[str]) -> None:
        problems = [(i, r) for i, r in enumerate(results) if r.problem]
        for i, r in problems:
            if r.problem == "config":
                raise RewardConfigError(f"sample {i} (data_source={data_sources[i]!r}): {r.message}")
            if self.strict and r.problem == "error":
                raise RewardError(f"reward function raised on sample {i} (data_source={data_sources[i]!r}): "
                                  f"{r.message}\n{r.trace}".rstrip())
        for i, r in problems[:self.max_logged_problems]:
            what = "raised" if r.problem == "error" else "gave no finite score"
            log.warning("reward function %s on sample %d (data_source=%r), scored 0.0: %s",
                        what, i, data_sources[i], r.message)
        if len(problems) > self.max_logged_problems:
            log.warning("... and %d more samples scored 0.0 after a reward function problem in this batch",
                        len(problems) - self.max_logged_problems)


_PROCESS_WORKER: RewardWorker | None = None


def _init_process_worker(payload: bytes) -> None:
    import pickle

    global _PROCESS_WORKER
    _PROCESS_WORKER = RewardWorker(*pickle.loads(payload))


def _score_in_process_worker(samples: list) -> list[SampleResult]:
    return _PROCESS_WORKER.score(samples)


def _collect_extras(results: list[SampleResult]) -> dict[str, list]:
    keys = list(dict.fromkeys(k for r in results for k in r.extras))
    return {k: [r.extras.get(k) for r in results] for k in keys}
