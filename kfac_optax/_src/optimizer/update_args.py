"""Checks of what ``update`` is given: the batch, params, grads and key.

Both transformations check their update's arguments before tracing K-FAC's
pass, so that a missing batch, gradients of other params or a malformed key
is an error naming the argument and its fix, not a shape error inside it.
"""

from typing import Any

import jax
import jax.numpy as jnp

from kfac_optax._src import checks
from kfac_optax._src import tree_paths


def value_at(hyperparameter: Any, count: jax.Array) -> jax.Array:
  """A hyperparameter's value at step ``count``: a schedule's, or itself."""
  return hyperparameter(count) if callable(hyperparameter) else hyperparameter


def check(estimation: str, grads: Any, batch: Any, params: Any, rng: Any,
          name: str) -> None:
  """The arguments of ``name``'s update (``estimation``: the curvature's)."""
  if batch is None:
    raise TypeError(
        f"{name}'s update needs the training batch: call "
        "tx.update(grads, state, params, batch=batch, rng=rng), or "
        "kfac_optax.TrainState.apply_gradients(grads=..., batch=..., rng=...). "
        "If you did, a wrapper between you and it dropped them: one that is "
        "not an optax.GradientTransformationExtraArgs, such as an "
        "optax.MultiSteps inside optax.chain (put the chain inside "
        "MultiSteps instead: MultiSteps(optax.chain(..., kfac(...)), k)).")
  if params is None:
    raise TypeError(f"{name}'s update needs params: "
                    "tx.update(grads, state, params, batch=batch, rng=rng)")
  _check_grads_fit(grads, params, name)
  if estimation in ("fisher", "curvature_prop") and rng is None:
    raise TypeError(
        f'estimation="{estimation}" draws random output gradients '
        "and needs rng=: pass a fresh jax.random key each step (or use "
        'estimation="empirical" or "exact")')
  if rng is not None:
    checks.random_key("rng", rng)


def _check_grads_fit(grads, params, name: str) -> None:
  """The gradients must be params-shaped: same leaves, same shapes."""
  flat_grads = tree_paths.flatten(grads)[0]
  flat_params = tree_paths.flatten(params)[0]
  wrong = []
  for path in {**flat_params, **flat_grads}:
    shapes = [tuple(jnp.shape(tree[path])) if path in tree else "missing"
              for tree in (flat_grads, flat_params)]
    if shapes[0] != shapes[1]:
      wrong.append(f"{'/'.join(path)}: {shapes[0]} vs {shapes[1]}")
  if wrong:
    raise ValueError(
        f"{name}'s update got grads that do not match params (grads shape vs "
        f"params shape): {'; '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}."
        "\nFix: pass the gradients of these params, tx.update(grads, state, "
        "params, ...) with grads = jax.grad(loss_fn)(params): the same tree "
        "and shapes as params.")


def check_state(state: Any, expected: type, name: str) -> None:
  """``state`` must be what ``name``'s init made (``expected``), not another
  transformation's (`kfac` and `scale_by_kfac` hold different states)."""
  if not isinstance(state, expected):
    raise TypeError(
        f"{name}'s update got a {type(state).__name__} as its state, not the "
        f"{expected.__name__} that {name}'s init makes.\nFix: pass the state "
        f"this transformation's init returned (opt_state = tx.init(params) "
        "with the same tx); restore a checkpoint with a target built from "
        "the same tx.")
