"""K-FAC against Adam on scikit-learn digits: training loss after 200 steps."""

import flax.linen as nn
import jax
import numpy as np
import optax
from sklearn.datasets import load_digits

import kfac_optax

STEPS, BATCH = 200, 128
LOSS = kfac_optax.losses.softmax_cross_entropy()


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(64)(x))
    x = nn.tanh(nn.Dense(64, use_bias=False)(x))
    return nn.Dense(10)(x)


def final_training_loss(tx, x, y):
  """Trains from a fixed init on a fixed batch order; full-data loss after."""
  model = MLP()
  params = model.init(jax.random.key(0), x[:1])["params"]
  state = tx.init(params)
  order = np.random.default_rng(0)

  @jax.jit
  def step(params, state, batch, rng):
    grads = jax.grad(lambda p: LOSS.value(model.apply({"params": p}, batch[0]),
                                          batch))(params)
    updates, state = tx.update(grads, state, params, batch=batch, rng=rng)
    return optax.apply_updates(params, updates), state

  for i in range(STEPS):
    idx = order.choice(len(x), BATCH, replace=False)
    params, state = step(params, state, (x[idx], y[idx]), jax.random.key(i))
  return float(LOSS.value(model.apply({"params": params}, x), (x, y)))


def test_kfac_beats_best_adam_after_200_steps():
  x, y = load_digits(return_X_y=True)
  x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
  adam = {lr: final_training_loss(optax.adam(lr), x, y) for lr in (1e-2, 3e-2, 1e-1)}
  kfac = final_training_loss(
      kfac_optax.kfac(MLP().apply, LOSS, example_batch=(x[:BATCH], y[:BATCH]),
                      learning_rate=0.1, momentum=0.9, damping=0.1), x, y)
  best_adam = min(adam.values())
  assert min(adam, key=adam.get) == 3e-2  # the grid brackets Adam's best rate
  assert kfac < best_adam, (kfac, adam)
