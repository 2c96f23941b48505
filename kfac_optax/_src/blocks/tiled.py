"""A Kronecker block whose factors are cut into diagonal tiles: ``⊕ A_ii ⊗ G_jj``.

With ``factor_block_size=t`` a factor of ``d > t`` rows keeps only its
``n = ⌈d/t⌉`` diagonal tiles of ``t × t`` (the last one padded with zero
rows). Its Fisher block becomes block-diagonal,

.. math::
  F ≈ \\bigoplus_{i,j} A_{ii} ⊗ G_{jj},

so the tile ``V_ij`` of the gradient matrix (rows of tile ``i``, columns of
tile ``j``) is preconditioned on its own, ``(A_ii + π√λ I)⁻¹ V_ij (G_jj +
√λ/π I)⁻¹``, with the layer's ``π`` from its whole factors' traces (the
tiles' traces add up to them). The refresh costs ``n t³`` instead of
``d³`` and no tile depends on another, as in Distributed Shampoo's blocking
of large matrices.

That is what sharded jobs need: when ``t`` divides the rows (columns) a
device holds of a kernel split over the mesh (FSDP, tensor parallelism), a
device's tiles of ``V`` meet only tiles of ``A`` (``G``) that are its own,
so K-FAC's factors are spread with the params and preconditioning moves
nothing between devices (`curvature.tile_placement`). The tiles do not
depend on the mesh: a state restores on any mesh, and a sharded run equals
one device's with the same ``factor_block_size``.
"""

import dataclasses

import jax
import jax.numpy as jnp

from kfac_optax._src import linalg
from kfac_optax._src import losses
from kfac_optax._src.blocks import kronecker


def tiling(size: int, tile: int) -> tuple[int, int]:
  """``(number of tiles, tile size)`` of a factor of ``size`` rows: one
  tile of ``size`` when it fits in ``tile``."""
  return (1, size) if size <= tile else (-(-size // tile), tile)


def _padded(x: jax.Array, axis: int, length: int) -> jax.Array:
  """``x`` with zeros appended on ``axis`` up to ``length``."""
  extra = length - x.shape[axis]
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def tile_gram(rows: jax.Array, weights: jax.Array | None, tile: int) -> jax.Array:
  """``(S, R, d) -> (S, n, t, t)``: the diagonal tiles of ``Σ_rows w r rᵀ``,
  without forming the whole ``d × d`` matrix; on a mesh, each device's
  partial tiles from its share of the rows (`linalg.rows_over_mesh`)."""
  n, t = tiling(rows.shape[-1], tile)
  rows = _padded(linalg.at_least_float32(linalg.rows_over_mesh(rows)), 2, n * t)
  rows = rows.reshape(*rows.shape[:2], n, t)
  weighted = rows if weights is None else rows * weights[:, None, None]
  return jnp.einsum("srni,srnj->snij", weighted, rows,
                    precision=linalg.STATISTICS_PRECISION)


def tiles_of(matrix: jax.Array, tile: int) -> jax.Array:
  """``(S, d, d) -> (S, n, t, t)``: the diagonal tiles of ``matrix``."""
  s, d = matrix.shape[0], matrix.shape[-1]
  n, t = tiling(d, tile)
  matrix = _padded(_padded(matrix, 1, n * t), 2, n * t).reshape(s, n, t, n, t)
  index = jnp.arange(n)
  return jnp.moveaxis(matrix[:, index, :, index, :], 0, 1)


def _tiled_product(tiles: jax.Array, matrix: jax.Array, axis: int) -> jax.Array:
  """``blockdiag(tiles)`` times ``matrix`` ``(S, rows, cols)`` along
  ``axis`` (1: from the left on its rows; 2: from the right on its columns;
  the tiles are symmetric)."""
  s, n, t, _ = tiles.shape
  size = matrix.shape[axis]
  padded = _padded(matrix, axis, n * t)
  if axis == 1:
    product = jnp.einsum("snij,snjc->snic", tiles, padded.reshape(s, n, t, -1))
    return product.reshape(s, n * t, -1)[:, :size]
  product = jnp.einsum("srnj,snjk->srnk", padded.reshape(s, padded.shape[1], n, t), tiles)
  return product.reshape(s, padded.shape[1], n * t)[:, :, :size]


def tiled_sandwich(inverses: kronecker.KroneckerFactors, matrix: jax.Array) -> jax.Array:
  """``A⁻¹ V G⁻¹`` per stack slice, each factor's inverse as its diagonal
  tiles ``(S, n, t, t)`` or, kept diagonal, a vector ``(S, d)``."""
  a, g = inverses
  matrix = a[:, :, None] * matrix if a.ndim == 2 else _tiled_product(a, matrix, 1)
  return matrix * g[:, None, :] if g.ndim == 2 else _tiled_product(g, matrix, 2)


@dataclasses.dataclass(frozen=True)
class TiledKroneckerBlock(kronecker.KroneckerBlock):
  """`kronecker.KroneckerBlock` with each full factor kept as its diagonal
  tiles of ``tile`` rows (see the module docstring): ``a`` is ``(S, n_a,
  t_a, t_a)`` (or ``(S, in_dim [+ 1])`` where diagonal), ``g`` ``(S, n_g,
  t_g, t_g)`` (or ``(S, out_dim)``).

  Attributes:
    tile: ``factor_block_size``, the tiles' rows.
  """

  tile: int = 0

  def side_size(self, side: str) -> int:
    """The rows of factor ``side`` (``"a"`` or ``"g"``), padding not counted."""
    return self.layout.in_dim + self.has_bias if side == "a" else self.layout.out_dim

  def side_tiling(self, side: str) -> tuple[int, int]:
    """`tiling` of factor ``side``."""
    return tiling(self.side_size(side), self.tile)

  def init(self) -> tuple[kronecker.KroneckerFactors, kronecker.KroneckerFactors]:
    zeros, identities = super().init()
    pairs = []
    for side, diagonal in (("a", self.diagonal_input), ("g", self.diagonal_output)):
      if diagonal:
        pairs.append((getattr(zeros, side), getattr(identities, side)))
        continue
      n, t = self.side_tiling(side)
      shape = (self.layout.num_stacks, n, t, t)
      pairs.append((jnp.zeros(shape), jnp.broadcast_to(jnp.eye(t), shape)))
    (zero_a, eye_a), (zero_g, eye_g) = pairs
    return (kronecker.KroneckerFactors(zero_a, zero_g),
            kronecker.KroneckerFactors(eye_a, eye_g))

  def statistics(self, inputs, output_grads, terms: losses.Terms
                 ) -> kronecker.KroneckerFactors:
    if self.diagonal_output:
      g = kronecker.output_factor(self.layout, output_grads, terms, True)
    else:
      g = sum(tile_gram(*kronecker.weighted_output_rows(self.layout, grads, terms),
                        self.tile) for grads in output_grads) / terms.count
    return kronecker.KroneckerFactors(self.input_factor(inputs, terms), g)

  def _input_gram(self, x: jax.Array, terms: losses.Terms):
    if self.diagonal_input:
      return super()._input_gram(x, terms)
    if getattr(self.layout, "expands_input", False):
      # Convolutions' patch Grams keep their chunked, translated forms.
      full, count = super()._input_gram(x, terms)
      return tiles_of(full, self.tile), count
    rows = self._rows(x)
    weights = terms.row_weights(x.shape, rows.shape[1])
    return tile_gram(rows, weights, self.tile), (
        rows.shape[1] if weights is None else jnp.sum(weights))

  def damped(self, factors: kronecker.KroneckerFactors,
             damping: jax.Array) -> kronecker.KroneckerFactors:
    """Each tile with its layer's π-adjusted damping: ``π`` from the whole
    factors' mean eigenvalues (the tiles' traces over the factor's rows,
    the padding's zeros not counted)."""
    def mean_eigenvalue(factor, size):
      if factor.ndim == 2:  # kept diagonal
        return jnp.mean(factor, -1)
      return jnp.sum(jnp.diagonal(factor, axis1=-2, axis2=-1), (-2, -1)) / size
    damping_a, damping_g = linalg.pi_adjusted_damping(
        *(mean_eigenvalue(f, self.side_size(side)) for f, side in zip(factors, "ag")),
        damping)

    def damped(factor, side_damping):
      if factor.ndim == 2:
        return linalg.DampedDiagonal(factor, side_damping)
      return linalg.Damped(factor, jnp.broadcast_to(side_damping[:, None],
                                                    factor.shape[:2]))
    return kronecker.KroneckerFactors(damped(factors.a, damping_a),
                                      damped(factors.g, damping_g))

  def precondition(self, inverses: kronecker.KroneckerFactors, grads: dict) -> dict:
    return self.matrix_leaves(tiled_sandwich(
        inverses, self.gradient_matrix(grads, inverses.a.dtype)))
