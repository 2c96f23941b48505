"""The block contract: what every curvature block does, written once.

A block owns a group of parameter leaves and approximates their Fisher
block. It turns captured layer data into a batch estimate of its statistics,
turns (EMA-averaged) statistics into damped factors to invert, and applies
the inverses to the gradient leaves it owns. Blocks know nothing about flax:
they see arrays and the names of their layer's parameter leaves.

Conventions (docs/design.md, "Mathematical conventions"): L is the number of
loss terms, a row is one position of one example at which a layer is
applied, and every output gradient ``g`` is the gradient of the *summed*
per-term NLL, one per output cotangent ``k`` (`losses.output_cotangents`),
so a captured output gradient has a leading axis K.

`Curvature` holds a block's statistics and inverses in its state as the
pytrees `init` returns; it EMA-averages what `statistics` returns into the
first, and puts what `linalg.invert_all` makes of `damped`'s tree into the
second, so all three have one structure per block.
"""

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import jax

from kfac_optax._src import losses


@runtime_checkable
class LayerBlock(Protocol):
  """The block of one captured layer (`select.block_for` makes it).

  Implemented by `kronecker.KroneckerBlock`, `series.SeriesBlock`,
  `embedding.EmbeddingBlock`, `diagonal.NormBlock` and the wrappers of
  `lifted` (`StackedBlock`, `BatchMajor`).
  """

  @property
  def param_names(self) -> tuple[str, ...]:
    """The layer's parameter leaves this block preconditions (e.g.
    ``("kernel", "bias")``)."""

  def init(self) -> tuple[Any, Any]:
    """``(statistics, inverses)``: zeros, and inverses that precondition as
    the identity until the first refresh."""

  def statistics(self, inputs: Sequence[jax.Array],
                 output_grads: Sequence[jax.Array], terms: losses.Terms,
                 **other_calls: tuple[Sequence[jax.Array], Sequence[jax.Array]]
                 ) -> Any:
    """The batch estimate of the statistics, ``init()[0]``'s structure.

    Args:
      inputs: per call of the layer, its input.
      output_grads: per call, ``(K, *output_shape)`` gradients of the
        summed NLL with respect to the layer's output.
      terms: the number of loss terms L and their mask.
      **other_calls: for a layer whose other methods are captured too
        (``attend`` of a tied embedding), ``method=(inputs, output_grads)``.
    """

  def damped(self, statistics: Any, damping: jax.Array) -> Any:
    """The statistics with their share of λ, as a tree of `linalg.Damped`,
    `linalg.DampedDiagonal` or `linalg.DampedLag` leaves for
    `linalg.invert_all`, whose result has ``init()[1]``'s structure."""

  def precondition(self, inverses: Any, grads: Mapping[str, jax.Array]
                   ) -> dict[str, jax.Array]:
    """``{name: leaf}`` of the gradient (by `param_names`) -> the
    preconditioned leaves, in the inverses' dtype."""


@runtime_checkable
class FallbackBlock(Protocol):
  """The block of the params no layer block owns (`diagonal.DiagonalBlock`).

  The same as `LayerBlock`, except that its statistics come from the
  gradients of its own leaves (no layer to capture) and its leaves are
  named by their keys in the state rather than by a layer's params.
  """

  @property
  def names(self) -> tuple[str, ...]:
    """The keys of its leaves (their params paths joined by "/")."""

  def init(self) -> tuple[Any, Any]:
    """``(statistics, inverses)``: zeros and ones, per leaf."""

  def statistics(self, param_grads: Mapping[str, jax.Array],
                 terms: losses.Terms) -> Any:
    """``param_grads``: leaf key -> ``(K, *leaf_shape)`` gradients of the
    summed NLL (one per output cotangent)."""

  def damped(self, statistics: Any, damping: jax.Array) -> Any:
    """As `LayerBlock.damped`."""

  def precondition(self, inverses: Any, grads: Mapping[str, jax.Array]
                   ) -> dict[str, jax.Array]:
    """As `LayerBlock.precondition`, leaves keyed by `names`."""
