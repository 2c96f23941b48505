"""`block_for`: the curvature block of a captured layer, from its layout."""

from typing import Any

import jax

from kfac_optax._src import layouts
from kfac_optax._src.blocks.diagonal import NormBlock
from kfac_optax._src.blocks.embedding import EmbeddingBlock
from kfac_optax._src.blocks.kronecker import KRONECKER_STRUCTURES
from kfac_optax._src.blocks.kronecker import KroneckerBlock
from kfac_optax._src.blocks.lifted import BatchMajor
from kfac_optax._src.blocks.lifted import StackedBlock
from kfac_optax._src.blocks.series import SeriesBlock
from kfac_optax._src.blocks.tiled import TiledKroneckerBlock


def block_for(layout: Any, layer_params: dict, stack_shape: tuple = (),
              other_methods: tuple[str, ...] = (), *, structure: str | None = None,
              max_factor_dim: int | None = None, series: str | None = None,
              time_axes: tuple = (), factor_block_size: int | None = None) -> Any:
  """The curvature block of a captured layer, from its layout and params.

  Args:
    layout: the layer's layout (see `layouts`).
    layer_params: the layer's param leaves (arrays or shape structs).
    stack_shape: leading axes that the params, inputs and output gradients
      share (nn.scan layer stacks); each slice gets its own block.
    other_methods: the layer's other captured methods that the model calls
      (``"attend"``: a tied embedding).
    structure: a key of `KRONECKER_STRUCTURES` that fixes which factors of
      a Kronecker block are diagonal, or None to decide by ``max_factor_dim``.
    max_factor_dim: a Kronecker factor whose layer side is larger than
      this (``in_dim``, a bias's row not counted; ``out_dim``) is kept
      diagonal; None: no bound.
    series: a `SERIES_OPTIONS` value for a dense layer with one time axis,
      or None.
    time_axes: the sizes of the leading axes (after the stack axes) that
      the inputs and output gradients have and the params lack: time steps
      of an nn.RNN or nn.scan over time.
    factor_block_size: a Kronecker block's full factor of more rows than
      this keeps only its diagonal tiles of this size
      (`tiled.TiledKroneckerBlock`); None: whole factors.
  """
  slice_params = {k: jax.ShapeDtypeStruct(v.shape[len(stack_shape):], v.dtype)
                  for k, v in layer_params.items()}
  block = _unstacked_block(layout, slice_params, other_methods, structure,
                           max_factor_dim, factor_block_size)
  if series is not None:
    if block.diagonal_input or block.diagonal_output:
      raise ValueError(
          f"{series!r} needs both Kronecker factors in full, but this layer's factors "
          f"(A {layout.in_dim + block.has_bias}², G {layout.out_dim}²) exceed "
          f"max_factor_dim={max_factor_dim}. Fix: raise max_factor_dim (None: "
          "no bound), or give the layer 'independent'.")
    block = SeriesBlock(layout, block.has_bias, option=series,
                        num_steps=time_axes[0])
  if len(time_axes) == 1 and isinstance(block, KroneckerBlock):
    block = BatchMajor(block)
  if stack_shape and other_methods:
    raise NotImplementedError(
        f"{other_methods} calls of a layer stacked by a lifted transform are "
        "not supported; give the layer the diagonal block with layer_overrides")
  for size in reversed(stack_shape):
    block = StackedBlock(block, size)
  return block


def _unstacked_block(layout: Any, layer_params: dict, other_methods: tuple,
                     structure: str | None, max_factor_dim: int | None,
                     factor_block_size: int | None) -> Any:
  kronecker = not isinstance(layout, (layouts.EmbeddingLayout, layouts.NormLayout))
  if structure is not None and not kronecker:
    raise ValueError(
        f"layer_overrides value {structure!r} is for dense and conv layers "
        f"(Kronecker blocks), but it matched a layer with a {type(layout).__name__}."
        "\nFix: put a pattern for that layer (\"diagonal\", \"skip\") before the "
        "one that matched it, or narrow that pattern")
  if isinstance(layout, layouts.EmbeddingLayout):
    return EmbeddingBlock(layout, tied="attend" in other_methods)
  if isinstance(layout, layouts.NormLayout):
    return NormBlock({k: v.shape for k, v in layer_params.items()}, layout)
  has_bias = layout.bias_name in layer_params
  if structure is None:
    too_large = lambda size: max_factor_dim is not None and size > max_factor_dim
    # The bias's row does not count: it costs nothing, and a layer fed by a
    # 4096-wide one (VGG's fc8) keeps its input factor under the 4096 bound.
    diagonal = too_large(layout.in_dim), too_large(layout.out_dim)
  else:
    diagonal = KRONECKER_STRUCTURES[structure]
  sizes = (layout.in_dim + has_bias, layout.out_dim)
  if factor_block_size is not None and any(
      size > factor_block_size and not diag for size, diag in zip(sizes, diagonal)):
    return TiledKroneckerBlock(layout, has_bias, *diagonal, tile=factor_block_size)
  return KroneckerBlock(layout, has_bias, *diagonal)
