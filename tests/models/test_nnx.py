"""Flax NNX models: the same blocks and numbers as their linen twins.

Each NNX model here has a linen twin with the same module paths and, copied
over, the same weights, and gives its twin's factors and updates in every
estimation mode. The brute-force tests of the layers, norms, masks and
shared modules run on NNX twins themselves (`tests/nnx_twins.py`); a tiny
NNX MLP is also checked here against the explicit float64 reference of
`tests/brute_force.py`.
"""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import kfac_optax
from kfac_optax._src import tree_paths
from kfac_optax._src import param_boxes
from kfac_optax._src.models import nnx_capture
from tests import brute_force as bf
from tests.nnx_twins import twin_of

DAMPING = 1e-2
VOCAB, WIDTH, LENGTH = 11, 8, 5


def copy_params(model: nnx.Module, linen_params) -> nnx.Module:
  """``model`` with the linen twin's params (same paths)."""
  nnx.update(model, nnx.State(jax.tree.map(jnp.asarray, linen_params)))
  return model


def random_like(tree, seed, scale=1.0):
  """Normal draws shaped like ``tree``'s leaves (NumPy's: nothing to compile)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda x: jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype), tree)


def random_variables(linen, *inputs):
  """Random variables of the linen model (its init would compile every
  initializer)."""
  return random_like(jax.eval_shape(linen.init, jax.random.key(0), *inputs), 3,
                     scale=0.3)


# -- twins -------------------------------------------------------------------

class NNXTiny(nnx.Module):
  """bf.TinyMLP in NNX: x -> Linear(4) -> tanh -> Linear(3, no bias) -> tanh -> Linear(3)."""

  def __init__(self, rngs):
    self.hidden = nnx.Linear(5, 4, rngs=rngs)
    self.nobias = nnx.Linear(4, 3, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(3, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.nobias(jnp.tanh(self.hidden(x)))))


class LinenLM(nn.Module):
  """Embed (tied attend), attention, layer and RMS norms, a shared Dense."""

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(VOCAB, WIDTH, name="embed")
    h = embed(ids)
    h = h + nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(
        nn.LayerNorm(name="ln")(h))
    shared = nn.Dense(WIDTH, name="shared")
    h = shared(jnp.tanh(shared(h)))  # one module, two calls
    return embed.attend(nn.RMSNorm(name="rms")(h))


class NNXLM(nnx.Module):

  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.ln = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, WIDTH, decode=False, keep_rngs=False,
                                       rngs=rngs)
    self.shared = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.rms = nnx.RMSNorm(WIDTH, rngs=rngs)

  def __call__(self, ids):
    h = self.embed(ids)
    h = h + self.attn(self.ln(h))
    h = self.shared(jnp.tanh(self.shared(h)))
    return self.embed.attend(self.rms(h))


class LinenCNN(nn.Module):
  """Strided and grouped 2-D convs, group and batch norms; 1-D and 3-D convs."""

  @nn.compact
  def __call__(self, x2, x1, x3):
    h = nn.Conv(4, (3, 3), strides=2, padding="SAME", name="conv")(x2)
    h = jax.nn.relu(nn.GroupNorm(num_groups=2, name="gn")(h))
    h = nn.Conv(6, (2, 2), padding="VALID", feature_group_count=2, name="grouped")(h)
    h = nn.BatchNorm(use_running_average=False, name="bn")(h)
    h1 = nn.Conv(3, (2,), padding="CAUSAL", name="conv1d")(x1)
    h3 = nn.Conv(3, (2, 2, 2), name="conv3d")(x3)
    pooled = jnp.concatenate([h.mean((1, 2)), h1.mean(1), h3.mean((1, 2, 3))], -1)
    return nn.Dense(3, name="head")(jnp.tanh(pooled))


class NNXCNN(nnx.Module):

  def __init__(self, rngs):
    self.conv = nnx.Conv(2, 4, (3, 3), strides=2, padding="SAME", rngs=rngs)
    self.gn = nnx.GroupNorm(4, num_groups=2, rngs=rngs)
    self.grouped = nnx.Conv(4, 6, (2, 2), padding="VALID", feature_group_count=2,
                            rngs=rngs)
    self.bn = nnx.BatchNorm(6, use_running_average=False, rngs=rngs)
    self.conv1d = nnx.Conv(2, 3, (2,), padding="CAUSAL", rngs=rngs)
    self.conv3d = nnx.Conv(2, 3, (2, 2, 2), rngs=rngs)
    self.head = nnx.Linear(12, 3, rngs=rngs)

  def __call__(self, x2, x1, x3):
    h = self.conv(x2)
    h = jax.nn.relu(self.gn(h))
    h = self.bn(self.grouped(h))
    h1, h3 = self.conv1d(x1), self.conv3d(x3)
    pooled = jnp.concatenate([h.mean((1, 2)), h1.mean(1), h3.mean((1, 2, 3))], -1)
    return self.head(jnp.tanh(pooled))


def tiny_case():
  params, batch = bf.tiny_problem(seed=3)
  return bf.TinyMLP(), NNXTiny, {"params": params}, batch, {}


def lm_case():
  ids = jax.random.randint(jax.random.key(1), (3, LENGTH), 0, VOCAB)
  batch = {"ids": ids, "y": jnp.roll(ids, -1, 1),
           "mask": jnp.arange(LENGTH)[None] < jnp.array([[5], [3], [4]])}
  linen = LinenLM()
  return (linen, NNXLM, random_variables(linen, ids), batch,
          dict(inputs=lambda b: b["ids"],
               loss=kfac_optax.losses.softmax_cross_entropy(
                   targets=lambda b: b["y"], mask=lambda b: b["mask"])))


def cnn_case():
  keys = jax.random.split(jax.random.key(4), 4)
  batch = {"x2": jax.random.normal(keys[0], (4, 6, 6, 2)),
           "x1": jax.random.normal(keys[1], (4, 5, 2)),
           "x3": jax.random.normal(keys[2], (4, 3, 3, 3, 2)),
           "y": jax.random.randint(keys[3], (4,), 0, 3)}
  linen = LinenCNN()
  variables = random_variables(linen, batch["x2"], batch["x1"], batch["x3"])
  return (linen, NNXCNN, variables, batch,
          dict(inputs=lambda b: (b["x2"], b["x1"], b["x3"]),
               loss=kfac_optax.losses.softmax_cross_entropy(targets=lambda b: b["y"])))


CASES = {"tiny": tiny_case, "lm": lm_case, "cnn": cnn_case}


@pytest.fixture(scope="module")
def twins(request):
  linen, make, variables, batch, options = CASES[request.param]()
  return request.param, linen, twin_of(make, variables), variables, batch, options


def one_update(apply_fn, params, batch, options, estimation, variables=None,
               grads=None):
  """scale_by_kfac's first update of ``grads`` (default: random): (factors,
  updates)."""
  options = dict(options)
  loss = options.pop("loss", kfac_optax.losses.softmax_cross_entropy())
  tx = kfac_optax.scale_by_kfac(apply_fn, loss, example_batch=batch,
                                estimation=estimation, damping=DAMPING, **options)
  grads = random_like(params, 7) if grads is None else grads

  @jax.jit
  def run(params, grads, batch, rng):
    updates, state = tx.update(grads, tx.init(params), params, batch=batch,
                               rng=rng, variables=variables)
    return state.factors, updates
  return run(params, grads, batch, jax.random.key(8))


def by_path(tree):
  return {"/".join(path): np.asarray(leaf, np.float64)
          for path, leaf in tree_paths.flatten(tree)[0].items()}


ESTIMATIONS = ("fisher", "empirical", "exact", "curvature_prop")


@pytest.mark.parametrize("twins, estimation", [
    (case, estimation) for case in CASES for estimation in ESTIMATIONS],
    indirect=["twins"])
def test_nnx_model_gives_its_linen_twins_factors_and_updates(twins, estimation):
  _, linen, model, variables, batch, options = twins
  others = {k: v for k, v in variables.items() if k != "params"}
  expected = one_update(linen.apply, variables["params"], batch, options,
                        estimation, others or None)
  params = nnx.state(model, nnx.Param)
  actual = one_update(model, param_boxes.values(params), batch, options, estimation)
  assert set(actual[0]) == set(expected[0])
  for key in expected[0]:
    assert bf.relative_error(actual[0][key], jax.tree.map(np.asarray, expected[0][key])) < 1e-5, key
  got, want = by_path(actual[1]), by_path(expected[1])
  assert set(got) == set(want)
  assert bf.relative_error(got, want) < 1e-4


@pytest.mark.parametrize("estimation", ["empirical", "exact"])
def test_nnx_mlp_matches_brute_force(estimation):
  model = NNXTiny(nnx.Rngs(0))
  params, batch = bf.tiny_problem(seed=5)
  copy_params(model, params)
  nnx_params = nnx.state(model, nnx.Param)
  factors, updates = one_update(model, nnx_params, batch, {}, estimation)
  expected = bf.factors(nnx.to_pure_dict(nnx_params), batch, estimation)
  for layer in bf.LAYERS:
    assert bf.relative_error(factors[layer], expected[layer]) < 1e-5
  grads = nnx.to_pure_dict(random_like(nnx_params, 7))
  assert bf.relative_error(nnx.to_pure_dict(updates),
                           bf.precondition(expected, grads, DAMPING)) < 1e-4


# -- training with nnx.Optimizer and raw optax --------------------------------

class NNXNet(nnx.Module):
  """Conv, BatchNorm (train mode), Dropout, Linear."""

  def __init__(self, rngs):
    self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(4, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.head = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    h = jax.nn.relu(self.bn(self.conv(x)))
    return self.head(self.drop(h.mean((1, 2))))


def net_batch(seed, n=16):
  x = jax.random.normal(jax.random.key(seed), (n, 6, 6, 1))
  # a learnable label: which third of the range the image mean falls in
  y = jnp.digitize(x.mean((1, 2, 3)), jnp.array([-0.1, 0.1]))
  return x, y


def cross_entropy(model, batch):
  logits = model(batch[0])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()


LOSS = kfac_optax.losses.softmax_cross_entropy()


def test_nnx_optimizer_under_nnx_jit_compiles_once_and_trains():
  model = NNXNet(nnx.Rngs(0))
  batch = net_batch(1)
  tx = kfac_optax.kfac(model, LOSS, example_batch=batch, learning_rate=0.1)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  traces = []

  @nnx.jit
  def train_step(model, optimizer, batch, rng):
    traces.append(None)
    loss, grads = nnx.value_and_grad(cross_entropy)(model, batch)
    optimizer.update(model, grads, batch=batch, rng=rng)
    return loss

  stats_before = param_boxes.values(nnx.state(model, nnx.BatchStat))
  losses = [float(train_step(model, optimizer, batch, jax.random.key(i)))
            for i in range(20)]
  assert len(traces) == 1
  assert losses[-1] < 0.7 * losses[0], losses
  # The user's own forward passes (not K-FAC's) move the running statistics.
  stats_after = param_boxes.values(nnx.state(model, nnx.BatchStat))
  assert not np.allclose(stats_after["bn"]["mean"], stats_before["bn"]["mean"])
  assert int(kfac_optax.stats(optimizer.opt_state)["rejected_statistics"]) == 0


def test_frozen_layers_stay_put_and_the_others_get_their_kfac_updates():
  """The recipe for training some layers (docs/models.md, "Flax NNX"): K-FAC
  skips the frozen one and a mask zeroes it inside the norm constraint, so
  the others get their K-FAC directions clipped by their own Fisher norm
  alone."""
  model = NNXTiny(nnx.Rngs(0))
  batch = (jax.random.normal(jax.random.key(1), (6, 5)), jnp.arange(6) % 3)
  frozen = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: path[0].key == "hidden", params)
  lr, clip = 0.1, 1e-4
  params = param_boxes.values(nnx.state(model, nnx.Param))
  grads = nnx.to_pure_dict(random_like(nnx.state(model, nnx.Param), 7))

  def update(tx):
    updates, _ = jax.jit(lambda g: tx.update(g, tx.init(params), params, batch=batch,
                                             rng=jax.random.key(0)))(nnx.State(grads))
    return nnx.to_pure_dict(updates)
  kfac = lambda **overrides: kfac_optax.scale_by_kfac(
      model, LOSS, example_batch=batch, damping=DAMPING, **overrides)
  directions = update(kfac())  # v = F̂⁻¹ g, every layer
  trained = update(optax.chain(kfac_optax.norm_constraint(optax.chain(
      kfac(layer_overrides={"hidden": "skip"}),
      optax.masked(optax.set_to_zero(), frozen)), clip, lr), optax.scale(-lr)))
  kept = [k for k in directions if k != "hidden"]
  v_g = sum(float(np.vdot(directions[k][n], grads[k][n])) for k in kept
            for n in directions[k])
  scale = min(1.0, np.sqrt(clip / (lr**2 * v_g)))
  assert scale < 0.5  # the clipping binds
  for name, leaf in directions["hidden"].items():
    np.testing.assert_array_equal(trained["hidden"][name], np.zeros_like(leaf))
  for k in kept:
    for name, leaf in directions[k].items():
      np.testing.assert_allclose(trained[k][name], -lr * scale * np.asarray(leaf),
                                 rtol=1e-4, atol=1e-7)

def test_raw_optax_over_nnx_split_state():
  model = NNXNet(nnx.Rngs(0))
  batch = net_batch(2)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = kfac_optax.kfac(model, LOSS, example_batch=batch, learning_rate=0.1)
  state = tx.init(params)  # Variables at the leaves, as nnx.split gives them
  # As optax's own moments do, the momentum keeps the params' Variables (and
  # their metadata); the rest of the state is what pure arrays give.
  assert (jax.tree.structure(state.previous_update)
          == jax.tree.structure(jax.tree.map(jnp.zeros_like, params)))
  without_momentum = lambda s: jax.tree.structure(s._replace(previous_update=None))
  assert without_momentum(state) == without_momentum(tx.init(param_boxes.values(params)))
  traces = []

  def loss_fn(params, rest, batch):
    model = nnx.merge(graphdef, params, rest)
    return cross_entropy(model, batch), nnx.as_pure(nnx.state(model, nnx.Not(nnx.Param)))

  @jax.jit
  def train_step(params, rest, state, batch, rng):
    traces.append(None)
    (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, batch)
    updates, state = tx.update(grads, state, params, batch=batch, rng=rng)
    assert jax.tree.structure(updates) == jax.tree.structure(grads)
    return optax.apply_updates(params, updates), rest, state, loss

  losses, rest = [], nnx.as_pure(rest)
  for i in range(10):
    params, rest, state, loss = train_step(params, rest, state, batch,
                                           jax.random.key(i))
    losses.append(float(loss))
  assert len(traces) == 1
  assert losses[-1] < 0.8 * losses[0], losses


# -- what K-FAC's pass reads and never changes ---------------------------------

def snapshot(model):
  """Every array of the model's state (keys as their data), as NumPy."""
  return jax.tree.map(
      lambda x: np.asarray(jax.random.key_data(x) if jnp.issubdtype(
          x.dtype, jax.dtypes.prng_key) else x),
      param_boxes.values(nnx.state(model)))


def factors_by_key(model, batch):
  """Jitted ``key -> factors`` of one statistics update of ``model`` on
  ``batch``, its dropout masks drawn from ``key``."""
  curvature = kfac_optax.Curvature(model, LOSS, example_batch=batch)
  params = param_boxes.values(nnx.state(model, nnx.Param))
  return jax.jit(lambda key: curvature.update(
      curvature.init(params), params, batch=batch, rng=key, damping=DAMPING).factors)

def test_dropout_comes_from_rng_and_the_model_is_untouched():
  model = NNXNet(nnx.Rngs(0))
  batch = net_batch(3)
  before = snapshot(model)
  curvature = kfac_optax.Curvature(model, LOSS, example_batch=batch)
  params = param_boxes.values(nnx.state(model, nnx.Param))
  stats = nnx.state(model, nnx.BatchStat)  # the model's own Variables
  factors = jax.jit(lambda key: curvature.update(
      curvature.init(params), params, batch=batch, rng=key, damping=DAMPING,
      variables=stats).factors)
  same = [factors(jax.random.key(1)) for _ in range(2)]
  other = factors(jax.random.key(2))
  # Dropout masks and sampled targets come from rng alone.
  jax.tree.map(np.testing.assert_array_equal, same[0], same[1])
  assert bf.relative_error(other["head"], jax.tree.map(np.asarray, same[0]["head"])) > 1e-3
  forward = jax.jit(lambda key: curvature.forward(params, batch, rng=key))
  assert not np.allclose(forward(jax.random.key(1)), forward(jax.random.key(2)))
  # Params, batch statistics and the Rngs' keys and counters as they were.
  jax.tree.map(np.testing.assert_array_equal, before, snapshot(model))
  assert type(model.conv) is nnx.Conv and type(model.bn) is nnx.BatchNorm


class CallRngsNet(nnx.Module):
  """Dropout that takes its rngs as a call argument (it holds none)."""

  def __init__(self, rngs):
    self.hidden = nnx.Linear(5, 4, rngs=rngs)
    self.drop = nnx.Dropout(0.5)
    self.out = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x, rngs=None):
    return self.out(self.drop(jnp.tanh(self.hidden(x)), deterministic=False, rngs=rngs))


class HoldsRngs(nnx.Module):
  """The fix the error names: a module that holds the Rngs and passes them."""

  def __init__(self, net):
    self.net, self.rngs = net, nnx.Rngs(dropout=0)

  def __call__(self, x):
    return self.net(x, rngs=self.rngs)


def test_a_model_taking_rngs_per_call_is_told_to_hold_them():
  net = CallRngsNet(nnx.Rngs(0))
  batch = (jax.random.normal(jax.random.key(1), (6, 5)), jnp.arange(6) % 3)
  fix = "for a model that takes rngs as a call argument, give kfac and nnx.Optimizer"
  tx = kfac_optax.kfac(net, LOSS, example_batch=batch, learning_rate=0.1)
  with pytest.raises(ValueError, match="no `rngs` argument was provided(.|\n)*" + fix):
    tx.init(nnx.state(net, nnx.Param))
  with pytest.raises(ValueError, match="apply_kwargs must not hold 'rngs'.*" + fix):
    kfac_optax.kfac(net, LOSS, example_batch=batch, apply_kwargs={"rngs": nnx.Rngs(0)})
  factors = factors_by_key(HoldsRngs(net), batch)
  masked = factors(jax.random.key(2))["net/out"]
  assert bf.relative_error(factors(jax.random.key(3))["net/out"],
                           jax.tree.map(np.asarray, masked)) > 1e-3


def test_other_state_comes_from_variables():
  """An eval-mode BatchNorm reads the statistics passed as variables=."""
  model = NNXNet(nnx.Rngs(0))
  model.eval()
  batch = net_batch(4)
  curvature = kfac_optax.Curvature(model, LOSS, example_batch=batch)
  params = param_boxes.values(nnx.state(model, nnx.Param))
  stats = {"bn": {"mean": jnp.full((4,), 0.5), "var": jnp.full((4,), 2.0)}}
  nnx.update(model, nnx.State(stats))
  np.testing.assert_allclose(curvature.forward(params, batch, variables=stats),
                             model(batch[0]), rtol=1e-6)


class Fails(nnx.Module):
  """Raises inside its forward pass on a batch of 3."""

  def __init__(self, rngs):
    self.lin = nnx.Linear(2, 3, rngs=rngs)
    self.out = nnx.Linear(3, 3, rngs=rngs)

  def __call__(self, x):
    h = self.lin(x)
    if x.shape[0] == 3:
      raise RuntimeError("boom")
    return self.out(h)


def test_an_exception_inside_the_model_leaves_no_hook_behind():
  model = Fails(nnx.Rngs(0))
  call, attend = nnx.Linear.__call__, nnx.Embed.attend
  batch = (jnp.ones((4, 2)), jnp.zeros((4,), jnp.int32))
  tx = kfac_optax.scale_by_kfac(model, LOSS, example_batch=batch,
                                estimation="empirical")
  params = nnx.state(model, nnx.Param)
  state = tx.init(params)
  update = jax.jit(lambda batch: tx.update(params, state, params, batch=batch))
  with pytest.raises(ValueError, match="RuntimeError: boom"):
    update((jnp.ones((3, 2)), jnp.zeros((3,), jnp.int32)))
  assert nnx_capture._ACTIVE == []  # pylint: disable=protected-access
  assert nnx.Linear.__call__ is call and nnx.Embed.attend is attend
  assert type(model.lin) is nnx.Linear and type(model.out) is nnx.Linear
  update(batch)  # and K-FAC still works


# -- describe, the fallback warning, overrides, registration ------------------

class Affine(nnx.Module):
  """A Dense of one's own: ``y = x @ w.T + b`` with ``w`` stored (out, in)."""

  def __init__(self, d_in, d_out, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (d_out, d_in)) / d_in ** 0.5)
    self.b = nnx.Param(jnp.zeros((d_out,)))

  def __call__(self, x):
    return x @ self.w[...].T + self.b[...]


class Block(nnx.Module):

  def __init__(self, rngs):
    self.affine = Affine(6, 24, rngs)
    self.lin = nnx.Linear(24, 6, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.lin(jnp.tanh(self.affine(x))))


class Blocks(nnx.Module):

  def __init__(self, rngs):
    self.blocks = nnx.List([Block(rngs) for _ in range(2)])
    self.head = nnx.Linear(6, 3, rngs=rngs)

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def blocks_problem():
  model = Blocks(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (8, 6))
  return model, (x, jnp.arange(8) % 3), nnx.state(model, nnx.Param)


def test_describe_and_fallback_warning_name_nnx_paths():
  model, batch, params = blocks_problem()
  tx = kfac_optax.kfac(model, LOSS, example_batch=batch, learning_rate=0.1,
                       layer_overrides={"blocks/1/lin": "diagonal"})
  with pytest.warns(kfac_optax.FallbackWarning,
                    match=r"get only K-FAC's diagonal fallback.*'blocks/\d/affine' \(168\)"
                    r".*nnx\.Param \(NNX\) kernels as layers: nn\.Dense or nnx\.Linear"):
    tx.init(params)
  kinds = {row.path: row.kind for row in kfac_optax.describe(tx, params).rows}
  assert kinds == {"blocks/0/affine": "fallback", "blocks/1/affine": "fallback",
                   "blocks/0/lin": "kronecker", "blocks/1/lin": "diagonal",
                   "head": "kronecker"}
  kfac_optax.register_layer(Affine, "dense", kernel="w", bias="b",
                            kernel_layout="out_in")
  kinds = {row.path: row.kind for row in kfac_optax.describe(tx, params).rows}
  assert kinds["blocks/0/affine"] == kinds["blocks/1/affine"] == "kronecker"


class LinearNet(nnx.Module):

  def __init__(self, rngs):
    self.first = nnx.Linear(6, 4, rngs=rngs)
    self.out = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.first(x)))


class AffineNet(LinearNet):

  def __init__(self, rngs):
    super().__init__(rngs)
    self.first = Affine(6, 4, rngs)


def test_registered_nnx_layer_equals_the_stock_layer():
  """An (out, in) kernel registered as such is preconditioned as the same
  layer stored (in, out) by nnx.Linear: updates transposed, all else equal.
  (conftest restores the registry after each test.)"""
  kfac_optax.register_layer(Affine, "dense", kernel="w", bias="b",
                            kernel_layout="out_in")
  own, stock = AffineNet(nnx.Rngs(0)), LinearNet(nnx.Rngs(0))
  stock.first.kernel[...] = own.first.w[...].T
  stock.first.bias[...] = own.first.b[...]
  stock.out.kernel[...], stock.out.bias[...] = own.out.kernel[...], own.out.bias[...]
  x = jax.random.normal(jax.random.key(1), (8, 6))
  batch = (x, jnp.arange(8) % 3)
  grads = nnx.to_pure_dict(random_like(nnx.state(own, nnx.Param), 7))
  stock_grads = {**grads, "first": {"kernel": grads["first"]["w"].T,
                                    "bias": grads["first"]["b"]}}
  _, expected = one_update(stock, nnx.state(stock, nnx.Param), batch, {},
                           "empirical", grads=nnx.State(stock_grads))
  _, actual = one_update(own, nnx.state(own, nnx.Param), batch, {}, "empirical",
                         grads=nnx.State(grads))
  want = nnx.to_pure_dict(expected)
  want["first"] = {"w": want["first"]["kernel"].T, "b": want["first"]["bias"]}
  assert bf.relative_error(nnx.to_pure_dict(actual), want) < 1e-5


class Layer(nnx.Module):
  """A pre-norm transformer layer: attention and an MLP."""

  def __init__(self, rngs):
    self.ln = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, WIDTH, decode=False, rngs=rngs)
    self.mlp = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

  def __call__(self, h):
    h = h + self.attn(self.ln(h))
    return h + jnp.tanh(self.mlp(h))


class ScanLM(nnx.Module):
  """The NNX guides' layer stack: made by nnx.vmap, applied by nnx.scan."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)

    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stack(rngs):
      return Layer(rngs)
    self.layers = stack(rngs)

  def __call__(self, ids):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def apply(h, layer):
      return layer(h)
    return self.embed.attend(apply(self.embed(ids), self.layers))


class LoopLM(nnx.Module):
  """ScanLM's twin: the same layers in an nnx.List, applied in a loop."""

  def __init__(self, scanned):
    self.embed = scanned.embed
    state = nnx.state(scanned.layers)
    self.layers = nnx.List([
        nnx.merge(nnx.graphdef(scanned.layers), jax.tree.map(lambda x, i=i: x[i], state))
        for i in range(2)])

  def __call__(self, ids):
    h = self.embed(ids)
    for layer in self.layers:
      h = layer(h)
    return self.embed.attend(h)


def test_scanned_layer_stack_gets_one_block_per_layer():
  scanned = ScanLM(nnx.Rngs(0))
  loop = LoopLM(scanned)
  ids = jax.random.randint(jax.random.key(1), (3, LENGTH), 0, VOCAB)
  batch = {"ids": ids, "y": jnp.roll(ids, -1, 1)}
  options = dict(inputs=lambda b: b["ids"], loss=kfac_optax.losses.softmax_cross_entropy(
      targets=lambda b: b["y"]))
  tx = kfac_optax.scale_by_kfac(scanned, options["loss"], example_batch=batch,
                                inputs=options["inputs"])
  rows = {row.path: row for row in kfac_optax.describe(
      tx, nnx.state(scanned, nnx.Param)).rows}
  assert rows["layers/attn/query"].kind == "kronecker"
  assert "2 × (A 9×9" in str(kfac_optax.describe(tx, nnx.state(scanned, nnx.Param)))
  grads = nnx.to_pure_dict(random_like(nnx.state(scanned, nnx.Param), 7))
  loop_grads = {"embed": grads["embed"], "layers": {
      i: jax.tree.map(lambda x, i=i: x[i], grads["layers"]) for i in range(2)}}
  stacked_factors, stacked = one_update(scanned, nnx.state(scanned, nnx.Param),
                                        batch, options, "empirical",
                                        grads=nnx.State(grads))
  loop_factors, looped = one_update(loop, nnx.state(loop, nnx.Param), batch,
                                    options, "empirical",
                                    grads=nnx.State(loop_grads))
  stacked, looped = nnx.to_pure_dict(stacked), nnx.to_pure_dict(looped)
  for i in range(2):
    for key in ("ln", "attn/query", "attn/out", "mlp"):
      assert bf.relative_error(
          jax.tree.map(lambda x, i=i: x[i], stacked_factors[f"layers/{key}"]),
          jax.tree.map(np.asarray, loop_factors[f"layers/{i}/{key}"])) < 1e-5, key
    assert bf.relative_error(jax.tree.map(lambda x, i=i: x[i], stacked["layers"]),
                             looped["layers"][i]) < 1e-4
  assert bf.relative_error(stacked["embed"], looped["embed"]) < 1e-4


class DropoutStack(nnx.Module):
  """Two Linear + Dropout layers made by nnx.vmap over split Rngs and applied
  by nnx.scan with their keys sliced per layer (the NNX guides' dropout stack)."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stack(rngs):
      return nnx.Sequential(nnx.Linear(WIDTH, WIDTH, rngs=rngs),
                            nnx.Dropout(0.5, rngs=rngs))
    self.layers = stack(rngs)
    self.head = nnx.Linear(WIDTH, 3, rngs=rngs)

  def __call__(self, h):
    @nnx.scan(in_axes=(nnx.Carry, nnx.StateAxes({nnx.RngState: 0, ...: 0})),
              out_axes=nnx.Carry)
    def apply(h, layer):
      return jnp.tanh(layer(h))
    return self.head(apply(h, self.layers))


def test_a_scanned_stack_draws_one_dropout_key_per_layer_from_rng():
  model = DropoutStack(nnx.Rngs(0, dropout=1))
  x = jax.random.normal(jax.random.key(1), (6, WIDTH))
  batch = (x, jnp.arange(6) % 3)
  streams = nnx_capture.NNXModel(model)._streams(jax.random.key(2))
  keys = [k for k in jax.tree.leaves(streams)
          if jnp.issubdtype(k.dtype, jax.dtypes.prng_key)]
  assert [k.shape for k in keys] == [
      k.shape for k in jax.tree.leaves(param_boxes.values(nnx.state(model, nnx.RngState)))
      if jnp.issubdtype(k.dtype, jax.dtypes.prng_key)]
  stacked, = [k for k in keys if k.shape == (2,)]
  assert not np.array_equal(*jax.random.key_data(stacked))
  factors = factors_by_key(model, batch)
  same, other = factors(jax.random.key(3)), factors(jax.random.key(4))
  jax.tree.map(np.testing.assert_array_equal, same, factors(jax.random.key(3)))
  assert bf.relative_error(other["head"], jax.tree.map(np.asarray, same["head"])) > 1e-3


# -- data parallel ----------------------------------------------------------------

class DenseNet(nnx.Module):
  """Linear, BatchNorm (train mode), Dropout, Linear."""

  def __init__(self, rngs):
    self.hidden = nnx.Linear(36, 8, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    h = jnp.tanh(self.bn(self.hidden(x.reshape(x.shape[0], -1))))
    return self.head(self.drop(h))


def test_sharded_batch_gives_unsharded_updates():
  """tests/scaling/test_sharding.py's check for an NNX model (BatchNorm, dropout): a
  batch sharded over 8 devices (Explicit axes), the inverses distributed
  over them, gives the update of one device."""
  model = DenseNet(nnx.Rngs(0))
  data = net_batch(5)
  params = param_boxes.values(nnx.state(model, nnx.Param))
  tx = kfac_optax.kfac(model, LOSS, example_batch=data, learning_rate=0.1,
                       inverse_update_period=1)
  grads = random_like(params, 2)

  update = jax.jit(lambda state, batch: tx.update(
      grads, state, params, batch=batch, rng=jax.random.key(5)))
  initial = jax.jit(tx.init)(params)  # one compile, not one per eager op
  expected, _ = update(initial, data)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    sharded = jax.device_put(data, NamedSharding(mesh, P("data")))
    replicated = jax.device_put(initial, NamedSharding(mesh, P()))
    actual, state = update(replicated, sharded)
  assert bf.relative_error(actual, jax.tree.map(np.asarray, expected)) < 1e-4
  assert int(state[0].count) == 1


def test_params_that_do_not_fit_the_model_are_named():
  model = NNXTiny(nnx.Rngs(0))
  _, batch = bf.tiny_problem()
  tx = kfac_optax.scale_by_kfac(model, LOSS, example_batch=batch)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  fix = ("\nFix: pass the model's params, nnx.state(model, nnx.Param) (as "
         "nnx.Optimizer(model, tx, wrt=nnx.Param) does), unchanged in structure "
         "and shapes: K-FAC runs the model, which needs them all. To train some "
         "layers only (wrt=nnx.LoRAParam), give it all params and freeze the "
         "others with layer_overrides={'their/path': 'skip'} and "
         "optax.masked(optax.set_to_zero(), frozen_mask) after it "
         "(docs/models.md, \"Flax NNX\", has the recipe).")
  with pytest.raises(ValueError) as error:
    tx.init({**params, "extra": {"w": jnp.ones(2)}, "out": {"kernel": jnp.ones((3, 4))}})
  assert str(error.value) == (
      "the params do not match the NNX model NNXTiny: out/bias: missing; "
      "extra/w: not a param of the model; out/kernel: shape (3, 4), the model's "
      "(3, 3)." + fix)
