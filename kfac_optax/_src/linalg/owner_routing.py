"""Matrices moved from the params' layout to the devices that own their
slots, and back.

A stack of ``T`` slots split over every device of the mesh (``P(axes)`` on
its leading axis) is owned ``m = T / n`` consecutive slots per device. To
apply a slot's factors to a gradient matrix ``V`` (``rows × cols``), the
owner needs all of ``V``, while each device holds a piece of it: ``V``'s
rows split over the mesh axes ``R`` and its columns over ``C`` (FSDP and
tensor parallelism), replicated over the rest ``O``. Stacking the matrices
as arrays leaves the move to XLA, which all-gathers the whole stack on every
device. `at_owners` moves them with two all-to-alls instead, each device
sending and receiving about its own share of the matrices:

1. each piece is cut to ``rows × cols / n``: an all-to-all over each axis of
   ``R`` trades row blocks for column blocks, and over ``O`` each device
   keeps its own column block. Block ``b`` of ``V``'s ``n`` column blocks
   is then held by the device whose indices, read as one number with
   digits in the order ``C, reversed R, O``, make ``b``;
2. the pieces of all slots are stacked, and one all-to-all over every axis
   sends each slot's ``n`` pieces to its owner, which puts them in column
   order (a per-slot permutation, read from a table split like the slots);
3. the owner applies ``f``, and the same moves run backwards (an
   all-gather over ``O`` where step 1 kept one block).

Every matrix has its own layout; the tables make one all-to-all serve them
all. Columns must divide into ``n`` blocks (`routable`).
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

  def digits(self, axes: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes whose indices number a device's column block after
    step 1, most significant first."""
    return self.cols + self.rows[::-1] + self.replicated(axes)


def routable(shape: tuple[int, ...], devices: int) -> bool:
  """Whether ``(..., rows, cols)`` matrices can go through `at_owners` on a
  mesh of ``devices``: their columns divide into a block per device."""
  return shape[-1] % devices == 0


def _block_tables(layouts: list[MatrixLayout], counts: list[int], slots: int,
                  sizes: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
  """``(slots, n)`` tables: ``source[t, b]``, the device (mesh-order linear
  index) holding column block ``b`` of slot ``t``'s matrix after step 1, and
  ``block[t, s]``, the block device ``s`` holds. Padding slots: identity."""
  axes = tuple(sizes)
  n = math.prod(sizes.values())
  coords = np.array(list(np.ndindex(*sizes.values())))  # device s -> indices
  block = np.tile(np.arange(n), (slots, 1))
  t = 0
  for layout, count in zip(layouts, counts):
    digits = layout.digits(axes)
    radix = [sizes[a] for a in digits]
    weights = np.array([math.prod(radix[i + 1:]) for i in range(len(radix))])
    of_device = coords[:, [axes.index(a) for a in digits]] @ weights
    block[t:t + count] = of_device
    t += count
  source = np.argsort(block, axis=1)
  return source.astype(np.int32), block.astype(np.int32)


def at_owners(f: Callable[[Any, jax.Array], jax.Array], owned: Any,
              matrices: list[jax.Array], layouts: list[MatrixLayout],
              slots: int, axes: tuple[str, ...],
              mesh: jax.sharding.Mesh | None = None) -> list[jax.Array]:
  """``f`` applied on the owners of the slots that ``matrices`` fill.

  Args:
    f: ``(owned share, (m, rows, cols) matrices) -> (m, rows, cols)``, slot
      by slot (``m = slots / n``).
    owned: a tree of ``(slots, ...)`` stacks split over ``axes`` (the
      factors), passed to ``f`` as each device's share.
    matrices: ``(k_i, rows, cols)`` arrays filling the first ``Σ k_i``
      slots in order, laid out as ``layouts`` say; `routable`.
    layouts: each matrix's `MatrixLayout`.
    slots: ``T``, a multiple of the devices.
    axes: every axis of the mesh, in its order (the slots' split).
    mesh: a concrete mesh, or None for the context mesh.

  Returns:
    ``f``'s result for each matrix, in its shape and layout.
  """
  context = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
  sizes = {a: context.shape[a] for a in axes}
  n = math.prod(sizes.values())
  counts = [len(m) for m in matrices]
  source, block = _block_tables(layouts, counts, slots, sizes)
  split = PartitionSpec(axes)

  def cut(x, layout):  # step 1: (k, rows / |R|, cols / |C|) -> (k, rows, cols / n)
    for a in layout.rows[::-1]:
      x = jax.lax.all_to_all(x, a, 2, 1, tiled=True)
    for a in layout.replicated(axes):
      width = x.shape[2] // sizes[a]
      x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(a) * width, width, 2)
    return x

  def uncut(x, layout):  # step 1 backwards
    for a in layout.replicated(axes)[::-1]:
      x = jax.lax.all_gather(x, a, axis=2, tiled=True)
    for a in layout.rows:
      x = jax.lax.all_to_all(x, a, 1, 2, tiled=True)
    return x

  def route(owned, source, block, *pieces):
    pieces = [cut(x, layout) for x, layout in zip(pieces, layouts)]
    rows, width = pieces[0].shape[1:]
    m = slots // n
    stack = jnp.concatenate(
        [*pieces, jnp.zeros((slots - sum(counts), rows, width), pieces[0].dtype)])
    # Step 2: received[s, j] is device s's piece of my slot j.
    received = jax.lax.all_to_all(stack, axes, 0, 0, tiled=True).reshape(n, m, rows, width)
    ordered = jnp.take_along_axis(received.transpose(1, 0, 2, 3),
                                  source[:, :, None, None], axis=1)
    product = f(owned, ordered.transpose(0, 2, 1, 3).reshape(m, rows, n * width))
    blocks = product.reshape(m, rows, n, width).transpose(0, 2, 1, 3)
    outgoing = jnp.take_along_axis(blocks, block[:, :, None, None], axis=1)
    back = jax.lax.all_to_all(outgoing.transpose(1, 0, 2, 3).reshape(slots, rows, width),
                              axes, 0, 0, tiled=True)
    parts = jnp.split(back, np.cumsum(counts))[:-1]
    return tuple(uncut(x, layout) for x, layout in zip(parts, layouts))

  specs = tuple(layout.spec() for layout in layouts)
  # Replicated over O by the all-gathers, which the type check cannot see.
  return list(jax.shard_map(
      route, mesh=mesh, in_specs=(split, split, split, *specs), out_specs=specs,
      check_vma=False)(
          owned, jnp.asarray(source), jnp.asarray(block), *matrices))
