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


def curvature_dtype(params: Any) -> jnp.dtype:
  """The dtype of statistics and inverses: float64 if any param leaf is
  float64 (under ``jax_enable_x64``), else float32 (also for float16 and
  bfloat16 params, whose range and precision do not suffice)."""
  wide = any(jnp.dtype(leaf.dtype) == jnp.float64 for leaf in jax.tree.leaves(params))
  return jnp.dtype(jnp.float64 if wide else jnp.float32)


def at_least_float32(x: jax.Array) -> jax.Array:
  """``x`` in float32, or unchanged if it is float64."""
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


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
  """``tr(M) / dim M``; a vector stands for the diagonal matrix it holds."""
  if matrix.ndim == 1:
    return jnp.mean(matrix)
  return jnp.trace(matrix) / matrix.shape[0]


def damped_inverse(matrix: jax.Array, damping: jax.Array, method: str) -> jax.Array:
  """``(M + damping·I)⁻¹`` for a symmetric positive semi-definite ``M``.

  Args:
    matrix: symmetric PSD matrix (float32 or float64).
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
  """Symmetric PSD matrices ``(..., d, d)`` with ``damping`` (...) to add."""
  matrix: jax.Array
  damping: jax.Array


class DampedDiagonal(NamedTuple):
  """Diagonal matrices, stored as their non-negative diagonal, with ``damping``."""
  values: jax.Array
  damping: jax.Array


def damped_power(matrix: jax.Array, damping: jax.Array, power: float,
                 method: str) -> jax.Array:
  """``(M + damping·I)^power`` for a symmetric PSD ``M``.

  ``power=-1`` uses `damped_inverse` with ``method``; ``power=1`` adds the
  damping; any other power goes through ``eigh`` (eigenvalues clipped at 0).
  """
  if power == -1:
    return damped_inverse(matrix, damping, method)
  identity = jnp.eye(matrix.shape[-1], dtype=matrix.dtype)
  if power == 1:
    return matrix + damping * identity
  eigenvalues, eigenvectors = jnp.linalg.eigh(matrix)
  scale = (jnp.maximum(eigenvalues, 0.0) + damping) ** power
  return (eigenvectors * scale) @ eigenvectors.T


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
               max_padding: float = 1.25, power: float = -1) -> Any:
  """Replaces every `Damped` leaf of ``tree`` by its damped inverse, batched.

  (Or, with ``power``, by any power of it; `DampedDiagonal` leaves likewise,
  elementwise.)

  Matrices are grouped by `bucket_sizes`, padded to their bucket's size with
  an identity block (which leaves the inverse's leading block unchanged:
  ``[[M, 0], [0, I]] + δI`` inverts blockwise), stacked and inverted in one
  call per bucket (see `_over_stack`). With ``stack_sharding`` each stack is
  padded to a multiple of its ``num_shards`` and split along the stack axis,
  so every device inverts only its share, then gathered back to every device.

  Args:
    tree: any pytree; `Damped` and `DampedDiagonal` leaves are inverted,
      other leaves kept.
    method: see `damped_inverse`.
    stack_sharding: ``None`` or an object with ``num_shards`` and
      ``map(f, *stacks)``, which applies ``f`` to each device's share of the
      stacks and gathers the result (see `kfac_optax.sharding`).
    max_padding: see `bucket_sizes`.
    power: the exponent (see `damped_power`).

  Returns:
    ``tree`` with each `Damped` leaf replaced by an array of its matrix's shape.
  """
  is_damped = lambda x: isinstance(x, (Damped, DampedDiagonal))
  leaves, treedef = jax.tree.flatten(tree, is_leaf=is_damped)
  results = [_diagonal_power(leaf, power) if isinstance(leaf, DampedDiagonal)
             else leaf for leaf in leaves]
  requests = {i: leaf for i, leaf in enumerate(leaves) if isinstance(leaf, Damped)}
  buckets = bucket_sizes(leaf.matrix.shape[-1] for leaf in requests.values())
  for bucket in sorted(set(buckets.values())):
    members = [i for i, leaf in requests.items()
               if buckets[leaf.matrix.shape[-1]] == bucket]
    matrices, dampings = [], []
    for i in members:
      matrix = at_least_float32(requests[i].matrix)
      size = matrix.shape[-1]
      matrix = matrix.reshape(-1, size, size)
      if size < bucket:
        padded = jnp.pad(matrix, ((0, 0), (0, bucket - size), (0, bucket - size)))
        matrix = padded + jnp.diag(jnp.arange(bucket) >= size).astype(matrix.dtype)
      matrices.append(matrix)
      dampings.append(jnp.broadcast_to(requests[i].damping, requests[i].matrix.shape[:-2])
                      .reshape(-1).astype(matrix.dtype))
    stack, damping = jnp.concatenate(matrices), jnp.concatenate(dampings)
    count = len(stack)
    each = lambda m, d: damped_power(m, d, power, method)
    if stack_sharding is None:
      inverted = _over_stack(each, stack, damping)
    else:
      extra = -count % stack_sharding.num_shards
      stack = jnp.concatenate([stack, jnp.broadcast_to(
          jnp.eye(bucket, dtype=stack.dtype), (extra, bucket, bucket))])
      damping = jnp.concatenate([damping, jnp.ones((extra,), damping.dtype)])
      inverted = stack_sharding.map(
          lambda s, d, real: _over_stack(each, s, d, real), stack, damping,
          jnp.arange(count + extra) < count)
    offset = 0
    for i in members:
      shape = requests[i].matrix.shape
      size, num = shape[-1], math.prod(shape[:-2])
      results[i] = inverted[offset:offset + num, :size, :size].reshape(shape)
      offset += num
  return treedef.unflatten(results)


def _diagonal_power(diagonal: DampedDiagonal, power: float) -> jax.Array:
  # The damping's axes lead the values' (both gain the same vmapped axes).
  damping = jnp.reshape(diagonal.damping, jnp.shape(diagonal.damping)
                        + (1,) * (diagonal.values.ndim - jnp.ndim(diagonal.damping)))
  return (jnp.maximum(diagonal.values, 0.0) + damping) ** power


def _over_stack(each, stack: jax.Array, damping: jax.Array,
                real: jax.Array | None = None) -> jax.Array:
  """``each`` over a stack of matrices: vmapped, but one at a time on CPU.

  On CPU a batched eigh/Cholesky is one LAPACK custom call that fans the
  batch out over XLA's intra-op thread pool and blocks until it is done;
  two such calls running at once can each wait for the other's queued work
  and deadlock a small pool (seen with jaxlib 0.10 on 2 cores). `lax.map`
  keeps every CPU call to a single matrix, and skips the padding entries
  (``real`` false) that only make the stack divide over devices: simulated
  CPU devices share the same cores.
  """
  if jax.default_backend() != "cpu":
    return jax.vmap(each)(stack, damping)
  if real is None:
    return jax.lax.map(lambda args: each(*args), (stack, damping))
  return jax.lax.map(lambda args: jax.lax.cond(
      args[2], lambda: each(args[0], args[1]), lambda: args[0]), (stack, damping, real))
