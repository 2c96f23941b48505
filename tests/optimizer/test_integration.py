"""kfac_optax composed with optax and flax, everything under `jax.jit`.

Each test compares a composed optimizer against the same computation spelled
out by hand on the output of a separately run `scale_by_kfac`, so a wrongly
forwarded keyword (batch, rng, variables), a wrong step count or a dropped
hyperparameter shows up as a numerical mismatch.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

import kfac_optax
from tests import brute_force as bf

LOSS = kfac_optax.losses.softmax_cross_entropy()
APPLY = bf.TinyMLP().apply
PARAMS, BATCH = bf.tiny_problem()
BATCHES = [bf.tiny_problem(seed=s)[1] for s in (1, 2, 3)]  # same shapes
KEYS = list(jax.random.split(jax.random.key(42), 3))
SETTINGS = dict(damping=1e-2, ema_decay=0.9, inverse_update_period=1)


def scale_by_kfac(**kwargs):
  return kfac_optax.scale_by_kfac(
      APPLY, LOSS, example_batch=BATCH, **{**SETTINGS, **kwargs})


def kfac(**kwargs):
  """kfac without its default norm constraint: updates follow lr and momentum."""
  return kfac_optax.kfac(
      APPLY, LOSS, example_batch=BATCH, **{**SETTINGS, "norm_constraint": None, **kwargs})


def loss_value(params, batch):
  return LOSS.value(APPLY({"params": params}, batch[0]), batch)


grad_fn = jax.grad(loss_value)


def assert_trees_close(actual, expected, rtol=1e-5):
  """Each leaf within ``rtol`` of its largest entry: float32 after a solve
  differs between machines (reduction order) by a few ulps of the largest
  entries, which is far more than an ulp of the small ones."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    e = np.asarray(e)
    scale = np.max(np.abs(e)) if e.size else 0.0
    np.testing.assert_allclose(np.asarray(a), e, rtol=0, atol=rtol * scale + 1e-30)


def trees_differ(a, b, rtol=1e-3):
  """True when some leaf differs by more than `rtol` relative to its norm."""
  return any(np.linalg.norm(np.asarray(x) - np.asarray(y))
             > rtol * np.linalg.norm(np.asarray(y))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def make_step(tx, reference):
  """jit: one update of `tx` and of `reference` on the same grads/batch/rng."""
  @jax.jit
  def step(params, state, ref_state, batch, rng):
    grads = grad_fn(params, batch)
    out, state = tx.update(grads, state, params, batch=batch, rng=rng)
    ref, ref_state = reference.update(grads, ref_state, params, batch=batch,
                                      rng=rng)
    return out, ref, state, ref_state
  return step


# 1. clip_by_global_norm after scale_by_kfac.
def test_chain_with_clip_by_global_norm():
  clip = 1e-2
  reference = scale_by_kfac(estimation="fisher")
  tx = optax.chain(scale_by_kfac(estimation="fisher"),
                   optax.clip_by_global_norm(clip))
  step = make_step(tx, reference)
  state, ref_state = tx.init(PARAMS), reference.init(PARAMS)
  for batch, rng in zip(BATCHES[:2], KEYS):
    out, ref, state, ref_state = step(PARAMS, state, ref_state, batch, rng)
    ref_norm = optax.tree.norm(ref)
    assert ref_norm > 10 * clip  # clipping is active
    assert_trees_close(out, jax.tree.map(lambda u: u * clip / ref_norm, ref))
    assert optax.tree.norm(out) <= clip * (1 + 1e-5)


# 2. sgd with momentum after scale_by_kfac: m = 0.9 m + u, update = -lr m.
def test_chain_with_sgd_momentum_matches_hand_recursion():
  lr, beta = 0.3, 0.9
  reference = scale_by_kfac(estimation="fisher")
  tx = optax.chain(scale_by_kfac(estimation="fisher"),
                   optax.sgd(learning_rate=lr, momentum=beta))
  step = make_step(tx, reference)
  state, ref_state = tx.init(PARAMS), reference.init(PARAMS)
  momentum = jax.tree.map(jnp.zeros_like, PARAMS)
  for batch, rng in zip(BATCHES, KEYS):
    out, ref, state, ref_state = step(PARAMS, state, ref_state, batch, rng)
    momentum = jax.tree.map(lambda m, u: beta * m + u, momentum, ref)
    assert_trees_close(out, jax.tree.map(lambda m: -lr * m, momentum))
  # After 3 steps the momentum term matters: -lr * u alone is wrong.
  assert trees_differ(out, jax.tree.map(lambda u: -lr * u, ref))


# 3. add_decayed_weights after scale_by_kfac: update = U + wd * params.
def test_chain_with_add_decayed_weights():
  wd = 0.5
  reference = scale_by_kfac(estimation="empirical")
  tx = optax.chain(scale_by_kfac(estimation="empirical"),
                   optax.add_decayed_weights(wd))
  step = make_step(tx, reference)
  state, ref_state = tx.init(PARAMS), reference.init(PARAMS)
  params = PARAMS
  for batch in BATCHES[:2]:
    out, ref, state, ref_state = step(params, state, ref_state, batch, None)
    assert_trees_close(out, jax.tree.map(lambda u, p: u + wd * p, ref, params))
    assert trees_differ(out, ref)
    params = jax.tree.map(lambda p: 0.9 * p, params)  # same shapes: no retrace


# 4. kfac with a learning-rate schedule and with a momentum schedule.
def test_kfac_learning_rate_schedule():
  schedule = optax.linear_schedule(0.4, 0.1, transition_steps=2)
  reference = scale_by_kfac(estimation="empirical")
  tx = kfac(estimation="empirical", learning_rate=schedule, momentum=0.0)
  step = make_step(tx, reference)
  state, ref_state = tx.init(PARAMS), reference.init(PARAMS)
  for t, batch in enumerate(BATCHES):
    out, ref, state, ref_state = step(PARAMS, state, ref_state, batch, None)
    assert_trees_close(out, jax.tree.map(lambda u: -schedule(t) * u, ref))


def test_kfac_momentum_schedule():
  lr = 0.2
  momentum_schedule = optax.linear_schedule(0.0, 0.8, transition_steps=2)
  reference = scale_by_kfac(estimation="empirical")
  tx = kfac(estimation="empirical", learning_rate=lr, momentum=momentum_schedule)
  step = make_step(tx, reference)
  state, ref_state = tx.init(PARAMS), reference.init(PARAMS)
  momentum = jax.tree.map(jnp.zeros_like, PARAMS)
  for t, batch in enumerate(BATCHES):
    out, ref, state, ref_state = step(PARAMS, state, ref_state, batch, None)
    momentum = jax.tree.map(lambda m, u: momentum_schedule(t) * m + u,
                            momentum, ref)
    assert_trees_close(out, jax.tree.map(lambda m: -lr * m, momentum))
  assert trees_differ(out, jax.tree.map(lambda u: -lr * u, ref))


# 5. optax.inject_hyperparams(scale_by_kfac) with damping injected.
INJECT_STATIC = ("apply_fn", "loss", "inputs", "num_samples")


def test_inject_hyperparams_damping_changes_like_construction():
  first, second = 1e-2, 3.0
  injected = optax.inject_hyperparams(
      kfac_optax.scale_by_kfac, static_args=INJECT_STATIC)(
          APPLY, LOSS, example_batch=BATCH, estimation="empirical",
          **{**SETTINGS, "damping": first})
  plain = {d: scale_by_kfac(estimation="empirical", damping=d)
           for d in (first, second)}
  traces = []

  @jax.jit
  def step(state, plain_states, batch):
    traces.append(None)  # runs once per trace (= per compilation)
    grads = grad_fn(PARAMS, batch)
    out, state = injected.update(grads, state, PARAMS, batch=batch)
    plain_out, new_plain = {}, {}
    for d, tx in plain.items():
      plain_out[d], new_plain[d] = tx.update(
          grads, plain_states[d], PARAMS, batch=batch)
    return out, plain_out, state, new_plain

  state = injected.init(PARAMS)
  plain_states = {d: tx.init(PARAMS) for d, tx in plain.items()}
  # Statistics do not depend on damping and inverses are refreshed every
  # update, so each step's output only depends on that step's damping.
  for batch, damping in zip(BATCHES, (first, second, first)):
    state.hyperparams["damping"] = jnp.asarray(damping, jnp.float32)
    out, plain_out, state, plain_states = step(state, plain_states, batch)
    other = second if damping == first else first
    assert_trees_close(out, plain_out[damping])
    assert trees_differ(out, plain_out[other])  # the damping matters
    np.testing.assert_allclose(state.hyperparams["damping"], damping)
  assert len(traces) == 1  # one compilation for every damping value


def test_inject_hyperparams_static_args():
  # apply_fn is callable (a schedule unless static); the loss object is not
  # callable and inputs=None is not a callable either, so neither needs to be
  # static; num_samples must stay a Python int.
  minimal = optax.inject_hyperparams(
      kfac_optax.scale_by_kfac, static_args=("apply_fn", "num_samples"))(
          APPLY, LOSS, example_batch=BATCH, estimation="empirical")
  state = minimal.init(PARAMS)
  assert set(state.hyperparams) == {
      "damping", "ema_decay", "inverse_update_period", "stats_update_period",
      "curvature_warmup"}
  with pytest.raises(ValueError, match="static_args"):
    optax.inject_hyperparams(
        kfac_optax.scale_by_kfac, static_args=("apply_fn",))(
            APPLY, LOSS, example_batch=BATCH).init(PARAMS)


def test_kfac_can_be_wrapped_by_inject_hyperparams():
  # The usual optax way to change the learning rate at run time: it reads
  # kfac's signature, so every option must be a keyword argument of kfac's
  # own (a **kwargs would hide them; tests/optimizer/test_options.py).
  tx = optax.inject_hyperparams(
      kfac_optax.kfac, static_args=("apply_fn", "num_samples"))(
          APPLY, LOSS, example_batch=BATCH, learning_rate=0.1, momentum=0.0,
          norm_constraint=None, estimation="empirical", **SETTINGS)
  reference = scale_by_kfac(estimation="empirical")
  step = make_step(tx, reference)
  state, ref_state = tx.init(PARAMS), reference.init(PARAMS)
  for batch, lr in zip(BATCHES[:2], (0.1, 0.02)):
    state.hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
    out, ref, state, ref_state = step(PARAMS, state, ref_state, batch, None)
    assert_trees_close(out, jax.tree.map(lambda u: -lr * u, ref))


# 6. TrainState.apply_gradients.
def test_train_state_apply_gradients_matches_manual_update():
  tx = kfac(estimation="fisher", learning_rate=0.1)
  state = kfac_optax.TrainState.create(apply_fn=APPLY, params=PARAMS, tx=tx)

  @jax.jit
  def step(state, batch, rng):
    grads = grad_fn(state.params, batch)
    new_state = state.apply_gradients(grads=grads, batch=batch, rng=rng)
    updates, opt_state = tx.update(grads, state.opt_state, state.params,
                                   batch=batch, rng=rng)
    return new_state, optax.apply_updates(state.params, updates), opt_state

  for t, (batch, rng) in enumerate(zip(BATCHES[:2], KEYS)):
    old_params = state.params
    state, manual_params, manual_opt_state = step(state, batch, rng)
    assert int(state.step) == t + 1
    assert_trees_close(state.params, manual_params, rtol=0)
    assert_trees_close(state.opt_state, manual_opt_state, rtol=0)
    assert trees_differ(state.params, old_params, rtol=1e-4)


class ScaledMLP(nn.Module):
  """TinyMLP on ``x * scale``, ``scale`` an OVERWRITE_WITH_GRADIENT variable."""

  @nn.compact
  def __call__(self, x):
    scale = self.variable(OVERWRITE_WITH_GRADIENT, "scale",
                          lambda: 1.0 + 0.1 * jnp.arange(x.shape[-1]))
    return bf.TinyMLP(name="mlp")(x * scale.value)


def test_train_state_overwrite_with_gradient():
  model = ScaledMLP()
  variables = model.init(jax.random.key(7), BATCH[0])
  assert set(variables) == {"params", OVERWRITE_WITH_GRADIENT}
  tx = kfac_optax.kfac(model.apply, LOSS, example_batch=BATCH, learning_rate=0.1,
                       norm_constraint=None, estimation="empirical", **SETTINGS)
  state = kfac_optax.TrainState.create(
      apply_fn=model.apply, params=variables, tx=tx)
  # Only params["params"] gets optimizer state: three Kronecker blocks and
  # no diagonal block for the overwritten scale.
  assert set(state.opt_state[0].factors) == {"mlp/hidden", "mlp/nobias", "mlp/out"}

  @jax.jit
  def step(state, batch):
    grads = jax.grad(lambda v: LOSS.value(model.apply(v, batch[0]), batch))(
        state.params)
    new_state = state.apply_gradients(grads=grads, batch=batch)
    updates, _ = tx.update(
        grads["params"], state.opt_state, state.params["params"], batch=batch,
        variables={OVERWRITE_WITH_GRADIENT: state.params[OVERWRITE_WITH_GRADIENT]})
    return new_state, grads, optax.apply_updates(state.params["params"], updates)

  for t, batch in enumerate(BATCHES[:2]):
    old = state.params
    state, grads, manual = step(state, batch)
    assert int(state.step) == t + 1
    assert set(state.params) == {"params", OVERWRITE_WITH_GRADIENT}
    assert_trees_close(state.params[OVERWRITE_WITH_GRADIENT],
                       grads[OVERWRITE_WITH_GRADIENT], rtol=0)
    assert trees_differ(grads[OVERWRITE_WITH_GRADIENT],
                        old[OVERWRITE_WITH_GRADIENT])
    assert_trees_close(state.params["params"], manual, rtol=1e-6)
    assert trees_differ(state.params["params"], old["params"], rtol=1e-4)


class BatchNormMLP(nn.Module):
  """Dense -> BatchNorm (batch statistics) -> tanh -> Dense."""

  @nn.compact
  def __call__(self, x):
    h = nn.BatchNorm(use_running_average=False, momentum=0.5, name="bn")(
        nn.Dense(4, name="hidden")(x))
    return nn.Dense(3, name="out")(jnp.tanh(h))


class BatchStatsState(kfac_optax.TrainState):
  batch_stats: Any = None


def test_train_state_forwards_variables_of_a_batch_norm_model():
  model = BatchNormMLP()
  variables = model.init(jax.random.key(8), BATCH[0])
  tx = kfac_optax.kfac(model.apply, LOSS, example_batch=BATCH,
                       learning_rate=0.1, **SETTINGS)
  state = BatchStatsState.create(apply_fn=model.apply, params=variables["params"],
                                 tx=tx, batch_stats=variables["batch_stats"])
  assert set(state.opt_state[0].factors) == {"hidden", "bn", "out"}

  @jax.jit
  def step(state, batch, rng):
    def loss_fn(params):  # the user's step owns batch_stats
      logits, new = model.apply(
          {"params": params, "batch_stats": state.batch_stats}, batch[0],
          mutable=["batch_stats"])
      return LOSS.value(logits, batch), new["batch_stats"]
    (value, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params)
    others = {"batch_stats": state.batch_stats}
    new_state = state.apply_gradients(grads=grads, batch=batch, rng=rng,
                                      variables=others, batch_stats=new_stats)
    updates, _ = tx.update(grads, state.opt_state, state.params, batch=batch,
                           rng=rng, variables=others)
    return new_state, value, new_stats, optax.apply_updates(state.params, updates)

  values = []
  for t, rng in enumerate(jax.random.split(jax.random.key(9), 4)):
    state, value, new_stats, manual = step(state, BATCH, rng)
    values.append(float(value))
    assert int(state.step) == t + 1
    assert_trees_close(state.params, manual, rtol=0)
    assert_trees_close(state.batch_stats, new_stats, rtol=0)  # field replaced
  assert np.all(np.isfinite(values)) and values[-1] < 0.8 * values[0]


def scale_by_keyword():
  """Multiplies the updates by the ``scale`` keyword of ``update``."""
  def update_fn(updates, state, params=None, *, scale=1.0, **extra_args):
    del params, extra_args
    return jax.tree.map(lambda u: scale * u, updates), state
  return optax.GradientTransformationExtraArgs(
      lambda params: optax.EmptyState(), update_fn)


def test_train_state_forwards_keywords_that_are_not_fields():
  tx = optax.chain(kfac(estimation="empirical", learning_rate=0.1),
                   scale_by_keyword())
  state = kfac_optax.TrainState.create(apply_fn=APPLY, params=PARAMS, tx=tx)

  @jax.jit
  def step(state, scale):
    grads = grad_fn(state.params, BATCH)
    return state.apply_gradients(grads=grads, batch=BATCH, scale=scale)

  frozen, moved = step(state, 0.0), step(state, 1.0)
  assert_trees_close(frozen.params, PARAMS, rtol=0)
  assert trees_differ(moved.params, PARAMS, rtol=1e-4)
  assert int(frozen.step) == int(moved.step) == 1


def test_apply_if_finite_skips_a_nan_batch_and_training_goes_on():
  # The recipe of docs/operations.md: apply_if_finite forwards batch= and rng= to kfac.
  tx = optax.apply_if_finite(kfac(estimation="fisher", learning_rate=0.05),
                             max_consecutive_errors=3)
  state = kfac_optax.TrainState.create(apply_fn=APPLY, params=PARAMS, tx=tx)

  @jax.jit
  def step(state, batch, rng):
    value, grads = jax.value_and_grad(loss_value)(state.params, batch)
    return state.apply_gradients(grads=grads, batch=batch, rng=rng), value

  nan_batch = (BATCH[0].at[0, 0].set(jnp.nan), BATCH[1])
  initial = float(loss_jit(PARAMS, BATCH))
  rngs = jax.random.split(jax.random.key(5), 6)
  state, _ = step(state, BATCH, rngs[0])
  before = state
  state, value = step(state, nan_batch, rngs[1])
  assert not np.isfinite(value)
  assert int(state.opt_state.notfinite_count) == 1
  assert_trees_close(state.params, before.params, rtol=0)  # step skipped
  assert_trees_close(state.opt_state.inner_state, before.opt_state.inner_state,
                     rtol=0)  # K-FAC's statistics untouched
  for rng in rngs[2:]:
    state, value = step(state, BATCH, rng)
    assert np.isfinite(value)
  assert int(state.opt_state.notfinite_count) == 0
  assert int(state.opt_state.total_notfinite) == 1
  final = float(loss_jit(state.params, BATCH))
  assert np.isfinite(final) and final < 0.8 * initial


# 7. Errors.
def test_update_without_batch_raises():
  tx = scale_by_kfac(estimation="empirical")
  state = tx.init(PARAMS)
  with pytest.raises(TypeError, match="batch"):
    jax.jit(lambda g, s: tx.update(g, s, PARAMS))(PARAMS, state)


def test_fisher_without_rng_raises():
  tx = kfac(estimation="fisher", learning_rate=0.1)
  state = tx.init(PARAMS)
  with pytest.raises(TypeError, match="rng"):
    jax.jit(lambda g, s: tx.update(g, s, PARAMS, batch=BATCH))(PARAMS, state)
  train_state = kfac_optax.TrainState.create(apply_fn=APPLY, params=PARAMS, tx=tx)
  with pytest.raises(TypeError, match="rng"):
    jax.jit(lambda s: s.apply_gradients(grads=PARAMS, batch=BATCH))(train_state)


def test_example_batch_of_wrong_feature_size_raises_at_init():
  wrong = (jnp.ones((6, 7)), BATCH[1])  # TinyMLP's params expect 5 features
  tx = kfac_optax.scale_by_kfac(APPLY, LOSS, example_batch=wrong)
  with pytest.raises(ValueError, match="example_batch"):
    tx.init(PARAMS)


def test_whole_variables_dict_as_params_raises():
  tx = scale_by_kfac(estimation="empirical")
  # The message must tell the user to pass variables["params"].
  with pytest.raises(ValueError, match=r"\[.params.\]"):
    tx.init({"params": PARAMS})
  state = tx.init(PARAMS)
  whole = {"params": PARAMS}
  with pytest.raises(ValueError, match=r"\[.params.\]"):
    jax.jit(lambda g, s: tx.update(g, s, whole, batch=BATCH))(whole, state)


class WithOddParams(nn.Module):
  """TinyMLP plus a complex Dense and an integer param."""

  @nn.compact
  def __call__(self, x):
    x = jnp.real(nn.Dense(5, param_dtype=jnp.complex64, name="complex")(x))
    counter = self.param("counter", lambda key: jnp.zeros((3,), jnp.int32))
    return bf.TinyMLP(name="mlp")(x) + counter


def test_integer_and_complex_params_raise_at_init():
  model = WithOddParams()
  params = model.init(jax.random.key(0), BATCH[0])["params"]
  tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=BATCH)
  with pytest.raises(TypeError) as error:
    tx.init(params)
  assert str(error.value) == (
      "kfac_optax trains real floating-point params only; these params leaves "
      "are not: complex/bias (complex64), complex/kernel (complex64), counter "
      "(int32).\nFix: keep integer arrays out of the 'params' collection "
      "(e.g. self.variable('constants', ...)) and pass that collection as "
      "update(..., variables=...) or TrainState.apply_gradients(..., "
      "variables=...); write a complex weight as two real params (its real "
      "and imaginary parts).")


def test_empirical_targets_of_the_wrong_shape_name_the_fix():
  wrong = (BATCH[0], BATCH[1][:, None])  # labels (N, 1) for logits (N, 3)
  tx = scale_by_kfac(estimation="empirical")
  with pytest.raises(ValueError, match=(
      r"^softmax_cross_entropy: targets\(batch\) has shape \(6, 1\) \(int32\) "
      r"for outputs of shape \(6, 3\); targets= must return integer class "
      r"labels \(not one-hot\) of shape outputs.shape\[:-1\], here \(6,\)")):
    jax.jit(lambda g, s: tx.update(g, s, PARAMS, batch=wrong))(PARAMS, tx.init(PARAMS))


def test_dict_batch_needs_inputs():
  batch = {"x": BATCH[0], "y": BATCH[1]}
  tx = kfac_optax.scale_by_kfac(APPLY, LOSS, example_batch=batch)
  with pytest.raises((TypeError, ValueError), match="inputs="):
    tx.init(PARAMS)
  # With inputs= (and the loss's targets=) the same dict batch works under jit
  # and gives exactly the tuple batch's result.
  dict_tx = kfac_optax.scale_by_kfac(
      APPLY, kfac_optax.losses.softmax_cross_entropy(targets=lambda b: b["y"]),
      example_batch=batch, inputs=lambda b: b["x"], estimation="empirical",
      **SETTINGS)
  reference = scale_by_kfac(estimation="empirical")

  @jax.jit
  def step(dict_batch, tuple_batch):
    grads = grad_fn(PARAMS, tuple_batch)
    out, _ = dict_tx.update(grads, dict_tx.init(PARAMS), PARAMS, batch=dict_batch)
    ref, _ = reference.update(grads, reference.init(PARAMS), PARAMS,
                              batch=tuple_batch)
    return out, ref

  out, ref = step(batch, BATCH)
  assert_trees_close(out, ref)


# 8. End to end.
loss_jit = jax.jit(loss_value)


@pytest.mark.parametrize("estimation", ["fisher", "empirical", "exact"])
def test_kfac_reduces_loss_on_fixed_batch(estimation):
  tx = kfac(estimation=estimation, learning_rate=0.05)

  @jax.jit
  def step(params, state, rng):
    grads = grad_fn(params, BATCH)
    updates, state = tx.update(grads, state, params, batch=BATCH, rng=rng)
    return optax.apply_updates(params, updates), state

  params, state = PARAMS, tx.init(PARAMS)
  initial = float(loss_jit(params, BATCH))
  for rng in jax.random.split(jax.random.key(3), 5):
    params, state = step(params, state, rng)
  final = float(loss_jit(params, BATCH))
  assert np.isfinite(final)
  assert final < 0.8 * initial
  assert int(state[0].count) == 5


def test_example_batch_may_be_shape_structs():
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), BATCH)
  concrete = scale_by_kfac(estimation="empirical")
  tx = kfac_optax.scale_by_kfac(APPLY, LOSS, example_batch=abstract,
                                estimation="empirical", **SETTINGS)
  grads = jax.grad(loss_value)(PARAMS, BATCHES[0])
  expected, _ = concrete.update(grads, concrete.init(PARAMS), PARAMS, batch=BATCHES[0])
  actual, _ = tx.update(grads, tx.init(PARAMS), PARAMS, batch=BATCHES[0])
  assert_trees_close(actual, expected)
