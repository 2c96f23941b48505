"""Predictive distributions: values, samples and output-Fisher square roots."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfac_optax._src import losses

OUTPUTS = jax.random.normal(jax.random.key(0), (2, 3, 4))  # two leading axes


def fisher_from_sqrt(loss):
  columns = np.asarray(loss.fisher_sqrt(OUTPUTS), np.float64)  # (C, 2, 3, C)
  return np.einsum("kabi,kabj->abij", columns, columns)


def score_outer(loss, targets):
  """∇_f NLL ∇_f NLLᵀ per term, for given targets."""
  grad = jax.grad(lambda f: jnp.sum(loss.nll(f, targets)))(OUTPUTS)
  grad = np.asarray(grad, np.float64)
  return np.einsum("abi,abj->abij", grad, grad)


def test_categorical_fisher_sqrt_is_expected_score_outer_product():
  loss = losses.softmax_cross_entropy()
  p = np.asarray(jax.nn.softmax(OUTPUTS), np.float64)
  expected = sum(p[..., k, None, None] * score_outer(loss, jnp.full((2, 3), k))
                 for k in range(4))  # E_y over all classes
  np.testing.assert_allclose(fisher_from_sqrt(loss), expected, atol=1e-6)
  explicit = np.einsum("abi,ij->abij", p, np.eye(4)) - np.einsum("abi,abj->abij", p, p)
  np.testing.assert_allclose(fisher_from_sqrt(loss), explicit, atol=1e-6)


def test_bernoulli_fisher_sqrt_is_expected_score_outer_product():
  loss = losses.sigmoid_cross_entropy()
  q = np.asarray(jax.nn.sigmoid(OUTPUTS), np.float64)
  expected = np.zeros((2, 3, 4, 4))
  for bits in itertools.product([0.0, 1.0], repeat=4):  # all 16 outcomes
    y = np.broadcast_to(np.array(bits), (2, 3, 4))
    prob = np.prod(np.where(y == 1, q, 1 - q), -1)[..., None, None]
    expected += prob * score_outer(loss, jnp.asarray(y, jnp.float32))
  np.testing.assert_allclose(fisher_from_sqrt(loss), expected, atol=1e-6)


def test_gaussian_fisher_sqrt_is_identity_and_samples_match():
  loss = losses.squared_error()
  np.testing.assert_allclose(fisher_from_sqrt(loss),
                             np.broadcast_to(np.eye(4), (2, 3, 4, 4)), atol=1e-7)
  draws = jax.vmap(loss.sample, (0, None))(
      jax.random.split(jax.random.key(1), 20000), OUTPUTS)
  scores = jax.vmap(jax.grad(lambda f, y: jnp.sum(loss.nll(f, y))), (None, 0))(
      OUTPUTS, draws)
  scores = np.asarray(scores, np.float64)
  mean_outer = np.einsum("sabi,sabj->abij", scores, scores) / len(scores)
  np.testing.assert_allclose(mean_outer, fisher_from_sqrt(loss), atol=0.06)
  np.testing.assert_allclose(np.mean(draws, 0), OUTPUTS, atol=0.05)


@pytest.mark.parametrize("make, targets, expected", [
    (losses.softmax_cross_entropy, jnp.zeros((2, 3), jnp.int32),
     lambda f, y: -jax.nn.log_softmax(f)[..., 0]),
    # Every class as a label: the masked sum picks each one's log-probability.
    (losses.softmax_cross_entropy, jnp.array([[0, 1, 2], [3, 2, 1]]),
     lambda f, y: -np.take_along_axis(np.asarray(jax.nn.log_softmax(f)),
                                      np.asarray(y)[..., None], -1)[..., 0]),
    (losses.sigmoid_cross_entropy, jnp.ones((2, 3, 4)),
     lambda f, y: -jnp.sum(jax.nn.log_sigmoid(f), -1)),
    (losses.squared_error, jnp.ones((2, 3, 4)),
     lambda f, y: 0.5 * jnp.sum((1 - f) ** 2, -1)),
])
def test_value_is_mean_of_per_term_nll(make, targets, expected):
  loss = make(targets=lambda batch: batch["y"])
  assert loss.nll(OUTPUTS, targets).shape == (2, 3)
  np.testing.assert_allclose(loss.value(OUTPUTS, {"y": targets}),
                             jnp.mean(expected(OUTPUTS, targets)), rtol=1e-6)
  assert loss.terms(OUTPUTS, {"y": targets}).count == 6



@pytest.mark.parametrize("make, targets, expected", [
    (losses.softmax_cross_entropy, np.zeros((2, 3), np.int32),
     lambda f, y: -(f[..., 0] - np.log(np.sum(np.exp(f), -1)))),
    (losses.sigmoid_cross_entropy, np.ones((2, 3, 4)),
     lambda f, y: np.sum(np.log1p(np.exp(-f)), -1)),
    (losses.squared_error, np.ones((2, 3, 4)),
     lambda f, y: 0.5 * np.sum((1 - f) ** 2, -1)),
])
def test_float64_outputs_keep_float64(make, targets, expected):
  """Under x64 a float64 model's loss, output Fisher and samples stay float64
  (the training loss of a float64 model, and the loss change that kfac's ρ
  measures; they were rounded to float32, which put ρ 0.2% off)."""
  outputs = np.random.default_rng(0).normal(size=(2, 3, 4)) * 3
  with jax.enable_x64(True):
    loss = make(targets=lambda batch: batch["y"])
    value = loss.value(jnp.asarray(outputs), {"y": jnp.asarray(targets)})
    assert value.dtype == jnp.float64
    assert abs(float(value) - np.mean(expected(outputs, targets))) < 1e-13
    assert loss.fisher_sqrt(jnp.asarray(outputs)).dtype == jnp.float64
    assert loss.fisher_product(jnp.asarray(outputs), jnp.asarray(outputs)).dtype == jnp.float64
    sample = loss.sample(jax.random.key(0), jnp.asarray(outputs))
    assert sample.dtype in (jnp.float64, jnp.int64)

def test_default_targets_need_a_tuple_batch():
  with pytest.raises(TypeError, match="targets="):
    losses.softmax_cross_entropy().value(OUTPUTS, {"y": 0})


FIT_SOFTMAX = ("integer class labels (not one-hot) of shape outputs.shape[:-1], "
               "here (2, 3)")
FIT_OUTPUTS = ("targets of the outputs' shape (one output unit still has its "
               "last axis: y[..., None]), here (2, 3, 4)")


@pytest.mark.parametrize("make, targets, message", [
    (losses.softmax_cross_entropy, jnp.zeros((2, 3, 4), jnp.int32),
     "softmax_cross_entropy: targets(batch) has shape (2, 3, 4) (int32) for "
     f"outputs of shape (2, 3, 4); targets= must return {FIT_SOFTMAX}"),
    (losses.softmax_cross_entropy, jnp.zeros((2, 3), jnp.float32),
     "softmax_cross_entropy: targets(batch) has shape (2, 3) (float32) for "
     f"outputs of shape (2, 3, 4); targets= must return {FIT_SOFTMAX}"),
    (losses.sigmoid_cross_entropy, jnp.ones((2, 3)),
     "sigmoid_cross_entropy: targets(batch) has shape (2, 3) (float32) for "
     f"outputs of shape (2, 3, 4); targets= must return {FIT_OUTPUTS}"),
    (losses.squared_error, jnp.ones((3, 4)),
     "squared_error: targets(batch) has shape (3, 4) (float32) for "
     f"outputs of shape (2, 3, 4); targets= must return {FIT_OUTPUTS}"),
], ids=["one-hot", "float-labels", "sigmoid", "squared-error"])
@pytest.mark.parametrize("use", ["value", "empirical"])
def test_targets_that_do_not_fit_the_outputs_raise(make, targets, message, use):
  loss = make(targets=lambda batch: batch["y"])
  read = {"value": lambda f, b: loss.value(f, b),
          "empirical": lambda f, b: losses.output_cotangents(
              loss, f, b, "empirical", None, 1)}[use]
  with pytest.raises(ValueError) as error:
    jax.jit(read)(OUTPUTS, {"y": targets})
  assert str(error.value) == message


def test_squared_error_single_output_does_not_broadcast():
  # outputs (B, 1) and targets (B,) once broadcast to (B, B) silently.
  outputs, targets = jnp.zeros((5, 1)), jnp.arange(5.0)
  loss = losses.squared_error()
  with pytest.raises(ValueError, match=r"\(5,\) \(float32\) for outputs of "
                     r"shape \(5, 1\).*y\[\.\.\., None\]\), here \(5, 1\)"):
    loss.value(outputs, (None, targets))
  np.testing.assert_allclose(loss.value(outputs, (None, targets[:, None])),
                             0.5 * np.mean(np.arange(5.0) ** 2))
