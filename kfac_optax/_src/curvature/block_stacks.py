"""Kronecker factors kept in stacks of one shape, each device owning a share.

In a sharded job every device holding every factor and inverse would cost
it the whole curvature. Instead the factors of Kronecker blocks (dense,
dense-general, einsum and conv layers: `blocks.KroneckerBlock`, also under
``nn.scan``/``nn.RNN``) with equal shapes form one stack per side,
``A: (T, *a_shape)`` and ``G: (T, *g_shape)``, one slot per independent
block (a layer, or each slice of a stacked layer), the slots padded to a
multiple ``T`` of the mesh's size. The leading axis is split over every
device of the mesh, so each device owns ``T / devices`` consecutive slots,
A and G of a slot together:

- statistics: each block's batch estimate is reduced into its slot, on the
  owner (`Layout.stack`); under Explicit axes the owner forms it from the
  layer's activation rows sent to it (`owner_statistics`);
- refresh: each device inverts its own slots (`distributed.StackSharding`
  with ``gather=False``), nothing is gathered;
- preconditioning: each block's gradient matrix ``V = [∇W; ∇b]`` goes to
  the owner of its slot, so ``A⁻¹ V G⁻¹`` is a batched product there; the
  product goes back to the params' layout (`linalg.owner_routing` where
  Explicit axes give the layouts, else stacked as arrays and left to XLA).

Equal shapes make every slot cost the same, so equal slot counts balance the
devices; the padding is at most one slot per device and group. Slots follow
the blocks' order and the padding trails, so a checkpoint's stacks fit any
mesh whose size divides ``T`` (8 → 4 devices, 2×4 → 4×2), and orbax pads or
truncates the trailing slots for others. On one device ``T`` is the number
of blocks: nothing is padded.

`BlockStacks` is the state's ``factors`` and ``inverses``: a mapping from
block key to that block's factors as before (sliced out of its stack), a
pytree whose leaves are the stacks. Blocks of other kinds (embeddings,
series, norms, the diagonal fallback) and every block when factors are kept
at a rank (``factor_rank``) stay whole, in the same mapping.
"""

import dataclasses
import math
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp

from kfac_optax._src import blocks
from kfac_optax._src import linalg
from kfac_optax._src.curvature import explicit_axes


def kronecker_core(block: Any) -> blocks.KroneckerBlock | None:
  """The `blocks.KroneckerBlock` inside ``block`` (through `blocks.StackedBlock`
  and `blocks.BatchMajor`), None for other blocks (a `blocks.SeriesBlock`
  included: its factors have lags)."""
  while isinstance(block, (blocks.StackedBlock, blocks.BatchMajor)):
    block = block.inner
  return block if type(block) is blocks.KroneckerBlock else None


def gradient_matrix(block: Any, grads: dict, dtype) -> jax.Array:
  """``block``'s ``V = [∇W; ∇b]``, with a leading axis per stacking level."""
  if isinstance(block, blocks.StackedBlock):
    return jax.vmap(lambda g: gradient_matrix(block.inner, g, dtype))(grads)
  if isinstance(block, blocks.BatchMajor):
    return gradient_matrix(block.inner, grads, dtype)
  return block.gradient_matrix(grads, dtype)


def gradient_matrix_spec(path: tuple[str, ...], block: Any,
                         flat: dict) -> jax.sharding.PartitionSpec | None:
  """How ``block``'s `gradient_matrix` of its leaves at ``path`` in
  ``flat`` (params-shaped, by leaf path) lies on the mesh, as the params'
  types or boxes place it (`explicit_axes.params_typed_spec`); None where
  unknown."""
  leaves = {path + (n,): flat[path + (n,)] for n in block.param_names}
  return explicit_axes.params_typed_spec(lambda typed: gradient_matrix(
      block, {n: typed[path + (n,)] for n in block.param_names}, jnp.float32), leaves)


def matrix_leaves(block: Any, matrix: jax.Array) -> dict:
  """The inverse of `gradient_matrix`."""
  if isinstance(block, blocks.StackedBlock):
    return jax.vmap(lambda m: matrix_leaves(block.inner, m))(matrix)
  if isinstance(block, blocks.BatchMajor):
    return matrix_leaves(block.inner, matrix)
  return block.matrix_leaves(matrix)


@dataclasses.dataclass(frozen=True)
class Group:
  """Blocks whose factors have one shape, in one stack.

  Attributes:
    keys: the blocks' keys, in slot order.
    leads: each block's leading (stack) axes: its slots are their product.
    slots: ``T``, the blocks' slots padded to a multiple of the devices.
    tails: the shape of one slot's A and of its G.
  """

  keys: tuple[str, ...]
  leads: tuple[tuple[int, ...], ...]
  slots: int
  tails: tuple[tuple[int, ...], tuple[int, ...]]

  @property
  def used(self) -> int:
    """The slots its blocks fill (the rest, up to ``slots``, are padding)."""
    return sum(math.prod(lead) for lead in self.leads)

  def offsets(self) -> Iterator[tuple[str, int, tuple[int, ...]]]:
    """``(key, first slot, leading axes)`` of each block."""
    offset = 0
    for key, lead in zip(self.keys, self.leads):
      yield key, offset, lead
      offset += math.prod(lead)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Which blocks are stacked, in which group and slot (static).

  Attributes:
    order: every block's key, in the plan's order.
    groups: the stacked blocks' groups.
  """

  order: tuple[str, ...]
  groups: tuple[Group, ...]

  @classmethod
  def of(cls, all_blocks: dict[str, Any], factors: dict[str, Any],
         devices: int, stacked: bool = True) -> "Layout":
    """The layout of ``factors`` (block key -> its factors, as ``init``
    makes them) over ``devices``; with ``stacked`` false none is stacked."""
    shapes: dict[tuple, list[tuple[str, tuple[int, ...]]]] = {}
    for key, block in all_blocks.items():
      core = kronecker_core(block)
      if not stacked or core is None:
        continue
      a, g = factors[key]
      tails = (a.shape[-1:] if core.diagonal_input else a.shape[-2:],
               g.shape[-1:] if core.diagonal_output else g.shape[-2:])
      lead = a.shape[:a.ndim - len(tails[0])]
      shapes.setdefault((tails, a.dtype), []).append((key, lead))
    groups = []
    for (tails, _), members in shapes.items():
      keys, leads = zip(*members)
      used = sum(math.prod(lead) for lead in leads)
      groups.append(Group(keys, leads, -(-used // devices) * devices, tails))
    return cls(tuple(all_blocks), tuple(groups))

  def stacked_keys(self) -> set[str]:
    return {key for group in self.groups for key in group.keys}

  def stack(self, per_block: Mapping[str, Any],
            placement: linalg.StackSharding | None) -> "BlockStacks":
    """``per_block`` (block key -> factors) in this layout, each stack
    split over the mesh by ``placement``."""
    stacked = self.stacked_keys()
    return BlockStacks(
        self, tuple(stack_group(group, per_block, placement) for group in self.groups),
        {key: per_block[key] for key in self.order if key not in stacked})


def stack_group(group: Group, per_block: Mapping[str, Any],
                placement: linalg.StackSharding | None) -> Any:
  """The entries of ``group``'s blocks in ``per_block`` (trees of arrays
  with the blocks' leading axes) as one tree of ``(T, ...)`` stacks, zeros
  in the padding slots, split over the mesh by ``placement``."""
  parts = [jax.tree.map(lambda x, lead=lead: x.reshape(math.prod(lead), *x.shape[len(lead):]),
                        per_block[key]) for key, _, lead in group.offsets()]
  stack = jax.tree.map(lambda *x: jnp.concatenate(
      [*x, jnp.zeros((group.slots - group.used, *x[0].shape[1:]), x[0].dtype)]), *parts)
  return stack if placement is None else placement.place(stack)


def unstack_group(group: Group, stack: Any) -> dict[str, Any]:
  """The inverse of `stack_group`: block key -> its entry."""
  return {key: jax.tree.map(
      lambda s, offset=offset, lead=lead:
      s[offset:offset + math.prod(lead)].reshape(*lead, *s.shape[1:]), stack)
          for key, offset, lead in group.offsets()}


def _entry(group: Group, stack: Any, key: str, shape_only: bool = False) -> Any:
  """Block ``key``'s factors (or their shapes) from its group's stacks,
  which may carry leading axes of their own (a state under ``jax.vmap``)."""
  offset, lead = next((o, l) for k, o, l in group.offsets() if k == key)

  def take(x, tail):
    axis = len(x.shape) - len(tail) - 1
    shape = (*x.shape[:axis], *lead, *tail)
    if shape_only:
      return shape
    if isinstance(x, jax.ShapeDtypeStruct):  # a state from jax.eval_shape
      return jax.ShapeDtypeStruct(shape, x.dtype)
    return jax.lax.slice_in_dim(x, offset, offset + math.prod(lead), axis=axis
                                ).reshape(shape)
  return blocks.KroneckerFactors(*(take(x, tail) for x, tail in zip(stack, group.tails)))


@jax.tree_util.register_pytree_with_keys_class
class BlockStacks:
  """Block key -> factors (or inverses), the Kronecker ones held in stacks.

  ``stacks[i]`` is `Layout.groups` ``[i]``'s `blocks.KroneckerFactors` of
  stacks; ``rest`` the other blocks' entries. Indexing by a block key gives
  that block's entry in its own shape (sliced out of its stack); ``keys``,
  ``items`` and ``in`` read like a dict's. Not a `Mapping`: tree utilities
  that take mappings for dicts (orbax's) must see the stacks, not slices.
  """

  def __init__(self, layout: Layout, stacks: tuple, rest: dict):
    self.layout, self.stacks, self.rest = layout, tuple(stacks), rest

  def __getitem__(self, key: str) -> Any:
    if key in self.rest:
      return self.rest[key]
    for group, stack in zip(self.layout.groups, self.stacks):
      if key in group.keys:
        return _entry(group, stack, key)
    raise KeyError(key)

  def __iter__(self) -> Iterator[str]:
    return iter(self.layout.order)

  def __len__(self) -> int:
    return len(self.layout.order)

  def __contains__(self, key: Any) -> bool:
    return key in self.layout.order

  def keys(self) -> tuple[str, ...]:
    return self.layout.order

  def items(self) -> Iterator[tuple[str, Any]]:
    return ((key, self[key]) for key in self.layout.order)

  def __repr__(self) -> str:
    return f"BlockStacks(stacks={self.stacks!r}, rest={self.rest!r})"

  def __eq__(self, other: Any) -> bool:  # as a pytree, not by slicing stacks
    return (isinstance(other, BlockStacks) and self.layout == other.layout
            and self.stacks == other.stacks and self.rest == other.rest)

  __hash__ = None

  def shapes(self) -> dict[str, Any]:
    """Each block's entry as shapes, without slicing a stack."""
    found = {key: jax.tree.map(jnp.shape, value) for key, value in self.rest.items()}
    for group, stack in zip(self.layout.groups, self.stacks):
      for key in group.keys:
        found[key] = _entry(group, stack, key, shape_only=True)
    return {key: found[key] for key in self.layout.order}

  def replace(self, stacks: tuple, rest: dict) -> "BlockStacks":
    return BlockStacks(self.layout, stacks, rest)

  def tree_flatten_with_keys(self):
    keys = [jax.tree_util.DictKey(f"stack{i}") for i in range(len(self.stacks))]
    children = list(zip(keys, self.stacks))
    children.append((jax.tree_util.GetAttrKey("rest"), self.rest))
    return children, self.layout

  @classmethod
  def tree_unflatten(cls, layout: Layout, children: list) -> "BlockStacks":
    return cls(layout, tuple(children[:-1]), children[-1])


def interleave(pair: Any) -> Any:
  """A pair (e.g. `blocks.KroneckerFactors`) of trees of ``(T, ...)`` stacks
  of one shape as one tree of ``(2T, ...)`` stacks, slot by slot: a device's
  share of the slots stays on it. None for None."""
  if pair is None:
    return None
  return jax.tree.map(lambda x, y: jnp.stack([x, y], 1).reshape(-1, *x.shape[1:]),
                      *pair)


def deinterleave(stack: jax.Array) -> blocks.KroneckerFactors:
  """The inverse of `interleave`, for an array."""
  pairs = stack.reshape(-1, 2, *stack.shape[1:])
  return blocks.KroneckerFactors(pairs[:, 0], pairs[:, 1])


def shapes(factors: Any) -> dict[str, Any]:
  """Each block's factors as shapes (a `BlockStacks` or a plain dict)."""
  if isinstance(factors, BlockStacks):
    return factors.shapes()
  return {key: jax.tree.map(jnp.shape, value) for key, value in factors.items()}
