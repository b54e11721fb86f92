"""Masked reductions with veRL's semantics (`verl.utils.torch_functional`).

Masks are 0/1 (bool, int or float) and broadcast against the values. Masked-out entries are
dropped with `jnp.where`, so a NaN or inf in a padded slot never leaks into a sum.

Deviation from veRL, forced by `jit`: veRL's `masked_var` raises when the mask selects 0 or 1
elements (the Bessel factor n / (n - 1) is undefined). Under `jit` we cannot raise on a traced
count, so we skip the Bessel factor in that case: the variance of 0 or 1 elements is then 0, and
`masked_whiten` returns 0 on the selected element instead of NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# veRL adds this to the count in `masked_mean`, so an empty mask gives 0 rather than NaN.
_MEAN_EPS = 1e-8
# veRL's `masked_whiten`: rsqrt(var + 1e-8).
_WHITEN_EPS = 1e-8


def masked_sum(values: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """Sum of `values` where `mask` is non-zero.

    Args:
      values: [...] float.
      mask: [...] 0/1, broadcastable to `values`.
      axis: axis or axes to reduce; None reduces all.
    """
    mask = jnp.broadcast_to(mask, jnp.shape(values))
    return jnp.sum(jnp.where(mask != 0, values, 0), axis=axis)


def masked_mean(values: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """Mean of `values` over the selected elements; 0 where nothing is selected (veRL: +1e-8)."""
    mask = jnp.broadcast_to(mask, jnp.shape(values))
    count = jnp.sum(mask.astype(jnp.result_type(values, jnp.float32)), axis=axis)
    return masked_sum(values, mask, axis) / (count + _MEAN_EPS)


def masked_var(values: jax.Array, mask: jax.Array, unbiased: bool = True) -> jax.Array:
    """Variance of the selected elements (over all axes), Bessel-corrected by default like veRL.

    Returns a scalar. With fewer than two selected elements the Bessel factor is skipped (veRL
    raises instead; see the module docstring).
    """
    mask = jnp.broadcast_to(mask, jnp.shape(values))
    mean = masked_mean(values, mask)
    var = masked_mean(jnp.square(values - mean), mask)
    if unbiased:
        n = jnp.sum(mask.astype(var.dtype))
        var = var * jnp.where(n > 1, n / jnp.maximum(n - 1, 1), 1.0)
    return var


def masked_whiten(values: jax.Array, mask: jax.Array, shift_mean: bool = True) -> jax.Array:
    """(values - mean) * rsqrt(var + 1e-8) with the masked mean and unbiased variance.

    Every element is transformed, masked or not (as in veRL); callers multiply by the mask where
    they need zeros. With `shift_mean=False` the mean is added back (scale only).

    Args:
      values: [...] float.
      mask: [...] 0/1, broadcastable to `values`.
    Returns:
      [...] whitened values, same shape and dtype as `values`.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * jax.lax.rsqrt(var + _WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened.astype(jnp.result_type(values))
