"""The dtype of K-FAC's statistics and inverses, and their products' precision.

Statistics, inverses and preconditioning products are float32, or float64
when the params are (under ``jax_enable_x64``): bfloat16 and float16 lack
the range and precision that second moments and their inverses need.
"""

from typing import Any

import jax
import jax.numpy as jnp

# The matmul precision of the factors' Gram products (their sums of outer
# products): float32 on CPU, TF32 tensor-core products on GPUs, three
# bfloat16 passes on TPUs. TF32 rounds each input by at most 2⁻¹¹ (5e-4
# relative), as JAX's default does to the model's own float32 products on
# those GPUs. Full float32 (HIGHEST) kept them off the tensor cores: K-FAC's
# matmuls in a statistics step of the large transformer LM on an H200 took
# 4.7 ms of kernels, 2.2 ms in TF32 (benchmarks/RESULTS.md, "GPU (H200):
# summary"). TPUs' default, one bfloat16 pass (2⁻⁸ per input), would blur a
# factor's small eigenvalues.
STATISTICS_PRECISION = jax.lax.Precision.HIGH


def curvature_dtype(params: Any) -> jnp.dtype:
  """The dtype of statistics and inverses: float64 if any param leaf is
  float64 (under ``jax_enable_x64``), else float32 (also for float16 and
  bfloat16 params, whose range and precision do not suffice)."""
  wide = any(jnp.dtype(leaf.dtype) == jnp.float64 for leaf in jax.tree.leaves(params))
  return jnp.dtype(jnp.float64 if wide else jnp.float32)


def at_least_float32(x: jax.Array) -> jax.Array:
  """``x`` in float32, or unchanged if it is float64."""
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))
