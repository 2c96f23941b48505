"""Layers and params the loss's outputs do not depend on: init refuses them
(their Fisher block is zero), naming the fix; ``"skip"`` leaves them
unpreconditioned; a layer's calls that do not reach the loss are left out
of its statistics."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kfac_optax
from kfac_optax._src.curvature import reach

LOSS = kfac_optax.losses.softmax_cross_entropy()
X = jax.random.normal(jax.random.key(0), (8, 5))
BATCH = (X, jax.random.randint(jax.random.key(1), (8,), 0, 3))


def test_the_walk_cuts_at_stop_gradient_and_reads_inner_calls():
  def fn(a, b, c, d, e):
    inner = jax.jit(lambda x, y: 2.0 * x)(c, d)  # d unused inside the call
    return jax.nn.relu(a) + jax.lax.stop_gradient(b) + inner + 0.0 * e

  # e reaches through a multiplication by zero: the walk reads structure, so
  # it is reached (conservative), as a custom_jvp call's inputs (relu) are.
  assert reach.unreached(fn, *[1.0] * 5) == [False, True, False, True, False]
  assert reach.unreached(lambda t: t["x"] @ jnp.ones(3),
                         {"x": jnp.ones(3), "y": jnp.ones(2)}) == [False, True]


def test_remat_and_scan_are_reached():
  def fn(a, b):
    rematted = jax.checkpoint(lambda x, y: x * 2.0)(a, b)
    summed = jax.lax.scan(lambda c, x: (c + x, None), 0.0, jnp.stack([b, b]))[0]
    return rematted, summed
  # b is not used by the remat'd function, but the scan reads it.
  assert reach.unreached(lambda a, b: fn(a, b)[0], 1.0, 2.0) == [False, True]
  assert reach.unreached(fn, 1.0, 2.0) == [False, False]


def test_the_walk_reads_loop_bodies_to_a_fixed_point_and_every_branch():
  def scanned(a, b, c, d):
    def body(carry, x):
      u, v, w, z = carry
      return (u + v * x, w, c, z * b), None  # c reaches u two steps later
    return jax.lax.scan(body, (a, 0.0, 0.0, 1.0), jnp.arange(1.0, 4.0))[0][0]

  def looped(a, b, c, d):  # d only decides when the loop stops
    return jax.lax.while_loop(lambda s: s[0] < d, lambda s: (s[0] + s[1], c),
                              (a, b))[0]

  def branched(p, a, b):
    return jax.lax.cond(p > 0, lambda x, y: x, lambda x, y: 2.0 * x, a, b)

  assert reach.unreached(scanned, *[0.5] * 4) == [False, True, False, True]
  assert reach.unreached(looped, 0.5, 1.0, 2.0, 4.0) == [False, False, False, True]
  assert reach.unreached(branched, 1.0, 0.5, 0.5) == [True, False, True]
  # The derivatives agree: zero exactly where the walk says unreached.
  assert [float(g) != 0.0 for g in jax.grad(scanned, (0, 1, 2, 3))(*[0.5] * 4)] == [
      True, False, True, False]
  tangents = [jax.jvp(looped, (0.5, 1.0, 2.0, 4.0), tuple(
      float(i == j) for j in range(4)))[1] for i in range(4)]
  assert [float(t) != 0.0 for t in tangents] == [True, True, True, False]
  assert [float(g) != 0.0 for g in jax.grad(branched, (1, 2))(1.0, 0.5, 0.5)] == [
      True, False]


class ActorCritic(nn.Module):
  """Flax's PPO example's shape: a shared trunk, a policy and a value head."""

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(16, name="hidden")(x))
    log_std = self.param("log_std", nn.initializers.zeros, (1,))
    value = nn.Dense(1, name="value")(h) * jnp.exp(log_std)
    return nn.log_softmax(nn.Dense(3, name="policy")(h)), value


class Detached(nn.Module):
  """A layer whose output reaches the logits only through stop_gradient."""

  @nn.compact
  def __call__(self, x):
    frozen = jax.lax.stop_gradient(nn.Dense(3, name="frozen")(x))
    return nn.Dense(3, name="head")(x) + frozen


def test_a_head_the_loss_does_not_read_is_refused_naming_the_fix():
  model = ActorCritic()
  params = model.init(jax.random.key(2), X)["params"]
  tx = kfac_optax.kfac(model.apply, LOSS, example_batch=BATCH,
                       outputs=lambda out: out[0], learning_rate=1e-2)
  with pytest.raises(ValueError) as error:
    tx.init(params)
  message = str(error.value)
  assert "'value' (layer)" in message and "'log_std' (param)" in message
  assert "'hidden'" not in message and "'policy'" not in message
  assert "layer_overrides={'': 'skip', 'value': 'skip'}" in message
  assert "losses.joint(policy_loss, value_loss" in message
  # Modelling both heads reaches every layer and param.
  both = kfac_optax.losses.joint(
      LOSS, kfac_optax.losses.squared_error(targets=lambda b: b[0][:, :1]))
  kfac_optax.kfac(model.apply, both, example_batch=BATCH,
                  learning_rate=1e-2).init(params)


def test_a_layer_behind_stop_gradient_is_refused():
  model = Detached()
  params = model.init(jax.random.key(2), X)["params"]
  with pytest.raises(ValueError, match=r"depend on 'frozen' \(layer\):"):
    kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=BATCH).init(params)


def test_skipped_heads_pass_their_gradient_through():
  """With the value head and log_std skipped, their part of the update is
  the gradient itself; the policy's and the trunk's are preconditioned."""
  model = ActorCritic()
  params = model.init(jax.random.key(2), X)["params"]
  tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=BATCH,
                                outputs=lambda out: out[0],
                                layer_overrides={"value": "skip", "": "skip"})
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
  updates, _ = tx.update(grads, tx.init(params), params, batch=BATCH,
                         rng=jax.random.key(3))
  for leaf in (updates["value"]["kernel"], updates["value"]["bias"],
               updates["log_std"]):
    np.testing.assert_array_equal(leaf, 0.5)
  assert not np.allclose(updates["policy"]["kernel"], 0.5)
  kinds = {row.path: row.kind for row in kfac_optax.describe(tx, params).rows}
  assert kinds["value"] == kinds[""] == "skipped"


class NNXActorCritic(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(5, 16, rngs=rngs)
    self.policy = nnx.Linear(16, 3, rngs=rngs)
    self.value = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(self.hidden(x))
    return self.policy(h), self.value(h)


def test_nnx_heads_are_checked_too():
  model = NNXActorCritic(nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  tx = kfac_optax.kfac(model, LOSS, example_batch=BATCH,
                       outputs=lambda out: out[0], learning_rate=1e-2)
  with pytest.raises(ValueError, match=r"depend on 'value' \(layer\):"):
    tx.init(params)
  skipping = kfac_optax.kfac(model, LOSS, example_batch=BATCH,
                             outputs=lambda out: out[0], learning_rate=1e-2,
                             layer_overrides={"value": "skip"})
  skipping.init(params)


class PooledHead(nn.Module):
  """big_vision's ViT head: one layer applied to the pooled features, which
  the loss reads, and to every position's, returned beside them."""
  per_position: bool = True

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(4, name="hidden")(x))
    head = nn.Dense(3, name="head")
    logits = head(h.mean(1))
    return (logits, head(h)) if self.per_position else (logits, h)


def test_a_call_that_does_not_reach_the_loss_is_left_out_of_the_statistics():
  """The head's factors are the brute-force ones of its pooled call alone,
  ``A = mean [p, 1][p, 1]ᵀ`` and ``G = mean (diag(s) - s sᵀ)`` (softmax
  probabilities s; exact estimation), and every factor is the one of the
  same model without the per-position call."""
  x = jax.random.normal(jax.random.key(0), (6, 7, 5))
  batch = (x, jax.random.randint(jax.random.key(1), (6,), 0, 3))
  params = PooledHead().init(jax.random.key(2), x)["params"]

  def factors(model):
    tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=batch,
                                  outputs=lambda out: out[0], estimation="exact")
    return jax.jit(lambda p: tx.update(p, tx.init(p), p, batch=batch)[1].factors)(
        params)

  both, pooled_only = factors(PooledHead()), factors(PooledHead(per_position=False))
  p64 = jax.tree.map(lambda v: np.asarray(v, np.float64), params)
  pooled = np.tanh(np.asarray(x, np.float64) @ p64["hidden"]["kernel"]
                   + p64["hidden"]["bias"]).mean(1)
  logits = pooled @ p64["head"]["kernel"] + p64["head"]["bias"]
  s = np.exp(logits - logits.max(1, keepdims=True))
  s /= s.sum(1, keepdims=True)
  a_bar = np.concatenate([pooled, np.ones((len(pooled), 1))], 1)
  want = (a_bar.T @ a_bar / len(a_bar),
          np.mean([np.diag(row) - np.outer(row, row) for row in s], 0))
  for got, expected in zip(both["head"], want):
    np.testing.assert_allclose(np.asarray(got[0], np.float64), expected,
                               rtol=1e-5, atol=1e-7)
  for got, expected in zip(jax.tree.leaves(both), jax.tree.leaves(pooled_only)):
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-8)


class TiedAutoencoder(nn.Module):
  """A decoder tied to the encoder's kernel, read outside the encoder's call."""

  @nn.compact
  def __call__(self, x):
    encoder = nn.Dense(3, name="enc")
    h = nn.sigmoid(encoder(x))
    bias = self.param("decoder_bias", nn.initializers.zeros, (x.shape[-1],))
    return h @ encoder.variables["params"]["kernel"].T + bias


class ReadIntoAnotherLayer(nn.Module):
  """A kernel read raw whose product feeds another captured layer."""

  @nn.compact
  def __call__(self, x):
    encoder = nn.Dense(5, name="enc")
    mixed = jnp.tanh(encoder(x)) @ encoder.variables["params"]["kernel"]
    return nn.Dense(3, name="head")(mixed)


class ReadsItsOwnKernel(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    dense = nn.Dense(5, name="dense")
    return jnp.tanh(dense(h) + h @ dense.variables["params"]["kernel"]), None


class ScannedRawRead(nn.Module):
  """The raw read inside an nn.scan body, over stacked layers."""

  @nn.compact
  def __call__(self, x):
    h, _ = nn.scan(ReadsItsOwnKernel, variable_axes={
        "params": 0, "kfac_inputs": 0, "kfac_perturbations": 0},
                   split_rngs={"params": True}, length=2)(name="stack")(x, None)
    return nn.Dense(3, name="head")(h)


AUTOENCODER_LOSS = kfac_optax.losses.squared_error(targets=lambda batch: batch[0])


@pytest.mark.parametrize("model, loss, read", [
    (TiedAutoencoder(), AUTOENCODER_LOSS, "enc"),
    (ReadIntoAnotherLayer(), LOSS, "enc"),
    (ScannedRawRead(), LOSS, "stack/dense"),
], ids=["tied decoder", "into another layer", "inside nn.scan"])
def test_a_kernel_also_read_outside_its_layer_is_refused_naming_the_fix(
    model, loss, read):
  """The block would model the gradient through the layer's calls only;
  the exact diagonal (the fix the error names) is accepted."""
  params = model.init(jax.random.key(2), X)["params"]
  with pytest.raises(ValueError, match="outside the calls of its layer") as error:
    kfac_optax.kfac(model.apply, loss, example_batch=BATCH,
                    learning_rate=1e-2).init(params)
  message = str(error.value)
  assert f"reads '{read}/kernel' outside" in message and "bias'" not in message
  assert f"layer_overrides={{'{read}': 'diagonal'}}" in message
  kfac_optax.kfac(model.apply, loss, example_batch=BATCH, learning_rate=1e-2,
                  layer_overrides={read: "diagonal"}).init(params)


class TanhDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.tanh(nn.Dense(4, name="dense")(x))


def _vjp_forward(module, x):
  return nn.vjp(lambda m, v: m(v), module, x)


class CustomVJPNet(nn.Module):
  """A layer called inside nn.custom_vjp (its rule the plain vjp)."""

  @nn.compact
  def __call__(self, x):
    rule = nn.custom_vjp(lambda m, v: m(v), forward_fn=_vjp_forward,
                         backward_fn=lambda vjp, g: vjp(g))
    return nn.Dense(3, name="head")(rule(TanhDense(name="inner"), x))


def test_a_layer_called_inside_a_custom_vjp_is_not_read_elsewhere():
  """The walk reads a custom-derivative call's primal for the layers' own
  params (their path ends at the marks inside it), so init accepts it."""
  model = CustomVJPNet()
  params = model.init(jax.random.key(2), X)["params"]
  tx = kfac_optax.kfac(model.apply, LOSS, example_batch=BATCH, learning_rate=1e-2)
  tx.init(params)
  kinds = {row.path: row.kind for row in kfac_optax.describe(tx, params).rows}
  assert kinds == {"inner/dense": "kronecker", "head": "kronecker"}


class NNXTiedAutoencoder(nnx.Module):

  def __init__(self, rngs):
    self.enc = nnx.Linear(5, 3, rngs=rngs)

  def __call__(self, x):
    return nnx.sigmoid(self.enc(x)) @ self.enc.kernel[...].T


def test_an_nnx_kernel_read_outside_its_layer_is_refused():
  model = NNXTiedAutoencoder(nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  with pytest.raises(ValueError, match=r"reads 'enc/kernel' outside"):
    kfac_optax.kfac(model, AUTOENCODER_LOSS, example_batch=BATCH,
                    learning_rate=1e-2).init(params)


class SlicedHead(nn.Module):
  """A head applied to every position, its output then indexed (or not)."""
  read: str

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(4, name="hidden")(x))
    if self.read == "input sliced":
      return nn.Dense(3, name="head")(h[:, 0])
    out = nn.Dense(3, name="head")(h)
    return {"first": lambda: out[:, 0],
            "gathered": lambda: out[jnp.arange(6), jnp.arange(1, 7)],
            "mean": lambda: out.mean(1),
            "features": lambda: out[:, 0, :] + out[:, 1:, :2].sum((1, 2))[:, None]}[
                self.read]()


@pytest.mark.parametrize("read, warned", [
    ("first", True), ("gathered", True), ("mean", False), ("features", False),
    ("input sliced", False)])
def test_a_layer_output_the_loss_reads_in_part_is_warned_of(read, warned):
  """The warning's claim, brute force: the input factor of
  ``head(h)[:, 0]`` is the mean of ``[h, 1][h, 1]ᵀ`` over all 7 positions of
  each example, not the read one's; ``G``, per example a sum over positions,
  is the read rows' (the others' gradients are zero; exact estimation)."""
  x = jax.random.normal(jax.random.key(0), (6, 7, 5))
  batch = (x, jax.random.randint(jax.random.key(1), (6,), 0, 3))
  model = SlicedHead(read)
  params = model.init(jax.random.key(2), x)["params"]
  tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=batch,
                                estimation="exact")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state = tx.init(params)
  messages = [str(w.message) for w in caught if "only through indexing" in str(w.message)]
  assert len(messages) == int(warned)
  if read != "first":
    return
  assert "'head'" in messages[0] and "head(h[:, 0])" in messages[0]
  head = jax.jit(lambda p: tx.update(p, state, p, batch=batch)[1].factors)(params)["head"]
  p64 = jax.tree.map(lambda v: np.asarray(v, np.float64), params)
  h = np.tanh(np.asarray(x, np.float64) @ p64["hidden"]["kernel"] + p64["hidden"]["bias"])
  logits = h[:, 0] @ p64["head"]["kernel"] + p64["head"]["bias"]
  s = np.exp(logits - logits.max(1, keepdims=True))
  s /= s.sum(1, keepdims=True)
  rows = np.concatenate([h, np.ones(h.shape[:2] + (1,))], 2).reshape(-1, 5)
  want = (rows.T @ rows / len(rows),
          np.mean([np.diag(r) - np.outer(r, r) for r in s], 0))
  for got, expected in zip(head, want):
    np.testing.assert_allclose(np.asarray(got[0], np.float64), expected,
                               rtol=1e-5, atol=1e-7)

