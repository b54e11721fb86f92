"""What both JAX engines (paged and dense) share: the engine's weights and how a request becomes a decode spec.

Weight sync is in memory: the trainer's params are cast and resharded to the engine layout
(`sharding.ENGINE_RULES`: replicated over data/fsdp, split over tensor) by one jitted function.

A mixture of experts' stacked experts ([L, E, D, I] a stack) are read in place instead where they already are what
the engine would make of them: in the engine's dtype and layout (a frozen bf16 base under LoRA, on the engine's
devices). The engine then keeps a reference, not a copy (61 GB of Qwen3-30B-A3B's), and its programs index the
layer in the stack (`grouped_matmul(..., layer=j)`). Whoever passes them keeps them alive and unchanged while the
engine holds them (the trainer syncs new weights before every rollout, and frees nothing the engine reads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from jaxrl_llm import distributed, sharding
from jaxrl_llm.models import quant
from jaxrl_llm.models.config import Qwen2Config
from jaxrl_llm.rollout import decode
from jaxrl_llm.rollout.base import SamplingParams, check_prompts
from jaxrl_llm.rollout.weight_sync import WeightSync


def resolve_decode_attention(impl: str, supported: bool, why: str) -> str:
    """"xla" or "pallas" for an engine's `decode_attention` ("auto": the kernel on a GPU where
    `supported`); the kernel's shape limits are checked where the engine is built."""
    if impl not in ("auto", "xla", "pallas"):
        raise ValueError(f"decode_attention must be 'auto', 'xla' or 'pallas', got {impl!r}")
    if impl == "xla" or jax.default_backend() != "gpu":
        return "xla" if impl == "auto" else impl
    if supported:
        return "pallas"
    if impl == "auto":
        return "xla"
    raise ValueError(f"decode_attention='pallas' on GPU needs {why}; use 'xla' or 'auto'")


class EngineWeights:
    """The engine's compute-dtype weights on its mesh, and the helpers every JAX engine uses."""

    # The paged engine's option (Qwen3.5's recurrent state in its state slots); the dense engine serves no
    # linear-attention model.
    linear_state_dtype = "float32"
    state_update = "in_place"

    def __init__(self, cfg: Qwen2Config, params=None, *, mesh: Mesh | None = None, dtype: str = "bfloat16",
                 max_prompt_length: int = 1024):
        self.cfg = cfg.replace(dtype=dtype, param_dtype=dtype, remat="none", attention_impl="xla")
        self.mesh = mesh
        self.max_prompt_length = max_prompt_length
        self.version = 0
        self._dp = sharding.data_parallel_size(mesh) if mesh is not None else 1
        self._converters: dict[tuple[str, ...], object] = {}
        self._convert = self._converter(())
        self.params = None
        self._sync: WeightSync | None = None  # made at the first update from other devices
        if params is not None:
            self.update_weights(params)

    def _sharding(self, axes, shape):
        if self.mesh is None:
            return SingleDeviceSharding(jax.devices()[0])
        return sharding.named_sharding(self.mesh, axes, shape, rules=sharding.ENGINE_RULES)

    def _engine_shardings(self, shared: tuple[str, ...] = ()):
        cfg, sh = self.cfg, self._sharding
        per_stack = {}
        for stack in cfg.layer_stacks:  # one layout per kind of layer (dense, or a MoE's sparse layers)
            layer = _abstract_layer(cfg, stack)
            if stack in shared:
                del layer["mlp"]["experts"]
            shapes = jax.eval_shape(lambda layer: decode.engine_layer(layer, jnp.dtype(cfg.dtype)), layer)
            per_stack[stack] = {k: sh(decode.ENGINE_LAYER_AXES[k], v.shape) for k, v in shapes.items()}
        return {
            "embed": sh(("vocab", "embed"), (cfg.vocab_size, cfg.hidden_size)),
            "layers": [per_stack[stack] for stack, _ in layer_slots(cfg)],
            "norm": sh(("norm",), (cfg.hidden_size,)),
            "head": sh(("embed", "vocab"), (cfg.hidden_size, cfg.vocab_size)),
        }

    def _converter(self, shared: tuple[str, ...]):
        """The jitted trainer -> engine conversion of params whose `shared` stacks' experts were taken out."""
        if shared not in self._converters:
            self._converters[shared] = jax.jit(self._to_engine, out_shardings=self._engine_shardings(shared))
        return self._converters[shared]

    def shared_experts(self, params) -> dict[str, dict]:
        """{stack: {"gate_proj", "up_proj", "down_proj": [L, E, ...]}} of the stacked experts in `params` the engine
        can read in place (see the module docstring): already in its dtype and layout."""
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        out = {}
        for stack in cfg.layer_stacks if cfg.is_moe else ():
            experts = params["model"][stack]["mlp"].get("experts")
            if experts is None or getattr(experts.get("gate_proj"), "sharding", None) is None:
                continue
            target = lambda a: self._sharding(("layers",) + decode.ENGINE_LAYER_AXES["expert_gate_w"], a.shape) \
                if a.ndim == 4 else None
            if all(a.dtype == dt and target(a) is not None and a.sharding.is_equivalent_to(target(a), a.ndim)
                   for a in experts.values()):
                out[stack] = {k: _relabel(a, target(a)) for k, a in experts.items()}
        return out

    def _to_engine(self, params):
        dt = jnp.dtype(self.cfg.dtype)
        m = params["model"]
        # An 8-bit base with its adapters (`ModelState.engine_params`) is dequantized and merged one layer
        # at a time here; plain layers pass through `plain_layer` unchanged.
        layers = [decode.engine_layer(quant.plain_layer(jax.tree.map(lambda x, j=j: x[j], m[stack]), dt), dt)
                  for stack, j in layer_slots(self.cfg)]
        embed = m["embed_tokens"]["embedding"].astype(dt)
        head = embed.T if self.cfg.tie_word_embeddings else params["lm_head"]["kernel"].astype(dt)
        return {"embed": embed, "layers": layers, "norm": m["norm"]["weight"].astype(dt), "head": head}

    def update_weights(self, params, *, step: int | None = None) -> int:
        """Casts and reshards trainer params into the engine layout, in device memory. `params` may also be
        an 8-bit or bf16 base with pre-scaled adapters (`ModelState.engine_params`, `WeightSync.adapters`), on
        the engine's devices or on others."""
        # The old weights go first: the conversion's output is a new copy of every layer (the decode
        # layout unstacks and fuses them), so keeping both would hold two engine copies at the peak.
        self.params = None
        self.params = self.convert(params)
        self.version = self.version + 1 if step is None else step
        return self.version

    def convert(self, params):
        """Trainer params (on any devices) in the engine layout on the engine's devices, as a new tree (the
        engine's own weights untouched: a rollout stream stages them while its shards decode)."""
        engine_devices = set(self.mesh.devices.flat) if self.mesh is not None else {jax.devices()[0]}
        if any(set(x.sharding.device_set) != engine_devices for x in jax.tree.leaves(params)):
            # Trainer and engine on different devices: device-to-device copies in layer buckets into a layout
            # the conversion below takes on the engine's devices (rollout/weight_sync.py). A plain device_put
            # to the engine's layout would go through host memory wherever the layouts' shards differ.
            if self._sync is None:
                self._sync = WeightSync(self.cfg, self.mesh, dtype=self.cfg.dtype)
            params = self._sync(params)
        shared = self.shared_experts(params)
        convert, rest = self.conversion(params)
        with self._mesh_ctx():  # the conversion leaves those stacks' experts out: the engine reads them in place
            out = convert(rest)
        if shared:
            out["experts"] = shared
        return out

    def conversion(self, params) -> tuple:
        """(the jitted conversion `convert` runs on `params`, its input): `params` less the experts the engine
        reads in place. Shapes will do; the memory check compiles it."""
        shared = tuple(sorted(self.shared_experts(params)))
        return self._converter(shared), _without_experts(params, shared)

    def release_weights(self) -> None:
        """Drops the engine's weights until the next `update_weights`, so the trainer's update has their memory
        (buffers the trainer's params share stay alive through the trainer's references)."""
        self.params = None

    def _mesh_ctx(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else _null_ctx()

    def _put(self, x: np.ndarray) -> jax.Array:
        """A host array (the same on every process) split over the engine's data-parallel devices."""
        return distributed.put(x, self._batch_sharding(x.ndim))

    def _put_replicated(self, x: np.ndarray) -> jax.Array:
        if self.mesh is None:
            return jax.device_put(np.asarray(x), SingleDeviceSharding(jax.devices()[0]))
        return distributed.put(x, sharding.replicated(self.mesh))

    def _batch_sharding(self, ndim):
        if self.mesh is None:
            return SingleDeviceSharding(jax.devices()[0])
        return NamedSharding(self.mesh, sharding.logical_to_spec(("batch",) + (None,) * (ndim - 1),
                                                                 None, self.mesh))

    def _spec(self, sampling: SamplingParams, attention: str) -> decode.DecodeSpec:
        stops = tuple(sampling.stop_token_ids) + (() if sampling.ignore_eos else self.cfg.eos_token_ids)
        return decode.DecodeSpec(
            num_layers=self.cfg.num_hidden_layers, num_heads=self.cfg.num_attention_heads,
            num_kv_heads=self.cfg.num_key_value_heads, head_dim=self.cfg.head_dim, rope_theta=self.cfg.rope_theta,
            rope_scaling=self.cfg.rope_scaling, rms_norm_eps=self.cfg.rms_norm_eps,
            temperature=float(sampling.temperature),
            top_k=max(0, int(sampling.top_k)), top_p=float(sampling.top_p), stop_ids=tuple(sorted(set(stops))),
            pad_id=self.cfg.pad_token_id if self.cfg.pad_token_id is not None else 0,
            max_new_tokens=int(sampling.max_new_tokens), attention=attention,
            moe_top_k=self.cfg.num_experts_per_tok if self.cfg.is_moe else 0, norm_topk_prob=self.cfg.norm_topk_prob,
            num_moe_layers=len(self.cfg.sparse_layers),
            layer_slots=tuple(layer_slots(self.cfg)) if self.cfg.is_moe else (),
            record_routing=bool(sampling.return_routed_experts) and self.cfg.is_moe, **self._linear_spec())

    def _linear_spec(self) -> dict:
        """The DecodeSpec fields of Qwen3.5's hybrid layers (none for the other families)."""
        c = self.cfg
        if not c.is_hybrid:
            return {}
        return dict(rotary_dim=c.rotary_dim, hybrid=True,
                    linear_layers=tuple(i for i in range(c.num_hidden_layers) if c.is_linear_layer(i)),
                    linear_key_heads=c.linear_num_key_heads, linear_value_heads=c.linear_num_value_heads,
                    linear_key_dim=c.linear_key_head_dim, linear_value_dim=c.linear_value_head_dim,
                    conv_kernel=c.linear_conv_kernel_dim,
                    state_dtype=self.linear_state_dtype, state_update=self.state_update)

    def _request_spec(self, prompts, sampling: SamplingParams, row_max=None) -> decode.DecodeSpec:
        """Checks a request before any work (one clear error per problem); returns its decode spec.
        `row_max` [len(prompts) * n] are the rows' own token caps, when they have them."""
        budgets = row_max.reshape(len(prompts), -1).max(-1).tolist() if row_max is not None and row_max.size else None
        check_prompts(prompts, self.max_prompt_length, self.cfg.vocab_size, sampling,
                      self.cfg.max_position_embeddings, budgets=budgets)
        if self.params is None:
            raise RuntimeError(f"{type(self).__name__} has no weights; call update_weights(params) first")
        return self._spec(sampling, self.decode_attention)

    @property
    def pad_id(self) -> int:
        return self.cfg.pad_token_id if self.cfg.pad_token_id is not None else 0


def row_budgets(max_new_tokens_per_row, rows: int, max_new_tokens: int) -> np.ndarray:
    """[rows] per-response token caps (vLLM's per-request max_tokens), each in [1, max_new_tokens]."""
    from jaxrl_llm.rollout.base import RolloutError

    if max_new_tokens_per_row is None:
        return np.full(rows, max_new_tokens, np.int32)
    out = np.clip(np.asarray(max_new_tokens_per_row, np.int32), 1, max_new_tokens)
    if out.shape != (rows,):
        raise RolloutError(f"max_new_tokens_per_row has {out.size} values; need len(prompts) * n = {rows}")
    return out


def row_streams(seeds, rows: int) -> np.ndarray:
    """[rows] int32 ids of each response row's random stream: row r draws token t from
    fold_in(fold_in(key(sampling.seed), streams[r]), t). The default is the row's index in the request;
    a caller that samples the same logical row in several calls (the agent loop's turns) passes its own,
    so a row's draws do not depend on which other rows share the call."""
    from jaxrl_llm.rollout.base import RolloutError

    if seeds is None:
        return np.arange(rows, dtype=np.int32)
    out = np.asarray(seeds, np.int64)
    if out.shape != (rows,):
        raise RolloutError(f"seeds has {out.size} values; need len(prompts) * n = {rows}")
    if out.size and (out.min() < 0 or out.max() >= 2**31):
        raise RolloutError("seeds must be in [0, 2**31): each one seeds a row's stream through fold_in")
    return out.astype(np.int32)


def _relabel(x, target):
    """`x` under the engine's own sharding object (an equivalent one: the same buffers, no copy)."""
    if not isinstance(x, jax.Array) or x.sharding == target:
        return x
    return jax.make_array_from_single_device_arrays(x.shape, target, [s.data for s in x.addressable_shards])


def _without_experts(params: dict, stacks) -> dict:
    """`params` with the experts of `stacks` left out (a new tree around the same arrays)."""
    if not stacks:
        return params
    model = dict(params["model"])
    for stack in stacks:
        mlp = {k: v for k, v in model[stack]["mlp"].items() if k != "experts"}
        model[stack] = {**model[stack], "mlp": mlp}
    return {**params, "model": model}


def layer_slots(cfg: Qwen2Config) -> list[tuple[str, int]]:
    """(stack, index in the stack) of each decoder layer in execution order (see `cfg.layer_stacks`)."""
    where = {i: (stack, j) for stack, ids in cfg.layer_stacks.items() for j, i in enumerate(ids)}
    return [where[i] for i in range(cfg.num_hidden_layers)]


def _abstract_layer(cfg: Qwen2Config, stack: str = "layers") -> dict:
    """ShapeDtypeStructs of one unstacked trainer layer of `stack` in the engine dtype."""
    from jaxrl_llm.models.params import graphdef_and_abstract_params

    _, abstract = graphdef_and_abstract_params(cfg)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], jnp.dtype(cfg.dtype)),
                        abstract["model"][stack])


class _null_ctx:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
