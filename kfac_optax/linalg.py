"""Damped factor inverses, the π-adjusted split of the damping, and batching.

Every factor inverse of a refresh goes through `invert_all`: matrices of
similar size are stacked into buckets and inverted in one vmapped call per
bucket, optionally with the stack sharded over devices.
"""

import dataclasses
import functools
import math
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kfac_optax import cholesky
from kfac_optax import low_rank

INVERSE_METHODS = ("auto", "eigh", "cholesky", "newton_schulz")
NEWTON_SCHULZ_MAX_ITERATIONS = 40
# The largest residual ‖I - (M + δI) X‖_F accepted from Newton-Schulz (else
# Cholesky) and from Cholesky (else eigh).
NEWTON_SCHULZ_ACCEPTED = 0.1


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
  # Not jnp.trace: it selects the diagonal by masking the whole matrix, a
  # pass over its d² entries at every refresh.
  return jnp.sum(jnp.diagonal(matrix)) / matrix.shape[0]


def resolve_inverse(method: str) -> str:
  """The inverse method ``"auto"`` stands for on the default backend.

  ``"cholesky"`` on CPU (`cholesky.cholesky_inverse`): in the README
  example's training step at the recommended periods (inverses every 50
  steps) it was the fastest, on a quiet machine and with one extra busy
  process (mean step 2.12× and 2.82× Adam's; eigh 3.35× and 4.50×,
  Newton-Schulz 3.61× and 4.45×), and one inverse of a 1024² factor took
  15 ms (23 ms busy) against Newton-Schulz's 38 ms (69 ms) from a nearby
  start (benchmarks/RESULTS.md, "The inverse refresh on a busy CPU").
  ``"eigh"`` elsewhere (not measured against the others).
  """
  if method != "auto":
    return method
  return "cholesky" if jax.default_backend() == "cpu" else "eigh"


def newton_schulz_tolerance(dtype: Any) -> float:
  """The residual Newton-Schulz stops at: ``8 eps`` of ``dtype`` (9.5e-7
  for float32), round-off. So the result is as accurate as the dtype
  allows (the stall test of `newton_schulz_inverse` ends it earlier for
  ill-conditioned factors) and does not depend on the start, which keeps
  runs that differ only in their previous inverses alike."""
  return 8 * float(jnp.finfo(dtype).eps)


def damped_inverse(matrix: jax.Array, damping: jax.Array, method: str) -> jax.Array:
  """``(M + damping·I)⁻¹`` for a symmetric positive semi-definite ``M``.

  Args:
    matrix: symmetric PSD matrix (float32 or float64).
    damping: positive scalar added to the diagonal.
    method: ``"eigh"`` (eigenvalues clipped at 0 before damping, robust to
      round-off negativity), ``"cholesky"`` (faster, needs ``M + dI`` to be
      numerically positive definite; `invert_all` falls back to eigh where
      it is not; `cholesky.cholesky_inverse`, which on CPU keeps OpenBLAS's
      threads from spinning after the refresh), ``"newton_schulz"`` (matrix
      products only, `newton_schulz_inverse` from the scaled identity;
      Cholesky where its residual stays above ``NEWTON_SCHULZ_ACCEPTED``)
      or ``"auto"`` (`resolve_inverse`).

  Returns:
    The inverse, same shape as ``matrix``. Non-finite if the factorisation
    failed; callers keep the previous inverse in that case.
  """
  method = resolve_inverse(method)
  if method == "eigh":
    eigenvalues, eigenvectors = jnp.linalg.eigh(matrix)
    scale = 1.0 / (jnp.maximum(eigenvalues, 0.0) + damping)
    return (eigenvectors * scale) @ eigenvectors.T
  if method == "cholesky":
    return cholesky.cholesky_inverse(
        matrix + damping * jnp.eye(matrix.shape[0], dtype=matrix.dtype))
  if method == "newton_schulz":
    inverse, residual, _ = newton_schulz_inverse(matrix, damping)
    return jax.lax.cond(residual <= NEWTON_SCHULZ_ACCEPTED, lambda: inverse,
                        lambda: damped_inverse(matrix, damping, "cholesky"))
  raise ValueError(f"inverse must be one of {INVERSE_METHODS}, got {method!r}")


class NewtonSchulz(NamedTuple):
  """`newton_schulz_inverse`'s result."""
  inverse: jax.Array
  residual: jax.Array    # ‖I - (M + δI) X‖_F of the returned X
  iterations: jax.Array  # iterations run (the rejected last one included)


def newton_schulz_inverse(
    matrix: jax.Array, damping: jax.Array, previous: jax.Array | None = None, *,
    tolerance: float | None = None,
    max_iterations: int = NEWTON_SCHULZ_MAX_ITERATIONS) -> NewtonSchulz:
  """``(M + δI)⁻¹`` by Newton-Schulz iterations: matrix products only.

  With ``D = M + δI`` and the residual ``R_k = I - D X_k``,

  .. math::
    X_{k+1} = X_k (2I - D X_k) = X_k + X_k R_k, \\quad R_{k+1} = R_k^2,

  so the residual's eigenvalues square at every step: quadratic convergence
  once ``‖R‖ < 1``. The error of the result is ``D⁻¹ - X = D⁻¹ R`` (relative
  error ``‖R‖₂ ≤ ‖R‖_F`` in every direction). No LAPACK call: the products
  run on XLA's own threads (on CPU, LAPACK's OpenBLAS threads contend with
  XLA's on a busy machine).

  Start: ``previous`` (the last refresh's inverse: factors change little
  between refreshes, so a few iterations suffice) when its residual has
  Frobenius norm below 1, which guarantees convergence (the spectral
  radius is at most that norm); else ``I / ‖D‖_∞``: the max-row-sum norm
  bounds D's eigenvalues, so the residual's eigenvalues ``1 - λ_i/‖D‖_∞``
  lie in ``[0, 1)`` and shrink monotonically (about ``log₂ κ(D)`` more
  iterations). Iterates until ``‖R‖_F ≤ tolerance``, or until an iteration
  stops reducing it or, below 1e-2, fails to halve it (round-off,
  ``≈ κ(D) ε``, has taken over), keeping the best iterate; at most
  ``max_iterations``.

  Args:
    matrix: a symmetric PSD ``M`` (d, d).
    damping: δ > 0.
    previous: an approximate inverse to start from, or None.
    tolerance: the residual to stop at (default:
      `newton_schulz_tolerance` of the matrix's dtype).
    max_iterations: the most iterations.

  Returns:
    `NewtonSchulz`: the symmetrised inverse, its residual norm (callers fall
    back to another method when it is large; nan for non-finite input) and
    the iterations run.

  References:
    Schulz, "Iterative Berechnung der reziproken Matrix", ZAMM 1933;
    Pan & Schreiber, "An improved Newton iteration for the generalized
    inverse of a matrix", SIAM J. Sci. Stat. Comput. 1991 (the scaled
    identity start).
  """
  if tolerance is None:
    tolerance = newton_schulz_tolerance(matrix.dtype)
  identity = jnp.eye(matrix.shape[-1], dtype=matrix.dtype)
  damped = matrix + damping * identity
  residual_of = lambda x: identity - damped @ x
  norm = lambda r: jnp.sqrt(jnp.sum(r * r))
  scale = 1 / jnp.max(jnp.sum(jnp.abs(damped), axis=1))
  start, r0 = scale * identity, identity - scale * damped
  if previous is not None:
    warm = previous.astype(matrix.dtype)
    warm_r = residual_of(warm)
    use = norm(warm_r) < 1
    start, r0 = jnp.where(use, warm, start), jnp.where(use, warm_r, r0)

  def running(carry):
    k, _, _, size, done = carry
    return (k < max_iterations) & ~done & (size > tolerance)

  def iterate(carry):
    k, x, r, size, _ = carry
    new_x = x + x @ r
    new_r = residual_of(new_x)
    new_size = norm(new_r)
    better = new_size < size
    # Below 1e-2 the residual squares at every step; a smaller gain means
    # round-off has taken over.
    stalled = (size < 1e-2) & (new_size > size / 2)
    pick = lambda new, old: jnp.where(better, new, old)
    return (k + 1, pick(new_x, x), pick(new_r, r), pick(new_size, size),
            ~better | stalled)

  size = norm(r0)  # counters derived from it: varying like it under shard_map
  k, x, _, size, _ = jax.lax.while_loop(
      running, iterate, (jnp.zeros_like(size, jnp.int32), start, r0, size,
                         jnp.zeros_like(size, bool)))
  return NewtonSchulz((x + x.T) / 2, size, k)


class Damped(NamedTuple):
  """Symmetric PSD matrices ``(..., d, d)`` with ``damping`` (...) to add."""
  matrix: jax.Array
  damping: jax.Array


class DampedDiagonal(NamedTuple):
  """Diagonal matrices, stored as their non-negative diagonal, with ``damping``."""
  values: jax.Array
  damping: jax.Array


class Whitened(NamedTuple):
  """Series option 1's factor: the whitened, symmetrised lag-1 moment.

  ``Ψ̂ = C̃0^{-1/2} ((C1 + C1ᵀ)/2) C̃0^{-1/2} = U diag(ψ) Uᵀ`` with
  ``C̃0 = C0 + d I``; kept as ``l = C̃0^{-1/2} U`` and ``psi = |ψ|``.
  """
  l: jax.Array
  psi: jax.Array


class Transition(NamedTuple):
  """Series option 2's factor: a linear transition ``x_{t+1} ≈ Pᵀ x_t``.

  ``p = C1ᵀ C̃0⁻¹``; with the SVD ``C̃0^{-1/2} C1 C̃0^{-1/2} = U diag(s) Eᵀ``,
  ``k = C̃0^{-1/2} E`` and ``mu = min(s², 1)``.
  """
  p: jax.Array
  k: jax.Array
  mu: jax.Array


def whitened(c0: jax.Array, c1: jax.Array, damping: jax.Array) -> Whitened:
  """`Whitened` of one (C0, C1) pair; ``|ψ|`` as the original takes it."""
  root = damped_power(c0, damping, -0.5, "eigh")
  psi, u = jnp.linalg.eigh(root @ ((c1 + c1.T) / 2) @ root)
  return Whitened(root @ u, jnp.abs(psi))


def transition(c0: jax.Array, c1: jax.Array, damping: jax.Array) -> Transition:
  """`Transition` of one (C0, C1) pair."""
  root = damped_power(c0, damping, -0.5, "eigh")
  _, s, e_t = jnp.linalg.svd(root @ c1 @ root)
  return Transition(c1.T @ root @ root, root @ e_t.T, jnp.minimum(s * s, 1.0))


SERIES_DECOMPOSITIONS: dict[str, Callable[..., Any]] = {
    "series_option1": whitened, "series_option2": transition}


@dataclasses.dataclass(frozen=True)
class DampedLag:
  """Moments ``C0`` and lag-1 ``C1`` ``(..., d, d)`` with ``damping`` (...),
  to decompose as ``option`` (a key of `SERIES_DECOMPOSITIONS`)."""
  matrix: jax.Array
  lag: jax.Array
  damping: jax.Array
  option: str


jax.tree_util.register_dataclass(DampedLag, data_fields=["matrix", "lag", "damping"],
                                 meta_fields=["option"])


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
               max_padding: float = 1.25, power: float = -1,
               previous: Any = None, rank: int | None = None) -> Any:
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
    previous: None, or a tree with the structure of the result (the
      inverses in use): ``method="newton_schulz"`` starts each inverse from
      its previous one (see `newton_schulz_inverse`), and so does every
      low-rank inverse; other methods ignore it.
    rank: None, or a `Damped` leaf of more than ``rank`` rows gets a
      `low_rank.LowRankInverse` of that rank (``power=-1`` only), stacked by
      exact size.

  `DampedLag` leaves (the series blocks of recurrent layers) are replaced by
  their decomposition (`Whitened` or `Transition`), stacked by exact size
  and distributed the same way; they support ``power=-1`` only.

  Returns:
    ``tree`` with each `Damped` leaf replaced by an array of its matrix's
    shape (or a `low_rank.LowRankInverse`).
  """
  if rank is not None and power != -1:
    raise ValueError(f"rank={rank} applies to inverses (power=-1), got power={power}")
  method = resolve_inverse(method)
  leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_damped)
  results = [_diagonal_power(leaf, power) if isinstance(leaf, DampedDiagonal)
             else leaf for leaf in leaves]
  _decompose_lags(leaves, results, stack_sharding, power)
  starts = treedef.flatten_up_to(previous) if previous is not None else None
  _low_rank_inverses(leaves, results, starts, rank, stack_sharding)
  requests = {i: leaf for i, leaf in enumerate(leaves) if isinstance(leaf, Damped)
              and not _kept_at_rank(leaf, rank)}
  warm = method == "newton_schulz" and power == -1 and previous is not None
  buckets = bucket_sizes(leaf.matrix.shape[-1] for leaf in requests.values())
  for bucket in sorted(set(buckets.values())):
    members = [i for i, leaf in requests.items()
               if buckets[leaf.matrix.shape[-1]] == bucket]
    matrices, dampings, previous_stack = [], [], []
    for i in members:
      dtype = at_least_float32(requests[i].matrix).dtype
      damping = (jnp.broadcast_to(requests[i].damping, requests[i].matrix.shape[:-2])
                 .reshape(-1).astype(dtype))
      dampings.append(damping)
      # The padding block of M is I, of its damped inverse I / (1 + δ).
      matrices.append(_padded(requests[i].matrix, bucket, jnp.ones_like(damping)))
      if warm:
        previous_stack.append(_padded(starts[i], bucket, 1 / (1 + damping)))
    stack, damping = jnp.concatenate(matrices), jnp.concatenate(dampings)
    if method == "newton_schulz" and power == -1:
      inverted = _newton_schulz_stack(
          stack, damping, jnp.concatenate(previous_stack) if warm else None,
          stack_sharding)
    elif method == "cholesky" and power == -1:
      inverted = _cholesky_stack(stack, damping, stack_sharding)
    else:
      each = lambda m, d: damped_power(m, d, power, method)
      inverted = _distributed(each, (stack, damping), stack_sharding)
    offset = 0
    for i in members:
      shape = requests[i].matrix.shape
      size, num = shape[-1], math.prod(shape[:-2])
      results[i] = inverted[offset:offset + num, :size, :size].reshape(shape)
      offset += num
  return treedef.unflatten(results)


def _is_damped(x: Any) -> bool:
  return isinstance(x, (Damped, DampedDiagonal, DampedLag))


def _kept_at_rank(leaf: Any, rank: int | None) -> bool:
  """Whether ``leaf`` (of a tree for `invert_all`) gets a low-rank inverse
  at ``rank``: a `Damped` of more than ``rank`` rows (None: none does)."""
  return isinstance(leaf, Damped) and low_rank.applies(leaf.matrix.shape[-1], rank)


def low_rank_identities(tree: Any, inverses: Any, rank: int | None) -> Any:
  """The identity ``inverses`` of ``tree``'s leaves (dense, in `invert_all`'s
  result structure), those that `invert_all` keeps at ``rank`` as
  `low_rank.identity`, so that the state's structure never changes."""
  leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_damped)
  current = treedef.flatten_up_to(inverses)
  return treedef.unflatten([
      low_rank.identity(inverse.shape, rank, inverse.dtype)
      if _kept_at_rank(leaf, rank) else inverse
      for leaf, inverse in zip(leaves, current)])


def _low_rank_inverses(leaves: list, results: list, starts: list | None,
                       rank: int | None, stack_sharding: Any) -> None:
  """Puts the `low_rank.LowRankInverse` of every `Damped` leaf kept at
  ``rank`` into ``results``, stacked by exact size and distributed like the
  others; each starts from its basis in ``starts`` (the inverses in use)."""
  groups: dict[int, list[int]] = {}
  for i, leaf in enumerate(leaves):
    if _kept_at_rank(leaf, rank):
      groups.setdefault(leaf.matrix.shape[-1], []).append(i)
  for members in groups.values():
    def basis(i):
      if starts is not None and isinstance(starts[i], low_rank.LowRankInverse):
        return starts[i].basis
      return jnp.zeros((*leaves[i].matrix.shape[:-1], rank))
    stacks = (_stacked(leaves, members, lambda i: leaves[i].matrix),
              _damping_stack(leaves, members), _stacked(leaves, members, basis))
    _unstack(results, leaves, members,
             _distributed(_low_rank_stack, stacks, stack_sharding, batched=True))


def _low_rank_stack(matrices: jax.Array, dampings: jax.Array,
                    bases: jax.Array) -> low_rank.LowRankInverse:
  """`low_rank.damped_inverse` of a stack: its products and Gram-Schmidt
  batched over the stack (one loop for all, none of them LAPACK), the
  small eigh one matrix at a time on CPU (`_over_stack`)."""
  return low_rank.damped_inverse(
      matrices, dampings, bases, eigh=lambda m: _over_stack(jnp.linalg.eigh, m))


def _padded(matrices: jax.Array, size: int, fill: jax.Array) -> jax.Array:
  """``(..., d, d)`` matrices as a ``(n, size, size)`` stack in at least
  float32, each padded with ``fill`` (n,) times the identity."""
  matrices = at_least_float32(matrices)
  d = matrices.shape[-1]
  matrices = matrices.reshape(-1, d, d)
  if d == size:
    return matrices
  padded = jnp.pad(matrices, ((0, 0), (0, size - d), (0, size - d)))
  return padded + fill[:, None, None] * jnp.diag(jnp.arange(size) >= d).astype(
      matrices.dtype)


def _newton_schulz_stack(stack: jax.Array, damping: jax.Array,
                         previous: jax.Array | None, stack_sharding: Any) -> jax.Array:
  """`newton_schulz_inverse` of every matrix of a stack (warm-started from
  ``previous`` if given), `_cholesky_stack` for those whose residual stays
  above ``NEWTON_SCHULZ_ACCEPTED``: computed only when some matrix needs it."""
  if previous is None:
    each = lambda m, d: newton_schulz_inverse(m, d)[:2]
    inverses, residuals = _distributed(each, (stack, damping), stack_sharding)
  else:
    each = lambda m, d, p: newton_schulz_inverse(m, d, p)[:2]
    inverses, residuals = _distributed(each, (stack, damping, previous),
                                       stack_sharding)
  return _replace_inaccurate(inverses, residuals,
                             lambda: _cholesky_stack(stack, damping, stack_sharding))


def _cholesky_stack(stack: jax.Array, damping: jax.Array,
                    stack_sharding: Any) -> jax.Array:
  """Cholesky inverses of every matrix of a stack, eigh for those whose
  residual ``‖I - (M + δI) X‖_F`` (estimated) exceeds
  ``NEWTON_SCHULZ_ACCEPTED`` or is not finite; eigh is computed only when
  some matrix needs it.

  In float32 a Cholesky inverse loses ``κ ε`` of accuracy: with a damping
  near the round-off of a singular factor (the automatic mode's adaptive
  damping gets there) it comes out finite but wrong, while eigh, clipping
  the eigenvalues at 0, stays positive definite. Non-finite input stays
  non-finite (the refresh is then rejected).
  """
  def cholesky(matrix, damping):
    inverse = damped_inverse(matrix, damping, "cholesky")
    # ‖R v‖ for random signs v estimates ‖R‖_F (E‖R v‖² = ‖R‖_F²) with
    # matrix-vector products: the refresh's cost stays Cholesky's.
    signs = jnp.asarray(np.random.default_rng(0).choice(
        [-1.0, 1.0], matrix.shape[-1]), matrix.dtype)
    solved = inverse @ signs
    residual = signs - (matrix @ solved + damping * solved)
    return inverse, jnp.sqrt(jnp.sum(residual * residual))
  inverses, residuals = _distributed(cholesky, (stack, damping), stack_sharding)
  return _replace_inaccurate(inverses, residuals, lambda: _distributed(
      lambda m, d: damped_inverse(m, d, "eigh"), (stack, damping), stack_sharding))


def _replace_inaccurate(inverses: jax.Array, residuals: jax.Array,
                        fallback: Callable[[], jax.Array]) -> jax.Array:
  """``inverses`` (a stack), each one whose residual is above
  ``NEWTON_SCHULZ_ACCEPTED`` or not finite replaced by ``fallback()``'s;
  ``fallback`` runs only when some inverse needs it."""
  # Padding entries of a sharded stack come back as zeros: accepted, dropped.
  accepted = (residuals <= NEWTON_SCHULZ_ACCEPTED)[:, None, None]
  return jax.lax.cond(jnp.all(accepted), lambda: inverses,
                      lambda: jnp.where(accepted, inverses, fallback()))


def _diagonal_power(diagonal: DampedDiagonal, power: float) -> jax.Array:
  # The damping's axes lead the values' (both gain the same vmapped axes).
  damping = jnp.reshape(diagonal.damping, jnp.shape(diagonal.damping)
                        + (1,) * (diagonal.values.ndim - jnp.ndim(diagonal.damping)))
  return (jnp.maximum(diagonal.values, 0.0) + damping) ** power


def _decompose_lags(leaves: list, results: list, stack_sharding: Any,
                    power: float) -> None:
  """Puts the decomposition of every `DampedLag` of ``leaves`` into ``results``."""
  requests = {i: leaf for i, leaf in enumerate(leaves) if isinstance(leaf, DampedLag)}
  if requests and power != -1:
    raise NotImplementedError(
        f"power={power}: the series blocks of recurrent layers (layer_overrides "
        "'series_option1'/'series_option2') give only the damped inverse, "
        "power=-1 (as the original K-FAC does); use 'independent' for those "
        "layers to get other powers")
  groups: dict[tuple, list[int]] = {}
  for i, leaf in requests.items():
    groups.setdefault((leaf.option, leaf.matrix.shape[-1]), []).append(i)
  for (option, _), members in groups.items():
    stack = lambda field: _stacked(leaves, members, lambda i: field(leaves[i]))
    decomposed = _distributed(
        SERIES_DECOMPOSITIONS[option],
        (stack(lambda r: r.matrix), stack(lambda r: r.lag), _damping_stack(leaves, members)),
        stack_sharding)
    _unstack(results, leaves, members, decomposed)


def _stacked(leaves: list, members: list[int], part: Callable[[int], jax.Array]) -> jax.Array:
  """``part(i)`` ``(..., *tail)`` of every member ``i`` as one ``(n, *tail)``
  stack in its matrix's dtype (at least float32), where ``...`` are the
  leading axes of ``leaves[i].matrix``."""
  dtype = at_least_float32(leaves[members[0]].matrix).dtype
  parts = [(part(i), leaves[i].matrix.ndim - 2) for i in members]
  return jnp.concatenate([jnp.reshape(x, (-1, *jnp.shape(x)[lead:]))
                          for x, lead in parts]).astype(dtype)


def _damping_stack(leaves: list, members: list[int]) -> jax.Array:
  """Every member's damping, one per matrix of its stack: ``(n,)``."""
  return _stacked(leaves, members, lambda i: jnp.broadcast_to(
      leaves[i].damping, leaves[i].matrix.shape[:-2]))


def _unstack(results: list, leaves: list, members: list[int], stacked: Any) -> None:
  """Puts each member's share of ``stacked`` (a tree of ``(n, ...)`` stacks)
  into ``results``, with its matrix's leading axes back."""
  offset = 0
  for i in members:
    lead = leaves[i].matrix.shape[:-2]
    num = math.prod(lead)
    results[i] = jax.tree.map(
        lambda x: x[offset:offset + num].reshape(*lead, *x.shape[1:]), stacked)
    offset += num


def _distributed(each: Callable[..., Any], stacks: tuple, stack_sharding: Any,
                 batched: bool = False) -> Any:
  """``each`` over the leading axis of ``stacks``, split over devices if sharded.

  With ``stack_sharding`` the stacks are padded to a multiple of its
  ``num_shards`` (with copies of their first entry, skipped on CPU unless
  ``batched``), so every device handles an equal share; the results are
  gathered back. ``batched``: ``each`` takes whole stacks (a device's
  share) instead of one matrix each.
  """
  if batched:
    over_stack = lambda *s, real=None: each(*s)
  else:
    over_stack = functools.partial(_over_stack, each)
  if stack_sharding is None:
    return over_stack(*stacks)
  count = len(stacks[0])
  extra = -count % stack_sharding.num_shards
  padded = [jnp.concatenate([s, jnp.broadcast_to(s[:1], (extra, *s.shape[1:]))])
            for s in stacks]
  real = jnp.arange(count + extra) < count
  return stack_sharding.map(lambda r, *s: over_stack(*s, real=r), real, *padded)


def _over_stack(each, *stacks: jax.Array, real: jax.Array | None = None) -> Any:
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
    return jax.vmap(each)(*stacks)
  if real is None:
    return jax.lax.map(lambda args: each(*args), stacks)
  shapes = jax.eval_shape(each, *(s[0] for s in stacks))

  def skip(args):  # zeros derived from an input: varying over shard_map's axes too
    zero = jnp.zeros_like(args[1].reshape(-1)[0])
    return jax.tree.map(lambda x: jnp.broadcast_to(zero, x.shape).astype(x.dtype), shapes)
  return jax.lax.map(lambda args: jax.lax.cond(
      args[0], lambda: each(*args[1:]), lambda: skip(args)), (real, *stacks))
