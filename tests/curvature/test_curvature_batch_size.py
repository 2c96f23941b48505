"""curvature_batch_size: statistics from the first n examples, against brute force."""

import jax
import numpy as np
import pytest

import kfac_optax
from tests import brute_force as bf
from tests.optimizer.test_adaptive import explicit_fisher
from tests.optimizer.test_adaptive import flat64
from tests.optimizer.test_adaptive import grads_at

LOSS = kfac_optax.losses.softmax_cross_entropy()
DAMPING = 1e-2
PARAMS, BATCH = bf.tiny_problem(n=8)
SUB = 3
TRUNCATED = jax.tree.map(lambda x: x[:SUB], BATCH)
SETTINGS = dict(damping=DAMPING, inverse_update_period=1)


def scale_by_kfac(example_batch=BATCH, **settings):
  return kfac_optax.scale_by_kfac(bf.TinyMLP().apply, LOSS,
                                  example_batch=example_batch, **SETTINGS, **settings)


@pytest.mark.parametrize("estimation", ["empirical", "exact"])
def test_factors_are_those_of_the_first_examples_and_precondition_the_whole_gradient(
    estimation):
  tx = scale_by_kfac(estimation=estimation, curvature_batch_size=SUB)
  grads = grads_at(PARAMS, BATCH)
  out, state = jax.jit(lambda g, s: tx.update(g, s, PARAMS, batch=BATCH))(
      grads, tx.init(PARAMS))
  expected = bf.factors(PARAMS, TRUNCATED, estimation)
  whole = bf.factors(PARAMS, BATCH, estimation)
  for name in bf.LAYERS:
    assert bf.relative_error(state.factors[name], expected[name]) < 1e-4, name
    assert bf.relative_error(state.factors[name], whole[name]) > 1e-2, name
  assert bf.relative_error(out, bf.precondition(expected, grads, DAMPING)) < 1e-3


def test_sampled_statistics_equal_a_full_pass_on_the_truncated_batch():
  grads, rng = grads_at(PARAMS, BATCH), jax.random.key(7)
  sub = scale_by_kfac(curvature_batch_size=SUB)
  full = scale_by_kfac(example_batch=TRUNCATED)
  _, sub_state = sub.update(grads, sub.init(PARAMS), PARAMS, batch=BATCH, rng=rng)
  _, full_state = full.update(grads, full.init(PARAMS), PARAMS, batch=TRUNCATED,
                              rng=rng)
  jax.tree.map(np.testing.assert_array_equal, sub_state.factors, full_state.factors)


def test_quadratic_model_takes_the_whole_batch_curvature():
  """The factors come from the sub-batch; α from the whole batch's Fisher."""
  tx = kfac_optax.kfac(bf.TinyMLP().apply, LOSS, example_batch=BATCH,
                       learning_rate=None, momentum=None, adaptive_damping=False,
                       estimation="empirical", curvature_batch_size=SUB, **SETTINGS)
  grads = grads_at(PARAMS, BATCH)
  update, _ = tx.update(grads, tx.init(PARAMS), PARAMS, batch=BATCH)
  g = flat64(grads)
  v = flat64(bf.precondition(bf.factors(PARAMS, TRUNCATED, "empirical"), grads,
                             DAMPING))
  step = {}
  for name, batch in (("whole", BATCH), ("sub", TRUNCATED)):
    fisher = explicit_fisher(PARAMS, batch)[0] + DAMPING * np.eye(len(g))
    step[name] = -(g @ v) / (v @ fisher @ v) * v  # the first step: v alone
  assert bf.relative_error(update, step["whole"]) < 1e-3
  assert np.linalg.norm(step["sub"] - step["whole"]) > 1e-2 * np.linalg.norm(step["whole"])


@pytest.mark.parametrize("value", [0, -2, 2.5, True, "4"])
@pytest.mark.parametrize("factory", [kfac_optax.scale_by_kfac, kfac_optax.kfac,
                                     kfac_optax.Curvature])
def test_a_bad_size_is_rejected_where_it_is_given(value, factory):
  with pytest.raises(ValueError, match=(
      f"curvature_batch_size must be a positive Python int or None, got {value!r}; "
      "with optax.inject_hyperparams, list it in static_args")):
    factory(bf.TinyMLP().apply, LOSS, example_batch=BATCH, curvature_batch_size=value)


# A model built for one batch size: an array with a row per example of it.
OFFSETS = np.zeros((8, 1), np.float32)


def fixed_batch_apply(variables, x, **kwargs):
  return bf.TinyMLP().apply(variables, x + OFFSETS, **kwargs)


@pytest.mark.parametrize("factory, setting", [
    (kfac_optax.scale_by_kfac, {"curvature_batch_size": SUB}),
    (kfac_optax.kfac, {"curvature_batch_size": SUB}),
    (kfac_optax.kfac, {"learning_rate": None, "momentum": None,
                       "quadratic_batch_size": SUB})])
def test_a_model_sized_for_the_whole_batch_fails_init_naming_the_setting(
    factory, setting):
  name = next(key for key in setting if key.endswith("batch_size"))
  tx = factory(fixed_batch_apply, LOSS, example_batch=BATCH, **SETTINGS, **setting)
  with pytest.raises(ValueError, match=(
      rf"{name}=3 runs the model on the batch's first 3 examples, but "
      r"apply_fn, which runs on the 8 of example_batch, fails on 3: TypeError: "
      r"[^\n]*incompatible shapes[^\n]*\nThe model likely holds arrays made for 8 "
      rf"examples .*\nFix: build them from the inputs' shape inside the "
      rf"model's call, or {name}=None \(the whole batch\).")):
    tx.init(PARAMS)
  # on the whole batch it runs
  factory(fixed_batch_apply, LOSS, example_batch=BATCH, **SETTINGS).init(PARAMS)


def test_batch_errors_name_the_argument_and_the_fix():
  grads = grads_at(PARAMS, BATCH)
  tx = scale_by_kfac(estimation="empirical", curvature_batch_size=9)
  with pytest.raises(ValueError, match=(
      r"curvature_batch_size=9 exceeds the batch size 8.\nFix: "
      r"curvature_batch_size <= 8, or None \(the whole batch\).")):
    tx.update(grads, tx.init(PARAMS), PARAMS, batch=BATCH)
  tx = scale_by_kfac(estimation="empirical", curvature_batch_size=SUB)
  with pytest.raises(ValueError, match=(
      r"curvature_batch_size=3 takes the first 3 examples of every leaf of the "
      r"batch, but its leaves have no common leading \(batch\) axis: shapes "
      r"\[\(8, 5\), \(6,\)\].\nFix: give every leaf of the batch the examples on "
      r"its first axis, or curvature_batch_size=None")):
    tx.update(grads, tx.init(PARAMS), PARAMS, batch=(BATCH[0], BATCH[1][:6]))
