"""A function over a stack of matrices, split over the devices of a mesh.

The inverse refresh stacks factors of similar size (`stacked_inverses`);
`map_over_stack` applies one matrix's computation to every entry of such a
stack, each device computing its share when a `StackSharding` is given,
then gathers the results on every device, or leaves each device its share
(``gather=False``: the stacks of `curvature.block_stacks`, which live split).
"""

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class StackSharding:
  """Shards a stack of matrices along its leading axis over every mesh axis.

  Attributes:
    axes: the mesh axis names the stack axis is split over.
    num_shards: the product of their sizes; stacks are padded to a multiple.
    mesh: a concrete mesh, or ``None`` to use the context mesh (``jax.set_mesh``).
    gather: whether `map` gathers its results on every device.
  """

  axes: tuple[str, ...]
  num_shards: int
  mesh: jax.sharding.Mesh | None = None
  gather: bool = True

  def _sharding(self, spec: PartitionSpec) -> Any:
    return spec if self.mesh is None else NamedSharding(self.mesh, spec)

  def map(self, f: Callable[..., jax.Array], *stacks: jax.Array) -> jax.Array:
    """``f`` on each device's ``1/num_shards`` of the stacks, then all-gathered
    (unless not ``gather``)."""
    spec = PartitionSpec(self.axes)
    local = jax.shard_map(f, mesh=self.mesh, in_specs=spec, out_specs=spec)(*stacks)
    if not self.gather:
      return local
    return jax.lax.with_sharding_constraint(local, self._sharding(PartitionSpec()))

  def place(self, tree: Any) -> Any:
    """Every leaf of ``tree`` split along its leading axis over the mesh
    (leaves whose leading axis does not divide into ``num_shards`` are left
    to XLA: a state made for another mesh still runs, unsplit)."""
    split = self._sharding(PartitionSpec(self.axes))
    return jax.tree.map(
        lambda x: constrain(x, split)
        if x.ndim and x.shape[0] % self.num_shards == 0 else x, tree)


def constrain(x: jax.Array, sharding: Any) -> jax.Array:
  """``x`` placed by ``sharding`` (a `PartitionSpec` of the context mesh,
  or a `NamedSharding`): under Explicit axes a sharding is part of the
  type, so ``x`` is moved (`jax.sharding.reshard`); under Auto ones XLA is
  told (`jax.lax.with_sharding_constraint`)."""
  context = jax.sharding.get_abstract_mesh()
  if jax.sharding.AxisType.Explicit in context.axis_types:
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


# Set while the model's own Explicit axes placed the rows (`rows_over_mesh`).
_ROWS_TYPED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "kfac_optax_rows_typed", default=False)


@contextlib.contextmanager
def rows_typed() -> Iterator[None]:
  """Within, `rows_over_mesh` leaves rows as they are: the model's Explicit
  axes placed them (batch over its axes), and splitting them again moved
  features between devices (the tiled statistics step of
  `benchmarks/sharded_state.py` under Explicit axes, 2 × 4: 8.3 MB with the
  split, 5.6 without)."""
  token = _ROWS_TYPED.set(True)
  try:
    yield
  finally:
    _ROWS_TYPED.reset(token)


def rows_over_mesh(rows: jax.Array) -> jax.Array:
  """``(S, R, d)`` rows of a statistic split over every device of the
  context mesh along ``R`` (where it divides), so that each device forms
  the partial Gram of its rows and XLA sums them, instead of gathering rows
  for a Gram placed elsewhere. The tiled factors' statistics step of
  `benchmarks/sharded_state.py` under Auto axes (2 × 4) sent 4.5 MB with
  it, 13.1 without (the capture pass's activations placed differently too).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if (_ROWS_TYPED.get() or mesh.empty or mesh.size == 1 or mesh.manual_axes
      or rows.shape[1] % mesh.size):
    return rows
  return constrain(rows, PartitionSpec(None, mesh.axis_names, None))


def stack_sharding(mesh: jax.sharding.Mesh | None) -> StackSharding | None:
  """How inverse stacks are distributed: over ``mesh``, else the context mesh.

  Returns ``None`` (no distribution) without a mesh, on a single device,
  and inside ``pmap`` or ``shard_map`` (manual axes: each device runs the
  step on its own share, `curvature.replicas`). Inside a context mesh
  `StackSharding.map` uses it (as an abstract mesh), which also holds under
  `jax.sharding.auto_axes` (see `curvature.explicit_axes`).
  """
  context = jax.sharding.get_abstract_mesh()
  if context.manual_axes:
    return None
  if not context.empty:
    axes, size, concrete = context.axis_names, context.size, None
  elif mesh is not None:
    axes, size, concrete = mesh.axis_names, mesh.size, mesh
  else:
    return None
  if size == 1:
    return None
  return StackSharding(tuple(axes), size, concrete)


def map_over_stack(each: Callable[..., Any], stacks: tuple,
                   stack_sharding: StackSharding | None,
                   batched: bool = False) -> Any:
  """``each`` over the leading axis of ``stacks``, split over devices if sharded.

  With ``stack_sharding`` the stacks are padded to a multiple of its
  ``num_shards`` (with copies of their first entry, skipped on CPU unless
  ``batched``), so every device handles an equal share; the results are
  gathered back. ``batched``: ``each`` takes whole stacks (a device's
  share) instead of one matrix each.
  """
  if batched:
    run = lambda *s, real=None: each(*s)
  else:
    run = functools.partial(over_stack, each)
  if stack_sharding is None:
    return run(*stacks)
  count = len(stacks[0])
  extra = -count % stack_sharding.num_shards
  padded = [jnp.concatenate([s, jnp.broadcast_to(s[:1], (extra, *s.shape[1:]))])
            for s in stacks]
  real = jnp.arange(count + extra) < count
  return stack_sharding.map(lambda r, *s: run(*s, real=r), real, *padded)


def over_stack(each, *stacks: jax.Array, real: jax.Array | None = None) -> Any:
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
