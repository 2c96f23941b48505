"""A mask per output unit (missing labels of a multi-label task): each unit
is a term of its own, in the loss, the statistics and exact products."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import kfac_optax
from tests import brute_force as bf

N, LABELS = 6, 3  # TinyMLP's 3 outputs as 3 binary labels


def problem():
  params, (x, _) = bf.tiny_problem(seed=3, n=N)
  labels = jax.random.bernoulli(jax.random.key(5), 0.5, (N, LABELS)).astype(jnp.float32)
  # Row 2 has no label at all (a padding example), one unit weighs 2.
  mask = jnp.array([[1, 1, 1], [1, 0, 1], [0, 0, 0], [0, 1, 0], [1, 1, 0],
                    [2, 1, 1]], jnp.float32)
  return params, {"x": x, "y": labels, "mask": mask}


LOSS = kfac_optax.losses.sigmoid_cross_entropy(targets=lambda b: b["y"],
                                               mask=lambda b: b["mask"])


def sigmoid(f):
  return 1 / (1 + np.exp(-f))


def test_the_loss_is_the_weighted_mean_over_units():
  params, batch = problem()
  logits = bf.TinyMLP().apply({"params": params}, batch["x"])
  per_unit = optax.sigmoid_binary_cross_entropy(logits, batch["y"])
  expected = jnp.sum(batch["mask"] * per_unit) / jnp.sum(batch["mask"])
  np.testing.assert_allclose(LOSS.value(logits, batch), expected, rtol=1e-6)


@pytest.mark.parametrize("estimation", ["exact", "empirical"])
def test_factors_are_the_brute_force_ones(estimation):
  """A = Σ_n w_n ā āᵀ / Σ w (w_n: row n's summed unit weights),
  G = Σ_n J_nᵀ D_n J_n / Σ w with D_n = diag(m_n ⊙ p(1-p)) (exact) or
  r rᵀ, r = m_n ⊙ (p - y) (empirical: m² = m for a 0/1 mask, 4 for weight 2,
  hence the weight's square root on the cotangent)."""
  params, batch = problem()
  tx = kfac_optax.scale_by_kfac(bf.TinyMLP().apply, LOSS, example_batch=batch,
                                inputs=lambda b: b["x"], estimation=estimation)
  factors = jax.jit(lambda p, b: tx.update(p, tx.init(p), p, batch=b)[1].factors)(
      params, batch)
  f, inputs, jacobians = bf.forward(params, batch["x"])
  p, y, m = sigmoid(f), np.asarray(batch["y"], np.float64), np.asarray(batch["mask"], np.float64)
  if estimation == "exact":
    d = np.einsum("nc,cd->ncd", m * p * (1 - p), np.eye(LABELS))
  else:
    r = np.sqrt(m) * (p - y)
    d = np.einsum("nc,nd->ncd", r, r)
  w = m.sum(1)
  for name in bf.LAYERS:
    a, bias = inputs[name]
    a_bar = np.concatenate([a, np.ones((N, 1))], 1) if bias else a
    j = jacobians[name]
    want_a = np.einsum("n,ni,nj->ij", w, a_bar, a_bar) / w.sum()
    want_g = np.einsum("nci,ncd,ndj->ij", j, d, j) / w.sum()
    got_a, got_g = (np.asarray(x[0], np.float64) for x in factors[name])
    assert bf.relative_error(got_a, want_a) < 1e-5
    assert bf.relative_error(got_g, want_g) < 1e-5


@pytest.mark.parametrize("loss", [
    LOSS,  # a mask per unit
    kfac_optax.losses.squared_error(targets=lambda b: b["y"],  # a mask per row
                                    mask=lambda b: jnp.sum(b["mask"], 1))])
def test_masked_targets_may_be_nan(loss):
  """Missing labels marked NaN under a zero mask (Flax's ogbg-molpcba
  example): the loss, eager and jitted, and the empirical statistics are
  those of any finite targets there, none rejected."""
  params, batch = problem()
  mask = batch["mask"] if loss is LOSS else jnp.sum(batch["mask"], 1, keepdims=True)
  missing = {**batch, "y": jnp.where(mask == 0, jnp.nan, batch["y"])}
  logits = bf.TinyMLP().apply({"params": params}, batch["x"])
  want = float(loss.value(logits, batch))
  assert float(loss.value(logits, missing)) == pytest.approx(want, rel=1e-6)
  assert float(jax.jit(loss.value)(logits, missing)) == pytest.approx(want, rel=1e-6)
  tx = kfac_optax.scale_by_kfac(bf.TinyMLP().apply, loss, example_batch=batch,
                                inputs=lambda b: b["x"], estimation="empirical")
  update = jax.jit(lambda p, b: tx.update(p, tx.init(p), p, batch=b)[1])
  state, want_state = update(params, missing), update(params, batch)
  assert int(state.rejected_statistics) == 0
  for name in bf.LAYERS:
    for got, expected in zip(state.factors[name], want_state.factors[name]):
      assert bf.relative_error(got, np.asarray(expected)) < 1e-6


def test_exact_product_is_the_brute_force_fisher_of_the_masked_loss():
  """F = Σ_{n,c} m_nc p(1-p) ∇f_nc ∇f_ncᵀ / Σ m (the Gauss-Newton matrix of
  the weighted mean over units), times a vector."""
  params, batch = problem()
  curvature = kfac_optax.Curvature(bf.TinyMLP().apply, LOSS, example_batch=batch,
                                   inputs=lambda b: b["x"])
  flat, unravel = ravel_pytree(params)
  vector = jax.random.normal(jax.random.key(7), flat.shape)
  got = ravel_pytree(curvature.exact_product(params, batch, unravel(vector)))[0]
  jac = np.asarray(jax.jacobian(
      lambda v: bf.TinyMLP().apply({"params": unravel(v)}, batch["x"]))(flat), np.float64)
  f = np.asarray(bf.TinyMLP().apply({"params": params}, batch["x"]), np.float64)
  m = np.asarray(batch["mask"], np.float64)
  weight = m * sigmoid(f) * (1 - sigmoid(f))
  fisher = np.einsum("nc,nci,ncj->ij", weight, jac, jac) / m.sum()
  assert bf.relative_error(got, fisher @ np.asarray(vector, np.float64)) < 1e-5


def test_a_categorical_loss_takes_no_mask_per_unit():
  params, batch = problem()
  loss = kfac_optax.losses.softmax_cross_entropy(
      targets=lambda b: jnp.zeros(N, jnp.int32), mask=lambda b: b["mask"])
  tx = kfac_optax.scale_by_kfac(bf.TinyMLP().apply, loss, example_batch=batch,
                                inputs=lambda b: b["x"])
  with pytest.raises(ValueError, match="a mask cannot select parts of it"):
    tx.init(params)


def test_a_mask_of_ones_per_unit_makes_the_mean_over_units():
  """``mask`` of ones in the outputs' shape: the loss optax's mean over every
  unit (as Flax's NNX VAE example takes it), and G the per-example loss's
  G over the number of units, A unchanged."""
  params, batch = problem()
  ones = kfac_optax.losses.sigmoid_cross_entropy(
      targets=lambda b: b["y"], mask=lambda b: jnp.ones_like(b["y"]))
  per_example = kfac_optax.losses.sigmoid_cross_entropy(targets=lambda b: b["y"])
  logits = bf.TinyMLP().apply({"params": params}, batch["x"])
  np.testing.assert_allclose(
      ones.value(logits, batch),
      jnp.mean(optax.sigmoid_binary_cross_entropy(logits, batch["y"])), rtol=1e-6)

  def factors(loss):
    tx = kfac_optax.scale_by_kfac(bf.TinyMLP().apply, loss, example_batch=batch,
                                  inputs=lambda b: b["x"], estimation="exact")
    return tx.update(params, tx.init(params), params, batch=batch)[1].factors
  with_ones, without = factors(ones), factors(per_example)
  for name in bf.LAYERS:
    assert bf.relative_error(with_ones[name].a, np.asarray(without[name].a)) < 1e-6
    assert bf.relative_error(with_ones[name].g,
                             np.asarray(without[name].g) / LABELS) < 1e-5
