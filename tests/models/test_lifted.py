"""Layers under flax lifted transforms: nn.scan, nn.remat, nn.RNN."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_optax
from kfac_optax._src.models import capture
from tests import brute_force as bf

LOSS = kfac_optax.losses.softmax_cross_entropy()
THREADED = {"params": 0, "kfac_inputs": 0, "kfac_perturbations": 0}


class Layer(nn.Module):

  @nn.compact
  def __call__(self, h, _):
    return jnp.tanh(nn.LayerNorm(name="norm")(nn.Dense(4, name="dense")(h))), None


def scanned_net(variable_axes):
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(4, name="embed")(x)
      h, _ = nn.scan(Layer, variable_axes=variable_axes,
                     split_rngs={"params": True}, length=3)(name="stack")(h, None)
      h = nn.remat(nn.Dense)(4, name="rematted")(h)
      return nn.Dense(3, name="head")(h)
  return Net()


class Unrolled(nn.Module):
  """The same network with the three scanned layers written out."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4, name="embed")(x)
    for i in range(3):
      h, _ = Layer(name=f"layer{i}")(h, None)
    return nn.Dense(3, name="head")(nn.Dense(4, name="rematted")(h))


def test_scanned_layer_stack_gets_one_block_per_layer():
  x = jax.random.normal(jax.random.key(0), (6, 2))
  y = jnp.arange(6) % 3
  model = scanned_net(THREADED)
  params = model.init(jax.random.key(1), x)["params"]
  unrolled = {**{k: v for k, v in params.items() if k != "stack"},
              **{f"layer{i}": jax.tree.map(lambda a, i=i: a[i], params["stack"])
                 for i in range(3)}}
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(2), p.shape), params)
  unrolled_grads = {**{k: v for k, v in grads.items() if k != "stack"},
                    **{f"layer{i}": jax.tree.map(lambda a, i=i: a[i], grads["stack"])
                       for i in range(3)}}

  def run(net, p, g):
    tx = kfac_optax.scale_by_kfac(net.apply, LOSS, example_batch=(x, y),
                                  estimation="empirical", damping=1e-2)
    return jax.jit(lambda s: tx.update(g, s, p, batch=(x, y)))(tx.init(p))

  out, state = run(model, params, grads)
  expected_out, expected = run(Unrolled(), unrolled, unrolled_grads)
  assert state.factors["stack/dense"].a.shape == (3, 1, 5, 5)
  for i in range(3):
    for block in ("dense", "norm"):
      actual = jax.tree.map(lambda a, i=i: a[i], state.factors[f"stack/{block}"])
      assert bf.relative_error(actual, expected.factors[f"layer{i}/{block}"]) < 1e-5
    actual_out = jax.tree.map(lambda a, i=i: a[i], out["stack"])
    assert bf.relative_error(actual_out, expected_out[f"layer{i}"]) < 1e-4
  assert bf.relative_error(state.factors["rematted"], expected.factors["rematted"]) < 1e-5
  assert "<diagonal>" not in state.factors


@pytest.mark.parametrize("carried", [(), ("kfac_inputs",), ("kfac_perturbations",)],
                         ids=["neither", "inputs only", "perturbations only"])
def test_scan_without_kfac_collections_names_the_fix(carried):
  x = jax.random.normal(jax.random.key(0), (6, 2))
  y = jnp.arange(6) % 3
  model = scanned_net({"params": 0, **dict.fromkeys(carried, 0)})
  params = model.init(jax.random.key(1), x)["params"]
  tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=(x, y))
  with pytest.raises(ValueError, match=r"'stack/dense'.*'kfac_inputs': 0, "
                                       r"'kfac_perturbations': 0"):
    tx.init(params)


def test_rnn_cell_steps_count_as_rows():
  """nn.RNN broadcasts the cell's params over time: every step is a row."""
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.RNN(nn.SimpleCell(4, name="cell"), name="rnn",
                 variable_axes={"kfac_inputs": 0, "kfac_perturbations": 0})(x)
      return nn.Dense(3, name="head")(h[:, -1])

  x = jax.random.normal(jax.random.key(0), (5, 7, 2))  # (batch, time, features)
  y = jnp.arange(5) % 3
  model = Net()
  params = model.init(jax.random.key(1), x)["params"]
  tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=(x, y),
                                estimation="empirical")
  _, state = tx.update(params, tx.init(params), params, batch=(x, y))
  assert set(state.factors) == {"cell/i", "cell/h", "head"}
  # The cell's input projection sees x at every time step: A over 5 x 7 rows.
  rows = np.asarray(x, np.float64).reshape(-1, 2)
  rows = np.concatenate([rows, np.ones((35, 1))], 1)
  # Within a few float32 ulps of the largest entry (off-diagonal sums cancel).
  expected = rows.T @ rows / 35
  np.testing.assert_allclose(state.factors["cell/i"].a[0], expected, rtol=0,
                             atol=1e-5 * np.abs(expected).max())


def test_unthreaded_scan_layers_can_take_the_diagonal_block():
  x = jax.random.normal(jax.random.key(0), (6, 2))
  y = jnp.arange(6) % 3
  model = scanned_net({"params": 0})
  params = model.init(jax.random.key(1), x)["params"]
  unthreaded = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=(x, y))
  with pytest.raises(ValueError, match="inside a flax lifted transform") as error:
    unthreaded.init(params)
  # The advice names a pattern for every layer under the transform.
  assert "layer_overrides={'stack/*': 'diagonal'}" in str(error.value)
  tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=(x, y),
                                layer_overrides={"stack/*": "diagonal"})
  _, state = tx.update(params, tx.init(params), params, batch=(x, y),
                       rng=jax.random.key(2))
  assert set(state.factors["<diagonal>"]) == {
      "stack/dense/kernel", "stack/dense/bias", "stack/norm/scale", "stack/norm/bias"}


class SharedOverTime(nn.Module):
  """An LSTM scanned over time with its weights shared, as Flax's sst2
  example writes it; ``variable_axes`` for K-FAC's collections."""
  variable_axes: dict

  @nn.compact
  def __call__(self, x):
    cell = nn.scan(nn.OptimizedLSTMCell, variable_broadcast="params",
                   variable_axes=self.variable_axes, split_rngs={"params": False},
                   in_axes=1, out_axes=1)(4, name="lstm")
    carry = nn.OptimizedLSTMCell(4, parent=None).initialize_carry(
        jax.random.key(0), x[:, 0].shape)
    _, h = cell(carry, x)
    return nn.Dense(3, name="head")(h[:, -1])


def test_the_advice_for_weights_shared_over_a_scan_makes_them_blocks():
  x = jax.random.normal(jax.random.key(0), (6, 5, 2))
  batch = (x, jnp.arange(6) % 3)
  params = SharedOverTime({}).init(jax.random.key(1), x)["params"]
  unthreaded = kfac_optax.scale_by_kfac(SharedOverTime({}).apply, LOSS,
                                        example_batch=batch)
  with pytest.raises(ValueError, match="inside a flax lifted transform") as error:
    unthreaded.init(params)
  advice = ("for weights shared over a scan's steps nn.scan(..., "
            "variable_broadcast='params', variable_axes={'kfac_inputs': 0, "
            "'kfac_perturbations': 0})")
  assert advice in str(error.value)
  model = SharedOverTime({"kfac_inputs": 0, "kfac_perturbations": 0})
  tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=batch)
  state = tx.init(params)
  assert set(state.factors) == {"lstm/ii", "lstm/if", "lstm/ig", "lstm/io",
                                "lstm/hi", "lstm/hf", "lstm/hg", "lstm/ho", "head"}


class Bidirectional(nn.Module):
  """Two LSTMs scanned as Flax's sst2 example does, neither threaded."""

  @nn.compact
  def __call__(self, x):
    outputs = [SharedOverTime({}, name=name)(x) for name in ("forward", "backward")]
    return outputs[0] + outputs[1]


def test_every_unthreaded_transform_is_named_at_once():
  x = jax.random.normal(jax.random.key(0), (6, 5, 2))
  params = Bidirectional().init(jax.random.key(1), x)["params"]
  tx = kfac_optax.scale_by_kfac(Bidirectional().apply, LOSS,
                                example_batch=(x, jnp.arange(6) % 3))
  with pytest.raises(ValueError, match="the layers at 'forward/lstm/ii', ") as error:
    tx.init(params)
  assert ("layer_overrides={'forward/lstm/*': 'diagonal', 'backward/lstm/*': "
          "'diagonal'}") in str(error.value)
  kfac_optax.scale_by_kfac(
      Bidirectional().apply, LOSS, example_batch=(x, jnp.arange(6) % 3),
      layer_overrides={"forward/lstm/*": "diagonal", "backward/lstm/*": "diagonal"},
  ).init(params)


def test_a_pattern_covered_by_another_is_not_repeated():
  """Flax's seq2seq decoder cell holds an LSTMCell of its own: "d/*" covers
  "d/cell/*" (fnmatch's "*" spans "/")."""
  error = capture.not_threaded_error(
      [("cell", "ii"), ("d", "cell", "ii"), ("d", "dense")])
  assert "layer_overrides={'cell/*': 'diagonal', 'd/*': 'diagonal'}" in str(error)


class Member(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, name="out")(jnp.tanh(nn.Dense(4, name="hidden")(x)))


def test_vmapped_ensemble_gets_one_block_per_member():
  """nn.vmap over stacked params: each member is its own block, as if alone."""
  ensemble = nn.vmap(Member, in_axes=0, out_axes=0, axis_size=2,
                     variable_axes=THREADED, split_rngs={"params": True})()
  x = jax.random.normal(jax.random.key(0), (2, 6, 5))  # (member, batch, features)
  y = jnp.stack([jnp.arange(6) % 3, (jnp.arange(6) + 1) % 3])
  params = ensemble.init(jax.random.key(1), x)["params"]
  tx = kfac_optax.scale_by_kfac(ensemble.apply, LOSS, example_batch=(x, y),
                                estimation="empirical")
  _, state = tx.update(params, tx.init(params), params, batch=(x, y))
  assert state.factors["hidden"].a.shape == (2, 1, 6, 6)
  for member in range(2):
    alone = jax.tree.map(lambda a, m=member: a[m], params)
    single = kfac_optax.scale_by_kfac(
        Member().apply, LOSS, example_batch=(x[member], y[member]),
        estimation="empirical")
    _, expected = single.update(alone, single.init(alone), alone,
                                batch=(x[member], y[member]))
    for key in ("hidden", "out"):
      actual = jax.tree.map(lambda a, m=member: a[m], state.factors[key])
      # L counts the terms of both members (12), one member alone has 6.
      expected_factors = expected.factors[key]._replace(g=expected.factors[key].g / 2)
      assert bf.relative_error(actual, expected_factors) < 1e-5
