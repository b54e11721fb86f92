"""LoRA adapters on the decoder's linear layers: targets, params, shardings, and merging into the base.

The adapter of a linear layer with kernel W [in, out] is lora_a [in, r] and lora_b [r, out]; the layer
computes x @ W + (x @ lora_a) @ lora_b * alpha / r (PEFT's LoRA without dropout, `qwen2.Linear`). The
adapters live in the model's params tree beside the kernels they adapt, stacked over layers like them
(`model.layers.self_attn.q_proj.lora_a` [L, in, r]), so `nnx.merge` with a LoRA config runs them.
Everything here is pure; the trainer decides which leaves train (`trainer/roles/model_state.py`).

Where an adapter can sit depends on the layer's kind (`layer_modules`), with PEFT's module names:

  stack / layer kind                   module paths (under the layer)
  attention layers (`layers`)          self_attn.{q,k,v,o}_proj
  Qwen3.5 linear layers                linear_attn.{in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj}
  a dense MLP                          mlp.{gate,up,down}_proj
  Qwen3.5-MoE's sparse MLP             mlp.shared_expert.{gate,up,down}_proj, mlp.shared_expert_gate
  Qwen3-MoE's sparse MLP               none

A target name adapts every module of that name the model has (as PEFT matches `target_modules` by the last
name): `gate_proj` on a Qwen3.5-MoE is its shared expert's. 'all-linear' is what PEFT's 'all-linear' puts on
transformers 5.19's model of the family (every `nn.Linear` of the layers). Their routers and fused experts are
not `nn.Linear`; for Qwen3-MoE PEFT maps the MLP names (gate_proj, ...) to the experts' 3-D parameters
(`target_parameters`), which we do not adapt (benchmarks/NOTES.md item 32), so an MLP name there is an error.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, SingleDeviceSharding

from jaxrl_llm import sharding
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.errors import ConfigError
from jaxrl_llm.models.hf_table import get_path, layer_shape, param_table, set_path

# The linear modules of a layer an adapter can sit on, by what holds them: name -> parent path in the layer.
ATTENTION_MODULES = {n: ("self_attn",) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
LINEAR_ATTENTION_MODULES = {n: ("linear_attn",) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                          "out_proj")}
MLP_MODULES = {n: ("mlp",) for n in ("gate_proj", "up_proj", "down_proj")}
SHARED_EXPERT_MODULES = {**{n: ("mlp", "shared_expert") for n in MLP_MODULES}, "shared_expert_gate": ("mlp",)}
# Every target name, in the order targets resolve to (a dense model's seven first, as before Qwen3.5).
LORA_MODULES = (*ATTENTION_MODULES, *MLP_MODULES, *LINEAR_ATTENTION_MODULES, "shared_expert_gate")
LORA_LEAVES = ("lora_a", "lora_b")
# The targets a Qwen3-MoE offers: its sparse layers have no dense MLP (see the module docstring).
MOE_LORA_MODULES = tuple(ATTENTION_MODULES)


def layer_modules(cfg: DecoderConfig, stack: str) -> dict[str, tuple[str, ...]]:
    """The adaptable modules of the layers in `stack` (one of `cfg.layer_stacks`): name -> parent path."""
    mixer = LINEAR_ATTENTION_MODULES if stack == "linear_layers" else ATTENTION_MODULES
    if not cfg.is_moe or stack == "dense_layers":
        mlp = MLP_MODULES
    else:  # a sparse layer: the shared expert's (Qwen3.5-MoE), or none (Qwen3-MoE)
        mlp = SHARED_EXPERT_MODULES if cfg.shared_expert_intermediate_size else {}
    return {**mixer, **mlp}


def model_modules(cfg: DecoderConfig | None) -> tuple[str, ...]:
    """The target names `cfg`'s layers have, in `LORA_MODULES` order; what 'all-linear' resolves to (PEFT's
    nn.Linear modules of transformers' model). None: a dense model's (Qwen2, Qwen3, Llama)."""
    if cfg is None:
        return (*ATTENTION_MODULES, *MLP_MODULES)
    if cfg.is_moe and not cfg.family.shared_expert:  # Qwen3-MoE: the attention, in every stack
        return MOE_LORA_MODULES
    have = {n for stack in cfg.layer_stacks for n in layer_modules(cfg, stack)}
    return tuple(n for n in LORA_MODULES if n in have)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Rank, alpha and the (resolved, ordered) target module names of a run's adapters."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def apply(self, cfg: DecoderConfig) -> DecoderConfig:
        """The model config whose graph holds these adapters."""
        _check_model_targets(self.targets, cfg)
        return cfg.replace(lora_rank=self.rank, lora_alpha=float(self.alpha), lora_targets=self.targets)


def _check_model_targets(targets, cfg: DecoderConfig) -> None:
    """One ConfigError for target names `cfg`'s layers lack (a Qwen3-MoE's MLP names say why)."""
    have = model_modules(cfg)
    missing = [n for n in targets if n not in have]
    if not missing:
        return
    if cfg.is_moe and not cfg.family.shared_expert:
        raise ConfigError(f"model.target_modules: {sorted(missing)} on a mixture-of-experts model (Qwen3-MoE): its "
                          "sparse layers have no such nn.Linear (the routed experts are 3-D parameters, which PEFT on "
                          "transformers 5 adapts only as target_parameters, not supported here); target the attention "
                          f"modules {list(MOE_LORA_MODULES)} or 'all-linear'")
    raise ConfigError(f"model.target_modules: {missing} are not linear modules of this model (model_type "
                      f"{cfg.model_type!r}); its layers have {list(have)} ('all-linear' is all of them)")


def resolve_targets(target_modules, exclude_modules=(), cfg: DecoderConfig | None = None) -> tuple[str, ...]:
    """`model.target_modules` ('all-linear', None for it, or module names) less `model.exclude_modules`, in
    `LORA_MODULES` order.

    'all-linear' is the linear modules of `cfg`'s layers (`model_modules`: what PEFT's 'all-linear' adapts on the
    family's transformers model; a dense model's seven when `cfg` is None); a name `cfg` lacks is an error."""
    known = sorted(LORA_MODULES)
    if target_modules is None:  # model.target_modules' default: every linear layer, as veRL's
        target_modules = "all-linear"
    if isinstance(target_modules, str):
        if target_modules != "all-linear":
            raise ConfigError(f"model.target_modules: {target_modules!r}; use 'all-linear' or a list of module names "
                              f"from {known}")
        wanted = set(model_modules(cfg))
    else:
        wanted = set(target_modules)
    for key, names in (("model.target_modules", wanted), ("model.exclude_modules", set(exclude_modules or ()))):
        unknown = sorted(str(n) for n in names if n not in LORA_MODULES)
        if unknown:
            raise ConfigError(f"{key}: unknown module name(s) {unknown}; LoRA can target {known} (or 'all-linear' "
                              "in model.target_modules); the stacked layers take one setting for every layer")
    if cfg is not None:
        _check_model_targets([n for n in LORA_MODULES if n in wanted], cfg)
    targets = tuple(n for n in LORA_MODULES if n in wanted and n not in set(exclude_modules or ()))
    if not targets:
        raise ConfigError(f"model.target_modules={target_modules!r} less model.exclude_modules={exclude_modules!r} "
                          "leaves no module to adapt; target at least one")
    return targets


def check_settings(rank, alpha, target_modules, exclude_modules, adapter_path) -> None:
    """`model.lora_*` as a run sets them; one ConfigError naming the key and the fix."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ConfigError(f"model.lora_rank: {rank!r}; use 0 (full fine-tuning) or a positive rank such as 32")
    if adapter_path is not None:
        if not rank:
            raise ConfigError("model.lora_adapter_path: an adapter needs LoRA on; set model.lora_rank to the "
                              "adapter's rank (its adapter_config.json's 'r')")
        if not os.path.isfile(os.path.join(adapter_path, "adapter_config.json")):
            raise ConfigError(f"model.lora_adapter_path: {adapter_path!r} is not a PEFT adapter directory (no "
                              "adapter_config.json); give what PeftModel.save_pretrained or `python -m "
                              "jaxrl_llm.export` writes")
    if not rank and (target_modules is not None or exclude_modules):
        key = "model.target_modules" if target_modules is not None else "model.exclude_modules"
        raise ConfigError(f"{key} is set but model.lora_rank is 0, which trains every weight (full fine-tuning); "
                          f"set model.lora_rank (e.g. 32) to train LoRA adapters, or drop {key}")
    if rank:
        if not alpha > 0:
            raise ConfigError(f"model.lora_alpha: {alpha}; need > 0 (the adapters' scale is lora_alpha / lora_rank)")
        resolve_targets(target_modules, exclude_modules)


def module_path(name: str, stack: str = "layers", cfg: DecoderConfig | None = None) -> tuple[str, ...]:
    """Where a target module's params sit in the params tree (`stack`: one of `cfg.layer_stacks`; `cfg` None:
    a dense model's)."""
    modules = layer_modules(cfg, stack) if cfg is not None else {**ATTENTION_MODULES, **MLP_MODULES}
    return ("model", stack, *modules[name], name)


def adapter_sites(cfg: DecoderConfig, spec: LoraSpec) -> list[tuple[str, str, tuple[str, ...]]]:
    """(stack, target name, module path) of every adapted module, stack-major: each stack (a mixed MoE's dense
    layers, a Qwen3.5's linear layers) holds the adapters of the targets its layers have, stacked over them."""
    return [(stack, name, module_path(name, stack, cfg)) for stack in cfg.layer_stacks
            for name in spec.targets if name in layer_modules(cfg, stack)]


def _kernel_axes(cfg: DecoderConfig, path: tuple[str, ...]) -> tuple:
    kernel = path + ("kernel",)
    return next(row.axes for row in param_table(cfg) if row.path == kernel)


def adapter_shapes(cfg: DecoderConfig, spec: LoraSpec) -> dict:
    """The adapters' tree of ShapeDtypeStructs (param_dtype), as the LoRA model's params hold them."""
    out: dict = {}
    dt = jnp.dtype(cfg.param_dtype)
    for stack, _, path in adapter_sites(cfg, spec):
        layers = len(cfg.layer_stacks[stack])
        din, dout = layer_shape(path + ("kernel",), cfg)
        set_path(out, path + ("lora_a",), jax.ShapeDtypeStruct((layers, din, spec.rank), dt))
        set_path(out, path + ("lora_b",), jax.ShapeDtypeStruct((layers, spec.rank, dout), dt))
    return out


def num_adapter_params(cfg: DecoderConfig, spec: LoraSpec | None) -> int:
    """How many params the adapters of `spec` hold on `cfg` (0 without LoRA)."""
    return 0 if spec is None else sum(x.size for x in jax.tree.leaves(adapter_shapes(cfg, spec)))


def adapter_shardings(cfg: DecoderConfig, spec: LoraSpec, mesh: Mesh | None) -> dict:
    """lora_a takes its kernel's input-axis sharding, lora_b its output-axis one; the rank is replicated."""
    out: dict = {}
    shapes = adapter_shapes(cfg, spec)
    for _, _, path in adapter_sites(cfg, spec):
        layers_ax, in_ax, out_ax = _kernel_axes(cfg, path)
        for leaf, axes in (("lora_a", (layers_ax, in_ax, None)), ("lora_b", (layers_ax, None, out_ax))):
            shape = get_path(shapes, path + (leaf,)).shape
            sh = (SingleDeviceSharding(jax.devices()[0]) if mesh is None
                  else sharding.named_sharding(mesh, axes, shape))
            set_path(out, path + (leaf,), sh)
    return out


def init_adapters(cfg: DecoderConfig, spec: LoraSpec, *, mesh: Mesh | None = None, seed: int = 0) -> dict:
    """Fresh adapters in their sharded layout: lora_a uniform in ±1/sqrt(in) (PEFT's default), lora_b zero."""
    shapes = adapter_shapes(cfg, spec)

    def make(key):
        out: dict = {}
        for i, (_, _, path) in enumerate(adapter_sites(cfg, spec)):
            a, b = get_path(shapes, path + ("lora_a",)), get_path(shapes, path + ("lora_b",))
            bound = a.shape[1] ** -0.5
            a = jax.random.uniform(jax.random.fold_in(key, i), a.shape, a.dtype, -bound, bound)
            set_path(out, path + ("lora_a",), a)
            set_path(out, path + ("lora_b",), jnp.zeros(b.shape, b.dtype))
        return out

    return jax.jit(make, out_shardings=adapter_shardings(cfg, spec, mesh))(jax.random.key(seed))


def is_adapter(path: tuple[str, ...]) -> bool:
    """A params path that ends in an adapter leaf."""
    return path[-1] in LORA_LEAVES


def combine(*trees: dict) -> dict:
    """The union of nested dicts with disjoint leaves (the frozen base and the trained leaves); no copy."""
    out: dict = {}
    for tree in trees:
        for k, v in tree.items():
            out[k] = combine(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def partition(tree: dict, pred) -> tuple[dict, dict]:
    """(leaves where `pred(path)`, the rest) as two nested dicts of the same layout; no copy."""
    yes, no = {}, {}

    def walk(node, path):
        for k, v in node.items():
            p = path + (k,)
            if isinstance(v, dict):
                walk(v, p)
            else:
                set_path(yes if pred(p) else no, p, v)

    walk(tree, ())
    return yes, no


def adapted_paths(adapters: dict) -> list[tuple[str, ...]]:
    """The kernel path of every module that `adapters` adapts."""
    paths: list = []

    def walk(node, path):
        if "lora_a" in node:
            paths.append(path + ("kernel",))
        else:
            for k, v in node.items():
                walk(v, path + (k,))

    walk(adapters, ())
    return paths


def merged_kernels(base: dict, adapters: dict, spec: LoraSpec, dtype) -> dict:
    """Only the adapted kernels, W + (lora_a @ lora_b) * scale in `dtype`, as a tree of the base's layout
    (pure; call under jit). The adapters say which modules they sit on (every stack of a mixed MoE).

    Args:
      base: the base model's params (kernels [L, in, out]); only the adapted kernels are read.
      adapters: lora_a [L, in, r] and lora_b [L, r, out] per adapted module.
    """
    out: dict = {}
    for path in adapted_paths(adapters):
        ad = get_path(adapters, path[:-1])
        delta = jnp.einsum("lir,lro->lio", ad["lora_a"].astype(jnp.float32), ad["lora_b"].astype(jnp.float32))
        set_path(out, path, (get_path(base, path).astype(jnp.float32) + delta * spec.scale).astype(dtype))
    return out


def cast_tree(tree: dict, dtype) -> dict:
    """`tree` in `dtype`; a leaf already in it is the same array (no copy outside jit)."""
    dt = jnp.dtype(dtype)
    return jax.tree.map(lambda x: x if x.dtype == dt else x.astype(dt), tree)


def merge_adapters(base: dict, adapters: dict, spec: LoraSpec, dtype) -> dict:
    """The base tree with W + (lora_a @ lora_b) * scale for every adapted kernel, in `dtype`.

    Outside jit, the leaves no adapter touches that are already in `dtype` are the base's own arrays: a
    sync of Qwen3-30B-A3B's attention adapters copies 1.8 GB of kernels, not the 57 GB of experts.
    """
    return combine(cast_tree(base, dtype), merged_kernels(base, adapters, spec, dtype))
