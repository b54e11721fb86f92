"""Run configuration as gin-configurable dataclasses, with veRL's field names where they exist.

Each dataclass is bound in gin under a short veRL-like name: `model.*`, `data.*`, `rollout.*`,
`actor.*`, `critic.*`, `algorithm.*`, `reward.*` and `train.*` (the trainer: epochs, saving,
logging, mesh). `build_run_config()` builds one `RunConfig` from the bindings and validates it before
any model is loaded, so a bad value fails in the first second.
"""

from __future__ import annotations

import dataclasses

import gin

from jaxrl_llm.algorithms.rollout_correction import RolloutCorrectionConfig
from jaxrl_llm.trainer.config.async_training import AsyncConfig, check_async
from jaxrl_llm.trainer.config.check import ConfigValueError, check_types
from jaxrl_llm.trainer.config.check import check as _check
from jaxrl_llm.trainer.config.rollout import RolloutConfig
from jaxrl_llm.trainer.config.router_replay import RouterReplaySettings


@gin.configurable("model")
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Where the policy comes from: a local HF dir / hub id (`path`), or a random preset (`preset`)."""

    path: str | None = None  # a local HF model directory, or a hub id (downloaded when online)
    # a random-init model by name (models/config.py PRESETS): 'tiny', 'qwen2p5_7b', ...; Qwen3.5's 'qwen3_5_9b',
    # 'qwen3_5_35b_a3b' (MoE), 'tiny_qwen35' and 'tiny_qwen35_moe'
    preset: str | None = None
    tokenizer_path: str | None = None  # a HF tokenizer dir (default: model.path)
    dtype: str = "bfloat16"  # the compute dtype (and the export's default)
    param_dtype: str = "float32"  # the master weights' dtype
    # "auto": the policy with the least recompute whose update fits the device (models/remat.py: "dots", ...,
    # "full"), or one by name
    remat: str = "auto"
    attention_impl: str = "auto"  # 'auto' (cuDNN flash attention on GPUs), 'cudnn' or 'xla'
    critic_path: str | None = None  # defaults to `path` (veRL initialises the critic from the actor)
    # DecoderConfig fields to change (e.g. a smaller vocab for a preset); a Qwen3.5's also layer_types (each
    # 'linear_attention' or 'full_attention'), linear_num_key_heads / linear_num_value_heads,
    # linear_key_head_dim / linear_value_head_dim, linear_conv_kernel_dim, partial_rotary_factor and (MoE)
    # shared_expert_intermediate_size
    overrides: dict | None = None
    seed: int = 0  # seed of a preset's random init (the critic's: seed + 1) and of fresh adapters
    # LoRA (veRL's names; rank 0: full fine-tuning) on target_modules ('all-linear' or names) less exclude_modules.
    lora_rank: int = 0
    lora_alpha: float = 16.0  # the adapters' scale is lora_alpha / lora_rank (PEFT's)
    # None: 'all-linear' under LoRA (the model's linear modules, as PEFT's); or names (q/k/v/o_proj,
    # gate/up/down_proj; a Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj; a Qwen3.5-MoE's
    # shared_expert_gate)
    target_modules: str | tuple[str, ...] | None = None
    exclude_modules: tuple[str, ...] = ()  # module names to leave out of target_modules
    lora_adapter_path: str | None = None  # a PEFT adapter directory to start from
    # LoRA's frozen base in 8 bits (our name; veRL has no QLoRA): 'none', 'int8' or 'fp8' (`models/quant.py`;
    # not on a mixture of experts).
    base_quantization: str = "none"

    def validate(self):
        from jaxrl_llm.models.config import PRESETS

        _check((self.path is None) != (self.preset is None), "model.path / model.preset",
               "set exactly one: a HF model dir (or hub id) in `path`, or a random-init `preset`")
        _check(self.preset is None or self.preset in PRESETS, "model.preset",
               f"unknown preset {self.preset!r}; known: {sorted(PRESETS)}")
        from jaxrl_llm.models.remat import POLICIES

        _check(self.remat == "auto" or self.remat in POLICIES, "model.remat",
               f"{self.remat!r}; use 'auto' or one of {POLICIES} (models/remat.py)")
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

    source: str = "files"  # 'files' (parquet/jsonl in veRL's schema), or a demo task: 'arithmetic', 'multiply'
    train_files: tuple[str, ...] = ()  # a path or a list of paths (parquet or jsonl)
    val_files: tuple[str, ...] = ()  # the same for validation; () for none
    train_batch_size: int = 1024  # prompts per step
    val_batch_size: int | None = None  # validation prompts a generate call (None: all)
    max_prompt_length: int = 512  # prompt tokens at most; longer prompts are filtered out
    max_response_length: int = 1024  # response tokens at most (veRL's rollout.response_length)
    prompt_key: str = "prompt"  # the column with the chat messages
    shuffle: bool = True  # shuffle the training prompts each epoch
    seed: int = 1  # seed of the data order and of sampling
    val_max_samples: int | None = None  # validation prompts at most (None: all)
    arithmetic_max_operand: int = 9  # demo task only

    def __post_init__(self):  # one path as a plain string, as veRL takes it ('' for none), or a list
        for key in ("train_files", "val_files"):
            value = getattr(self, key)
            if isinstance(value, str):
                object.__setattr__(self, key, (value,) if value else ())
            elif isinstance(value, list):
                object.__setattr__(self, key, tuple(value))

    def validate(self):
        _check(self.source in ("files", "arithmetic", "multiply"), "data.source", f"{self.source!r}; use 'files'")
        if self.source == "files":
            _check(bool(self.train_files), "data.train_files", "no training files given")
        _check(self.train_batch_size >= 1, "data.train_batch_size", "must be >= 1")
        _check(self.max_prompt_length >= 1 and self.max_response_length >= 1,
               "data.max_prompt_length / max_response_length", "must be >= 1")


@gin.configurable("actor")
@dataclasses.dataclass(frozen=True)
class ActorConfig:
    """veRL's `actor_rollout_ref.actor.*` plus the optimizer (`optim.*`)."""

    lr: float = 1e-6  # learning rate (veRL's actor.optim.lr)
    lr_warmup_steps: int = 0  # linear warmup from 0 over this many training steps
    lr_warmup_steps_ratio: float = 0.0  # warmup as a share of the total steps (when lr_warmup_steps is 0)
    lr_scheduler: str = "constant"  # or "cosine"
    min_lr_ratio: float = 0.0  # cosine: the last lr as a share of lr
    weight_decay: float = 0.01  # AdamW's decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # Adam's (beta1, beta2)
    grad_clip: float = 1.0  # clip the gradient's global norm to this (0: off)
    ppo_epochs: int = 1  # passes over each step's batch
    ppo_mini_batch_size: int = 256  # prompts per optimizer step (x n responses)
    ppo_max_token_len_per_gpu: int = 16384  # token budget of one micro-batch per device
    pack_length: int | None = None  # packed row length (default: max prompt + max response, rounded)
    # Micro-batch shapes a pass may take (trainer/packing.py; 1: always the full one; k: the full one and 1/2 ...
    # 1/2^(k-1) of its rows, each built before the first step), so a pass's padding is a few % of its tokens.
    tail_shapes: int = 4
    clip_ratio: float = 0.2  # PPO's clip range (both sides, unless clip_ratio_low / high)
    clip_ratio_low: float | None = None  # the range below 1 (None: clip_ratio)
    clip_ratio_high: float | None = None  # the range above 1 (None: clip_ratio; DAPO's clip-higher uses 0.28)
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages (> 1)
    # 'token-mean', 'token-sum', 'seq-mean-token-sum', 'seq-mean-token-mean', 'seq-mean-token-sum-norm'
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0  # weight of the entropy bonus
    use_kl_loss: bool = False  # add a KL loss to the reference policy (GRPO's)
    kl_loss_coef: float = 0.001  # weight of the KL loss
    kl_loss_type: str = "low_var_kl"  # its estimator: 'kl' (k1), 'abs', 'mse' (k2), 'low_var_kl' (k3), 'full'
    logprob_chunk_size: int = 8192  # vocab chunk of the fused logprob/entropy
    # SAPO's gate temperatures for positive / negative advantages (veRL's actor.tau_pos / tau_neg).
    tau_pos: float = 1.0
    tau_neg: float = 1.05  # SAPO's gate temperature for negative advantages
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

    # 'vanilla' (PPO clip), 'gspo', 'sapo', 'gpg', 'clip_cov', 'kl_cov', ... (README: Algorithms)
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002  # clip_cov: share of tokens whose gradient is dropped
    clip_cov_lb: float = 1.0  # clip_cov: the lower end of the covariance range it picks tokens in
    clip_cov_ub: float = 5.0  # clip_cov: the upper end
    kl_cov_ratio: float = 0.0002  # kl_cov: share of tokens that get the |log-ratio| penalty
    ppo_kl_coef: float = 0.1  # kl_cov: weight of the |log-ratio| penalty
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

    lr: float = 1e-5  # the critic's learning rate (veRL's critic.optim.lr)
    lr_warmup_steps: int = 0  # linear warmup from 0 over this many training steps
    lr_scheduler: str = "constant"  # 'constant' or 'cosine'
    weight_decay: float = 0.01  # AdamW's decoupled weight decay
    grad_clip: float = 1.0  # clip the gradient's global norm to this (0: off)
    ppo_epochs: int | None = None  # defaults to the actor's
    cliprange_value: float = 0.5  # the value loss's clip range around the old values
    loss_agg_mode: str = "token-mean"  # aggregation of the value loss (as actor.loss_agg_mode)


@gin.configurable("algorithm")
@dataclasses.dataclass(frozen=True)
class AlgoConfig:
    """veRL's `algorithm.*`."""

    adv_estimator: str = "grpo"  # 'grpo', 'gae' (PPO, with a critic), 'rloo', 'remax', ... (README: Algorithms)
    gamma: float = 1.0  # discount factor (GAE, REINFORCE++)
    lam: float = 1.0  # GAE's lambda
    norm_adv_by_std_in_grpo: bool = True  # GRPO: divide by the group's std (False: Dr.GRPO)
    use_kl_in_reward: bool = False  # subtract a KL penalty to the reference from the reward
    kl_penalty: str = "kl"  # its estimator: 'kl', 'abs', 'mse', 'low_var_kl', 'full'
    kl_ctrl_type: str = "fixed"  # 'fixed' or 'adaptive' KL coefficient (veRL's kl_ctrl.type)
    kl_coef: float = 0.001  # the (starting) KL coefficient
    kl_target: float = 0.1  # adaptive: the KL it steers to
    kl_horizon: int = 10000  # adaptive: the controller's horizon
    # GDPO: the reward-function dict keys normalised one by one, and their weights (None: equal).
    gdpo_reward_keys: tuple[str, ...] | None = None
    gdpo_reward_weights: tuple[float, ...] | None = None  # one weight per gdpo_reward_keys entry (None: equal)

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

    enable: bool = False  # DAPO's dynamic sampling on
    metric: str = "reward"
    max_num_gen_batches: int = 0


@gin.configurable("overlong_buffer_cfg", module="reward.reward_kwargs")
@dataclasses.dataclass(frozen=True)
class OverlongBufferSettings:
    """veRL's `reward.reward_kwargs.overlong_buffer_cfg.*` (DAPO): a response longer than
    max_response_length - len loses up to `penalty_factor` of reward, linearly over the last `len` tokens."""

    enable: bool = False  # DAPO's overlong penalty on
    len: int = 0  # tokens of the buffer before data.max_response_length
    penalty_factor: float = 1.0  # the most reward the penalty takes away
    log: bool = False  # log the penalty's metrics

    def validate(self, max_response_length: int):
        if self.enable:
            _check(0 < self.len <= max_response_length, "reward.reward_kwargs.overlong_buffer_cfg.len",
                   f"{self.len}; need 0 < len <= data.max_response_length ({max_response_length})")


@gin.configurable("reward")
@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Reward scoring: veRL's `reward_model.*` / `custom_reward_function.*` for rule-based rewards."""

    custom_reward_path: str | None = None  # a .py file holding your reward function
    custom_reward_name: str = "compute_score"  # its name in that file
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

    project_name: str = "jaxrl_llm"  # the wandb project
    experiment_name: str = "run"  # the wandb run name
    run_dir: str = "runs/run"  # metrics, TensorBoard, checkpoints and the operative config go here
    total_epochs: int = 1  # passes over the training data (unless total_training_steps)
    total_training_steps: int | None = None  # training steps (None: total_epochs' worth)
    save_freq: int = 20  # a checkpoint every N steps and at the end (-1: only at the end)
    max_checkpoints_to_keep: int = 2  # the newest checkpoints kept; older ones are deleted
    test_freq: int = -1  # validate every N steps and at the end (-1: never)
    val_before_train: bool = False  # validate once before the first step
    resume_mode: str = "auto"  # "auto", "disable", or a checkpoint path
    # sinks: 'console', 'jsonl' (metrics.jsonl), 'tensorboard', 'wandb'
    logger: tuple[str, ...] = ("console", "jsonl", "tensorboard")
    driver: str = "ray"  # "ray" or "inprocess"
    ray_address: str | None = None  # a Ray cluster to join ('auto'); None: start one in this process
    # Processes of the run (both sides of an async run together; veRL's trainer.nnodes is train.nnodes). The Ray
    # driver starts this many trainer processes (one Ray placement-group bundle each) joined by jax.distributed;
    # plain launches set the count with --num_processes.
    num_processes: int = 1
    devices_per_process: int | None = None  # GPUs (or simulated CPU devices) of each process; None: 1 GPU
    heartbeat_timeout_s: int = 60  # a dead process stops the others after this long
    # JAX's persistent compilation cache: a repeated or resumed run loads its programs instead of
    # compiling them. "" turns it off.
    compilation_cache_dir: str = "~/.cache/jaxrl_llm/xla"
    mesh_data: int = 1  # the device mesh's data-parallel axis (one mesh size may be -1: the rest)
    mesh_fsdp: int = -1  # the fully sharded data-parallel axis
    mesh_tensor: int = 1  # the tensor-parallel axis
    mesh_expert: int = 1  # splits a MoE's experts (its devices are data-parallel elsewhere)
    # The training devices (veRL's trainer.n_gpus_per_node x trainer.nnodes): None, every device (sync) or every
    # device the rollout does not take (async_training); the mesh sizes above shape these
    n_gpus_per_node: int | None = None
    nnodes: int = 1  # veRL's trainer.nnodes: the trainer's nodes (train.n_gpus_per_node each)
    ref_offload: bool = False  # keep the reference model in host memory between its passes
    # The bytes a device may hold, for the memory check before the first step (trainer/memory/check.py).
    # None: what XLA may use on the device (a CPU says nothing: no check there); set it to check on a CPU.
    device_memory_limit_bytes: int | None = None
    # Compile the update and log-prob passes at every micro-batch shape a step can meet
    # (trainer/memory/warm_programs.py) while the worker starts, so that no later step compiles. None: on where the
    # devices are not the CPU. Measured on 4xH200 at the 7B seed share (2026-11-27): nothing compiled after step 0
    # (a 3.8 s program in step 1 without), step 0 164 -> 111 s (BENCHMARKS.md, issue 40).
    compile_ahead: bool | None = None
    # XLA's GPU options that overlap FSDP's collectives with compute (jaxrl_llm/xla_flags.py), added to XLA_FLAGS
    # before the backend starts; a flag XLA_FLAGS sets already keeps its value. No effect off a GPU.
    xla_gpu_overlap: bool = False
    dump_batches: bool = False  # save every step's training batch under <run_dir>/batches
    replay_batches_from: str | None = None  # a dir of dumped batches to train on instead of generating
    peak_tflops: float | None = None  # per device, for perf/mfu (default: a table by device kind)
    progress_bar: bool = True  # a tqdm bar on stderr, when stderr is a terminal

    def validate(self):
        _check(self.n_gpus_per_node is None or self.n_gpus_per_node >= 1, "train.n_gpus_per_node",
               f"{self.n_gpus_per_node}; need >= 1, or None for every device the rollout does not take")
        _check(self.nnodes >= 1, "train.nnodes", f"{self.nnodes}; need >= 1")
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
    async_training: AsyncConfig = AsyncConfig()

    def validate(self) -> RunConfig:
        for part in (self.model, self.data, self.rollout, self.actor, self.algo, self.reward, self.trainer,
                     self.policy_loss, self.rollout_correction, self.async_training):
            part.validate()
        check_async(self)
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
    def max_model_len(self) -> int:
        """Prompt + response tokens a row holds at most (the paged engine's block-table width)."""
        return self.data.max_prompt_length + self.data.max_response_length

    @property
    def pack_length(self) -> int:
        if self.actor.pack_length:
            return self.actor.pack_length
        total = self.data.max_prompt_length + self.data.max_response_length
        return -(-total // 128) * 128


# The parts of a RunConfig: (its field, the gin name of its keys, the gin configurable that builds it).
PARTS = (("model", "model", ModelConfig), ("data", "data", DataConfig), ("rollout", "rollout", RolloutConfig),
         ("actor", "actor", ActorConfig), ("policy_loss", "actor.policy_loss", PolicyLossSettings),
         ("router_replay", "actor.router_replay", RouterReplaySettings), ("critic", "critic", CriticConfig),
         ("algo", "algorithm", AlgoConfig), ("rollout_correction", "algorithm.rollout_correction",
                                             RolloutCorrectionSettings),
         ("filter_groups", "algorithm.filter_groups", FilterGroupsSettings), ("reward", "reward", RewardConfig),
         ("overlong_buffer", "reward.reward_kwargs.overlong_buffer_cfg", OverlongBufferSettings),
         ("trainer", "train", TrainerConfig), ("async_training", "async_training", AsyncConfig))


def build_run_config() -> RunConfig:
    """Builds every part from its gin bindings (`actor.lr = 1e-6`, ...) and validates the whole."""
    parts = {field: make() for field, _, make in PARTS}
    for field, name, _ in PARTS:
        check_types(parts[field], name)
    return RunConfig(**parts).validate()
