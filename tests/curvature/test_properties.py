"""Property: over Dense and Conv shapes, batch sizes, damping, EMA decay and
update periods, the preconditioned gradient equals a float64 brute force
(explicit rows from the layer's Jacobian, np.kron, np.linalg.solve) within
a tolerance scaled by the condition number of the damped Kronecker product.

One layer is the whole model (its flattened output is the logits), so the
output gradient of example n is ``softmax(f_n) - e_{y_n}`` (empirical).
Shapes come from a small set and everything else is a traced argument of
one jitted step, so few distinct programs are compiled.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

import kfac_optax
from tests import brute_force as bf

LOSS = kfac_optax.losses.softmax_cross_entropy()
STEPS = 3
EPS32 = float(np.finfo(np.float32).eps)


class Flat(nn.Module):
  """One layer whose flattened output is the logits."""
  layer: nn.Module

  @nn.compact
  def __call__(self, x):
    return self.layer(x).reshape(x.shape[0], -1)


LAYERS = {
    "dense": [nn.Dense(3), nn.Dense(2, use_bias=False)],
    "conv": [nn.Conv(2, (2, 2), padding="VALID"),
             nn.Conv(1, (2, 1), padding="SAME", use_bias=False)],
}
INPUTS = {"dense": [(2,), (4,)], "conv": [(3, 3, 1), (3, 2, 2)]}


def curvature(model, example, ema_decay, stats_period, inverse_period):
  return kfac_optax.Curvature(model.apply, LOSS, example_batch=example,
                              estimation="empirical", ema_decay=ema_decay,
                              stats_update_period=stats_period,
                              inverse_update_period=inverse_period)


@functools.partial(jax.jit, static_argnums=0)
def step(model, state, params, batch, grads, damping, ema, stats_period, inverse_period):
  # The settings are traced: one program per model and shape.
  example = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
  curv = curvature(model, example, ema, stats_period, inverse_period)
  state = curv.update(state, params, batch=batch, damping=damping)
  return curv.precondition(state, grads), state


def reference_rows(model, params, x, y):
  """Rows ``ā`` (R, d[+1]), output-gradient rows (R, o), from autodiff alone."""
  kernel = params["layer"]["kernel"]
  out = lambda k: model.apply({"params": {**params, "layer": {**params["layer"],
                                                              "kernel": k}}}, x)
  o = kernel.shape[-1]
  # The output is linear in the kernel: its Jacobian at output channel 0
  # holds the input row (im2col patch) of every output location.
  jac = np.asarray(jax.jacobian(out)(kernel), np.float64)
  rows = jac.reshape(-1, o, kernel.size // o, o)[:, 0, :, 0]
  logits = np.asarray(model.apply({"params": params}, x), np.float64)
  g = bf.softmax(logits) - np.eye(logits.shape[1])[np.asarray(y)]
  if "bias" in params["layer"]:
    rows = np.concatenate([rows, np.ones((len(rows), 1))], 1)
  return rows, g.reshape(-1, o)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(kind=st.sampled_from(sorted(LAYERS)), layer=st.integers(0, 1),
       shape=st.integers(0, 1), batch_size=st.sampled_from([1, 3]),
       log_damping=st.floats(-4, 0), ema=st.sampled_from([0.0, 0.5, 0.9]),
       stats_period=st.integers(1, 2), inverse_period=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_preconditioned_gradient_matches_brute_force(
    kind, layer, shape, batch_size, log_damping, ema, stats_period, inverse_period,
    seed):
  model, damping = Flat(LAYERS[kind][layer]), 10.0 ** log_damping
  rng = np.random.default_rng(seed)
  xs = [jnp.asarray(rng.normal(size=(batch_size, *INPUTS[kind][shape])), jnp.float32)
        for _ in range(STEPS)]
  params = model.init(jax.random.key(seed), xs[0])["params"]
  classes = model.apply({"params": params}, xs[0]).shape[1]
  ys = [jnp.asarray(rng.integers(0, classes, batch_size), jnp.int32) for _ in xs]
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32),
                       params)
  state = curvature(model, (xs[0], ys[0]), ema, 1, 1).init(params)
  for x, y in zip(xs, ys):
    out, state = step(model, state, params, (x, y), grads, damping, ema,
                      stats_period, inverse_period)

  # Brute force: the debiased EMA of the statistics folded in up to the last
  # refresh, the damped Kronecker product formed and solved in float64.
  refresh = max(t for t in range(STEPS) if t % inverse_period == 0)
  a = g = 0.0
  weight = 0.0
  for t in range(refresh + 1):
    if t % stats_period == 0:
      rows, out_rows = reference_rows(model, params, xs[t], ys[t])
      weight = weight * ema + 1.0
      a = ema * a + rows.T @ rows / len(rows)
      g = ema * g + out_rows.T @ out_rows / batch_size
  a, g = a / weight, g / weight
  layer_grads = grads["layer"]
  expected = bf.kronecker_precondition(
      a, g, layer_grads["kernel"].reshape(-1, g.shape[0]), layer_grads.get("bias"),
      damping)
  expected["kernel"] = expected["kernel"].reshape(layer_grads["kernel"].shape)

  da, dg = bf.pi_damping(a, g, damping)
  condition = (np.linalg.cond(a + da * np.eye(len(a)))
               * np.linalg.cond(g + dg * np.eye(len(g))))
  # float32 statistics, inverses and products perturb the damped product by
  # a few eps32 (relative); a solve amplifies that by at most its condition
  # number (measured: at most 0.1 of this bound, at κ from 1 to 2e4).
  tolerance = 16 * EPS32 * condition
  assert bf.relative_error(out["layer"], expected) < tolerance
