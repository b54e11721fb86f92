"""The RL loop: the one module with side effects. Reads top to bottom as one step of the run.

The data source yields prompts. The engine samples `n` responses each (and, for REMAX, one greedy
response a prompt). The worker starts the old and reference log-prob (and value) passes on the device,
and reward functions score the responses on the host meanwhile (DAPO's overlong penalty shapes the
scores). With DAPO's dynamic sampling on, the batch is only known after scoring: the loop scores prompt
batches until enough groups are kept (`trainer.dynamic_sampling`), then runs the passes on that batch.
Then advantages; the actor (and critic) update. New weights go to the engine. Metrics are logged;
validation (`trainer.validation`) and checkpoints happen every `test_freq` / `save_freq` steps.

In a multi-process run every process runs this loop with the same data, the same programs in the same
order, and the same host-side values (scores and sampler decisions are gathered across processes);
only process 0 logs and writes the run's own files (`jaxrl_llm.distributed`).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import shutil
import time

import numpy as np

import jaxrl_llm
from jaxrl_llm import compile_watch, distributed
from jaxrl_llm.agent.config import engine_prompt_length, make_tool_runner
from jaxrl_llm.algorithms import make_kl_controller
from jaxrl_llm.checkpoint import resolve_resume
from jaxrl_llm.rewards import CustomRewardFunction, RewardManager, apply_overlong_penalty, overlong_metrics
from jaxrl_llm.rollout import RolloutBatch, SamplingParams
from jaxrl_llm.trainer import metrics as M
from jaxrl_llm.trainer import router_replay
from jaxrl_llm.trainer.batch import TrainBatch
from jaxrl_llm.trainer.config import ConfigValueError, RunConfig
from jaxrl_llm.trainer.data_setup import build_datasets, load_tokenizer
from jaxrl_llm.trainer.dynamic_sampling import GroupFilter, ScoredDraw, draw_seed, extra_info_fields
from jaxrl_llm.trainer.loggers import MetricsLogger
from jaxrl_llm.trainer.model_load import lora_meta, lora_spec
from jaxrl_llm.trainer.roles import make_worker
from jaxrl_llm.trainer.rollout_batch import Rollout, build_train_batch, response_items
from jaxrl_llm.trainer.step_rewards import StepScorer
from jaxrl_llm.trainer.validation import ValidationResults

log = logging.getLogger(__name__)


class RLTrainer:
    """Runs GRPO / PPO for `RunConfig`; `fit()` trains, validates, logs and checkpoints."""

    def __init__(self, run: RunConfig, *, operative_config: str = "", inprocess: bool = False):
        self.run = run
        self.run_dir = run.trainer.run_dir
        self.main = distributed.is_main()
        resolve_resume(run.trainer.resume_mode, self.run_dir)  # a bad path fails before any work
        os.makedirs(self.run_dir, exist_ok=True)
        self.tokenizer = load_tokenizer(run)
        self.tools = make_tool_runner(run.rollout.multi_turn) if run.rollout.multi_turn.enable else None
        if self.tools is not None:
            import jaxrl_llm.agent.env  # noqa: F401 (the built-in environments' rewards, for the data check)
        self.train_data, self.val_data, self.iterator = build_datasets(
            run, self.tokenizer, tools=self.tools.schemas if self.tools else None)
        t = run.trainer
        self.total_steps = t.total_training_steps or self.iterator.steps_per_epoch * t.total_epochs
        custom = (CustomRewardFunction(run.reward.custom_reward_path, run.reward.custom_reward_name)
                  if run.reward.custom_reward_path else None)
        self.rewards = RewardManager(custom, num_workers=run.reward.num_workers, backend=run.reward.backend,
                                     strict=run.reward.strict)
        self.scorer = StepScorer(self.tokenizer, self.rewards)
        datasets = [d for d in (self.train_data, self.val_data) if d is not None]
        self.rewards.check_data_sources({item["data_source"] for d in datasets for item in d},
                                        where=", ".join(f for d in datasets for f in getattr(d, "files", ())))
        a = run.algo
        self.kl_ctrl = (make_kl_controller(a.kl_ctrl_type, a.kl_coef, a.kl_target, a.kl_horizon)
                        if a.use_kl_in_reward else None)
        self.worker = make_worker(run, total_steps=self.total_steps, inprocess=inprocess)
        self.operative_config = operative_config
        self.global_step = 0
        self.resumed_meta: dict | None = None
        self.checkpoint_usage: dict[str, float] = {}  # of the checkpoints committed before the last save
        self.ckpt_dir = os.path.join(self.run_dir, "checkpoints")
        self.worker.call("open_checkpointer", self.ckpt_dir, t.max_checkpoints_to_keep)
        try:
            self._resume()
            self._save_tokenizer()
            self.use_pool = run.rollout.engine == "vllm"
            # LoRA on the pool: the base once, then only the adapters (vLLM LoRA requests), unless rollout.lora_merge
            self.lora = lora_spec(run)
            self.sync_adapters = self.use_pool and self.lora is not None and not run.rollout.lora_merge
            self.pool = self._make_vllm_pool() if self.use_pool else None  # on process 0 only
            self.agent = self._make_agent_loop() if self.tools else None
        except BaseException:
            # Let Orbax's background threads finish before the caller may remove the run dir.
            self.worker.call("close_checkpointer")
            raise
        self.logger = MetricsLogger(self.run_dir, t.logger if self.main else (), total_steps=self.total_steps,
                                    start_step=self.global_step,
                                    project=t.project_name, experiment=t.experiment_name,
                                    progress_bar=t.progress_bar)
        self.peak = self.worker.call("peak_tflops")
        self.n_devices = self.worker.call("num_devices")
        self.model_cfg = self.worker.call("model_config")
        self.needs_old = self.worker.call("needs_old_log_prob")
        self.needs_ref = self.worker.call("needs_ref_flag")
        if self.main and operative_config:
            with open(os.path.join(self.run_dir, "operative_config.gin"), "w") as f:
                f.write(operative_config)

    # ---- checkpoints -----------------------------------------------------------------------------
    def _meta(self) -> dict:
        return {"step": self.global_step, "data": self.iterator.state_dict(),
                "kl_ctrl": self.kl_ctrl.state_dict() if self.kl_ctrl is not None else None,
                "seed": self.run.data.seed, "model": self.model_cfg_hf, "dtype": self.run.model.dtype,
                "gin": self.operative_config,
                "lora": lora_meta(self.run, lora_spec(self.run)), "jaxrl_llm": jaxrl_llm.__version__}

    def _resume(self) -> None:
        """Continues from a checkpoint (`train.resume_mode`): states, step, data order, KL controller."""
        self.model_cfg_hf = self.worker.call("model_config").to_hf()
        directory, step = resolve_resume(self.run.trainer.resume_mode, self.run_dir)
        if directory is None:
            self.worker.call("set_aside_checkpoints")
            log.info("train.resume_mode='disable': starting from step 0")
            return
        meta = self.worker.call("restore_checkpoint", directory, step)
        if meta is None:
            log.info("no checkpoint in %s: starting from step 0", directory)
            return
        self.global_step = int(meta["step"])
        self.resumed_meta = meta
        self.iterator.load_state_dict(meta["data"])
        if self.kl_ctrl is not None and meta.get("kl_ctrl"):
            self.kl_ctrl.load_state_dict(meta["kl_ctrl"])
        log.info("resumed from %s at step %d", directory, self.global_step)

    def save_checkpoint(self) -> None:
        """Starts the checkpoint of this step (written while the next steps run); keeps the disk usage of the
        committed checkpoints (perf/checkpoint_*) for the step's metrics."""
        self.checkpoint_usage = self.worker.call("save_checkpoint", self.global_step, self._meta()) or {}

    def _save_tokenizer(self) -> None:
        """Keeps the tokenizer beside the checkpoints, so exports are complete HF directories."""
        path = os.path.join(self.run_dir, "tokenizer")
        if self.main and not os.path.exists(os.path.join(path, "tokenizer_config.json")):
            self.tokenizer.save_pretrained(path)

    # ---- rollout engine ----------------------------------------------------------------------------
    def _make_vllm_pool(self):
        """The vLLM pool of Ray actors, started from the actor's current weights (saved with Orbax)."""
        from jaxrl_llm.rollout import VllmPool
        from jaxrl_llm.trainer.roles import init_ray

        self.weights_dir = self._weights_dir()
        # Every process writes its shards. LoRA with adapter syncs: the frozen base, then this step's adapters
        # (a killed run's newer adapters, left on disk, go first).
        if self.sync_adapters and self.main:
            shutil.rmtree(os.path.join(self.weights_dir, "adapters"), ignore_errors=True)
        self.worker.call("save_weights", self.weights_dir, self.global_step, base=self.sync_adapters)
        adapter = self.worker.call("save_adapters", self.weights_dir, self.global_step) if self.sync_adapters else None
        if not self.main:
            return None
        init_ray(self.run)
        d = self.run.data
        lora = self.lora if self.sync_adapters else None
        pool = VllmPool(self.worker.call("model_config"), num_workers=self.run.rollout.vllm_workers,
                        weights_dir=self.weights_dir, max_prompt_length=engine_prompt_length(self.run),
                        max_model_len=d.max_prompt_length + d.max_response_length, dtype=self.run.model.dtype,
                        seed=d.seed, lora_rank=lora.rank if lora else 0, lora_targets=lora.targets if lora else ())
        if adapter is not None:
            pool.update_adapter(adapter, step=self.global_step)
        return pool

    def _weights_dir(self) -> str:
        """The pool's weights checkpoint dir: <run_dir>/weights, or this run's own subdirectory of
        `rollout.weights_dir` (named by the run dir, so every process of the run finds the same one)."""
        root = self.run.rollout.weights_dir
        if not root:
            return os.path.join(self.run_dir, "weights")
        tag = hashlib.sha1(os.path.abspath(self.run_dir).encode()).hexdigest()[:12]
        return os.path.join(root, f"jaxrl_llm_weights_{tag}")

    def _remove_weights_dir(self) -> None:
        """Drops the pool's weights at the end of a run when they live outside the run dir (a RAM disk
        keeps two steps of weights in host memory otherwise)."""
        if self.main and self.use_pool and self.run.rollout.weights_dir:
            shutil.rmtree(self._weights_dir(), ignore_errors=True)

    def _make_agent_loop(self):
        """The multi-turn agent loop over this run's engine (`rollout.multi_turn.enable`)."""
        from jaxrl_llm.agent.formats import get_format
        from jaxrl_llm.agent.loop import AgentLoop

        if not self.use_pool and distributed.process_count() > 1:
            raise ConfigValueError("rollout.multi_turn.enable: a multi-process run drives multi-turn rollouts "
                                   "from process 0 only; use rollout.engine = 'vllm' (or one process)")
        engine = self.pool.generate if self.use_pool else lambda *a, **k: self.worker.call("generate", *a, **k)
        mt = self.run.rollout.multi_turn
        return AgentLoop(engine, self.tokenizer, self.tools, get_format(mt.format), mt,
                         max_response_length=self.run.data.max_response_length,
                         max_prompt_length=self.run.data.max_prompt_length)

    def generate(self, prompts: list[dict], sampling: SamplingParams) -> RolloutBatch:
        """`sampling.n` responses a prompt; with multi-turn on, the agent loop's trajectories."""
        ids = [p["prompt_ids"] for p in prompts]
        if self.agent is not None:  # process 0 runs the loop and its tools; every process gets the rollout
            return distributed.broadcast_object(self.agent.run(prompts, sampling) if self.main else None)
        if self.use_pool:  # process 0 drives the pool; every process gets its rollout
            return distributed.broadcast_object(self.pool.generate(ids, sampling) if self.main else None)
        return self.worker.call("generate", ids, sampling)

    def sync_weights(self, version: int) -> None:
        """New actor weights to the engine: in device memory (JAX), or via an Orbax checkpoint (vLLM); a LoRA
        run's pool gets the adapters alone, as a PEFT directory it serves as vLLM LoRA requests."""
        if not self.use_pool:
            self.worker.call("sync_rollout_weights", version)
        elif self.sync_adapters:
            adapter = self.worker.call("save_adapters", self.weights_dir, version)  # process 0 writes
            if self.main:
                self.pool.update_adapter(adapter, step=version)
            distributed.barrier(f"weights_{version}")
        else:
            self.worker.call("save_weights", self.weights_dir, version)  # every process writes its shards
            if self.main:
                self.pool.update_weights(step=version)
            distributed.barrier(f"weights_{version}")

    # ---- one step --------------------------------------------------------------------------------
    def sampling(self, step: int, *, validate: bool = False, draw: int = 0) -> SamplingParams:
        """Training sampling of prompt batch `draw` of `step` (a seed of its own), or validation's."""
        r, d = self.run.rollout, self.run.data
        if validate:
            return SamplingParams(n=r.val_n, temperature=r.val_temperature, top_p=r.val_top_p, top_k=r.val_top_k,
                                  max_new_tokens=d.max_response_length, seed=d.seed)
        return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=d.max_response_length, seed=draw_seed(d.seed, step, draw),
                              return_routed_experts=self.run.router_replay.mode == "R3")

    def rollout(self, prompts: list[dict], step: int, draw: int, timer) -> Rollout:
        """Samples `n` responses a prompt; for REMAX also one greedy response a prompt (`timing_s/gen_max`)."""
        max_len = self.run.data.max_response_length
        with timer("gen"):
            sampled = self.generate(prompts, self.sampling(step, draw=draw))
        out = Rollout(build_train_batch(prompts, sampled, max_len, self.run.data.max_prompt_length),
                      response_items(prompts, sampled))
        if self.run.algo.adv_estimator == "remax":
            with timer("gen_max"):
                greedy = self.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_len,
                                                               seed=draw_seed(self.run.data.seed, step, draw)))
            out.greedy = build_train_batch(prompts, greedy, max_len)
            out.greedy_items = response_items(prompts, greedy)
        return out

    def score(self, items: list[dict], batch: TrainBatch, device_done=None) -> ScoredDraw:
        """Scores of every response (this process scores its share; the shares are gathered), with DAPO's
        overlong penalty added when `reward.reward_kwargs.overlong_buffer_cfg.enable` (train and validation,
        as veRL's DAPO reward manager)."""
        out = self.scorer.score(items, batch.responses, batch.response_mask, device_done=device_done)
        scores, extras = out.scores, dict(out.extra_info)
        if "tool_rewards" in batch.fields and self.run.rollout.multi_turn.tool_reward_weight:
            scores = scores + self.run.rollout.multi_turn.tool_reward_weight * batch.fields["tool_rewards"]
        ob = self.run.overlong_buffer
        if ob.enable:
            scores, shaping = apply_overlong_penalty(scores, batch.response_lengths, buffer_len=ob.len, log=ob.log,
                                                     max_response_length=self.run.data.max_response_length,
                                                     penalty_factor=ob.penalty_factor)
            extras.update(shaping)
        return ScoredDraw(batch, scores, extras, dict(out.metrics), out.exposed_s)

    def score_rollout(self, ro: Rollout, device_done=None) -> ScoredDraw:
        """`score`, plus the per-response inputs of the estimators that need more than the score: REMAX's
        greedy baseline (`reward_baselines`), GDPO's reward components (`score/<key>`)."""
        scored = self.score(ro.items, ro.batch, device_done)
        fields = scored.batch.fields
        if ro.greedy is not None:
            base = self.score(ro.greedy_items, ro.greedy)
            by_prompt = np.zeros(int(ro.greedy.group_ids.max()) + 1, np.float32)
            by_prompt[ro.greedy.group_ids] = base.scores
            fields["reward_baselines"] = by_prompt[scored.batch.group_ids]  # [R] its prompt's greedy score
            scored.counts = {k: v + base.counts.get(k, 0) for k, v in scored.counts.items()}
        if self.run.algo.adv_estimator == "gdpo":
            fields.update(extra_info_fields(scored.extra_info, self.run.algo.gdpo_reward_keys,
                                            binding="algorithm.gdpo_reward_keys", prefix="score/"))
        return scored

    def sample_batch(self, prompts: list[dict], step: int, timer, passes: dict,
                     ro: Rollout | None = None) -> tuple[ScoredDraw, dict]:
        """One prompt batch (generated here, or `ro`, generated ahead by an async trainer), scored on the host
        while the device runs the old/reference log-prob (and value) passes; the passes do not need the scores."""
        ro = ro if ro is not None else self.rollout(prompts, step, 0, timer)
        if not any(passes.values()):
            with timer("reward"):
                return self.score_rollout(ro), {}
        worker = self.worker
        with timer("log_probs"):
            worker.call("start_forward_passes", ro.batch, **passes)
            with timer("reward"):
                scored = self.score_rollout(ro, device_done=lambda: worker.call("forward_passes_ready"))
            return scored, worker.call("finish_forward_passes")

    def sample_filtered_batch(self, prompts: list[dict], step: int, timer, passes: dict,
                              metrics: dict) -> tuple[ScoredDraw, dict]:
        """DAPO's dynamic sampling: draws, generates and scores prompt batches until the groups whose
        filter metric varies fill `data.train_batch_size` prompts, then runs the passes on that batch
        alone (it is only known after scoring, so nothing overlaps the reward)."""
        groups = GroupFilter(self.run.filter_groups, self.run.data.train_batch_size)
        for draw in itertools.count():
            if draw:
                groups.check_budget()
                prompts = next(self.iterator)  # the checkpoint's iterator state covers every draw
            ro = self.rollout(prompts, step, draw, timer)
            with timer("reward"):
                groups.add(self.score_rollout(ro))
            if groups.full:
                break
        metrics.update(groups.metrics())
        scored = groups.result()
        scored.exposed_s = timer.times["reward"]
        if not any(passes.values()):
            return scored, {}
        with timer("log_probs"):
            self.worker.call("start_forward_passes", scored.batch, **passes)
            return scored, self.worker.call("finish_forward_passes")

    def _replayed_batch(self, step: int) -> TrainBatch:
        path = os.path.join(self.run.trainer.replay_batches_from, f"step_{step:06d}.npz")
        if not os.path.exists(path):
            raise FileNotFoundError(f"train.replay_batches_from: no batch for step {step} ({path}); replay needs "
                                    "the dumps of every step it runs (train.dump_batches = True)")
        with np.load(path) as f:
            return TrainBatch.from_arrays(dict(f))

    def _dump_batch(self, batch: TrainBatch, step: int) -> None:
        if not self.main:
            return
        d = os.path.join(self.run_dir, "batches")
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f".step_{step:06d}.tmp.npz")
        np.savez(tmp, **batch.to_arrays())
        os.replace(tmp, os.path.join(d, f"step_{step:06d}.npz"))

    def step(self, step: int) -> dict[str, float]:
        """One training step: the next prompt batch, generated, scored and trained on."""
        return self.train_step(next(self.iterator), step)

    def train_step(self, prompts: list[dict], step: int, *, ro: Rollout | None = None,
                   sync: bool = True) -> dict[str, float]:
        """Generates (or takes `ro`), scores, computes the passes and advantages, and updates; `sync`: then moves
        the new weights to the engine (an async trainer moves them itself)."""
        run, worker = self.run, self.worker
        timer = M.Timer()
        metrics: dict[str, float] = {}
        if run.trainer.replay_batches_from:
            return self._replay_step(step, epoch=getattr(prompts, "epoch", None))
        compiled_before = worker.call("compile_stats")
        with timer("step"):
            passes = dict(old=self.needs_old, ref=self.needs_ref, values=run.algo.uses_critic)
            if run.filter_groups.enable:
                scored, out = self.sample_filtered_batch(prompts, step, timer, passes, metrics)
            else:
                scored, out = self.sample_batch(prompts, step, timer, passes, ro=ro)
            batch = scored.batch
            metrics.update(scored.counts)
            metrics["timing_s/reward_exposed"] = scored.exposed_s
            metrics.update(overlong_metrics(scored.extra_info))
            tls = np.zeros_like(batch.response_mask)
            last = np.maximum(batch.response_lengths - 1, 0)
            tls[np.arange(len(batch)), last] = scored.scores
            batch.fields["token_level_scores"] = tls
            batch.fields.update(out)  # every array of the passes: old/ref log-probs, values, entropy, ...
            if "old_log_prob" in out:  # the sampler–trainer gap (what MoE routing replay shrinks)
                metrics.update(router_replay.rollout_gap_metrics(out["old_log_prob"], batch.fields["rollout_log_probs"],
                                                                 batch.response_mask))
            with timer("adv"):
                kl_coef = self.kl_ctrl.value if self.kl_ctrl is not None else 0.0
                adv = worker.call("compute_advantages", batch, kl_coef)
            batch.fields.update(adv["fields"])
            metrics.update(adv["metrics"])
            if self.kl_ctrl is not None:
                self.kl_ctrl.update(adv["metrics"]["actor/reward_kl_penalty"], n_steps=run.data.train_batch_size)
            if run.trainer.dump_batches:
                self._dump_batch(batch, step)
            self._update(batch, step, timer, metrics, sync=sync)
        if self.agent is not None:
            metrics.update(self.agent.last_metrics)
        if "entropy" in out:
            metrics["actor/entropy_rollout"] = float(np.sum(out["entropy"]) / max(batch.response_mask.sum(), 1))
        compiled = worker.call("compile_stats")  # a program compiled after the first step shows here
        metrics.update(compile_watch.delta(compiled_before, compiled))
        metrics.update(worker.call("pack_metrics"))
        metrics["perf/engine_programs_compiled"] = compiled["engine_programs_compiled"]
        # the epoch of the batch trained on (the iterator's is the next batch's: one epoch on at an epoch's end,
        # and further on in the async modes, which draw ahead)
        return self._step_metrics(metrics, batch, timer, step, epoch=getattr(prompts, "epoch", None))

    def _replay_step(self, step: int, epoch: int | None = None) -> dict[str, float]:
        """Trains on a dumped batch instead of generating one: same start state and same batches give
        the same updates (batch dump and replay, for exact reproduction)."""
        timer = M.Timer()
        metrics: dict[str, float] = {}
        with timer("step"):
            batch = self._replayed_batch(step)
            self._update(batch, step, timer, metrics)
        return self._step_metrics(metrics, batch, timer, step, epoch=epoch)

    def _update(self, batch: TrainBatch, step: int, timer, metrics: dict, sync: bool = True) -> None:
        """Critic then actor updates on the finished batch, then (`sync`) the new weights to the engine."""
        if self.run.algo.uses_critic:
            with timer("update_critic"):
                metrics.update(self.worker.call("update_critic", batch, step))
        with timer("update_actor"):
            metrics.update(self.worker.call("update_actor", batch, step))
        if sync:
            with timer("reshard"):
                self.sync_weights(step + 1)

    def _step_metrics(self, metrics, batch: TrainBatch, timer, step: int, epoch: int | None = None) -> dict[str, float]:
        run = self.run
        metrics.update(M.data_metrics(batch, max_response_length=run.data.max_response_length,
                                      max_prompt_length=run.data.max_prompt_length, use_critic=run.algo.uses_critic))
        metrics.update(timer.metrics(float(np.sum(batch.prompt_lengths + batch.response_lengths))))
        metrics.update(M.perf_metrics(timer.times, batch, self.model_cfg, ppo_epochs=run.actor.ppo_epochs,
                                      n_devices=self.n_devices, peak=self.peak,
                                      log_prob_passes=self.needs_old + self.needs_ref + run.algo.uses_critic))
        metrics["training/global_step"] = step + 1
        metrics["training/epoch"] = self.iterator.epoch if epoch is None else epoch
        return metrics

    # ---- validation ------------------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        """`rollout.val_n` responses to every validation prompt (greedy when val_n = 1), scored; veRL's
        val-core / val-aux metrics per data source (mean@N, best@N, worst@N, maj@N), pass@k and
        `val-core/mean` (see `jaxrl_llm.trainer.validation`)."""
        items = [self.val_data[i] for i in range(len(self.val_data))]
        bs = self.run.data.val_batch_size or len(items)
        results = ValidationResults()
        for start in range(0, len(items), bs):
            chunk = items[start:start + bs]
            rollout = self.generate(chunk, self.sampling(0, validate=True))
            rows = response_items(chunk, rollout)
            scored = self.score(rows, build_train_batch(chunk, rollout, self.run.data.max_response_length))
            results.add([r["data_source"] for r in rows], (start + rollout.prompt_index).tolist(), scored.scores,
                        scored.extra_info)
        return results.metrics()

    # ---- the run ---------------------------------------------------------------------------------
    def _nothing_to_train(self) -> str:
        """The one line for a run resumed at or past its last step, naming the key that sets it."""
        t = self.run.trainer
        key = (f"train.total_training_steps={t.total_training_steps}" if t.total_training_steps else
               f"train.total_epochs={t.total_epochs} ({self.iterator.steps_per_epoch} steps an epoch)")
        return (f"nothing to train: {self.run_dir} resumed at step {self.global_step} and {key} ends the run at step "
                f"{self.total_steps}; raise it to train on, or give a new train.run_dir (or "
                "train.resume_mode='disable') to start over")

    def fit(self) -> dict[str, float]:
        t = self.run.trainer
        last: dict[str, float] = {}
        if self.global_step >= self.total_steps and self.main:
            log.warning(self._nothing_to_train())
        try:
            if t.val_before_train and self.val_data is not None and self.global_step == 0:
                val = self.validate()
                self.logger.log(self.global_step, val, advance=False)
                last.update(val)
            while self.global_step < self.total_steps:
                step_start = time.perf_counter()
                metrics = self.step(self.global_step)
                self.global_step += 1
                done = self.global_step == self.total_steps
                if self.val_data is not None and t.test_freq > 0 and (self.global_step % t.test_freq == 0 or done):
                    t0 = time.perf_counter()
                    metrics.update(self.validate())
                    metrics["timing_s/testing"] = time.perf_counter() - t0
                if (t.save_freq > 0 and self.global_step % t.save_freq == 0) or done:
                    t0 = time.perf_counter()
                    self.save_checkpoint()
                    metrics["timing_s/save_checkpoint"] = time.perf_counter() - t0  # not the write: that is async
                    metrics.update(self.checkpoint_usage)
                metrics["timing_s/step_total"] = time.perf_counter() - step_start
                self.logger.log(self.global_step, metrics)
                last = metrics
            self.worker.call("wait_checkpoint")
        finally:
            self.logger.close()
            self.rewards.close()
            if self.tools is not None:
                self.tools.close()
            if self.pool is not None:
                self.pool.shutdown()
            self._remove_weights_dir()
        return last
