"""Run configuration as gin-configurable dataclasses, with veRL's field names where they exist.

Each dataclass is bound in gin under a short veRL-like name: `model.*`, `data.*`, `rollout.*`,
`actor.*`, `critic.*`, `algorithm.*`, `reward.*` and `train.*` (the trainer: epochs, saving,
logging, mesh). `build_run_config()` builds one `RunConfig` from the bindings and validates it before
any model is loaded, so a bad value fails in the first second.
"""

from __future__ import annotations

import dataclasses
import types
import typing

import gin


class ConfigValueError(ValueError):
    """A config value that cannot work; the message names the gin binding to change."""


def _check(cond: bool, binding: str, msg: str) -> None:
    if not cond:
        raise ConfigValueError(f"{binding}: {msg}")


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

    def validate(self):
        from jaxrl_llm.models.config import PRESETS

        _check((self.path is None) != (self.preset is None), "model.path / model.preset",
               "set exactly one: a HF model dir (or hub id) in `path`, or a random-init `preset`")
        _check(self.preset is None or self.preset in PRESETS, "model.preset",
               f"unknown preset {self.preset!r}; known: {sorted(PRESETS)}")
        _check(self.remat in ("auto", "none", "full", "dots"), "model.remat",
               f"{self.remat!r}; use 'auto', 'none', 'full' or 'dots'")


@gin.configurable("data")
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """veRL's `data.*`. `source` is "files" (parquet/jsonl in veRL schema) or "arithmetic" (the demo)."""

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
        _check(self.source in ("files", "arithmetic"), "data.source", f"{self.source!r} is not 'files' or "
               "'arithmetic'")
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
    max_batch_size: int = 1024  # response rows decoded together (JAX engine)
    val_temperature: float = 0.0  # validation is greedy (mean@1)
    vllm_workers: int = 1
    # Token budget of one micro-batch a device in the old/reference log-prob (and value) passes; None:
    # twice actor.ppo_max_token_len_per_gpu (a forward pass keeps no activations for a backward one).
    log_prob_max_token_len_per_gpu: int | None = None
    log_prob_gap: bool = True  # the trainer-sampler logprob gap metric

    def validate(self):
        _check(self.engine in ("jax", "vllm"), "rollout.engine", f"{self.engine!r}; use 'jax' or 'vllm'")
        _check(isinstance(self.n, int) and self.n >= 1, "rollout.n", f"n={self.n}; need n >= 1")
        _check(0.0 < self.top_p <= 1.0, "rollout.top_p", f"{self.top_p} is not in (0, 1]")
        _check(self.temperature > 0.0, "rollout.temperature", "training rollouts need temperature > 0")


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

    def validate(self):
        _check(self.lr >= 0, "actor.lr", "must be >= 0")
        _check(self.lr_scheduler in ("constant", "cosine"), "actor.lr_scheduler",
               f"{self.lr_scheduler!r}; use 'constant' or 'cosine'")
        _check(self.ppo_mini_batch_size >= 1 and self.ppo_epochs >= 1,
               "actor.ppo_mini_batch_size / ppo_epochs", "must be >= 1")
        _check(self.clip_ratio_c > 1.0, "actor.clip_ratio_c", "dual-clip bound must be > 1")
        _check(self.tail_shapes >= 1, "actor.tail_shapes", f"{self.tail_shapes}; need >= 1")
        _check(self.loss_agg_mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                      "seq-mean-token-sum-norm"), "actor.loss_agg_mode",
               f"{self.loss_agg_mode!r} is not a veRL mode")

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


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

    @property
    def uses_critic(self) -> bool:
        return self.adv_estimator == "gae"

    def validate(self):
        known = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
        _check(self.adv_estimator in known, "algorithm.adv_estimator", f"{self.adv_estimator!r}; known: {known}")
        _check(self.kl_ctrl_type in ("fixed", "adaptive"), "algorithm.kl_ctrl_type", "use 'fixed' or 'adaptive'")


@gin.configurable("reward")
@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Reward scoring: veRL's `reward_model.*` / `custom_reward_function.*` for rule-based rewards."""

    custom_reward_path: str | None = None
    custom_reward_name: str = "compute_score"
    num_workers: int = 0  # >0: a pool of Ray CPU workers
    strict: bool = False  # a raising reward function stops the run


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
    ref_offload: bool = False
    dump_batches: bool = False
    replay_batches_from: str | None = None
    peak_tflops: float | None = None  # per device, for perf/mfu (default: a table by device kind)
    progress_bar: bool = True

    def validate(self):
        _check(self.driver in ("ray", "inprocess"), "train.driver", f"{self.driver!r}; use 'ray' or "
               "'inprocess'")
        _check(self.num_processes >= 1, "train.num_processes", f"{self.num_processes}; need >= 1")
        _check(self.devices_per_process is None or self.devices_per_process >= 1, "train.devices_per_process",
               f"{self.devices_per_process}; need >= 1 (or None)")
        _check(self.heartbeat_timeout_s >= 5, "train.heartbeat_timeout_s", f"{self.heartbeat_timeout_s}; need >= 5")
        _check(self.total_epochs >= 1, "train.total_epochs", "must be >= 1")
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

    def validate(self) -> RunConfig:
        for part in (self.model, self.data, self.rollout, self.actor, self.algo, self.trainer):
            part.validate()
        _check(self.actor.ppo_mini_batch_size <= self.data.train_batch_size, "actor.ppo_mini_batch_size",
               f"{self.actor.ppo_mini_batch_size} is larger than data.train_batch_size "
               f"{self.data.train_batch_size}")
        _check(self.data.train_batch_size % self.actor.ppo_mini_batch_size == 0, "actor.ppo_mini_batch_size",
               f"{self.actor.ppo_mini_batch_size} does not divide data.train_batch_size "
               f"{self.data.train_batch_size}")
        if self.data.source == "files" and self.model.preset is not None:
            _check(self.model.tokenizer_path is not None, "model.tokenizer_path", "a random-init model.preset "
                   "needs a tokenizer for data.source = 'files'; set it to a HF tokenizer dir")
        if self.algo.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
            _check(self.rollout.n >= 2, "rollout.n", f"{self.algo.adv_estimator} compares responses of a "
                   "prompt; use n >= 2")
        return self

    @property
    def pack_length(self) -> int:
        if self.actor.pack_length:
            return self.actor.pack_length
        total = self.data.max_prompt_length + self.data.max_response_length
        return -(-total // 128) * 128


def _type_ok(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_type_ok(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is tuple or origin is tuple:
        return isinstance(value, tuple | list)  # gin writes lists for tuple fields too
    return isinstance(value, origin or hint)


def _check_types(part, name: str) -> None:
    """A bound value of the wrong type fails here, naming its binding, not later inside a comparison."""
    hints = typing.get_type_hints(type(part))
    for field in dataclasses.fields(part):
        value = getattr(part, field.name)
        _check(_type_ok(value, hints[field.name]), f"{name}.{field.name}",
               f"{value!r} is a {type(value).__name__}; expected {field.type}")


def build_run_config() -> RunConfig:
    """Builds every part from its gin bindings (`actor.lr = 1e-6`, ...) and validates the whole."""
    parts = dict(model=ModelConfig(), data=DataConfig(), rollout=RolloutConfig(), actor=ActorConfig(),
                 critic=CriticConfig(), algo=AlgoConfig(), reward=RewardConfig(), trainer=TrainerConfig())
    gin_names = dict(algo="algorithm", trainer="train")
    for key, part in parts.items():
        _check_types(part, gin_names.get(key, key))
    return RunConfig(**parts).validate()
