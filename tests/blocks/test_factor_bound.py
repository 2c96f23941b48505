"""Diagonal Kronecker factors (``diag(A) ⊗ G``, ``A ⊗ diag(G)``) against brute force.

A dense or conv layer whose factor exceeds ``max_factor_dim`` (or that
``layer_overrides`` gives a ``kron_*_diag`` choice) keeps that factor as its
diagonal. The reference takes the full factors from explicit per-example
Jacobians (tests/brute_force.py) or explicit im2col patches, replaces the
chosen factor by ``diag(diag(·))``, and solves with ``np.kron``.
"""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_optax
from tests import brute_force as bf
from tests.models import test_lifted

LOSS = kfac_optax.losses.softmax_cross_entropy()
DAMPING = 1e-2
DENSE_OVERRIDES = {"hidden": "kron_in_diag", "nobias": "kron_out_diag",
                   "out": "kron_both_diag"}
DIAGONAL = {"kron": (False, False), "kron_in_diag": (True, False),
            "kron_out_diag": (False, True), "kron_both_diag": (True, True)}


def keep_diagonal(matrix, diagonal):
  return np.diag(np.diag(matrix)) if diagonal else matrix


def expected_factors(full, choices):
  """The full brute-force factors with the chosen ones cut to their diagonal."""
  return {name: tuple(keep_diagonal(f, d) for f, d in zip(full[name], DIAGONAL[choice]))
          for name, choice in choices.items()}


def stored(factor, diagonal):
  """A factor as the state keeps it: (1, d) diagonal or (1, d, d), float64."""
  return np.diag(factor)[None] if diagonal else factor[None]


@functools.lru_cache(maxsize=None)
def dense_run(inverse, sharded):
  """Factors, F̂⁻¹g, F̂v, (F̂+λ)^-½ twice and their inputs for the tiny MLP."""
  params, batch = bf.tiny_problem(n=8)
  mesh = (jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
          if sharded else None)
  curvature = kfac_optax.Curvature(
      bf.TinyMLP().apply, LOSS, example_batch=batch, estimation="exact",
      inverse=inverse, layer_overrides=DENSE_OVERRIDES, mesh=mesh)
  rng = np.random.default_rng(0)
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32),
                       params)

  @jax.jit
  def run(params, batch, grads):
    state = curvature.update(curvature.init(params), params, batch=batch,
                             damping=DAMPING)
    half = curvature.multiply(state, grads, power=-0.5, damping=DAMPING)
    return (state.factors, curvature.precondition(state, grads),
            curvature.multiply(state, grads, power=1),
            curvature.multiply(state, half, power=-0.5, damping=DAMPING))
  return params, batch, grads, jax.tree.map(np.asarray, run(params, batch, grads))


@pytest.mark.parametrize("inverse,sharded", [("eigh", False), ("cholesky", True)])
def test_dense_diagonal_factors_match_brute_force(inverse, sharded):
  params, batch, grads, (factors, update, fv, inverse_twice) = dense_run(inverse, sharded)
  expected = expected_factors(bf.factors(params, batch, "exact"), DENSE_OVERRIDES)
  for name, choice in DENSE_OVERRIDES.items():
    diagonal_a, diagonal_g = DIAGONAL[choice]
    a, g = expected[name]
    assert bf.relative_error(factors[name].a, stored(a, diagonal_a)) < 1e-4
    assert bf.relative_error(factors[name].g, stored(g, diagonal_g)) < 1e-4
  solved = bf.precondition(expected, grads, DAMPING)
  assert bf.relative_error(update, solved) < 1e-3
  # Powers: F̂ itself (no damping) and (F̂+λ)^-½ applied twice = (F̂+λ)⁻¹.
  assert bf.relative_error(inverse_twice, solved) < 1e-3
  for name in DENSE_OVERRIDES:
    v = np.asarray(grads[name]["kernel"], np.float64)
    if "bias" in grads[name]:
      v = np.concatenate([v, np.asarray(grads[name]["bias"], np.float64)[None]])
    product = (np.kron(*expected[name]) @ v.reshape(-1)).reshape(v.shape)
    got = fv[name]["kernel"]
    if "bias" in grads[name]:
      got = np.concatenate([got, fv[name]["bias"][None]])
    assert bf.relative_error(got, product) < 1e-4


def test_max_factor_dim_picks_the_diagonal_factors():
  """TinyMLP: hidden 5+1 → 4, nobias 4 → 3, out 3+1 → 3; bound 3 and 4.

  The bound is on the layer's widths: a bias's extra row of A does not count
  (out's A is 4×4 under the bound 3)."""
  params, batch = bf.tiny_problem()
  shapes = {}
  for bound in (3, 4, None):
    tx = kfac_optax.scale_by_kfac(bf.TinyMLP().apply, LOSS, example_batch=batch,
                                  max_factor_dim=bound)
    factors = jax.eval_shape(tx.init, params).factors
    shapes[bound] = {name: (factors[name].a.shape, factors[name].g.shape)
                     for name in bf.LAYERS}
  assert shapes[3] == {"hidden": ((1, 6), (1, 4)), "nobias": ((1, 4), (1, 3, 3)),
                       "out": ((1, 4, 4), (1, 3, 3))}
  assert shapes[4] == {"hidden": ((1, 6), (1, 4, 4)), "nobias": ((1, 4, 4), (1, 3, 3)),
                       "out": ((1, 4, 4), (1, 3, 3))}
  assert shapes[None]["hidden"] == ((1, 6, 6), (1, 4, 4))


def test_a_layer_fed_by_a_4096_wide_one_keeps_its_input_factor():
  """VGG's fc8 under the default bound: 4096 inputs and a bias make a 4097²
  input factor, kept whole; 4097 inputs make it diagonal (shapes only)."""
  shapes = {}
  for width in (4096, 4097):
    x = jax.ShapeDtypeStruct((2, width), jnp.float32)
    params = jax.eval_shape(nn.Dense(10).init, jax.random.key(0), x)["params"]
    tx = kfac_optax.scale_by_kfac(nn.Dense(10).apply, LOSS,
                                  example_batch=(x, jnp.zeros((2,), jnp.int32)))
    shapes[width] = jax.eval_shape(tx.init, params).factors[""].a.shape
  assert shapes == {4096: (1, 4097, 4097), 4097: (1, 4098)}


def test_kron_override_ignores_the_bound():
  params, batch = bf.tiny_problem()
  tx = kfac_optax.scale_by_kfac(bf.TinyMLP().apply, LOSS, example_batch=batch,
                                max_factor_dim=2, layer_overrides={"hidden": "kron"})
  factors = jax.eval_shape(tx.init, params).factors
  assert factors["hidden"].a.shape == (1, 6, 6)
  assert factors["out"].a.shape == (1, 4)


class TwoConvs(nn.Module):
  """x -> [Conv_a(2x2) | Conv_b(2x2, no bias)] -> tanh -> Dense(3)."""

  @nn.compact
  def __call__(self, x):
    h = [jnp.tanh(nn.Conv(3, (2, 2), padding="VALID", name="conv_a")(x)),
         jnp.tanh(nn.Conv(3, (2, 2), padding="VALID", use_bias=False,
                          name="conv_b")(x))]
    return nn.Dense(3, name="head")(jnp.concatenate(h, -1).reshape(x.shape[0], -1))


def conv_reference(params, x, y):
  """Per conv: (im2col rows with their bias 1s, output-gradient rows), float64.

  Output gradients of the summed NLL come from autodiff through the written-
  out model with a zero perturbation on each conv output.
  """
  def summed_nll(perturbations):
    h = [jnp.tanh(nn.Conv(3, (2, 2), padding="VALID", use_bias=name == "conv_a")
                  .apply({"params": params[name]}, x) + perturbations[name])
         for name in ("conv_a", "conv_b")]
    logits = (jnp.concatenate(h, -1).reshape(x.shape[0], -1) @ params["head"]["kernel"]
              + params["head"]["bias"])
    log_p = jax.nn.log_softmax(logits)
    return -jnp.sum(jnp.take_along_axis(log_p, y[:, None], axis=-1))
  zeros = {name: jnp.zeros((x.shape[0], 3, 3, 3)) for name in ("conv_a", "conv_b")}
  output_grads = jax.grad(summed_nll)(zeros)
  x64 = np.asarray(x, np.float64)
  patches = np.stack([x64[:, i:i + 2, j:j + 2, :].reshape(len(x64), -1)
                      for i in range(3) for j in range(3)], 1).reshape(-1, 8)
  with_bias = np.concatenate([patches, np.ones((len(patches), 1))], 1)
  return {"conv_a": (with_bias, np.asarray(output_grads["conv_a"], np.float64).reshape(-1, 3)),
          "conv_b": (patches, np.asarray(output_grads["conv_b"], np.float64).reshape(-1, 3))}


def test_conv_diagonal_factors_match_brute_force():
  choices = {"conv_a": "kron_in_diag", "conv_b": "kron_out_diag"}
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(4, 4, 4, 2)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 3, 4), jnp.int32)
  params = TwoConvs().init(jax.random.key(0), x)["params"]
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32),
                       params)
  tx = kfac_optax.scale_by_kfac(TwoConvs().apply, LOSS, example_batch=(x, y),
                                estimation="empirical", inverse_update_period=1,
                                damping=DAMPING, layer_overrides=choices)
  updates, state = jax.jit(lambda g, p: tx.update(g, tx.init(p), p, batch=(x, y)))(
      grads, params)
  for name, (rows, out_rows) in conv_reference(params, x, y).items():
    diagonal_a, diagonal_g = DIAGONAL[choices[name]]
    a = keep_diagonal(rows.T @ rows / len(rows), diagonal_a)
    g = keep_diagonal(out_rows.T @ out_rows / len(x), diagonal_g)  # L = 4 examples
    assert bf.relative_error(state.factors[name].a, stored(a, diagonal_a)) < 1e-4
    assert bf.relative_error(state.factors[name].g, stored(g, diagonal_g)) < 1e-4
    kernel_grad = np.asarray(grads[name]["kernel"], np.float64).reshape(8, 3)
    solved = bf.kronecker_precondition(a, g, kernel_grad, grads[name].get("bias"),
                                       DAMPING)
    solved["kernel"] = solved["kernel"].reshape(2, 2, 2, 3)
    assert bf.relative_error(updates[name], solved) < 1e-3


def test_kron_choice_for_a_norm_layer_is_an_error():
  class Normed(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3, name="out")(nn.LayerNorm(name="norm")(x))
  params, batch = bf.tiny_problem()
  model = Normed()
  params = model.init(jax.random.key(0), batch[0])["params"]
  tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=batch,
                                layer_overrides={"*": "kron_in_diag"})
  with pytest.raises(ValueError, match=r"layer_overrides value 'kron_in_diag' is "
                     r"for dense and conv layers \(Kronecker blocks\), but it "
                     r"matched a layer with a NormLayout"):
    tx.init(params)


@pytest.mark.parametrize("value", [0, 2.5, True, "4096", jnp.asarray(64)])
def test_max_factor_dim_must_be_a_positive_int(value):
  _, batch = bf.tiny_problem()
  with pytest.raises(ValueError, match=r"max_factor_dim must be a positive Python "
                     r'int, None \(no bound\) or "auto" \(4096\), got '
                     rf"{re.escape(repr(value))}; with optax.inject_hyperparams, "
                     r"list it in static_args"):
    kfac_optax.scale_by_kfac(bf.TinyMLP().apply, LOSS, example_batch=batch,
                             max_factor_dim=value)


def test_scanned_stack_with_diagonal_factors_matches_unrolled_layers():
  """nn.scan: each layer's diag(A) ⊗ diag(G) block equals its unrolled twin's."""
  x = jax.random.normal(jax.random.key(0), (6, 2))
  y = jnp.arange(6) % 3
  params = test_lifted.scanned_net(test_lifted.THREADED).init(jax.random.key(1), x)["params"]
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(2), p.shape), params)
  unroll = lambda tree: {**{k: v for k, v in tree.items() if k != "stack"},
                         **{f"layer{i}": jax.tree.map(lambda a, i=i: a[i], tree["stack"])
                            for i in range(3)}}

  def run(net, p, g):
    tx = kfac_optax.scale_by_kfac(net.apply, LOSS, example_batch=(x, y),
                                  estimation="empirical", damping=DAMPING,
                                  max_factor_dim=3)
    return jax.jit(lambda: tx.update(g, tx.init(p), p, batch=(x, y)))()

  out, state = run(test_lifted.scanned_net(test_lifted.THREADED), params, grads)
  expected_out, expected = run(test_lifted.Unrolled(), unroll(params), unroll(grads))
  assert state.factors["stack/dense"].a.shape == (3, 1, 5)  # 4 inputs > 3
  assert state.factors["stack/dense"].g.shape == (3, 1, 4)  # 4 outputs > 3
  assert bf.relative_error(unroll(out), expected_out) < 1e-4
