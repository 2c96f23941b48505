"""Matrices moved from the params' layout to the devices that own their
slots, and back.

A stack of ``T`` slots split over every device of the mesh (``P(axes)`` on
its leading axis) is owned ``m = T / n`` consecutive slots per device. To
apply a slot's factors to a gradient matrix ``V`` (``rows × cols``), the
owner needs all of ``V``, while each device holds a piece of it: ``V``'s
rows split over the mesh axes ``R`` and its columns over ``C`` (FSDP and
tensor parallelism), replicated over the rest ``O``. Stacking the matrices
as arrays leaves the move to XLA, which all-gathers the whole stack on every
device. `at_owners` moves them with one all-to-all each way instead, each
device sending and receiving about its own share of the matrices:

1. each device keeps ``1/|O|`` of its piece (its own column block over
   ``O``, so that the ``n`` devices hold ``n`` disjoint blocks of ``V``,
   each ``rows · cols / n`` numbers), flattened;
2. the pieces of all slots are stacked, and one all-to-all over every axis
   sends each slot's ``n`` pieces to its owner, which puts them together
   by the slot's layout: the block of device ``s`` sits at the rows its
   indices on ``R`` number and the columns its indices on ``C`` then ``O``
   number (most significant first);
3. the owner applies ``f``, and the same moves run backwards (an
   all-gather over ``O`` for the blocks step 1 left out); or the results
   stay on the owners as a stack split like the slots (a factor's
   statistics from the rows of activations).

Every matrix has its own layout; a table of each slot's layout (split like
the slots) makes one all-to-all serve them all. Rows and columns must
divide into their blocks (`routable`).
"""

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec


@dataclasses.dataclass(frozen=True)
class MatrixLayout:
  """How a ``(k, rows, cols)`` array lies on the mesh: its rows split over
  the mesh axes ``rows`` (major first), its columns over ``cols``."""
  rows: tuple[str, ...]
  cols: tuple[str, ...]

  @classmethod
  def of(cls, spec: PartitionSpec, ndim: int) -> "MatrixLayout | None":
    """The layout of a ``(..., rows, cols)`` array of ``ndim`` axes sharded
    by ``spec``; None where a leading axis is split."""
    spec = (*spec, *[None] * (ndim - len(spec)))  # a short spec leaves the last axes whole
    if any(entry is not None for entry in spec[:-2]):
      return None
    names = lambda entry: () if entry is None else (
        entry if isinstance(entry, tuple) else (entry,))
    return cls(names(spec[-2]), names(spec[-1]))

  def spec(self) -> PartitionSpec:
    entry = lambda axes: axes or None
    return PartitionSpec(None, entry(self.rows), entry(self.cols))

  def replicated(self, axes: tuple[str, ...]) -> tuple[str, ...]:
    """``O``: the mesh axes (of ``axes``, in their order) that split neither."""
    return tuple(a for a in axes if a not in self.rows + self.cols)

  def blocks(self, axes: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The mesh axes whose indices number a device's row block and its
    column block after step 1, each most significant first."""
    return self.rows, self.cols + self.replicated(axes)


def routable(shape: tuple[int, ...], devices: int) -> bool:
  """Whether ``(..., rows, cols)`` matrices can go through `at_owners` on a
  mesh of ``devices``, whichever their layouts: their columns divide into a
  block per device."""
  return shape[-1] % devices == 0


def _assembly(layout: MatrixLayout, sizes: dict[str, int], m: int, rows: int,
              cols: int) -> tuple[tuple[int, ...], list[int]]:
  """How the ``(n, m, rows · cols / n)`` pieces an owner receives (device
  ``s``'s piece of each of its ``m`` slots, devices in mesh order) become
  ``(m, rows, cols)`` matrices of ``layout``: the shape to read them as, and
  the transposition that puts row and column blocks in their places."""
  axes = tuple(sizes)
  row_axes, col_axes = layout.blocks(axes)
  piece = (rows // math.prod(sizes[a] for a in row_axes),
           cols // math.prod(sizes[a] for a in col_axes))
  k = len(axes)
  order = [k, *(axes.index(a) for a in row_axes), k + 1,
           *(axes.index(a) for a in col_axes), k + 2]
  return (*sizes.values(), m, *piece), order


def at_owners(f: Callable[[Any, jax.Array], jax.Array], owned: Any,
              matrices: list[jax.Array], layouts: list[MatrixLayout],
              slots: int, axes: tuple[str, ...],
              mesh: jax.sharding.Mesh | None = None,
              back: bool = True) -> list[jax.Array] | jax.Array:
  """``f`` applied on the owners of the slots that ``matrices`` fill.

  Args:
    f: ``(owned share, (m, rows, cols) matrices) -> (m, rows, cols)``, slot
      by slot (``m = slots / n``); any ``(m, ...)`` without ``back``.
    owned: a tree of ``(slots, ...)`` stacks split over ``axes`` (the
      factors), passed to ``f`` as each device's share.
    matrices: ``(k_i, rows, cols)`` arrays filling the first ``Σ k_i``
      slots in order, laid out as ``layouts`` say; `routable`.
    layouts: each matrix's `MatrixLayout`.
    slots: ``T``, a multiple of the devices.
    axes: every axis of the mesh, in its order (the slots' split).
    mesh: a concrete mesh, or None for the context mesh.
    back: whether the results return to the matrices' layouts (step 3);
      without, they stay on the owners.

  Returns:
    ``f``'s result for each matrix, in its shape and layout; without
    ``back``, the ``(slots, ...)`` stack of the results split over ``axes``
    like ``owned`` (the padding slots' from zero matrices).
  """
  context = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
  sizes = {a: context.shape[a] for a in axes}
  n = math.prod(sizes.values())
  m = slots // n
  rows, cols = matrices[0].shape[1:]
  counts = [len(x) for x in matrices]
  kinds = list(dict.fromkeys(layouts))  # the distinct layouts
  kind_of_slot = np.zeros(slots, np.int32)
  kind_of_slot[:sum(counts)] = np.repeat([kinds.index(l) for l in layouts], counts)
  split = PartitionSpec(axes)

  def cut(x, layout):  # step 1: (k, rows / |R|, cols / |C|) -> (k, rows · cols / n)
    for a in layout.replicated(axes):
      width = x.shape[2] // sizes[a]
      x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(a) * width, width, 2)
    return x.reshape(len(x), -1)

  def uncut(x, layout):  # step 1 backwards
    shape, _ = _assembly(layout, sizes, m, rows, cols)
    x = x.reshape(len(x), *shape[-2:])
    for a in layout.replicated(axes)[::-1]:
      x = jax.lax.all_gather(x, a, axis=2, tiled=True)
    return x

  def by_slot(kind, make):  # make(layout) for every slot of that layout
    result = make(kinds[0])
    for i, layout in enumerate(kinds[1:], 1):
      chosen = (kind == i).reshape(-1, *[1] * (result.ndim - 1))
      result = jnp.where(chosen, make(layout), result)
    return result

  def route(owned, kind, *pieces):
    pieces = [cut(x, layout) for x, layout in zip(pieces, layouts)]
    stack = jnp.concatenate(
        [*pieces, jnp.zeros((slots - sum(counts), pieces[0].shape[1]), pieces[0].dtype)])
    # Step 2: received[s, j] is device s's piece of my slot j.
    received = jax.lax.all_to_all(stack, axes, 0, 0, tiled=True).reshape(n, m, -1)

    def assemble(layout):
      shape, order = _assembly(layout, sizes, m, rows, cols)
      return received.reshape(shape).transpose(order).reshape(m, rows, cols)
    product = f(owned, by_slot(kind, assemble))
    if not back:
      return product

    def disassemble(layout):  # per slot (m, ...) first, as `by_slot` selects
      shape, order = _assembly(layout, sizes, m, rows, cols)
      blocks = product.reshape([shape[i] for i in order])
      return blocks.transpose(np.argsort(order)).reshape(n, m, -1).swapaxes(0, 1)
    outgoing = by_slot(kind, disassemble).swapaxes(0, 1).reshape(slots, -1)
    returned = jax.lax.all_to_all(outgoing, axes, 0, 0, tiled=True)
    parts = jnp.split(returned, np.cumsum(counts))[:-1]
    return tuple(uncut(x, layout) for x, layout in zip(parts, layouts))

  specs = tuple(layout.spec() for layout in layouts)
  # Replicated over O by the all-gathers, which the type check cannot see.
  routed = jax.shard_map(
      route, mesh=mesh, in_specs=(split, split, *specs),
      out_specs=specs if back else split, check_vma=False)(
          owned, jnp.asarray(kind_of_slot), *matrices)
  return list(routed) if back else routed


def summed_at_owners(f: Callable[[jax.Array], jax.Array], matrices: list[jax.Array],
                     layouts: list[MatrixLayout], slots: int, axes: tuple[str, ...],
                     mesh: jax.sharding.Mesh | None = None) -> jax.Array:
  """``Σ_row blocks f(block)`` of each slot's matrix, on the slot's owner.

  For matrices whose columns are whole on every device (``layout.cols``
  empty) and an ``f`` that sums over rows (a Gram ``Vᵀ V``): each device
  applies ``f`` to its own rows (its share of those an axis of ``O``
  replicates), and one all-to-all sends each slot's partial result to its
  owner, which adds them up. Each device sends the stack's partial results,
  ``slots`` of them, where `at_owners` sends its share of the matrices:
  cheaper when a result is smaller than a device's share of a matrix.

  Args:
    f: ``(k, rows / n, cols) -> (k, ...)``, additive over rows.
    matrices, layouts, slots, axes, mesh: as for `at_owners`; rows divide
      into a block per device.

  Returns:
    The ``(slots, ...)`` stack of the sums, split over ``axes``, zeros in
    the padding slots.
  """
  context = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
  sizes = {a: context.shape[a] for a in axes}
  n = math.prod(sizes.values())
  counts = [len(x) for x in matrices]

  def reduce(*pieces):
    partial = []
    for x, layout in zip(pieces, layouts):
      for a in layout.replicated(axes):  # devices sharing rows take a part each
        height = x.shape[1] // sizes[a]
        x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(a) * height, height, 1)
      partial.append(f(x))
    stack = jnp.concatenate(
        [*partial, jnp.zeros((slots - sum(counts), *partial[0].shape[1:]), partial[0].dtype)])
    received = jax.lax.all_to_all(stack, axes, 0, 0, tiled=True)
    return received.reshape(n, slots // n, *stack.shape[1:]).sum(0)

  return jax.shard_map(
      reduce, mesh=mesh, in_specs=tuple(layout.spec() for layout in layouts),
      out_specs=PartitionSpec(axes), check_vma=False)(*matrices)
