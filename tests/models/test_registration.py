"""Third-party layers: register_layer with param names and kernel layouts, and
tied embeddings applied through a submodule's own ``.apply``.

The model is GPT-2 as Hugging Face writes it in Flax, shrunk: projections
are ``Conv1D`` (a Dense whose kernel is stored ``(out, in)`` and applied as
``x @ kernel.T + bias``), and the LM head is an ``nn.Dense`` run with
``lm_head.apply({"params": {"kernel": wte.T}}, h)`` (tie_word_embeddings).
The reference is a forward pass written out with a zero perturbation on each
layer output; factors and damped Kronecker solves are numpy (brute_force).
"""

import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_optax
from kfac_optax._src.models import registry
from examples.models import FlaxConv1D as Conv1D  # Hugging Face's layout
from tests import brute_force as bf
from tests.conftest import restored_layer_registry
from tests.blocks.test_layers import DAMPING, LOSS, assert_block, dense_reference, f64
from tests.blocks.test_layers import random_tree, summed_nll

VOCAB, WIDTH, HIDDEN, N, T = 7, 4, 6, 3, 5
TIED = {"lm_head": "transformer/wte"}


class Block(nn.Module):
  def setup(self):
    self.c_fc = Conv1D(HIDDEN)
    self.c_proj = Conv1D(WIDTH, use_bias=False)

  def __call__(self, h):
    return h + self.c_proj(jnp.tanh(self.c_fc(h)))


class Transformer(nn.Module):
  def setup(self):
    self.wte = nn.Embed(VOCAB, WIDTH)
    self.h = Block()

  def __call__(self, tokens):
    return self.h(self.wte(tokens))


class LMHead(nn.Module):
  """The tied head exactly as FlaxGPT2LMHeadModule writes it."""

  def setup(self):
    self.transformer = Transformer()
    self.lm_head = nn.Dense(VOCAB, use_bias=False)

  def __call__(self, tokens):
    h = self.transformer(tokens)
    kernel = self.transformer.variables["params"]["wte"]["embedding"].T
    return self.lm_head.apply({"params": {"kernel": kernel}}, h)


def conv1d_layout(module, x, y):
  """The layout-function form of the registration below."""
  del module
  return kfac_optax.layouts.dense(x.shape[-1], y.shape[-1], kernel_order="out_in")


def problem():
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, VOCAB, (N, T)), jnp.int32)
  labels = jnp.asarray(rng.integers(0, VOCAB, (N, T)), jnp.int32)
  shapes = jax.eval_shape(LMHead().init, jax.random.key(0), tokens)["params"]
  return random_tree(shapes, seed=1, scale=0.5), (tokens, labels)


def kfac_update(params, batch, grads, **kwargs):
  tx = kfac_optax.scale_by_kfac(
      LMHead().apply, LOSS, example_batch=batch, estimation="empirical",
      inverse_update_period=1, damping=DAMPING, **kwargs)
  step = jax.jit(lambda g, p, b: tx.update(g, tx.init(p), p, batch=b))
  return step(grads, params, batch)


def forward(params, tokens, perturbations):
  """The model written out, a perturbation added to every layer output."""
  table = params["transformer"]["wte"]["embedding"]
  block = params["transformer"]["h"]
  e = table[tokens] + perturbations["wte"]
  fc = e @ block["c_fc"]["kernel"].T + block["c_fc"]["bias"] + perturbations["c_fc"]
  act = jnp.tanh(fc)
  h = e + act @ block["c_proj"]["kernel"].T + perturbations["c_proj"]
  logits = h @ table.T + perturbations["lm_head"]
  return logits, {"wte": e, "c_fc": act, "lm_head": h}


@pytest.fixture(scope="module")
def registered_run():
  """One K-FAC update of the registered model, and its brute-force inputs."""
  with restored_layer_registry():
    kfac_optax.register_layer(Conv1D, "dense", kernel_layout="out_in")
    params, batch = problem()
    grads = random_tree(params, seed=2)
    out, state = kfac_update(params, batch, grads, tied_embeddings=TIED)
  return params, batch, grads, out, state


def test_hf_style_gpt2_gets_kronecker_and_tied_blocks_matching_brute_force(
    registered_run):
  params, (tokens, labels), grads, out, state = registered_run
  assert set(state.factors) == {"transformer/wte", "transformer/h/c_fc",
                                "transformer/h/c_proj"}  # no diagonal fallback

  zeros = {"wte": jnp.zeros((N, T, WIDTH)), "c_fc": jnp.zeros((N, T, HIDDEN)),
           "c_proj": jnp.zeros((N, T, WIDTH)), "lm_head": jnp.zeros((N, T, VOCAB))}
  def loss(perturbations):
    logits, inputs = forward(params, tokens, perturbations)
    return summed_nll(logits.reshape(-1, VOCAB), labels.reshape(-1)), (logits, inputs)
  out_grads, (logits, inputs) = jax.jit(jax.grad(loss, has_aux=True))(zeros)
  np.testing.assert_allclose(logits, LMHead().apply({"params": params}, tokens),
                             atol=1e-5)
  num_terms = N * T

  # Conv1D: the Kronecker block of x W + b with W = kernelᵀ, (in, out).
  block = params["transformer"]["h"]
  for name, layer_input in (("c_fc", inputs["wte"]), ("c_proj", inputs["c_fc"])):
    layer_grads = grads["transformer"]["h"][name]
    flipped = {**layer_grads, "kernel": f64(layer_grads["kernel"]).T}
    factors, update = dense_reference(layer_input, out_grads[name], num_terms, flipped)
    update["kernel"] = update["kernel"].T
    assert update["kernel"].shape == block[name]["kernel"].shape
    assert_block(state.factors[f"transformer/h/{name}"],
                 out["transformer"]["h"][name], factors, update)

  # The table E has two uses: lookups and the tied head's logits h Eᵀ.
  one_hot = np.eye(VOCAB)[np.asarray(tokens).reshape(-1)]
  lookup_g = f64(out_grads["wte"]).reshape(-1, WIDTH)
  logits_g = f64(out_grads["lm_head"]).reshape(-1, VOCAB)
  queries = f64(inputs["lm_head"]).reshape(-1, WIDTH)
  uses = [(one_hot.mean(0), lookup_g.T @ lookup_g / num_terms),
          ((logits_g**2).sum(0) / num_terms, queries.T @ queries / len(queries))]
  a, g = bf.combined_kronecker(uses)
  expected = bf.kronecker_precondition(
      np.diag(a), g, grads["transformer"]["wte"]["embedding"], None, DAMPING)
  embedding = state.factors["transformer/wte"]
  assert bf.relative_error(embedding.a, np.stack([d for d, _ in uses])) < 1e-4
  assert bf.relative_error(embedding.g, np.stack([f for _, f in uses])) < 1e-4
  assert bf.relative_error(out["transformer"]["wte"],
                           {"embedding": expected["kernel"]}) < 1e-3


def test_non_square_out_in_kernels_go_through_apply_updates(registered_run):
  params, _, _, out, _ = registered_run
  new = optax.apply_updates(params, jax.tree.map(lambda u: -0.1 * u, out))
  assert jax.tree.map(jnp.shape, new) == jax.tree.map(jnp.shape, params)
  assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(new))


def test_layout_function_registration_matches_the_named_layout(registered_run):
  params, batch, grads, expected, _ = registered_run
  kfac_optax.register_layer(Conv1D, conv1d_layout)
  out, state = kfac_update(params, batch, grads, tied_embeddings=TIED)
  assert "transformer/h/c_fc" in state.factors
  assert bf.relative_error(out, jax.tree.map(f64, expected)) < 1e-6


def test_misdeclared_layout_is_an_init_error():
  params, batch = problem()
  kfac_optax.register_layer(Conv1D, "dense")  # the kernel is really (out, in)
  tx = kfac_optax.scale_by_kfac(LMHead().apply, LOSS, example_batch=batch,
                                tied_embeddings=TIED)
  with pytest.raises(ValueError) as error:
    tx.init(params)
  assert str(error.value) == (
      "the layer at 'transformer/h/c_fc' has param 'kernel' of shape (6, 4), but "
      "its captured input and output (in_dim=4, out_dim=6) need (4, 6) with "
      "kernel_layout='in_out'; K-FAC never reshapes a kernel to fit.\nFix: "
      "register the layer with the layout its kernel is stored in, e.g. "
      "kfac_optax.register_layer(TheLayer, 'dense', kernel_layout='out_in') for "
      "a kernel stored (out, in), or give it the diagonal block with "
      "layer_overrides={'transformer/h/c_fc': 'diagonal'}.")


def test_misnamed_kernel_is_an_init_error():
  params, batch = problem()
  kfac_optax.register_layer(Conv1D, "dense", kernel="weight", kernel_layout="out_in")
  tx = kfac_optax.scale_by_kfac(LMHead().apply, LOSS, example_batch=batch,
                                tied_embeddings=TIED)
  with pytest.raises(ValueError, match=(
      r"^the layer at 'transformer/h/c_fc' has no kernel param 'weight' \(its "
      r"params: \['bias', 'kernel'\]\).\nFix: name the layer's params in its "
      r"registration, e.g. kfac_optax.register_layer\(TheLayer, 'dense', "
      r"kernel='weight', bias='bias'\)")):
    tx.init(params)


class Linear(nn.Module):
  """A PyTorch-style linear layer: params "weight" (out, in) and "offset"."""
  features: int

  @nn.compact
  def __call__(self, x):
    weight = self.param("weight", nn.initializers.normal(), (self.features, x.shape[-1]))
    return x @ weight.T + self.param("offset", nn.initializers.zeros, (self.features,))


class LinearNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    return Linear(3, name="out")(jnp.tanh(Linear(5, name="hidden")(x)))


def test_param_names_map_onto_the_same_block_as_flax_names():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
  batch = (x, jnp.asarray(rng.integers(0, 3, 6), jnp.int32))
  params = random_tree(jax.eval_shape(LinearNet().init, jax.random.key(0), x)["params"], 4)
  grads = random_tree(params, seed=5)
  as_dense = {layer: {"kernel": p["weight"].T, "bias": p["offset"]}
              for layer, p in params.items()}
  dense_grads = {layer: {"kernel": g["weight"].T, "bias": g["offset"]}
                 for layer, g in grads.items()}
  dense_net = nn.Sequential([nn.Dense(5, name="hidden"), jnp.tanh, nn.Dense(3, name="out")])

  kfac_optax.register_layer(Linear, "dense", kernel="weight", bias="offset",
                            kernel_layout="out_in")
  def update(model, p, g):
    tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=batch,
                                  estimation="empirical", damping=DAMPING)
    return jax.jit(lambda p, g: tx.update(g, tx.init(p), p, batch=batch))(p, g)
  out, state = update(LinearNet(), params, grads)
  expected, expected_state = update(dense_net, {"layers_0": as_dense["hidden"],
                                                "layers_2": as_dense["out"]},
                                    {"layers_0": dense_grads["hidden"],
                                     "layers_2": dense_grads["out"]})
  for layer, flax_name in (("hidden", "layers_0"), ("out", "layers_2")):
    assert bf.relative_error(state.factors[layer], expected_state.factors[flax_name]) < 1e-5
    assert bf.relative_error(
        {"kernel": out[layer]["weight"].T, "bias": out[layer]["offset"]},
        jax.tree.map(f64, expected[flax_name])) < 1e-5


class Projection(nn.Module):
  """An einsum layer of a model zoo: its equation an attribute, kernel "w"."""
  einsum_str: str
  shape: tuple

  @nn.compact
  def __call__(self, x):
    return jnp.einsum(self.einsum_str, x, self.param("w", nn.initializers.normal(),
                                                     self.shape))


class GemmaEinsum(nn.Module):
  """Gemma's einsum layer: the equation is the call's first argument."""
  shape: tuple

  @nn.compact
  def __call__(self, eqn, x):
    return jnp.einsum(eqn, x, self.param("w", nn.initializers.normal(), self.shape))


class MeanOver(nn.Module):
  """``call(layer, x)`` averaged over its last axis."""
  layer: nn.Module
  call: Any = lambda layer, x: layer(x)

  def __call__(self, x):
    return self.call(self.layer, x).mean(-1)


EQUATION, EINSUM_SHAPE = "bd,dhk->bkh", (4, 3, 3)
ZOO_EINSUMS = {
    "equation_an_attribute": (Projection, {},
                              lambda: MeanOver(Projection(EQUATION, EINSUM_SHAPE))),
    "equation_per_call_first": (
        GemmaEinsum, {"equation": "eqn"},
        lambda: MeanOver(GemmaEinsum(EINSUM_SHAPE), lambda layer, x: layer(EQUATION, x))),
}


@pytest.mark.parametrize("style", list(ZOO_EINSUMS))
def test_einsum_kind_with_a_param_name_is_the_flax_einsum_block(style):
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
  batch = (x, jnp.asarray(rng.integers(0, 3, 6), jnp.int32))
  grads = {"w": random_tree({"w": jnp.zeros(EINSUM_SHAPE)}, 5)["w"]}
  kernel = random_tree({"w": jnp.zeros(EINSUM_SHAPE)}, 4)["w"]

  module_class, options, model = ZOO_EINSUMS[style]
  kfac_optax.register_layer(module_class, "einsum", kernel="w", bias=None, **options)
  def update(model, p, g):
    tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=batch,
                                  estimation="empirical", damping=DAMPING)
    return jax.jit(lambda p, g: tx.update(g, tx.init(p), p, batch=batch))(p, g)
  out, state = update(model(), {"layer": {"w": kernel}}, {"layer": grads})
  expected, expected_state = update(
      MeanOver(nn.Einsum(EINSUM_SHAPE, EQUATION, use_bias=False)),
      {"layer": {"kernel": kernel}}, {"layer": {"kernel": grads["w"]}})
  assert state.factors["layer"].a.shape == (1, 4, 4)
  assert bf.relative_error(state.factors, expected_state.factors) < 1e-5
  assert bf.relative_error(out["layer"]["w"], expected["layer"]["kernel"]) < 1e-5


def test_tied_head_without_declaration_warns_once_and_still_trains():
  params, batch = problem()
  kfac_optax.register_layer(Conv1D, "dense", kernel_layout="out_in")
  tx = kfac_optax.scale_by_kfac(LMHead().apply, LOSS, example_batch=batch)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state = tx.init(params)
    updates, _ = jax.eval_shape(
        lambda s: tx.update(params, s, params, batch=batch, rng=jax.random.key(0)),
        state)
  messages = [str(w.message) for w in caught]
  assert len(messages) == 1, messages  # init's, and not update's
  assert messages[0].startswith(
      "K-FAC gives these captured layer calls no block of their own: 'lm_head'. "
      "Their params are not leaves of the params tree")
  assert messages[0].endswith(
      "pass tied_embeddings={'lm_head': 'transformer/wte'} to fold it into that "
      "embedding's block.")
  assert set(state.factors) == {"transformer/wte", "transformer/h/c_fc",
                                "transformer/h/c_proj"}
  assert state.factors["transformer/wte"].a.shape == (1, VOCAB)  # lookups only
  assert jax.tree.map(jnp.shape, updates) == jax.tree.map(jnp.shape, params)


@pytest.mark.parametrize("tied, message", [
    ({"lm_head": "transformer/h/c_fc"},
     "tied_embeddings['lm_head'] = 'transformer/h/c_fc' is not a captured nn.Embed; "),
    ({"transformer/h/c_fc": "transformer/wte"},
     "tied_embeddings: 'transformer/h/c_fc' is not a captured layer call without "
     "params of its own; "),
])
def test_wrong_tied_embeddings_are_init_errors(tied, message):
  params, batch = problem()
  kfac_optax.register_layer(Conv1D, "dense", kernel_layout="out_in")
  tx = kfac_optax.scale_by_kfac(LMHead().apply, LOSS, example_batch=batch,
                                tied_embeddings=tied)
  with pytest.raises(ValueError) as error:
    tx.init(params)
  assert str(error.value).startswith(message)


@pytest.mark.parametrize("args, kwargs, error, message", [
    ((Conv1D(3), "dense"), {}, TypeError,
     "register_layer's module_class must be a flax nn.Module or nnx.Module "
     "subclass (the class, not an instance), got FlaxConv1D("),
    ((Conv1D, "linear"), {}, ValueError,
     "register_layer: unknown kind 'linear'; built-in kinds: ['conv', "
     "'conv_transpose', 'dense', 'dense_general', 'einsum', 'embed', 'norm'], or "
     "pass a layout function"),
    ((Conv1D, "dense"), {"kernel_layout": "io"}, ValueError,
     "register_layer: kernel_layout='io' is not one of ('in_out', 'out_in') for "
     "kind 'dense'"),
    ((Conv1D, "conv"), {"kernel_layout": "out_in"}, ValueError,
     "register_layer: kernel_layout='out_in' is not one of ('in_out',) for kind 'conv'"),
    ((Conv1D, "embed"), {"kernel": "table"}, ValueError,
     "register_layer: kernel=, bias= and kernel_layout= apply to the kinds "
     "('dense', 'dense_general', 'conv', 'conv_transpose', 'einsum'), not 'embed'"),
    ((Conv1D, conv1d_layout), {"bias": None}, ValueError,
     "register_layer: kernel=, bias= and kernel_layout= go with a kind name; a "
     "layout function sets them on the layout it returns"),
    ((Conv1D, "dense"), {"equation": "eqn"}, ValueError,
     "register_layer: equation= applies to the kind 'einsum', not 'dense'"),
    ((Conv1D, "einsum"), {"equation": "eqn"}, ValueError,
     "register_layer: equation='eqn' names no argument of FlaxConv1D.__call__"),
])
def test_register_layer_rejects_bad_arguments(args, kwargs, error, message):
  with pytest.raises(error) as raised:
    kfac_optax.register_layer(*args, **kwargs)
  assert str(raised.value).startswith(message)
  assert Conv1D not in registry._REGISTRY  # pylint: disable=protected-access
