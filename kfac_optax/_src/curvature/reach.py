"""Which layers and params the loss's outputs depend on, read off a jaxpr.

K-FAC's curvature of a layer comes from the gradients its outputs receive
from the loss. A layer whose outputs never reach the loss's outputs (an
actor-critic's value head when the loss reads the policy, an auxiliary head
that ``outputs=`` leaves out) has a zero Fisher block: ``G = 0`` and its
damped inverse scales the user's gradient there by a factor the damping λ
alone sets (``(A + √λ)⁻¹ ⊗ λ^{-1/2}``, up to ``1/λ``), a step nothing in the
loss K-FAC models measures. `check` refuses such layers and params at
``init``, before any step, from `unreached`'s reading of the model's jaxpr;
a layer that reaches them through some of its calls only has the others
left out of its statistics (`reached_calls`).

A layer's block models its params' gradient as the sum over its calls of
``∂(output)/∂(params)ᵀ · ∂ℓ/∂(output)``. A param the model also reads
outside the layer's calls (a tied decoder's ``h @ enc.kernel.T``) has
gradient terms the block never sees; `check` refuses those too. The same
walk finds them: the trace marks where each call's output leaves the layer
(`capture.marking_calls`), and a layer's params that still reach the loss
with the path through its own marked calls cut are read elsewhere.

The walk follows differentiable dependence: a primitive's outputs depend on
all of its inputs, except ``stop_gradient`` (no derivative passes), the
calls whose inner jaxpr is read the same way (``pjit``, ``remat``), and
control flow, whose bodies are read to a fixed point (``scan``, ``while``:
a carry is needed while any later iteration needs it; ``cond``: any branch).
A custom derivative rule may route gradients anywhere, so custom_jvp and
custom_vjp calls count as depending on every input (for the reach
question; a layer's own params follow the call's primal, where a layer
called inside it ends their path). An input reported unreached therefore
truly sends no derivative to the outputs.
"""

import contextlib
import functools
import math
import operator
from typing import Any, Callable, NamedTuple

import flax
import jax

from kfac_optax._src import tree_paths
from kfac_optax._src.curvature import model_call
from kfac_optax._src.curvature import plan as plans
from kfac_optax._src.curvature import summary
from kfac_optax._src.models import capture

# Calls whose inner jaxpr takes the call's operands in order.
_TRANSPARENT_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "checkpoint": "jaxpr",
                      "remat": "jaxpr", "remat2": "jaxpr",
                      "closed_call": "call_jaxpr"}
_CUSTOM_DERIVATIVE_CALLS = ("custom_jvp_call", "custom_vjp_call")
# Indexing that keeps some of an array's elements (x[:, 0], x[idx]).
_SLICES = ("slice", "dynamic_slice", "gather")


class Reads(NamedTuple):
  """What one walk of the hooked model's jaxpr finds."""
  unreached_fallback: dict[str, bool]                        # leaf key -> unreached
  unreached_calls: dict[tree_paths.Path, tuple[bool, ...]]   # layer -> per call
  read_elsewhere: list[tree_paths.Path]  # layer params leaves read outside its calls
  sliced: list[tree_paths.Path]          # layers with a call whose rows the loss slices


def check(model: model_call.ModelCall, plan: plans.Plan, params: Any,
          batch: Any, axis_names: tuple[str, ...]) -> None:
  """Every block's layers and params must reach the loss's outputs on
  ``batch`` (the example batch, at init): a layer through at least one of
  its calls (`reached_calls` leaves the others out of its statistics); and
  a layer's params only through its calls.

  Warns when the loss reads only some rows of a call's output (by indexing
  it): the statistics would count every row.

  Raises:
    ValueError: naming the layers and params that do not, or the params
      read outside their layer's calls, and the fix.
  """
  reads = _reads(model, plan, params, batch, axis_names, own_params=True)
  layers = [key for key, (path, _) in plan.layers.items()
            if path in reads.unreached_calls and all(reads.unreached_calls[path])]
  leaves = [key for key, unused in reads.unreached_fallback.items() if unused]
  if layers or leaves:
    raise ValueError(unreached_message(layers, leaves))
  if reads.read_elsewhere:
    raise ValueError(read_elsewhere_message(reads.read_elsewhere))
  if reads.sliced:
    summary.warn(sliced_message(reads.sliced))


def reached_calls(model: model_call.ModelCall, plan: plans.Plan, params: Any,
                  batch: Any, axis_names: tuple[str, ...]
                  ) -> dict[tree_paths.Path, tuple[int, ...]]:
  """For each layer some of whose calls do not reach the loss's outputs:
  the indices of those that do (a layer absent reaches through all).

  A call whose output the loss never reads (big_vision's ViT applies its
  head to the pooled features, which the loss reads, and to every patch's,
  which it returns beside them) adds nothing to the layer's Fisher block,
  but its inputs would count as rows of ``A`` (49 of every 50 rows of that
  head's): its statistics must leave it out."""
  calls = _reads(model, plan, params, batch, axis_names).unreached_calls
  return {path: tuple(i for i, unused in enumerate(flags) if not unused)
          for path, flags in calls.items() if any(flags)}


def only_reached(captured: capture.Captured,
                 reached: dict[tree_paths.Path, tuple[int, ...]]) -> capture.Captured:
  """``captured`` without the layer calls that `reached_calls` leaves out."""
  kept = lambda per_path: {path: tuple(calls[i] for i in reached[path])
                           if path in reached else calls
                           for path, calls in per_path.items()}
  return captured._replace(inputs=kept(captured.inputs),
                           output_grads=kept(captured.output_grads))


def _reads(model: model_call.ModelCall, plan: plans.Plan, params: Any, batch: Any,
           axis_names: tuple[str, ...], own_params: bool = False) -> Reads:
  """`Reads` from one abstract trace of the hooked model on ``batch``
  (``read_elsewhere`` and ``sliced`` only with ``own_params``, at init).

  One walk carries a bit per question: bit 0 asks what reaches the loss;
  layer ``i``'s bit ``2**(i + 1)`` is dropped where the layer's own marked
  calls pass their outputs on, so its params keep it only through other reads.
  """
  bits = {path: 2 << i for i, (path, _) in enumerate(plan.layers.values())}
  markers = {capture.marker_name(path): path for path in bits}
  ends = {name: bits[path] for name, path in markers.items()}
  for table, calls in plan.tied.items():  # the table's block owns these calls
    for call in calls:
      ends[capture.marker_name(call)] = ends.get(capture.marker_name(call), 0) | bits[table]
  for call in plan.unowned:  # calls on weights the model computes: warned of
    ends[capture.marker_name(call)] = ~1
  found = []

  def trace(params, batch, variables, _):
    hooked = plans.hooked_model(model, plan, params, batch, variables, None,
                                flax.core.DenyList("params"))
    flat_params = tree_paths.flatten(params)[0]
    fallback = {k: flat_params[path] for k, path in plan.fallback_paths.items()}
    owned = {path + (name,): flat_params[path + (name,)]
             for path, block in plan.layers.values()
             for name in block.param_names} if own_params else {}
    args = (fallback, plan.perturbations, owned)
    # The marks only serve the layer bits: the reach question (bit 0) passes
    # through them, so `reached_calls` (every update's trace) goes without.
    with capture.marking_calls() if own_params else contextlib.nullcontext():
      jaxpr = jax.make_jaxpr(lambda *args: hooked(*args)[0])(*args).jaxpr
    need = _need_map(jaxpr, [-1] * len(jaxpr.outvars), ends)
    found.append((jax.tree.unflatten(jax.tree.structure(args),
                                     [need.get(v, 0) for v in jaxpr.invars]),
                  _sliced_calls(jaxpr, need, markers) if own_params else []))
  plans.abstractly(trace, params, batch, {}, axis_names)
  (fallback, perturbations, owned), sliced = found[0]
  calls = {path: tuple(not any(need & 1 for need in jax.tree.leaves(call))
                       for call in per_call)
           for path, per_call in capture.by_layer(perturbations).items()}
  return Reads({k: not need & 1 for k, need in fallback.items()}, calls,
               [leaf for leaf, need in owned.items() if need & bits[leaf[:-1]]],
               sliced)


def _sliced_calls(jaxpr: Any, need: dict, markers: dict[str, tree_paths.Path]
                  ) -> list[tree_paths.Path]:
  """The layers with a call (outside control flow and calls) whose output
  the loss reads only through indexing that keeps fewer rows (every axis but
  the last) than the output has, as in ``head(h)[:, 0]``."""
  rows = lambda var: math.prod(var.aval.shape[:-1])
  readers_of = {}  # var -> the equations on the loss's path that read it
  for eqn in jaxpr.eqns:
    if any(need.get(v, 0) & 1 for v in eqn.outvars):
      for var in filter(_is_var, eqn.invars):
        readers = readers_of.setdefault(var, [])
        if not readers or readers[-1] is not eqn:  # once per equation
          readers.append(eqn)
  sliced = []
  for eqn in jaxpr.eqns:
    path = markers.get(eqn.params.get("name")) if _inner(eqn) is not None else None
    if path is None or path in sliced or not eqn.outvars:  # outputs pruned (nn.scan)
      continue
    output = eqn.outvars[0]
    readers = readers_of.get(output, [])
    if (readers and output not in jaxpr.outvars
        and all(e.primitive.name in _SLICES and e.invars[0] is output for e in readers)
        and sum(rows(e.outvars[0]) for e in readers) < rows(output)):
      sliced.append(path)
  return sliced


def unreached(fn: Callable[..., Any], *args: Any) -> list[bool]:
  """For each leaf of ``args`` (flattened in order): True if no output of
  ``fn(*args)`` depends on it through a differentiable path.

  ``args`` may be arrays or ``jax.ShapeDtypeStruct`` (the trace runs no
  FLOPs).
  """
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return [not need for need in _needs(jaxpr, [1] * len(jaxpr.outvars), {})]


def _is_var(atom: Any) -> bool:
  return not hasattr(atom, "val")  # a Literal has a value, a Var has not


def _inner(eqn: Any) -> Any:
  """The inner jaxpr of a transparent call, or None."""
  name = _TRANSPARENT_CALLS.get(eqn.primitive.name)
  inner = eqn.params.get(name) if name else None
  inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's own jaxpr
  if inner is None or len(inner.invars) != len(eqn.invars):
    return None
  return inner


def _needs(jaxpr: Any, out_needs: list[int], ends: dict[str, int]) -> list[int]:
  """For each invar of ``jaxpr``: the union of the bits of ``out_needs`` (one
  int per outvar) of the outvars that depend on it. A marked call named in
  ``ends`` passes its output's bits on without the ones it names."""
  need = _need_map(jaxpr, out_needs, ends)
  return [need.get(v, 0) for v in jaxpr.invars]


def _need_map(jaxpr: Any, out_needs: list[int], ends: dict[str, int]) -> dict:
  """`_needs` of every var of ``jaxpr`` (its own equations' too)."""
  need = {}

  def pull(atoms, needs):
    for atom, bits in zip(atoms, needs):
      if bits and _is_var(atom):
        need[atom] = need.get(atom, 0) | bits
  pull(jaxpr.outvars, out_needs)
  for eqn in reversed(jaxpr.eqns):
    needs = [need.get(v, 0) for v in eqn.outvars]
    if any(needs) and eqn.primitive.name != "stop_gradient":
      pull(eqn.invars, _eqn_needs(eqn, needs, ends))
  return need


def _eqn_needs(eqn: Any, needs: list[int], ends: dict[str, int]) -> list[int]:
  """`_needs` of one equation's inputs, given its outputs'."""
  inner = _inner(eqn)
  if inner is not None:
    if eqn.params.get("name") in ends:  # output + perturbation, one output
      return [needs[0] & ~ends[eqn.params["name"]], needs[0]]
    return _needs(inner, needs, ends)
  params = eqn.params
  if eqn.primitive.name == "scan":
    return _loop_needs(params["jaxpr"].jaxpr, params["num_consts"],
                       params["num_carry"], needs, ends)
  if eqn.primitive.name == "while":  # the predicate passes no derivative
    return [0] * params["cond_nconsts"] + _loop_needs(
        params["body_jaxpr"].jaxpr, params["body_nconsts"], len(needs), needs, ends)
  if eqn.primitive.name == "cond":  # the branch index passes no derivative
    branches = [_needs(branch.jaxpr, needs, ends) for branch in params["branches"]]
    return [0] + [functools.reduce(operator.or_, column) for column in zip(*branches)]
  union = functools.reduce(operator.or_, needs)
  primal = getattr(params.get("call_jaxpr"), "jaxpr", None)
  if eqn.primitive.name in _CUSTOM_DERIVATIVE_CALLS and primal is not None and len(
      primal.invars) == len(eqn.invars):
    # Reaching stays conservative; a layer's own params follow the primal,
    # so that a layer called inside (nn.custom_vjp) is not read elsewhere.
    inner = _needs(primal, [need & ~1 for need in needs], ends)
    return [(union & 1) | need for need in inner]
  return [union] * len(eqn.invars)


def _loop_needs(body: Any, num_consts: int, num_carry: int, needs: list[int],
                ends: dict[str, int]) -> list[int]:
  """The needs of a loop's ``(consts, carry, xs)`` whose body maps ``(consts,
  carry, x) -> (carry, y)`` and whose outputs ``(carry, ys)`` have ``needs``:
  a carry's need grows with what the next iteration's carry input needs,
  to a fixed point (the union over iterations; the initial carry's
  includes the outputs' own, for a loop of no iterations)."""
  carry, ys = list(needs[:num_carry]), list(needs[num_carry:])
  while True:
    inner = _needs(body, carry + ys, ends)
    grown = [c | i for c, i in zip(carry, inner[num_consts:num_consts + num_carry])]
    if grown == carry:
      return inner[:num_consts] + carry + inner[num_consts + num_carry:]
    carry = grown


def unreached_message(layers: list[str], leaves: list[str]) -> str:
  """init's error for layer blocks (keys) and fallback leaves (keys) that do
  not reach the loss's outputs."""
  modules = sorted({*layers, *(leaf.rpartition("/")[0] for leaf in leaves)})
  named = [*(f"{key!r} (layer)" for key in layers),
           *(f"{key!r} (param)" for key in leaves)]
  skip = {module: "skip" for module in modules[:4]}
  more = f" and {len(modules) - 4} more" if len(modules) > 4 else ""
  return (
      f"the loss's outputs do not depend on {', '.join(named[:6])}"
      f"{' ...' if len(named) > 6 else ''}: the loss K-FAC models "
      "(`loss` on what `outputs=` picks from the model's return value) "
      "sends them no gradient, so their Fisher block is zero and K-FAC's "
      "damped inverse would scale your gradient there by a factor that the "
      "damping sets, not any curvature (up to 1/damping).\nFix: leave them "
      f"unpreconditioned, layer_overrides={skip!r}{more} (their gradient "
      "passes through, scaled by the step's learning rate; params frozen by "
      "stop_gradient have none, so skipping them changes nothing); or, if "
      "your loss has a term for a head K-FAC's loss leaves out (an "
      "actor-critic's value), model both: loss=kfac_optax."
      "losses.joint(policy_loss, value_loss, weights=(1.0, c)) with outputs= "
      "returning the tuple of the heads' outputs; or, if `outputs=` picks the "
      "wrong part of what the model returns, pick the array your loss reads.")


def read_elsewhere_message(leaves: list[tree_paths.Path]) -> str:
  """init's error for layer params the model also reads outside the layer's
  calls."""
  modules = sorted({tree_paths.key(leaf[:-1]) for leaf in leaves})
  named = ", ".join(repr(tree_paths.key(leaf)) for leaf in leaves[:6])
  diagonal = {module: "diagonal" for module in modules[:4]}
  more = f" and {len(modules) - 4} more" if len(modules) > 4 else ""
  return (
      f"the model reads {named}{' ...' if len(leaves) > 6 else ''} outside "
      "the calls of its layer (e.g. a tied decoder's `h @ "
      "enc.variables['params']['kernel'].T`, or the array passed to another "
      "function): K-FAC's block for a layer models its params' "
      "gradient through the layer's own calls only, so its curvature would "
      "leave out the rest of their gradient.\nFix: give these params the "
      f"exact diagonal Fisher, layer_overrides={diagonal!r}{more}; or reuse "
      "the layer by calling it (a shared module keeps every call); or, for an "
      "embedding table that also gives the logits, call its `attend` "
      "(nn.Embed) or apply a Dense on its transpose and name that call in "
      "tied_embeddings={call: table}.")


def sliced_message(paths: list[tree_paths.Path]) -> str:
  """init's warning for layer calls whose output the loss reads in part."""
  named = ", ".join(repr(tree_paths.key(path)) for path in paths)
  return (
      f"the loss reads the output of {named} only through indexing that keeps "
      "some of its rows (e.g. head(h)[:, 0]): K-FAC's input factor A averages "
      "over every row the layer computes, so the rows the loss never reads "
      "(their output gradient is zero) dilute it. Index the layer's input "
      "instead (head(h[:, 0])), so that it computes only the rows the loss "
      "reads.")
