"""Statistics of stacked Kronecker factors formed on the devices that own
their slots.

Over a mesh the activations of K-FAC's pass are split as the model splits
them: the examples over the data axes, the features over the model axes.
A block's batch factor is the mean Gram of rows ``r`` (its layer's input
rows ``ā``, or output-gradient rows ``g``):

    F = (1/N) Σ_rows w r rᵀ,

with ``N`` the rows' total weight ``Σ w`` for ``A`` and the number of terms
``L`` for ``G`` (`blocks.KroneckerBlock.statistics`). Left to XLA, each
Gram is formed whole on every device from all-gathered rows, then cut into
the stack (the sharded example decoder, 2×4 mesh: 43 MB sent per device in
a statistics step). Here each block's rows, scaled by ``√(w / N)`` so that
their plain Gram is ``F``, reach the owner of the block's slot one of two
ways, whichever sends less (`_gram_stack`):

- the rows themselves (`linalg.at_owners` without the way back), each
  device sending its share, ``R d / n`` numbers a slot; the owner forms
  the Gram;
- where the features are whole on every device, each device's Gram of its
  own rows (`linalg.summed_at_owners`), ``d²`` numbers a slot, which the
  owner adds up: cheaper once a device holds more rows than features.

Both send the padding slots too; where few blocks fill a stack (a shallow
model on many devices) the blocks' own statistics, whose partial Grams XLA
all-reduces, can send less, and are kept (`_gram_stack`).

``A``'s bias row and column, ``(1/N) Σ w ā`` and ``Σ w / N = 1``, are
reductions of ``d`` numbers a block, left to XLA.

The rows' layout comes from the types under Explicit axes
(`explicit_axes.typed_spec`); where none names it (Auto axes, or a reshape
of an einsum's features the types cannot follow) the rows are split over
every device first (XLA moves them there, each device sending about its
share). A side
of a stack is formed so where every block's rows can go: plain
`blocks.KroneckerBlock` s of one call whose inputs are not expanded into
patches, a full (not diagonal) factor, equal row counts, and rows or
features that divide among the devices. Elsewhere the blocks' own
statistics are stacked (`block_stacks.Layout.stack`).
"""

from typing import Any

import jax
import jax.numpy as jnp

from kfac_optax._src import linalg
from kfac_optax._src import losses
from kfac_optax._src.blocks import kronecker
from kfac_optax._src.curvature import block_stacks
from kfac_optax._src.curvature import explicit_axes
from kfac_optax._src.models import capture


def _rows_on_mesh(rows_of, array, spec, num_rows: int,
                  placement) -> linalg.MatrixLayout | None:
  """How ``rows_of(array)`` (``num_rows`` rows) lies on the mesh: as the
  Explicit axes type it (``array`` typed by ``spec``); where no type names
  it (Auto axes, ``spec`` None; a reshape the types cannot follow), the
  rows split over every axis, where XLA reshards them (each device sending
  about its share), if they divide."""
  rows_spec = None if spec is None else explicit_axes.typed_spec(rows_of, array, spec)
  if rows_spec is not None:
    return linalg.MatrixLayout.of(rows_spec, 3)
  return (linalg.MatrixLayout(placement.axes, ())
          if num_rows % placement.num_shards == 0 else None)


def _scaled(rows: jax.Array, weights: jax.Array | None, total: Any) -> jax.Array:
  """Rows times ``√(w / N)``: their Gram is the weighted mean Gram."""
  rows = linalg.at_least_float32(rows)
  scale = jax.lax.rsqrt(jnp.asarray(total, rows.dtype)) if weights is None else (
      jnp.sqrt(weights / total)[:, None])
  return rows * scale


def _sides(block, x, g, x_spec, g_spec, terms: losses.Terms, placement):
  """``[(scaled rows, layout, bias parts or None) or None]`` for ``A`` and
  ``G`` of one block (None for a side that cannot go to its owner)."""
  layout = block.layout
  sides = []
  if block.diagonal_input:
    sides.append(None)
  else:
    rows = layout.input_rows(x)
    weights = terms.row_weights(x.shape, rows.shape[1])
    total = rows.shape[1] if weights is None else jnp.sum(weights)
    bias = None
    if block.has_bias:
      weighted = rows if weights is None else rows * weights[:, None]
      mean = jnp.sum(linalg.at_least_float32(weighted), 1) / total  # (S, d)
      bias = (mean, jnp.ones(rows.shape[:1], mean.dtype))  # Σ w / N
    sides.append((_scaled(rows, weights, total),
                  _rows_on_mesh(layout.input_rows, x, x_spec, rows.shape[1],
                                placement), bias))
  if block.diagonal_output:
    sides.append(None)
  else:
    rows, weights = kronecker.weighted_output_rows(layout, g, terms)
    sides.append((_scaled(rows, weights, terms.count),
                  _rows_on_mesh(layout.output_rows, g, g_spec, rows.shape[1],
                                placement), None))
  return sides


def _eligible(plan, path, block, captured: capture.Captured) -> bool:
  """Whether the block's statistics are a plain Kronecker block's Grams of
  one call's rows."""
  return (type(block) is kronecker.KroneckerBlock
          and not getattr(block.layout, "expands_input", False)
          and len(captured.inputs[path]) == 1 and len(captured.output_grads[path]) == 1
          and path not in plan.tied
          and not any(path in inputs for inputs, _ in captured.other_methods.values()))


def _gram_stack(group: block_stacks.Group, sides: list, placement) -> jax.Array | None:
  """One side's ``(T, d, d)`` stack of batch factors, formed on the owners;
  None where a block's rows cannot go there, or where XLA's own way sends
  less.

  Numbers each device sends (``T`` slots, padding included; ``U`` used):
  its share of every slot's rows, ``T R d / n`` (`linalg.at_owners`); or,
  where the features are whole on every device, its partial Grams,
  ``T d²`` (`linalg.summed_at_owners`), or, the blocks' own statistics,
  whose partial Grams XLA all-reduces, about ``2 U d²``. The least, ours
  on a tie. (With features split XLA gathers the rows: ours.)"""
  if any(side is None or side[1] is None for side in sides):
    return None
  rows, layouts = [side[0] for side in sides], [side[1] for side in sides]
  if len({r.shape[1:] for r in rows}) != 1 or group.slots % placement.num_shards:
    return None
  count, width = rows[0].shape[1:]
  n = placement.num_shards
  whole = all(not layout.cols for layout in layouts)
  sent = {}
  if linalg.routable(rows[0].shape, n):
    sent["rows"] = group.slots * count * width / n
  if whole and count % n == 0:
    sent["partial Grams"] = group.slots * width**2
  if whole:
    sent["blocks' own"] = 2 * group.used * width**2
  way = min(sent, key=sent.get) if sent else "blocks' own"
  if way == "rows":
    grams = linalg.at_owners(
        lambda _, full: kronecker.gram(full), (), rows, layouts, group.slots,
        placement.axes, placement.mesh, back=False)
  elif way == "partial Grams":
    grams = linalg.summed_at_owners(kronecker.gram, rows, layouts, group.slots,
                                    placement.axes, placement.mesh)
  else:
    return None
  if sides[0][2] is None:
    return grams
  # [[Σ w ā āᵀ, Σ w ā], [Σ w āᵀ, Σ w]] / N: the bias row and column added.
  mean, corner = (block_stacks.stack_group(
      group, {key: side[2][i] for key, side in zip(group.keys, sides)}, placement)
                  for i in (0, 1))
  full = jnp.pad(grams, ((0, 0), (0, 1), (0, 1)))
  full = full.at[:, :-1, -1].set(mean).at[:, -1, :-1].set(mean)
  return placement.place(full.at[:, -1, -1].set(corner))


def at_owners(plan, stacks: block_stacks.BlockStacks, captured: capture.Captured,
              specs: capture.Captured | None, terms: losses.Terms,
              placement: linalg.StackSharding | None) -> block_stacks.BlockStacks:
  """``stacks`` (the blocks' own statistics, stacked) with each side that
  can be formed on its owners so formed instead (XLA then drops the blocks'
  own Grams of that side). A side keeps the blocks' own statistics where
  its stack is not eligible, or where XLA's all-reduce of their partial
  Grams sends less than either way to the owners (`_gram_stack`)."""
  if placement is None:
    return stacks
  new = []
  for group, stack in zip(stacks.layout.groups, stacks.stacks):
    blocks = [plan.layers[key] for key in group.keys]
    if not all(_eligible(plan, path, block, captured) for path, block in blocks):
      new.append(stack)
      continue
    spec = lambda found, path: None if specs is None else getattr(specs, found)[path][0]
    per_block = [_sides(block, captured.inputs[path][0], captured.output_grads[path][0],
                        spec("inputs", path), spec("output_grads", path), terms, placement)
                 for path, block in blocks]
    formed = [_gram_stack(group, [sides[i] for sides in per_block], placement)
              for i in (0, 1)]
    new.append(kronecker.KroneckerFactors(
        *(old if made is None else made for made, old in zip(formed, stack))))
  return stacks.replace(tuple(new), stacks.rest)
