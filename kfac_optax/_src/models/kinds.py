"""Layer kinds: how K-FAC captures each kind of flax layer.

A kind reads a module's configuration while the model is traced and returns
its layout (`layouts`); it also says what to capture as the layer's input
(the input itself, or for normalisation layers the normalised ``x̂``).
`KINDS` and `NNX_KINDS` hold the kinds of flax's own layers by name, for
linen and NNX: they differ only where the two APIs name a configuration
differently (NNX's ``out_features`` for linen's ``features``). `registry`
maps module classes to them.
"""

import dataclasses
import inspect
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx
from flax.linen import linear

from kfac_optax._src import layouts


def _first_argument(module, args, kwargs, output):
  del module, output
  return args[0] if args else next(iter(kwargs.values()))


@dataclasses.dataclass(frozen=True)
class Kind:
  """How to capture one kind of layer.

  Attributes:
    layout: ``(module, layer_input, layer_output) -> layout``.
    captured_input: ``(module, args, kwargs, output) -> array`` to record as
      the layer's input (default: the first argument).
    extra_methods: other methods whose calls are captured too (input: their
      first argument), for blocks that use the parameters there as well.
    captures: ``module -> bool``, False for a configuration the layout
      cannot express (the module's params then get the diagonal fallback).
    call_settings: ``(args, kwargs) -> {attribute: value}``: configuration
      that a call gives in place of the module's attribute of that name
      (``nn.Einsum``'s ``einsum_str``). ``layout`` and ``captures`` then
      read the module as each call configures it (see `configured`).
  """
  layout: Callable[[nn.Module, Any, Any], Any]
  captured_input: Callable[..., Any] = _first_argument
  extra_methods: tuple[str, ...] = ()
  captures: Callable[[Any], bool] = lambda module: True
  call_settings: Callable[[tuple, dict], dict] | None = None


def _as_tuple(value) -> tuple:
  return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _per_axis(value, rank: int) -> tuple:
  """A conv's strides or dilation, None, an int or one per spatial axis."""
  return (1,) * rank if value is None else (
      (value,) * rank if isinstance(value, int) else tuple(value))


def _dense(module, x, y):
  """Any layer ``y = x @ kernel (+ bias)`` over the last axis."""
  del module
  return layouts.dense(x.shape[-1], y.shape[-1])


def _dense_general_layout(x, axis, batch_dims, features):
  # flax (linen and NNX) sorts both: the kernel is (*batch, *in_features,
  # *features) in axis order.
  axes = tuple(a - x.ndim for a in sorted(a % x.ndim for a in _as_tuple(axis)))
  batch_axes = tuple(sorted(a % x.ndim for a in _as_tuple(batch_dims)))
  return layouts.DenseLayout(
      input_axes=axes, batch_axes=batch_axes,
      in_features=tuple(x.shape[a] for a in axes),
      out_features=tuple(_as_tuple(features)),
      batch_shape=tuple(x.shape[a] for a in batch_axes))


def _dense_general(module, x, y):
  del y
  return _dense_general_layout(x, module.axis, module.batch_dims, module.features)


def _nnx_linear_general(module, x, y):
  del y
  return _dense_general_layout(x, module.axis, tuple(module.batch_axis),
                               module.out_features)


def _einsum(module, x, y):
  x_labels, kernel_labels, out_labels = layouts.einsum_labels(module.einsum_str)
  sizes = {**dict(zip(x_labels, x.shape[x.ndim - len(x_labels):])),
           **dict(zip(out_labels, y.shape[y.ndim - len(out_labels):]))}
  return layouts.EinsumLayout(x_labels, kernel_labels, out_labels,
                              tuple(sorted(sizes.items())))


def _einsum_in_layout(module) -> bool:
  """An equation (given at construction or by the call) that `EinsumLayout`
  expresses."""
  equation = getattr(module, "einsum_str", None)
  return equation is not None and layouts.einsum_labels(equation) is not None


def einsum_kind(call: Callable[..., Any], equation: str | None) -> Kind:
  """The einsum kind of a layer whose ``__call__`` (``call``) may take its
  equation as the argument named ``equation`` (the module's ``einsum_str``
  where the call gives none) and takes its input as its first other
  argument: ``nn.Einsum(...)(x, einsum_str=None)``, or Gemma's
  ``Einsum(shape)(eqn, x)``. ``equation=None``: the module's
  ``einsum_str`` only, the input first.

  Raises:
    ValueError: ``call`` has no argument named ``equation``, or no other.
  """
  if equation is None:
    return Kind(_einsum, captures=_einsum_in_layout)
  names = list(inspect.signature(call).parameters)[1:]  # self dropped
  others = [name for name in names if name != equation]
  if equation not in names or not others:
    raise ValueError(
        f"register_layer: equation={equation!r} names no argument of "
        f"{call.__qualname__}{inspect.signature(call)} beside the layer's input")

  def argument(args, kwargs, name):
    position = names.index(name)
    return kwargs[name] if name in kwargs else (
        args[position] if position < len(args) else None)

  def call_settings(args, kwargs):
    given = argument(args, kwargs, equation)
    return {} if given is None else {"einsum_str": given}

  def layer_input(module, args, kwargs, output):
    del module, output
    return argument(args, kwargs, others[0])

  return Kind(_einsum, layer_input, captures=_einsum_in_layout,
              call_settings=call_settings)


_PRE_PADDING = {"CIRCULAR": "wrap", "REFLECT": "reflect", "CAUSAL": "causal"}


def _linen_and_nnx(layout_with_width):
  """The linen and NNX layout functions of ``layout_with_width(module, x,
  width)``: linen names the output width ``features``, NNX ``out_features``;
  the two APIs share every other configuration name of these layers."""
  return (lambda module, x, y: layout_with_width(module, x, module.features),
          lambda module, x, y: layout_with_width(module, x, module.out_features))


def _conv_layout(module, x, features):
  kernel_size = _as_tuple(module.kernel_size)
  rank = len(kernel_size)
  padding = linear.canonicalize_padding(module.padding, rank)
  pre_padding = _PRE_PADDING.get(padding) if isinstance(padding, str) else None
  if pre_padding is not None:
    padding = "VALID"
  elif not isinstance(padding, str):
    padding = tuple((int(lo), int(hi)) for lo, hi in padding)
  return layouts.ConvLayout(
      kernel_size=kernel_size, strides=_per_axis(module.strides, rank),
      input_dilation=_per_axis(module.input_dilation, rank),
      kernel_dilation=_per_axis(module.kernel_dilation, rank),
      padding=padding, pre_padding=pre_padding, in_channels=x.shape[-1],
      out_channels=features, groups=module.feature_group_count)


def _conv_transpose_layout(module, x, features):
  """flax's ConvTranspose is ``lax.conv_transpose``: a stride-1 convolution
  of the input dilated by the strides, padded as below."""
  kernel_size = _as_tuple(module.kernel_size)
  rank = len(kernel_size)
  strides = _per_axis(module.strides, rank)
  kernel_dilation = _per_axis(module.kernel_dilation, rank)
  padding = linear.canonicalize_padding(module.padding, rank)
  if isinstance(padding, str):
    padding = tuple(_conv_transpose_pads(k, s, padding) for k, s in zip(
        layouts.reach(kernel_size, kernel_dilation), strides))
  return layouts.ConvLayout(
      kernel_size=kernel_size, strides=(1,) * rank, input_dilation=strides,
      kernel_dilation=kernel_dilation,
      padding=tuple((int(lo), int(hi)) for lo, hi in padding), pre_padding=None,
      in_channels=x.shape[-1], out_channels=features,
      kernel_flipped=module.transpose_kernel)


def _conv_transpose_pads(kernel: int, stride: int, padding: str) -> tuple[int, int]:
  """``lax.conv_transpose``'s (front, back) padding of the dilated input
  along one axis, for a kernel reaching ``kernel`` inputs: ``"SAME"`` makes
  the output ``stride`` × the input's length, ``"VALID"`` is the full
  transposed convolution."""
  if padding == "SAME":
    total = kernel + stride - 2
    front = kernel - 1 if stride > kernel - 1 else -(-total // 2)
  elif padding == "VALID":
    total = kernel + stride - 2 + max(kernel - stride, 0)
    front = kernel - 1
  else:
    raise ValueError(f"ConvTranspose padding {padding!r} has no K-FAC layout")
  return front, total - front


_conv, _nnx_conv = _linen_and_nnx(_conv_layout)


_conv_transpose, _nnx_conv_transpose = _linen_and_nnx(_conv_transpose_layout)


def _not_circular(module) -> bool:
  """Circular ConvTranspose sums its output over periods after the
  convolution, which no convolution layout expresses."""
  return module.padding != "CIRCULAR"


def _embed(module, x, y):
  del x, y
  return layouts.EmbeddingLayout(module.num_embeddings, module.features)


def _norm(module, x, y):
  del y
  axes = getattr(module, "feature_axes", getattr(module, "axis", -1))
  return layouts.NormLayout(tuple(sorted(a % x.ndim - x.ndim for a in _as_tuple(axes))))


def _normalized_input(module, args, kwargs, output):
  """x̂: the same module with its affine part switched off, on the same input.

  Runs after the layer itself, so collections it creates (BatchNorm's
  batch_stats) exist; in training mode BatchNorm normalises with batch
  statistics, which the running-average update does not change.
  """
  del output
  affine = {name: False for name in ("use_scale", "use_bias") if hasattr(module, name)}
  plain = module.clone(parent=None, **affine)
  others = {k: v for k, v in module.variables.items() if k != "params"}
  normalized, _ = plain.apply(others, *args, mutable=True, **kwargs)
  return normalized


def _nnx_normalized_input(module, args, kwargs, output):
  """x̂: the NNX layer run again with scale 1 and bias 0, on the same input.

  The layer is K-FAC's own copy of the user's module (see `nnx_capture`), so
  setting its params for one call is safe; they are restored on every exit.
  A train-mode BatchNorm's second update of its running averages goes with
  the copy.
  """
  del output
  affine = {name: fill for name, fill in (("scale", jnp.ones_like),
                                          ("bias", jnp.zeros_like))
            if isinstance(getattr(module, name, None), nnx.Variable)}
  saved = {name: getattr(module, name).get_value() for name in affine}
  try:
    for name, fill in affine.items():
      getattr(module, name).set_value(fill(saved[name]))
    return module(*args, **kwargs)
  finally:
    for name, value in saved.items():
      getattr(module, name).set_value(value)


KINDS: dict[str, Kind] = {
    "dense": Kind(_dense),
    "dense_general": Kind(_dense_general),
    "conv": Kind(_conv),
    "conv_transpose": Kind(_conv_transpose, captures=_not_circular),
    "embed": Kind(_embed, extra_methods=("attend",)),
    "norm": Kind(_norm, _normalized_input),
    "einsum": einsum_kind(nn.Einsum.__call__, "einsum_str"),
}


NNX_KINDS: dict[str, Kind] = {
    "dense": KINDS["dense"],
    "dense_general": Kind(_nnx_linear_general),
    "conv": Kind(_nnx_conv),
    "conv_transpose": Kind(_nnx_conv_transpose, captures=_not_circular),
    "embed": KINDS["embed"],
    "norm": Kind(_norm, _nnx_normalized_input),
    "einsum": einsum_kind(nnx.Einsum.__call__, "einsum_str"),
}
