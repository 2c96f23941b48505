"""The dtype of K-FAC's statistics and inverses.

Statistics, inverses and preconditioning products are float32, or float64
when the params are (under ``jax_enable_x64``): bfloat16 and float16 lack
the range and precision that second moments and their inverses need.
"""

from typing import Any

import jax
import jax.numpy as jnp


def curvature_dtype(params: Any) -> jnp.dtype:
  """The dtype of statistics and inverses: float64 if any param leaf is
  float64 (under ``jax_enable_x64``), else float32 (also for float16 and
  bfloat16 params, whose range and precision do not suffice)."""
  wide = any(jnp.dtype(leaf.dtype) == jnp.float64 for leaf in jax.tree.leaves(params))
  return jnp.dtype(jnp.float64 if wide else jnp.float32)


def at_least_float32(x: jax.Array) -> jax.Array:
  """``x`` in float32, or unchanged if it is float64."""
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))
