"""Damped factor inverses, the π-adjusted split of the damping, and batching.

Every factor inverse of a refresh goes through `invert_all`: matrices of
similar size are stacked into buckets and inverted in one vmapped call per
bucket, optionally with the stack sharded over devices.
"""

import math
from typing import Any, Iterable, NamedTuple

import jax
import jax.numpy as jnp

INVERSE_METHODS = ("eigh", "cholesky")


def pi_adjusted_damping(
    mean_a: jax.Array, mean_g: jax.Array, damping: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Splits Tikhonov damping λ between two Kronecker factors.

  .. math::
    π = \\sqrt{\\frac{\\operatorname{tr}(A)/\\dim A}{\\operatorname{tr}(G)/\\dim G}},
    \\quad (A + π\\sqrt{λ} I) ⊗ (G + \\sqrt{λ}/π I)

  so that the damping added to each factor is proportional to its average
  eigenvalue (Martens & Grosse 2015, section 6.3). ``π = 1`` when either
  average is not positive (e.g. a layer whose statistics are still zero).

  Args:
    mean_a: ``tr(A) / dim A``, the input factor's average eigenvalue.
    mean_g: ``tr(G) / dim G``.
    damping: λ, a scalar.

  Returns:
    ``(π√λ, √λ/π)``: the damping for ``A`` and for ``G``.
  """
  usable = (mean_a > 0) & (mean_g > 0)
  pi = jnp.where(usable, jnp.sqrt(mean_a / jnp.where(usable, mean_g, 1.0)), 1.0)
  root = jnp.sqrt(damping)
  return pi * root, root / pi


def mean_eigenvalue(matrix: jax.Array) -> jax.Array:
  """``tr(M) / dim M``."""
  return jnp.trace(matrix) / matrix.shape[0]


def damped_inverse(matrix: jax.Array, damping: jax.Array, method: str) -> jax.Array:
  """``(M + damping·I)⁻¹`` for a symmetric positive semi-definite ``M``.

  Args:
    matrix: symmetric PSD matrix (float32).
    damping: positive scalar added to the diagonal.
    method: ``"eigh"`` (eigenvalues clipped at 0 before damping, robust to
      round-off negativity) or ``"cholesky"`` (faster, needs ``M + dI`` to be
      numerically positive definite).

  Returns:
    The inverse, same shape as ``matrix``. Non-finite if the factorisation
    failed; callers keep the previous inverse in that case.
  """
  if method == "eigh":
    eigenvalues, eigenvectors = jnp.linalg.eigh(matrix)
    scale = 1.0 / (jnp.maximum(eigenvalues, 0.0) + damping)
    return (eigenvectors * scale) @ eigenvectors.T
  if method == "cholesky":
    identity = jnp.eye(matrix.shape[0], dtype=matrix.dtype)
    factor = jax.scipy.linalg.cho_factor(matrix + damping * identity, lower=True)
    return jax.scipy.linalg.cho_solve(factor, identity)
  raise ValueError(f"inverse must be one of {INVERSE_METHODS}, got {method!r}")


class Damped(NamedTuple):
  """Symmetric PSD matrices ``(..., d, d)`` to invert with ``damping`` (...) added."""
  matrix: jax.Array
  damping: jax.Array


def bucket_sizes(sizes: Iterable[int], max_padding: float = 1.25) -> dict[int, int]:
  """Assigns each matrix size the (padded) size of the stack it is inverted in.

  Sizes are taken largest first; a size joins the smallest existing bucket
  whose inversion costs at most ``max_padding`` times its own (cost ∝ d³),
  else it opens a bucket of its own. Fewer, fuller stacks split more evenly
  over devices; the padding bounds the extra work.

  Args:
    sizes: matrix sizes ``d``.
    max_padding: the largest allowed ``(D / d)³`` for padding d up to D.

  Returns:
    ``{d: D}`` for every distinct size.
  """
  buckets, assigned = [], {}
  for size in sorted(set(sizes), reverse=True):
    fitting = [top for top in buckets if top**3 <= max_padding * size**3]
    if fitting:
      assigned[size] = min(fitting)
    else:
      buckets.append(size)
      assigned[size] = size
  return assigned


def invert_all(tree: Any, method: str, stack_sharding: Any = None,
               max_padding: float = 1.25) -> Any:
  """Replaces every `Damped` leaf of ``tree`` by its damped inverse, batched.

  Matrices are grouped by `bucket_sizes`, padded to their bucket's size with
  an identity block (which leaves the inverse's leading block unchanged:
  ``[[M, 0], [0, I]] + δI`` inverts blockwise), stacked and inverted in one
  vmapped call per bucket. With ``stack_sharding`` each stack is padded to a
  multiple of its ``num_shards`` and sharded along the stack axis, so every
  device inverts only its share, then gathered back to every device.

  Args:
    tree: any pytree; `Damped` leaves are inverted, other leaves kept.
    method: see `damped_inverse`.
    stack_sharding: ``None`` or an object with ``num_shards`` and
      ``split(stack)`` / ``gather(stack)`` (see `kfac_optax.sharding`).
    max_padding: see `bucket_sizes`.

  Returns:
    ``tree`` with each `Damped` leaf replaced by an array of its matrix's shape.
  """
  is_damped = lambda x: isinstance(x, Damped)
  leaves, treedef = jax.tree.flatten(tree, is_leaf=is_damped)
  requests = {i: leaf for i, leaf in enumerate(leaves) if is_damped(leaf)}
  buckets = bucket_sizes(leaf.matrix.shape[-1] for leaf in requests.values())
  results = list(leaves)
  for bucket in sorted(set(buckets.values())):
    members = [i for i, leaf in requests.items()
               if buckets[leaf.matrix.shape[-1]] == bucket]
    matrices, dampings = [], []
    for i in members:
      matrix = requests[i].matrix.astype(jnp.float32)
      size = matrix.shape[-1]
      matrix = matrix.reshape(-1, size, size)
      if size < bucket:
        padded = jnp.pad(matrix, ((0, 0), (0, bucket - size), (0, bucket - size)))
        matrix = padded + jnp.diag(jnp.arange(bucket) >= size).astype(jnp.float32)
      matrices.append(matrix)
      dampings.append(jnp.broadcast_to(requests[i].damping, requests[i].matrix.shape[:-2])
                      .reshape(-1).astype(jnp.float32))
    stack, damping = jnp.concatenate(matrices), jnp.concatenate(dampings)
    count = len(stack)
    if stack_sharding is not None:
      extra = -count % stack_sharding.num_shards
      stack = jnp.concatenate([stack, jnp.broadcast_to(jnp.eye(bucket), (extra, bucket, bucket))])
      damping = jnp.concatenate([damping, jnp.ones((extra,), jnp.float32)])
      stack, damping = stack_sharding.split(stack), stack_sharding.split(damping)
    inverted = jax.vmap(lambda m, d: damped_inverse(m, d, method))(stack, damping)
    if stack_sharding is not None:
      inverted = stack_sharding.gather(inverted)
    offset = 0
    for i in members:
      shape = requests[i].matrix.shape
      size, num = shape[-1], math.prod(shape[:-2])
      results[i] = inverted[offset:offset + num, :size, :size].reshape(shape)
      offset += num
  return treedef.unflatten(results)
