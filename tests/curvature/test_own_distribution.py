"""A distribution of the user's own, by subclassing PredictiveLoss (the
Poisson of docs/models.md): K-FAC's factors against brute force, and the
error that names a method it lacks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_optax
from tests import brute_force as bf


class Poisson(kfac_optax.losses.PredictiveLoss):
  """Counts ``y ~ Poisson(exp(f))`` per output unit."""

  NAME = "poisson"

  def nll(self, outputs, targets):
    return jnp.sum(jnp.exp(outputs) - targets * outputs
                   + jax.scipy.special.gammaln(targets + 1), -1)

  def sample(self, rng, outputs):
    return jax.random.poisson(rng, jnp.exp(outputs)).astype(outputs.dtype)

  def fisher_sqrt(self, outputs):  # F_out = diag(exp(f)), f the natural parameter
    root = jnp.sqrt(jnp.exp(outputs))
    return jnp.moveaxis(root[..., :, None] * jnp.eye(outputs.shape[-1]), -2, 0)

  def fisher_product(self, outputs, u):
    return jnp.exp(outputs) * u


def problem():
  params, (x, _) = bf.tiny_problem(seed=4)
  counts = jax.random.poisson(jax.random.key(8), 2.0, (len(x), 3)).astype(jnp.float32)
  return params, (x, counts)


def test_factors_are_the_brute_force_ones():
  """Exact estimation: A = mean ā āᵀ, G = mean J diag(exp f) Jᵀ."""
  params, batch = problem()
  tx = kfac_optax.scale_by_kfac(bf.TinyMLP().apply, Poisson(), example_batch=batch,
                                estimation="exact")
  factors = jax.jit(lambda p: tx.update(p, tx.init(p), p, batch=batch)[1].factors)(
      params)
  f, inputs, jacobians = bf.forward(params, batch[0])
  n = len(f)
  fisher = np.einsum("nc,cd->ncd", np.exp(f), np.eye(3))
  for name in bf.LAYERS:
    a, bias = inputs[name]
    a_bar = np.concatenate([a, np.ones((n, 1))], 1) if bias else a
    j = jacobians[name]
    want = (a_bar.T @ a_bar / n, np.einsum("nci,ncd,ndj->ij", j, fisher, j) / n)
    for got, expected in zip(factors[name], want):
      assert bf.relative_error(np.asarray(got[0], np.float64), expected) < 1e-5


def test_the_automatic_mode_trains_on_it():
  params, batch = problem()
  loss = Poisson()
  tx = kfac_optax.kfac(bf.TinyMLP().apply, loss, example_batch=batch)
  loss_of = lambda p: loss.value(bf.TinyMLP().apply({"params": p}, batch[0]), batch)

  @jax.jit
  def step(p, state, key):
    updates, state = tx.update(jax.grad(loss_of)(p), state, p, batch=batch, rng=key)
    return jax.tree.map(jnp.add, p, updates), state
  trained, state = params, tx.init(params)
  for i in range(10):
    trained, state = step(trained, state, jax.random.key(i))
  assert loss_of(trained) < loss_of(params)


class WithoutProducts(kfac_optax.losses.PredictiveLoss):
  """Enough for the sampled Fisher only."""
  nll, sample = Poisson.nll, Poisson.sample


def test_a_missing_method_is_named_with_what_needs_it():
  params, batch = problem()
  sampled = kfac_optax.scale_by_kfac(bf.TinyMLP().apply, WithoutProducts(),
                                     example_batch=batch)
  # The sampled Fisher needs neither fisher_sqrt nor fisher_product.
  sampled.update(params, sampled.init(params), params, batch=batch,
                 rng=jax.random.key(0))
  tx = kfac_optax.kfac(bf.TinyMLP().apply, WithoutProducts(), example_batch=batch)
  with pytest.raises(NotImplementedError,
                     match="WithoutProducts does not define fisher_product, which "
                           "kfac's solved steps"):
    tx.update(params, tx.init(params), params, batch=batch, rng=jax.random.key(0))
