"""The layer registry: which flax modules K-FAC captures, and as what kind.

Kinds are looked up along the module's MRO, so subclasses of a registered


class are captured too. Linen and NNX layers live in one registry, filled
with flax's own layers (`kinds`) and extended by `register_layer`.
"""

import dataclasses
import inspect
from typing import Any, Callable

import flax.linen as nn
from flax import nnx

from kfac_optax._src import layouts
from kfac_optax._src.models import kinds


_REGISTRY: dict[type, kinds.Kind] = {
    nn.Dense: kinds.KINDS["dense"],
    nn.DenseGeneral: kinds.KINDS["dense_general"],
    nn.Conv: kinds.KINDS["conv"],
    nn.ConvTranspose: kinds.KINDS["conv_transpose"],
    nn.Embed: kinds.KINDS["embed"],
    nn.Einsum: kinds.KINDS["einsum"],
    nn.LayerNorm: kinds.KINDS["norm"],
    nn.RMSNorm: kinds.KINDS["norm"],
    nn.GroupNorm: kinds.KINDS["norm"],
    nn.InstanceNorm: kinds.KINDS["norm"],
    nn.BatchNorm: kinds.KINDS["norm"],
    nnx.Linear: kinds.NNX_KINDS["dense"],
    nnx.LinearGeneral: kinds.NNX_KINDS["dense_general"],
    nnx.Conv: kinds.NNX_KINDS["conv"],
    nnx.ConvTranspose: kinds.NNX_KINDS["conv_transpose"],
    nnx.Embed: kinds.NNX_KINDS["embed"],
    nnx.Einsum: kinds.NNX_KINDS["einsum"],
    nnx.LayerNorm: kinds.NNX_KINDS["norm"],
    nnx.RMSNorm: kinds.NNX_KINDS["norm"],
    nnx.GroupNorm: kinds.NNX_KINDS["norm"],
    nnx.InstanceNorm: kinds.NNX_KINDS["norm"],
    nnx.BatchNorm: kinds.NNX_KINDS["norm"],
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
      a layer whose params include no bias (also accepted for ``"norm"``,
      whose block takes the layer's ``scale`` and ``bias`` params as it
      finds them).
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
  known = kinds.NNX_KINDS if issubclass(module_class, nnx.Module) else kinds.KINDS
  # A norm layer's block reads its params as it finds them: saying it has
  # no bias is true of an RMSNorm, and changes nothing.
  if kind == "norm" and bias is None:
    bias = "bias"
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
    _REGISTRY[module_class] = kinds.Kind(kind)
    return
  if kind not in known:
    raise ValueError(f"register_layer: unknown kind {kind!r}; built-in kinds: "
                     f"{sorted(known)}, or pass a layout function")
  orders = layouts.KERNEL_ORDERS if kind not in _FIXED_ORDER_KINDS else ("in_out",)
  if kernel_layout not in orders:
    raise ValueError(f"register_layer: kernel_layout={kernel_layout!r} is not one "
                     f"of {orders} for kind {kind!r}")
  if custom and kind not in _NAMED_KINDS:
    raise ValueError(f"register_layer: kernel=, bias= and kernel_layout= apply to "
                     f"the kinds {_NAMED_KINDS}, not {kind!r}")
  found = known[kind]
  if kind == "einsum":
    if equation is None and "einsum_str" in inspect.signature(
        module_class.__call__).parameters:
      equation = "einsum_str"
    found = kinds.einsum_kind(module_class.__call__, equation)
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
  """False for a linen layer that sees its params transformed: through
  ``nn.map_variables`` (``nn.WeightNorm``, ``nn.SpectralNorm``) or its own
  ``param`` (big_vision's weight-standardised ``StdConv``, an ``nn.Conv``
  whose ``param`` returns the kernel standardised). Its input and output
  gradient give the Fisher of the params as transformed, W / σ(W) say, not
  of the params that are stored and updated."""
  if getattr(type(module), "param", nn.Module.param) is not nn.Module.param:
    return False
  steps = getattr(getattr(module, "scope", None), "debug_path", ())
  return not any(str(step).startswith("map_variables(") for step in steps)


def registered_class(cls: type) -> type | None:
  """The class along ``cls``'s MRO that gives it its kind (None: none)."""
  return next((base for base in cls.__mro__ if base in _REGISTRY), None)


def overrides_call(cls: type) -> bool:
  """Whether ``cls`` has a ``__call__`` of its own below the registered class
  it takes its kind from (``class ScaledDense(nn.Dense)`` whose ``__call__``
  scales ``super().__call__(x)``): only that inner call is the layer the
  kind describes."""
  registered = registered_class(cls)
  return registered is not None and cls.__call__ is not registered.__call__


def kind_of(module: "nn.Module | nnx.Module") -> kinds.Kind | None:
  """The layer kind of a flax module instance, or None if it is not captured
  (for a kind with `Kind.call_settings`, `configured` decides call by call)."""
  registered = registered_class(type(module))
  if registered is None:
    return None
  kind = _REGISTRY[registered]
  expressed = kind.call_settings is not None or kind.captures(module)
  return kind if expressed and _params_as_stored(module) else None


class _Configured:
  """A layer as one call configures it: the call's settings in place of the
  module's attributes of those names, the module's for the rest."""

  def __init__(self, module: Any, settings: dict[str, Any]):
    self._module, self._settings = module, settings

  def __getattr__(self, name: str) -> Any:
    settings = self.__dict__["_settings"]
    return settings[name] if name in settings else getattr(self.__dict__["_module"], name)


def configured(kind: kinds.Kind, module: Any, args: tuple, kwargs: dict) -> Any:
  """What ``kind.layout`` reads for one ``__call__``: the module, or with
  `Kind.call_settings` the module as the call configures it; None where
  the kind cannot express that configuration (an einsum equation that sums
  over a label): the call is then not captured."""
  if kind.call_settings is None:
    return module
  view = _Configured(module, kind.call_settings(args, kwargs))
  return view if kind.captures(view) else None
