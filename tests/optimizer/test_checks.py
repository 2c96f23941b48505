"""Every numeric setting is checked where it is given, with a message naming
the argument, the value and the valid range."""

import re

import jax.numpy as jnp
import optax
import pytest

import kfac_optax
from tests import brute_force as bf

PARAMS, BATCH = bf.tiny_problem()
LOSS = kfac_optax.losses.softmax_cross_entropy()
APPLY = bf.TinyMLP().apply


def scale_by_kfac(**settings):
  return kfac_optax.scale_by_kfac(APPLY, LOSS, example_batch=BATCH, **settings)


def kfac(**settings):
  return kfac_optax.kfac(APPLY, LOSS, example_batch=BATCH,
                         **{"learning_rate": 0.1, **settings})


SHARED = [  # (settings, message) for both transformations
    ({"damping": -1e-2}, "damping must be > 0, got -0.01"),
    ({"damping": 0.0}, "damping must be > 0, got 0.0"),
    ({"damping": float("nan")}, "damping must be > 0, got nan"),
    ({"damping": lambda count: 0.0 * count},
     "damping (a schedule, at count 0) must be > 0, got 0.0"),
    ({"ema_decay": 1.0}, "ema_decay must be in [0, 1), got 1.0"),
    ({"ema_decay": 1.5}, "ema_decay must be in [0, 1), got 1.5"),
    ({"ema_decay": -0.5}, "ema_decay must be in [0, 1), got -0.5"),
    ({"stats_update_period": 0}, "stats_update_period must be an int >= 1, got 0"),
    ({"stats_update_period": -3}, "stats_update_period must be an int >= 1, got -3"),
    ({"curvature_warmup": -1}, "curvature_warmup must be an int >= 0, got -1"),
    ({"curvature_warmup": 2.0}, "curvature_warmup must be an int >= 0, got 2.0"),
    ({"inverse_update_period": 0}, "inverse_update_period must be an int >= 1, got 0"),
    ({"inverse_update_period": 2.5},
     "inverse_update_period must be an int >= 1, got 2.5"),
    ({"num_samples": 0}, "num_samples must be a positive Python int, got 0"),
]

KFAC_ONLY = [
    ({"learning_rate": 0.0}, "learning_rate must be > 0, got 0.0"),
    ({"learning_rate": -0.1}, "learning_rate must be > 0, got -0.1"),
    ({"learning_rate": optax.linear_schedule(-1.0, 1.0, 10)},
     "learning_rate (a schedule, at count 0) must be >= 0, got"),
    ({"norm_constraint": 0.0}, "norm_constraint must be > 0, got 0.0"),
    ({"num_burnin_steps": -1}, "num_burnin_steps must be an int >= 0, got -1"),
    ({"min_damping": 0.0}, "min_damping must be > 0, got 0.0"),
    ({"max_damping": -1.0}, "max_damping must be > 0, got -1.0"),
    ({"min_damping": 1.0, "max_damping": 0.5},
     "min_damping must be <= max_damping, got 1.0 > 0.5"),
    ({"damping_adaptation_interval": 0},
     "damping_adaptation_interval must be an int >= 1, got 0"),
    ({"damping_adaptation_decay": 0.0},
     "damping_adaptation_decay must be in (0, 1], got 0.0"),
    ({"damping_adaptation_decay": 1.5},
     "damping_adaptation_decay must be in (0, 1], got 1.5"),
    ({"l2_reg": -1e-3}, "l2_reg must be >= 0, got -0.001"),
]


@pytest.mark.parametrize("settings, message", SHARED)
@pytest.mark.parametrize("make", [scale_by_kfac, kfac])
def test_shared_settings_are_checked(make, settings, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    make(**settings)


@pytest.mark.parametrize("settings, message", KFAC_ONLY)
def test_kfac_settings_are_checked(settings, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    kfac(**settings)


def test_valid_edges_are_accepted():
  scale_by_kfac(ema_decay=0.0, damping=1e-12, inverse_update_period=jnp.asarray(3))
  kfac(damping_adaptation_decay=1.0, min_damping=0.1, max_damping=0.1,
       num_burnin_steps=0, learning_rate=None, momentum=None)


def test_injected_values_are_checked_at_init():
  injected = optax.inject_hyperparams(
      kfac_optax.scale_by_kfac, static_args=("apply_fn", "num_samples"))(
          APPLY, LOSS, example_batch=BATCH, damping=-1.0)
  with pytest.raises(ValueError, match=re.escape("damping must be > 0, got Array(-1.")):
    injected.init(PARAMS)


def then_rsqrt(first, peak, warmup):
  """``first`` for ``warmup`` steps, then ``peak·sqrt(warmup/count)``: at
  count 0 optax evaluates the second part at ``0 - warmup``, where its
  ``(count + warmup) ** -0.5`` is ``0 ** -0.5``, which only an array count
  survives (jnp.where then discards it)."""
  return optax.join_schedules(
      [first, lambda count: peak * (count + warmup) ** -0.5 * warmup ** 0.5],
      [warmup])


def test_schedules_are_checked_with_the_count_optax_passes():
  """A schedule is called with an int32 array, as optax calls it: with a
  Python 0 the rsqrt part raised ZeroDivisionError in the settings check
  (and in kfac's init, for a scheduled damping)."""
  warmup_then_rsqrt = then_rsqrt(optax.linear_schedule(0.0, 1e-3, 10), 1e-3, 10)
  kfac(learning_rate=warmup_then_rsqrt).init(PARAMS)
  constant_then_rsqrt = then_rsqrt(optax.constant_schedule(1e-2), 1e-2, 10)
  state = kfac(damping=constant_then_rsqrt).init(PARAMS)
  assert float(kfac_optax.stats(state)["requested_damping"]) == pytest.approx(1e-2)
  scale_by_kfac(damping=constant_then_rsqrt).init(PARAMS)
  with pytest.raises(ValueError, match=re.escape(
      "learning_rate (a schedule, at count 0) must be >= 0, got -1.0")):
    kfac(learning_rate=lambda count: -1.0 + 0 * count)


@pytest.mark.parametrize("settings, message", [
    ({"learning_rate": None, "norm_constraint": 1e-3},
     "norm_constraint bounds the step of a given learning rate; with "
     "learning_rate=None the quadratic model already chooses the step size"),
    ({"learning_rate": None, "damping": lambda count: 1e-2},
     "adaptive_damping adapts λ itself: give damping as the initial value, "
     "not a schedule"),
    ({"momentum": "fast"}, 'momentum must be a number, None or "auto", got '
     "'fast'"),
])
def test_settings_that_contradict_the_mode(settings, message):
  with pytest.raises(ValueError) as error:
    kfac(**settings)
  assert str(error.value) == message
