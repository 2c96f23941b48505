"""`schedule_free_kfac` against the schedule-free recurrences, written out in
float64 around brute-force K-FAC steps on the tiny MLP."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_optax
from kfac_optax._src.optimizer import adaptive
from tests import brute_force as bf

LOSS = kfac_optax.losses.softmax_cross_entropy()
DAMPING = 1e-2
PARAMS, BATCH = bf.tiny_problem()
BATCHES = [bf.tiny_problem(seed=s)[1] for s in range(3)]
# Inverses every step and an EMA that keeps only the newest batch: each base
# step is the brute-force damped natural gradient of its own batch.
SETTINGS = dict(example_batch=BATCH, estimation="empirical", damping=DAMPING,
                inverse_update_period=1, ema_decay=0.0)


def grads_at(params, batch):
  return jax.grad(lambda p: LOSS.value(bf.TinyMLP().apply({"params": p}, batch[0]),
                                       batch))(params)


def as64(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def combine(a, b, wa, wb):
  return jax.tree.map(lambda u, v: wa * u + wb * v, a, b)


def scaled(tree, factor):
  return jax.tree.map(lambda a: factor * np.asarray(a, np.float64), tree)


@pytest.mark.parametrize("learning_rates, b1", [((0.3, 0.3, 0.3), 0.9),
                                                ((0.1, 0.4, 0.2), 0.5)])
def test_steps_follow_the_schedule_free_recurrences(learning_rates, b1):
  """y (the trained params) and x (the evaluation params) after three steps,
  each base step ``-lr_t F̂⁻¹ g`` from explicit Kronecker products at y_t."""
  schedule = lambda count: jnp.asarray(learning_rates)[count]
  tx = kfac_optax.schedule_free_kfac(bf.TinyMLP().apply, LOSS, learning_rate=schedule,
                                     b1=b1, norm_constraint=None, **SETTINGS)
  update = jax.jit(lambda g, s, p, b: tx.update(g, s, p, batch=b))
  y, state = PARAMS, tx.init(PARAMS)
  x_ref = z_ref = y_ref = as64(PARAMS)
  weight_sum = largest = 0.0
  for lr, batch in zip(learning_rates, BATCHES):
    grads = grads_at(y, batch)
    natural = bf.precondition(bf.factors(y, batch, "empirical"), grads, DAMPING)
    z_ref = combine(z_ref, natural, 1.0, -lr)
    largest = max(largest, lr)
    weight_sum += largest ** 2
    c = largest ** 2 / weight_sum
    x_ref = combine(x_ref, z_ref, 1 - c, c)
    y_ref = combine(x_ref, z_ref, b1, 1 - b1)
    updates, state = update(grads, state, y, batch)
    y = optax.apply_updates(y, updates)
    assert bf.relative_error(y, y_ref) < 1e-4
  x = optax.contrib.schedule_free_eval_params(state, y)
  assert bf.relative_error(x, x_ref) < 1e-4
  # The averaging moved y off the last base iterate.
  assert bf.relative_error(y_ref, z_ref) > 1e-3


def test_the_kl_bound_limits_each_base_step():
  """With a bound that binds, each base step is the unbounded one scaled so
  that its Fisher norm ``α² vᵀg`` equals the bound."""
  lr, bound = 0.5, 1e-4
  grads = grads_at(PARAMS, BATCHES[0])

  def first_update(bound_or_none):
    tx = kfac_optax.schedule_free_kfac(bf.TinyMLP().apply, LOSS, learning_rate=lr,
                                       norm_constraint=bound_or_none, **SETTINGS)
    return tx.update(grads, tx.init(PARAMS), PARAMS, batch=BATCHES[0])

  bounded, state = first_update(bound)
  free, _ = first_update(None)
  natural = bf.precondition(bf.factors(PARAMS, BATCHES[0], "empirical"), grads, DAMPING)
  scale = np.sqrt(bound / float(adaptive.tree_dot(natural, grads))) / lr
  assert scale < 1
  # The first step: y_1 = z_1 (c_1 = 1), so the update is the base step.
  assert bf.relative_error(free, scaled(natural, -lr)) < 1e-4
  assert bf.relative_error(bounded, scaled(free, scale)) < 1e-4
  assert float(kfac_optax.stats(state)["fisher_norm"]) == pytest.approx(bound, rel=1e-3)


def test_describe_and_train_state_see_through_the_averaging():
  tx = kfac_optax.schedule_free_kfac(bf.TinyMLP().apply, LOSS, learning_rate=0.1,
                                     **SETTINGS)
  assert "hidden" in str(kfac_optax.describe(tx, PARAMS))
  state = kfac_optax.TrainState.create(apply_fn=bf.TinyMLP().apply, params=PARAMS, tx=tx)
  state = state.apply_gradients(grads=grads_at(PARAMS, BATCH), batch=BATCH)
  assert int(state.step) == 1 and bf.relative_error(state.params, PARAMS) > 1e-4


@pytest.mark.parametrize("settings, message", [
    (dict(learning_rate=0.1, momentum=0.9), "no momentum"),
    (dict(learning_rate=None), "needs a learning_rate"),
    (dict(learning_rate=0.1, b1=1.0), r"b1 must be in \[0, 1\)"),
    (dict(learning_rate=0.1, weight_lr_power=-1.0), "weight_lr_power must be >= 0"),
    (dict(learning_rate=0.1, norm_constraint=-1.0), "norm_constraint"),
])
def test_bad_settings_are_rejected(settings, message):
  with pytest.raises(ValueError, match=message):
    kfac_optax.schedule_free_kfac(bf.TinyMLP().apply, LOSS, **settings, **SETTINGS)
