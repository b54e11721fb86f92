"""`TrainerWorker`: the actor, reference and critic models (and the JAX engine) on one device mesh.

The driver (`trainer.loop`) calls these methods with host `TrainBatch`es, either directly
(in-process) or on a Ray actor; everything on devices stays inside the worker.
"""

from __future__ import annotations

import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import distributed, sharding
from jaxrl_llm.algorithms import (
    AdvantageConfig,
    LossNorm,
    PolicyLossConfig,
    RolloutCorrectionConfig,
    apply_kl_penalty,
    compute_rollout_correction_and_rejection_mask,
    get_adv_estimator,
    select_cov_tokens,
)
from jaxrl_llm.models import Qwen2Config, graphdef_and_abstract_params, init_params, load_params, param_shardings
from jaxrl_llm.models.config import PRESETS
from jaxrl_llm.models.hf_io import is_critic_checkpoint
from jaxrl_llm.rollout import RolloutBatch, SamplingParams, make_jax_engine
from jaxrl_llm.trainer import steps
from jaxrl_llm.trainer.batch import (
    PackShape,
    TrainBatch,
    build_micro_batch,
    plan_micro_batches,
    split_mini_batches,
    tail_shape,
)
from jaxrl_llm.trainer.config import RunConfig, rollout_correction_enabled
from jaxrl_llm.trainer.optim import make_optimizer

log = logging.getLogger(__name__)

HOST_ONLY = ("seq_ids",)


def resolve_model_path(path: str) -> str:
    """A local directory as is; otherwise a hub id, fetched with huggingface_hub (needs network)."""
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} is a file; pass a HF model directory")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja"])
    except Exception as e:  # offline, unknown repo, no hub client
        raise FileNotFoundError(f"model path {path!r} is not a local directory, and fetching it as a hub id "
                                f"failed ({type(e).__name__}: {e}); pass a local HF model directory") from None


def model_config(run: RunConfig) -> Qwen2Config:
    m = run.model
    remat = "full" if m.remat == "auto" else m.remat  # "auto" is resolved once the mesh is known
    numerics = dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=remat, attention_impl=m.attention_impl,
                    **(m.overrides or {}))
    if m.preset is not None:
        if m.preset not in PRESETS:
            raise ValueError(f"model.preset: unknown preset {m.preset!r}; known: {sorted(PRESETS)}")
        return PRESETS[m.preset](**numerics)
    return Qwen2Config.from_hf(resolve_model_path(m.path), **numerics)


def opt_state_shardings(tx, params, param_sh, mesh):
    """Shardings for `tx.init(params)`: a leaf that mirrors a param (Adam's mu and nu) takes that
    param's sharding, found by the key path the two share; anything else (counts) is replicated.
    Without this, jit places the state's zeros on one device."""
    by_path = {jax.tree_util.keystr(p): (x.shape, sh) for (p, x), sh in
               zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(param_sh))}
    rep = sharding.replicated(mesh)

    def pick(path, leaf):
        key = jax.tree_util.keystr(path)
        for suffix, (shape, sh) in by_path.items():
            if key.endswith(suffix) and leaf.shape == shape:
                return sh
        return rep

    return jax.tree_util.tree_map_with_path(pick, jax.eval_shape(tx.init, params))


def policy_loss_config(run: RunConfig, rc: RolloutCorrectionConfig | None) -> PolicyLossConfig:
    """The actor's policy loss from `actor.*` and `actor.policy_loss.*`; bypass mode swaps in veRL's
    `bypass_mode` loss, which reads the rollout-correction settings."""
    a, p = run.actor, run.policy_loss
    return PolicyLossConfig(
        loss_mode="bypass_mode" if rc is not None and rc.bypass_mode else p.loss_mode,
        clip_ratio_low=a.low, clip_ratio_high=a.high, clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode,
        clip_cov_ratio=p.clip_cov_ratio, clip_cov_lb=p.clip_cov_lb, clip_cov_ub=p.clip_cov_ub,
        kl_cov_ratio=p.kl_cov_ratio, ppo_kl_coef=p.ppo_kl_coef, dro_beta=p.dro_beta, tau_pos=a.tau_pos,
        tau_neg=a.tau_neg, rollout_correction=rc)


def rollout_correction_config(run: RunConfig) -> RolloutCorrectionConfig | None:
    """`algorithm.rollout_correction.*`, or None when it is off."""
    return run.rollout_correction if rollout_correction_enabled(run.rollout_correction) else None


class TrainerWorker:
    """Owns the device state of a run. `total_steps` sizes the LR schedule."""

    def __init__(self, run: RunConfig, *, total_steps: int, model_cfg: Qwen2Config | None = None):
        self.run = run
        t = run.trainer
        self.mesh = sharding.make_mesh(t.mesh_data, t.mesh_fsdp, t.mesh_tensor, expert=t.mesh_expert)
        self.dp = sharding.data_parallel_size(self.mesh)
        self.cfg = model_cfg or model_config(run)
        if model_cfg is None and run.model.remat == "auto":
            self.cfg = self.cfg.replace(remat=self._auto_remat())
        self.actor_gd, _ = graphdef_and_abstract_params(self.cfg)
        self.actor_sh = param_shardings(self.cfg, self.mesh)
        params = self._load_actor_params()

        n_mini = run.data.train_batch_size // run.actor.ppo_mini_batch_size
        self.tx, self.lr_at = make_optimizer(
            run.actor.lr, total_steps=total_steps, updates_per_step=n_mini * run.actor.ppo_epochs,
            warmup_steps=run.actor.lr_warmup_steps, warmup_ratio=run.actor.lr_warmup_steps_ratio,
            scheduler=run.actor.lr_scheduler, min_lr_ratio=run.actor.min_lr_ratio,
            weight_decay=run.actor.weight_decay, betas=run.actor.betas, grad_clip=run.actor.grad_clip)
        self.actor_state = self._init_state(params, self.tx, self.actor_sh)
        self.actor_state_sh = jax.tree.map(lambda x: x.sharding, self.actor_state)

        self.needs_ref = run.actor.use_kl_loss or run.algo.use_kl_in_reward
        self.ref_params = self._make_ref(params) if self.needs_ref else None

        self.critic_state = None
        if run.algo.uses_critic:
            self.critic_gd, _ = graphdef_and_abstract_params(self.cfg, critic=True)
            self.critic_sh = param_shardings(self.cfg, self.mesh, critic=True)
            c = run.critic
            self.critic_tx, self.critic_lr_at = make_optimizer(
                c.lr, total_steps=total_steps, updates_per_step=n_mini * (c.ppo_epochs or run.actor.ppo_epochs),
                warmup_steps=c.lr_warmup_steps, scheduler=c.lr_scheduler, weight_decay=c.weight_decay,
                grad_clip=c.grad_clip)
            self.critic_state = self._init_state(self._load_critic_params(), self.critic_tx, self.critic_sh)
            self.critic_state_sh = jax.tree.map(lambda x: x.sharding, self.critic_state)

        self._build_steps()
        self._cast_for_pool = None
        self.engine = None
        if run.rollout.engine == "jax":
            self.engine = make_jax_engine(self.cfg, self.actor_state["params"], self.mesh, rollout=run.rollout,
                                          max_prompt_length=run.data.max_prompt_length)

    # ---- construction ----------------------------------------------------------------------------
    def _auto_remat(self) -> str:
        """`model.remat='auto'`: "dots" when the update fits this device with it, else "full"."""
        from jaxrl_llm.trainer.memory import choose_remat, device_memory_bytes

        run, shape = self.run, self.mesh.shape
        tokens = max(1, run.actor.ppo_max_token_len_per_gpu // run.pack_length) * run.pack_length
        return choose_remat(self.cfg, tokens_per_device=tokens, param_shards=shape["fsdp"] * shape["tensor"],
                            tensor=shape["tensor"], ref=(run.actor.use_kl_loss or run.algo.use_kl_in_reward)
                            and not run.trainer.ref_offload, critic=run.algo.uses_critic,
                            engine=run.rollout.engine == "jax" and not run.rollout.free_cache_engine,
                            device_bytes=device_memory_bytes())

    def _load_actor_params(self):
        m = self.run.model
        if m.preset is not None:
            return init_params(self.cfg, mesh=self.mesh, seed=m.seed)
        return load_params(resolve_model_path(m.path), self.cfg, mesh=self.mesh)

    def _load_critic_params(self):
        m = self.run.model
        if m.preset is not None:
            return init_params(self.cfg, mesh=self.mesh, seed=m.seed + 1, critic=True)
        path = resolve_model_path(m.critic_path or m.path)
        if is_critic_checkpoint(path):  # the family's *ForTokenClassification
            return load_params(path, self.cfg, mesh=self.mesh, critic=True)
        # veRL initialises the critic from the actor checkpoint with a fresh value head.
        lm = load_params(path, self.cfg, mesh=self.mesh)
        head_cfg = self.cfg.replace(num_hidden_layers=1, vocab_size=8, mlp_only_layers=(), decoder_sparse_step=1)
        head = init_params(head_cfg, seed=m.seed + 1, critic=True)
        score = jax.tree.map(lambda x, sh: distributed.put(distributed.fetch(x), sh), head["score"],
                             self.critic_sh["score"])
        return {"model": lm["model"], "score": score}

    def _init_state(self, params, tx, param_sh):
        opt_state = jax.jit(tx.init, out_shardings=opt_state_shardings(tx, params, param_sh, self.mesh))(params)
        scalar = lambda: distributed.put(np.zeros((), np.int32), sharding.replicated(self.mesh))
        return {"params": params, "opt_state": opt_state, "step": scalar(), "skipped": scalar()}

    def _make_ref(self, params):
        """The frozen reference policy in the compute dtype; on the host when `ref_offload` (each
        process keeps its own devices' shards)."""
        dt = jnp.dtype(self.cfg.dtype)
        ref = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dt), p), out_shardings=self.actor_sh)(params)
        if self.run.trainer.ref_offload:
            ref = jax.tree.map(distributed.to_host_shards, ref)
        return ref

    def _ref_on_device(self):
        if not self.run.trainer.ref_offload:
            return self.ref_params
        return jax.tree.map(distributed.from_host_shards, self.ref_params)

    def _build_steps(self):
        run = self.run
        temp = run.rollout.temperature
        chunk = run.actor.logprob_chunk_size
        self.pack = self._pack_shape(run.actor.ppo_max_token_len_per_gpu)
        # Forward-only passes keep no activations for a backward pass: larger micro-batches, fewer of them.
        self.fwd_pack = self._pack_shape(run.rollout.log_prob_max_token_len_per_gpu
                                         or 2 * run.actor.ppo_max_token_len_per_gpu)
        self.estimator = get_adv_estimator(run.algo.adv_estimator)
        self.rc = rollout_correction_config(run)
        self.bypass = self.rc is not None and self.rc.bypass_mode
        # The optimal-token-baseline estimators need Σ_v π(v)² of the old policy from its log-prob pass.
        self.with_sum_pi_squared = "sum_pi_squared" in self.estimator.inputs
        self.logprob_fn = steps.make_logprob_fn(self.actor_gd, temperature=temp, chunk_size=chunk, with_entropy=True,
                                                with_sum_pi_squared=self.with_sum_pi_squared)
        self.ref_logprob_fn = steps.make_logprob_fn(self.actor_gd, temperature=temp, chunk_size=chunk)
        # A step that is one mini-batch and one epoch is exactly on-policy (veRL's shortcut): the ratio is
        # 1 by construction and the old-log-prob pass is skipped, unless something else reads the old
        # log-probs (the KL in the reward, decoupled rollout correction, the optimal token baseline).
        # Bypass mode uses the sampler's log-probs as the old ones and never runs the pass.
        self.on_policy = (run.actor.ppo_epochs == 1 and run.actor.ppo_mini_batch_size == run.data.train_batch_size
                          and not run.algo.use_kl_in_reward and self.rc is None
                          and not {"old_log_probs", "sum_pi_squared"} & set(self.estimator.inputs))
        self.policy_loss = policy_loss_config(run, self.rc)
        self.loss_settings = steps.ActorLossSettings(
            temperature=temp, policy=self.policy_loss, entropy_coeff=run.actor.entropy_coeff,
            use_kl_loss=run.actor.use_kl_loss, kl_loss_coef=run.actor.kl_loss_coef,
            kl_loss_type=run.actor.kl_loss_type, chunk_size=chunk, on_policy=self.on_policy,
            router_aux_loss_coef=self.cfg.router_aux_loss_coef if self.cfg.output_router_logits else 0.0)
        # clip_cov / kl_cov choose their tokens over the whole mini-batch, from the current policy.
        self.cov_select = (jax.jit(functools.partial(select_cov_tokens, config=self.policy_loss))
                           if self.policy_loss.loss_mode in ("clip_cov", "kl_cov") else None)
        self.actor_grad = steps.make_grad_step(steps.actor_loss, self.actor_gd, self.actor_sh, s=self.loss_settings)
        self.actor_metrics0 = steps.make_metrics_init(steps.actor_loss, self.actor_gd, s=self.loss_settings)
        self.actor_apply = steps.make_apply_step(self.tx, self.actor_state_sh)
        self.actor_zeros = steps.make_zeros(self.actor_sh)
        self.adv_fn = self._make_adv_fn()
        if self.critic_state is not None:
            kw = dict(cliprange_value=run.critic.cliprange_value, loss_agg_mode=run.critic.loss_agg_mode)
            self.value_fn = steps.make_value_fn(self.critic_gd)
            self.critic_grad = steps.make_grad_step(steps.critic_loss, self.critic_gd, self.critic_sh, **kw)
            self.critic_metrics0 = steps.make_metrics_init(steps.critic_loss, self.critic_gd, **kw)
            self.critic_apply = steps.make_apply_step(self.critic_tx, self.critic_state_sh)
            self.critic_zeros = steps.make_zeros(self.critic_sh)

    def _pack_shape(self, tokens_per_device: int) -> PackShape:
        run = self.run
        length = run.pack_length
        per_device = max(1, tokens_per_device // length)
        rows = per_device * self.dp
        max_seqs = rows * max(1, length // 8)
        return PackShape(rows=rows, length=length, max_seqs=max_seqs, resp_len=run.data.max_response_length)

    # ---- placement -------------------------------------------------------------------------------
    def _put(self, mb: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        out = {}
        for k, v in mb.items():
            if k in HOST_ONLY:
                continue
            out[k] = distributed.put(v, sharding.batch_sharding(self.mesh, v.ndim, v.shape))
        return out

    def _micro_batches(self, batch: TrainBatch, fields, pack: PackShape):
        lengths = batch.prompt_lengths + batch.response_lengths
        for placements in plan_micro_batches(lengths, pack):
            shape = tail_shape(placements, pack, self.dp, self.run.actor.tail_shapes)
            mb = build_micro_batch(batch, placements, shape, fields=fields, pad_id=self.cfg.pad_token_id or 0)
            yield mb["seq_ids"], self._put(mb)

    # ---- forward passes: old and reference log-probs, values ------------------------------------
    def start_forward_passes(self, batch: TrainBatch, *, old: bool = False, ref: bool = False,
                             values: bool = False) -> None:
        """Packs `batch` once and dispatches every micro-batch of the asked passes: the actor's log-probs
        and entropy (`old`), the reference log-probs (`ref`), the critic's values (`values`).

        Nothing is fetched: the device computes while the caller does host work (the driver scores
        rewards here), and `finish_forward_passes` collects the results.
        """
        passes = []
        if old:
            names = {"log_prob": "old_log_prob", "entropy": "entropy"}
            if self.with_sum_pi_squared:
                names["sum_pi_squared"] = "sum_pi_squared"
            passes.append((self.logprob_fn, self.actor_state["params"], names))
        if ref:
            passes.append((self.ref_logprob_fn, self._ref_on_device(), {"log_prob": "ref_log_prob"}))
        if values:
            passes.append((self.value_fn, self.critic_state["params"], {"values": "values"}))
        pending = []
        with jax.set_mesh(self.mesh):
            # Dispatch every micro-batch before fetching any result, so the host packs the next
            # micro-batch while the device computes.
            for seq_ids, mb in self._micro_batches(batch, (), self.fwd_pack):
                pending.append((seq_ids, [(names, fn(params, mb)) for fn, params, names in passes]))
        self._pending = (batch, pending)

    def forward_passes_ready(self) -> bool:
        """Whether the device has finished the dispatched passes (never blocks)."""
        _, pending = self._pending
        return not pending or all(x.is_ready() for _, res in pending[-1:] for _, r in res
                                  for x in jax.tree.leaves(r))

    def finish_forward_passes(self) -> dict[str, np.ndarray]:
        """The results of `start_forward_passes`, [R, Tr] each, masked to the responses."""
        batch, pending = self._pending
        self._pending = None
        out: dict[str, np.ndarray] = {}
        for seq_ids, results in pending:
            used = seq_ids >= 0
            for names, res in results:
                res = distributed.fetch_tree(res)
                for k, name in names.items():
                    if name not in out:
                        out[name] = np.zeros(batch.responses.shape, np.float32)
                    out[name][seq_ids[used]] = res[k][used]
        for k in out:
            out[k] *= batch.response_mask
        return out

    def _forward(self, batch: TrainBatch, **passes) -> dict[str, np.ndarray]:
        self.start_forward_passes(batch, **passes)
        return self.finish_forward_passes()

    # ---- the RL step -----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        return self.engine.generate(prompts, sampling)

    def compute_log_prob(self, batch: TrainBatch) -> dict[str, np.ndarray]:
        """Old log-probs and entropy of the current actor ([R, Tr] each)."""
        return self._forward(batch, old=True)

    def compute_ref_log_prob(self, batch: TrainBatch) -> np.ndarray:
        return self._forward(batch, ref=True)["ref_log_prob"]

    def compute_values(self, batch: TrainBatch) -> np.ndarray:
        return self._forward(batch, values=True)["values"]

    def _make_adv_fn(self):
        """One jitted function from the scored batch to what the update needs: rollout correction
        (decoupled mode: importance weights and rejection of the whole batch, from the old and the
        sampler's log-probs), token-level rewards (with the in-reward KL penalty when configured), then
        the configured advantage estimator, called with the batch fields it declares."""
        algo = self.run.algo
        est, rc = self.estimator, self.rc
        config = AdvantageConfig(gamma=algo.gamma, lam=algo.lam, norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
                                 gdpo_reward_keys=algo.gdpo_reward_keys, gdpo_reward_weights=algo.gdpo_reward_weights)

        def fn(scores, mask, f, kl_coef):
            metrics, out = {}, {}
            if rc is not None and not rc.bypass_mode:
                weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
                    f["old_log_prob"], f["rollout_log_probs"], mask, rc)
                out["loss_mask"] = mask
                if weights is not None:
                    out["rollout_is_weights"] = weights
            rewards = scores
            if algo.use_kl_in_reward:
                rewards, kl_metrics = apply_kl_penalty(scores, f["old_log_prob"], f["ref_log_prob"], mask, kl_coef,
                                                       algo.kl_penalty)
                metrics = {**metrics, **kl_metrics}
            inputs = {**f, **out, "old_log_probs": f.get("old_log_prob")}
            adv, ret = est.fn(rewards, mask, config=config, **{k: inputs.get(k) for k in est.inputs})
            return {**out, "token_level_rewards": rewards, "advantages": adv, "returns": ret}, metrics

        return jax.jit(fn)

    def _adv_inputs(self, batch: TrainBatch) -> dict:
        """The batch fields the advantage function reads, by the estimator's input names."""
        f, need = batch.fields, set(self.estimator.inputs)
        out = {"index": batch.group_ids}
        # Only the [R, Tr] fields `adv_fn` reads go to the device: the rollout correction's and the in-reward
        # KL's log-probs, and the estimator's own inputs.
        decoupled_rc, kl_in_reward = self.rc is not None and not self.bypass, self.run.algo.use_kl_in_reward
        wanted = {"values", "sum_pi_squared", "reward_baselines"} & need
        if "old_log_probs" in need or kl_in_reward or decoupled_rc:
            wanted.add("old_log_prob")
        if kl_in_reward:
            wanted.add("ref_log_prob")
        if decoupled_rc:
            wanted.add("rollout_log_probs")
        for name in sorted(wanted):
            if name in f:
                out[name] = f[name]
        if "reward_components" in need:
            keys = self.run.algo.gdpo_reward_keys or ()
            out["reward_components"] = {k: f[f"score/{k}"] for k in keys}
        missing = sorted(k for k in need - {"old_log_probs", "rollout_is_weights"} if k not in out)
        if "old_log_probs" in need and "old_log_prob" not in out:
            missing.append("old_log_prob")
        if missing:
            raise ValueError(f"algorithm.adv_estimator={self.run.algo.adv_estimator!r} needs the batch fields "
                             f"{missing}, which this step did not produce")
        return out

    def compute_advantages(self, batch: TrainBatch, kl_coef: float = 0.0) -> dict:
        """Token-level rewards, advantages and returns [R, Tr] (veRL semantics), on device; with rollout
        correction on (decoupled mode), also the importance weights and the loss mask of the update."""
        if self.bypass:  # veRL's bypass mode: the sampler's log-probs are the old ones
            batch.fields["old_log_prob"] = batch.fields["rollout_log_probs"]
        fields, metrics = self.adv_fn(batch.fields["token_level_scores"], batch.response_mask,
                                      self._adv_inputs(batch), np.float32(kl_coef))
        fields, metrics = distributed.fetch_tree((fields, metrics))
        fields = {k: np.asarray(v) for k, v in fields.items()}
        if self.bypass:
            fields["old_log_prob"] = batch.fields["old_log_prob"]
        return {"fields": fields, "metrics": {k: float(v) for k, v in metrics.items()}}

    def _update(self, batch: TrainBatch, *, state, grad_fn, metrics0, zeros, apply_fn, fields, epochs, lr, prefix,
                prepare=None):
        """Epochs x mini-batches of optimizer steps, each the sum of its micro-batches' gradients.

        `prepare(sub, params, index)`, when given, adds fields that depend on the whole mini-batch and the
        current params to `sub` before it is split (the clip_cov / kl_cov token selection).
        """
        run = self.run
        mini = run.actor.ppo_mini_batch_size * run.rollout.n
        history = []
        with jax.set_mesh(self.mesh):
            for epoch in range(epochs):
                for i, idx in enumerate(split_mini_batches(len(batch), mini)):
                    sub = batch.select(idx)
                    if prepare is not None:
                        prepare(sub, state["params"], epoch * len(batch) + i)
                    mask = sub.fields.get("loss_mask", sub.response_mask)
                    norm = LossNorm(num_tokens=jnp.float32(max(mask.sum(), 1.0)),
                                    num_seqs=jnp.float32(max((mask.sum(-1) > 0).sum(), 1)),
                                    max_len=jnp.float32(run.actor.loss_scale_factor or run.data.max_response_length))
                    grads = metrics = None
                    for _, mb in self._micro_batches(sub, fields, self.pack):
                        if grads is None:
                            grads = zeros(state["params"])
                            metrics = metrics0(state["params"], mb, norm)
                        grads, metrics = grad_fn(state["params"], grads, metrics, mb, norm)
                    state, applied = apply_fn(state, grads)
                    history.append((metrics, applied))  # fetched after the last update: no sync here
        history = [{**m, f"{prefix}/grad_norm": a["grad_norm"], f"{prefix}/skipped_steps": a["skipped"],
                    f"{prefix}/lr": lr} for m, a in distributed.fetch_tree(history)]
        out = {}
        for k in history[0]:
            combine = steps.metric_combiner(k)
            vals = [h[k] for h in history]
            out[k] = float(np.mean(vals) if combine is None else functools.reduce(combine, vals))
        out[f"{prefix}/skipped_steps"] = float(sum(h[f"{prefix}/skipped_steps"] for h in history))
        return state, out

    def update_actor(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """PPO epochs x mini-batches of AdamW updates; `step` is the training step (for the LR)."""
        if self.bypass:  # veRL's bypass mode: the sampler's log-probs are the old ones
            batch.fields.setdefault("old_log_prob", batch.fields["rollout_log_probs"])
        self._release_engine_weights()
        fields = ["advantages"] if self.on_policy else ["old_log_prob", "advantages"]
        if self.run.actor.use_kl_loss:
            fields.append("ref_log_prob")
        fields += [k for k in ("rollout_log_probs", "loss_mask", "rollout_is_weights") if k in batch.fields]
        prepare = None
        if self.cov_select is not None:
            fields.append("token_select")
            prepare = functools.partial(self._select_cov_tokens, step=step)
        self.actor_state, metrics = self._update(
            batch, state=self.actor_state, grad_fn=self.actor_grad, metrics0=self.actor_metrics0,
            zeros=self.actor_zeros, apply_fn=self.actor_apply, fields=fields, epochs=self.run.actor.ppo_epochs,
            lr=float(self.lr_at(step)), prefix="actor", prepare=prepare)
        if self.run.actor.use_kl_loss:
            metrics["actor/kl_coef"] = self.run.actor.kl_loss_coef
        return metrics

    def _select_cov_tokens(self, sub: TrainBatch, params, index: int, *, step: int) -> None:
        """clip_cov / kl_cov: the mini-batch's selected tokens, from the current policy's log-probs (one
        forward pass over the mini-batch), so every micro-batch applies the mini-batch's selection."""
        logp = np.zeros(sub.responses.shape, np.float32)
        for seq_ids, mb in self._micro_batches(sub, (), self.fwd_pack):
            used = seq_ids >= 0
            # The reference pass's program: log-probs alone (no entropy or Σπ²), here with the current params.
            logp[seq_ids[used]] = distributed.fetch(self.ref_logprob_fn(params, mb)["log_prob"])[used]
        mask = sub.fields.get("loss_mask", sub.response_mask)
        old = logp if self.on_policy else sub.fields["old_log_prob"]
        key = jax.random.fold_in(jax.random.key(self.run.data.seed), step * 100003 + index)
        sel = self.cov_select(old, logp, sub.fields["advantages"], mask, key=key)
        sub.fields["token_select"] = np.asarray(distributed.fetch(sel), np.float32)

    def _release_engine_weights(self) -> None:
        """With rollout.free_cache_engine, the JAX engine's weight copy is dropped for the updates (the sync that
        follows every actor update rebuilds it), like its KV pool after every rollout."""
        if self.engine is not None and self.run.rollout.free_cache_engine:
            self.engine.release_weights()

    def update_critic(self, batch: TrainBatch, step: int) -> dict[str, float]:
        self._release_engine_weights()
        self.critic_state, metrics = self._update(
            batch, state=self.critic_state, grad_fn=self.critic_grad, metrics0=self.critic_metrics0,
            zeros=self.critic_zeros, apply_fn=self.critic_apply, fields=["values", "returns"],
            epochs=self.run.critic.ppo_epochs or self.run.actor.ppo_epochs, lr=float(self.critic_lr_at(step)),
            prefix="critic")
        return metrics

    def sync_rollout_weights(self, step: int) -> None:
        """Moves the new actor weights into the JAX engine, in device memory."""
        if self.engine is not None:
            self.engine.update_weights(self.actor_state["params"], step=step)
            jax.block_until_ready(self.engine.params)

    def save_weights(self, directory: str, step: int) -> str:
        """Writes the actor params as a weights-only Orbax checkpoint (for a vLLM pool), in the compute
        dtype the pool runs in (bf16 by default: half the bytes of the fp32 master weights to write and to
        read back), cast on the devices in the params' own sharding."""
        from jaxrl_llm.weights_io import save_weights

        if self._cast_for_pool is None:
            dt = jnp.dtype(self.cfg.dtype)
            self._cast_for_pool = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dt), p),
                                          out_shardings=self.actor_sh)
        return save_weights(directory, step, self._cast_for_pool(self.actor_state["params"]), self.cfg)

    # ---- checkpoints ------------------------------------------------------------------------------
    def set_aside_checkpoints(self) -> list[str]:
        """A fresh start in a run dir that has checkpoints moves them aside (they are another run's)."""
        return self.ckpt.set_aside_after(0)

    def open_checkpointer(self, directory: str, max_to_keep: int | None) -> list[int]:
        """Opens the run's checkpoint dir for saving; returns the steps already there."""
        from jaxrl_llm.checkpoint import RunCheckpointer

        self.ckpt = RunCheckpointer(directory, max_to_keep=max_to_keep)
        return self.ckpt.steps()

    def close_checkpointer(self) -> None:
        """Waits for pending saves and stops the checkpoint manager's threads."""
        self.ckpt.close()

    def save_checkpoint(self, step: int, meta: dict) -> None:
        """Starts an async save of the train states (the device-to-host copy happens here)."""
        self.ckpt.save(step, actor=self.actor_state, critic=self.critic_state, meta=meta)

    def wait_checkpoint(self) -> None:
        self.ckpt.wait()

    def restore_checkpoint(self, directory: str, step: int | None = None) -> dict | None:
        """Restores train states into this worker's mesh layout; returns the checkpoint's meta (with
        its step), or None when `directory` has no checkpoint."""
        from jaxrl_llm.checkpoint import NoValidCheckpointError, RunCheckpointer

        own = self.ckpt
        ckpt = own if own.directory == os.path.abspath(directory) else \
            RunCheckpointer(directory, read_only=True) if os.path.isdir(directory) else None
        if ckpt is None:
            own.set_aside_after(0)
            return None
        if step is None:
            found = ckpt.restore_latest_valid(actor=self.actor_state, critic=self.critic_state)
            if found is None:
                own.set_aside_after(0)
                return None
            step, actor, critic, meta = found
        else:
            if step not in ckpt.steps():
                raise NoValidCheckpointError(f"{directory}: no checkpoint for step {step}; it has {ckpt.steps()}")
            actor, critic, meta = ckpt.restore(step, actor=self.actor_state, critic=self.critic_state)
        self.actor_state = actor
        if critic is not None:
            self.critic_state = critic
        own.set_aside_after(step)
        self.sync_rollout_weights(step)
        return {**meta, "step": step}

    # ---- small queries for the driver -------------------------------------------------------------
    def model_config(self) -> Qwen2Config:
        return self.cfg

    def needs_ref_flag(self) -> bool:
        return self.needs_ref

    def needs_old_log_prob(self) -> bool:
        return not self.on_policy and not self.bypass

    def num_devices(self) -> int:
        return self.mesh.devices.size

    def peak_tflops(self) -> float:
        from jaxrl_llm.trainer.metrics import peak_tflops

        return peak_tflops(self.run.trainer.peak_tflops)
