"""Run configuration as gin-configurable dataclasses, with veRL's field names where they exist.

Each dataclass is bound in gin under a short veRL-like name: `model.*`, `data.*`, `rollout.*`,
`actor.*`, `critic.*`, `algorithm.*`, `reward.*` and `train.*` (the trainer: epochs, saving,
logging, mesh). `build_run_config()` builds one `RunConfig` from the bindings and validates it before
any model is loaded, so a bad value fails in the first second.
"""

from __future__ import annotations

import dataclasses
import os

import gin

from jaxrl_llm.agent.config import MultiTurnConfig
from jaxrl_llm.algorithms.rollout_correction import RolloutCorrectionConfig
from jaxrl_llm.trainer.config_check import ConfigValueError, check_types
from jaxrl_llm.trainer.config_check import check as _check
from jaxrl_llm.trainer.router_replay import RouterReplaySettings


@gin.configurable("model")
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Where the policy comes from: a local HF dir / hub id (`path`), or a random preset (`preset`)."""

    path: str | None = None
    preset: str | None = None
    tokenizer_path: str | None = None
    dtype: str = "bfloat16"  # compute
    param_dtype: str = "float32"  # master weights
    remat: str = "auto"  # "auto": "dots" when the device has the memory for it, else "full"
    attention_impl: str = "auto"
    critic_path: str | None = None  # defaults to `path` (veRL initialises the critic from the actor)
    overrides: dict | None = None  # Qwen2Config fields to change (e.g. a smaller vocab for a preset)
    seed: int = 0
    # LoRA (veRL's names; rank 0: full fine-tuning) on target_modules ('all-linear' or names) less exclude_modules.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    target_modules: str | tuple[str, ...] = "all-linear"
    exclude_modules: tuple[str, ...] = ()
    lora_adapter_path: str | None = None  # a PEFT adapter directory to start from
    # LoRA's frozen base in 8 bits (our name; veRL has no QLoRA): 'none', 'int8' or 'fp8' (`models/quant.py`).
    base_quantization: str = "none"

    def validate(self):
        from jaxrl_llm.models.config import PRESETS

        _check((self.path is None) != (self.preset is None), "model.path / model.preset",
               "set exactly one: a HF model dir (or hub id) in `path`, or a random-init `preset`")
        _check(self.preset is None or self.preset in PRESETS, "model.preset",
               f"unknown preset {self.preset!r}; known: {sorted(PRESETS)}")
        _check(self.remat in ("auto", "none", "full", "dots"), "model.remat",
               f"{self.remat!r}; use 'auto', 'none', 'full' or 'dots'")
        self._validate_lora()

    def _validate_lora(self):
        from jaxrl_llm.models.errors import ConfigError
        from jaxrl_llm.models.lora import check_settings
        from jaxrl_llm.models.quant import check_setting as check_quantization

        try:
            check_settings(self.lora_rank, self.lora_alpha, self.target_modules, self.exclude_modules,
                           self.lora_adapter_path)
            check_quantization(self.base_quantization, self.lora_rank)
        except ConfigError as e:
            raise ConfigValueError(str(e)) from None


@gin.configurable("data")
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """veRL's `data.*`. `source`: "files" (parquet/jsonl in veRL schema), or a demo: "arithmetic", "multiply"."""

    source: str = "files"
    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()
    train_batch_size: int = 1024  # prompts per step
    val_batch_size: int | None = None
    max_prompt_length: int = 512
    max_response_length: int = 1024
    prompt_key: str = "prompt"
    shuffle: bool = True
    seed: int = 1
    val_max_samples: int | None = None
    arithmetic_max_operand: int = 9  # demo task only

    def validate(self):
        _check(self.source in ("files", "arithmetic", "multiply"), "data.source", f"{self.source!r}; use 'files'")
        if self.source == "files":
            _check(bool(self.train_files), "data.train_files", "no training files given")
        _check(self.train_batch_size >= 1, "data.train_batch_size", "must be >= 1")
        _check(self.max_prompt_length >= 1 and self.max_response_length >= 1,
               "data.max_prompt_length / max_response_length", "must be >= 1")


@gin.configurable("rollout")
@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """veRL's `actor_rollout_ref.rollout.*`."""

    engine: str = "jax"  # "jax" (in-process sampler) or "vllm" (a pool of Ray actors)
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # The JAX engine's KV memory: "paged" (a page pool under a budget, continuous batching; the default)
    # or "dense" (per-row caches; the baseline it is measured against)
    kv_cache: str = "paged"
    # Paged: the share of device memory total use may reach while generating (trainer state and engine
    # weights included); kv_cache_memory_bytes (bytes a device) overrides it
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    free_cache_engine: bool = True  # release the KV pool after each rollout (the update gets the memory)
    max_num_seqs: int = 1024  # paged: rows decoded together at most
    max_num_batched_tokens: int = 8192  # paged: prompt tokens one prefill call processes at most
    page_size: int = 16  # paged: tokens a KV page holds
    max_batch_size: int = 1024  # dense: response rows decoded together
    # JAX engine's decode attention: "xla" (every cache slot), "pallas" (a kernel that reads only each
    # row's valid slots; kernels/decode_attention.py), "auto" (the kernel on GPUs, XLA elsewhere)
    decode_attention: str = "auto"
    val_temperature: float = 0.0  # validation is greedy (mean@1) unless val_n > 1
    val_n: int = 1  # responses a validation prompt (veRL's val_kwargs.n): mean@N, best@N, pass@k
    val_top_p: float = 1.0
    val_top_k: int = -1
    vllm_workers: int = 1
    # Where the trainer writes the vLLM pool's weights each step: '' is <run_dir>/weights; a directory
    # such as /dev/shm (a RAM disk, one host) gets a subdirectory of this run, removed at the end.
    weights_dir: str = ""
    # A LoRA run on the vLLM pool: False syncs the base once, then the adapters as vLLM LoRA requests; True: the merged
    lora_merge: bool = False  # weights every step (a full sync, the fallback). The JAX engine merges at every sync.
    # Token budget of one micro-batch a device in the old/reference log-prob (and value) passes; None:
    # twice actor.ppo_max_token_len_per_gpu (a forward pass keeps no activations for a backward one).
    log_prob_max_token_len_per_gpu: int | None = None
    multi_turn: MultiTurnConfig = dataclasses.field(default_factory=MultiTurnConfig)  # rollout.multi_turn.*

    def validate(self):
        _check(self.engine in ("jax", "vllm"), "rollout.engine", f"{self.engine!r}; use 'jax' or 'vllm'")
        self.multi_turn.validate()
        _check(not self.weights_dir or os.path.isdir(self.weights_dir), "rollout.weights_dir",
               f"{self.weights_dir!r} is not a directory; give an existing one ('/dev/shm' on one host, a shared "
               "file system across hosts) or '' for <run_dir>/weights")
        _check(self.kv_cache in ("paged", "dense"), "rollout.kv_cache", f"{self.kv_cache!r}; use 'paged' or 'dense'")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "rollout.gpu_memory_utilization",
               f"{self.gpu_memory_utilization} is not a fraction in (0, 1]")
        _check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "rollout.kv_cache_memory_bytes",
               f"{self.kv_cache_memory_bytes}; give a positive byte count or None")
        _check(self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0, "rollout.page_size",
               f"{self.page_size} is not a power of two")
        _check(self.max_num_seqs >= 1 and self.max_num_batched_tokens >= 16,
               "rollout.max_num_seqs / max_num_batched_tokens",
               "need max_num_seqs >= 1 and max_num_batched_tokens >= 16")
        _check(self.decode_attention in ("auto", "xla", "pallas"), "rollout.decode_attention",
               f"{self.decode_attention!r}; use 'auto', 'xla' or 'pallas'")
        _check(isinstance(self.n, int) and self.n >= 1, "rollout.n", f"n={self.n}; need n >= 1")
        _check(0.0 < self.top_p <= 1.0, "rollout.top_p", f"{self.top_p} is not in (0, 1]")
        _check(self.temperature > 0.0, "rollout.temperature", "training rollouts need temperature > 0")
        _check(isinstance(self.val_n, int) and self.val_n >= 1, "rollout.val_n", f"val_n={self.val_n}; need >= 1")
        _check(self.val_n == 1 or self.val_temperature > 0.0, "rollout.val_temperature",
               f"rollout.val_n={self.val_n} samples the same greedy response {self.val_n} times; set "
               "rollout.val_temperature > 0 (e.g. 1.0) or val_n = 1")


@gin.configurable("actor")
@dataclasses.dataclass(frozen=True)
class ActorConfig:
    """veRL's `actor_rollout_ref.actor.*` plus the optimizer (`optim.*`)."""

    lr: float = 1e-6
    lr_warmup_steps: int = 0
    lr_warmup_steps_ratio: float = 0.0
    lr_scheduler: str = "constant"  # or "cosine"
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 256  # prompts per optimizer step (x n responses)
    ppo_max_token_len_per_gpu: int = 16384  # token budget of one micro-batch per device
    pack_length: int | None = None  # packed row length (default: max prompt + max response, rounded)
    # Shapes the last micro-batch of a mini-batch may take (1: always the full one; k: the full one and
    # 1/2 ... 1/2^(k-1) of its rows), so a mostly empty tail does not cost a full micro-batch.
    tail_shapes: int = 3
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    logprob_chunk_size: int = 8192  # vocab chunk of the fused logprob/entropy
    # SAPO's gate temperatures for positive / negative advantages (veRL's actor.tau_pos / tau_neg).
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    # The constant of "seq-mean-token-sum-norm" (veRL's actor.loss_scale_factor); None: the max response length.
    loss_scale_factor: int | None = None

    def validate(self):
        _check(self.lr >= 0, "actor.lr", "must be >= 0")
        _check(self.lr_scheduler in ("constant", "cosine"), "actor.lr_scheduler",
               f"{self.lr_scheduler!r}; use 'constant' or 'cosine'")
        _check(self.ppo_mini_batch_size >= 1 and self.ppo_epochs >= 1,
               "actor.ppo_mini_batch_size / ppo_epochs", "must be >= 1")
        _check(self.clip_ratio_c > 1.0, "actor.clip_ratio_c", "dual-clip bound must be > 1")
        _check(self.tail_shapes >= 1, "actor.tail_shapes", f"{self.tail_shapes}; need >= 1")
        from jaxrl_llm.algorithms import LOSS_AGG_MODES

        _check(self.loss_agg_mode in LOSS_AGG_MODES, "actor.loss_agg_mode",
               f"{self.loss_agg_mode!r} is not a veRL mode; use one of {LOSS_AGG_MODES}")
        _check(self.loss_scale_factor is None or self.loss_scale_factor >= 1, "actor.loss_scale_factor",
               f"{self.loss_scale_factor}; need >= 1 (or None: the max response length)")

    @property
    def low(self) -> float:  # the PPO clip range below and above 1
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    high = property(lambda self: self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high)


@gin.configurable("policy_loss", module="actor")
@dataclasses.dataclass(frozen=True)
class PolicyLossSettings:
    """veRL's `actor.policy_loss.*`: which policy loss the actor minimises, and its own knobs.

    The PPO clip range, dual-clip bound and aggregation stay on `actor.*` (`clip_ratio*`,
    `loss_agg_mode`), as in veRL; the losses that reuse them (dppo_*: divergence thresholds and the TIS
    cap) say so in `jaxrl_llm.algorithms.policy_loss`.
    """

    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002  # clip_cov: share of tokens whose gradient is dropped
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: share of tokens that get the |log-ratio| penalty
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None  # dro: the quadratic log-ratio penalty (required for 'dro')

    def validate(self):
        from jaxrl_llm.algorithms import POLICY_LOSS_REGISTRY

        _check(self.loss_mode in POLICY_LOSS_REGISTRY, "actor.policy_loss.loss_mode",
               f"{self.loss_mode!r}; known: {sorted(POLICY_LOSS_REGISTRY)}")
        _check(self.clip_cov_ratio > 0 and self.kl_cov_ratio > 0, "actor.policy_loss.clip_cov_ratio / kl_cov_ratio",
               "must be > 0")
        _check(self.clip_cov_lb < self.clip_cov_ub, "actor.policy_loss.clip_cov_lb / clip_cov_ub",
               f"need lb < ub, got {self.clip_cov_lb} and {self.clip_cov_ub}")
        if self.loss_mode == "dro":
            _check(self.dro_beta is not None and self.dro_beta > 0, "actor.policy_loss.dro_beta",
                   f"{self.dro_beta}; loss_mode 'dro' needs a positive dro_beta")


@gin.configurable("critic")
@dataclasses.dataclass(frozen=True)
class CriticConfig:
    """veRL's `critic.*` (PPO only)."""

    lr: float = 1e-5
    lr_warmup_steps: int = 0
    lr_scheduler: str = "constant"
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    ppo_epochs: int | None = None  # defaults to the actor's
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"


@gin.configurable("algorithm")
@dataclasses.dataclass(frozen=True)
class AlgoConfig:
    """veRL's `algorithm.*`."""

    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl_type: str = "fixed"
    kl_coef: float = 0.001
    kl_target: float = 0.1
    kl_horizon: int = 10000
    # GDPO: the reward-function dict keys normalised one by one, and their weights (None: equal).
    gdpo_reward_keys: tuple[str, ...] | None = None
    gdpo_reward_weights: tuple[float, ...] | None = None

    @property
    def uses_critic(self) -> bool:
        return self.adv_estimator == "gae"

    def validate(self):
        from jaxrl_llm.algorithms import ADV_ESTIMATOR_REGISTRY

        known = sorted(ADV_ESTIMATOR_REGISTRY)
        _check(self.adv_estimator in known, "algorithm.adv_estimator", f"{self.adv_estimator!r}; known: {known}")
        _check(self.kl_ctrl_type in ("fixed", "adaptive"), "algorithm.kl_ctrl_type", "use 'fixed' or 'adaptive'")
        if self.adv_estimator == "gdpo":
            _check(bool(self.gdpo_reward_keys), "algorithm.gdpo_reward_keys", "gdpo needs the reward keys to "
                   "normalise one by one (the keys of the dict your reward function returns)")
        if self.gdpo_reward_weights is not None:
            _check(self.gdpo_reward_keys is not None and len(self.gdpo_reward_weights) == len(self.gdpo_reward_keys),
                   "algorithm.gdpo_reward_weights", "give one weight per entry of algorithm.gdpo_reward_keys")


# veRL's `algorithm.rollout_correction.*` (the trainer–sampler gap: TIS / MIS weights, bypass mode): the
# algorithms' own config, bound in gin under veRL's name. Off by default, as in veRL's YAML.
RolloutCorrectionSettings = gin.external_configurable(RolloutCorrectionConfig, "rollout_correction",
                                                      module="algorithm")


def rollout_correction_enabled(rc: RolloutCorrectionConfig) -> bool:
    return rc.bypass_mode or rc.rollout_is is not None or rc.rollout_rs is not None


@gin.configurable("filter_groups", module="algorithm")
@dataclasses.dataclass(frozen=True)
class FilterGroupsSettings:
    """veRL's `algorithm.filter_groups.*` (DAPO dynamic sampling): drop the groups whose `metric` is the
    same for every response, and draw more prompts until the batch is full.

    metric: "reward" (the score, before any KL penalty) or a key of the dicts the reward function
      returns ("acc", ...).
    max_num_gen_batches: prompt batches drawn at most per step (<= 0: no limit).
    """

    enable: bool = False
    metric: str = "reward"
    max_num_gen_batches: int = 0


@gin.configurable("overlong_buffer_cfg", module="reward.reward_kwargs")
@dataclasses.dataclass(frozen=True)
class OverlongBufferSettings:
    """veRL's `reward.reward_kwargs.overlong_buffer_cfg.*` (DAPO): a response longer than
    max_response_length - len loses up to `penalty_factor` of reward, linearly over the last `len` tokens."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = False

    def validate(self, max_response_length: int):
        if self.enable:
            _check(0 < self.len <= max_response_length, "reward.reward_kwargs.overlong_buffer_cfg.len",
                   f"{self.len}; need 0 < len <= data.max_response_length ({max_response_length})")


@gin.configurable("reward")
@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Reward scoring: veRL's `reward_model.*` / `custom_reward_function.*` for rule-based rewards."""

    custom_reward_path: str | None = None
    custom_reward_name: str = "compute_score"
    num_workers: int = 0  # >0: score each step's responses in this many parallel workers
    backend: str = "auto"  # the workers: "ray", "process" (no Ray needed), "auto" (Ray when installed)
    strict: bool = False  # a raising reward function stops the run

    def validate(self):
        _check(self.num_workers >= 0, "reward.num_workers", f"{self.num_workers}; use 0 (in-process) or more")
        _check(self.backend in ("auto", "ray", "process"), "reward.backend",
               f"{self.backend!r}; use 'auto', 'ray' or 'process'")


@gin.configurable("train")
@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """veRL's `trainer.*`."""

    project_name: str = "jaxrl_llm"
    experiment_name: str = "run"
    run_dir: str = "runs/run"
    total_epochs: int = 1
    total_training_steps: int | None = None
    save_freq: int = -1  # -1: only at the end
    max_checkpoints_to_keep: int = 2
    test_freq: int = -1
    val_before_train: bool = False
    resume_mode: str = "auto"  # "auto", "disable", or a checkpoint path
    logger: tuple[str, ...] = ("console", "jsonl", "tensorboard")
    driver: str = "ray"  # "ray" or "inprocess"
    ray_address: str | None = None
    # Processes of the run. The Ray driver starts this many trainer processes (one Ray placement-group
    # bundle each) joined by jax.distributed; plain launches set the count with --num_processes.
    num_processes: int = 1
    devices_per_process: int | None = None  # GPUs (or simulated CPU devices) of each process; None: 1 GPU
    heartbeat_timeout_s: int = 60  # a dead process stops the others after this long
    # JAX's persistent compilation cache: a repeated or resumed run loads its programs instead of
    # compiling them. "" turns it off.
    compilation_cache_dir: str = "~/.cache/jaxrl_llm/xla"
    mesh_data: int = 1
    mesh_fsdp: int = -1
    mesh_tensor: int = 1
    mesh_expert: int = 1  # splits a MoE's experts (its devices are data-parallel elsewhere)
    ref_offload: bool = False
    # The bytes a device may hold, for the memory check before the first step (trainer/memory_check.py).
    # None: what XLA may use on the device (a CPU says nothing: no check there); set it to check on a CPU.
    device_memory_limit_bytes: int | None = None
    dump_batches: bool = False
    replay_batches_from: str | None = None
    peak_tflops: float | None = None  # per device, for perf/mfu (default: a table by device kind)
    progress_bar: bool = True

    def validate(self):
        _check(self.driver in ("ray", "inprocess"), "train.driver", f"{self.driver!r}; use 'ray' or 'inprocess'")
        _check(self.num_processes >= 1, "train.num_processes", f"{self.num_processes}; need >= 1")
        _check(self.devices_per_process is None or self.devices_per_process >= 1, "train.devices_per_process",
               f"{self.devices_per_process}; need >= 1 (or None)")
        _check(self.heartbeat_timeout_s >= 5, "train.heartbeat_timeout_s", f"{self.heartbeat_timeout_s}; need >= 5")
        _check(self.total_epochs >= 1, "train.total_epochs", "must be >= 1")
        _check(self.device_memory_limit_bytes is None or self.device_memory_limit_bytes > 0,
               "train.device_memory_limit_bytes", f"{self.device_memory_limit_bytes}; need > 0 (or None: the device's)")
        sinks = ("console", "jsonl", "tensorboard", "wandb")
        unknown = [s for s in self.logger if s not in sinks]
        _check(not unknown, "train.logger", f"unknown sink(s) {unknown}; use {sinks}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig
    actor: ActorConfig
    critic: CriticConfig
    algo: AlgoConfig
    reward: RewardConfig
    trainer: TrainerConfig
    policy_loss: PolicyLossSettings = PolicyLossSettings()
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    filter_groups: FilterGroupsSettings = FilterGroupsSettings()
    overlong_buffer: OverlongBufferSettings = OverlongBufferSettings()
    router_replay: RouterReplaySettings = RouterReplaySettings()

    def validate(self) -> RunConfig:
        for part in (self.model, self.data, self.rollout, self.actor, self.algo, self.reward, self.trainer,
                     self.policy_loss, self.rollout_correction):
            part.validate()
        self.overlong_buffer.validate(self.data.max_response_length)
        self.router_replay.validate(self.rollout.engine, self.rollout.multi_turn.enable)
        _check(self.actor.ppo_mini_batch_size <= self.data.train_batch_size, "actor.ppo_mini_batch_size",
               f"{self.actor.ppo_mini_batch_size} is larger than data.train_batch_size {self.data.train_batch_size}")
        _check(self.data.train_batch_size % self.actor.ppo_mini_batch_size == 0, "actor.ppo_mini_batch_size",
               f"{self.actor.ppo_mini_batch_size} does not divide data.train_batch_size "
               f"{self.data.train_batch_size}")
        if self.data.source == "files" and self.model.preset is not None:
            _check(self.model.tokenizer_path is not None, "model.tokenizer_path", "a random-init model.preset "
                   "needs a tokenizer for data.source = 'files'; set it to a HF tokenizer dir")
        if self.algo.adv_estimator in ("grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "opo", "grpo_passk",
                                       "reinforce_plus_plus_baseline", "gdpo", "gpg", "optimal_token_baseline",
                                       "tir_optimal_token_baseline"):
            _check(self.rollout.n >= 2, "rollout.n", f"{self.algo.adv_estimator} compares responses of a "
                   "prompt; use n >= 2")
        if self.filter_groups.enable:
            _check(self.rollout.n >= 2, "algorithm.filter_groups.enable", "dynamic sampling drops groups whose "
                   "responses all score the same; it needs rollout.n >= 2")
        return self

    @property
    def pack_length(self) -> int:
        if self.actor.pack_length:
            return self.actor.pack_length
        total = self.data.max_prompt_length + self.data.max_response_length
        return -(-total // 128) * 128


def build_run_config() -> RunConfig:
    """Builds every part from its gin bindings (`actor.lr = 1e-6`, ...) and validates the whole."""
    parts = dict(model=ModelConfig(), data=DataConfig(), rollout=RolloutConfig(), actor=ActorConfig(),
                 critic=CriticConfig(), algo=AlgoConfig(), reward=RewardConfig(), trainer=TrainerConfig(),
                 policy_loss=PolicyLossSettings(), rollout_correction=RolloutCorrectionSettings(),
                 filter_groups=FilterGroupsSettings(), overlong_buffer=OverlongBufferSettings(),
                 router_replay=RouterReplaySettings())
    gin_names = dict(algo="algorithm", trainer="train", policy_loss="actor.policy_loss",
                     rollout_correction="algorithm.rollout_correction", filter_groups="algorithm.filter_groups",
                     overlong_buffer="reward.reward_kwargs.overlong_buffer_cfg", router_replay="actor.router_replay")
    for key, part in parts.items():
        check_types(part, gin_names.get(key, key))
    return RunConfig(**parts).validate()
