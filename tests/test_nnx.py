"""Flax NNX models: the same blocks and numbers as their linen twins.

Each NNX model here has a linen twin with the same module paths and, copied
over, the same weights; the linen path is tested against brute force
elsewhere, so equal factors and updates carry that proof over. A tiny NNX
MLP is also checked directly against the explicit float64 reference of
`tests/brute_force.py`.
"""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_optax
from kfac_optax import nnx_capture
from tests import brute_force as bf

DAMPING = 1e-2
VOCAB, WIDTH, LENGTH = 11, 8, 5


def copy_params(model: nnx.Module, linen_params) -> nnx.Module:
  """``model`` with the linen twin's params (same paths)."""
  nnx.update(model, nnx.State(jax.tree.map(jnp.asarray, linen_params)))
  return model


def random_like(tree, seed):
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten([jax.random.normal(k, x.shape, x.dtype)
                            for k, x in zip(keys, leaves)])


# -- twins -------------------------------------------------------------------

class NNXTiny(nnx.Module):
  """bf.TinyMLP in NNX: x -> Linear(4) -> tanh -> Linear(3, no bias) -> tanh -> Linear(3)."""

  def __init__(self, rngs):
    self.hidden = nnx.Linear(5, 4, rngs=rngs)
    self.nobias = nnx.Linear(4, 3, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(3, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.nobias(jnp.tanh(self.hidden(x)))))


class LinenLM(nn.Module):
  """Embed (tied attend), attention, layer and RMS norms, a shared Dense."""

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(VOCAB, WIDTH, name="embed")
    h = embed(ids)
    h = h + nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(
        nn.LayerNorm(name="ln")(h))
    shared = nn.Dense(WIDTH, name="shared")
    h = shared(jnp.tanh(shared(h)))  # one module, two calls
    return embed.attend(nn.RMSNorm(name="rms")(h))


class NNXLM(nnx.Module):

  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.ln = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, WIDTH, decode=False, rngs=rngs)
    self.shared = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.rms = nnx.RMSNorm(WIDTH, rngs=rngs)

  def __call__(self, ids):
    h = self.embed(ids)
    h = h + self.attn(self.ln(h))
    h = self.shared(jnp.tanh(self.shared(h)))
    return self.embed.attend(self.rms(h))


class LinenCNN(nn.Module):
  """Strided and grouped 2-D convs, group and batch norms; 1-D and 3-D convs."""

  @nn.compact
  def __call__(self, x2, x1, x3):
    h = nn.Conv(4, (3, 3), strides=2, padding="SAME", name="conv")(x2)
    h = jax.nn.relu(nn.GroupNorm(num_groups=2, name="gn")(h))
    h = nn.Conv(6, (2, 2), padding="VALID", feature_group_count=2, name="grouped")(h)
    h = nn.BatchNorm(use_running_average=False, name="bn")(h)
    h1 = nn.Conv(3, (2,), padding="CAUSAL", name="conv1d")(x1)
    h3 = nn.Conv(3, (2, 2, 2), name="conv3d")(x3)
    pooled = jnp.concatenate([h.mean((1, 2)), h1.mean(1), h3.mean((1, 2, 3))], -1)
    return nn.Dense(3, name="head")(jnp.tanh(pooled))


class NNXCNN(nnx.Module):

  def __init__(self, rngs):
    self.conv = nnx.Conv(2, 4, (3, 3), strides=2, padding="SAME", rngs=rngs)
    self.gn = nnx.GroupNorm(4, num_groups=2, rngs=rngs)
    self.grouped = nnx.Conv(4, 6, (2, 2), padding="VALID", feature_group_count=2,
                            rngs=rngs)
    self.bn = nnx.BatchNorm(6, use_running_average=False, rngs=rngs)
    self.conv1d = nnx.Conv(2, 3, (2,), padding="CAUSAL", rngs=rngs)
    self.conv3d = nnx.Conv(2, 3, (2, 2, 2), rngs=rngs)
    self.head = nnx.Linear(12, 3, rngs=rngs)

  def __call__(self, x2, x1, x3):
    h = self.conv(x2)
    h = jax.nn.relu(self.gn(h))
    h = self.bn(self.grouped(h))
    h1, h3 = self.conv1d(x1), self.conv3d(x3)
    pooled = jnp.concatenate([h.mean((1, 2)), h1.mean(1), h3.mean((1, 2, 3))], -1)
    return self.head(jnp.tanh(pooled))


def tiny_case():
  params, batch = bf.tiny_problem(seed=3)
  return bf.TinyMLP(), NNXTiny(nnx.Rngs(0)), {"params": params}, batch, {}


def lm_case():
  ids = jax.random.randint(jax.random.key(1), (3, LENGTH), 0, VOCAB)
  batch = {"ids": ids, "y": jnp.roll(ids, -1, 1),
           "mask": jnp.arange(LENGTH)[None] < jnp.array([[5], [3], [4]])}
  linen = LinenLM()
  return (linen, NNXLM(nnx.Rngs(0)), linen.init(jax.random.key(2), ids), batch,
          dict(inputs=lambda b: b["ids"],
               loss=kfac_optax.losses.softmax_cross_entropy(
                   targets=lambda b: b["y"], mask=lambda b: b["mask"])))


def cnn_case():
  keys = jax.random.split(jax.random.key(4), 4)
  batch = {"x2": jax.random.normal(keys[0], (4, 6, 6, 2)),
           "x1": jax.random.normal(keys[1], (4, 5, 2)),
           "x3": jax.random.normal(keys[2], (4, 3, 3, 3, 2)),
           "y": jax.random.randint(keys[3], (4,), 0, 3)}
  linen = LinenCNN()
  variables = linen.init(jax.random.key(5), batch["x2"], batch["x1"], batch["x3"])
  return (linen, NNXCNN(nnx.Rngs(0)), variables, batch,
          dict(inputs=lambda b: (b["x2"], b["x1"], b["x3"]),
               loss=kfac_optax.losses.softmax_cross_entropy(targets=lambda b: b["y"])))


CASES = {"tiny": tiny_case, "lm": lm_case, "cnn": cnn_case}


@pytest.fixture(scope="module", params=list(CASES))
def twins(request):
  linen, model, variables, batch, options = CASES[request.param]()
  copy_params(model, variables["params"])
  return request.param, linen, model, variables, batch, options


def one_update(apply_fn, params, batch, options, estimation, variables=None):
  """scale_by_kfac's first update of random grads: (factors, updates)."""
  options = dict(options)
  loss = options.pop("loss", kfac_optax.losses.softmax_cross_entropy())
  tx = kfac_optax.scale_by_kfac(apply_fn, loss, example_batch=batch,
                                estimation=estimation, damping=DAMPING, **options)
  grads = random_like(params, 7)

  @jax.jit
  def run(params, grads, batch, rng):
    updates, state = tx.update(grads, tx.init(params), params, batch=batch,
                               rng=rng, variables=variables)
    return state.factors, updates
  return run(params, grads, batch, jax.random.key(8))


def by_path(tree):
  return {"/".join(path): np.asarray(leaf, np.float64)
          for path, leaf in kfac_optax.curvature.flatten(tree)[0].items()}


ESTIMATIONS = ("fisher", "empirical", "exact", "curvature_prop")


@pytest.mark.parametrize("estimation", ESTIMATIONS)
def test_nnx_model_gives_its_linen_twins_factors_and_updates(twins, estimation):
  name, linen, model, variables, batch, options = twins
  if name != "tiny" and estimation != "fisher":
    pytest.skip("every estimation mode runs on the tiny twin (compile time)")
  others = {k: v for k, v in variables.items() if k != "params"}
  expected = one_update(linen.apply, variables["params"], batch, options,
                        estimation, others or None)
  params = nnx.state(model, nnx.Param)
  actual = one_update(model, nnx_capture.pure(params), batch, options, estimation)
  assert set(actual[0]) == set(expected[0])
  for key in expected[0]:
    assert bf.relative_error(actual[0][key], jax.tree.map(np.asarray, expected[0][key])) < 1e-5, key
  got, want = by_path(actual[1]), by_path(expected[1])
  assert set(got) == set(want)
  assert bf.relative_error(got, want) < 1e-4


@pytest.mark.parametrize("estimation", ["empirical", "exact"])
def test_nnx_mlp_matches_brute_force(estimation):
  model = NNXTiny(nnx.Rngs(0))
  params, batch = bf.tiny_problem(seed=5)
  copy_params(model, params)
  nnx_params = nnx.state(model, nnx.Param)
  factors, updates = one_update(model, nnx_params, batch, {}, estimation)
  expected = bf.factors(nnx.to_pure_dict(nnx_params), batch, estimation)
  for layer in bf.LAYERS:
    assert bf.relative_error(factors[layer], expected[layer]) < 1e-5
  grads = nnx.to_pure_dict(random_like(nnx_params, 7))
  assert bf.relative_error(nnx.to_pure_dict(updates),
                           bf.precondition(expected, grads, DAMPING)) < 1e-4
