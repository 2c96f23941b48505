"""K-FAC's own controls against explicit matrices on the tiny MLP.

Norm constraint, quadratic-model learning rate and momentum, Levenberg-
Marquardt damping, curvature products, burn-in, l2_reg and `stats`.
"""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import kfac_optax
from kfac_optax._src.optimizer import adaptive
from kfac_optax._src.optimizer import kfac_step
from tests import brute_force as bf

LOSS = kfac_optax.losses.softmax_cross_entropy()
DAMPING = 1e-2
PARAMS, BATCH = bf.tiny_problem()
BATCHES = [bf.tiny_problem(seed=s)[1] for s in range(3)]
SETTINGS = dict(example_batch=BATCH, estimation="empirical", damping=DAMPING,
                inverse_update_period=1)


def grads_at(params, batch):
  return jax.grad(lambda p: LOSS.value(bf.TinyMLP().apply({"params": p}, batch[0]),
                                       batch))(params)


def curvature():
  return kfac_optax.Curvature(bf.TinyMLP().apply, LOSS, BATCH, estimation="empirical",
                              inverse_update_period=1)


def explicit_fisher(params, batch):
  """F = (1/N) Σ_n J_nᵀ (diag p_n - p_n p_nᵀ) J_n over the flattened params."""
  flat, unravel = ravel_pytree(params)
  outputs = lambda w: bf.TinyMLP().apply({"params": unravel(w)}, batch[0])
  jacobian = np.asarray(jax.jacfwd(outputs)(flat), np.float64)  # (N, C, P)
  p = bf.softmax(np.asarray(outputs(flat), np.float64))
  h = np.einsum("nc,cd->ncd", p, np.eye(p.shape[1])) - np.einsum("nc,nd->ncd", p, p)
  return np.einsum("nci,ncd,ndj->ij", jacobian, h, jacobian) / len(p), unravel


def flat64(tree):
  return np.asarray(ravel_pytree(tree)[0], np.float64)


def run(tx, batches=BATCHES, params=PARAMS):
  """Jitted updates of ``tx`` on ``batches`` at fixed params: (updates, states)."""
  update = jax.jit(lambda g, s, b: tx.update(g, s, params, batch=b))
  state, updates, states = tx.init(params), [], []
  for batch in batches:
    out, state = update(grads_at(params, batch), state, batch)
    updates.append(out)
    states.append(state)
  return updates, states


# --------------------------------------------------------------------------
# Curvature products.


def test_products_match_explicit_kronecker_matrices():
  curv = curvature()
  state = jax.jit(lambda s: curv.update(s, PARAMS, batch=BATCH, damping=DAMPING))(
      curv.init(PARAMS))
  vector = grads_at(PARAMS, BATCHES[1])

  def explicit(power, damping):
    out = {}
    for name in bf.LAYERS:
      a, g = (np.asarray(x[0], np.float64) for x in state.factors[name])
      da, dg = bf.pi_damping(a, g, damping) if damping else (0.0, 0.0)
      big = np.kron(a + da * np.eye(len(a)), g + dg * np.eye(len(g)))
      w, q = np.linalg.eigh(big)
      matrix = (q * np.maximum(w, 1e-30) ** power) @ q.T
      v = np.asarray(vector[name]["kernel"], np.float64)
      if "bias" in vector[name]:
        v = np.concatenate([v, np.asarray(vector[name]["bias"], np.float64)[None]])
      u = (matrix @ v.reshape(-1)).reshape(v.shape)
      out[name] = {"kernel": u[:len(vector[name]["kernel"])]}
      if "bias" in vector[name]:
        out[name]["bias"] = u[-1]
    return out

  multiply = jax.jit(lambda v, p, d: curv.multiply(state, v, power=p, damping=d),
                     static_argnums=1)
  fv = multiply(vector, 1, 0.0)
  inverse = multiply(vector, -1, DAMPING)
  root = multiply(vector, -0.5, DAMPING)
  assert bf.relative_error(fv, explicit(1, 0.0)) < 1e-4
  assert bf.relative_error(inverse, explicit(-1, DAMPING)) < 1e-3
  assert bf.relative_error(root, explicit(-0.5, DAMPING)) < 1e-3
  # F̂⁻¹(F̂ v) = v, the square root twice is the inverse, and the stored
  # inverses (refreshed with the same damping) are the power -1.
  damped = multiply(vector, 1, DAMPING)
  assert bf.relative_error(multiply(damped, -1, DAMPING), jax.tree.map(np.asarray, vector)) < 1e-3
  assert bf.relative_error(multiply(root, -0.5, DAMPING), jax.tree.map(np.asarray, inverse)) < 1e-3
  assert bf.relative_error(curv.precondition(state, vector),
                           jax.tree.map(np.asarray, inverse)) < 1e-3


def test_exact_product_is_the_explicit_fisher():
  fisher, unravel = explicit_fisher(PARAMS, BATCH)
  vector = grads_at(PARAMS, BATCHES[1])
  product = jax.jit(lambda v: curvature().exact_product(PARAMS, BATCH, v))(vector)
  assert bf.relative_error(product, fisher @ flat64(vector)) < 1e-4
  assert np.asarray(unravel(jnp.zeros(len(fisher)))["out"]["kernel"]).shape == (3, 3)


@pytest.mark.parametrize("estimation", ["fisher", "curvature_prop"])
def test_random_estimations_average_to_the_exact_factors(estimation):
  exact = bf.factors(PARAMS, BATCH, "exact")
  curv = kfac_optax.Curvature(bf.TinyMLP().apply, LOSS, BATCH, estimation=estimation,
                              num_samples=4000, inverse_update_period=1)
  state = jax.jit(lambda s, k: curv.update(s, PARAMS, batch=BATCH, rng=k, damping=1.0))(
      curv.init(PARAMS), jax.random.key(0))
  for name in bf.LAYERS:
    assert bf.relative_error(state.factors[name].a[0], exact[name][0]) < 1e-5
    assert bf.relative_error(state.factors[name].g[0], exact[name][1]) < 0.05
  few = kfac_optax.Curvature(bf.TinyMLP().apply, LOSS, BATCH, estimation=estimation)
  one_draw = few.update(few.init(PARAMS), PARAMS, batch=BATCH, rng=jax.random.key(0),
                        damping=1.0)
  assert bf.relative_error(one_draw.factors["out"].g[0], exact["out"][1]) > 0.05


# --------------------------------------------------------------------------
# Norm constraint.


def test_norm_constraint_bounds_the_update_fisher_norm():
  lr, bound = 0.5, 1e-4
  tx = kfac_optax.kfac(bf.TinyMLP().apply, LOSS, learning_rate=lr, momentum=0.0,
                       norm_constraint=bound, **SETTINGS)
  unconstrained = kfac_optax.kfac(bf.TinyMLP().apply, LOSS, learning_rate=lr,
                                  momentum=0.0, norm_constraint=None, **SETTINGS)
  (update,), (state,) = run(tx, BATCHES[:1])
  (free,), _ = run(unconstrained, BATCHES[:1])
  # δ = -lr·s·v with v = F̂_λ⁻¹ g, so δᵀ F̂_λ δ = lr² s² vᵀg must equal the bound.
  curv = curvature()
  damped_product = curv.multiply(state.curvature, update, power=1, damping=DAMPING)
  assert adaptive.tree_dot(update, damped_product) == pytest.approx(bound, rel=1e-3)
  assert float(kfac_optax.stats(state)["fisher_norm"]) == pytest.approx(bound, rel=1e-4)
  scale = flat64(update) / flat64(free)
  assert np.allclose(scale, scale[0]) and 0 < scale[0] < 1
  # A bound that already holds changes nothing.
  loose = kfac_optax.kfac(bf.TinyMLP().apply, LOSS, learning_rate=lr, momentum=0.0,
                          norm_constraint=1e6, **SETTINGS)
  assert bf.relative_error(run(loose, BATCHES[:1])[0][0], jax.tree.map(np.asarray, free)) < 1e-6

  # The standalone transform in a user's chain gives the same updates.
  chain = optax.chain(
      kfac_optax.norm_constraint(kfac_optax.scale_by_kfac(bf.TinyMLP().apply, LOSS, **SETTINGS),
                                 bound, lr),
      optax.scale_by_learning_rate(lr))
  assert bf.relative_error(run(chain, BATCHES[:1])[0][0], jax.tree.map(np.asarray, update)) < 1e-5


# --------------------------------------------------------------------------
# Quadratic-model learning rate and momentum.


def first(batch, size):
  """The first ``size`` examples of ``batch`` (all for None)."""
  return jax.tree.map(lambda leaf: leaf[:size], batch)


@pytest.mark.parametrize("quadratic_batch_size", [None, 3])
def test_qmodel_coefficients_minimise_the_explicit_quadratic_model(quadratic_batch_size):
  """The model's curvature term is the Fisher of the batch, or of its first
  ``quadratic_batch_size`` examples; its gradient term the whole batch's."""
  l2 = 1e-3
  tx = kfac_optax.kfac(bf.TinyMLP().apply, LOSS, learning_rate=None, momentum=None,
                       adaptive_damping=False, l2_reg=l2,
                       quadratic_batch_size=quadratic_batch_size, **SETTINGS)
  updates, states = run(tx)
  curv = curvature()
  for step, (update, state) in enumerate(zip(updates, states)):
    batch = BATCHES[step]
    fisher, _ = explicit_fisher(PARAMS, first(batch, quadratic_batch_size))
    g = flat64(grads_at(PARAMS, batch))
    v = flat64(curv.precondition(state.curvature, grads_at(PARAMS, batch)))
    previous = flat64(states[step - 1].previous_update) if step else np.zeros_like(v)
    curvature_matrix = fisher + (DAMPING + l2) * np.eye(len(g))
    if step == 0:  # no previous step: the 1x1 model along v
      coefficients = np.array([-(g @ v) / (v @ curvature_matrix @ v), 0.0])
    else:  # the 2x2 optimum, its momentum clipped to the range, α re-solved
      d = np.stack([v, previous], 1)
      m, b = d.T @ curvature_matrix @ d, d.T @ g
      mu = np.clip(np.linalg.solve(m, -b)[1], *adaptive.MOMENTUM_RANGE)
      coefficients = np.array([-(b[0] + m[0, 1] * mu) / m[0, 0], mu])
    expected = coefficients[0] * v + coefficients[1] * previous
    change = g @ expected + 0.5 * expected @ curvature_matrix @ expected
    stats = kfac_optax.stats(state)
    assert bf.relative_error(update, expected) < 1e-3, step
    np.testing.assert_allclose([-stats["learning_rate"], stats["momentum"]],
                               coefficients, rtol=1e-3, atol=1e-6)
    assert float(stats["qmodel_change"]) == pytest.approx(change, rel=1e-3)
    assert change < 0
    # No other step along v and the previous step, μ in its range, does better.
    for perturbation in ([1e-2, 0], [0, 1e-2], [-1e-2, 1e-2], [0, -1e-2]):
      low, high = adaptive.MOMENTUM_RANGE
      if not low <= coefficients[1] + perturbation[1] <= high:
        continue
      other = expected + perturbation[0] * v + perturbation[1] * previous
      assert g @ other + 0.5 * other @ curvature_matrix @ other >= change - 1e-12


def test_fixed_momentum_with_qmodel_learning_rate():
  tx = kfac_optax.kfac(bf.TinyMLP().apply, LOSS, learning_rate=None, momentum=0.5,
                       adaptive_damping=False, **SETTINGS)
  updates, states = run(tx, BATCHES[:2])
  fisher, _ = explicit_fisher(PARAMS, BATCHES[1])
  g = flat64(grads_at(PARAMS, BATCHES[1]))
  v = flat64(curvature().precondition(states[1].curvature, grads_at(PARAMS, BATCHES[1])))
  previous = flat64(updates[0])
  m = fisher + DAMPING * np.eye(len(g))
  alpha = -(g @ v + 0.5 * v @ m @ previous) / (v @ m @ v)
  assert bf.relative_error(updates[1], alpha * v + 0.5 * previous) < 1e-3


def test_zero_momentum_solves_the_learning_rate_along_v_alone():
  """momentum=0 builds the model along v only (no δ_prev tangent): after a
  first step, α is the 1x1 optimum and the update has no δ_prev part."""
  l2 = 1e-3
  tx = kfac_optax.kfac(bf.TinyMLP().apply, LOSS, learning_rate=None, momentum=0.0,
                       adaptive_damping=False, l2_reg=l2, **SETTINGS)
  updates, states = run(tx, BATCHES[:2])
  assert np.any(flat64(updates[0]) != 0)  # a δ_prev the model could have used
  fisher, _ = explicit_fisher(PARAMS, BATCHES[1])
  g = flat64(grads_at(PARAMS, BATCHES[1]))
  v = flat64(curvature().precondition(states[1].curvature, grads_at(PARAMS, BATCHES[1])))
  alpha = -(g @ v) / (v @ (fisher + (DAMPING + l2) * np.eye(len(g))) @ v)
  stats = kfac_optax.stats(states[1])
  assert bf.relative_error(updates[1], alpha * v) < 1e-3
  assert float(stats["momentum"]) == 0
  assert float(stats["qmodel_change"]) == pytest.approx(0.5 * alpha * (g @ v), rel=1e-3)


# --------------------------------------------------------------------------
# Levenberg-Marquardt damping.


@pytest.mark.parametrize("rho, factor", [(0.1, 1 / 0.9**2), (-3.0, 1 / 0.9**2),
                                         (float("nan"), 1 / 0.9**2), (0.5, 1.0),
                                         (0.9, 0.9**2)])
def test_levenberg_marquardt_rule(rho, factor):
  new = adaptive.levenberg_marquardt(jnp.float32(1.0), jnp.float32(rho), 0.9, 2, 1e-3, 10.0)
  assert float(new) == pytest.approx(factor, rel=1e-6)
  assert float(adaptive.levenberg_marquardt(
      jnp.float32(9.9), jnp.float32(rho), 0.9, 2, 1e-3, 10.0)) <= 10.0


def adaptive_run(lr, batches=BATCHES):
  """`run` of kfac with a fixed lr, λ adapted every 2 steps (ω = 0.9²) from 0.1."""
  return run(kfac_optax.kfac(bf.TinyMLP().apply, LOSS, learning_rate=lr, momentum=0.0,
                             norm_constraint=None, adaptive_damping=True, damping_adaptation_interval=2,
                             damping_adaptation_decay=0.9,
                             **{**SETTINGS, "damping": 0.1}), batches)


def test_adaptive_damping_falls_when_the_model_is_accurate():
  # A tiny step: the loss changes as the quadratic model predicts (ρ ≈ 1).
  _, states = adaptive_run(1e-4)
  omega = 0.9**2
  assert float(states[0].rho) == pytest.approx(1.0, abs=0.05)
  # Adapted on step 0, then kept on step 1 (interval 2), adapted on step 2.
  assert float(states[0].damping) == pytest.approx(0.1 * omega, rel=1e-5)
  assert float(states[1].damping) == pytest.approx(0.1 * omega, rel=1e-5)
  assert float(states[1].rho) == pytest.approx(float(states[0].rho), rel=1e-6)
  assert float(states[2].damping) == pytest.approx(0.1 * omega**2, rel=1e-5)


class DropoutMLP(nn.Module):
  noise: float = 0.0  # the std of Gaussian noise from a stream of its own

  @nn.compact
  def __call__(self, x):
    h = nn.Dropout(0.3, deterministic=False)(jnp.tanh(nn.Dense(16)(x)))
    if self.noise:
      h = h + self.noise * jax.random.normal(self.make_rng("noise"), h.shape)
    return nn.Dense(3)(h)  # tiny_problem's classes


@pytest.mark.parametrize("model, gradient_rngs", [
    (DropoutMLP(), lambda key: {"dropout": key}),
    (DropoutMLP(noise=0.3), kfac_optax.model_rngs)], ids=["dropout", "dropout+noise"])
def test_the_gradients_key_as_rng_gives_the_loss_change_the_model_predicts(
    model, gradient_rngs):
  """ρ compares the loss change under K-FAC's noise (drawn from ``rng``) with
  a model built on the user's gradient: the gradient's noise drawn from the
  same key as ``rng`` (``model_rngs`` for streams other than dropout) gives
  ρ ≈ 1 at small steps, another key a ρ well below (the advice of docs/models.md, "How `apply_fn` is called")."""
  params = model.init(jax.random.key(0), BATCH[0])["params"]
  tx = kfac_optax.kfac(model.apply, LOSS, example_batch=BATCH, damping=10.0,
                       damping_adaptation_interval=1)

  @jax.jit
  def step(p, state, key, gradient_key):
    grads = jax.grad(lambda p: LOSS.value(
        model.apply({"params": p}, BATCH[0], rngs=gradient_rngs(gradient_key)),
        BATCH))(p)
    updates, state = tx.update(grads, state, p, batch=BATCH, rng=key)
    return optax.apply_updates(p, updates), state

  def rhos(same_key):
    p, state, found = params, tx.init(params), []
    for i in range(4):
      key = jax.random.key(100 + i)
      p, state = step(p, state, key, key if same_key else jax.random.fold_in(key, 7))
      found.append(float(state.rho))
    return np.array(found)
  np.testing.assert_allclose(rhos(True), 1.0, atol=0.05)
  assert np.mean(rhos(False)) < 0.9


def test_with_a_quadratic_sub_batch_rho_compares_its_examples_losses():
  """ρ divides the sub-batch's loss change by the model's prediction (its
  gradient term the whole batch's, its curvature term the sub-batch's)."""
  size = 2
  tx = kfac_optax.kfac(bf.TinyMLP().apply, LOSS, damping_adaptation_interval=1,
                       quadratic_batch_size=size, **SETTINGS)
  updates, states = run(tx, BATCHES[:1])
  delta = flat64(updates[0])
  fisher, unravel = explicit_fisher(PARAMS, first(BATCHES[0], size))
  g = flat64(grads_at(PARAMS, BATCHES[0]))
  predicted = g @ delta + 0.5 * delta @ fisher @ delta

  def loss_change(batch):
    loss = lambda w: float(LOSS.value(bf.TinyMLP().apply(
        {"params": unravel(w)}, batch[0]), batch))
    flat = flat64(PARAMS)
    return loss(flat + delta) - loss(flat)
  whole = loss_change(BATCHES[0]) / predicted
  sub_batch = loss_change(first(BATCHES[0], size)) / predicted
  assert float(states[0].rho) == pytest.approx(sub_batch, rel=1e-3)
  assert abs(sub_batch - whole) > 0.05  # the two differ: the check can fail


def test_quadratic_batch_size_errors_name_the_setting_and_the_fix():
  with pytest.raises(ValueError, match=(
      "quadratic_batch_size sizes the automatic mode's quadratic model, which a "
      "fixed learning_rate and momentum do not build.\nFix: learning_rate=None")):
    kfac_optax.kfac(bf.TinyMLP().apply, LOSS, learning_rate=0.1,
                    quadratic_batch_size=2, **SETTINGS)
  with pytest.raises(ValueError, match=(
      "quadratic_batch_size must be a positive Python int or None, got 2.0; "
      "with optax.inject_hyperparams, list it in static_args")):
    kfac_optax.kfac(bf.TinyMLP().apply, LOSS, quadratic_batch_size=2.0, **SETTINGS)
  tx = kfac_optax.kfac(bf.TinyMLP().apply, LOSS, quadratic_batch_size=7, **SETTINGS)
  with pytest.raises(ValueError, match=(
      "quadratic_batch_size=7 exceeds the batch size 6.\nFix: "
      "quadratic_batch_size <= 6, or None \\(the whole batch\\).")):
    tx.update(grads_at(PARAMS, BATCH), tx.init(PARAMS), PARAMS, batch=BATCH)


def test_a_failed_step_is_rejected_and_measured_again_until_one_succeeds():
  # lr 5 overshoots on the tiny MLP. Step 0 raises the loss (ρ < 0); steps
  # 1 and 2, at the same params with λ raised, are still predicted to raise
  # it (ρ nan); step 3 succeeds. Each failure is rejected and measured again
  # on the next step although the interval is 2; λ rises by 1/ω each time.
  updates, states = adaptive_run(5.0, batches=BATCHES + BATCHES[:1])
  rhos = [float(s.rho) for s in states]
  assert rhos[0] < 0 and np.isnan(rhos[1]) and np.isnan(rhos[2]), rhos
  assert 0.25 <= rhos[3] <= 0.75, rhos  # measured off-interval, λ kept
  omega = 0.9**2
  for step, exponent in enumerate((1, 2, 3, 3)):
    assert float(states[step].damping) == pytest.approx(0.1 / omega**exponent, rel=1e-5)
  for update, state in zip(updates[:3], states[:3]):
    assert not np.any(flat64(update)) and not np.any(flat64(state.previous_update))
  assert np.any(flat64(updates[3]))


# --------------------------------------------------------------------------
# The quadratic model's safeguards.


def brute_force_coefficients(m, b, learning_rate, momentum):
  """argmin of q(c) = bᵀc + ½ cᵀMc over a fine grid of the free μ in the
  momentum range (α exact given μ), or the fixed coefficients."""
  mus = (np.linspace(*adaptive.MOMENTUM_RANGE, 100_001) if momentum is None
         else np.array([momentum]))
  alphas = (-(b[0] + m[0, 1] * mus) / m[0, 0] if learning_rate is None
            else np.full_like(mus, -learning_rate))
  c = np.stack([alphas, mus])
  q = b @ c + 0.5 * np.einsum("in,ij,jn->n", c, m, c)
  best = np.argmin(q)
  return c[:, best], q[best]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("learning_rate, momentum", [(None, None), (0.3, None),
                                                      (None, 0.5)])
def test_quadratic_coefficients_minimise_over_the_momentum_range(seed, learning_rate,
                                                                   momentum):
  rng = np.random.default_rng(seed)
  d = rng.normal(size=(2, 2))
  m, b = d @ d.T + 0.1 * np.eye(2), rng.normal(size=2)
  b[0] = -abs(b[0])  # vᵀ∇h < 0 along v = -F̂⁻¹g: a descent direction
  alpha, mu, change = adaptive.quadratic_coefficients(
      jnp.asarray(m, jnp.float32), jnp.asarray(b, jnp.float32), learning_rate,
      momentum, jnp.bool_(True))
  expected, q = brute_force_coefficients(m, b, learning_rate, momentum)
  if learning_rate is None and q >= 0:  # not predicted to decrease: not taken
    expected, q = np.zeros(2), 0.0
  np.testing.assert_allclose([alpha, mu], expected, atol=1e-4 * (1 + np.abs(expected).max()))
  assert float(change) == pytest.approx(q, abs=1e-5 * (1 + abs(q)))
  assert adaptive.MOMENTUM_RANGE[0] <= float(mu) <= adaptive.MOMENTUM_RANGE[1]


def test_nearly_parallel_directions_fall_back_to_the_learning_rate_alone():
  # v and p at an angle of 1e-3 under M: det M / (m00 m11) ≈ 1e-6, far below
  # MIN_INDEPENDENCE. The 2x2 solve would give huge opposite coefficients.
  angle = 1e-3
  directions = np.array([[1.0, 0.0], [np.cos(angle), np.sin(angle)]])
  m = directions @ directions.T
  b = directions @ np.array([-1.0, 0.3])
  alpha, mu, change = adaptive.quadratic_coefficients(
      jnp.asarray(m, jnp.float32), jnp.asarray(b, jnp.float32), None, None, jnp.bool_(True))
  assert float(mu) == 0.0
  assert float(alpha) == pytest.approx(-b[0] / m[0, 0], rel=1e-5)
  assert float(change) == pytest.approx(-0.5 * b[0]**2 / m[0, 0], rel=1e-4)


def test_a_non_finite_quadratic_model_takes_no_step():
  m = jnp.array([[jnp.nan, 0.0], [0.0, 1.0]])
  alpha, mu, change = adaptive.quadratic_coefficients(
      m, jnp.array([-1.0, 0.0]), None, None, jnp.bool_(True))
  assert (float(alpha), float(mu), float(change)) == (0.0, 0.0, 0.0)


@dataclasses.dataclass(frozen=True)
class UnboundedCategorical(type(LOSS)):
  """The same loss, declared as one that may be negative."""
  nonnegative = False


def off_schedule_case(loss, l2_reg, change, last_change=None):
  """`kfac_step` settings, a state whose last ρ was good and off the
  measurement interval, and coefficients whose undamped model predicts
  ``change`` for the step α = 1 (``q₀(α) = -bα + α²/2``), as the damped
  one does; the last step's damped model predicted ``last_change``
  (default ``change``)."""
  settings = kfac_step.Settings(
      kfac_optax.Curvature(bf.TinyMLP().apply, loss, BATCH, estimation="empirical"),
      None, None, None, True, 1e-2, 1000, 0.95, 1e-8, math.inf, l2_reg, 0, None)
  state = kfac_step.KFACState(None, None, jnp.array(3), jnp.float32(1e-2),
                              *[jnp.float32(0.0)] * 2, jnp.float32(1.0),
                              jnp.float32(change if last_change is None else last_change),
                              jnp.float32(0.0))
  outputs = bf.TinyMLP().apply({"params": PARAMS}, BATCH[0])
  quadratic = kfac_step._Quadratic(  # pylint: disable=protected-access
      jnp.eye(2), jnp.array([-(0.5 - change), 0.0]), loss.value(outputs, BATCH))
  return settings, state, kfac_step._Coefficients(  # pylint: disable=protected-access
      jnp.float32(1.0), jnp.float32(0.0), jnp.float32(change), quadratic)


def gradient_and_steps():
  """The gradient at PARAMS on BATCH, a step along it that raises the loss
  (3 g) and one that lowers it a little (-1e-3 g)."""
  grads = grads_at(PARAMS, BATCH)
  return (grads, jax.tree.map(lambda g: 3.0 * g, grads),
          jax.tree.map(lambda g: -1e-3 * g, grads))


def adapt_off_schedule(case, step, grads):
  """`kfac_step._adapt_damping` of ``step`` past burn-in in an
  `off_schedule_case`: ``(δ, ρ, λ)``."""
  settings, state, coefficients = case
  return kfac_step._adapt_damping(  # pylint: disable=protected-access
      settings, state, coefficients, jnp.bool_(True), step, state.damping,
      grads, PARAMS, BATCH, {}, None)


@pytest.mark.parametrize("l2_reg", [0.0, 0.1])
def test_a_step_predicted_to_lower_a_nonnegative_loss_below_zero_is_measured(l2_reg):
  """Off its interval, with a good last ρ, a step is measured when the model
  predicts a decrease more than four times the loss (with its L2 term): no
  loss of these can fall below 0, so its ρ is below ¼ whatever happens; it
  is then rejected if the loss rose. A loss that may be negative is not
  checked that way."""
  loss_value = float(LOSS.value(bf.TinyMLP().apply({"params": PARAMS}, BATCH[0]), BATCH))
  objective = loss_value + 0.5 * l2_reg * float(np.sum(flat64(PARAMS) ** 2))
  implausible = kfac_step._implausible  # pylint: disable=protected-access
  for change, expected in [(-4.04 * objective, True), (-3.96 * objective, False)]:
    settings, _, coefficients = off_schedule_case(LOSS, l2_reg, change)
    assert bool(implausible(settings, coefficients, PARAMS)) == expected
  settings, _, coefficients = off_schedule_case(UnboundedCategorical(), l2_reg,
                                               -8 * objective)
  assert not implausible(settings, coefficients, PARAMS)

  grads, uphill, downhill = gradient_and_steps()
  for loss, change, measured in [(LOSS, -8 * objective, True),
                                 (LOSS, -2 * objective, False),
                                 (UnboundedCategorical(), -8 * objective, False)]:
    delta, rho, _ = adapt_off_schedule(off_schedule_case(loss, l2_reg, change),
                                       uphill, grads)
    assert (float(rho) != 1.0) == measured
    assert (not np.any(flat64(delta))) == measured  # ρ < 0: not taken

  # Measured for the check alone, λ rises only with the loss: a step whose
  # loss fell, by far less than predicted (0 <= ρ < ¼), is taken, λ kept.
  for step, rises in [(uphill, True), (downhill, False)]:
    case = off_schedule_case(LOSS, l2_reg, -8 * objective)
    state = case[1]
    delta, rho, damping = adapt_off_schedule(case, step, grads)
    assert (float(rho) < 0) == rises and float(rho) < 0.25
    assert (float(damping) > float(state.damping)) == rises
    assert float(damping) >= float(state.damping)
    assert bool(np.any(flat64(delta))) != rises


def test_a_step_predicted_to_lower_the_loss_far_more_than_the_last_is_measured():
  """Off its interval, with a good last ρ, a solved step is measured when
  its damped model predicts more than four times the last step's decrease
  (here far less than the loss, so `_implausible` stays out): rejected, λ
  raised, if the loss rose; taken, λ kept, if it fell. Fixed coefficients
  (no quadratic model) are never measured for it."""
  change = -0.1
  surprising = kfac_step._surprising  # pylint: disable=protected-access
  grads, uphill, downhill = gradient_and_steps()
  for last, step, measured, rises in [(change / 4.04, uphill, True, True),
                                      (change / 4.04, downhill, True, False),
                                      (change / 3.96, uphill, False, False)]:
    case = off_schedule_case(LOSS, 0.0, change, last)
    settings, state, coefficients = case
    assert bool(surprising(state, coefficients)) == measured
    assert not kfac_step._implausible(  # pylint: disable=protected-access
        settings, coefficients, PARAMS)
    delta, rho, damping = adapt_off_schedule(case, step, grads)
    assert (float(rho) != 1.0) == measured
    assert (float(rho) < 0) == rises
    assert (float(damping) > float(state.damping)) == rises
    assert float(damping) >= float(state.damping)
    assert bool(np.any(flat64(delta))) != rises
  _, state, coefficients = off_schedule_case(LOSS, 0.0, change, change / 10)
  assert not surprising(state, coefficients._replace(quadratic=None))


def test_joint_losses_are_nonnegative_when_every_head_is():
  losses = kfac_optax.losses
  assert losses.softmax_cross_entropy().nonnegative
  assert losses.sigmoid_cross_entropy().nonnegative and losses.squared_error().nonnegative
  assert not losses.diagonal_normal().nonnegative
  assert losses.joint(losses.softmax_cross_entropy(), losses.squared_error()).nonnegative
  assert not losses.joint(losses.softmax_cross_entropy(),
                          losses.diagonal_normal()).nonnegative


# --------------------------------------------------------------------------
# Burn-in, l2_reg, stats and jit/inject_hyperparams.


def test_burnin_gathers_statistics_without_moving():
  tx = kfac_optax.kfac(bf.TinyMLP().apply, LOSS, learning_rate=0.1,
                       num_burnin_steps=2, **SETTINGS)
  updates, states = run(tx)
  assert all(np.all(np.asarray(leaf) == 0) for u in updates[:2] for leaf in jax.tree.leaves(u))
  assert int(states[1].curvature.stats_count) == 2
  assert np.any(flat64(updates[2]) != 0)


def test_a_warmup_from_zero_moves_nothing_then_the_scheduled_step():
  # optax's usual warmup starts at 0; without momentum the step after it is
  # the constant learning rate's step (same statistics, same inverses).
  make = lambda lr: kfac_optax.kfac(bf.TinyMLP().apply, LOSS, learning_rate=lr,
                                    momentum=0.0, **SETTINGS)
  warm, _ = run(make(optax.linear_schedule(0.0, 0.1, transition_steps=1)))
  constant, _ = run(make(0.1))
  assert all(np.all(np.asarray(leaf) == 0) for leaf in jax.tree.leaves(warm[0]))
  assert np.any(flat64(warm[1]) != 0)
  assert bf.relative_error(warm[1], jax.tree.map(np.asarray, constant[1])) < 1e-6


def test_l2_reg_is_added_to_the_damping():
  with_l2 = kfac_optax.kfac(bf.TinyMLP().apply, LOSS, learning_rate=0.1, l2_reg=0.05,
                            **SETTINGS)
  shifted = kfac_optax.kfac(bf.TinyMLP().apply, LOSS, learning_rate=0.1,
                            **{**SETTINGS, "damping": DAMPING + 0.05})
  plain = kfac_optax.kfac(bf.TinyMLP().apply, LOSS, learning_rate=0.1, **SETTINGS)
  a, b, c = (run(tx)[0][-1] for tx in (with_l2, shifted, plain))
  assert bf.relative_error(a, jax.tree.map(np.asarray, b)) < 1e-5
  assert bf.relative_error(a, jax.tree.map(np.asarray, c)) > 1e-3


def test_with_l2_reg_rho_measures_the_loss_with_its_l2_term():
  """A linear model under squared error plus η/2 ‖θ‖² is exactly quadratic,
  with Hessian G + ηI: the undamped model is exact, so ρ = 1 (before, the
  L2 term was in the prediction but not in the measured change). In float64,
  so that the third step's change (1.6e-6) is far above round-off: in float32
  ρ came out 1.0029 there on one machine, and under x64 the losses computed
  in float32 until they kept float64 outputs (ρ 0.9979)."""
  with jax.enable_x64(True):
    eta, model = 0.5, nn.Dense(2)
    x, y = (jax.random.normal(jax.random.key(k), (8, n), jnp.float64)
            for k, n in ((0, 3), (1, 2)))
    batch, loss = (x, y), kfac_optax.losses.squared_error()
    params = jax.tree.map(lambda p: p.astype(jnp.float64),
                          model.init(jax.random.key(2), x)["params"])
    tx = kfac_optax.kfac(model.apply, loss, example_batch=batch, l2_reg=eta,
                         estimation="exact", damping_adaptation_interval=1,
                         damping=1e-2)

    @jax.jit
    def step(p, state):
      grads = jax.grad(lambda p: loss.value(model.apply({"params": p}, x), batch)
                       + 0.5 * eta * sum(jnp.sum(jnp.square(a))
                                         for a in jax.tree.leaves(p)))(p)
      updates, state = tx.update(grads, state, p, batch=batch)
      return optax.apply_updates(p, updates), state
    state = tx.init(params)
    for _ in range(3):
      params, state = step(params, state)
      assert float(state.rho) == pytest.approx(1.0, abs=1e-5)


def test_stats_of_kfac_train_state_and_of_a_chain():
  tx = kfac_optax.kfac(bf.TinyMLP().apply, LOSS, learning_rate=0.1, momentum=0.9,
                       norm_constraint=None, **SETTINGS)
  train_state = kfac_optax.TrainState.create(apply_fn=bf.TinyMLP().apply, params=PARAMS,
                                             tx=tx)
  train_state = jax.jit(lambda s: s.apply_gradients(
      grads=grads_at(PARAMS, BATCH), batch=BATCH))(train_state)
  stats = jax.jit(kfac_optax.stats)(train_state)
  assert set(stats) == {"damping", "requested_damping", "learning_rate", "momentum",
                        "rho", "qmodel_change", "fisher_norm", "rejected_statistics",
                        "rejected_refreshes", "rescaled_updates"}
  assert float(stats["damping"]) == pytest.approx(DAMPING)
  assert float(stats["requested_damping"]) == pytest.approx(DAMPING)
  assert float(stats["learning_rate"]) == pytest.approx(0.1)
  assert float(stats["momentum"]) == pytest.approx(0.9)
  assert float(stats["rho"]) == 0 and float(stats["fisher_norm"]) > 0
  # Nothing measured is a placeholder that a finite-state check would flag.
  assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(train_state))

  chain = optax.chain(kfac_optax.scale_by_kfac(bf.TinyMLP().apply, LOSS, **SETTINGS),
                      optax.sgd(0.1))
  _, (state,) = run(chain, BATCHES[:1])
  chain_stats = kfac_optax.stats(state)
  assert float(chain_stats["damping"]) == pytest.approx(DAMPING)
  assert np.isnan(chain_stats["learning_rate"])
  with pytest.raises(ValueError, match="no kfac"):
    kfac_optax.stats(optax.adam(0.1).init(PARAMS))


def test_adaptive_modes_under_inject_hyperparams():
  tx = optax.inject_hyperparams(kfac_optax.kfac, static_args=("apply_fn", "num_samples"))(
      bf.TinyMLP().apply, LOSS, learning_rate=None, momentum=None,
      adaptive_damping=True, damping_adaptation_interval=1, **SETTINGS)
  updates, states = run(tx)
  assert all(np.all(np.isfinite(flat64(u))) for u in updates)
  assert float(kfac_optax.stats(states[-1])["damping"]) != DAMPING


def test_adaptive_kfac_inside_a_chain_with_random_estimation():
  tx = optax.chain(optax.clip_by_global_norm(10.0), kfac_optax.kfac(
      bf.TinyMLP().apply, LOSS, learning_rate=None, momentum=None,
      adaptive_damping=True, damping_adaptation_interval=1,
      **{**SETTINGS, "estimation": "curvature_prop"}))
  update = jax.jit(lambda g, s, b, k: tx.update(g, s, PARAMS, batch=b, rng=k))
  state = tx.init(PARAMS)
  for seed, batch in enumerate(BATCHES):
    out, state = update(grads_at(PARAMS, batch), state, batch, jax.random.key(seed))
  stats = kfac_optax.stats(state)
  assert np.all(np.isfinite(flat64(out)))
  assert float(stats["qmodel_change"]) < 0 and np.isfinite(stats["rho"])


def test_bad_combinations_are_rejected():
  with pytest.raises(ValueError, match="norm_constraint"):
    kfac_optax.kfac(bf.TinyMLP().apply, LOSS, learning_rate=None, norm_constraint=1.0,
                    **SETTINGS)
  with pytest.raises(ValueError, match="schedule"):
    kfac_optax.kfac(bf.TinyMLP().apply, LOSS, learning_rate=0.1, adaptive_damping=True,
                    **{**SETTINGS, "damping": lambda t: 0.1})


# --------------------------------------------------------------------------
# The two models of the stability suite whose automatic mode diverged (NaN by step 12
# and by step 7, momentum -17.7 and -3e8) before the safeguards.


@pytest.mark.parametrize("name", ["cnn_bn_dropout", "self_attention"])
def test_automatic_mode_trains_the_formerly_divergent_models(name):
  from benchmarks import stability_problems  # pylint: disable=import-outside-toplevel
  problem = stability_problems.make_problem(name)
  state, losses = stability_problems.train(problem, problem.kfac(), 300)
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-20:]) < 0.2 * np.mean(losses[:5])
  stats = kfac_optax.stats(state.opt_state)
  lo, hi = adaptive.MOMENTUM_RANGE
  assert lo <= float(stats["momentum"]) <= hi
