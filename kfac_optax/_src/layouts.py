"""Layouts: how a layer's arrays map onto the rows of a Kronecker block.

A Kronecker block sees a layer as ``S`` independent matrix multiplications
``s = a W`` stacked along a leading axis (``S = 1`` for a plain dense layer;
the groups of a grouped convolution; the batch slices of a ``DenseGeneral``
with ``batch_dims``). A layout turns

- the layer input into rows ``ā`` of shape ``(S, R, in_dim)``,
- output gradients (leading cotangent axis K) into rows ``(S, K·R, out_dim)``,
- the kernel into ``(S, in_dim, out_dim)`` and the bias into ``(S, out_dim)``,

and back. A layout also names the layer's kernel and bias leaves and says how
the kernel is stored, so layers written outside flax (e.g. a kernel kept as
``(out, in)``) map onto the same blocks. Layouts are plain frozen dataclasses
of ints, strings and tuples (hashable, no flax), built from a module's
configuration in `models.kinds`, or by a user's layout function given to
`kfac_optax.register_layer`.
"""

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp

KERNEL_ORDERS = ("in_out", "out_in")


def _size(shape) -> int:
  return int(math.prod(shape))


def _matrices(x: jax.Array, stacks: int, rows: int, cols: int) -> jax.Array:
  """``x`` as ``(stacks, rows, cols)``; one stack in two steps, merging
  axes then adding the stack's, which Explicit axes' sharding types can
  follow (a kernel whose heads are split over the mesh keeps a typed
  layout, `curvature.tile_placement`)."""
  if stacks == 1:
    return x.reshape(rows, cols)[None]
  return x.reshape(stacks, rows, cols)


def reach(kernel_size, kernel_dilation) -> list[int]:
  """The input extent of a dilated kernel, per spatial axis."""
  return [(k - 1) * d + 1 for k, d in zip(kernel_size, kernel_dilation)]


@dataclasses.dataclass(frozen=True)
class DenseLayout:
  """``y = x · kernel`` contracting ``input_axes`` of x (Dense, DenseGeneral).

  The kernel has shape ``(*batch_shape, *in_features, *out_features)``; the
  output ``(*batch_shape, *other x axes, *out_features)``. Every position of
  the other axes is a row; each batch index is its own stack slice.

  Attributes:
    input_axes: the contracted axes of x, counted from the end (negative),
      in kernel order, so one layout serves inputs of any rank.
    batch_axes: the axes of x that index the kernel's batch slices
      (non-negative: flax's batch_dims are leading axes).
    in_features: shape of the contracted axes.
    out_features: shape of the output feature axes (the last axes of y).
    batch_shape: shape of the batch axes (``()`` for none).
    kernel_order: ``"in_out"`` (flax) or ``"out_in"``: the order of the
      kernel's feature axes.
    kernel_name: the layer's kernel param.
    bias_name: the layer's bias param (used when the layer has one), or None.
  """

  input_axes: tuple[int, ...]
  batch_axes: tuple[int, ...]
  in_features: tuple[int, ...]
  out_features: tuple[int, ...]
  batch_shape: tuple[int, ...] = ()
  kernel_order: str = "in_out"
  kernel_name: str = "kernel"
  bias_name: str | None = "bias"

  @property
  def num_stacks(self) -> int:
    return _size(self.batch_shape)

  @property
  def in_dim(self) -> int:
    return _size(self.in_features)

  @property
  def out_dim(self) -> int:
    return _size(self.out_features)

  def input_rows(self, x: jax.Array) -> jax.Array:
    contracted = [a % x.ndim for a in self.input_axes]
    others = [a for a in range(x.ndim)
              if a not in contracted and a not in self.batch_axes]
    x = jnp.transpose(x, (*self.batch_axes, *others, *contracted))
    if not self.batch_axes:  # in two steps, which Explicit axes' types can follow
      return x.reshape(-1, self.in_dim)[None]
    return x.reshape(self.num_stacks, -1, self.in_dim)

  def output_rows(self, g: jax.Array) -> jax.Array:
    """``g``: ``(K, *batch_shape, ..., *out_features)``."""
    g = jnp.moveaxis(g, 0, len(self.batch_shape))
    return g.reshape(self.num_stacks, -1, self.out_dim)

  @property
  def kernel_shape(self) -> tuple[int, ...]:
    features = (self.in_features, self.out_features)
    if self.kernel_order == "out_in":
      features = features[::-1]
    return (*self.batch_shape, *features[0], *features[1])

  @property
  def bias_shape(self) -> tuple[int, ...]:
    return (*self.batch_shape, *self.out_features)

  def kernel_matrix(self, kernel: jax.Array) -> jax.Array:
    if self.kernel_order == "out_in":
      return jnp.swapaxes(_matrices(kernel, self.num_stacks, self.out_dim, self.in_dim), 1, 2)
    return _matrices(kernel, self.num_stacks, self.in_dim, self.out_dim)

  def kernel_from_matrix(self, matrix: jax.Array) -> jax.Array:
    if self.kernel_order == "out_in":
      matrix = jnp.swapaxes(matrix, 1, 2)
    return matrix.reshape(self.kernel_shape)

  def bias_matrix(self, bias: jax.Array) -> jax.Array:
    return bias.reshape(self.num_stacks, self.out_dim)

  def bias_from_matrix(self, matrix: jax.Array) -> jax.Array:
    return matrix.reshape(self.bias_shape)


def dense(in_dim: int, out_dim: int, **names_and_order) -> DenseLayout:
  """The layout of ``nn.Dense``: contract the last axis.

  Args:
    in_dim, out_dim: the input and output feature sizes.
    **names_and_order: ``kernel_order``, ``kernel_name``, ``bias_name`` (see
      `DenseLayout`).

  Example:
    >>> dense(4, 3, kernel_order="out_in").kernel_shape
    (3, 4)
  """
  return DenseLayout((-1,), (), (in_dim,), (out_dim,), **names_and_order)


def _inverse(permutation) -> tuple[int, ...]:
  return tuple(sorted(range(len(permutation)), key=permutation.__getitem__))


@dataclasses.dataclass(frozen=True)
class EinsumLayout:
  """``y = einsum("x,kernel->y", x, kernel) (+ bias)``: flax's ``Einsum``.

  Each label of the equation plays one part: in x and the kernel only, it is
  contracted (an input feature); in the kernel and y only, an output
  feature; in all three, a stack index (one block per index, as
  DenseGeneral's batch_dims); in x and y only, a row index. Every position of
  the row axes is a row, and so is every position of leading axes that x and
  y have beyond the equation (time steps that nn.RNN stacks, a "..."). The
  kernel matrix has the contracted labels as rows and the features as
  columns, each in kernel order, so ``"btd,dk->btk"`` is ``nn.Dense``'s
  layout; flax's bias has y's kernel labels, in y's order.

  Attributes:
    x_labels, kernel_labels, out_labels: one label per axis of each operand
      (a leading "..." of x and y dropped), as `einsum_labels` parses them.
    sizes: ``(label, size)`` for every label.
  """

  x_labels: str
  kernel_labels: str
  out_labels: str
  sizes: tuple[tuple[str, int], ...]
  kernel_name: str = "kernel"
  bias_name: str | None = "bias"

  def _labels(self, part: str) -> str:
    x, kernel, out = self.x_labels, self.kernel_labels, self.out_labels
    if part == "rows":
      return "".join(c for c in x if c in out and c not in kernel)
    in_x, in_out = {"stack": (True, True), "contracted": (True, False),
                    "features": (False, True)}[part]
    return "".join(c for c in kernel if (c in x) == in_x and (c in out) == in_out)

  def _shape(self, labels: str) -> tuple[int, ...]:
    return tuple(dict(self.sizes)[c] for c in labels)

  @property
  def num_stacks(self) -> int:
    return _size(self._shape(self._labels("stack")))

  @property
  def in_dim(self) -> int:
    return _size(self._shape(self._labels("contracted")))

  @property
  def out_dim(self) -> int:
    return _size(self._shape(self._labels("features")))

  @property
  def kernel_shape(self) -> tuple[int, ...]:
    return self._shape(self.kernel_labels)

  @property
  def _bias_labels(self) -> str:
    return "".join(c for c in self.out_labels if c in self.kernel_labels)

  @property
  def bias_shape(self) -> tuple[int, ...]:
    return self._shape(self._bias_labels)

  def _rows(self, array: jax.Array, labels: str, first: tuple, columns: str) -> jax.Array:
    """``array`` (its last axes labelled) as ``(S, rows, columns)``: stack
    axes, then the ``first`` axes, the leading extra axes and the row labels."""
    extra = array.ndim - len(labels)
    at = lambda part: [extra + labels.index(c) for c in self._labels(part)]
    leading = [a for a in range(extra) if a not in first]
    order = [*at("stack"), *first, *leading, *at("rows"), *[extra + labels.index(c)
                                                          for c in columns]]
    return jnp.transpose(array, order).reshape(self.num_stacks, -1, _size(
        self._shape(columns)))

  def input_rows(self, x: jax.Array) -> jax.Array:
    return self._rows(x, self.x_labels, (), self._labels("contracted"))

  def output_rows(self, g: jax.Array) -> jax.Array:
    """``g``: ``(K, ..., *y axes)``; rows K-major within each stack slice."""
    return self._rows(g, self.out_labels, (0,), self._labels("features"))

  def _kernel_order(self) -> tuple[int, ...]:
    parts = "".join(self._labels(p) for p in ("stack", "contracted", "features"))
    return tuple(self.kernel_labels.index(c) for c in parts)

  def kernel_matrix(self, kernel: jax.Array) -> jax.Array:
    return _matrices(jnp.transpose(kernel, self._kernel_order()), self.num_stacks,
                     self.in_dim, self.out_dim)

  def kernel_from_matrix(self, matrix: jax.Array) -> jax.Array:
    order = self._kernel_order()
    shape = tuple(self.kernel_shape[a] for a in order)
    return jnp.transpose(matrix.reshape(shape), _inverse(order))

  def _bias_order(self) -> tuple[int, ...]:
    parts = self._labels("stack") + self._labels("features")
    return tuple(self._bias_labels.index(c) for c in parts)

  def bias_matrix(self, bias: jax.Array) -> jax.Array:
    return jnp.transpose(bias, self._bias_order()).reshape(self.num_stacks, self.out_dim)

  def bias_from_matrix(self, matrix: jax.Array) -> jax.Array:
    order = self._bias_order()
    shape = tuple(self.bias_shape[a] for a in order)
    return jnp.transpose(matrix.reshape(shape), _inverse(order))


def einsum_labels(equation: str) -> tuple[str, str, str] | None:
  """``(x, kernel, y)`` labels of ``"x,kernel->y"``, or None where the
  equation is not a stack of matrix products that `EinsumLayout` expresses:
  a label repeated within an operand (a diagonal), in one operand only (a
  sum over it), a "..." anywhere but leading both x and y."""
  operands, _, out = equation.replace(" ", "").partition("->")
  x, _, kernel = operands.partition(",")
  if x.startswith("...") and out.startswith("..."):
    x, out = x[3:], out[3:]
  operands = (x, kernel, out)
  if not all(o.isalpha() and len(set(o)) == len(o) for o in operands if o):
    return None
  for i, labels in enumerate(operands):
    others = set("".join(operands[:i] + operands[i + 1:]))
    if not set(labels) <= others:
      return None
  return operands


@dataclasses.dataclass(frozen=True)
class ConvLayout:
  """An N-d convolution, channels last (KFC, Grosse & Martens 2016).

  Rows are the im2col patches of every output location (padding included),
  flattened in the kernel's own order ``(*kernel_size, c_in / groups)``, so
  ``patches @ kernel.reshape(-1, c_out)`` is the convolution. Each of the
  ``feature_group_count`` groups is one stack slice.

  Attributes:
    kernel_size: spatial kernel shape.
    strides, input_dilation, kernel_dilation: per spatial axis.
    padding: ``"SAME"``, ``"VALID"`` or explicit ``((lo, hi), ...)``.
    pre_padding: ``"wrap"``, ``"reflect"`` or ``"causal"``: flax pads the
      input this way, then convolves with VALID (CIRCULAR, REFLECT, CAUSAL).
    in_channels, out_channels: total channel counts.
    groups: ``feature_group_count``.
    kernel_name: the layer's kernel param, shaped like flax's
      ``(*kernel_size, in_channels / groups, out_channels)``.
    kernel_flipped: the kernel param is stored as ``lax.conv_transpose``
      takes it with ``transpose_kernel=True``: ``(*kernel_size,
      out_channels, in_channels)``, convolved flipped along every spatial
      axis and with its two channel axes swapped (``groups`` 1).
    bias_name: the layer's bias param (used when the layer has one), or None.
  """

  kernel_size: tuple[int, ...]
  strides: tuple[int, ...]
  input_dilation: tuple[int, ...]
  kernel_dilation: tuple[int, ...]
  padding: str | tuple[tuple[int, int], ...]
  pre_padding: str | None
  in_channels: int
  out_channels: int
  groups: int = 1
  kernel_name: str = "kernel"
  bias_name: str | None = "bias"
  kernel_flipped: bool = False
  expands_input = True  # patches are ~prod(kernel_size) x the input: chunk them

  @property
  def num_stacks(self) -> int:
    return self.groups

  @property
  def in_dim(self) -> int:
    return _size(self.kernel_size) * self.in_channels // self.groups

  @property
  def out_dim(self) -> int:
    return self.out_channels // self.groups

  def _padded(self, x: jax.Array) -> jax.Array:
    dilated = reach(self.kernel_size, self.kernel_dilation)
    if self.pre_padding == "causal":
      pads = [(dilated[0] - 1, 0)]
    else:
      pads = [((k - 1) // 2, k // 2) for k in dilated]
    mode = {"causal": "constant"}.get(self.pre_padding, self.pre_padding)
    return jnp.pad(x, [(0, 0), *pads, (0, 0)], mode=mode)

  def padded_input(self, x: jax.Array) -> jax.Array:
    """``x`` with leading batch axes merged (flax merges them too) and the
    layer's padding and input dilation applied: the array whose strided
    windows are the patches, ``(N, *padded_spatial, in_channels)``."""
    rank = len(self.kernel_size)
    x = x.reshape(-1, *x.shape[-rank - 1:])
    if self.pre_padding is not None:
      x = self._padded(x)
    padding = "VALID" if self.pre_padding is not None else self.padding
    if isinstance(padding, str):  # lax allows string padding only undilated
      padding = jax.lax.padtype_to_pads(
          x.shape[1:-1], reach(self.kernel_size, self.kernel_dilation), self.strides, padding)
    return jax.lax.pad(x, jnp.zeros((), x.dtype), [
        (0, 0, 0), *[(lo, hi, d - 1) for (lo, hi), d in zip(padding, self.input_dilation)],
        (0, 0, 0)])

  def windows(self, padded: jax.Array, axes: slice = slice(None)) -> jax.Array:
    """The kernel's windows over ``padded`` along spatial ``axes`` (the other
    spatial axes are kept whole): ``(N, *outputs, taps, groups, c_in / groups)``
    with taps in the kernel's order.

    im2col by strided slices: plain copies, any rank; on CPU the benchmark
    convnet's step is 17% faster than with lax's patches (a convolution with
    an identity kernel).
    """
    rank = len(self.kernel_size)
    spatial = [i in range(rank)[axes] for i in range(rank)]
    kernel = [k if s else 1 for k, s in zip(self.kernel_size, spatial)]
    dilation = [d if s else 1 for d, s in zip(self.kernel_dilation, spatial)]
    strides = [t if s else 1 for t, s in zip(self.strides, spatial)]
    outputs = [(n - k) // s + 1 for n, k, s in zip(padded.shape[1:-1], reach(kernel, dilation),
                                                    strides)]
    taps = []  # one strided slice per kernel offset, in the kernel's order
    for offset in itertools.product(*map(range, kernel)):
      start = [o * d for o, d in zip(offset, dilation)]
      limit = [b + (n - 1) * s + 1 for b, n, s in zip(start, outputs, strides)]
      taps.append(jax.lax.slice(padded, (0, *start, 0),
                                (padded.shape[0], *limit, padded.shape[-1]), (1, *strides, 1)))
    return jnp.stack(taps, -2).reshape(*taps[0].shape[:-1], len(taps), self.groups,
                                       self.in_channels // self.groups)

  def input_rows(self, x: jax.Array) -> jax.Array:
    patches = self.windows(self.padded_input(x))
    # (rows, taps, groups, c_in / groups) -> the kernel's order per group.
    patches = patches.reshape(-1, *patches.shape[-3:])
    return jnp.transpose(patches, (2, 0, 1, 3)).reshape(self.groups, -1, self.in_dim)

  def output_rows(self, g: jax.Array) -> jax.Array:
    g = g.reshape(-1, self.groups, self.out_dim)
    return jnp.swapaxes(g, 0, 1)

  @property
  def _applied_kernel_shape(self) -> tuple[int, ...]:
    return (*self.kernel_size, self.in_channels // self.groups, self.out_channels)

  @property
  def kernel_shape(self) -> tuple[int, ...]:
    *spatial, c_in, c_out = self._applied_kernel_shape
    return (*spatial, c_out, c_in) if self.kernel_flipped else (*spatial, c_in, c_out)

  @property
  def bias_shape(self) -> tuple[int, ...]:
    return (self.out_channels,)

  def _stored_or_applied(self, kernel: jax.Array) -> jax.Array:
    """The applied kernel of a stored one, or the stored kernel of an applied
    one: flipping and swapping the channel axes is its own inverse."""
    if not self.kernel_flipped:
      return kernel
    return jnp.swapaxes(jnp.flip(kernel, range(len(self.kernel_size))), -1, -2)

  def kernel_matrix(self, kernel: jax.Array) -> jax.Array:
    kernel = self._stored_or_applied(kernel).reshape(self.in_dim, self.groups, self.out_dim)
    return jnp.swapaxes(kernel, 0, 1)

  def kernel_from_matrix(self, matrix: jax.Array) -> jax.Array:
    return self._stored_or_applied(
        jnp.swapaxes(matrix, 0, 1).reshape(self._applied_kernel_shape))

  def bias_matrix(self, bias: jax.Array) -> jax.Array:
    return bias.reshape(self.groups, self.out_dim)

  def bias_from_matrix(self, matrix: jax.Array) -> jax.Array:
    return matrix.reshape(self.bias_shape)


@dataclasses.dataclass(frozen=True)
class EmbeddingLayout:
  """``nn.Embed``: rows are one-hot token vectors; never materialised.

  Attributes:
    vocab: number of embeddings.
    features: embedding width.
  """
  vocab: int
  features: int
  num_stacks = 1

  @property
  def out_dim(self) -> int:
    return self.features

  def output_rows(self, g: jax.Array) -> jax.Array:
    return g.reshape(1, -1, self.features)


@dataclasses.dataclass(frozen=True)
class NormLayout:
  """A normalisation ``y = x̂ · scale + bias``, scale and bias per feature.

  The captured input is the normalised ``x̂`` itself (see `models.kinds`), so the
  per-example gradients are exact: ``∇scale_n = Σ_positions g ⊙ x̂`` and
  ``∇bias_n = Σ_positions g``, summed over every axis of example ``n`` (axis
  0) other than the feature axes.

  Attributes:
    feature_axes: the axes of x that scale and bias span, negative, sorted.
  """

  feature_axes: tuple[int, ...]

  def per_example(self, x: jax.Array) -> jax.Array:
    """``(N, ..., features...) -> (N, positions, prod(features))``."""
    features = [a % x.ndim for a in self.feature_axes]
    others = [a for a in range(1, x.ndim) if a not in features]
    x = jnp.transpose(x, (0, *others, *features))
    return x.reshape(x.shape[0], -1, _size(x.shape[x.ndim - len(features):]))
