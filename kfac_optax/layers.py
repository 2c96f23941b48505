"""Registry: which flax modules K-FAC captures, and their block layouts.

A layer kind reads a module's configuration while the model is traced and
returns its layout (see `layouts`); it also says what to capture as the
layer's input (the input itself, or for normalisation layers the normalised
``x̂``). Kinds are looked up along the module's MRO, so subclasses of a
registered class are captured too. Linen and NNX layers live in one registry;
their kinds differ only where the two APIs name a configuration differently
(NNX's ``out_features`` for linen's ``features``).
"""

import dataclasses
import inspect
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx
from flax.linen import linear

from kfac_optax import layouts


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


def _einsum_kind(call: Callable[..., Any], equation: str | None) -> Kind:
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
    "einsum": _einsum_kind(nn.Einsum.__call__, "einsum_str"),
}

NNX_KINDS: dict[str, Kind] = {
    "dense": KINDS["dense"],
    "dense_general": Kind(_nnx_linear_general),
    "conv": Kind(_nnx_conv),
    "conv_transpose": Kind(_nnx_conv_transpose, captures=_not_circular),
    "embed": KINDS["embed"],
    "norm": Kind(_norm, _nnx_normalized_input),
    "einsum": _einsum_kind(nnx.Einsum.__call__, "einsum_str"),
}

_REGISTRY: dict[type, Kind] = {
    nn.Dense: KINDS["dense"],
    nn.DenseGeneral: KINDS["dense_general"],
    nn.Conv: KINDS["conv"],
    nn.ConvTranspose: KINDS["conv_transpose"],
    nn.Embed: KINDS["embed"],
    nn.Einsum: KINDS["einsum"],
    nn.LayerNorm: KINDS["norm"],
    nn.RMSNorm: KINDS["norm"],
    nn.GroupNorm: KINDS["norm"],
    nn.InstanceNorm: KINDS["norm"],
    nn.BatchNorm: KINDS["norm"],
    nnx.Linear: NNX_KINDS["dense"],
    nnx.LinearGeneral: NNX_KINDS["dense_general"],
    nnx.Conv: NNX_KINDS["conv"],
    nnx.ConvTranspose: NNX_KINDS["conv_transpose"],
    nnx.Embed: NNX_KINDS["embed"],
    nnx.Einsum: NNX_KINDS["einsum"],
    nnx.LayerNorm: NNX_KINDS["norm"],
    nnx.RMSNorm: NNX_KINDS["norm"],
    nnx.GroupNorm: NNX_KINDS["norm"],
    nnx.InstanceNorm: NNX_KINDS["norm"],
    nnx.BatchNorm: NNX_KINDS["norm"],
}


# Kinds whose kernel order is set by the layer (flax's conv kernel, the
# equation), and kinds with a kernel and bias to name.
_FIXED_ORDER_KINDS = ("conv", "conv_transpose", "einsum")
_NAMED_KINDS = ("dense", "dense_general", *_FIXED_ORDER_KINDS)


def register_layer(
    module_class: type,
    kind: "str | Callable[[nn.Module, Any, Any], Any]",
    *,
    kernel: str = "kernel",
    bias: str | None = "bias",
    kernel_layout: str = "in_out",
    equation: str | None = None,
) -> None:
  """Captures every instance of ``module_class`` as a curvature block.

  ``kind`` names the block and says how the layer maps its input to its
  output: ``"dense"`` is ``y = x @ W (+ b)`` over the last axis of ``x``;
  ``"dense_general"``, ``"conv"`` and ``"conv_transpose"`` read the
  configuration attributes of ``nn.DenseGeneral``, ``nn.Conv`` and
  ``nn.ConvTranspose`` (``features``, ``axis``, ``kernel_size``,
  ``strides``, ``padding``, ...) from the module, so they fit subclasses and
  look-alikes of those; ``"embed"`` and ``"norm"`` likewise, and
  ``"einsum"`` reads ``nn.Einsum``'s ``einsum_str`` (the module's, or the
  call's where ``__call__`` takes it, as ``nn.Einsum``'s does).
  For an ``nnx.Module`` class they read NNX's names (``nnx.LinearGeneral``'s
  ``out_features``, ``axis``, ``batch_axis``; ``nnx.Conv``'s
  ``out_features``, ...).
  ``kernel`` and ``bias`` name the layer's param leaves, and
  ``kernel_layout`` how its kernel is stored, so any Dense-like layer fits
  without code: e.g. Hugging Face's ``FlaxConv1D`` (``y = x @ kernel.T +
  bias``, kernel ``(out, in)``) is
  ``register_layer(FlaxConv1D, "dense", kernel_layout="out_in")``. An
  ``(out, in)`` kernel is transposed, never reshaped; a kernel whose shape
  does not fit the layer's captured input and output is an error at
  ``init``. (A square kernel fits both layouts: declaring the wrong one
  there goes unnoticed.)

  Args:
    module_class: a flax ``nn.Module`` or ``nnx.Module`` subclass whose
      ``__call__`` takes the layer input as its first argument; its
      subclasses are captured too.
    kind: ``"dense"``, ``"dense_general"``, ``"conv"``,
      ``"conv_transpose"``, ``"einsum"``, ``"embed"``, ``"norm"``, or a
      layout function ``(module, layer_input, layer_output) -> layout``
      returning a `kfac_optax.layouts.DenseLayout` (e.g.
      ``layouts.dense(d_in, d_out, kernel_order="out_in")``),
      `kfac_optax.layouts.ConvLayout` or `kfac_optax.layouts.EinsumLayout`,
      which carries the param names and kernel order itself.
    kernel: the name of the kernel param (``"dense"``, ``"dense_general"``,
      ``"conv"``, ``"conv_transpose"``, ``"einsum"``).
    bias: the name of the bias param, used when the layer has it; None for
      a layer whose params include no bias.
    kernel_layout: ``"in_out"`` (flax's ``(*in, *out)``; for the conv
      kinds flax's, e.g. ``(*kernel_size, in / groups, out)``) or
      ``"out_in"`` (the feature axes swapped: ``"dense"`` and
      ``"dense_general"`` only).
    equation: ``"einsum"`` only: the name of the ``__call__`` argument that
      holds the equation, for a layer that takes it per call, with the input
      as its first other argument (Gemma's ``Einsum(shape)(eqn, x)``:
      ``equation="eqn"``); by default ``einsum_str`` where ``__call__``
      takes one, otherwise the module's attribute ``einsum_str``.

  Raises:
    TypeError: ``module_class`` is not a flax module class.
    ValueError: an unknown ``kind`` or ``kernel_layout``, or param names,
      a layout or an equation given with a kind that takes none.

  Example:
    >>> class Conv1D(nn.Module):  # Hugging Face's Dense with an (out, in) kernel
    ...   features: int
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     w = self.param("weight", nn.initializers.normal(0.02), (self.features, x.shape[-1]))
    ...     return x @ w.T + self.param("b", nn.initializers.zeros, (self.features,))
    >>> kfac_optax.register_layer(Conv1D, "dense", kernel="weight", bias="b",
    ...                           kernel_layout="out_in")
  """
  if not (isinstance(module_class, type)
          and issubclass(module_class, (nn.Module, nnx.Module))):
    raise TypeError(f"register_layer's module_class must be a flax nn.Module "
                    f"or nnx.Module subclass (the class, not an instance), got "
                    f"{module_class!r}")
  kinds = NNX_KINDS if issubclass(module_class, nnx.Module) else KINDS
  custom = (kernel, bias, kernel_layout) != ("kernel", "bias", "in_out")
  if equation is not None and kind != "einsum":
    raise ValueError(f"register_layer: equation= applies to the kind 'einsum', "
                     f"not {kind!r}")
  if callable(kind):
    if custom:
      raise ValueError(
          "register_layer: kernel=, bias= and kernel_layout= go with a kind "
          "name; a layout function sets them on the layout it returns, e.g. "
          "layouts.dense(d_in, d_out, kernel_name=..., kernel_order='out_in')")
    _REGISTRY[module_class] = Kind(kind)
    return
  if kind not in kinds:
    raise ValueError(f"register_layer: unknown kind {kind!r}; built-in kinds: "
                     f"{sorted(kinds)}, or pass a layout function")
  orders = layouts.KERNEL_ORDERS if kind not in _FIXED_ORDER_KINDS else ("in_out",)
  if kernel_layout not in orders:
    raise ValueError(f"register_layer: kernel_layout={kernel_layout!r} is not one "
                     f"of {orders} for kind {kind!r}")
  if custom and kind not in _NAMED_KINDS:
    raise ValueError(f"register_layer: kernel=, bias= and kernel_layout= apply to "
                     f"the kinds {_NAMED_KINDS}, not {kind!r}")
  found = kinds[kind]
  if kind == "einsum":
    if equation is None and "einsum_str" in inspect.signature(
        module_class.__call__).parameters:
      equation = "einsum_str"
    found = _einsum_kind(module_class.__call__, equation)
  if custom:
    names = {"kernel_name": kernel, "bias_name": bias}
    if kind not in _FIXED_ORDER_KINDS:
      names["kernel_order"] = kernel_layout
    layout_of = found.layout
    found = dataclasses.replace(found, layout=lambda module, x, y: dataclasses.replace(
        layout_of(module, x, y), **names))
  _REGISTRY[module_class] = found


# Linen modules whose own code hides their layers from the hooks, and a
# function that computes the same with captured layers, run in K-FAC's own
# passes in their place (``(module, *args, **kwargs) -> output``, the module
# as ``self``). nn.OptimizedLSTMCell concatenates its eight gate kernels into
# two matmuls; nn.LSTMCell's code makes one nn.Dense per gate, at the paths
# and with the params the optimized cell names the same way.
_STAND_INS: dict[type, Callable[..., Any]] = {
    nn.OptimizedLSTMCell: nn.LSTMCell.__call__.__wrapped__,
}


def stand_in(module: nn.Module) -> Callable[..., Any] | None:
  """The function K-FAC runs for a linen module's ``__call__`` in its own
  passes, where the module's code hides its layers (None: its own)."""
  return next((_STAND_INS[cls] for cls in type(module).__mro__ if cls in _STAND_INS),
              None)


def _params_as_stored(module: "nn.Module | nnx.Module") -> bool:
  """False for a linen layer that sees its params through ``nn.map_variables``
  (``nn.WeightNorm``, ``nn.SpectralNorm``): its input and output gradient
  give the Fisher of the params as transformed, W / σ(W) say, not of the
  params that are stored and updated."""
  steps = getattr(getattr(module, "scope", None), "debug_path", ())
  return not any(str(step).startswith("map_variables(") for step in steps)


def kind_of(module: "nn.Module | nnx.Module") -> Kind | None:
  """The layer kind of a flax module instance, or None if it is not captured
  (for a kind with `Kind.call_settings`, `configured` decides call by call)."""
  for cls in type(module).__mro__:
    if cls in _REGISTRY:
      kind = _REGISTRY[cls]
      expressed = kind.call_settings is not None or kind.captures(module)
      return kind if expressed and _params_as_stored(module) else None
  return None


class _Configured:
  """A layer as one call configures it: the call's settings in place of the
  module's attributes of those names, the module's for the rest."""

  def __init__(self, module: Any, settings: dict[str, Any]):
    self._module, self._settings = module, settings

  def __getattr__(self, name: str) -> Any:
    settings = self.__dict__["_settings"]
    return settings[name] if name in settings else getattr(self.__dict__["_module"], name)


def configured(kind: Kind, module: Any, args: tuple, kwargs: dict) -> Any:
  """What ``kind.layout`` reads for one ``__call__``: the module, or with
  `Kind.call_settings` the module as the call configures it; None where
  the kind cannot express that configuration (an einsum equation that sums
  over a label): the call is then not captured."""
  if kind.call_settings is None:
    return module
  view = _Configured(module, kind.call_settings(args, kwargs))
  return view if kind.captures(view) else None
