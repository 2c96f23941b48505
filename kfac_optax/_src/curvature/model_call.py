"""How K-FAC calls the model: one convention for every pass it makes.

K-FAC runs the user's model itself (statistics, the quadratic model of
`kfac`, exact products) with one call::

  out = apply_fn({"params": params, **variables}, *inputs(batch),
                 mutable=[...], rngs=model_rngs(key), **apply_kwargs)
  loss_outputs = outputs(out)

`ModelCall` holds ``apply_fn`` (after `front_end.front_end`), ``inputs``,
``outputs`` and ``apply_kwargs``, and raises errors that name the argument
to fix when a batch or a return value does not fit.
"""

import dataclasses
import inspect
from typing import Any, Callable

import jax
from flax import linen

from kfac_optax._src import losses
from kfac_optax._src.curvature import explicit_axes


def model_rngs(rng: jax.Array) -> dict[str, jax.Array]:
  """The ``rngs`` K-FAC's passes give a linen ``apply_fn`` for the key ``rng``.

  ``"dropout"`` gets ``rng`` and ``"params"`` a key folded from it, which
  flax's ``make_rng`` falls back to for every other stream (stochastic
  depth's, a VAE's noise). Take your gradient with
  ``model.apply(..., rngs=kfac_optax.model_rngs(key))`` and pass
  ``rng=key`` to ``update``: `kfac`'s automatic mode then measures the loss
  change under the very noise your gradient saw, as its quadratic model
  assumes.
  """
  return {"dropout": rng, "params": jax.random.fold_in(rng, 1)}


def _first_element(batch: Any) -> Any:
  return losses.batch_element(
      batch, 0, "inputs", "scale_by_kfac/kfac (returning apply_fn's "
      "positional input, or a tuple of them)")


BATCH_FIX = (
    "{what} must have the structure of a training batch, `inputs=` must map "
    "it to apply_fn's positional input(s) (default batch[0]), constant call "
    "keywords go in apply_kwargs=, and other variable collections (e.g. "
    "batch_stats) in update(..., variables=...).")


_CALLED_AS = (
    "apply_fn(variables, *inputs(batch), mutable=..., "
    "rngs=kfac_optax.model_rngs(key), **apply_kwargs)")


def _is_array(value: Any) -> bool:
  return hasattr(value, "shape") and hasattr(value, "dtype")


def _logits_or_first_array(names: list, get: Callable[[Any], Any]) -> Any:
  """The name the ``outputs=`` hint shows: ``logits`` if it is an array
  there (Hugging Face's name for a head's outputs), else the first array."""
  arrays = [name for name in names if _is_array(get(name))]
  return "logits" if "logits" in arrays or not arrays else arrays[0]


def _output_advice(value: Any) -> tuple[str, str]:
  """(its keys or fields, an ``outputs=`` selecting an array) for a
  non-array model output."""
  if dataclasses.is_dataclass(value):  # also Hugging Face's ModelOutput
    names = [field.name for field in dataclasses.fields(value)]
    name = _logits_or_first_array(names, lambda n: getattr(value, n))
    return f"fields {names}", f"outputs=lambda out: out.{name}"
  if isinstance(value, dict):
    key = _logits_or_first_array(list(value), value.get)
    return f"keys {list(value)}", f"outputs=lambda out: out[{key!r}]"
  if isinstance(value, (tuple, list)):
    return f"{len(value)} elements", "outputs=lambda out: out[0]"
  return repr(value), "outputs=lambda out: out.logits"


@dataclasses.dataclass(frozen=True, eq=False)
class ModelCall:
  """How K-FAC calls ``apply_fn``; see the module docstring.

  Attributes:
    apply_fn: a linen apply function, or an NNX model's
      `nnx_capture.NNXModel`.
    inputs: batch -> apply_fn's positional input (or a tuple of them);
      None: ``batch[0]``.
    outputs: apply_fn's return value -> the array the loss reads (a tuple
      of ``num_outputs`` arrays for a `losses.joint`); None: the return
      value itself.
    apply_kwargs: constant keyword arguments of ``apply_fn``.
    num_outputs: how many arrays the loss reads.
  """

  apply_fn: Callable[..., Any]
  inputs: Callable[[Any], Any] | None = None
  outputs: Callable[[Any], Any] | None = None
  apply_kwargs: dict[str, Any] | None = None
  num_outputs: int = 1

  def args(self, batch: Any, what: str = "batch") -> tuple:
    """apply_fn's positional inputs from ``batch`` (named ``what`` in errors)."""
    if self.inputs is None:
      found = _first_element(batch)
    else:
      try:
        found = self.inputs(batch)
      except Exception as error:  # re-raised naming inputs= and the batch
        raise ValueError(
            f"inputs= could not read apply_fn's input from {what}: "
            f"{type(error).__name__}: {error}\nFix: "
            f"{BATCH_FIX.format(what=what)}") from error
    # A plain tuple holds several inputs; a NamedTuple (jraph's GraphsTuple)
    # is one structured input.
    return found if type(found) is tuple else (found,)

  def call_kwargs(self, rng: jax.Array | None) -> dict[str, Any]:
    """apply_fn's keyword arguments: ``apply_kwargs`` and the ``rngs`` of
    ``rng`` (of a fixed key without one)."""
    key = jax.random.key(0) if rng is None else rng
    return {**(self.apply_kwargs or {}), "rngs": model_rngs(key)}

  def output(self, out: Any) -> jax.Array:
    """The array the loss reads from apply_fn's return value (``outputs=``).

    Raises:
      TypeError: if it is not an array (a dict, a dataclass such as Hugging
        Face's ``ModelOutput``, a tuple), naming ``outputs=``.
    """
    found = out if self.outputs is None else self.outputs(out)
    if self.num_outputs > 1:
      return self._joint_outputs(found)
    if not _is_array(found):
      content, hint = _output_advice(found)
      raise TypeError(
          f"{self._output_source()} {type(found).__name__} ({content}), but "
          "the loss reads one array of outputs.\nFix: pass outputs= to "
          "scale_by_kfac/kfac (or Curvature), a function from apply_fn's "
          f"return value to the array the loss reads, e.g. {hint}")
    return found

  def _output_source(self) -> str:
    """What returned the loss's outputs, for errors."""
    return "outputs= returned" if self.outputs is not None else "apply_fn returned"

  def _joint_outputs(self, found: Any) -> tuple:
    """``found`` as the tuple of arrays a `losses.joint` reads."""
    if (not isinstance(found, (tuple, list)) or len(found) != self.num_outputs
        or not all(_is_array(f) for f in found)):
      raise TypeError(
          f"{self._output_source()} {type(found).__name__}, but the joint "
          f"loss reads a tuple of {self.num_outputs} arrays, one per head in "
          "the order of its heads.\nFix: pass outputs= to scale_by_kfac/kfac "
          "(or Curvature), a function from apply_fn's return value to that "
          "tuple, e.g. "
          "outputs=lambda out: (out['logits'], out['value'])")
    return tuple(found)

  def forward(self, params: Any, batch: Any, variables: dict | None = None,
              rng: jax.Array | None = None) -> Any:
    """The model output on ``batch``, selected by ``outputs=`` (other
    collections' changes discarded)."""
    def run(params, batch, variables, rng):
      out = self.apply_fn({"params": params, **variables}, *self.args(batch),
                          mutable=list(variables) or False, **self.call_kwargs(rng))
      return self.output(out[0] if variables else out)
    return explicit_axes.in_model_axes(run, params, batch, dict(variables or {}), rng)

  def check_signature(self, variables: Any, args: tuple,
                      call_kwargs: dict[str, Any]) -> None:
    """apply_fn must accept the call K-FAC makes (flax's ``Module.apply`` does)."""
    try:
      signature = inspect.signature(self.apply_fn)
    except (TypeError, ValueError):  # no signature to check (a C callable)
      return
    try:
      signature.bind(variables, *args, mutable=False, **call_kwargs)
    except TypeError as error:
      raise TypeError(
          f"apply_fn cannot be called the way K-FAC calls it, {_CALLED_AS}: "
          f"{error}.\nFix: pass the flax apply function (model.apply), or a "
          "function that accepts these arguments and passes them on, e.g. "
          "lambda variables, *inputs, **kwargs: model.apply(variables, "
          "*inputs, **kwargs).") from error
    self._check_module_call(args)

  def _check_module_call(self, args: tuple) -> None:
    """A linen module's ``__call__`` (``apply_fn`` its bound ``apply``) must
    take the inputs positionally: flax's nlp_seq example's ``__call__(self,
    *, inputs, train)`` takes them by keyword only."""
    module = getattr(self.apply_fn, "__self__", None)
    kwargs = dict(self.apply_kwargs or {})
    if not (isinstance(module, linen.Module) and "method" not in kwargs
            and getattr(self.apply_fn, "__func__", None) is linen.Module.apply):
      return
    # apply's own keyword (rngs and mutable cannot reach here: the options
    # and `check_signature` refuse them in apply_kwargs).
    kwargs.pop("capture_intermediates", None)
    signature = inspect.signature(module.__call__)
    try:
      signature.bind(*args, **kwargs)
    except TypeError as error:
      keywords = [p.name for p in signature.parameters.values()
                  if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is p.empty]
      names = [k for k in keywords if k not in kwargs]
      wrapper = ", ".join(f"{k}={k}" for k in names)
      raise TypeError(
          f"{type(module).__name__}.__call__ cannot take K-FAC's call with "
          f"the {len(args)} positional input(s) that inputs= gives: {error}."
          "\nFix: a model whose inputs are keywords needs an apply_fn that "
          "passes them on by name, e.g. "
          f"apply_fn=lambda variables, {', '.join(names) or 'x'}, **kwargs: "
          f"model.apply(variables, {wrapper or 'x=x'}, **kwargs), with "
          "inputs= giving them in that order; constant call keywords (train="
          ") go in apply_kwargs=.") from error
