"""Convolutions laid out for XLA:CPU's fast path, also inside `lax.cond`.

XLA:CPU runs a convolution with its fast library kernels only when the
input is ``(batch, *spatial, feature)`` and the kernel ``(*spatial, in,
out)``. It rewrites other layouts into that one by explicit transposes, but
only in the program's top-level computation. The backward pass through a
convolution is such another layout: jax transposes a convolution into one
whose kernel has its in and out features swapped. Inside the `lax.cond` that
runs K-FAC's statistics on a schedule, XLA:CPU compiled those backward
convolutions into plain loops: on the benchmark ResNet (statistics from 32
examples) a statistics step cost 180 ms more than a plain step, against 60
ms with statistics every step, where there is no `lax.cond`, and 65 ms
under it with this module (`benchmarks/statistics_step.py`).

`canonical_convolutions` traces a function and evaluates its jaxpr with
every convolution written in the canonical layout by explicit transposes,
which XLA keeps; the rest of the program is bound unchanged. Only on CPU,
and only where the function has a convolution.
"""

import functools
from typing import Callable, Sequence

import jax
from jax.extend import core
from jax.extend import source_info_util
import numpy as np

_CONV = jax.lax.conv_general_dilated_p
_CHECKPOINT = "remat2"  # the primitive of `jax.checkpoint`


def canonical_convolutions(fn: Callable) -> Callable:
  """``fn`` with every convolution it traces in XLA:CPU's canonical layout.

  The same values as ``fn`` (up to float rounding of the convolutions).
  Convolutions inside nested ``jax.jit`` calls (which are inlined) and
  ``jax.checkpoint`` (``nn.remat``) are rewritten too; those inside other
  higher-order primitives (``lax.scan``, custom derivatives) are left as
  they are. A function without convolutions, or any function outside CPU,
  runs as ``fn`` traces it.
  """
  @functools.wraps(fn)
  def rewritten(*args):
    if jax.default_backend() != "cpu":
      return fn(*args)
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    if not _has_conv(closed.jaxpr):  # the program exactly as ``fn`` traces it
      return fn(*args)
    outs = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
  return rewritten


def _evaluate(jaxpr: core.Jaxpr, consts: Sequence, args: Sequence) -> list:
  """``jaxpr``'s outputs at ``args``, its convolutions bound canonical."""
  env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    # As `jax.core.eval_jaxpr` binds: the op keeps its name and context.
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (source_info_util.user_context(eqn.source_info.traceback,
                                        name_stack=name_stack),
          eqn.ctx.manager):
      if eqn.primitive is _CONV:
        outs = [_canonical_conv(*ins, **eqn.params)]
      elif eqn.primitive.name == "jit" and _has_conv(eqn.params["jaxpr"].jaxpr):
        inner = eqn.params["jaxpr"]
        outs = _evaluate(inner.jaxpr, inner.consts, ins)
      elif eqn.primitive.name == _CHECKPOINT and _has_conv(eqn.params["jaxpr"]):
        # Stays a checkpoint: XLA must not share its recomputation.
        outs = eqn.primitive.bind(*ins, **{
            **eqn.params, "jaxpr": _rewritten(eqn.params["jaxpr"])})
      else:
        outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
        outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _rewritten(jaxpr: core.Jaxpr) -> core.Jaxpr:
  """``jaxpr`` (a checkpoint's: no constants) with its convolutions rewritten.

  The rewrite adds no constants either: it binds only the original's
  operands, literals and transposes.
  """
  return jax.make_jaxpr(lambda *args: _evaluate(jaxpr, [], args))(
      *[v.aval for v in jaxpr.invars]).jaxpr


def _has_conv(jaxpr: core.Jaxpr) -> bool:
  def inner(eqn):
    if eqn.primitive.name == "jit":
      return eqn.params["jaxpr"].jaxpr
    return eqn.params["jaxpr"] if eqn.primitive.name == _CHECKPOINT else None
  return any(eqn.primitive is _CONV or (inner(eqn) is not None and _has_conv(inner(eqn)))
             for eqn in jaxpr.eqns)


def _canonical_conv(lhs, rhs, *, dimension_numbers, **params):
  """The convolution with input ``(N, *spatial, C)``, kernel ``(*spatial, I,
  O)`` and output ``(N, *spatial, C)``, transposed back to its own layout."""
  lhs_spec, rhs_spec, out_spec = dimension_numbers
  lhs_order = (lhs_spec[0], *lhs_spec[2:], lhs_spec[1])
  rhs_order = (*rhs_spec[2:], rhs_spec[1], rhs_spec[0])
  out_order = (out_spec[0], *out_spec[2:], out_spec[1])
  rank = len(lhs_spec)
  if lhs_order == rhs_order == out_order == tuple(range(rank)):
    return _CONV.bind(lhs, rhs, dimension_numbers=dimension_numbers, **params)
  features_last = (0, rank - 1, *range(1, rank - 1))
  canonical = jax.lax.ConvDimensionNumbers(
      features_last, (rank - 1, rank - 2, *range(rank - 2)), features_last)
  out = _CONV.bind(lhs.transpose(lhs_order), rhs.transpose(rhs_order),
                   dimension_numbers=canonical, **params)
  return out.transpose(tuple(np.argsort(out_order)))
