"""Per-token masks from the loss: padding never enters any statistic."""

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_optax
from tests import brute_force as bf
from tests.nnx_twins import APIS, model_for


class TokenNet(nn.Module):
  """Per-token model: embed -> dense -> layer norm -> per-token logits."""
  use_norm: bool = True

  @nn.compact
  def __call__(self, ids):
    h = jnp.tanh(nn.Dense(5, name="dense")(nn.Embed(11, 4, name="embed")(ids)))
    if self.use_norm:
      h = nn.LayerNorm(name="norm")(h)
    return nn.Dense(7, name="head")(h)


class NNXTokenNet(nnx.Module):
  """`TokenNet` in NNX."""

  def __init__(self, use_norm, rngs):
    self.embed = nnx.Embed(11, 4, rngs=rngs)
    self.dense = nnx.Linear(4, 5, rngs=rngs)
    self.norm = nnx.LayerNorm(5, rngs=rngs) if use_norm else None
    self.head = nnx.Linear(5, 7, rngs=rngs)

  def __call__(self, ids):
    h = jnp.tanh(self.dense(self.embed(ids)))
    if self.norm is not None:
      h = self.norm(h)
    return self.head(h)


def batch(seed, lengths=(5, 2, 4), length=6):
  ids = jax.random.randint(jax.random.key(seed), (len(lengths), length), 0, 11)
  targets = jax.random.randint(jax.random.key(seed + 1), ids.shape, 0, 7)
  mask = jnp.arange(length)[None] < jnp.array(lengths)[:, None]
  return {"ids": ids, "y": targets, "mask": mask}


LOSS = kfac_optax.losses.softmax_cross_entropy(
    targets=lambda b: b["y"], mask=lambda b: b["mask"])


def factors_for(api, model, params, data, estimation="empirical"):
  """The factors of one K-FAC update of ``model`` (a `TokenNet`), run in
  ``api`` with ``params``."""
  twin = model_for(api, model, lambda rngs: NNXTokenNet(model.use_norm, rngs),
                   params)
  tx = kfac_optax.scale_by_kfac(twin, LOSS, example_batch=data,
                                inputs=lambda b: b["ids"], estimation=estimation)
  return jax.jit(lambda p, b: tx.update(p, tx.init(p), p, batch=b)[1].factors)(
      params, data)


@pytest.mark.parametrize("api", APIS)
def test_padding_never_enters_the_statistics(api):
  model = TokenNet()
  data = batch(0)
  params = model.init(jax.random.key(9), data["ids"])["params"]
  padded = ~data["mask"]
  changed = {**data, "ids": jnp.where(padded, 10, data["ids"]),
             "y": jnp.where(padded, 0, data["y"])}
  original = factors_for(api, model, params, data)
  after = factors_for(api, model, params, changed)
  for key in original:
    assert bf.relative_error(after[key], jax.tree.map(np.asarray, original[key])) < 1e-6


@pytest.mark.parametrize("api", APIS)
def test_masked_statistics_equal_those_of_the_unmasked_tokens_alone(api):
  model = TokenNet(use_norm=False)
  data = batch(1)
  params = model.init(jax.random.key(9), data["ids"])["params"]
  kept = np.asarray(data["mask"])
  alone = {"ids": data["ids"][kept][:, None], "y": data["y"][kept][:, None],
           "mask": jnp.ones((int(kept.sum()), 1), bool)}  # M sequences of one token
  masked = factors_for(api, model, params, data)
  reference = factors_for(api, model, params, alone)
  for key in ("embed", "dense", "head"):
    assert bf.relative_error(masked[key], jax.tree.map(np.asarray, reference[key])) < 1e-5


@pytest.mark.parametrize("estimation", ["empirical", "exact"])
def test_a_terms_weight_counts_as_that_many_copies_of_it(estimation):
  """A mask of weights: a token of weight k gives the statistics of k copies
  of it (each a one-token sequence of weight 1), in every block."""
  model = TokenNet(use_norm=False)
  data = batch(1)
  weights = jnp.where(data["mask"], jax.random.randint(jax.random.key(4), data["mask"].shape,
                                                       1, 4), 0)
  params = model.init(jax.random.key(9), data["ids"])["params"]
  copies = np.repeat(np.arange(weights.size), np.asarray(weights).ravel())
  alone = {"ids": data["ids"].ravel()[copies][:, None], "y": data["y"].ravel()[copies][:, None],
           "mask": jnp.ones((copies.size, 1), bool)}
  weighted = factors_for("linen", model, params, {**data, "mask": weights.astype(jnp.float32)},
                         estimation)
  reference = factors_for("linen", model, params, alone, estimation)
  for key in ("embed", "dense", "head"):
    assert bf.relative_error(weighted[key], jax.tree.map(np.asarray, reference[key])) < 1e-5


@pytest.mark.parametrize("api", APIS)
def test_weights_scaled_alike_leave_the_statistics_unchanged(api):
  """The loss Σ w NLL / Σ w does not change when every weight is halved, nor
  does its Fisher; so no statistic may."""
  model = TokenNet()
  data = batch(0)
  params = model.init(jax.random.key(9), data["ids"])["params"]
  half = {**data, "mask": 0.5 * data["mask"].astype(jnp.float32)}
  original = factors_for(api, model, params, data, "exact")
  halved = factors_for(api, model, params, half, "exact")
  for key in original:
    assert bf.relative_error(halved[key], jax.tree.map(np.asarray, original[key])) < 1e-5


def test_the_automatic_steps_model_ignores_padding_and_the_weights_scale():
  """kfac's automatic mode (its quadratic model from exact Fisher-vector
  products along two directions at once) gives the same update when only
  padded tokens change, or when every weight is halved."""
  model = TokenNet()
  data = batch(0)
  params = model.init(jax.random.key(9), data["ids"])["params"]
  padded = ~data["mask"]
  variants = [data, {**data, "ids": jnp.where(padded, 10, data["ids"]),
                     "y": jnp.where(padded, 0, data["y"])},
              {**data, "mask": 0.5 * data["mask"].astype(jnp.float32)}]
  tx = kfac_optax.kfac(model.apply, LOSS, example_batch=data, inputs=lambda b: b["ids"],
                       estimation="exact")

  @jax.jit
  def two_updates(b):  # the second solves for momentum too
    state, found = tx.init(params), []
    for _ in range(2):
      grads = jax.grad(lambda p: LOSS.value(model.apply({"params": p}, b["ids"]), b))(params)
      updates, state = tx.update(grads, state, params, batch=b)
      found.append(updates)
    return found
  first = two_updates(variants[0])
  for other in variants[1:]:
    for want, got in zip(first, two_updates(other)):
      assert bf.relative_error(got, jax.tree.map(np.asarray, want)) < 1e-4


def test_masked_loss_value_and_count():
  data = batch(2)
  logits = jax.random.normal(jax.random.key(3), (3, 6, 7))
  nll = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)),
                            np.asarray(data["y"])[..., None], -1)[..., 0]
  kept = np.asarray(data["mask"])
  np.testing.assert_allclose(LOSS.value(logits, data), nll[kept].mean(), rtol=1e-6)
  assert float(LOSS.terms(logits, data).count) == kept.sum() == 11
