"""A flax TrainState whose `apply_gradients` hands the batch to K-FAC."""

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.core import FrozenDict
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training import train_state


class TrainState(train_state.TrainState):
  """`flax.training.train_state.TrainState` for K-FAC optimizers.

  Identical to flax's, except that `apply_gradients` takes the ``batch`` (and
  ``rng``, needed by ``estimation="fisher"``) and forwards them to
  ``tx.update``, which K-FAC needs to measure curvature.

  Example:
    >>> state = kfac_optax.TrainState.create(  # doctest: +SKIP
    ...     apply_fn=model.apply, params=params, tx=kfac_optax.kfac(...))
    >>> state = state.apply_gradients(grads=grads, batch=batch, rng=rng)  # doctest: +SKIP
  """

  @classmethod
  def create(cls, *, apply_fn, params, tx, **kwargs) -> "TrainState":
    """As flax's ``create``, with ``step`` an int32 array rather than 0.

    flax stores the Python int 0, so the first jitted step sees another input
    type than the later ones and compiles twice; an array compiles once.
    """
    state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
    return state.replace(step=jnp.zeros([], jnp.int32))

  def apply_gradients(self, *, grads: Any, batch: Any,
                      rng: jax.Array | None = None, **kwargs: Any) -> "TrainState":
    """Applies ``grads`` with ``tx.update(..., batch=batch, rng=rng)``.

    As in flax, an ``OVERWRITE_WITH_GRADIENT`` collection in ``grads``
    replaces its params entry directly; only ``grads["params"]`` passes
    through the optimizer, and the other collection is handed to K-FAC's
    model pass as ``variables``.

    Args:
      grads: gradients with the structure of ``params``.
      batch: the training batch the gradients were computed on.
      rng: a fresh random key for this step (K-FAC's target sampling).
      **kwargs: other fields to replace, as in flax.

    Returns:
      The state after one step, with ``step`` incremented.
    """
    overwrite = OVERWRITE_WITH_GRADIENT in grads
    if overwrite:
      trained_grads, trained_params = grads["params"], self.params["params"]
      others = {k: v for k, v in self.params.items() if k != "params"}
    else:
      trained_grads, trained_params, others = grads, self.params, {}
    updates, new_opt_state = self.tx.update(
        trained_grads, self.opt_state, trained_params,
        batch=batch, rng=rng, variables=others)
    new_params = optax.apply_updates(trained_params, updates)
    if overwrite:
      replaced = {**self.params, "params": new_params,
                  OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
      new_params = (FrozenDict(replaced) if isinstance(self.params, FrozenDict)
                    else replaced)
    return self.replace(step=self.step + 1, params=new_params,
                        opt_state=new_opt_state, **kwargs)
