"""Under Explicit mesh axes the stacked factors' statistics are formed on
the devices that own their slots (`curvature.owner_statistics`): equal to
the factors computed by hand, with biases and masked tokens, and a
statistics step sends each device about its share of the activations
instead of gathering them whole."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import kfac_optax
from kfac_optax._src import linalg
from kfac_optax._src.curvature import owner_statistics
from tests import brute_force as bf
from tests.scaling.test_explicit_axes import _step_collective_bytes


class TensorParallelTokens(nnx.Module):
  """A per-token MLP of 5 pairs of a column-parallel layer (12 -> 16, kernel
  split over "model") and a row-parallel one (16 -> 12), all with biases:
  two stacks of 5 layers on 8 devices."""

  def __init__(self, rngs):
    split = lambda init, axes: nnx.with_partitioning(init, axes)
    layer = lambda sizes, kernel, bias: nnx.Linear(
        *sizes, rngs=rngs, kernel_init=split(nnx.initializers.lecun_normal(), kernel),
        bias_init=split(nnx.initializers.normal(0.5), bias))
    self.layers = nnx.List([
        layer((12, 16), (None, "model"), ("model",)) if i % 2 == 0 else
        layer((16, 12), ("model", None), (None,)) for i in range(10)])

  def __call__(self, x):
    # Explicit axes ask for the contractions' shardings; Auto ones leave them to XLA.
    explicit = jax.sharding.AxisType.Explicit in jax.sharding.get_abstract_mesh().axis_types
    for i, layer in enumerate(self.layers):
      out = {"out_sharding": P("data", None, "model" if i % 2 == 0 else None)}
      x = layer(x, **(out if explicit else {}))
      x = jnp.tanh(x) if i < 9 else x
    return x


LOSS = kfac_optax.losses.softmax_cross_entropy(targets=lambda b: b["y"],
                                              mask=lambda b: b["mask"])


def _batch():
  """256 tokens: 32 a device, more than any factor's features (12 or 16)."""
  rng = np.random.default_rng(0)
  lengths = rng.integers(0, 17, 16)
  return {"x": rng.normal(size=(16, 16, 12)).astype(np.float32),
          "y": rng.integers(0, 12, (16, 16)),
          "mask": np.arange(16)[None] < lengths[:, None]}


def _by_hand(params, batch):
  """Each layer's A and G from their definitions: masked means of
  ``[a; 1][a; 1]ᵀ`` over tokens, and ``(1/L) Σ_t ∇ℓ_t ∇ℓ_tᵀ`` (the
  empirical Fisher's per-token output gradients, taken as the gradients
  of zero shifts added to each layer's outputs)."""
  mask = batch["mask"].reshape(-1).astype(np.float64)
  layers = [params["layers"][i] for i in range(10)]

  def run(shifts):
    x, inputs = batch["x"].reshape(-1, 12), []
    for i, (layer, shift) in enumerate(zip(layers, shifts)):
      inputs.append(x)
      x = x @ layer["kernel"] + layer["bias"] + shift
      x = jnp.tanh(x) if i < 9 else x
    nll = -jnp.take_along_axis(jax.nn.log_softmax(x), batch["y"].reshape(-1, 1), 1)[:, 0]
    return jnp.sum(mask * nll), inputs
  shifts = [jnp.zeros((len(mask), layer["kernel"].shape[1])) for layer in layers]
  grads, inputs = jax.grad(run, has_aux=True)(shifts)
  with_ones = lambda a: np.concatenate([a, np.ones((len(a), 1))], 1)
  mean_gram = lambda r: (r * mask[:, None]).T @ r / mask.sum()
  return {f"layers/{i}": (mean_gram(with_ones(np.asarray(a, np.float64))),
                          np.asarray(g, np.float64).T @ np.asarray(g) / mask.sum())
          for i, (a, g) in enumerate(zip(inputs, grads))}


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Explicit,
                                       jax.sharding.AxisType.Auto])
def test_statistics_formed_on_the_owners_equal_the_factors_by_hand(monkeypatch, axis_type):
  """TensorParallelTokens on 2x4, masked tokens: after one statistics step
  (the debiased average is the batch's) both factors of every layer equal
  `_by_hand`, and every side was formed on its owners: from routed rows
  (features split) or from partial Grams (features whole on each device,
  fewer than the tokens per device; under Auto axes every side's rows are
  split over all devices, its features whole: all summed)."""
  formed, ways = [], []
  gram_stack = owner_statistics._gram_stack
  monkeypatch.setattr(owner_statistics, "_gram_stack", lambda *args: formed.append(
      gram_stack(*args)) or formed[-1])
  for way in ("at_owners", "summed_at_owners"):
    def spy(*args, way=way, original=getattr(linalg, way), **kwargs):
      if way == "summed_at_owners" or kwargs.get("back") is False:  # not the gradients'
        ways.append(way)
      return original(*args, **kwargs)
    monkeypatch.setattr(linalg, way, spy)
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh):
    model = TensorParallelTokens(nnx.Rngs(0))
    batch = jax.device_put(_batch(), jax.NamedSharding(mesh, P("data")))
    tx = kfac_optax.scale_by_kfac(model, LOSS, example_batch=batch,
                                  inputs=lambda b: b["x"], estimation="empirical")
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))

    @nnx.jit
    def step(model, optimizer, batch):
      grads = nnx.grad(lambda m: LOSS.value(m(batch["x"]), batch))(model)
      optimizer.update(model, grads, batch=batch, rng=jax.random.key(0))
    step(model, optimizer, batch)
  assert len(formed) >= 4 and all(stack is not None for stack in formed)  # 4 sides
  assert set(ways) == ({"at_owners", "summed_at_owners"}
                       if axis_type == jax.sharding.AxisType.Explicit else {"summed_at_owners"})
  factors = jax.tree.map(lambda v: np.asarray(v.get_value()), optimizer.opt_state.factors,
                         is_leaf=lambda x: isinstance(x, nnx.Variable))
  for key, (a, g) in _by_hand(params, _batch()).items():
    assert bf.relative_error(factors[key].a[0], a) < 1e-5, key
    assert bf.relative_error(factors[key].g[0], g) < 1e-5, key


def test_a_statistics_step_sends_the_activations_once():
  """The example's Decoder (tiny) on 2x4: a step with statistics sends at
  most the plain step's bytes, the capture pass's own (twice SGD's step:
  its forward and backward), and each device's share of every stacked
  factor's rows, padded slots included: 0.81 of that allowance, where XLA
  forming the Grams whole on every device sent 1.9x it."""
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  never = 10**9

  def kfac(stats_period):
    return lambda model, loss, batch: kfac_optax.kfac(
        model, loss, example_batch=batch, learning_rate=1e-2, damping=1e-3,
        stats_update_period=stats_period, inverse_update_period=never)
  plain, _ = _step_collective_bytes(mesh, kfac(never))
  with_statistics, state = _step_collective_bytes(mesh, kfac(1))
  sgd, _ = _step_collective_bytes(mesh, lambda *_: optax.sgd(1e-2))
  rows = 8 * 16  # tokens of the batch
  share = sum(4 * a.shape[0] * rows * (a.shape[1] + g.shape[1]) / mesh.size
              for a, g in state.curvature.factors.stacks)
  assert with_statistics - plain <= 2 * sgd + share
