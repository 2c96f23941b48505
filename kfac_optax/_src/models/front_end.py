"""Which front-end runs a model: linen's interceptor, or an NNX model's copy.

A front-end answers three questions for `Curvature`: which layers are there
(`discover`, once, abstractly), what did they see on this batch
(`hooked_apply`, inside K-FAC's forward pass and vjp, see
`capture.capture`), and what is the model's output (the apply function
itself). An ``nnx.Module`` is wrapped once, at construction, by `front_end`;
a linen apply function is used as it is.
"""

from typing import Any, Callable, Sequence

import flax.linen as nn
from flax import nnx

from kfac_optax._src.models import capture
from kfac_optax._src.models import linen_capture
from kfac_optax._src.models import nnx_capture


def front_end(apply_fn: Any) -> Any:
  """``apply_fn`` itself, or for an ``nnx.Module`` its `nnx_capture.NNXModel`."""
  return nnx_capture.NNXModel(apply_fn) if isinstance(apply_fn, nnx.Module) else apply_fn


def discover(
    apply_fn: Callable[..., Any],
    variables: Any,
    args: Sequence[Any],
    apply_kwargs: dict[str, Any],
    mutable: bool | Sequence[str] | nn.DenyList = (),
) -> capture.Discovered:
  """The captured layers, from one abstract trace of the model (no FLOPs).

  Args:
    apply_fn: what `front_end` returned.
    variables: the variables to run with (params and other collections).
    args: positional inputs.
    apply_kwargs: keyword arguments of ``apply_fn``.
    mutable: (linen) collections the model may write besides K-FAC's own,
      or a flax collection filter (``True``, ``DenyList("params")``) that
      lets missing ones (e.g. batch_stats) be created.
  """
  if isinstance(apply_fn, nnx_capture.NNXModel):
    return apply_fn.discover(variables, args, apply_kwargs)
  return linen_capture.discover(apply_fn, variables, args, apply_kwargs, mutable)


def hooked_apply(
    apply_fn: Callable[..., Any],
    args: Sequence[Any],
    apply_kwargs: dict[str, Any],
    mutable: bool | Sequence[str] | nn.DenyList,
) -> Callable[[Any], tuple[Any, Any]]:
  """``variables -> (outputs, collections)``: the model run under the hooks
  of its front-end, ``collections[capture.INPUTS]`` the captured inputs."""
  if isinstance(apply_fn, nnx_capture.NNXModel):
    return apply_fn.hooked(args, apply_kwargs)
  return linen_capture.hooked_apply(apply_fn, args, apply_kwargs, mutable)
