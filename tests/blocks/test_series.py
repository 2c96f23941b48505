"""Series blocks for dense layers shared over time (Martens, Ba & Johnson 2018).

A Dense layer inside nn.scan over time sees fixed inputs x (N, T, d); a
squared-error loss whose targets are the model output minus a given array
makes that array the output gradient (empirical Fisher), so every statistic
and preconditioned vector has an independent float64 brute force
(`tests.brute_force`).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_optax
from kfac_optax._src import linalg
from kfac_optax._src.blocks import series
from tests import brute_force as bf

DAMPING = 1e-2
THREADED = {"kfac_inputs": 0, "kfac_perturbations": 0}
N, T, D, K = 12, 5, 3, 3


class Step(nn.Module):
  features: int
  use_bias: bool

  @nn.compact
  def __call__(self, carry, x):
    return carry, nn.Dense(self.features, use_bias=self.use_bias, name="dense")(x)


class OverTime(nn.Module):
  """``y_t = x_t W (+ b)`` at every step, the weights shared over time."""
  use_bias: bool = True

  @nn.compact
  def __call__(self, x):  # (N, T, d) -> (N, T, K)
    scan = nn.scan(Step, variable_broadcast="params", split_rngs={"params": False},
                   variable_axes=THREADED, in_axes=1, out_axes=1)
    return scan(K, self.use_bias, name="time")(None, x)[1]


def _ar1(key, shape, rho):
  """A series with lag-1 correlation ``rho`` along axis 1."""
  noise = jax.random.normal(key, shape)
  steps = [noise[:, 0]]
  for t in range(1, shape[1]):
    steps.append(rho * steps[-1] + np.sqrt(1 - rho ** 2) * noise[:, t])
  return jnp.stack(steps, 1)


def _data(case, steps=T):
  kx, kg = jax.random.split(jax.random.key({"correlated": 0, "anti": 1}.get(case, 2)))
  x = _ar1(kx, (N, steps, D), 0.8) + 0.3
  g = _ar1(kg, (N, steps, K), -0.8 if case == "anti" else 0.7)
  if case == "no_input_lag":  # every lag pair meets a zero input
    x = x.at[:, 1::2].set(0.0)
  if case == "no_gradient_lag":
    g = g.at[:, 1::2].set(0.0)
  return x, g


@functools.lru_cache(maxsize=None)
def _problem(case, bias, steps):
  """Inputs, output gradients, params and the targets that give those gradients."""
  x, g = _data(case, steps)
  model = OverTime(bias)
  params = model.init(jax.random.key(3), x)["params"]
  return x, g, params, model.apply({"params": params}, x) - g


@functools.lru_cache(maxsize=None)
def _run(case, option, bias=True, masked=False, steps=T):
  """One K-FAC update of V on fixed data (sequence lengths 5, 3, 2, 5, ... if
  ``masked``, their steps weighted in [0.5, 2] if it is ``"weights"``):
  (factors, preconditioned V, V, (inputs, output gradients, mask), (tx,
  state, params, the jitted update))."""
  x, g, params, targets = _problem(case, bias, steps)
  mask = (jnp.arange(steps)[None] < jnp.array([steps, 3, 2, steps] * 3)[:, None]
          ).astype(jnp.float32) if masked else jnp.ones((N, steps))
  if masked == "weights":
    mask = mask * jax.random.uniform(jax.random.key(5), mask.shape, minval=0.5, maxval=2.0)
  model = OverTime(bias)
  loss = kfac_optax.losses.squared_error(
      targets=lambda b: b[1], mask=(lambda b: b[2]) if masked else None)
  batch = (x, targets, mask)
  tx = kfac_optax.scale_by_kfac(
      model.apply, loss, example_batch=batch, estimation="empirical",
      damping=DAMPING, inverse_update_period=1,
      layer_overrides=None if option is None else {"time/*": option})
  v = jax.tree.map(lambda p: jax.random.normal(jax.random.key(4), p.shape), params)
  update = jax.jit(lambda s, b: tx.update(v, s, params, batch=b))
  out, state = update(tx.init(params), batch)
  return state.factors["time/dense"], out, v, (x, g, mask), (tx, state, params, update)


def _matrix(tree):
  layer = tree["time"]["dense"]
  kernel = np.asarray(layer["kernel"], np.float64)
  return np.concatenate([kernel, np.asarray(layer["bias"])[None]]) if "bias" in layer else kernel


def _stats(run, bias=True):
  x, g, mask = run[3]
  return bf.series_statistics(x, g, mask, bias)


@pytest.mark.parametrize("bias,masked,option", [(True, False, "series_option1"),
                                                (False, False, "series_option1"),
                                                (True, True, "series_option2"),
                                                (True, "weights", "series_option2")])
def test_statistics_match_explicit_sums(bias, masked, option):
  run = _run("correlated", option, bias, masked)
  factors = run[0]
  for actual, expected in zip((factors.a, factors.a_lag, factors.g, factors.g_lag),
                              _stats(run, bias)):
    assert bf.relative_error(actual[0], expected) < 1e-5


def test_masked_steps_leave_statistics_unchanged():
  """Inputs at masked steps never enter A0/A1 (nor, through pairs, G1)."""
  factors, _, _, (x, g, mask), (tx, _, params, update) = _run(
      "correlated", "series_option2", masked=True)
  changed = jnp.where(mask[..., None] > 0, x, 100.0)
  targets = OverTime(True).apply({"params": params}, changed) - g
  _, state = update(tx.init(params), (changed, targets, mask))
  assert bf.relative_error(state.factors["time/dense"], factors) < 1e-6
  # "independent" (steps as rows) keeps the masked steps out too.
  a0, _, g0, _ = bf.series_statistics(x, g, mask)
  independent = _run("correlated", None, masked=True)[0]
  assert bf.relative_error(independent, (a0[None], g0[None])) < 1e-5


@pytest.mark.parametrize("bias", [True, False])
def test_option1_is_its_formula_and_the_explicit_damped_fisher_solve(bias):
  run = _run("correlated", "series_option1", bias)
  stats, v = _stats(run, bias), _matrix(run[2])
  expected = bf.series_option1(stats, v, DAMPING, T)
  assert bf.relative_error(_matrix(run[1]), expected) < 1e-4
  # Positively correlated series: every ψ ≥ 0, so |ψ| changes nothing and
  # the Fisher is the one with Ψ̂ itself.
  fisher = bf.series_option1_fisher(stats, DAMPING, T, absolute=False)
  np.testing.assert_allclose(fisher, bf.series_option1_fisher(stats, DAMPING, T))
  solved = np.linalg.solve(fisher, v.reshape(-1)).reshape(v.shape)
  assert bf.relative_error(_matrix(run[1]), solved) < 1e-4


def test_option1_with_anti_correlated_gradients_takes_absolute_values():
  run = _run("anti", "series_option1")
  stats, v = _stats(run), _matrix(run[2])
  solve = lambda f: np.linalg.solve(f, v.reshape(-1)).reshape(v.shape)
  actual = _matrix(run[1])
  assert bf.relative_error(actual, bf.series_option1(stats, v, DAMPING, T)) < 1e-4
  assert bf.relative_error(actual, solve(bf.series_option1_fisher(stats, DAMPING, T))) < 1e-4
  # The gradients' lag-1 moment is negative: without |ψ| the Fisher differs.
  raw = solve(bf.series_option1_fisher(stats, DAMPING, T, absolute=False))
  assert bf.relative_error(actual, raw) > 1e-2


@pytest.mark.parametrize("case,bias", [("correlated", True), ("anti", True)])
def test_option2_is_its_formula(case, bias):
  run = _run(case, "series_option2", bias)
  expected = bf.series_option2(_stats(run, bias), _matrix(run[2]), DAMPING)
  assert bf.relative_error(_matrix(run[1]), expected) < 1e-4


@pytest.mark.parametrize("option,case,steps,bias", [
    ("series_option1", "no_input_lag", T, False), ("series_option2", "no_gradient_lag", T, True),
    ("series_option1", "correlated", 1, True), ("series_option2", "correlated", 1, True)])
def test_series_equals_independent_without_lag_statistics(option, case, steps, bias):
  """Without A1 (or G1) both options are `independent`'s (A0 + π√λ)⁻¹ V (G0 + √λ/π)⁻¹."""
  run = _run(case, option, bias, steps=steps)
  lags = run[0].a_lag if case == "no_input_lag" else run[0].g_lag
  assert float(jnp.max(jnp.abs(lags))) == 0.0
  a0, _, g0, _ = _stats(run, bias)
  v = run[2]["time"]["dense"]
  expected = bf.kronecker_precondition(a0, g0, v["kernel"], v.get("bias"), DAMPING)
  assert bf.relative_error(run[1]["time"]["dense"], expected) < 1e-4
  if steps == 1:  # and K-FAC's own independent block agrees
    assert bf.relative_error(run[1], _run(case, None, bias, steps=steps)[1]) < 1e-5


def test_independent_is_the_default():
  assert bf.relative_error(_run("correlated", "independent", steps=1)[1],
                           _run("correlated", None, steps=1)[1]) == 0.0


@pytest.mark.parametrize("steps", [1, 2, 7, 300])
def test_scaled_gamma_is_the_lag_sum_up_to_x_equal_one(steps):
  """``T γ_T(x) = T / Σ_{|d|<T} (T-|d|) x^{|d|}``, also where the closed form is 0/0."""
  x = np.asarray(jnp.asarray(np.concatenate(
      [[0.0, 0.5, 1.0], 1 - np.geomspace(1e-7, 1, 60) / steps]), jnp.float32), np.float64)
  lags = np.arange(-(steps - 1), steps)
  expected = steps / np.sum((steps - np.abs(lags)) * x[:, None] ** np.abs(lags), 1)
  actual = series._scaled_gamma(jnp.asarray(x, jnp.float32), jnp.float32(steps))
  assert np.max(np.abs(actual - expected) / expected) < 5e-5


def test_multiply_inverse_is_precondition_and_other_powers_raise():
  _, out, v, _, (tx, state, params, _) = _run("correlated", "series_option2")
  curvature = kfac_optax.Curvature(
      OverTime(True).apply, kfac_optax.losses.squared_error(), example_batch=_run(
          "correlated", "series_option2")[3][:2], estimation="empirical",
      layer_overrides={"time/*": "series_option2"})
  inverse, preconditioned = jax.jit(lambda s, v: (
      curvature.multiply(s, v, power=-1, damping=DAMPING), curvature.precondition(s, v)))(
          state, v)
  assert bf.relative_error(inverse, out) < 1e-5
  assert bf.relative_error(preconditioned, out) < 1e-6
  with pytest.raises(NotImplementedError, match=r"power=1: the series blocks .* "
                                                r"give only the damped inverse"):
    curvature.multiply(state, v, power=1)


def test_series_option_on_a_layer_without_time_axis_names_it():
  model = nn.Dense(2)
  x = jnp.ones((4, 3))
  params = model.init(jax.random.key(0), x)["params"]
  tx = kfac_optax.scale_by_kfac(
      model.apply, kfac_optax.losses.squared_error(), example_batch=(x, jnp.ones((4, 2))),
      layer_overrides={"*": "series_option1"})
  with pytest.raises(ValueError, match=r"layer_overrides gives '' 'series_option1', "
                                       r"but that layer has 0 time axes"):
    tx.init(params)
  with pytest.raises(ValueError, match=r"layer_overrides\['\*'\] must be one of"):
    kfac_optax.scale_by_kfac(model.apply, kfac_optax.losses.squared_error(),
                             example_batch=(x,), layer_overrides={"*": "series_option3"})


class NormStep(nn.Module):

  @nn.compact
  def __call__(self, carry, x):
    return carry, nn.LayerNorm(name="norm")(x)


class NormOverTime(nn.Module):

  @nn.compact
  def __call__(self, x):
    scan = nn.scan(NormStep, variable_broadcast="params", split_rngs={"params": False},
                   variable_axes=THREADED, in_axes=1, out_axes=1)
    return scan(name="time")(None, x)[1]


def test_series_option_on_a_layer_that_is_not_dense_names_it():
  x = jnp.ones((4, 5, 3))
  params = NormOverTime().init(jax.random.key(0), x)["params"]
  tx = kfac_optax.scale_by_kfac(
      NormOverTime().apply, kfac_optax.losses.squared_error(), example_batch=(x, x),
      layer_overrides={"time/*": "series_option2"})
  with pytest.raises(ValueError, match=r"layer_overrides gives 'time/norm' 'series_option2', "
                                       r"but series blocks are for Dense/DenseGeneral "
                                       r"layers \(this one has a NormLayout\)"):
    tx.init(params)


class Layers(nn.Module):
  """Two layers (nn.scan over layers), each a Dense over time on the same x."""

  @nn.compact
  def __call__(self, x):
    def body(module, carry, _):
      return carry, OverTime(name="layer")(carry)
    stack = nn.scan(body, variable_axes={"params": 0, **THREADED},
                    split_rngs={"params": True}, length=2)
    return stack(self, x, None)[1]  # (layers, N, T, K)


def test_scan_over_layers_and_time_gives_one_series_block_per_layer():
  x, _ = _data("correlated")
  g = jnp.stack([_data("correlated")[1], _data("anti")[1]])
  model = Layers()
  params = model.init(jax.random.key(0), x)["params"]
  targets = model.apply({"params": params}, x) - g
  tx = kfac_optax.scale_by_kfac(model.apply, kfac_optax.losses.squared_error(),
                                example_batch=(x, targets), estimation="empirical",
                                layer_overrides={"*": "series_option1"})
  _, state = jax.jit(lambda s: tx.update(params, s, params, batch=(x, targets)))(
      tx.init(params))
  factors = state.factors["layer/time/dense"]
  assert factors.a_lag.shape == (2, 1, D + 1, D + 1)
  for layer in range(2):
    a0, a1, g0, g1 = bf.series_statistics(x, g[layer])
    # L counts the terms of both layers' outputs.
    expected = (a0, g0 / 2, a1, g1 / 2)
    assert bf.relative_error(jax.tree.map(lambda f: f[layer, 0], factors), expected) < 1e-5


def test_series_decompositions_distribute_over_a_mesh():
  keys = jax.random.split(jax.random.key(0), 2)
  c0 = jnp.einsum("sik,sjk->sij", *[jax.random.normal(keys[0], (3, 4, 8))] * 2)
  c1 = jax.random.normal(keys[1], (3, 4, 4))
  tree = {option: linalg.DampedLag(c0, c1, jnp.array([0.1, 0.2, 0.3]), option)
          for option in ("series_option1", "series_option2")}
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  alone, spread = jax.jit(lambda t: (linalg.invert_all(t, "eigh"), linalg.invert_all(
      t, "eigh", linalg.stack_sharding(mesh))))(tree)
  for option in tree:
    w = lambda x: jax.tree.map(np.asarray, x)
    # compare the operators, not eigenvectors (their signs are arbitrary)
    if option == "series_option1":
      rebuilt = lambda r: np.einsum("sij,sj,skj->sik", r.l, r.psi, r.l)
    else:
      rebuilt = lambda r: (np.einsum("sij,sj,skj->sik", r.k, r.mu, r.k), r.p)
    assert bf.relative_error(rebuilt(w(spread[option])), rebuilt(w(alone[option]))) < 1e-5


def test_lstm_input_width_equal_to_steps_is_time_not_a_layer_stack():
  """Regression: LSTMCell's bias-free ``ii`` kernel is (width, features); a
  width equal to the number of steps once passed for an nn.scan layer stack
  (one block per "layer", and a crash in the first update). The blocks are
  fixed at init, so init shows it; examples/lstm_lm.py trains such a cell."""
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.RNN(nn.LSTMCell(4, name="cell"), name="rnn", variable_axes=THREADED)(x)
      return nn.Dense(3, name="head")(h[:, -1])

  x = jax.random.normal(jax.random.key(0), (5, 3, 3))  # width == steps == 3
  params = jax.jit(Net().init)(jax.random.key(1), x)["params"]
  tx = kfac_optax.scale_by_kfac(Net().apply, kfac_optax.losses.softmax_cross_entropy(),
                                example_batch=(x, jnp.arange(5) % 3),
                                layer_overrides={"cell/ii": "series_option1"})
  factors = tx.init(params).factors
  assert factors["cell/ii"].a_lag.shape == (1, 3, 3)  # a series: one time axis
  assert factors["cell/if"].a.shape == (1, 3, 3)  # not a stack of 3 blocks
  assert factors["cell/hi"].a.shape == (1, 5, 5)


@pytest.mark.parametrize("option", ["series_option1", "series_option2"])
def test_initial_state_has_distinct_buffers(option):
  """A state passed with donate_argnums must not hold one buffer twice."""
  tx, _, params, _ = _run("correlated", option)[4]
  leaves = jax.tree.leaves(tx.init(params))
  assert len({leaf.unsafe_buffer_pointer() for leaf in leaves}) == len(leaves)


def test_series_state_checkpoints(tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  _, _, _, _, (tx, state, params, _) = _run("correlated", "series_option1")
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", state)
  checkpointer.wait_until_finished()
  restored = checkpointer.restore(tmp_path / "state", tx.init(params))
  assert isinstance(restored.inverses["time/dense"].a, linalg.Whitened)
  for leaf, expected in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(leaf, expected)


@pytest.mark.parametrize("option,kind", [(None, "kronecker"),
                                         ("series_option1", "series_option1"),
                                         ("series_option2", "series_option2")])
def test_describe_names_the_time_treatment(option, kind):
  tx, _, params, _ = _run("correlated", option)[4]
  row = next(r for r in kfac_optax.describe(tx, params).rows if r.path == "time/dense")
  assert row.kind == kind
  assert [(f.size, f.diagonal) for f in row.factors] == [(D + 1, False), (K, False)]


def test_series_option_with_a_factor_over_max_factor_dim_names_the_fix():
  x, _, params, targets = _problem("correlated", True, T)
  tx = kfac_optax.scale_by_kfac(
      OverTime().apply, kfac_optax.losses.squared_error(), example_batch=(x, targets),
      layer_overrides={"time/*": "series_option2"}, max_factor_dim=2)
  with pytest.raises(ValueError, match=r"'series_option2' needs both Kronecker "
                     r"factors in full, but this layer's factors \(A 4², G 3²\) "
                     r"exceed max_factor_dim=2. Fix: raise max_factor_dim"):
    tx.init(params)
