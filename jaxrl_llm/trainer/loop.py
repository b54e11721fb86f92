"""The RL loop: the one module with side effects. Reads top to bottom as one step of the run.

The data source yields prompts. The engine samples `n` responses each (and, for REMAX, one greedy
response a prompt). A rollouter hands the loop those batches (trainer/rollouters/): generated in the step
(the synchronous mode), or a step ahead or streamed on the rollout's own devices (the asynchronous ones). The
worker starts the old and reference log-prob (and value) passes on the device, and reward functions score the
responses on the host meanwhile (DAPO's overlong penalty shapes the scores). With DAPO's dynamic sampling on, the
batch is only known after scoring: it comes scored (`trainer.dynamic_sampling`), and the passes run on it alone.
Then advantages; the actor (and critic) update. The rollouter moves the new weights to the engine. Metrics are
logged; validation (`trainer.validation`) and checkpoints happen every `test_freq` / `save_freq` steps.

The worker and the engine are roles (trainer/roles/), called through handles the same way in this process or in
a Ray actor.

In a multi-process run every process runs this loop with the same data, the same programs in the same
order, and the same host-side values (scores and sampler decisions are gathered across processes);
only process 0 logs and writes the run's own files (`jaxrl_llm.distributed`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import numpy as np

import jaxrl_llm
from jaxrl_llm import compile_watch, distributed
from jaxrl_llm.agent.config import make_tool_runner
from jaxrl_llm.algorithms import make_kl_controller
from jaxrl_llm.checkpoint import resolve_resume
from jaxrl_llm.rewards import CustomRewardFunction, RewardManager, apply_overlong_penalty, overlong_metrics
from jaxrl_llm.rollout import RolloutBatch, SamplingParams
from jaxrl_llm.trainer import metrics as M
from jaxrl_llm.trainer import router_replay
from jaxrl_llm.trainer.batch import TrainBatch
from jaxrl_llm.trainer.config import ConfigValueError, RunConfig
from jaxrl_llm.trainer.data_setup import build_datasets, load_tokenizer
from jaxrl_llm.trainer.dynamic_sampling import ScoredDraw, draw_seed, extra_info_fields
from jaxrl_llm.trainer.loggers import MetricsLogger
from jaxrl_llm.trainer.roles.engines import training_sampling
from jaxrl_llm.trainer.roles.host import make_roles
from jaxrl_llm.trainer.roles.model_load import lora_meta, lora_spec
from jaxrl_llm.trainer.rollout_batch import Rollout, build_train_batch, response_items
from jaxrl_llm.trainer.rollouters import make_rollouter
from jaxrl_llm.trainer.rollouters.state import mean_metrics
from jaxrl_llm.trainer.step_rewards import StepScorer
from jaxrl_llm.trainer.validation import ValidationResults

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Trained:
    """A batch trained on, with the metrics of its step so far (its clock may still take the step's weight sync)."""

    rollout: Rollout
    batch: TrainBatch
    metrics: dict[str, float]


class RLTrainer:
    """Runs GRPO / PPO for `RunConfig`; `fit()` trains, validates, logs and checkpoints."""

    def __init__(self, run: RunConfig, *, operative_config: str = ""):
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
        self.worker, self.engine = make_roles(run, total_steps=self.total_steps)
        self.operative_config = operative_config
        self.global_step = 0
        self.resumed_meta: dict | None = None
        self.checkpoint_usage: dict[str, float] = {}  # of the checkpoints committed before the last save
        self.ckpt_dir = os.path.join(self.run_dir, "checkpoints")
        self.worker.open_checkpointer(self.ckpt_dir, t.max_checkpoints_to_keep)
        try:
            self._resume()
            self._save_tokenizer()
            self.engine.start(self.global_step)  # the restored weights, or (a vLLM pool) its first
            self.agent = self._make_agent_loop() if self.tools else None
        except BaseException:
            # Let Orbax's background threads finish before the caller may remove the run dir.
            self.worker.close_checkpointer()
            raise
        self.logger = MetricsLogger(self.run_dir, t.logger if self.main else (), total_steps=self.total_steps,
                                    start_step=self.global_step,
                                    project=t.project_name, experiment=t.experiment_name,
                                    progress_bar=t.progress_bar)
        self.peak = self.worker.peak_tflops()
        self.n_devices = self.worker.num_devices()
        self.model_cfg = self.worker.model_config()
        self.needs_old = self.worker.needs_old_log_prob()
        self.needs_ref = self.worker.needs_ref_flag()
        self.rollouter = make_rollouter(self, self.resumed_meta)
        self._closed = False
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
        self.model_cfg_hf = self.worker.model_config().to_hf()
        directory, step = resolve_resume(self.run.trainer.resume_mode, self.run_dir)
        if directory is None:
            self.worker.set_aside_checkpoints()
            log.info("train.resume_mode='disable': starting from step 0")
            return
        meta = self.worker.restore_checkpoint(directory, step)
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
        """Starts the checkpoint of this step (written while the next steps run) at the rollouter's next sync point,
        with what the rollouter holds; keeps the disk usage of the committed checkpoints (perf/checkpoint_*) for the
        step's metrics."""
        self.rollouter.checkpoint(self._save)

    def _save(self, extra: dict) -> None:
        self.checkpoint_usage = self.worker.save_checkpoint(self.global_step, {**self._meta(), **extra}) or {}

    def _save_tokenizer(self) -> None:
        """Keeps the tokenizer beside the checkpoints, so exports are complete HF directories."""
        path = os.path.join(self.run_dir, "tokenizer")
        if self.main and not os.path.exists(os.path.join(path, "tokenizer_config.json")):
            self.tokenizer.save_pretrained(path)

    # ---- generation ------------------------------------------------------------------------------
    def _make_agent_loop(self):
        """The multi-turn agent loop over this run's engine (`rollout.multi_turn.enable`); process 0 drives it."""
        from jaxrl_llm.agent.formats import get_format
        from jaxrl_llm.agent.loop import AgentLoop

        if self.run.rollout.engine != "vllm" and distributed.process_count() > 1:
            raise ConfigValueError("rollout.multi_turn.enable: a multi-process run drives multi-turn rollouts "
                                   "from process 0 only; use rollout.engine = 'vllm' (or one process)")
        mt = self.run.rollout.multi_turn
        return AgentLoop(self.engine.generate_on_main, self.tokenizer, self.tools, get_format(mt.format), mt,
                         max_response_length=self.run.data.max_response_length,
                         max_prompt_length=self.run.data.max_prompt_length)

    def generate(self, prompts: list[dict], sampling: SamplingParams) -> RolloutBatch:
        """`sampling.n` responses a prompt; with multi-turn on, the agent loop's trajectories."""
        if self.agent is not None:  # process 0 runs the loop and its tools; every process gets the rollout
            return distributed.broadcast_object(self.agent.run(prompts, sampling) if self.main else None)
        return self.engine.generate([p["prompt_ids"] for p in prompts], sampling)

    def sampling(self, step: int, *, validate: bool = False, draw: int = 0) -> SamplingParams:
        """Training sampling of prompt batch `draw` of `step` (a seed of its own), or validation's."""
        r, d = self.run.rollout, self.run.data
        if validate:
            return SamplingParams(n=r.val_n, temperature=r.val_temperature, top_p=r.val_top_p, top_k=r.val_top_k,
                                  max_new_tokens=d.max_response_length, seed=d.seed)
        return training_sampling(self.run, draw_seed(d.seed, step, draw))

    def rollout(self, prompts: list[dict], step: int, draw: int, timer) -> Rollout:
        """Samples `n` responses a prompt; for REMAX also one greedy response a prompt (`timing_s/gen_max`)."""
        max_len = self.run.data.max_response_length
        with timer("gen"):
            sampled = self.generate(prompts, self.sampling(step, draw=draw))
        out = Rollout(build_train_batch(prompts, sampled, max_len, self.run.data.max_prompt_length),
                      response_items(prompts, sampled), prompts=prompts)
        if self.run.algo.adv_estimator == "remax":
            with timer("gen_max"):
                greedy = self.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_len,
                                                               seed=draw_seed(self.run.data.seed, step, draw)))
            out.greedy = build_train_batch(prompts, greedy, max_len)
            out.greedy_items = response_items(prompts, greedy)
        return out

    # ---- scores ----------------------------------------------------------------------------------
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

    def score_with_passes(self, ro: Rollout, timer) -> tuple[ScoredDraw, dict]:
        """The batch's scores, and the old/reference log-prob (and value) passes' results: scored on the host while
        the device runs the passes (they do not need the scores); a batch scored already runs the passes alone."""
        worker = self.worker
        passes = dict(old=self.needs_old, ref=self.needs_ref, values=self.run.algo.uses_critic)
        if not any(passes.values()):
            if ro.scored is not None:
                return ro.scored, {}
            with timer("reward"):
                return self.score_rollout(ro), {}
        with timer("log_probs"):
            if ro.scored is not None:
                worker.start_forward_passes(ro.scored.batch, **passes)
                return ro.scored, worker.finish_forward_passes()
            worker.start_forward_passes(ro.batch, **passes)
            with timer("reward"):
                scored = self.score_rollout(ro, device_done=worker.forward_passes_ready)
            return scored, worker.finish_forward_passes()

    # ---- one step --------------------------------------------------------------------------------
    def step(self, step: int, prompts: list[dict] | None = None) -> dict[str, float]:
        """One training step: each batch the rollouter hands over for it trained on (one a local update), then the
        new weights toward the engine. `prompts`: this step's prompt batch, drawn by the caller (a synchronous run's;
        by default the rollouter draws)."""
        if self.run.trainer.replay_batches_from:  # prompts drawn as the dumped run drew them: the same epochs
            prompts = next(self.iterator) if prompts is None else prompts
            return self._replay_step(step, epoch=getattr(prompts, "epoch", None))
        compiled = self.worker.compile_stats()
        trained = [self.train_on(ro, step) for ro in self.rollouter.take(step, prompts)]
        rollouter_metrics = self.rollouter.sync(step + 1, trained[-1].rollout.timer)
        parts = []
        for t in trained:
            # the epoch of the batch trained on (the iterator's is the next batch's: one epoch on at an epoch's end,
            # and further on in the async modes, which draw ahead)
            m = self._step_metrics(t.metrics, t.batch, t.rollout.timer, step,
                                   epoch=getattr(t.rollout.prompts, "epoch", None))
            parts.append({**m, **t.rollout.metrics})
        metrics = parts[0] if len(parts) == 1 else mean_metrics(parts)
        metrics.update(compile_watch.delta(compiled, self.worker.compile_stats()))  # a program compiled after step 0
        metrics.update(rollouter_metrics)
        return metrics

    def train_step(self, prompts: list[dict], step: int) -> dict[str, float]:
        """One synchronous step on `prompts` (`step(step, prompts)`)."""
        return self.step(step, prompts)

    def train_on(self, ro: Rollout, step: int) -> Trained:
        """Scores one batch while the passes run, computes its advantages and updates the actor (and critic)."""
        run, worker = self.run, self.worker
        timer = ro.timer
        metrics: dict[str, float] = {}
        with timer("step"):
            scored, out = self.score_with_passes(ro, timer)
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
                adv = worker.compute_advantages(batch, kl_coef)
            batch.fields.update(adv["fields"])
            metrics.update(adv["metrics"])
            if self.kl_ctrl is not None:
                self.kl_ctrl.update(adv["metrics"]["actor/reward_kl_penalty"], n_steps=run.data.train_batch_size)
            if run.trainer.dump_batches:
                self._dump_batch(batch, step)
            self._update(batch, step, timer, metrics)
        if self.agent is not None:
            metrics.update(self.agent.last_metrics)
        if "entropy" in out:
            metrics["actor/entropy_rollout"] = float(np.sum(out["entropy"]) / max(batch.response_mask.sum(), 1))
        metrics.update(worker.pack_metrics())
        metrics["perf/engine_programs_compiled"] = self.engine.stats().get("programs_compiled", 0)
        return Trained(ro, batch, metrics)

    def _update(self, batch: TrainBatch, step: int, timer, metrics: dict) -> None:
        """Critic then actor updates on the finished batch."""
        if self.run.algo.uses_critic:
            with timer("update_critic"):
                metrics.update(self.worker.update_critic(batch, step))
        with timer("update_actor"):
            metrics.update(self.worker.update_actor(batch, step))

    def _replay_step(self, step: int, epoch: int | None = None) -> dict[str, float]:
        """Trains on a dumped batch instead of generating one, then syncs the engine: same start state and same
        batches give the same updates (batch dump and replay, for exact reproduction)."""
        timer = M.Timer()
        metrics: dict[str, float] = {}
        with timer("step"):
            batch = self._replayed_batch(step)
            self._update(batch, step, timer, metrics)
            with timer("reshard"):
                self.engine.sync(step + 1)
        return self._step_metrics(metrics, batch, timer, step, epoch=epoch)

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
        `val-core/mean` (see `jaxrl_llm.trainer.validation`). The rollouter runs nothing on the engine meanwhile."""
        items = [self.val_data[i] for i in range(len(self.val_data))]
        bs = self.run.data.val_batch_size or len(items)
        results = ValidationResults()
        with self.rollouter.idle():
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
            self.worker.wait_checkpoint()
        finally:
            self.close()
        return last

    def close(self) -> None:
        """Stops the rollout side (the rollouter's threads and stream; the engine's pools, weights and actors) and the
        run's sinks: what `fit()` does at its end, for callers that drive `step()` themselves."""
        if self._closed:
            return
        self._closed = True
        try:
            self.rollouter.close()
        finally:
            try:
                self.engine.close()
            finally:
                self.logger.close()
                self.rewards.close()
                if self.tools is not None:
                    self.tools.close()
