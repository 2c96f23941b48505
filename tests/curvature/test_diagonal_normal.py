"""The normal distribution with learned log standard deviations: its NLL,
its output Fisher against the expected Hessian and expected score outer
product by Gauss-Hermite quadrature, and K-FAC's factors and exact products
against brute force on a tiny model."""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import kfac_optax
from kfac_optax._src import losses as private_losses

LOSS = kfac_optax.losses.diagonal_normal()
N, D = 5, 2


class Regressor(nn.Module):
  """A tanh trunk and one head of D means and D log standard deviations."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2 * D, name="head")(jnp.tanh(nn.Dense(4, name="hidden")(x)))


def problem():
  x = jax.random.normal(jax.random.key(0), (N, 3))
  y = jax.random.normal(jax.random.key(1), (N, D))
  params = Regressor().init(jax.random.key(2), x)["params"]
  return params, (x, y)


def expected_over_targets(fn, outputs, points=12):
  """E_y[fn(y)] for y ~ N(μ, σ²) per unit, by a product Gauss-Hermite rule
  (exact for the polynomials in y that the NLL's derivatives are)."""
  nodes, weights = np.polynomial.hermite.hermgauss(points)
  mean, log_scale = np.split(np.asarray(outputs, np.float64), 2)
  total = 0.0
  for index in itertools.product(range(points), repeat=D):
    z = np.sqrt(2) * nodes[list(index)]
    total = total + np.prod(weights[list(index)]) / np.pi ** (D / 2) * fn(
        mean + np.exp(log_scale) * z)
  return total


def test_the_nll_is_the_normal_log_density():
  outputs = jnp.array([[0.3, -1.0, 0.2, -0.5]])
  y = jnp.array([[1.0, 0.5]])
  expected = -jnp.sum(jax.scipy.stats.norm.logpdf(y, outputs[:, :2],
                                                  jnp.exp(outputs[:, 2:])))
  np.testing.assert_allclose(LOSS.nll(outputs, y), [expected], rtol=1e-6)


def test_the_output_fisher_is_the_expected_hessian_and_score_outer_product():
  f = np.array([0.3, -1.0, 0.2, -0.5])
  with jax.enable_x64():
    nll = lambda f, y: LOSS.nll(f[None], y[None])[0]
    at = lambda fn, y: np.asarray(fn(nll)(jnp.asarray(f), jnp.asarray(y)))
    hessian = expected_over_targets(lambda y: at(jax.hessian, y), f)
    score = expected_over_targets(lambda y: np.outer(at(jax.grad, y), at(jax.grad, y)), f)
  columns = np.asarray(LOSS.fisher_sqrt(jnp.asarray(f, jnp.float32)[None]),
                       np.float64)[:, 0]
  fisher = columns.T @ columns
  np.testing.assert_allclose(hessian, score, atol=1e-8)
  np.testing.assert_allclose(fisher, hessian, rtol=1e-5, atol=1e-6)
  u = np.arange(1.0, 2 * D + 1)
  np.testing.assert_allclose(
      LOSS.fisher_product(jnp.asarray(f, jnp.float32)[None], jnp.asarray(u)[None])[0],
      hessian @ u, rtol=1e-5)


def test_sampled_cotangents_average_to_the_fisher():
  f = jnp.array([[0.3, -1.0, 0.2, -0.5]])
  cotangents = private_losses.output_cotangents(LOSS, f, (None, jnp.zeros((1, D))),
                                                "fisher", jax.random.key(3), 40000)
  u = np.asarray(cotangents[:, 0], np.float64)
  columns = np.asarray(LOSS.fisher_sqrt(f), np.float64)[:, 0]
  np.testing.assert_allclose(u.T @ u, columns.T @ columns, atol=0.05)


def test_factors_and_exact_product_are_the_brute_force_ones():
  params, batch = problem()
  x = np.asarray(batch[0], np.float64)
  tx = kfac_optax.scale_by_kfac(Regressor().apply, LOSS, example_batch=batch,
                                estimation="exact")
  factors = jax.jit(lambda p: tx.update(p, tx.init(p), p, batch=batch)[1].factors)(
      params)
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  h = np.tanh(x @ p["hidden"]["kernel"] + p["hidden"]["bias"])
  f = h @ p["head"]["kernel"] + p["head"]["bias"]
  fishers = np.stack([np.diag(np.concatenate([np.exp(-2 * fn[D:]), [2.0] * D]))
                      for fn in f])
  kernel = p["head"]["kernel"]
  trunk_g = [np.diag(1 - hn ** 2) @ kernel @ fn @ kernel.T @ np.diag(1 - hn ** 2)
             for hn, fn in zip(h, fishers)]
  with_one = lambda a: np.concatenate([a, np.ones((N, 1))], 1)
  outer_mean = lambda a: with_one(a).T @ with_one(a) / N
  expected = {"hidden": (outer_mean(x), np.mean(trunk_g, 0)),
              "head": (outer_mean(h), fishers.mean(0))}
  for layer, want in expected.items():
    for got, w in zip(factors[layer], want):
      np.testing.assert_allclose(np.asarray(got[0], np.float64), w, rtol=1e-5, atol=1e-7)

  curvature = kfac_optax.Curvature(Regressor().apply, LOSS, example_batch=batch)
  flat, unravel = ravel_pytree(params)
  jacobian = np.asarray(jax.jacobian(
      lambda v: Regressor().apply({"params": unravel(v)}, batch[0]))(flat), np.float64)
  ggn = np.einsum("nip,nij,njq->pq", jacobian, fishers, jacobian) / N
  v = jax.random.normal(jax.random.key(4), flat.shape)
  product = ravel_pytree(curvature.exact_product(params, batch, unravel(v)))[0]
  np.testing.assert_allclose(product, ggn @ np.asarray(v, np.float64), rtol=1e-4,
                             atol=1e-6)


def test_an_odd_last_axis_is_named():
  with pytest.raises(ValueError, match="must hold the means and the log standard"):
    LOSS.value(jnp.zeros((N, 3)), (None, jnp.zeros((N, 1))))
