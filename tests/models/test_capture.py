"""Layer discovery and captured statistics on structured flax models.

The reference statistics come from an explicitly written forward pass with an
additive zero perturbation per layer call: autodiff of the summed NLL with
respect to those perturbations gives every row's output gradient, and the
factors are formed from explicit row matrices.
"""

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_optax
from kfac_optax._src import layouts
from kfac_optax._src.models import front_end
from tests import brute_force as bf
from tests.nnx_twins import APIS, model_for


class Inner(nn.Module):
  """A setup-defined Dense inside a submodule."""

  def setup(self):
    self.proj = nn.Dense(3)

  def __call__(self, x):
    return jnp.tanh(self.proj(x))


class SequenceNet(nn.Module):
  """(N, T, 2) -> nested Dense per position -> shared Dense twice -> pool -> head."""

  @nn.compact
  def __call__(self, x):
    h = Inner(name="inner")(x)
    shared = nn.Dense(3, name="shared")
    h = shared(jnp.tanh(shared(h)))
    h = jnp.tanh(h).mean(axis=1)
    temperature = self.param("temperature", nn.initializers.ones, (4,))
    return nn.Dense(4, use_bias=False, name="head")(h) * temperature


class NNXInner(nnx.Module):

  def __init__(self, rngs):
    self.proj = nnx.Linear(2, 3, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.proj(x))


class NNXSequenceNet(nnx.Module):
  """`SequenceNet` in NNX."""

  def __init__(self, rngs):
    self.inner = NNXInner(rngs)
    self.shared = nnx.Linear(3, 3, rngs=rngs)
    self.temperature = nnx.Param(jnp.ones((4,)))
    self.head = nnx.Linear(3, 4, use_bias=False, rngs=rngs)

  def __call__(self, x):
    h = self.shared(jnp.tanh(self.shared(self.inner(x))))
    return self.head(jnp.tanh(h).mean(axis=1)) * self.temperature


def explicit_forward(params, x, perturbations):
  """SequenceNet written out, with perturbations added to each layer output."""
  def dense(p, a):
    return a @ p["kernel"] + p["bias"] if "bias" in p else a @ p["kernel"]
  s_inner = dense(params["inner"]["proj"], x) + perturbations["inner"]
  s_shared0 = dense(params["shared"], jnp.tanh(s_inner)) + perturbations["shared0"]
  s_shared1 = dense(params["shared"], jnp.tanh(s_shared0)) + perturbations["shared1"]
  pooled = jnp.tanh(s_shared1).mean(axis=1)
  s_head = dense(params["head"], pooled) + perturbations["head"]
  inputs = {"inner": [x], "shared": [jnp.tanh(s_inner), jnp.tanh(s_shared0)],
            "head": [pooled]}
  return s_head * params["temperature"], inputs


def problem():
  x = jax.random.normal(jax.random.key(0), (5, 7, 2))
  y = jax.random.randint(jax.random.key(1), (5,), 0, 4)
  params = SequenceNet().init(jax.random.key(2), x)["params"]
  return params, (x, y)


def reference_factors(params, batch):
  x, y = batch
  n, t = x.shape[:2]
  zeros = {"inner": jnp.zeros((n, t, 3)), "shared0": jnp.zeros((n, t, 3)),
           "shared1": jnp.zeros((n, t, 3)), "head": jnp.zeros((n, 4))}
  loss = kfac_optax.losses.softmax_cross_entropy()
  def summed_nll(perturbations):
    logits, inputs = explicit_forward(params, x, perturbations)
    return jnp.sum(loss.nll(logits, y)), inputs
  grads, inputs = jax.grad(summed_nll, has_aux=True)(zeros)
  row_grads = {"inner": [grads["inner"]], "head": [grads["head"]],
               "shared": [grads["shared0"], grads["shared1"]]}
  expected = {}
  for key, has_bias in (("inner", True), ("shared", True), ("head", False)):
    a = np.concatenate([np.asarray(v, np.float64).reshape(-1, v.shape[-1])
                        for v in inputs[key]])
    if has_bias:
      a = np.concatenate([a, np.ones((len(a), 1))], 1)
    g = np.concatenate([np.asarray(v, np.float64).reshape(-1, v.shape[-1])
                        for v in row_grads[key]])
    expected[key] = (a.T @ a / len(a), g.T @ g / n)  # L = n examples
  return expected


def test_discovery_finds_nested_setup_and_shared_layers_by_path():
  params, batch = problem()
  found = front_end.discover(SequenceNet().apply, {"params": params}, (batch[0],), {})
  assert found.layouts == {("inner", "proj"): layouts.dense(2, 3),
                           ("shared",): layouts.dense(3, 3),
                           ("head",): layouts.dense(3, 4)}
  assert found.num_calls == {("inner", "proj"): 1, ("shared",): 2, ("head",): 1}


@pytest.mark.parametrize("api", APIS)
def test_factors_sum_over_positions_and_calls(api):
  params, batch = problem()
  tx = kfac_optax.scale_by_kfac(
      model_for(api, SequenceNet(), NNXSequenceNet, params),
      kfac_optax.losses.softmax_cross_entropy(), example_batch=batch,
      estimation="empirical")
  _, state = jax.jit(lambda s: tx.update(params, s, params, batch=batch))(
      tx.init(params))
  expected = reference_factors(params, batch)
  assert set(state.factors) == {"inner/proj", "shared", "head", "<diagonal>"}
  for key, path in (("inner", "inner/proj"), ("shared", "shared"), ("head", "head")):
    assert bf.relative_error(state.factors[path], expected[key]) < 1e-4


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("estimation", ["empirical", "exact"])
def test_diagonal_fallback_matches_per_example_gradients(estimation, api):
  """F = (1/N) Σ_k (Σ_n ∇θ ℓ_n,k)², U = ∇ / (F + λ), from per-example grads."""
  params, batch = problem()
  x, y = batch
  damping = 1e-2
  tx = kfac_optax.scale_by_kfac(
      model_for(api, SequenceNet(), NNXSequenceNet, params),
      kfac_optax.losses.softmax_cross_entropy(),
      example_batch=batch, estimation=estimation, damping=damping)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
  out, state = tx.update(grads, tx.init(params), params, batch=batch)

  def logits_of(temperature, xn):
    return SequenceNet().apply(
        {"params": {**params, "temperature": temperature}}, xn[None])[0]
  temperature = params["temperature"]
  jac = jax.vmap(jax.jacrev(logits_of), (None, 0))(temperature, x)  # (N, C, 4)
  logits = jax.vmap(logits_of, (None, 0))(temperature, x)
  p = np.asarray(jax.nn.softmax(logits), np.float64)
  jac = np.asarray(jac, np.float64)
  if estimation == "empirical":  # per-example ∇ℓ_n = J_nᵀ (p_n - e_y)
    residual = p - np.eye(4)[np.asarray(y)]
    fisher = np.square(np.einsum("nc,nci->i", residual, jac)) / len(x)
  else:  # columns b_k = sqrt(p_k)(e_k - p) of the output-Fisher square root
    columns = np.sqrt(p)[:, :, None] * (np.eye(4)[None] - p[:, None, :])
    fisher = np.sum(np.square(np.einsum("nkc,nci->ki", columns, jac)), 0) / len(x)
  # Each F_i squares a sum over examples that can cancel: float32 holds it to
  # a few ulps of the largest entry, not of its own. The update is then
  # 0.5 / (F + λ) to an ulp, so 0.5 / update recovers F + λ as closely.
  atol = 1e-5 * (fisher.max() + damping)
  np.testing.assert_allclose(state.factors["<diagonal>"]["temperature"], fisher,
                             rtol=0, atol=atol)
  np.testing.assert_allclose(0.5 / np.asarray(out["temperature"], np.float64),
                             fisher + damping, rtol=0, atol=atol)


def test_per_token_loss_counts_every_position_as_a_term():
  """Outputs (N, T, C): L = N·T terms, so G = Σ_rows g gᵀ / (N T)."""
  model = nn.Dense(3)
  x = jax.random.normal(jax.random.key(0), (4, 6, 2))
  y = jax.random.normal(jax.random.key(1), (4, 6, 3))
  params = model.init(jax.random.key(2), x)["params"]
  tx = kfac_optax.scale_by_kfac(
      model.apply, kfac_optax.losses.squared_error(), example_batch=(x, y),
      estimation="empirical")
  _, state = tx.update(params, tx.init(params), params, batch=(x, y))
  residual = np.asarray(model.apply({"params": params}, x) - y, np.float64)
  rows = residual.reshape(-1, 3)  # d(0.5||y - f||²)/df = f - y per token
  a = np.concatenate([np.asarray(x, np.float64).reshape(-1, 2), np.ones((24, 1))], 1)
  assert bf.relative_error(state.factors[""].g, rows.T @ rows / 24) < 1e-5
  assert bf.relative_error(state.factors[""].a, a.T @ a / 24) < 1e-5


def test_layer_overrides_skip_and_diagonal():
  params, batch = problem()
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
  tx = kfac_optax.scale_by_kfac(
      SequenceNet().apply, kfac_optax.losses.softmax_cross_entropy(),
      example_batch=batch, estimation="empirical",
      layer_overrides={"inner/*": "skip", "sh*": "diagonal"})
  out, state = tx.update(grads, tx.init(params), params, batch=batch)
  assert set(state.factors) == {"head", "<diagonal>"}
  assert set(state.factors["<diagonal>"]) == {"shared/kernel", "shared/bias",
                                              "temperature"}
  jax.tree.map(np.testing.assert_array_equal, out["inner"], grads["inner"])
  assert not np.allclose(out["shared"]["kernel"], grads["shared"]["kernel"])
  with pytest.raises(ValueError, match="layer_overrides"):
    kfac_optax.scale_by_kfac(SequenceNet().apply,
                             kfac_optax.losses.softmax_cross_entropy(),
                             example_batch=batch, layer_overrides={"head": "off"})
