"""Every damped factor of a refresh inverted, in stacks of similar size.

`invert_all` takes a tree whose leaves are `damped.Damped` (and
`DampedDiagonal`, `series.DampedLag`) requests, groups the matrices by size
(`bucket_sizes`), pads each to its bucket's size and inverts every bucket in
one call, optionally with the stack split over the devices of a mesh
(`distributed`).
"""

import collections
import math
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from kfac_optax._src.linalg import damped
from kfac_optax._src.linalg import distributed
from kfac_optax._src.linalg import low_rank
from kfac_optax._src.linalg import newton_schulz
from kfac_optax._src.linalg import precision
from kfac_optax._src.linalg import series


# Extra inversion work (∝ d³, a share of the whole refresh's) that
# `bucket_sizes` spends to put matrices of at most `SMALL_SIZE` rows into
# larger stacks: each stack is one compiled inversion, residual check and
# eigh fallback, 0.1-0.2 s of XLA:CPU's compile whatever its size. On the
# ResNet benchmark's 43 factors (11 sizes from 9 to 1152) the stacks went
# from 10 to 5, the refresh's compile from 3.2 to 2.2 s and its run time
# from 81 to 83 ms; letting larger sizes use the budget too (the
# autoencoder's 251 padded to 501) cost 6-8% of the refresh's time for 5%
# of its FLOPs (benchmarks/RESULTS.md, "Compile time of the training step").
PADDING_BUDGET = 0.05
SMALL_SIZE = 128


def bucket_sizes(sizes: Iterable[int], max_padding: float = 1.25,
                 budget: float = PADDING_BUDGET) -> dict[int, int]:
  """Assigns each matrix size the (padded) size of the stack it is inverted in.

  Sizes are taken largest first; a size joins the smallest existing bucket
  whose inversion costs at most ``max_padding`` times its own (cost ∝ d³);
  failing that, a size of at most `SMALL_SIZE` joins the smallest bucket
  into which padding all its matrices (``n (D³ - d³)``) fits in what is
  left of ``budget`` times the work of the whole refresh (``Σ d³`` over all
  matrices); else it opens a bucket of its own. Fewer, fuller stacks
  compile fewer inversions and split more evenly over devices;
  ``max_padding`` and ``budget`` bound the extra work.

  Args:
    sizes: the size ``d`` of every matrix (repeated for each matrix of a
      size).
    max_padding: the largest allowed ``(D / d)³`` for padding d up to D.
    budget: the share of the refresh's work that padding small sizes
      beyond ``max_padding`` may add, over all sizes.

  Returns:
    ``{d: D}`` for every distinct size.
  """
  counts = collections.Counter(sizes)
  spare = budget * sum(count * size**3 for size, count in counts.items())
  buckets, assigned = [], {}
  for size in sorted(counts, reverse=True):
    fitting = [top for top in buckets if top**3 <= max_padding * size**3]
    if not fitting and size <= SMALL_SIZE:
      extra = {top: counts[size] * (top**3 - size**3) for top in buckets}
      fitting = [top for top in buckets if extra[top] <= spare]
      spare -= extra[min(fitting)] if fitting else 0
    if fitting:
      assigned[size] = min(fitting)
    else:
      buckets.append(size)
      assigned[size] = size
  return assigned


def invert_all(tree: Any, method: str,
               stack_sharding: distributed.StackSharding | None = None,
               power: float = -1,
               previous: Any = None, rank: int | None = None) -> Any:
  """Replaces every `damped.Damped` leaf of ``tree`` by its damped inverse, batched.

  (Or, with ``power``, by any power of it; `damped.DampedDiagonal` leaves likewise,
  elementwise.)

  Matrices are grouped by `bucket_sizes`, padded to their bucket's size with
  an identity block (which leaves the inverse's leading block unchanged:
  ``[[M, 0], [0, I]] + δI`` inverts blockwise), stacked and inverted in one
  call per bucket (see `distributed.over_stack`). With ``stack_sharding`` each stack is
  padded to a multiple of its ``num_shards`` and split along the stack axis,
  so every device inverts only its share, then gathered back to every device.

  Args:
    tree: any pytree; `damped.Damped` and `damped.DampedDiagonal` leaves are inverted,
      other leaves kept.
    method: see `damped.damped_inverse`.
    stack_sharding: ``None``, or how each stack is split over devices
      (`distributed.StackSharding`).
    power: the exponent (see `damped.damped_power`).
    previous: None, or a tree with the structure of the result (the
      inverses in use): ``method="newton_schulz"`` starts each inverse from
      its previous one (see `newton_schulz.newton_schulz_inverse`), and so does every
      low-rank inverse; other methods ignore it.
    rank: None, or a `damped.Damped` leaf of more than ``rank`` rows gets a
      `low_rank.LowRankInverse` of that rank (``power=-1`` only), stacked by
      exact size.

  `series.DampedLag` leaves (the series blocks of recurrent layers) are replaced by
  their decomposition (`Whitened` or `Transition`), stacked by exact size
  and distributed the same way; they support ``power=-1`` only.

  Returns:
    ``tree`` with each `damped.Damped` leaf replaced by an array of its matrix's
    shape (or a `low_rank.LowRankInverse`).
  """
  if rank is not None and power != -1:
    raise ValueError(f"rank={rank} applies to inverses (power=-1), got power={power}")
  method = damped.resolve_inverse(method)
  leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_damped)
  results = [_diagonal_power(leaf, power) if isinstance(leaf, damped.DampedDiagonal)
             else leaf for leaf in leaves]
  _decompose_lags(leaves, results, stack_sharding, power)
  starts = treedef.flatten_up_to(previous) if previous is not None else None
  _low_rank_inverses(leaves, results, starts, rank, stack_sharding)
  requests = {i: leaf for i, leaf in enumerate(leaves) if isinstance(leaf, damped.Damped)
              and not _kept_at_rank(leaf, rank)}
  warm = method == "newton_schulz" and power == -1 and previous is not None
  buckets = bucket_sizes(leaf.matrix.shape[-1] for leaf in requests.values()
                         for _ in range(math.prod(leaf.matrix.shape[:-2])))
  for bucket in sorted(set(buckets.values())):
    members = [i for i, leaf in requests.items()
               if buckets[leaf.matrix.shape[-1]] == bucket]
    matrices, dampings, previous_stack = [], [], []
    for i in members:
      dtype = precision.at_least_float32(requests[i].matrix).dtype
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
      each = lambda m, d: damped.damped_power(m, d, power, method)
      inverted = distributed.map_over_stack(each, (stack, damping), stack_sharding)
    offset = 0
    for i in members:
      shape = requests[i].matrix.shape
      size, num = shape[-1], math.prod(shape[:-2])
      results[i] = inverted[offset:offset + num, :size, :size].reshape(shape)
      offset += num
  return treedef.unflatten(results)


def _is_damped(x: Any) -> bool:
  return isinstance(x, (damped.Damped, damped.DampedDiagonal, series.DampedLag))


def _kept_at_rank(leaf: Any, rank: int | None) -> bool:
  """Whether ``leaf`` (of a tree for `invert_all`) gets a low-rank inverse
  at ``rank``: a `damped.Damped` of more than ``rank`` rows (None: none does)."""
  return isinstance(leaf, damped.Damped) and low_rank.applies(leaf.matrix.shape[-1], rank)


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
                       rank: int | None,
                       stack_sharding: distributed.StackSharding | None) -> None:
  """Puts the `low_rank.LowRankInverse` of every `damped.Damped` leaf kept at
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
             distributed.map_over_stack(_low_rank_stack, stacks, stack_sharding,
                                        batched=True))


def _low_rank_stack(matrices: jax.Array, dampings: jax.Array,
                    bases: jax.Array) -> low_rank.LowRankInverse:
  """`low_rank.damped_inverse` of a stack: its products and Gram-Schmidt
  batched over the stack (one loop for all, none of them LAPACK), the
  small eigh one matrix at a time on CPU (`distributed.over_stack`)."""
  return low_rank.damped_inverse(
      matrices, dampings, bases,
      eigh=lambda m: distributed.over_stack(jnp.linalg.eigh, m))


def _padded(matrices: jax.Array, size: int, fill: jax.Array) -> jax.Array:
  """``(..., d, d)`` matrices as a ``(n, size, size)`` stack in at least
  float32, each padded with ``fill`` (n,) times the identity."""
  matrices = precision.at_least_float32(matrices)
  d = matrices.shape[-1]
  matrices = matrices.reshape(-1, d, d)
  if d == size:
    return matrices
  padded = jnp.pad(matrices, ((0, 0), (0, size - d), (0, size - d)))
  return padded + fill[:, None, None] * jnp.diag(jnp.arange(size) >= d).astype(
      matrices.dtype)


def _newton_schulz_stack(stack: jax.Array, damping: jax.Array,
                         previous: jax.Array | None,
                         stack_sharding: distributed.StackSharding | None) -> jax.Array:
  """`newton_schulz.newton_schulz_inverse` of every matrix of a stack (warm-started from
  ``previous`` if given), `_cholesky_stack` for those whose residual stays
  above ``newton_schulz.NEWTON_SCHULZ_ACCEPTED``: computed only when some
  matrix needs it."""
  if previous is None:
    each = lambda m, d: newton_schulz.newton_schulz_inverse(m, d)[:2]
    inverses, residuals = distributed.map_over_stack(each, (stack, damping),
                                                     stack_sharding)
  else:
    each = lambda m, d, p: newton_schulz.newton_schulz_inverse(m, d, p)[:2]
    inverses, residuals = distributed.map_over_stack(each, (stack, damping, previous),
                                       stack_sharding)
  return _replace_inaccurate(inverses, residuals,
                             lambda: _cholesky_stack(stack, damping, stack_sharding))


def _cholesky_stack(stack: jax.Array, damping: jax.Array,
                    stack_sharding: distributed.StackSharding | None) -> jax.Array:
  """Cholesky inverses of every matrix of a stack, eigh for those whose
  residual ``‖I - (M + δI) X‖_F`` (estimated) exceeds
  ``newton_schulz.NEWTON_SCHULZ_ACCEPTED`` or is not finite; eigh is computed only when
  some matrix needs it.

  In float32 a Cholesky inverse loses ``κ ε`` of accuracy: with a damping
  near the round-off of a singular factor (the automatic mode's adaptive
  damping gets there) it comes out finite but wrong, while eigh, clipping
  the eigenvalues at 0, stays positive definite. Non-finite input stays
  non-finite (the refresh is then rejected).
  """
  def cholesky(matrix, damping):
    inverse = damped.damped_inverse(matrix, damping, "cholesky")
    # ‖R v‖ for random signs v estimates ‖R‖_F (E‖R v‖² = ‖R‖_F²) with
    # matrix-vector products: the refresh's cost stays Cholesky's.
    signs = jnp.asarray(np.random.default_rng(0).choice(
        [-1.0, 1.0], matrix.shape[-1]), matrix.dtype)
    solved = inverse @ signs
    residual = signs - (matrix @ solved + damping * solved)
    return inverse, jnp.sqrt(jnp.sum(residual * residual))
  inverses, residuals = distributed.map_over_stack(cholesky, (stack, damping),
                                                   stack_sharding)
  return _replace_inaccurate(inverses, residuals, lambda: distributed.map_over_stack(
      lambda m, d: damped.damped_inverse(m, d, "eigh"), (stack, damping), stack_sharding))


def _replace_inaccurate(inverses: jax.Array, residuals: jax.Array,
                        fallback: Callable[[], jax.Array]) -> jax.Array:
  """``inverses`` (a stack), each one whose residual is above
  ``newton_schulz.NEWTON_SCHULZ_ACCEPTED`` or not finite replaced by ``fallback()``'s;
  ``fallback`` runs only when some inverse needs it."""
  # Padding entries of a sharded stack come back as zeros: accepted, dropped.
  accepted = (residuals <= newton_schulz.NEWTON_SCHULZ_ACCEPTED)[:, None, None]
  return jax.lax.cond(jnp.all(accepted), lambda: inverses,
                      lambda: jnp.where(accepted, inverses, fallback()))


def _diagonal_power(diagonal: damped.DampedDiagonal, power: float) -> jax.Array:
  # The damping's axes lead the values' (both gain the same vmapped axes).
  damping = jnp.reshape(diagonal.damping, jnp.shape(diagonal.damping)
                        + (1,) * (diagonal.values.ndim - jnp.ndim(diagonal.damping)))
  return (jnp.maximum(diagonal.values, 0.0) + damping) ** power


def _decompose_lags(leaves: list, results: list,
                    stack_sharding: distributed.StackSharding | None,
                    power: float) -> None:
  """Puts the decomposition of every `series.DampedLag` of ``leaves`` into ``results``."""
  requests = {i: leaf for i, leaf in enumerate(leaves)
              if isinstance(leaf, series.DampedLag)}
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
    decomposed = distributed.map_over_stack(
        series.SERIES_DECOMPOSITIONS[option],
        (stack(lambda r: r.matrix), stack(lambda r: r.lag),
         _damping_stack(leaves, members)),
        stack_sharding)
    _unstack(results, leaves, members, decomposed)


def _stacked(leaves: list, members: list[int],
             part: Callable[[int], jax.Array]) -> jax.Array:
  """``part(i)`` ``(..., *tail)`` of every member ``i`` as one ``(n, *tail)``
  stack in its matrix's dtype (at least float32), where ``...`` are the
  leading axes of ``leaves[i].matrix``."""
  dtype = precision.at_least_float32(leaves[members[0]].matrix).dtype
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
