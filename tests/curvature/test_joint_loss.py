"""A joint loss over several heads (an actor-critic's policy and value):
its value, output cotangents, factors and exact Fisher products against
brute force, and its errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import kfac_optax
from kfac_optax import losses
from kfac_optax._src import losses as private_losses

N, CLASSES, VALUES = 6, 3, 2
WEIGHTS = (1.0, 0.5)


class TwoHeads(nn.Module):
  """A tanh trunk, a policy head (logits) and a value head."""

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(4, name="hidden")(x))
    return nn.Dense(CLASSES, name="policy")(h), nn.Dense(VALUES, name="value")(h)


def problem():
  x = jax.random.normal(jax.random.key(0), (N, 5))
  batch = {"x": x,
           "action": jax.random.randint(jax.random.key(1), (N,), 0, CLASSES),
           "return": jax.random.normal(jax.random.key(2), (N, VALUES)),
           # Row 2 padding, row 5 counted twice.
           "weight": jnp.array([1.0, 1.0, 0.0, 1.0, 1.0, 2.0])}
  params = TwoHeads().init(jax.random.key(3), x)["params"]
  return params, batch


LOSS = losses.joint(losses.softmax_cross_entropy(targets=lambda b: b["action"]),
                    losses.squared_error(targets=lambda b: b["return"]),
                    weights=WEIGHTS, mask=lambda b: b["weight"])


def test_the_value_is_the_weighted_sum_of_the_heads_masked_means():
  params, batch = problem()
  logits, value = TwoHeads().apply({"params": params}, batch["x"])
  per_example = (WEIGHTS[0] * optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["action"])
      + WEIGHTS[1] * 0.5 * jnp.sum((value - batch["return"]) ** 2, -1))
  w = batch["weight"]
  np.testing.assert_allclose(LOSS.value((logits, value), batch),
                             jnp.sum(w * per_example) / jnp.sum(w), rtol=1e-6)
  # The padding row's return may be NaN: the joint mask keeps it out.
  missing = {**batch, "return": batch["return"].at[2].set(jnp.nan)}
  np.testing.assert_allclose(LOSS.value((logits, value), missing),
                             jnp.sum(w * per_example) / jnp.sum(w), rtol=1e-6)


def output_fishers(logits):
  """Per example, the joint output Fisher blockdiag(c₁(diag p - p pᵀ), c₂ I)."""
  p = jax.nn.softmax(np.asarray(logits, np.float64))
  fishers = np.zeros((len(p), CLASSES + VALUES, CLASSES + VALUES))
  for n, pn in enumerate(p):
    fishers[n, :CLASSES, :CLASSES] = WEIGHTS[0] * (np.diag(pn) - np.outer(pn, pn))
    fishers[n, CLASSES:, CLASSES:] = WEIGHTS[1] * np.eye(VALUES)
  return fishers


@pytest.mark.parametrize("estimation,samples,atol", [
    ("exact", 1, 1e-6), ("fisher", 20000, 0.03), ("curvature_prop", 20000, 0.03)])
def test_cotangents_outer_products_are_the_weighted_output_fishers(estimation, samples,
                                                                   atol):
  """Σ_k u_k u_kᵀ over the heads' concatenated cotangents is each example's
  blockdiag(c₁ F₁, c₂ F₂) times its mask weight: exactly for "exact", in
  expectation (the heads' cross terms vanish) for the sampled ones."""
  params, batch = problem()
  outputs = TwoHeads().apply({"params": params}, batch["x"])
  cotangents = private_losses.output_cotangents(LOSS, outputs, batch, estimation,
                                                jax.random.key(4), samples)
  u = np.concatenate([np.asarray(c, np.float64) for c in cotangents], -1)
  measured = np.einsum("kni,knj->nij", u, u)
  expected = output_fishers(outputs[0]) * np.asarray(batch["weight"])[:, None, None]
  np.testing.assert_allclose(measured, expected, atol=atol)


def brute_force_factors(params, batch):
  """A and G of the three layers from the per-example Jacobians, float64."""
  x = np.asarray(batch["x"], np.float64)
  w = np.asarray(batch["weight"], np.float64)
  p = {k: {n: np.asarray(v, np.float64) for n, v in d.items()} for k, d in params.items()}
  h = np.tanh(x @ p["hidden"]["kernel"] + p["hidden"]["bias"])
  logits = h @ p["policy"]["kernel"] + p["policy"]["bias"]
  fishers = output_fishers(logits)
  heads = np.concatenate([p["policy"]["kernel"], p["value"]["kernel"]], 1)  # (4, 5)
  trunk_g = [np.diag(1 - hn ** 2) @ heads @ fn @ heads.T @ np.diag(1 - hn ** 2)
             for hn, fn in zip(h, fishers)]
  mean = lambda terms: np.einsum("n,n...->...", w, np.asarray(terms)) / w.sum()
  with_one = lambda a: np.concatenate([a, np.ones((len(a), 1))], 1)
  outer = lambda a: np.einsum("ni,nj->nij", a, a)
  return {"hidden": (mean(outer(with_one(x))), mean(trunk_g)),
          "policy": (mean(outer(with_one(h))), mean(fishers[:, :CLASSES, :CLASSES])),
          "value": (mean(outer(with_one(h))), mean(fishers[:, CLASSES:, CLASSES:]))}


def test_factors_are_the_brute_force_ones():
  """Exact estimation: the trunk's G sums both heads' weighted Fishers
  pulled back through the heads, each head's G its own."""
  params, batch = problem()
  tx = kfac_optax.scale_by_kfac(TwoHeads().apply, LOSS, example_batch=batch,
                                inputs=lambda b: b["x"], estimation="exact")
  factors = jax.jit(lambda p: tx.update(p, tx.init(p), p, batch=batch)[1].factors)(
      params)
  for layer, expected in brute_force_factors(params, batch).items():
    for got, want in zip(factors[layer], expected):
      np.testing.assert_allclose(np.asarray(got[0], np.float64), want,
                                 rtol=1e-5, atol=1e-7)


def test_exact_product_is_the_brute_force_ggn():
  """F v = (1/Σw) Σ_n w_n Σ_h c_h J_hnᵀ F_hn J_hn v, Jacobians by jax.jacobian."""
  params, batch = problem()
  curvature = kfac_optax.Curvature(TwoHeads().apply, LOSS, example_batch=batch,
                                   inputs=lambda b: b["x"])
  flat, unravel = ravel_pytree(params)
  outputs = lambda f: jnp.concatenate(
      TwoHeads().apply({"params": unravel(f)}, batch["x"]), -1)
  jacobian = np.asarray(jax.jacobian(outputs)(flat), np.float64)  # (N, 5, P)
  fishers = output_fishers(outputs(flat)[:, :CLASSES])
  w = np.asarray(batch["weight"], np.float64)
  ggn = np.einsum("n,nip,nij,njq->pq", w, jacobian, fishers, jacobian) / w.sum()
  v = jax.random.normal(jax.random.key(6), flat.shape)
  product, _ = ravel_pytree(curvature.exact_product(params, batch, unravel(v)))
  np.testing.assert_allclose(product, ggn @ np.asarray(v, np.float64),
                             rtol=1e-4, atol=1e-6)


def test_the_automatic_mode_trains_an_actor_critic():
  """Both heads move the joint loss down under kfac's solved steps."""
  params, batch = problem()
  tx = kfac_optax.kfac(TwoHeads().apply, LOSS, example_batch=batch,
                       inputs=lambda b: b["x"])
  loss_of = lambda p: LOSS.value(TwoHeads().apply({"params": p}, batch["x"]), batch)

  @jax.jit
  def step(p, state, key):
    updates, state = tx.update(jax.grad(loss_of)(p), state, p, batch=batch, rng=key)
    return optax.apply_updates(p, updates), state
  trained, state = params, tx.init(params)
  for i in range(10):
    trained, state = step(trained, state, jax.random.key(i))
  assert loss_of(trained) < 0.5 * loss_of(params)


def test_mistakes_are_named():
  params, batch = problem()
  with pytest.raises(ValueError, match="pass mask= to joint, not to a head"):
    losses.joint(losses.squared_error(mask=lambda b: b["weight"]))
  with pytest.raises(ValueError, match="weights must be 2 positive numbers"):
    losses.joint(losses.squared_error(), losses.squared_error(), weights=(1.0, 0.0))
  with pytest.raises(TypeError, match="one per head"):
    losses.joint(LOSS)
  one_output = kfac_optax.scale_by_kfac(
      TwoHeads().apply, LOSS, example_batch=batch, inputs=lambda b: b["x"],
      outputs=lambda out: out[0])
  with pytest.raises(TypeError, match="reads a tuple of 2 arrays"):
    one_output.init(params)
  per_token = losses.joint(
      losses.softmax_cross_entropy(targets=lambda b: b["action"]),
      losses.squared_error(targets=lambda b: b["return"][:, :1, None]))
  outputs = (jnp.zeros((N, CLASSES)), jnp.zeros((N, 1, 1)))
  with pytest.raises(ValueError, match="must have the same terms.*per-sequence head, are not"):
    per_token.value(outputs, batch)
