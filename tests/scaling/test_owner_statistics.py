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
  """Per-token MLP: a column-parallel layer (kernel split over "model") and
  a row-parallel one, both with biases."""

  def __init__(self, rngs):
    split = lambda init, axes: nnx.with_partitioning(init, axes)
    self.up = nnx.Linear(8, 16, rngs=rngs,
                         kernel_init=split(nnx.initializers.lecun_normal(), (None, "model")),
                         bias_init=split(nnx.initializers.normal(0.5), ("model",)))
    self.down = nnx.Linear(16, 8, rngs=rngs,
                           kernel_init=split(nnx.initializers.lecun_normal(), ("model", None)),
                           bias_init=split(nnx.initializers.normal(0.5), (None,)))

  def __call__(self, x):
    # Explicit axes ask for the contractions' shardings; Auto ones leave them to XLA.
    explicit = jax.sharding.AxisType.Explicit in jax.sharding.get_abstract_mesh().axis_types
    out = lambda *spec: {"out_sharding": P(*spec)} if explicit else {}
    h = jnp.tanh(self.up(x, **out("data", None, "model")))
    return self.down(h, **out("data", None, None))


LOSS = kfac_optax.losses.softmax_cross_entropy(targets=lambda b: b["y"],
                                              mask=lambda b: b["mask"])


def _batch():
  """128 tokens: 16 a device, as many as the narrow factors' features (8),
  so those are summed from partial Grams, the wide ones (16) routed."""
  rng = np.random.default_rng(0)
  lengths = rng.integers(0, 9, 16)
  return {"x": rng.normal(size=(16, 8, 8)).astype(np.float32),
          "y": rng.integers(0, 8, (16, 8)),
          "mask": np.arange(8)[None] < lengths[:, None]}


def _by_hand(params, batch):
  """A and G of both layers from their definitions: masked means of
  ``[a; 1][a; 1]ᵀ`` over tokens, and ``(1/L) Σ_t ∇ℓ_t ∇ℓ_tᵀ`` (the
  empirical Fisher's per-token output gradients)."""
  mask = batch["mask"].reshape(-1).astype(np.float64)
  x = batch["x"].reshape(-1, 8).astype(np.float64)
  up_w, up_b = params["up"]["kernel"], params["up"]["bias"]
  down_w, down_b = params["down"]["kernel"], params["down"]["bias"]

  def outputs(s_up, s_down_shift):
    h = jnp.tanh(s_up)
    return h, h @ down_w + down_b + s_down_shift
  s_up = x @ up_w + up_b

  def summed_nll(s_up, shift):
    logits = outputs(s_up, shift)[1]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits),
                               batch["y"].reshape(-1, 1), 1)[:, 0]
    return jnp.sum(mask * nll)
  g_up, g_down = jax.grad(summed_nll, (0, 1))(s_up, jnp.zeros((len(x), 8)))
  h = np.asarray(outputs(s_up, 0)[0])
  with_ones = lambda a: np.concatenate([a, np.ones((len(a), 1))], 1)
  mean_gram = lambda r: (r * mask[:, None]).T @ r / mask.sum()
  grad_gram = lambda g: np.asarray(g).T @ np.asarray(g) / mask.sum()
  return {"up": (mean_gram(with_ones(x)), grad_gram(g_up)),
          "down": (mean_gram(with_ones(h)), grad_gram(g_down))}


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Explicit,
                                       jax.sharding.AxisType.Auto])
def test_statistics_formed_on_the_owners_equal_the_factors_by_hand(monkeypatch, axis_type):
  """TensorParallelTokens on 2x4, masked tokens: after one statistics step
  (the debiased average is the batch's) both factors of both layers equal
  `_by_hand`, and every side was formed on its owners: from routed rows
  (features split) or from partial Grams (features whole on each device,
  as many as the tokens per device; under Auto axes every side, its rows
  split over every device)."""
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
  assert formed and all(stack is not None for stack in formed)
  # Auto axes: every factor's rows split over all 8 devices, 16 rows each.
  assert set(ways) == ({"at_owners", "summed_at_owners"}
                       if axis_type == jax.sharding.AxisType.Explicit else {"summed_at_owners"})
  factors = jax.tree.map(lambda v: np.asarray(v.get_value()), optimizer.opt_state.factors,
                         is_leaf=lambda x: isinstance(x, nnx.Variable))
  expected = _by_hand(params, _batch())
  for key, (a, g) in expected.items():
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
