"""conv_layout: convolutions rewritten into XLA:CPU's canonical layout."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_optax
from kfac_optax._src.curvature import canonical_convolutions

CANONICAL_LABELS = {1: "b0f_0io->b0f", 2: "b01f_01io->b01f", 3: "b012f_012io->b012f"}


def conv(x, w, dims, **kwargs):
  return jax.lax.conv_general_dilated(x, w, (1,) * (x.ndim - 2), "SAME",
                                      dimension_numbers=dims, **kwargs)


def value_and_both_grads(f):
  """``f``'s value, and its VJP to the input and the kernel (whose convolutions
  have the swapped and the batch-grouped layouts)."""
  def run(x, w):
    y, vjp = jax.vjp(f, x, w)
    return y, *vjp(jnp.cos(y))
  return run


CASES = {
    "NHWC/HWIO": (lambda x, w: conv(x, w, ("NHWC", "HWIO", "NHWC")),
                  (2, 5, 6, 3), (3, 3, 3, 4)),
    "NCHW/OIHW": (lambda x, w: conv(x, w, ("NCHW", "OIHW", "NCHW")),
                  (2, 3, 5, 6), (4, 3, 3, 3)),
    "grouped, strided, dilated": (
        lambda x, w: jax.lax.conv_general_dilated(
            x, w, (2, 1), "SAME", rhs_dilation=(1, 2), feature_group_count=2,
            dimension_numbers=("NHWC", "HWIO", "NHWC")),
        (2, 7, 6, 4), (3, 2, 2, 6)),
    "1-d, in a nested jit": (
        lambda x, w: jax.jit(lambda a, b: jnp.tanh(conv(a, b, ("NWC", "WIO", "NWC"))))(x, w),
        (2, 9, 3), (5, 3, 2)),
    "3-d": (lambda x, w: conv(x, w, ("NDHWC", "DHWIO", "NDHWC")),
            (1, 4, 5, 3, 2), (3, 3, 3, 2, 3)),
    "in a jax.checkpoint": (
        jax.checkpoint(lambda x, w: jnp.tanh(conv(x, w, ("NHWC", "HWIO", "NHWC")))),
        (2, 5, 6, 3), (3, 3, 3, 4)),
}


@pytest.mark.parametrize("name", CASES)
def test_values_and_gradients_equal_the_original(name):
  f, x_shape, w_shape = CASES[name]
  kx, kw = jax.random.split(jax.random.key(0))
  x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
  run = value_and_both_grads(f)
  expected = jax.jit(run)(x, w)
  rewritten = jax.jit(canonical_convolutions.canonical_convolutions(run))(x, w)
  for got, want in zip(rewritten, expected):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_function_without_convolutions_lowers_to_the_same_program():
  def dense(x, w):
    return jax.jit(jnp.tanh)(x @ w).sum()
  args = jnp.ones((3, 4)), jnp.ones((4, 2))
  rewritten = jax.jit(canonical_convolutions.canonical_convolutions(dense)).lower(*args)
  assert rewritten.as_text() == jax.jit(dense).lower(*args).as_text()


def dim_labels(compiled_text):
  return set(re.findall(r"dim_labels=([\w>-]+)", compiled_text))


@pytest.mark.parametrize("name", ["NHWC/HWIO", "NCHW/OIHW", "1-d, in a nested jit", "3-d",
                                  "in a jax.checkpoint"])
def test_every_convolution_under_a_cond_is_canonical(name):
  f, x_shape, w_shape = CASES[name]
  run = canonical_convolutions.canonical_convolutions(value_and_both_grads(f))
  under_cond = jax.jit(lambda p, x, w: jax.lax.cond(
      p, run, lambda x, w: run(x * 0, w), x, w))
  text = under_cond.lower(True, jnp.ones(x_shape), jnp.ones(w_shape)).compile().as_text()
  assert dim_labels(text) == {CANONICAL_LABELS[len(x_shape) - 2]}


class TinyCNN(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(8, (3, 3))(x))
    x = nn.relu(nn.Conv(8, (3, 3))(x))
    return nn.Dense(3)(x.mean(axis=(1, 2)))


def test_statistics_on_a_schedule_run_canonical_convolutions():
  """K-FAC's statistics under `lax.cond` (period 2): its capture's backward
  convolutions too are canonical, and its factors those of period 1."""
  x = jax.random.normal(jax.random.key(1), (4, 8, 8, 2))
  batch = (x, jnp.array([0, 1, 2, 0]))
  model = TinyCNN()
  params = model.init(jax.random.key(2), x)["params"]
  grads = jax.tree.map(jnp.ones_like, params)
  states = {}
  for period in (1, 2):
    tx = kfac_optax.scale_by_kfac(
        model.apply, kfac_optax.losses.softmax_cross_entropy(), example_batch=batch,
        stats_update_period=period, estimation="empirical")
    update = jax.jit(lambda g, s, p: tx.update(g, s, p, batch=batch))
    state = tx.init(params)
    states[period] = update(grads, state, params)[1]
    if period == 2:
      assert dim_labels(update.lower(grads, state, params).compile().as_text()) == {
          CANONICAL_LABELS[2]}
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               states[1].factors, states[2].factors)
