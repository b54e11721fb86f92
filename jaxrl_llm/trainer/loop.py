"""The RL loop: the one module with side effects. Reads top to bottom as one step of the run.

The data source yields prompts. The engine samples `n` responses each. Reward functions score them
on the host. The worker computes old and reference log-probs (and values), then advantages. The
actor (and critic) update. New weights go to the engine. Metrics are logged; validation and
checkpoints happen every `test_freq` / `save_freq` steps.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from jaxrl_llm.algorithms import make_kl_controller
from jaxrl_llm.rewards import CustomRewardFunction, RewardManager
from jaxrl_llm.rollout import RolloutBatch, SamplingParams
from jaxrl_llm.trainer import metrics as M
from jaxrl_llm.trainer.batch import TrainBatch
from jaxrl_llm.trainer.config import RunConfig
from jaxrl_llm.trainer.data_setup import build_datasets, load_tokenizer
from jaxrl_llm.trainer.loggers import MetricsLogger
from jaxrl_llm.trainer.roles import make_worker

log = logging.getLogger(__name__)


def build_train_batch(prompts: list[dict], rollout: RolloutBatch, max_response_length: int) -> TrainBatch:
    """Response-layout arrays of a rollout: responses [R, Tr], mask, group ids, sampler logprobs."""
    r = len(rollout)
    tr = max_response_length
    lengths = np.minimum(rollout.lengths, tr)
    responses = np.zeros((r, tr), np.int32)
    logps = np.zeros((r, tr), np.float32)
    width = min(tr, rollout.tokens.shape[1])
    responses[:, :width] = rollout.tokens[:, :width]
    logps[:, :width] = rollout.logprobs[:, :width]
    mask = (np.arange(tr)[None, :] < lengths[:, None]).astype(np.float32)
    responses *= mask.astype(np.int32)
    logps *= mask
    prompt_ids = [np.asarray(prompts[i]["prompt_ids"], np.int32) for i in rollout.prompt_index]
    return TrainBatch(prompt_ids=prompt_ids, responses=responses, response_mask=mask,
                      group_ids=rollout.prompt_index.astype(np.int32), fields={"rollout_log_probs": logps})


class RLTrainer:
    """Runs GRPO / PPO for `RunConfig`; `fit()` trains, validates, logs and checkpoints."""

    def __init__(self, run: RunConfig, *, operative_config: str = ""):
        self.run = run
        self.run_dir = run.trainer.run_dir
        os.makedirs(self.run_dir, exist_ok=True)
        self.tokenizer = load_tokenizer(run)
        self.train_data, self.val_data, self.iterator = build_datasets(run, self.tokenizer)
        t = run.trainer
        self.total_steps = t.total_training_steps or self.iterator.steps_per_epoch * t.total_epochs
        custom = (CustomRewardFunction(run.reward.custom_reward_path, run.reward.custom_reward_name)
                  if run.reward.custom_reward_path else None)
        self.rewards = RewardManager(custom, num_workers=run.reward.num_workers, strict=run.reward.strict)
        a = run.algo
        self.kl_ctrl = (make_kl_controller(a.kl_ctrl_type, a.kl_coef, a.kl_target, a.kl_horizon)
                        if a.use_kl_in_reward else None)
        self.worker = make_worker(run, total_steps=self.total_steps)
        self.global_step = 0
        self.logger = MetricsLogger(self.run_dir, t.logger, total_steps=self.total_steps, start_step=self.global_step,
                                    project=t.project_name, experiment=t.experiment_name,
                                    progress_bar=t.progress_bar)
        self.peak = self.worker.call("peak_tflops")
        self.n_devices = self.worker.call("num_devices")
        self.model_cfg = self.worker.call("model_config")

    # ---- one step --------------------------------------------------------------------------------
    def sampling(self, step: int, *, validate: bool = False) -> SamplingParams:
        r = self.run.rollout
        if validate:
            return SamplingParams(n=1, temperature=r.val_temperature, max_new_tokens=self.run.data.max_response_length,
                                  seed=self.run.data.seed)
        return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=self.run.data.max_response_length, seed=self.run.data.seed * 100003 + step)

    def score(self, prompts: list[dict], batch: TrainBatch, rollout: RolloutBatch):
        texts = self.tokenizer.batch_decode([batch.responses[i, : batch.response_lengths[i]]
                                             for i in range(len(batch))], skip_special_tokens=True)
        items = [prompts[i] for i in rollout.prompt_index]
        out = self.rewards.score_batch([it["data_source"] for it in items], texts,
                                       [it["ground_truth"] for it in items], [it.get("extra_info") for it in items])
        return out, texts

    def train_step(self, prompts: list[dict], step: int) -> dict[str, float]:
        run, worker = self.run, self.worker
        timer = M.Timer()
        metrics: dict[str, float] = {}
        with timer("step"):
            with timer("gen"):
                rollout = worker.call("generate", [p["prompt_ids"] for p in prompts], self.sampling(step))
            batch = build_train_batch(prompts, rollout, run.data.max_response_length)
            with timer("reward"):
                scored, _ = self.score(prompts, batch, rollout)
            metrics.update(scored.metrics)
            scores = scored.scores
            tls = np.zeros_like(batch.response_mask)
            last = np.maximum(batch.response_lengths - 1, 0)
            tls[np.arange(len(batch)), last] = scores
            batch.fields["token_level_scores"] = tls
            with timer("old_log_prob"):
                old = worker.call("compute_log_prob", batch)
            batch.fields["old_log_prob"] = old["old_log_prob"]
            if worker.call("needs_ref_flag"):
                with timer("ref"):
                    batch.fields["ref_log_prob"] = worker.call("compute_ref_log_prob", batch)
            if run.algo.uses_critic:
                with timer("values"):
                    batch.fields["values"] = worker.call("compute_values", batch)
            with timer("adv"):
                kl_coef = self.kl_ctrl.value if self.kl_ctrl is not None else 0.0
                adv = worker.call("compute_advantages", batch, kl_coef)
            batch.fields.update(adv["fields"])
            metrics.update(adv["metrics"])
            if self.kl_ctrl is not None:
                self.kl_ctrl.update(adv["metrics"]["actor/reward_kl_penalty"], n_steps=len(prompts))
            if run.algo.uses_critic:
                with timer("update_critic"):
                    metrics.update(worker.call("update_critic", batch, step))
            with timer("update_actor"):
                metrics.update(worker.call("update_actor", batch, step))
            with timer("reshard"):
                worker.call("sync_rollout_weights", step + 1)
        metrics["actor/entropy_rollout"] = float(np.sum(old["entropy"]) / max(batch.response_mask.sum(), 1))
        metrics.update(M.data_metrics(batch, max_response_length=run.data.max_response_length,
                                      max_prompt_length=run.data.max_prompt_length, use_critic=run.algo.uses_critic))
        metrics.update(timer.metrics(float(np.sum(batch.prompt_lengths + batch.response_lengths))))
        metrics.update(M.perf_metrics(timer.times, batch, self.model_cfg, ppo_epochs=run.actor.ppo_epochs,
                                      n_devices=self.n_devices, peak=self.peak))
        metrics["training/global_step"] = step + 1
        metrics["training/epoch"] = self.iterator.epoch
        return metrics

    # ---- validation ------------------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        """Greedy decode of the validation split: `val-core/<data_source>/reward/mean@1`."""
        items = [self.val_data[i] for i in range(len(self.val_data))]
        bs = self.run.data.val_batch_size or len(items)
        scores, sources = [], []
        for start in range(0, len(items), bs):
            chunk = items[start:start + bs]
            rollout = self.worker.call("generate", [p["prompt_ids"] for p in chunk], self.sampling(0, validate=True))
            batch = build_train_batch(chunk, rollout, self.run.data.max_response_length)
            out, _ = self.score(chunk, batch, rollout)
            scores.extend(out.scores.tolist())
            sources.extend(p["data_source"] for p in chunk)
        scores, sources = np.asarray(scores), np.asarray(sources)
        metrics = {f"val-core/{src}/reward/mean@1": float(scores[sources == src].mean()) for src in np.unique(sources)}
        metrics["val-core/mean"] = float(scores.mean())
        return metrics

    # ---- the run ---------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        t = self.run.trainer
        last: dict[str, float] = {}
        if t.val_before_train and self.val_data is not None:
            val = self.validate()
            self.logger.log(self.global_step, val)
            last.update(val)
        while self.global_step < self.total_steps:
            prompts = next(self.iterator)
            step_start = time.perf_counter()
            metrics = self.train_step(prompts, self.global_step)
            self.global_step += 1
            if self.val_data is not None and t.test_freq > 0 and (
                    self.global_step % t.test_freq == 0 or self.global_step == self.total_steps):
                t0 = time.perf_counter()
                metrics.update(self.validate())
                metrics["timing_s/testing"] = time.perf_counter() - t0
            metrics["timing_s/step_total"] = time.perf_counter() - step_start
            self.logger.log(self.global_step, metrics)
            last = metrics
        self.logger.close()
        self.rewards.close()
        return last
