"""How K-FAC calls the model: outputs= for dict/dataclass outputs, models with
no captured layer (diagonal fallback alone, against a brute force), and the
errors for a model that K-FAC cannot call, each naming its real cause."""

import collections
import dataclasses
import re
from typing import NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_optax
from kfac_optax._src.models import registry
from tests import brute_force as bf

LOSS = kfac_optax.losses.softmax_cross_entropy()
PARAMS, BATCH = bf.tiny_problem()
BATCH_FIX = "must have the structure of a training batch"


class ModelOutput(collections.OrderedDict):
  """Like Hugging Face's ModelOutput: a dataclass that is also a mapping of
  its fields that are set."""

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if getattr(self, field.name) is not None:
        self[field.name] = getattr(self, field.name)


@flax.struct.dataclass
class Output(ModelOutput):
  """A pytree, as Hugging Face's Flax outputs are."""
  hidden: jax.Array = None
  logits: jax.Array = None


class DictMLP(nn.Module):
  """TinyMLP whose apply returns {"logits": ..., "hidden": ...}."""

  @nn.compact
  def __call__(self, x):
    return {"hidden": x, "logits": bf.TinyMLP(name="mlp")(x)}


class DataclassMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return Output(hidden=x, logits=bf.TinyMLP(name="mlp")(x))


class RawMatmuls(nn.Module):
  """No captured layer: f = tanh(x W1) W2 from raw params."""

  @nn.compact
  def __call__(self, x):
    w1 = self.param("w1", nn.initializers.normal(0.5), (x.shape[-1], 4))
    w2 = self.param("w2", nn.initializers.normal(0.5), (4, 3))
    return jnp.tanh(x @ w1) @ w2


def run_kfac(apply_fn, params, select=lambda out: out, steps=2, **settings):
  """``steps`` automatic-mode kfac updates (quadratic model, ρ measured):
  every place that runs the model (statistics, jvp, loss value) is used."""
  tx = kfac_optax.kfac(apply_fn, LOSS, example_batch=BATCH, estimation="exact",
                       inverse_update_period=1, **settings)
  loss_fn = lambda p: LOSS.value(select(apply_fn({"params": p}, BATCH[0])), BATCH)
  step = jax.jit(lambda p, s: tx.update(jax.grad(loss_fn)(p), s, p, batch=BATCH))
  state, updates = tx.init(params), []
  for _ in range(steps):
    update, state = step(params, state)
    params = optax.apply_updates(params, update)
    updates.append(update)
  return updates


@pytest.fixture(scope="module")
def plain_updates():
  return run_kfac(bf.TinyMLP().apply, PARAMS)


@pytest.mark.parametrize("model, select", [
    (DictMLP(), lambda out: out["logits"]),
    (DataclassMLP(), lambda out: out.logits),
])
def test_outputs_selects_what_the_loss_reads(model, select, plain_updates):
  updates = run_kfac(model.apply, {"mlp": PARAMS}, select, outputs=select)
  for got, expected in zip(updates, plain_updates):
    for g, e in zip(jax.tree.leaves(got["mlp"]), jax.tree.leaves(expected)):
      np.testing.assert_allclose(g, e, atol=1e-5 * float(jnp.max(jnp.abs(e))))


def test_exact_product_uses_outputs():
  vector = jax.tree.map(jnp.ones_like, {"mlp": PARAMS})
  curvature = kfac_optax.Curvature(DictMLP().apply, LOSS, example_batch=BATCH,
                                   outputs=lambda out: out["logits"])
  plain = kfac_optax.Curvature(bf.TinyMLP().apply, LOSS, example_batch=BATCH)
  got = curvature.exact_product({"mlp": PARAMS}, BATCH, vector)["mlp"]
  expected = plain.exact_product(PARAMS, BATCH, vector["mlp"])
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(g, e, atol=1e-5 * float(jnp.max(jnp.abs(e))))


@pytest.mark.parametrize("model, shown, hint", [
    (DictMLP(), "apply_fn returned dict (keys ['hidden', 'logits'])",
     "outputs=lambda out: out['logits']"),
    (DataclassMLP(), "apply_fn returned Output (fields ['hidden', 'logits'])",
     "outputs=lambda out: out.logits"),
])
def test_non_array_output_without_outputs_names_outputs(model, shown, hint):
  tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=BATCH)
  with pytest.raises(TypeError) as error:
    tx.init({"mlp": PARAMS})
  assert shown in str(error.value)
  assert "Fix: pass outputs= to scale_by_kfac/kfac (or Curvature)" in str(error.value)
  assert hint in str(error.value)


def test_outputs_returning_a_non_array_is_named():
  tx = kfac_optax.scale_by_kfac(DictMLP().apply, LOSS, example_batch=BATCH,
                                outputs=lambda out: (out["logits"],))
  with pytest.raises(TypeError, match=r"outputs= returned tuple \(1 elements\)"):
    tx.init({"mlp": PARAMS})


def brute_force_diagonal_fisher(params, batch):
  """``F = (1/N) Σ_k (Σ_n J_nᵀ B_{n,k})²`` for RawMatmuls, float64, with the
  per-example Jacobians written out and ``B_k = sqrt(p_k) (e_k - p)``."""
  w1, w2 = (np.asarray(params[k], np.float64) for k in ("w1", "w2"))
  x = np.asarray(batch[0], np.float64)
  h = np.tanh(x @ w1)
  p = bf.softmax(h @ w2)
  n, c = p.shape
  columns = np.sqrt(p)[:, :, None] * (np.eye(c)[None] - p[:, None, :])  # n, k, c
  # f_c = Σ_i h_i W2[i, c]: df_c/dW2[i, c'] = h_i δ_cc', df_c/dW1[j, i] = x_j (1 - h_i²) W2[i, c]
  grad_w2 = np.einsum("ni,nkc->kic", h, columns)
  grad_w1 = np.einsum("nj,ni,ic,nkc->kji", x, 1 - h ** 2, w2, columns)
  return {"w1": np.sum(grad_w1 ** 2, 0) / n, "w2": np.sum(grad_w2 ** 2, 0) / n}


@pytest.mark.parametrize("estimation", ["exact", "empirical"])
def test_model_without_captured_layers_gets_the_diagonal_fallback(estimation):
  model = RawMatmuls()
  params = model.init(jax.random.key(3), BATCH[0])["params"]
  tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=BATCH,
                                estimation=estimation, damping=1e-3)
  with pytest.warns(kfac_optax.FallbackWarning, match="100% of the parameters"):
    state = tx.init(params)
  assert list(state.factors) == ["<diagonal>"]
  vector = jax.tree.map(lambda v: jax.random.normal(jax.random.key(4), v.shape), params)
  update, state = tx.update(vector, state, params, batch=BATCH)
  if estimation == "exact":
    fisher = brute_force_diagonal_fisher(params, BATCH)
  else:  # the squared batch gradient of the summed NLL, over N
    grads = jax.grad(lambda p: LOSS.value(model.apply({"params": p}, BATCH[0]),
                                          BATCH))(params)
    fisher = {k: len(BATCH[1]) * np.asarray(g, np.float64) ** 2
              for k, g in grads.items()}
  for name in ("w1", "w2"):
    np.testing.assert_allclose(state.factors["<diagonal>"][name], fisher[name],
                               atol=1e-5 * np.max(fisher[name]))
    expected = np.asarray(vector[name], np.float64) / (fisher[name] + 1e-3)
    assert bf.relative_error(update[name], expected) < 1e-4


def test_model_without_captured_layers_trains():
  model = RawMatmuls()
  params = model.init(jax.random.key(3), BATCH[0])["params"]
  loss_fn = lambda p: LOSS.value(model.apply({"params": p}, BATCH[0]), BATCH)
  tx = kfac_optax.kfac(model.apply, LOSS, example_batch=BATCH, learning_rate=0.1)
  with pytest.warns(kfac_optax.FallbackWarning):
    state = tx.init(params)

  @jax.jit
  def step(params, state, rng):
    update, state = tx.update(jax.grad(loss_fn)(params), state, params,
                              batch=BATCH, rng=rng)
    return optax.apply_updates(params, update), state
  start = loss_fn(params)
  for i in range(10):
    params, state = step(params, state, jax.random.key(i))
  assert loss_fn(params) < 0.8 * start


def test_nnx_bridge_model_runs_on_the_diagonal_fallback():
  from flax import nnx  # pylint: disable=import-outside-toplevel

  class Linear(nnx.Module):
    def __init__(self, rngs):
      self.layer = nnx.Linear(5, 3, rngs=rngs)

    def __call__(self, x):
      return self.layer(x)
  model = nnx.bridge.to_linen(Linear)
  params = model.init(jax.random.key(0), BATCH[0])["params"]
  tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=BATCH,
                                estimation="empirical")
  with pytest.warns(kfac_optax.FallbackWarning, match="'layer'"):
    state = tx.init(params)
  assert sorted(state.factors["<diagonal>"]) == ["layer/bias", "layer/kernel"]
  update, _ = tx.update(params, state, params, batch=BATCH)
  assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(update))


# -- errors name their real cause ------------------------------------------

def init_error(apply_fn=bf.TinyMLP().apply, params=PARAMS, **settings):
  tx = kfac_optax.scale_by_kfac(apply_fn, LOSS, **{"example_batch": BATCH, **settings})
  with pytest.raises((TypeError, ValueError)) as error:
    tx.init(params)
  return str(error.value)


def test_params_of_another_model_are_named():
  other = bf.TinyMLP().init(jax.random.key(0), jnp.ones((1, 7)))["params"]
  message = init_error(params=other)
  assert message.startswith("the params do not match the model that apply_fn "
                            "runs on example_batch: ScopeParamShapeError")
  assert "Fix: pass the 'params' collection that this model's init returns" in message
  assert BATCH_FIX not in message


def test_missing_params_are_named():
  message = init_error(params={k: v for k, v in PARAMS.items() if k != "out"})
  assert "the params do not match the model" in message
  assert ('ScopeParamNotFoundError: Could not find parameter named "kernel" in '
          'scope "/out"') in message
  assert BATCH_FIX not in message


def test_whole_variables_dict_is_named():
  message = init_error(params={"params": PARAMS})
  assert "scale_by_kfac got the whole variables dict as params" in message


def test_batch_problems_name_the_batch():
  message = init_error(example_batch=(jnp.ones(()), BATCH[1]))  # no feature axis
  assert message.startswith("scale_by_kfac could not run apply_fn on example_batch")
  assert f"Fix: example_batch {BATCH_FIX}" in message
  message = init_error(inputs=lambda batch: batch["image"])
  assert message.startswith("inputs= could not read apply_fn's input from "
                            "example_batch: TypeError")
  assert BATCH_FIX in message


def test_targets_that_do_not_fit_are_named_at_init():
  one_hot = (BATCH[0], jax.nn.one_hot(BATCH[1], 3))
  message = init_error(example_batch=one_hot)
  assert message.startswith("softmax_cross_entropy: targets(batch) has shape "
                            "(6, 3) (float32) for outputs of shape (6, 3)")


def test_a_batch_without_targets_is_named_at_init():
  message = init_error(example_batch=(BATCH[0],))
  assert message.startswith("the default `targets` reads batch[1], but the batch "
                            "has 1 element(s); pass targets=lambda batch: ... "
                            "to the loss")


def test_a_mask_of_other_shape_than_the_terms_is_named_at_init():
  per_class = kfac_optax.losses.softmax_cross_entropy(
      mask=lambda batch: jnp.ones(batch[0].shape[:1] + (3,)))
  tx = kfac_optax.scale_by_kfac(bf.TinyMLP().apply, per_class, example_batch=BATCH)
  with pytest.raises(ValueError, match=re.escape(
      "softmax_cross_entropy: mask(batch) has shape (6, 3) for outputs of shape "
      "(6, 3); it must have the shape of the loss terms, outputs.shape[:-1] = (6,)")):
    tx.init(PARAMS)


@pytest.mark.parametrize("combinator", [
    lambda tx, labels: optax.multi_transform({"kfac": tx, "adam": optax.adam(1e-3)},
                                             labels),
    lambda tx, labels: optax.masked(tx, jax.tree.map(lambda l: l == "kfac", labels)),
], ids=["multi_transform", "masked"])
@pytest.mark.parametrize("per_leaf", [True, False], ids=["per leaf", "per module"])
def test_kfac_inside_optax_masking_is_named(combinator, per_leaf):
  """The error names the hidden module whether the labels (or mask) give a
  value per param or one per module (a prefix of the params tree)."""
  label = lambda name: "adam" if name == "out" else "kfac"
  labels = {name: jax.tree.map(lambda _, n=name: label(n), leaves) if per_leaf
            else label(name) for name, leaves in PARAMS.items()}
  tx = combinator(kfac_optax.scale_by_kfac(bf.TinyMLP().apply, LOSS,
                                           example_batch=BATCH), labels)
  with pytest.raises(ValueError, match="got params with optax.MaskedNode entries"
                     "(.|\n)*layer_overrides={'out': 'skip'}\\)"):
    tx.init(PARAMS)


def test_the_masking_advice_trains_the_skipped_layer_with_adam():
  """The error's fix: K-FAC sees all params, skips the head, Adam scales it."""
  head = {name: jax.tree.map(lambda _, n=name: n == "out", leaves)
          for name, leaves in PARAMS.items()}
  tx = optax.chain(
      kfac_optax.scale_by_kfac(bf.TinyMLP().apply, LOSS, example_batch=BATCH,
                               layer_overrides={"out": "skip"}),
      optax.masked(optax.scale_by_adam(), head))
  grads = jax.grad(lambda p: LOSS.value(bf.TinyMLP().apply({"params": p}, BATCH[0]),
                                        BATCH))(PARAMS)
  updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS, batch=BATCH,
                         rng=jax.random.key(0))
  adam, _ = optax.scale_by_adam().update(grads["out"], optax.scale_by_adam().init(
      PARAMS["out"]))
  np.testing.assert_allclose(updates["out"]["kernel"], adam["kernel"], rtol=1e-6)
  assert not np.allclose(updates["hidden"]["kernel"], grads["hidden"]["kernel"])


def test_a_loss_function_is_not_a_predictive_distribution():
  with pytest.raises(TypeError, match="loss must be a kfac_optax.losses predictive "
                     "distribution, e.g. kfac_optax.losses.softmax_cross_entropy"):
    kfac_optax.kfac(bf.TinyMLP().apply,
                    optax.softmax_cross_entropy_with_integer_labels,
                    example_batch=BATCH, learning_rate=0.1)


@pytest.mark.parametrize("apply_fn, keyword", [
    (lambda variables, x: bf.TinyMLP().apply(variables, x), "mutable"),
    (lambda variables, x, mutable=False: bf.TinyMLP().apply(
        variables, x, mutable=mutable), "rngs"),
])
def test_apply_fn_that_cannot_take_the_call_says_how_it_is_called(apply_fn, keyword):
  message = init_error(apply_fn=apply_fn)
  assert message.startswith(
      "apply_fn cannot be called the way K-FAC calls it, apply_fn(variables, "
      "*inputs(batch), mutable=..., rngs=kfac_optax.model_rngs(key), "
      "**apply_kwargs): "
      f"got an unexpected keyword argument '{keyword}'")
  assert "Fix: pass the flax apply function (model.apply)" in message
  assert BATCH_FIX not in message


class MisregisteredDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x @ self.param("kernel", nn.initializers.normal(), (x.shape[-1], 3))


def test_rngs_in_apply_kwargs_are_named():
  with pytest.raises(ValueError, match="apply_kwargs must not hold 'rngs'"):
    kfac_optax.scale_by_kfac(bf.TinyMLP().apply, LOSS, example_batch=BATCH,
                             apply_kwargs={"rngs": {"noise": jax.random.key(0)}})


def test_a_wrapper_that_drops_the_batch_is_named():
  """A plain GradientTransformation around K-FAC, inside a chain (as optax
  wraps a MultiSteps there): the chain's extra args do not reach it."""
  tx = kfac_optax.scale_by_kfac(bf.TinyMLP().apply, LOSS, example_batch=BATCH)
  plain = optax.GradientTransformation(tx.init, lambda u, s, p=None: tx.update(u, s, p))
  chained = optax.chain(optax.clip_by_global_norm(1.0), plain)
  with pytest.raises(TypeError, match="needs the training batch(.|\n)*a wrapper "
                     "between you and it dropped them(.|\n)*MultiSteps inside optax.chain"):
    chained.update(PARAMS, chained.init(PARAMS), PARAMS, batch=BATCH,
                   rng=jax.random.key(0))

def test_failure_under_capture_only_is_named():
  registry.register_layer(MisregisteredDense, "conv")  # it is a dense layer
  model = MisregisteredDense()
  params = model.init(jax.random.key(0), BATCH[0])["params"]
  message = init_error(apply_fn=model.apply, params=params)
  assert message.startswith("apply_fn runs on example_batch, but not under "
                            "K-FAC's capture of its layers")
  assert "kfac_optax.register_layer" in message
  assert BATCH_FIX not in message


def two_models(variables, x, **kwargs):
  """An apply_fn that applies two models, each at the path ''."""
  square = {"kernel": jnp.eye(5), "bias": jnp.zeros(5)}
  h, _ = nn.Dense(5).apply({"params": square}, x, **kwargs)
  return nn.Dense(3, use_bias=False).apply(variables, h, **kwargs)


def test_layers_applied_at_the_top_level_are_named():
  message = init_error(apply_fn=two_models,
                       params={"kernel": jnp.ones((5, 3))})
  assert message.startswith(
      "apply_fn runs on example_batch, but not under K-FAC's capture of its "
      "layers: ValueError: layer calls at the top-level path '' need different "
      "curvature layouts (")
  assert message.endswith(
      "more than one module runs with its own .apply (e.g. apply_fn applies two "
      "models, or applies a model twice), and K-FAC keeps one block per module "
      "path.\nFix: make apply_fn one model.apply, with every layer a submodule "
      "of that model.")
  assert BATCH_FIX not in message


@pytest.fixture(scope="module")
def tx_and_state():
  tx = kfac_optax.scale_by_kfac(bf.TinyMLP().apply, LOSS, example_batch=BATCH)
  return tx, tx.init(PARAMS)


def test_grads_of_other_shapes_are_named(tx_and_state):
  tx, state = tx_and_state
  grads = {**PARAMS, "hidden": {**PARAMS["hidden"],
                                "kernel": PARAMS["hidden"]["kernel"].T}}
  del grads["nobias"]
  with pytest.raises(ValueError) as error:
    tx.update(grads, state, PARAMS, batch=BATCH, rng=jax.random.key(0))
  assert str(error.value).startswith(
      "scale_by_kfac's update got grads that do not match params (grads shape "
      "vs params shape): ")
  assert "hidden/kernel: (4, 5) vs (5, 4)" in str(error.value)
  assert "nobias/kernel: missing vs (4, 3)" in str(error.value)


@pytest.mark.parametrize("rng, got", [
    (3, "got int 3"),
    (np.zeros(2, np.float32), "got an array of shape (2,) and dtype float32"),
    (jax.random.split(jax.random.key(0)), "got an array of shape (2,) and dtype key<fry>"),
])
def test_wrong_rng_is_named(tx_and_state, rng, got):
  tx, state = tx_and_state
  with pytest.raises(TypeError) as error:
    tx.update(PARAMS, state, PARAMS, batch=BATCH, rng=rng)
  assert str(error.value).startswith(
      "rng must be one jax.random key, jax.random.key(seed) (or a raw "
      f"jax.random.PRNGKey(seed)), {got}.\nFix: pass a fresh key each step")


def test_raw_keys_are_accepted(tx_and_state):
  tx, state = tx_and_state
  step = jax.jit(lambda rng: tx.update(PARAMS, state, PARAMS, batch=BATCH, rng=rng)[0])
  typed = step(jax.random.key(5))
  for raw in (jax.random.PRNGKey(5), np.asarray(jax.random.PRNGKey(5))):
    for a, b in zip(jax.tree.leaves(step(raw)), jax.tree.leaves(typed)):
      np.testing.assert_array_equal(a, b)


class Graphs(NamedTuple):
  """A structured input, as jraph's ``GraphsTuple``."""
  nodes: jax.Array
  scale: jax.Array


class OnGraphs(nn.Module):

  @nn.compact
  def __call__(self, graphs):
    return nn.Dense(3)(graphs.nodes * graphs.scale)


@pytest.mark.parametrize("inputs", [lambda b: b[0], lambda b: (b[0],)],
                         ids=["namedtuple", "wrapped in a tuple"])
def test_a_namedtuple_input_is_one_input(inputs):
  """The A factor is the brute-force mean of the Dense layer's ā āᵀ, whether
  inputs= returns the NamedTuple or a tuple holding it."""
  x = BATCH[0]
  batch = (Graphs(x, jnp.full((len(x), 1), 2.0)), BATCH[1])
  params = OnGraphs().init(jax.random.key(0), batch[0])["params"]
  tx = kfac_optax.scale_by_kfac(OnGraphs().apply, LOSS, example_batch=batch,
                                inputs=inputs, estimation="empirical")
  factors = tx.update(params, tx.init(params), params, batch=batch)[1].factors
  a_bar = np.concatenate([2.0 * np.asarray(x, np.float64), np.ones((len(x), 1))], 1)
  assert bf.relative_error(factors["Dense_0"].a[0], a_bar.T @ a_bar / len(x)) < 1e-5


class KeywordInputs(nn.Module):
  """Inputs by keyword only, as Flax's nlp_seq example's ``Transformer``."""

  @nn.compact
  def __call__(self, *, inputs, train):
    del train
    return nn.Dense(3)(inputs)


def test_a_model_with_keyword_inputs_is_named_with_the_wrapper():
  model = KeywordInputs()
  params = model.init(jax.random.key(0), inputs=BATCH[0], train=False)["params"]
  tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=BATCH,
                                apply_kwargs={"train": True})
  with pytest.raises(TypeError, match=re.escape(
      "KeywordInputs.__call__ cannot take K-FAC's call with the 1 positional "
      "input(s) that inputs= gives: too many positional arguments.\nFix: a "
      "model whose inputs are keywords needs an apply_fn that passes them on "
      "by name, e.g. apply_fn=lambda variables, inputs, **kwargs: "
      "model.apply(variables, inputs=inputs, **kwargs)")):
    tx.init(params)
  wrapped = kfac_optax.scale_by_kfac(
      lambda variables, inputs, **kwargs: model.apply(variables, inputs=inputs, **kwargs),
      LOSS, example_batch=BATCH, apply_kwargs={"train": True}, estimation="empirical")
  assert "Dense_0" in wrapped.update(params, wrapped.init(params), params,
                                     batch=BATCH)[1].factors
