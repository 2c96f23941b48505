"""Tiled factors kept with the params' shards (``factor_block_size``).

A tiled block (`blocks.TiledKroneckerBlock`) preconditions each tile
``V_ij`` of its gradient matrix with its own tiles ``A_ii`` and ``G_jj``.
Where ``V``'s rows are split over mesh axes ``R`` and each device's rows are
whole tiles (the tile count divides into the devices over ``R``, no padding
row), the stack of ``A``'s tiles is split over ``R`` the same way, so each
device holds exactly the tiles its rows need; likewise ``G`` over ``V``'s
column axes ``C``. Then:

- statistics: each device forms the partial Grams of the tiles from its
  share of the rows (`linalg.rows_over_mesh`), which XLA sums into the
  tiles' devices (tiles, not whole factors, move);
- refresh: each device inverts its own tiles (`jax.shard_map`);
- preconditioning: ``A_ii⁻¹ V_ij G_jj⁻¹`` on the device that holds
  ``V_ij``: no gradient moves.

A side that cannot be split so (its rows whole on every device, a bias row
joined to rows split over the mesh, a tile count that does not divide) is
kept whole on every device, each refreshing it alike. The layout of ``V``
comes from the params' types under Explicit axes or their partitioning
boxes under Auto ones (`explicit_axes.params_typed_spec`); without either,
XLA places the tiles.
"""

import math
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from kfac_optax._src import blocks
from kfac_optax._src import linalg
from kfac_optax._src.curvature import block_stacks


def _tiled_core(block: Any) -> tuple[blocks.TiledKroneckerBlock | None, int]:
  """The tiled block inside ``block`` and the stacking levels around it."""
  levels = 0
  while isinstance(block, (blocks.StackedBlock, blocks.BatchMajor)):
    levels += isinstance(block, blocks.StackedBlock)
    block = block.inner
  return (block if isinstance(block, blocks.TiledKroneckerBlock) else None), levels


def _side_axes(core: blocks.TiledKroneckerBlock, side: str, axes: tuple[str, ...],
               diagonal: bool) -> tuple[str, ...]:
  """The mesh axes that split ``side``'s tiles (or its diagonal) as the
  gradient matrix's rows (``"a"``) or columns (``"g"``) are split along
  ``axes``; () where they cannot."""
  mesh = jax.sharding.get_abstract_mesh()
  shards = math.prod(mesh.shape[a] for a in axes) if axes else 1
  rows = core.side_size(side)
  if shards == 1:
    return ()
  if diagonal:
    return axes if rows % shards == 0 else ()
  count, size = core.side_tiling(side)
  return axes if count * size == rows and count % shards == 0 else ()


def specs(plan: Any, flat_params: dict) -> dict[str, blocks.KroneckerFactors]:
  """Block key -> the `PartitionSpec` of each side's factors (tiles
  ``(..., n, t, t)`` or diagonal ``(..., d)``), for every tiled block with
  at least one side split over the mesh. Empty where the params' layout on
  the mesh is unknown."""
  found = {}
  for key, (path, block) in plan.layers.items():
    core, levels = _tiled_core(block)
    if core is None:
      continue
    spec = block_stacks.gradient_matrix_spec(path, block, flat_params)
    if spec is None:
      continue
    spec = (*spec, *[None] * (levels + 3 - len(spec)))  # levels, slices, rows, cols
    # Stacking levels split over the mesh would need their own routing.
    layout = None if any(spec[:levels]) else linalg.MatrixLayout.of(P(*spec[levels:]), 3)
    if layout is None:
      continue
    sides = [_side_axes(core, "a", layout.rows, core.diagonal_input),
             _side_axes(core, "g", layout.cols, core.diagonal_output)]
    if not any(sides):
      continue
    lead = (None,) * (levels + 1)  # stacking levels, then the layout's slices
    found[key] = blocks.KroneckerFactors(*(
        P(*lead, axes or None) if diagonal else P(*lead, axes or None, None, None)
        for axes, diagonal in zip(sides, (core.diagonal_input, core.diagonal_output))))
  return found


def place(per_block: dict, placed: dict[str, blocks.KroneckerFactors]) -> dict:
  """``per_block`` (block key -> factors) with each placed block's sides on
  their specs."""
  return {key: blocks.KroneckerFactors(*map(linalg.constrain, value, placed[key]))
          if key in placed else value for key, value in per_block.items()}


def _damped_specs(request: Any, spec: P) -> Any:
  """The specs of a `linalg.Damped` (its damping lacks the tile's two axes)
  or `linalg.DampedDiagonal` (its damping lacks the diagonal's axis)."""
  if isinstance(request, linalg.Damped):
    return linalg.Damped(spec, P(*spec[:-2]))
  return linalg.DampedDiagonal(spec, P(*spec[:-1]))


def invert_in_place(requests: dict, placed: dict[str, blocks.KroneckerFactors],
                    method: str, power: float, previous: dict | None) -> dict:
  """Block key -> its damped factors (``requests``) raised to ``power``,
  each device computing the tiles it holds (`specs`), nothing gathered."""
  def each(request, start):
    return linalg.invert_all(request, method, power=power, previous=start)

  found = {}
  for key, request in requests.items():
    request_specs = blocks.KroneckerFactors(
        *(_damped_specs(r, s) for r, s in zip(request, placed[key])))
    start = None if previous is None else previous[key]
    start_specs = None if start is None else placed[key]
    # Replicated over the axes a side is not split on: every device there
    # computes the same tiles, which LAPACK's custom calls cannot declare.
    found[key] = jax.shard_map(each, in_specs=(request_specs, start_specs),
                               out_specs=placed[key], check_vma=False)(request, start)
  return found
