"""Blocks of layers under flax's lifted transforms: stacks and time axes.

A layer under ``nn.scan``/``nn.vmap`` over params (or NNX's ``nnx.scan`` of
an ``nnx.vmap``-made stack) is a stack of independent layers: one block per
slice (`StackedBlock`). A layer applied at every step of an ``nn.RNN`` or
``nn.scan`` over time gets its captured arrays time-major; `BatchMajor`
hands them to its block example-major, as the loss's mask is.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class BatchMajor:
  """The block of a layer applied at every step of an nn.RNN/nn.scan over time.

  The lifted transform stacks the layer's captured arrays along a leading
  time axis, ``(T, N, ...)`` (gradients ``(K, T, N, ...)``), while losses
  are batch-major (a mask ``(N, T)``). ``inner`` gets them as ``(N, T, ...)``,
  so its rows are example-major and `losses.Terms` masks line up with them.

  Attributes:
    inner: the block of the layer (`KroneckerBlock` or `SeriesBlock`).
  """

  inner: Any

  @property
  def param_names(self) -> tuple[str, ...]:
    return self.inner.param_names

  def init(self):
    return self.inner.init()

  def statistics(self, inputs, output_grads, terms):
    # An unbatched layer input, (T, features), has no batch axis to swap.
    swap = lambda x, axis: jnp.swapaxes(x, axis, axis + 1) if x.ndim > axis + 2 else x
    return self.inner.statistics([swap(x, 0) for x in inputs],
                                 [swap(g, 1) for g in output_grads], terms)

  def damped(self, factors, damping):
    return self.inner.damped(factors, damping)

  def precondition(self, inverses, grads):
    return self.inner.precondition(inverses, grads)


@dataclasses.dataclass(frozen=True)
class StackedBlock:
  """One independent block per slice of a leading layer axis.

  For a layer under ``nn.scan`` (or ``nn.vmap`` over params): its params,
  captured inputs and output gradients all carry a leading axis of size
  ``num_layers``, and every slice gets its own ``inner`` block; statistics,
  inverses and preconditioning are vmapped over the slices.

  Attributes:
    inner: the block of one slice.
    num_layers: the size of the leading axis.
  """

  inner: Any
  num_layers: int

  @property
  def param_names(self) -> tuple[str, ...]:
    return self.inner.param_names

  def init(self):
    return jax.tree.map(lambda x: jnp.repeat(x[None], self.num_layers, 0),
                        self.inner.init())

  def statistics(self, inputs, output_grads, terms):
    return jax.vmap(lambda i, g: self.inner.statistics(i, g, terms),
                    in_axes=(0, 1))(tuple(inputs), tuple(output_grads))

  def damped(self, factors, damping):
    return jax.vmap(lambda f: self.inner.damped(f, damping))(factors)

  def precondition(self, inverses, grads):
    return jax.vmap(self.inner.precondition)(inverses, grads)
