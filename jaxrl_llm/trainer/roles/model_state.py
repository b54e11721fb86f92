"""A trained model's state (the actor's or the critic's): params, optimizer state, and which leaves train.

Full fine-tuning trains every leaf, in the fp32 master copy (`model.param_dtype`). With LoRA
(`model.lora_rank > 0`) only the adapters train, and a critic's value head, which starts fresh: the
optimizer state exists for them alone. The rest is a frozen tree in the compute dtype, with no master
copy; the actor's reference policy is that tree run without the adapters. Jitted steps take the trained
and the frozen trees apart (gradients reach only the first); `params()` joins them without a copy.

Built from `abstract_params` (ShapeDtypeStructs with shardings), a state holds the same trees as shapes
alone and allocates nothing: the memory check (`trainer/memory/check.py`) compiles the step's programs
against it before any weights are loaded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import distributed, sharding
from jaxrl_llm.models import DecoderConfig, graphdef_and_abstract_params, param_shardings, quant
from jaxrl_llm.models.hf_table import get_path, set_path
from jaxrl_llm.models.lora import (
    LoraSpec,
    adapted_paths,
    adapter_shapes,
    adapter_shardings,
    combine,
    init_adapters,
    is_adapter,
    merged_kernels,
    partition,
)


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


def init_train_state(params, tx, param_sh, mesh) -> dict:
    """{"params", "opt_state", "step", "skipped"}: what a checkpoint holds of a trained model (its shapes
    when `params` are ShapeDtypeStructs)."""
    init = jax.jit(tx.init, out_shardings=opt_state_shardings(tx, params, param_sh, mesh))
    if is_abstract(params):
        scalar = lambda: jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding.replicated(mesh))
        return {"params": params, "opt_state": jax.eval_shape(init, params), "step": scalar(), "skipped": scalar()}
    scalar = lambda: distributed.put(np.zeros((), np.int32), sharding.replicated(mesh))
    return {"params": params, "opt_state": init(params), "step": scalar(), "skipped": scalar()}


def is_abstract(tree) -> bool:
    """Whether `tree` holds shapes (ShapeDtypeStructs) rather than arrays."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def abstract_params(cfg: DecoderConfig, mesh, *, critic: bool = False) -> dict:
    """The base params as ShapeDtypeStructs in their shardings: a `ModelState` built from them allocates
    nothing (the memory check's state)."""
    _, shapes = graphdef_and_abstract_params(cfg, critic=critic)
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes,
                        param_shardings(cfg, mesh, critic=critic))


def _astype(x, dt):
    """`x` in `dt`: the same array (or shape) when it already is, else a cast (or the cast's shape)."""
    if x.dtype == dt:
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, dt, sharding=x.sharding)
    return x.astype(dt)


class ModelState:
    """The actor's (or, with `critic`, the critic's) trained state on `mesh`.

    Args:
      cfg: the base model's config (no adapters).
      params: the base params (with a critic's value head).
      tx: the optimizer; it sees only the trained leaves.
      lora: the adapters' spec, or None for full fine-tuning.
      adapters: starting adapters (from `model.lora_adapter_path`); None: fresh ones from `seed`.
      base_quantization: LoRA only: 'int8' or 'fp8' holds the frozen base's layer kernels in 8 bits
        (`models/quant.py`); the reference is then the quantized base.
    """

    def __init__(self, cfg: DecoderConfig, mesh, params: dict, tx, *, lora: LoraSpec | None = None,
                 adapters: dict | None = None, critic: bool = False, seed: int = 0, base_quantization: str = "none"):
        self.cfg, self.mesh, self.tx, self.lora, self.critic = cfg, mesh, tx, lora, critic
        self.abstract = is_abstract(params)
        run = jax.eval_shape if self.abstract else lambda fn, *args: fn(*args)  # shapes alone, or the arrays
        quant.check_setting(base_quantization, lora.rank if lora else 0)
        self.quantization = base_quantization
        self.base_graphdef, _ = graphdef_and_abstract_params(quant.apply(cfg, base_quantization), critic=critic)
        self.base_sh = param_shardings(cfg, mesh, critic=critic)
        if lora is None:
            self.graphdef, self.frozen = self.base_graphdef, {}
            trained, self.param_sh = params, self.base_sh
        else:
            self.graphdef, _ = graphdef_and_abstract_params(quant.apply(lora.apply(cfg), base_quantization),
                                                            critic=critic)
            head = lambda p: critic and p[0] == "score"  # a critic's value head is new: it trains in full
            head_params, body = partition(params, head)
            compute, master = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
            self.frozen = jax.tree.map(lambda x: _astype(x, compute), body)
            if base_quantization != "none":  # quantized in place of the compute-dtype kernels
                frozen_sh = quant.frozen_shardings(cfg, partition(self.base_sh, head)[1], mesh)
                self.frozen = run(jax.jit(lambda b: quant.quantize_base(b, base_quantization),
                                          out_shardings=frozen_sh), self.frozen)
            if adapters is None and self.abstract:
                adapters = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                        adapter_shapes(cfg, lora), adapter_shardings(cfg, lora, mesh))
            elif adapters is None:
                adapters = init_adapters(cfg, lora, mesh=mesh, seed=seed)
            head_params = jax.tree.map(lambda x: _astype(x, master), head_params)
            trained = combine(adapters, head_params)
            self.param_sh = combine(adapter_shardings(cfg, lora, mesh), partition(self.base_sh, head)[0])
        self.state = init_train_state(trained, tx, self.param_sh, mesh)
        self.state_sh = jax.tree.map(lambda x: x.sharding, self.state)
        self._merge = None

    def params(self, trained: dict | None = None) -> dict:
        """The whole params tree the model (`self.graphdef`) runs: the frozen leaves and the trained ones."""
        return combine(self.frozen, self.state["params"] if trained is None else trained)

    def adapters(self) -> dict:
        """The trained adapter leaves (LoRA only)."""
        return partition(self.state["params"], is_adapter)[0]

    def reference(self, offload: bool = False) -> dict:
        """The reference policy's params, which the base's program runs (`base_graphdef`). LoRA: the frozen
        base itself, no second copy. Else a copy of the params in the compute dtype, on the host with
        `offload` (each process keeps its own devices' shards). Shapes alone in an abstract state (where an
        offloaded one is what a reference pass brings back to the devices)."""
        if self.lora is not None:
            return self.frozen
        dt = jnp.dtype(self.cfg.dtype)
        cast = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dt), p), out_shardings=self.base_sh)
        if self.abstract:
            return jax.eval_shape(cast, self.params())
        ref = cast(self.params())
        return jax.tree.map(distributed.to_host_shards, ref) if offload else ref

    def merged(self, dtype: str | None = None) -> dict:
        """The base model's params tree with the adapters merged in (W + A @ B * alpha / r), in `dtype`
        (default: the compute dtype), in the base's shardings: what a rollout engine or an HF export runs.
        Full fine-tuning: the params, cast when `dtype` is given. An abstract state gives the tree's shapes.

        LoRA: only the adapted kernels are new arrays. Every other leaf already in `dtype` is the frozen
        tree's own array (no copy), so a sync of Qwen3-30B-A3B's attention adapters adds 1.8 GB to the
        61 GB base, not a second 61 GB (benchmarks/NOTES.md item 32)."""
        program = self.merge_program(dtype)
        if program is None:
            return self.state["params"]
        run = jax.eval_shape if self.abstract else lambda fn, *args: fn(*args)
        out = run(*program)
        if self.lora is None or self.quantization != "none":
            return out
        dt = self._merge[0]
        # The untouched leaves: as they are when already in `dt` (the engine's sync), else cast in one jit.
        rest = combine(self.frozen, partition(self.state["params"], is_adapter)[1])
        keep, recast = partition(rest, lambda p: get_path(rest, p).dtype == dt)
        recast = run(self._merge[2], recast) if jax.tree.leaves(recast) else {}
        return combine(keep, recast, out)

    def merge_program(self, dtype: str | None = None) -> tuple | None:
        """(jitted, *inputs): the program `merged(dtype)` runs, with its inputs (this state's arrays, or shapes
        in an abstract state); None where it runs none (full fine-tuning in the param dtype). LoRA on a
        compute-dtype base: the adapted kernels alone; an 8-bit base: every kernel, dequantized."""
        if self.lora is None and dtype is None:
            return None
        dt = jnp.dtype(dtype or self.cfg.dtype)
        spec = self.lora
        if self._merge is None or self._merge[0] != dt:
            def cast(tree):
                return jax.tree.map(lambda x: x.astype(dt), tree)

            def merge_dequantized(frozen, trained):  # every kernel is new: dequantized, merged where adapted
                adapters, head = partition(trained, is_adapter)
                return quant.merged_base(combine(frozen, head), adapters, spec.scale, dt)

            def merge(kernels, adapters):
                return merged_kernels(kernels, adapters, spec, dt)

            if spec is None:
                self._merge = (dt, jax.jit(cast, out_shardings=self.base_sh), None)
            elif self.quantization != "none":
                self._merge = (dt, jax.jit(merge_dequantized, out_shardings=self.base_sh), None)
            else:
                kernel_sh: dict = {}
                for path in adapted_paths(self.adapters()):
                    set_path(kernel_sh, path, get_path(self.base_sh, path))
                self._merge = (dt, jax.jit(merge, out_shardings=kernel_sh), jax.jit(cast))
        if spec is None:
            return self._merge[1], self.state["params"]
        if self.quantization != "none":
            return self._merge[1], self.frozen, self.state["params"]
        adapters, kernels = self.adapters(), {}
        for path in adapted_paths(adapters):
            set_path(kernels, path, get_path(self.frozen, path))
        return self._merge[1], kernels, adapters

    def merged_base(self) -> dict:
        """The frozen base alone in the compute dtype and the base's shardings (dequantized when 8-bit)."""
        dt = jnp.dtype(self.cfg.dtype)
        head = lambda p: self.critic and p[0] == "score"
        sh = partition(self.base_sh, head)[1]
        return jax.jit(lambda f: quant.dequantize_base(f, dt), out_shardings=sh)(self.frozen)

    def engine_params(self) -> dict:
        """What a JAX engine's `update_weights` takes: the merged tree (`merged()`), or with an 8-bit base the
        quantized tree and the adapters (lora_b pre-scaled by alpha / r), which the engine dequantizes and
        merges one layer at a time (`quant.plain_layer`): no second whole copy of the base in bf16."""
        if self.quantization == "none":
            return self.merged()
        if self.abstract:  # the pre-scaled adapters keep their shapes
            return combine(self.frozen, self.state["params"])
        scale = self.lora.scale
        trained = jax.tree_util.tree_map_with_path(
            lambda p, x: x * jnp.asarray(scale, x.dtype) if p[-1].key == "lora_b" else x, self.state["params"])
        return combine(self.frozen, trained)

    def num_trained(self) -> int:
        return sum(int(x.size) for x in jax.tree.leaves(self.state["params"]))
