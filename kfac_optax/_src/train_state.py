"""A flax TrainState whose `apply_gradients` hands the batch to K-FAC."""

import dataclasses
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
  ``tx.update``, which K-FAC needs to measure curvature, together with every
  other keyword that is not a field of the state (e.g. ``variables``).

  Example:
    >>> state = kfac_optax.TrainState.create(  # doctest: +SKIP
    ...     apply_fn=model.apply, params=params, tx=kfac_optax.kfac(...))
    >>> state = state.apply_gradients(grads=grads, batch=batch, rng=rng)  # doctest: +SKIP
    >>> # A model with BatchNorm: K-FAC's pass needs the batch_stats too.
    >>> state = state.apply_gradients(  # doctest: +SKIP
    ...     grads=grads, batch=batch, rng=rng,
    ...     variables={"batch_stats": batch_stats})
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
    """Applies ``grads`` with ``tx.update(..., batch=batch, rng=rng, ...)``.

    As in flax, an ``OVERWRITE_WITH_GRADIENT`` collection in ``grads``
    replaces its params entry directly; only ``grads["params"]`` passes
    through the optimizer, and the other collection is added to the
    ``variables`` handed to K-FAC's model pass.

    Args:
      grads: gradients with the structure of ``params``.
      batch: the training batch the gradients were computed on.
      rng: a fresh random key for this step (K-FAC's target sampling).
      **kwargs: fields of the state (a subclass's ``batch_stats``, say) are
        replaced, as in flax; every other keyword goes to ``tx.update``,
        e.g. ``variables={"batch_stats": ...}`` for K-FAC's model pass.

    Returns:
      The state after one step, with ``step`` incremented.
    """
    overwrite = OVERWRITE_WITH_GRADIENT in grads
    if overwrite:
      trained_grads, trained_params = grads["params"], self.params["params"]
      others = {k: v for k, v in self.params.items() if k != "params"}
    else:
      trained_grads, trained_params, others = grads, self.params, {}
    fields = {field.name for field in dataclasses.fields(self)}
    new_fields = {k: v for k, v in kwargs.items() if k in fields}
    forwarded = {k: v for k, v in kwargs.items() if k not in fields}
    forwarded["variables"] = {**(forwarded.get("variables") or {}), **others}
    updates, new_opt_state = self.tx.update(
        trained_grads, self.opt_state, trained_params,
        batch=batch, rng=rng, **forwarded)
    new_params = optax.apply_updates(trained_params, updates)
    if overwrite:
      replaced = {**self.params, "params": new_params,
                  OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
      new_params = (FrozenDict(replaced) if isinstance(self.params, FrozenDict)
                    else replaced)
    return self.replace(step=self.step + 1, params=new_params,
                        opt_state=new_opt_state, **new_fields)
