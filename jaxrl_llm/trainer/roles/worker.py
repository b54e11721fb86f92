"""`TrainerWorker`: the actor, reference and critic models on one device mesh (a `WorkerRole`, roles/protocols.py).

The driver (`trainer.loop`) calls these methods with host `TrainBatch`es, through a handle: the worker itself in
this process, or a proxy of it in a Ray actor (roles/handles.py); everything on devices stays inside the worker. The
rollout engine is a role of its own (roles/engines.py), built beside the worker where it shares its devices.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import compile_watch, distributed, sharding
from jaxrl_llm.algorithms import (
    LossNorm,
    get_adv_estimator,
    select_cov_tokens,
)
from jaxrl_llm.models import Qwen2Config
from jaxrl_llm.rollout.vllm_pool import check_model as check_vllm_model
from jaxrl_llm.trainer import router_replay, steps
from jaxrl_llm.trainer.batch import PackShape, TrainBatch, build_micro_batch, split_mini_batches
from jaxrl_llm.trainer.config import RunConfig
from jaxrl_llm.trainer.memory import check as memory_check
from jaxrl_llm.trainer.memory.warm_programs import CompileAhead
from jaxrl_llm.trainer.packing import padded_tokens, plan_packing, shape_ladder
from jaxrl_llm.trainer.processes.placement import split_devices
from jaxrl_llm.trainer.roles.algo_setup import (
    adv_inputs,
    exactly_on_policy,
    make_adv_fn,
    policy_loss_config,
    rollout_correction_config,
)
from jaxrl_llm.trainer.roles.model_load import (
    load_actor_params,
    load_adapters,
    load_critic_params,
    lora_spec,
    model_config,
)
from jaxrl_llm.trainer.roles.model_state import ModelState, abstract_params
from jaxrl_llm.trainer.roles.optim import make_optimizer
from jaxrl_llm.trainer.roles.worker_checkpoints import WorkerCheckpoints
from jaxrl_llm.trainer.roles.worker_weights import WorkerWeights

log = logging.getLogger(__name__)

HOST_ONLY = ("seq_ids", "seq_start")


class TrainerWorker(WorkerCheckpoints, WorkerWeights):
    """Owns the device state of a run. `total_steps` sizes the LR schedule."""

    def __init__(self, run: RunConfig, *, total_steps: int, model_cfg: Qwen2Config | None = None,
                 abstract: bool = False):
        """`abstract`: the states as shapes alone, nothing loaded: what the memory check compiles
        the step's programs against. Else that check runs first (`memory_check.plan`): it fails before any
        work when a program cannot fit the device, and resolves model.remat='auto' and the log-prob budget."""
        self.run = run
        t = run.trainer
        train_devices, self.rollout_devices = split_devices(run)  # the rollout's own devices in async modes
        self.mesh = sharding.make_mesh(t.mesh_data, t.mesh_fsdp, t.mesh_tensor, expert=t.mesh_expert,
                                       devices=train_devices)
        self.dp = sharding.data_parallel_size(self.mesh)
        self.cfg = model_cfg or model_config(run)
        self.lora = lora_spec(run, self.cfg)
        run.router_replay.check_model(self.cfg)
        if run.rollout.engine == "vllm":
            check_vllm_model(self.cfg)  # before any weights load: a family the pool cannot serve
        self.memory = None
        if not abstract:
            build = lambda r, c: TrainerWorker(r, total_steps=total_steps, model_cfg=c, abstract=True)
            self.memory = memory_check.plan(run, self.cfg, build, auto_remat=model_cfg is None)
            run = self.run = self.memory.run
            self.cfg = self.memory.cfg
        params = abstract_params(self.cfg, self.mesh) if abstract else load_actor_params(run, self.cfg, self.mesh,
                                                                                           self.lora)

        n_mini = run.data.train_batch_size // run.actor.ppo_mini_batch_size
        self.tx, self.lr_at = make_optimizer(
            run.actor.lr, total_steps=total_steps, updates_per_step=n_mini * run.actor.ppo_epochs,
            warmup_steps=run.actor.lr_warmup_steps, warmup_ratio=run.actor.lr_warmup_steps_ratio,
            scheduler=run.actor.lr_scheduler, min_lr_ratio=run.actor.min_lr_ratio,
            weight_decay=run.actor.weight_decay, betas=run.actor.betas, grad_clip=run.actor.grad_clip)
        self.actor = ModelState(self.cfg, self.mesh, params, self.tx, lora=self.lora, seed=run.model.seed,
                                adapters=None if abstract else load_adapters(run, self.cfg, self.lora, self.mesh),
                                base_quantization=run.model.base_quantization)
        self.actor_gd, self.actor_sh = self.actor.graphdef, self.actor.param_sh
        del params  # under LoRA the base now lives (in the compute dtype) in self.actor.frozen

        self.needs_ref = run.actor.use_kl_loss or run.algo.use_kl_in_reward
        self.ref_params = self.actor.reference(offload=run.trainer.ref_offload) if self.needs_ref else None

        self.critic = None
        if run.algo.uses_critic:
            c = run.critic
            self.critic_tx, self.critic_lr_at = make_optimizer(
                c.lr, total_steps=total_steps, updates_per_step=n_mini * (c.ppo_epochs or run.actor.ppo_epochs),
                warmup_steps=c.lr_warmup_steps, scheduler=c.lr_scheduler, weight_decay=c.weight_decay,
                grad_clip=c.grad_clip)
            params = abstract_params(self.cfg, self.mesh, critic=True) if abstract else load_critic_params(
                run, self.cfg, self.mesh, self.lora)
            self.critic = ModelState(self.cfg, self.mesh, params, self.critic_tx, lora=self.lora, critic=True,
                                     seed=run.model.seed + 1,
                                     base_quantization=run.model.base_quantization)
            self.critic_gd, self.critic_sh = self.critic.graphdef, self.critic.param_sh

        self._build_steps()
        self._tenants: list = []  # roles sharing these devices (a colocated engine): `share_devices`
        self._warm = None
        ahead = run.trainer.compile_ahead
        if not abstract and (jax.devices()[0].platform != "cpu" if ahead is None else ahead):
            self._warm = CompileAhead(self)  # on threads, while the engine is built beside the worker (roles/host.py)

    @property
    def compiles_ahead(self) -> bool:
        """Whether the step's programs are compiling on threads now (`train.compile_ahead`), until
        `finish_compile_ahead`."""
        return self._warm is not None

    def finish_compile_ahead(self) -> None:
        """Waits for the programs `train.compile_ahead` compiles on threads while the worker's process builds the
        rest of its roles."""
        if self._warm is not None:
            count, seconds = self._warm.wait()
            self._warm = None
            log.info("compiled the update and log-prob passes at every shape of their ladders ahead: %d programs "
                     "in %.1f s", count, seconds)

    # The train states ({"params", "opt_state", "step", "skipped"}: what checkpoints hold), by role.
    @property
    def actor_state(self) -> dict:
        return self.actor.state

    @actor_state.setter
    def actor_state(self, state: dict) -> None:
        self.actor.state = state

    @property
    def critic_state(self) -> dict | None:
        return None if self.critic is None else self.critic.state

    @critic_state.setter
    def critic_state(self, state: dict) -> None:
        self.critic.state = state

    # ---- construction ----------------------------------------------------------------------------
    def old_ref_params(self, actor=None, ref=None) -> tuple:
        """The fused old and reference pass's params arguments: (actor, reference), or under LoRA the actor's alone
        (its frozen base is the reference: `steps.make_old_and_ref_fn`'s `ref_in_actor`). `actor` and `ref` stand
        for the live params (the memory check passes their shapes)."""
        actor = self.actor.params() if actor is None else actor
        if self.lora is not None:
            return (actor,)
        return actor, self._ref_on_device() if ref is None else ref

    def _ref_on_device(self):
        if not self.run.trainer.ref_offload or self.lora is not None:  # LoRA: the base itself, no copy
            return self.ref_params
        return jax.tree.map(distributed.from_host_shards, self.ref_params)

    def _build_steps(self):
        run = self.run
        temp = run.rollout.temperature
        chunk = run.actor.logprob_chunk_size
        self.pack = self.pack_shape(run.actor.ppo_max_token_len_per_gpu)
        # Forward-only passes keep no activations for a backward pass: larger micro-batches, fewer of them.
        self.fwd_pack = self.pack_shape(run.rollout.log_prob_max_token_len_per_gpu
                                         or 2 * run.actor.ppo_max_token_len_per_gpu)
        # Every micro-batch shape a pass can meet (trainer/packing.py), and the tokens its packing filled.
        self.pack_ladder = shape_ladder(self.pack, self.dp, run.actor.tail_shapes)
        self.fwd_ladder = shape_ladder(self.fwd_pack, self.dp, run.actor.tail_shapes)
        self._fill: dict[str, list[int]] = {}
        self.estimator = get_adv_estimator(run.algo.adv_estimator)
        self.rc = rollout_correction_config(run)
        # Async training on stale samples: the sampler's log-probs are the behaviour policy's; without the
        # decoupled objective (async_training.compute_prox_log_prob) they are the old ones too (veRL's bypass).
        stale = run.async_training.off_policy
        self.bypass = (self.rc is not None and self.rc.bypass_mode) or (stale and not run.async_training.prox)
        # The optimal-token-baseline estimators need Σ_v π(v)² of the old policy from its log-prob pass.
        self.with_sum_pi_squared = "sum_pi_squared" in self.estimator.inputs
        # Routing replay R2: the old-log-prob pass records the routing the update passes replay.
        self.record_routing = run.router_replay.mode == "R2"
        self.logprob_fn = steps.make_logprob_fn(self.actor_gd, temperature=temp, chunk_size=chunk, with_entropy=True,
                                                with_sum_pi_squared=self.with_sum_pi_squared,
                                                with_routing=self.record_routing)
        # Log-probs alone: the reference's program (the base model under LoRA) and the current policy's.
        self.ref_logprob_fn = steps.make_logprob_fn(self.actor.base_graphdef, temperature=temp, chunk_size=chunk)
        self.plain_logprob_fn = (self.ref_logprob_fn if self.lora is None else
                                 steps.make_logprob_fn(self.actor_gd, temperature=temp, chunk_size=chunk))
        # Both passes in one program a micro-batch where both run (rollout.fuse_log_prob_passes, kept by the
        # memory check where it fits).
        self.old_ref_fn = steps.make_old_and_ref_fn(self.actor_gd, self.actor.base_graphdef, temperature=temp,
                                                    chunk_size=chunk, with_sum_pi_squared=self.with_sum_pi_squared,
                                                    with_routing=self.record_routing,
                                                    ref_in_actor=self.lora is not None)
        # Exactly on-policy (veRL's shortcut): the old-log-prob pass is skipped. Bypass mode uses the sampler's
        # log-probs as the old ones and never runs the pass either.
        why = exactly_on_policy(run, self.estimator, self.rc)
        self.on_policy = why is not None
        if why is not None and self.memory is not None:  # the real worker, not the memory check's
            log.info("old-log-prob pass skipped every step: %s", why)
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
        self.actor_apply = steps.make_apply_step(self.tx, self.actor.state_sh)
        self.actor_zeros = steps.make_zeros(self.actor_sh)
        self.adv_fn = make_adv_fn(run, self.estimator, self.rc)
        if self.critic_state is not None:
            kw = dict(cliprange_value=run.critic.cliprange_value, loss_agg_mode=run.critic.loss_agg_mode)
            self.value_fn = steps.make_value_fn(self.critic_gd)
            self.critic_grad = steps.make_grad_step(steps.critic_loss, self.critic_gd, self.critic_sh, **kw)
            self.critic_metrics0 = steps.make_metrics_init(steps.critic_loss, self.critic_gd, **kw)
            self.critic_apply = steps.make_apply_step(self.critic_tx, self.critic.state_sh)
            self.critic_zeros = steps.make_zeros(self.critic_sh)

    def pack_shape(self, tokens_per_device: int) -> PackShape:
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

    def _micro_batches(self, batch: TrainBatch, fields, ladder: tuple[PackShape, ...], name: str):
        """`batch` packed into micro-batches of `ladder`'s shapes, placed on the mesh: (host-only fields,
        device arrays) each. `name`: the pass its fill counts to (`pack_metrics`)."""
        lengths = batch.prompt_lengths + batch.response_lengths
        plans = plan_packing(lengths, ladder, self.dp)
        fill = self._fill.setdefault(name, [0, 0])
        fill[0] += int(lengths.sum())
        fill[1] += padded_tokens(plans)
        for shape, placements in plans:
            mb = build_micro_batch(batch, placements, shape, fields=fields, pad_id=self.cfg.pad_token_id or 0)
            yield {k: mb[k] for k in HOST_ONLY}, self._put(mb)

    def pack_metrics(self) -> dict[str, float]:
        """`perf/pack_fill`: the real tokens over the padded tokens of every micro-batch packed since the last
        call, and `perf/pack_fill/<pass>` for the update and the log-prob passes apart."""
        fill, self._fill = self._fill, {}
        out = {f"perf/pack_fill/{k}": real / padded for k, (real, padded) in fill.items() if padded}
        padded = sum(p for _, p in fill.values())
        if padded:
            out["perf/pack_fill"] = sum(r for r, _ in fill.values()) / padded
        return out

    # ---- forward passes: old and reference log-probs, values ------------------------------------
    def start_forward_passes(self, batch: TrainBatch, *, old: bool = False, ref: bool = False,
                             values: bool = False) -> None:
        """Packs `batch` once and dispatches every micro-batch of the asked passes: the actor's log-probs
        and entropy (`old`), the reference log-probs (`ref`), the critic's values (`values`).

        Nothing is fetched: the device computes while the caller does host work (the driver scores
        rewards here), and `finish_forward_passes` collects the results.
        """
        passes = []  # (program, its params, {its output: the batch field})
        old_names = {"log_prob": "old_log_prob", "entropy": "entropy"}
        if self.with_sum_pi_squared:
            old_names["sum_pi_squared"] = "sum_pi_squared"
        if self.record_routing:
            old_names["routing"] = router_replay.FIELD
        if old and ref and self.run.rollout.fuse_log_prob_passes:
            passes.append((self.old_ref_fn, self.old_ref_params(), {**old_names, "ref_log_prob": "ref_log_prob"}))
        else:
            if old:
                passes.append((self.logprob_fn, (self.actor.params(),), old_names))
            if ref:
                passes.append((self.ref_logprob_fn, (self._ref_on_device(),), {"log_prob": "ref_log_prob"}))
        if values:
            passes.append((self.value_fn, (self.critic.params(),), {"values": "values"}))
        pending = []
        with jax.set_mesh(self.mesh):
            # Dispatch every micro-batch before fetching any result, so the host packs the next
            # micro-batch while the device computes.
            for host, mb in self._micro_batches(batch, (), self.fwd_ladder, "log_prob"):
                pending.append((host, [(names, fn(*params, mb)) for fn, params, names in passes]))
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
        seq_lengths = batch.prompt_lengths + batch.response_lengths
        for host, results in pending:
            seq_ids = host["seq_ids"]
            used = seq_ids >= 0
            for names, res in results:
                res = distributed.fetch_tree(res)
                for k, name in names.items():
                    if name == router_replay.FIELD:  # R2's recorded routing: packed -> sequence layout
                        router_replay.unpack(res[k], host, seq_lengths, out)
                        continue
                    if name not in out:
                        out[name] = np.zeros(batch.responses.shape, np.float32)
                    out[name][seq_ids[used]] = res[k][used]
        for k in out:
            if k != router_replay.FIELD:
                out[k] *= batch.response_mask
        return out

    def _forward(self, batch: TrainBatch, **passes) -> dict[str, np.ndarray]:
        self.start_forward_passes(batch, **passes)
        return self.finish_forward_passes()

    # ---- the RL step -----------------------------------------------------------------------------
    def compile_stats(self) -> dict:
        """This process's XLA compiles so far (jaxrl_llm.compile_watch)."""
        return compile_watch.totals()

    def compute_log_prob(self, batch: TrainBatch) -> dict[str, np.ndarray]:
        """Old log-probs and entropy of the current actor ([R, Tr] each)."""
        return self._forward(batch, old=True)

    def compute_ref_log_prob(self, batch: TrainBatch) -> np.ndarray:
        return self._forward(batch, ref=True)["ref_log_prob"]

    def compute_values(self, batch: TrainBatch) -> np.ndarray:
        return self._forward(batch, values=True)["values"]

    def compute_advantages(self, batch: TrainBatch, kl_coef: float = 0.0) -> dict:
        """Token-level rewards, advantages and returns [R, Tr] (veRL semantics), on device; with rollout
        correction on (decoupled mode), also the importance weights and the loss mask of the update."""
        if self.bypass:  # veRL's bypass mode: the sampler's log-probs are the old ones
            batch.fields["old_log_prob"] = batch.fields["rollout_log_probs"]
        fields, metrics = self.adv_fn(batch.fields["token_level_scores"], batch.response_mask,
                                      adv_inputs(self.run, self.estimator, self.rc, batch), np.float32(kl_coef))
        fields, metrics = distributed.fetch_tree((fields, metrics))
        fields = {k: np.asarray(v) for k, v in fields.items()}
        if self.bypass:
            fields["old_log_prob"] = batch.fields["old_log_prob"]
        return {"fields": fields, "metrics": {k: float(v) for k, v in metrics.items()}}

    def _update(self, batch: TrainBatch, *, role: ModelState, grad_fn, metrics0, zeros, apply_fn, fields, epochs,
                lr, prefix, prepare=None):
        """Epochs x mini-batches of optimizer steps, each the sum of its micro-batches' gradients.

        `prepare(sub, params, index)`, when given, adds fields that depend on the whole mini-batch and the
        current params to `sub` before it is split (the clip_cov / kl_cov token selection).
        """
        run = self.run
        mini = run.actor.ppo_mini_batch_size * run.rollout.n
        history = []
        state = role.state
        with jax.set_mesh(self.mesh):
            for epoch in range(epochs):
                for i, idx in enumerate(split_mini_batches(len(batch), mini)):
                    sub = batch.select(idx)
                    if prepare is not None:
                        prepare(sub, role.params(state["params"]), epoch * len(batch) + i)
                    mask = sub.fields.get("loss_mask", sub.response_mask)
                    norm = LossNorm(num_tokens=jnp.float32(max(mask.sum(), 1.0)),
                                    num_seqs=jnp.float32(max((mask.sum(-1) > 0).sum(), 1)),
                                    max_len=jnp.float32(run.actor.loss_scale_factor or run.data.max_response_length))
                    grads = metrics = None
                    for _, mb in self._micro_batches(sub, fields, self.pack_ladder, "update"):
                        if grads is None:
                            grads = zeros(state["params"])
                            metrics = metrics0(role.params(state["params"]), mb, norm)
                        grads, metrics = grad_fn(state["params"], role.frozen, grads, metrics, mb, norm)
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
        self._free_for_update()
        fields = self.actor_update_fields(batch.fields)
        prepare = None
        if self.cov_select is not None:
            prepare = functools.partial(self._select_cov_tokens, step=step)
        self.actor_state, metrics = self._update(
            batch, role=self.actor, grad_fn=self.actor_grad, metrics0=self.actor_metrics0,
            zeros=self.actor_zeros, apply_fn=self.actor_apply, fields=fields, epochs=self.run.actor.ppo_epochs,
            lr=float(self.lr_at(step)), prefix="actor", prepare=prepare)
        if self.run.actor.use_kl_loss:
            metrics["actor/kl_coef"] = self.run.actor.kl_loss_coef
        return metrics

    def actor_update_fields(self, present) -> list[str]:
        """The batch fields an actor micro-batch carries, of those `present` in the batch."""
        fields = ["advantages"] if self.on_policy else ["old_log_prob", "advantages"]
        if self.run.actor.use_kl_loss:
            fields.append("ref_log_prob")
        fields += [k for k in ("rollout_log_probs", "loss_mask", "rollout_is_weights") if k in present]
        return fields + (["token_select"] if self.cov_select is not None else [])

    def _select_cov_tokens(self, sub: TrainBatch, params, index: int, *, step: int) -> None:
        """clip_cov / kl_cov: the mini-batch's selected tokens, from the current policy's log-probs (one
        forward pass over the mini-batch), so every micro-batch applies the mini-batch's selection."""
        logp = np.zeros(sub.responses.shape, np.float32)
        for host, mb in self._micro_batches(sub, (), self.fwd_ladder, "log_prob"):
            seq_ids = host["seq_ids"]
            used = seq_ids >= 0
            # Log-probs alone (no entropy or Σπ²), with the current params.
            logp[seq_ids[used]] = distributed.fetch(self.plain_logprob_fn(params, mb)["log_prob"])[used]
        mask = sub.fields.get("loss_mask", sub.response_mask)
        old = logp if self.on_policy else sub.fields["old_log_prob"]
        key = jax.random.fold_in(jax.random.key(self.run.data.seed), step * 100003 + index)
        sel = self.cov_select(old, logp, sub.fields["advantages"], mask, key=key)
        sub.fields["token_select"] = np.asarray(distributed.fetch(sel), np.float32)

    def update_critic(self, batch: TrainBatch, step: int) -> dict[str, float]:
        self._free_for_update()
        self.critic_state, metrics = self._update(
            batch, role=self.critic, grad_fn=self.critic_grad, metrics0=self.critic_metrics0,
            zeros=self.critic_zeros, apply_fn=self.critic_apply, fields=["values", "returns"],
            epochs=self.run.critic.ppo_epochs or self.run.actor.ppo_epochs, lr=float(self.critic_lr_at(step)),
            prefix="critic")
        return metrics

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

    def describe(self) -> dict:
        """What the worker settled at its start: the mesh's axes, the remat policy, the fused passes, on-policy."""
        return {"mesh": dict(self.mesh.shape), "remat": self.cfg.remat, "on_policy": self.on_policy,
                "fused": self.run.rollout.fuse_log_prob_passes}

    def memory_rows(self) -> list[dict]:
        """The memory check's programs, one row each (XLA's account, per device); empty where nothing was checked."""
        return self.memory.rows() if self.memory is not None and self.memory.limit else []
