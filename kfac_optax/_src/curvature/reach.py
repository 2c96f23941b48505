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

The walk is conservative: a primitive's outputs depend on all of its
inputs, except ``stop_gradient`` (no derivative passes) and the calls whose
inner jaxpr is read the same way (``pjit``, ``remat``). A custom derivative
rule may route gradients anywhere, so custom_jvp/custom_vjp calls count as
depending on every input; control flow (scan, while, cond) too. An input
reported unreached therefore truly sends no derivative to the outputs.
"""

from typing import Any, Callable

import flax
import jax

from kfac_optax._src import tree_paths
from kfac_optax._src.curvature import model_call
from kfac_optax._src.curvature import plan as plans
from kfac_optax._src.models import capture

# Calls whose inner jaxpr takes the call's operands in order.
_TRANSPARENT_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "checkpoint": "jaxpr",
                      "remat": "jaxpr", "remat2": "jaxpr",
                      "closed_call": "call_jaxpr"}


def check(model: model_call.ModelCall, plan: plans.Plan, params: Any,
          batch: Any, axis_names: tuple[str, ...]) -> None:
  """Every block's layers and params must reach the loss's outputs on
  ``batch`` (the example batch, at init): a layer through at least one of
  its calls (`reached_calls` leaves the others out of its statistics).

  Raises:
    ValueError: naming the layers and params that do not, and the fix.
  """
  fallback, calls = _unreached_leaves(model, plan, params, batch, axis_names)
  layers = [key for key, (path, _) in plan.layers.items()
            if path in calls and all(calls[path])]
  leaves = [key for key, unused in fallback.items() if unused]
  if layers or leaves:
    raise ValueError(unreached_message(layers, leaves))


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
  _, calls = _unreached_leaves(model, plan, params, batch, axis_names)
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


def _unreached_leaves(model: model_call.ModelCall, plan: plans.Plan, params: Any,
                      batch: Any, axis_names: tuple[str, ...]
                      ) -> tuple[dict[str, bool], dict[tree_paths.Path, tuple[bool, ...]]]:
  """``(fallback leaf key -> unreached, layer path -> per call: unreached)``,
  from one abstract trace of the hooked model on ``batch``."""
  found = []

  def trace(params, batch, variables, _):
    hooked = plans.hooked_model(model, plan, params, batch, variables, None,
                                flax.core.DenyList("params"))
    flat_params = tree_paths.flatten(params)[0]
    fallback = {k: flat_params[path] for k, path in plan.fallback_paths.items()}
    flags = unreached(lambda *args: hooked(*args)[0], fallback, plan.perturbations)
    found.append(jax.tree.unflatten(
        jax.tree.structure((fallback, plan.perturbations)), flags))
  plans.abstractly(trace, params, batch, {}, axis_names)
  fallback, perturbations = found[0]
  calls = {path: tuple(all(jax.tree.leaves(call)) for call in per_call)
           for path, per_call in capture.by_layer(perturbations).items()}
  return fallback, calls


def unreached(fn: Callable[..., Any], *args: Any) -> list[bool]:
  """For each leaf of ``args`` (flattened in order): True if no output of
  ``fn(*args)`` depends on it through a differentiable path.

  ``args`` may be arrays or ``jax.ShapeDtypeStruct`` (the trace runs no
  FLOPs).
  """
  # One walk backwards from the outputs marks every input they need.
  return [not reaches for reaches in _reaching_inputs(jax.make_jaxpr(fn)(*args).jaxpr)]


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


def _reaching_inputs(jaxpr: Any) -> list[bool]:
  """For each invar of ``jaxpr``: whether some outvar depends on it."""
  needed = {v for v in jaxpr.outvars if _is_var(v)}
  for eqn in reversed(jaxpr.eqns):
    wanted = [v in needed for v in eqn.outvars]
    if not any(wanted) or eqn.primitive.name == "stop_gradient":
      continue
    inner = _inner(eqn)
    if inner is not None:
      # Only the inner outputs that are needed here pull on its inputs.
      sub = _restricted(inner, wanted)
      reached = _reaching_inputs(sub)
    else:
      reached = [True] * len(eqn.invars)
    needed.update(v for v, r in zip(eqn.invars, reached) if r and _is_var(v))
  return [v in needed for v in jaxpr.invars]


def _restricted(jaxpr: Any, wanted: list[bool]) -> Any:
  """``jaxpr`` with only the outvars in ``wanted``."""
  return jaxpr.replace(outvars=[v for v, w in zip(jaxpr.outvars, wanted) if w])


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
