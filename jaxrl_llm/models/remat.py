"""Remat policies of the decoder layer scan: what the forward pass keeps for the backward pass, by name.

The layer tags its activations with `checkpoint_name` (HF's module names): the outputs of q_proj, k_proj,
v_proj, o_proj, gate_proj and up_proj, and the attention's output ("attention"). A policy keeps a set of them
and recomputes the rest from the layer's input (which the scan keeps under every policy). Between "full"
(keep nothing) and "dots" (keep every matmul output) each step keeps more and recomputes less:

  policy            keeps (per token and layer)                       recomputes in the backward pass
  full              nothing                                           the whole layer
  attention         the attention's output (cuDNN: and its stats)     q/k/v, o_proj, gate/up (not the attention)
  attention_block   + the q/k/v and o_proj outputs                    gate/up: 2 of the layer's 7 matmuls, 58%
                                                                      of its matmul FLOPs at Qwen2.5-7B
  mlp_gate          + gate_proj's output                              up_proj alone
  dots              every matmul output                               no matmul
  offload_mlp       attention_block on the device, gate/up outputs    no matmul; the MLP's outputs go to the
                    in the host's pinned memory                       host and back (PCIe: measure it)
  none              everything (no remat)

At Qwen2.5-7B (bf16, D 3,584, F 18,944, kv 512) the kept values are 7 KB (full: the layer input), 14 KB,
31 KB, 69 KB and 107 KB a token and layer: at 15,360 tokens a device and 28 layers 3, 6, 13, 30 and 46 GB.
`model.remat = 'auto'` (trainer/memory/check.py) takes the first of `AUTO_LADDER` whose compiled update fits.

cuDNN's attention is a custom call whose forward outputs (the output and the softmax statistics its backward
reads) are saved by primitive rather than by name, by every policy but "full": keeping its output alone would
recompute the attention to get the statistics back.
"""

from __future__ import annotations

import jax

# Policies from the least kept to the most; 'auto' tries them from the most (the least recompute) down.
AUTO_LADDER = ("dots", "mlp_gate", "attention_block", "attention", "full")
POLICIES = ("none", "full", "attention", "attention_block", "mlp_gate", "dots", "offload_mlp")

_ATTENTION_BLOCK = ("q_proj", "k_proj", "v_proj", "attention", "o_proj")
_NAMES = {"attention": ("attention",), "attention_block": _ATTENTION_BLOCK,
          "mlp_gate": _ATTENTION_BLOCK + ("gate_proj",)}


def _cudnn_attention_forward(prim) -> bool:
    return prim.name.startswith("dot_product_attention_fwd")


def _dots_and_attention_saveable(prim, *args, **params) -> bool:
    """Matmul outputs without batch dims (`dots_with_no_batch_dims_saveable`) and the outputs of cuDNN's
    attention forward (its output and softmax statistics): the backward pass then runs no forward
    attention again. XLA's attention is made of batched dots, which this saves as before: nothing."""
    return (jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params)
            or _cudnn_attention_forward(prim))


def _with_cudnn_attention(base):
    def policy(prim, *args, **params):
        return True if _cudnn_attention_forward(prim) else base(prim, *args, **params)

    return policy


def remat_policy(name: str):
    """The `jax.checkpoint` policy of `name` (one of POLICIES but "none")."""
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    if name == "dots":
        return _dots_and_attention_saveable
    if name == "offload_mlp":
        return _with_cudnn_attention(jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(_ATTENTION_BLOCK), names_which_can_be_offloaded=["gate_proj", "up_proj"],
            offload_src="device", offload_dst="pinned_host"))
    if name in _NAMES:
        return _with_cudnn_attention(jax.checkpoint_policies.save_only_these_names(*_NAMES[name]))
    raise ValueError(f"remat={name!r}; expected one of {POLICIES}")


def saved_values_per_layer(cfg, name: str) -> int:
    """Values a token keeps on the device in one attention layer for the backward pass under `name` (the layer
    input included; the softmax statistics, fp32, as two values a head). "none" keeps at least what "dots"
    keeps. (A Qwen3.5's Gated DeltaNet layers carry no tags: trainer/memory/estimate.py counts them.)"""
    d, f, q, kv = cfg.hidden_size, cfg.active_intermediate_size, cfg.q_dim, cfg.kv_dim
    stats = 2 * cfg.num_attention_heads
    q_out = q * (2 if cfg.is_hybrid else 1)  # Qwen3.5's q_proj makes the output gate too
    attention = d + q + stats
    block = attention + q_out + 2 * kv + d
    dots = q_out + 2 * kv + d + 2 * f + d + q + stats  # q/k/v, o_proj, gate/up, down, the attention (no input)
    return {"full": d, "attention": attention, "attention_block": block, "offload_mlp": block,
            "mlp_gate": block + f}.get(name, dots)
