"""Registry: which flax modules K-FAC captures, and their block layouts.

A layer kind reads a module's configuration while the model is traced and
returns its layout (see `layouts`); it also says what to capture as the
layer's input (the input itself, or for normalisation layers the normalised
``x̂``). Kinds are looked up along the module's MRO, so subclasses of a
registered class are captured too.
"""

import dataclasses
from typing import Any, Callable

import flax.linen as nn
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
  """
  layout: Callable[[nn.Module, Any, Any], Any]
  captured_input: Callable[..., Any] = _first_argument
  extra_methods: tuple[str, ...] = ()


def _as_tuple(value) -> tuple:
  return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _dense(module, x, y):
  """Any layer ``y = x @ kernel (+ bias)`` over the last axis."""
  del module
  return layouts.dense(x.shape[-1], y.shape[-1])


def _dense_general(module, x, y):
  del y
  # flax sorts both: the kernel is (*batch, *in_features, *features) in axis order.
  axes = tuple(a - x.ndim for a in sorted(a % x.ndim for a in _as_tuple(module.axis)))
  batch_axes = tuple(sorted(a % x.ndim for a in _as_tuple(module.batch_dims)))
  return layouts.DenseLayout(
      input_axes=axes, batch_axes=batch_axes,
      in_features=tuple(x.shape[a] for a in axes),
      out_features=tuple(_as_tuple(module.features)),
      batch_shape=tuple(x.shape[a] for a in batch_axes))


_PRE_PADDING = {"CIRCULAR": "wrap", "REFLECT": "reflect", "CAUSAL": "causal"}


def _conv(module, x, y):
  del y
  kernel_size = _as_tuple(module.kernel_size)
  rank = len(kernel_size)

  def per_axis(value):
    return (1,) * rank if value is None else (
        (value,) * rank if isinstance(value, int) else tuple(value))

  padding = linear.canonicalize_padding(module.padding, rank)
  pre_padding = _PRE_PADDING.get(padding) if isinstance(padding, str) else None
  if pre_padding is not None:
    padding = "VALID"
  elif not isinstance(padding, str):
    padding = tuple((int(lo), int(hi)) for lo, hi in padding)
  return layouts.ConvLayout(
      kernel_size=kernel_size, strides=per_axis(module.strides),
      input_dilation=per_axis(module.input_dilation),
      kernel_dilation=per_axis(module.kernel_dilation),
      padding=padding, pre_padding=pre_padding, in_channels=x.shape[-1],
      out_channels=module.features, groups=module.feature_group_count)


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


KINDS: dict[str, Kind] = {
    "dense": Kind(_dense),
    "dense_general": Kind(_dense_general),
    "conv": Kind(_conv),
    "embed": Kind(_embed, extra_methods=("attend",)),
    "norm": Kind(_norm, _normalized_input),
}

_REGISTRY: dict[type, Kind] = {
    nn.Dense: KINDS["dense"],
    nn.DenseGeneral: KINDS["dense_general"],
    nn.Conv: KINDS["conv"],
    nn.Embed: KINDS["embed"],
    nn.LayerNorm: KINDS["norm"],
    nn.RMSNorm: KINDS["norm"],
    nn.GroupNorm: KINDS["norm"],
    nn.BatchNorm: KINDS["norm"],
}


def register_layer(module_class: type, kind: "str | Kind") -> None:
  """Captures every instance of ``module_class`` as a curvature block.

  Args:
    module_class: a flax ``nn.Module`` subclass whose ``__call__`` takes the
      layer input as its first argument.
    kind: a built-in kind name (``"dense"``: ``y = x @ kernel (+ bias)`` over
      the last axis with params ``kernel`` of shape (d_in, d_out) and
      optional ``bias``; ``"dense_general"``, ``"conv"``, ``"embed"`` read
      the same attributes as the flax modules of those names), or a function
      ``(module, layer_input, layer_output) -> layout``.

  Example:
    >>> class MyDense(nn.Module):  # doctest: +SKIP
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return x @ self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], 4))
    >>> kfac_optax.register_layer(MyDense, "dense")  # doctest: +SKIP
  """
  if isinstance(kind, str):
    if kind not in KINDS:
      raise ValueError(f"unknown layer kind {kind!r}; built-in kinds: {sorted(KINDS)}")
    kind = KINDS[kind]
  _REGISTRY[module_class] = kind


def kind_of(module: nn.Module) -> Kind | None:
  """The layer kind of a flax module instance, or None if it is not captured."""
  for cls in type(module).__mro__:
    if cls in _REGISTRY:
      return _REGISTRY[cls]
  return None
