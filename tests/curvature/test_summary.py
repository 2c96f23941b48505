"""kfac_optax.describe (the table of blocks) and init's fallback warning."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import kfac_optax
from kfac_optax._src.curvature.summary import Factor
from tests.models import test_lifted

LOSS = kfac_optax.losses.softmax_cross_entropy()


class Mixed(nn.Module):
  """One module of every kind (bounded by max_factor_dim=12 below)."""

  @nn.compact
  def __call__(self, ids):
    h = nn.LayerNorm(name="norm")(nn.Embed(50, 8, name="embed")(ids))
    h = jnp.tanh(nn.Dense(16, name="wide")(h))
    h = nn.Conv(12, (3,), feature_group_count=2, name="conv")(h)
    h = h @ self.param("raw", nn.initializers.normal(), (12, 16))
    h = nn.Dense(8, name="skipped")(nn.Dense(8, name="chosen")(h))
    return nn.Dense(5, name="out")(h.mean(1))


IDS = jnp.zeros((4, 6), jnp.int32)
BATCH = (IDS, jnp.zeros((4,), jnp.int32))
PARAMS = jax.eval_shape(Mixed().init, jax.random.key(0), IDS)["params"]
SETTINGS = dict(example_batch=BATCH, max_factor_dim=12,
                layer_overrides={"skipped": "skip", "chosen": "diagonal"})

TABLE = """\
module   block          factors                        params
-------  -------------  -----------------------------  ------
chosen   diagonal       bias diag 8 · kernel diag 128     136
conv     kron_in_diag   2 × (A diag 25 · G 6×6)           300
embed    embedding      A diag 50 · G 8×8                 400
norm     norm           bias diag 8 · scale diag 8         16
out      kronecker      A 9×9 · G 5×5                      45
(root)   fallback       raw diag 192                      192
skipped  skipped        -                                  72
wide     kron_out_diag  A 9×9 · G diag 16                 144

1,305 parameters:
    3.4%  kronecker       A ⊗ G, neither factor kept diagonal
   23.0%  kron_in_diag    diag(A) ⊗ G: input factor kept diagonal
   11.0%  kron_out_diag   A ⊗ diag(G): output factor kept diagonal
   30.7%  embedding       diag(A) ⊗ G, A the token frequencies
    1.2%  norm            exact diagonal Fisher of scale and bias
   10.4%  diagonal        diagonal Fisher, chosen by layer_overrides
   14.7%  fallback        diagonal Fisher: no layer block captures these params
    5.5%  skipped         not preconditioned (layer_overrides 'skip')"""


def test_table_lists_every_module_its_block_and_shares():
  summary = kfac_optax.describe(
      kfac_optax.scale_by_kfac(Mixed().apply, LOSS, **SETTINGS), PARAMS)
  assert str(summary) == TABLE
  assert summary.num_params == sum(p.size for p in jax.tree.leaves(PARAMS))
  assert summary.shares()["fallback"] == 192 / 1305
  conv = next(row for row in summary.rows if row.path == "conv")
  assert conv.factors == (Factor("A", 25, True), Factor("G", 6, False))
  assert conv.stacks == 2


def test_factors_kept_at_rank_show_it():
  # factor_rank=6: full factors above 6 rows (out's A 9, G 5 stays; embed's
  # G 8) are inverted at rank 6; diagonal ones are not factors to invert.
  text = str(kfac_optax.describe(kfac_optax.scale_by_kfac(
      Mixed().apply, LOSS, factor_rank=6, **SETTINGS), PARAMS))
  assert "A 9×9 rank 6 · G 5×5 " in text
  assert "A diag 50 · G 8×8 rank 6 " in text
  assert "2 × (A diag 25 · G 6×6)" in text
  assert "A 9×9 rank 6 · G diag 16" in text
  # The shares say how those factors are inverted, not that they are full.
  assert text.endswith("Factors marked rank 6: inverted at that rank (their top "
                       "eigenpairs, the other eigenvalues by their mean).")
  assert "full" not in text


@pytest.mark.parametrize("build", [
    lambda: optax.chain(optax.clip(1.0), kfac_optax.scale_by_kfac(
        Mixed().apply, LOSS, **SETTINGS), optax.sgd(0.1)),
    lambda: kfac_optax.kfac(Mixed().apply, LOSS, learning_rate=0.1, **SETTINGS),
    lambda: kfac_optax.Curvature(Mixed().apply, LOSS, **SETTINGS),
    lambda: optax.MultiSteps(kfac_optax.kfac(
        Mixed().apply, LOSS, learning_rate=0.1, **SETTINGS), every_k_schedule=2),
    lambda: optax.MultiSteps(kfac_optax.kfac(
        Mixed().apply, LOSS, learning_rate=0.1, **SETTINGS),
                             every_k_schedule=2).gradient_transformation(),
], ids=["chain", "kfac", "curvature", "multi_steps", "multi_steps_transformation"])
def test_describe_finds_the_curvature(build):
  assert str(kfac_optax.describe(build(), PARAMS)) == TABLE


def test_describe_without_kfac_names_the_fix():
  with pytest.raises(ValueError, match=r"kfac_optax.describe found no K-FAC "
                     r"curvature in the given GradientTransformationExtraArgs; pass "
                     r"the transformation returned by kfac or scale_by_kfac"):
    kfac_optax.describe(optax.sgd(0.1), PARAMS)


def test_scanned_layers_count_as_stacks():
  model = test_lifted.scanned_net(test_lifted.THREADED)
  x = jnp.zeros((2, 4))
  params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
  summary = kfac_optax.describe(kfac_optax.Curvature(
      model.apply, LOSS, example_batch=(x, jnp.zeros((2,), jnp.int32))), params)
  rows = {row.path: row for row in summary.rows}
  assert rows["stack/dense"].factor_text() == "3 × (A 5×5 · G 4×4)"
  assert rows["stack/dense"].num_params == 3 * 20
  assert rows["stack/norm"].kind == "norm"


class MostlyRaw(nn.Module):
  """A Dense layer and three raw matmuls that no layer block captures."""

  @nn.compact
  def __call__(self, x):
    h = x @ self.param("big", nn.initializers.normal(), (8, 64))
    h = h @ self.param("middle", nn.initializers.normal(), (64, 16))
    h = h @ self.param("small", nn.initializers.normal(), (16, 8))
    h = h + self.param("tiny", nn.initializers.zeros, (8,))
    return nn.Dense(3, name="head")(h)


def mostly_raw_tx(**kwargs):
  x = jnp.zeros((2, 8))
  return kfac_optax.scale_by_kfac(MostlyRaw().apply, LOSS,
                                  example_batch=(x, jnp.zeros((2,), jnp.int32)),
                                  **kwargs), jax.eval_shape(
                                      MostlyRaw().init, jax.random.key(0), x)["params"]


def test_init_warns_once_when_most_params_fall_back():
  tx, params = mostly_raw_tx()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.eval_shape(tx.init, params)  # init traced: no arrays made
  fallback = [w for w in caught if issubclass(w.category, kfac_optax.FallbackWarning)]
  assert len(fallback) == 1
  tx, params = mostly_raw_tx()  # a fresh init: eval_shape caches traces
  with pytest.warns(kfac_optax.FallbackWarning, match=(
      r"98% of the parameters get only K-FAC's diagonal fallback: no layer block "
      r"captures them. Largest: '\(root\)' \(1,672\)\. Layers under "
      r"nn.map_variables \(nn.WeightNorm, nn.SpectralNorm\) or whose own `param` "
      r"transforms their params \(a weight-standardised conv\) stay there by design, "
      r"and so do layers run through flax's bridges \(linen layers in "
      r"nnx.bridge.ToNNX, NNX ones in nnx.bridge.to_linen\); "
      r"if these are dense- or conv-like layers of your own, declare their module "
      r"class with kfac_optax.register_layer")):
    jax.eval_shape(tx.init, params)  # init traced: no arrays made


@pytest.mark.parametrize("wrap", [
    lambda tx: tx,
    lambda tx: optax.chain(optax.clip_by_global_norm(1.0), tx, optax.scale(-0.1)),
], ids=["alone", "in a chain"])
def test_init_warnings_name_the_users_line(wrap):
  tx, params = mostly_raw_tx(layer_overrides={"nothing/*": "diagonal"})
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.eval_shape(wrap(tx).init, params)
  assert {w.filename for w in caught} == {__file__}, [(w.filename, w.lineno) for w in caught]
  assert len(caught) == 2  # the unmatched pattern and the fallback share


class ThreeRaw(nn.Module):
  """Three submodules of raw matmuls and a Dense head."""

  @nn.compact
  def __call__(self, x):
    for name, width in (("a", 32), ("b", 24), ("c", 16), ("d", 8)):
      x = RawLayer(width, name=name)(x)
    return nn.Dense(3, name="head")(x)


class RawLayer(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    return x @ self.param("w", nn.initializers.normal(), (x.shape[-1], self.width))


def test_warning_names_the_three_largest_modules():
  x = jnp.zeros((2, 8))
  params = jax.eval_shape(ThreeRaw().init, jax.random.key(0), x)["params"]
  tx = kfac_optax.scale_by_kfac(ThreeRaw().apply, LOSS,
                                example_batch=(x, jnp.zeros((2,), jnp.int32)))
  with pytest.warns(kfac_optax.FallbackWarning,
                    match=r"Largest: 'b' \(768\), 'c' \(384\), 'a' \(256\)\."):
    jax.eval_shape(tx.init, params)  # init traced: no arrays made


class Wide(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, name="head")(jnp.tanh(nn.Dense(64, name="hidden")(x)))


def test_no_warning_for_diagonal_blocks_chosen_by_layer_overrides():
  x = jnp.zeros((2, 8))
  params = jax.eval_shape(Wide().init, jax.random.key(0), x)["params"]
  tx = kfac_optax.scale_by_kfac(Wide().apply, LOSS,
                                example_batch=(x, jnp.zeros((2,), jnp.int32)),
                                layer_overrides={"hidden": "diagonal"})
  with warnings.catch_warnings():
    warnings.simplefilter("error", kfac_optax.FallbackWarning)
    jax.eval_shape(tx.init, params)  # init traced: no arrays made
  assert kfac_optax.describe(tx, params).shares()["diagonal"] > 0.5


class TiedLM(nn.Module):
  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(20, 8, name="embed")
    return embed.attend(jnp.tanh(nn.Dense(8, name="mix")(embed(ids))))


def test_tied_embedding_row():
  ids = jnp.zeros((2, 5), jnp.int32)
  params = jax.eval_shape(TiedLM().init, jax.random.key(0), ids)["params"]
  summary = kfac_optax.describe(kfac_optax.Curvature(
      TiedLM().apply, LOSS, example_batch=(ids, ids)), params)
  assert [(r.path, r.kind, r.factor_text(), r.num_params) for r in summary.rows] == [
      ("embed", "tied embedding", "A diag 20 · G 8×8", 160),
      ("mix", "kronecker", "A 9×9 · G 8×8", 72)]


def test_init_warns_about_a_layer_overrides_pattern_that_matches_nothing():
  tx = kfac_optax.scale_by_kfac(
      Mixed().apply, LOSS, **{**SETTINGS, "layer_overrides": {
          "out": "diagonal", "RNN_0/*": "skip", "decoder/*": "diagonal"}})
  with pytest.warns(UserWarning, match=r"layer_overrides patterns \['RNN_0/\*', "
                    r"'decoder/\*'\] match no module path of this model, so they "
                    r"change nothing. Module paths: \['', 'chosen', 'conv', "):
    tx.init(jax.tree.map(jnp.zeros_like, PARAMS))
