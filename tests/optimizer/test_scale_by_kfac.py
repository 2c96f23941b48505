"""scale_by_kfac against explicit per-example Jacobians, factors and solves."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_optax
from tests import brute_force as bf

LOSS = kfac_optax.losses.softmax_cross_entropy()
DAMPING = 1e-2


def make_tx(**kwargs):
  params, batch = bf.tiny_problem()
  settings = dict(damping=DAMPING, inverse_update_period=1, ema_decay=0.9)
  settings.update(kwargs)
  return kfac_optax.scale_by_kfac(
      bf.TinyMLP().apply, LOSS, example_batch=batch, **settings), params


def random_grads(params, seed):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten(
      [jax.random.normal(k, v.shape) for k, v in zip(keys, leaves)])


@pytest.mark.parametrize("estimation", ["empirical", "exact"])
@pytest.mark.parametrize("inverse", ["eigh", "cholesky", "newton_schulz"])
def test_matches_brute_force_after_one_and_two_updates(estimation, inverse):
  tx, params = make_tx(estimation=estimation, inverse=inverse)
  _, batch1 = bf.tiny_problem(seed=1)
  _, batch2 = bf.tiny_problem(seed=2)
  grads1, grads2 = random_grads(params, 3), random_grads(params, 4)
  update = jax.jit(lambda g, s, b: tx.update(g, s, params, batch=b))

  state = tx.init(params)
  out1, state = update(grads1, state, batch1)
  expected1 = bf.factors(params, batch1, estimation)
  assert bf.relative_error(out1, bf.precondition(expected1, grads1, DAMPING)) < 1e-3

  out2, state = update(grads2, state, batch2)
  expected2 = bf.factors(params, batch2, estimation)
  rho = 0.9  # debiased EMA after two updates: (ρ B1 + B2) / (1 + ρ)
  ema = {k: tuple((rho * b1 + b2) / (1 + rho)
                  for b1, b2 in zip(expected1[k], expected2[k]))
         for k in bf.LAYERS}
  for name in bf.LAYERS:
    assert bf.relative_error(state.factors[name], ema[name]) < 1e-4
  assert bf.relative_error(out2, bf.precondition(ema, grads2, DAMPING)) < 1e-3


def test_fisher_estimate_averages_to_exact():
  """Sampled-target statistics are unbiased: their mean over rng draws is exact."""
  tx, params = make_tx(estimation="fisher")
  _, batch = bf.tiny_problem(seed=1)
  grads = random_grads(params, 3)

  def factors_for(rng):
    _, state = tx.update(grads, tx.init(params), params, batch=batch, rng=rng)
    return state.factors

  draws = jax.jit(jax.vmap(factors_for))(jax.random.split(jax.random.key(0), 4000))
  exact = bf.factors(params, batch, "exact")
  for name in bf.LAYERS:
    a, g = jax.tree.map(lambda x: np.mean(np.asarray(x, np.float64), 0), draws[name])
    assert bf.relative_error(a, exact[name][0]) < 1e-5  # A does not depend on y
    assert bf.relative_error(g, exact[name][1]) < 0.05
    single = np.asarray(draws[name].g[0], np.float64)
    assert bf.relative_error(single, exact[name][1]) > 0.05  # one draw is noisy


def states_after_updates(num_updates, **kwargs):
  """States after each of `num_updates` empirical updates on new batches."""
  tx, params = make_tx(estimation="empirical", **kwargs)
  update = jax.jit(lambda s, b: tx.update(params, s, params, batch=b)[1])
  states = [tx.init(params)]
  for seed in range(1, num_updates + 1):
    states.append(update(states[-1], bf.tiny_problem(seed=seed)[1]))
  return states[1:]


def assert_inverses_of_own_factors(state):
  """Every layer's inverses in ``state`` are the brute-force π-damped
  inverses of its factors in ``state`` (a refresh from that step's statistics)."""
  for name in bf.LAYERS:
    a, g = (np.asarray(f[0], np.float64) for f in state.factors[name])
    da, dg = bf.pi_damping(a, g, DAMPING)
    expected_a = np.linalg.inv(a + da * np.eye(len(a)))
    expected_g = np.linalg.inv(g + dg * np.eye(len(g)))
    assert bf.relative_error(state.inverses[name].a, expected_a) < 1e-3
    assert bf.relative_error(state.inverses[name].g, expected_g) < 1e-3


def test_inverse_update_period_keeps_inverses_between_refreshes():
  history = states_after_updates(4, inverse_update_period=3)
  for later in history[1:3]:  # counts 1 and 2: last inverse reused
    jax.tree.map(np.testing.assert_array_equal, later.inverses, history[0].inverses)
    assert not np.allclose(later.factors["out"].g, history[0].factors["out"].g)
  refreshed = history[3]  # count 3: recomputed from the statistics of then
  assert_inverses_of_own_factors(refreshed)
  for name in bf.LAYERS:
    assert not np.allclose(refreshed.inverses[name].a, history[0].inverses[name].a)


def test_stats_update_period_skips_statistics():
  history = states_after_updates(3, stats_update_period=2)
  factors = [state.factors for state in history]
  assert int(history[-1].stats_count) == 2 and int(history[-1].count) == 3
  jax.tree.map(np.testing.assert_array_equal, factors[1], factors[0])
  params, batch = bf.tiny_problem(seed=0)[0], bf.tiny_problem(seed=1)[1]
  expected = bf.factors(params, batch, "empirical")
  for name in bf.LAYERS:
    assert bf.relative_error(factors[0][name], expected[name]) < 1e-4


def test_curvature_warmup_refreshes_every_update_then_keeps_the_periods():
  history = states_after_updates(4, stats_update_period=3, inverse_update_period=3,
                                 curvature_warmup=2)
  # counts 0 and 1: warm-up; count 2: neither period due; count 3: both due.
  assert [int(state.stats_count) for state in history] == [1, 2, 2, 3]
  warm = history[1]
  assert not np.allclose(warm.factors["out"].g, history[0].factors["out"].g)
  assert_inverses_of_own_factors(warm)
  jax.tree.map(np.testing.assert_array_equal, history[2].factors, warm.factors)
  jax.tree.map(np.testing.assert_array_equal, history[2].inverses, warm.inverses)
  assert not np.allclose(history[3].inverses["out"].g, warm.inverses["out"].g)


class DropoutMLP(nn.Module):
  stream: str  # the random stream of the dropout masks

  @nn.compact
  def __call__(self, x):
    h = nn.Dropout(0.5, deterministic=False, rng_collection=self.stream)(
        nn.tanh(nn.Dense(4)(x)))
    return nn.Dense(3)(h)


@pytest.mark.parametrize("stream", ["dropout", "drop_path"])
def test_dropout_masks_of_the_statistics_change_each_step_without_rng(stream):
  # One batch, the same params: only the second layer's input factor sees
  # the dropout mask. A fixed key (an rng given) keeps it; none, new masks.
  # A stream other than "dropout" draws from K-FAC's "params" key.
  _, batch = bf.tiny_problem()
  model = DropoutMLP(stream)
  params = model.init(jax.random.key(1), batch[0])["params"]
  tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=batch,
                                estimation="empirical", ema_decay=0.5)
  grads = jax.tree.map(jnp.ones_like, params)

  def second_input_factors(rng):
    state, factors = tx.init(params), []
    for _ in range(2):
      _, state = tx.update(grads, state, params, batch=batch, rng=rng)
      factors.append(np.asarray(state.factors["Dense_1"][0]))
    return factors

  fixed = second_input_factors(jax.random.key(2))
  np.testing.assert_allclose(fixed[1], fixed[0], rtol=1e-6, atol=1e-7)
  fresh = second_input_factors(None)
  assert bf.relative_error(fresh[1], fresh[0]) > 1e-2


def test_eigh_and_cholesky_agree():
  _, batch = bf.tiny_problem(seed=1)
  outputs = []
  for inverse in ("eigh", "cholesky"):
    tx, params = make_tx(estimation="exact", inverse=inverse, damping=1e-4)
    outputs.append(tx.update(random_grads(params, 3), tx.init(params), params,
                             batch=batch)[0])
  assert bf.relative_error(outputs[0], jax.tree.map(np.asarray, outputs[1])) < 1e-3


def test_non_finite_statistics_never_enter_the_factors():
  tx, params = make_tx(estimation="empirical")
  update = jax.jit(lambda s, b: tx.update(params, s, params, batch=b))
  x, y = bf.tiny_problem(seed=1)[1]
  _, good = update(tx.init(params), (x, y))
  out, bad = update(good, (x.at[0, 0].set(jnp.nan), y))
  jax.tree.map(np.testing.assert_array_equal, bad.factors, good.factors)
  jax.tree.map(np.testing.assert_array_equal, bad.inverses, good.inverses)
  assert int(bad.stats_count) == 1 and int(bad.count) == 2
  assert int(bad.rejected_statistics) == 1 and int(good.rejected_statistics) == 0
  assert kfac_optax.stats(bad)["rejected_statistics"] == 1
  assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(out))


def test_schedule_reaching_zero_damping_is_a_rejected_refresh():
  # The schedule is valid at count 0 (checked at construction), then 0 and
  # negative: those refreshes keep the inverses of λ = 1e-2 and say so.
  tx, params = make_tx(estimation="empirical",
                       damping=lambda count: jnp.array([1e-2, 0.0, -1.0])[count])
  update = jax.jit(lambda g, s, b: tx.update(g, s, params, batch=b))
  state = tx.init(params)
  assert float(kfac_optax.stats(state)["damping"]) == 0  # no refresh yet
  outs, states = [], []
  for seed in range(3):
    out, state = update(random_grads(params, seed), state, bf.tiny_problem(seed=seed)[1])
    outs.append(out)
    states.append(state)
  assert [int(s.rejected_refreshes) for s in states] == [0, 1, 2]
  for state in states[1:]:
    jax.tree.map(np.testing.assert_array_equal, state.inverses, states[0].inverses)
    assert float(kfac_optax.stats(state)["damping"]) == pytest.approx(1e-2)
  assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(outs))
  # Later updates still use the λ = 1e-2 inverses, with the new statistics.
  expected = bf.factors(params, bf.tiny_problem(seed=0)[1], "empirical")
  assert bf.relative_error(outs[2], bf.precondition(
      expected, random_grads(params, 2), DAMPING)) < 1e-3


def test_injected_invalid_damping_is_a_rejected_refresh():
  params, batch = bf.tiny_problem()
  tx = optax.inject_hyperparams(kfac_optax.scale_by_kfac,
                                static_args=("apply_fn", "num_samples"))(
      bf.TinyMLP().apply, LOSS, example_batch=batch, estimation="empirical",
      damping=DAMPING, inverse_update_period=1)
  update = jax.jit(lambda g, s, b: tx.update(g, s, params, batch=b))
  state = tx.init(params)
  _, state = update(random_grads(params, 0), state, batch)
  for damping in (0.0, -1e-2, float("nan")):
    state.hyperparams["damping"] = jnp.asarray(damping, jnp.float32)
    out, new = update(random_grads(params, 1), state, batch)
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(out))
    stats = kfac_optax.stats(new)
    assert int(stats["rejected_refreshes"]) == 1
    assert float(stats["damping"]) == pytest.approx(DAMPING)


def test_fresh_state_can_be_donated():
  """No two leaves of a new state share a buffer (donate_argnums needs that)."""
  tx, params = make_tx(estimation="empirical")
  _, batch = bf.tiny_problem(seed=1)
  step = jax.jit(lambda s: tx.update(params, s, params, batch=batch)[1],
                 donate_argnums=0)
  state = step(step(tx.init(params)))
  assert int(state.count) == 2


def test_training_steps_compile_once():
  """The state keeps its types step to step: one trace, state donated."""
  params, batch = bf.tiny_problem()
  model = bf.TinyMLP()
  tx = kfac_optax.kfac(model.apply, LOSS, example_batch=batch, learning_rate=0.1,
                       damping=lambda count: 1e-2 / (1 + count),
                       inverse_update_period=2)
  state = kfac_optax.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  traces = []

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, batch, rng):
    traces.append(1)
    grads = jax.grad(lambda p: LOSS.value(model.apply({"params": p}, batch[0]),
                                          batch))(state.params)
    return state.apply_gradients(grads=grads, batch=batch, rng=rng)

  for seed in range(4):
    state = step(state, bf.tiny_problem(seed=seed)[1], jax.random.key(seed))
  assert len(traces) == 1 and step._cache_size() == 1
  assert int(state.step) == 4
