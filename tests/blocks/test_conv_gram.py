"""The translated convolution Gram (`kfac_optax.conv_gram`).

Its reference is the Gram of flax's own convolution with an identity kernel:
output channel ``j`` of group ``g`` reads tap-and-channel ``j`` of the
group's patch, so the layer's output rows are its im2col patches, with
flax's padding modes, strides and dilations, and no use of kfac_optax's
layouts. The Gram is then formed in float64 numpy.
"""

from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfac_optax._src import blocks
from kfac_optax._src import layouts
from kfac_optax._src import losses
from kfac_optax._src.blocks import conv_gram
from kfac_optax._src.blocks import kronecker
from kfac_optax._src.models import kinds

CASES = {
    "2d_same": dict(shape=(3, 6, 5, 2), kernel_size=(3, 3), padding="SAME"),
    "2d_kernel_dilation_groups_strided_columns": dict(
        shape=(2, 7, 6, 4), kernel_size=(3, 2), padding=((2, 1), (0, 1)),
        kernel_dilation=(2, 1), strides=(1, 2), feature_group_count=2),
    "1d_causal_kernel_dilation": dict(shape=(3, 6, 3), kernel_size=(3,), padding="CAUSAL",
                                      kernel_dilation=2),
    "1d_input_dilation": dict(shape=(3, 5, 2), kernel_size=(4,), padding=((2, 1),),
                              input_dilation=2),
    # Two output rows: fewer than the kernel's reach, so edges overlap.
    "2d_circular_map_smaller_than_kernel": dict(shape=(2, 2, 3, 2), kernel_size=(3, 3),
                                                padding="CIRCULAR"),
    "2d_negative_padding": dict(shape=(2, 7, 5, 2), kernel_size=(2, 3),
                                padding=((-1, 2), (1, 1))),
    "3d_reflect": dict(shape=(2, 4, 3, 3, 2), kernel_size=(3, 2, 2), padding="REFLECT"),
    "2d_leading_batch_axes": dict(shape=(2, 2, 5, 4, 2), kernel_size=(3, 3),
                                  padding="SAME"),
}


def identity_conv(config):
  """(nn.Conv, its params): a convolution whose outputs are its patches."""
  shape, config = config["shape"], {k: v for k, v in config.items() if k != "shape"}
  groups = config.get("feature_group_count", 1)
  width = int(np.prod(config["kernel_size"])) * shape[-1] // groups
  module = nn.Conv(features=groups * width, use_bias=False, **config)
  identity = np.eye(width, dtype=np.float32).reshape(
      *config["kernel_size"], shape[-1] // groups, width)
  return module, {"params": {"kernel": jnp.asarray(np.tile(identity, groups))}}


def reference_gram(config, x, example_weights, has_bias):
  """``Σ_n w_n Σ_rows ā āᵀ`` per group from the identity convolution's rows."""
  module, params = identity_conv(config)
  groups = module.feature_group_count
  rows = np.asarray(module.apply(params, x), np.float64)
  rows = rows.reshape(len(example_weights), -1, groups, rows.shape[-1] // groups)
  if has_bias:
    rows = np.concatenate([rows, np.ones_like(rows[..., :1])], -1)
  return np.einsum("nrgi,n,nrgj->gij", rows, example_weights, rows)


@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_translated_gram_equals_the_patch_gram(case, has_bias):
  config = CASES[case]
  x = jax.random.normal(jax.random.PRNGKey(0), config["shape"])
  module, params = identity_conv(config)
  layout = kinds._conv(module, x, None)  # pylint: disable=protected-access
  examples = int(np.prod(config["shape"][:-len(config["kernel_size"]) - 1]))
  example_weights = np.linspace(0.5, 2.0, examples)
  rows_per_example = module.apply(params, x)[..., 0].size // examples

  gram = jax.jit(conv_gram.input_gram, static_argnums=(0, 3))(
      layout, x, jnp.repeat(jnp.asarray(example_weights, jnp.float32), rows_per_example),
      has_bias)
  expected = reference_gram(config, x, example_weights, has_bias)
  assert gram.shape == expected.shape
  np.testing.assert_allclose(gram, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_applies_where_blocks_share_a_diagonal_and_are_wide():
  conv = lambda x, **kw: kinds._conv(  # pylint: disable=protected-access
      nn.Conv(features=3, **{"kernel_size": (3, 3), **kw}), x, None)
  x = jnp.zeros((4, 5, 5, 16))  # blocks of 3 x 16 columns
  terms = losses.Terms(count=4)
  assert conv_gram.applies(conv(x), x.shape, terms, False)
  assert conv_gram.applies(conv(x, strides=(1, 2)), x.shape, terms, False)
  # A per-example mask weights whole examples: it still applies.
  assert conv_gram.applies(conv(x), x.shape, terms._replace(mask=jnp.ones(4)), False)
  assert not conv_gram.applies(conv(x), x.shape, terms._replace(mask=jnp.ones((4, 5))), False)
  assert not conv_gram.applies(conv(x, strides=(2, 1)), x.shape, terms, False)
  assert not conv_gram.applies(conv(x, kernel_size=(1, 3)), x.shape, terms, False)
  assert not conv_gram.applies(conv(x), x.shape, terms, True)  # a diagonal factor
  narrow = x[..., :4]  # blocks of 3 x 4 columns: the whole Gram is as fast
  assert not conv_gram.applies(conv(narrow), narrow.shape, terms, False)
  assert not conv_gram.applies(layouts.dense(2, 3), (4, 2), terms, False)


def test_block_statistics_in_chunks_and_under_a_mask_match_the_whole_patches():
  """The block's chunked scan (several chunks) and per-example mask feed the
  translated Gram the same rows and weights as the plain patch Gram."""
  x = jax.random.normal(jax.random.PRNGKey(1), (6, 5, 4, 11))
  module = nn.Conv(features=4, kernel_size=(3, 3), padding="SAME")
  block = blocks.KroneckerBlock(kinds._conv(module, x, None), True)  # pylint: disable=protected-access
  terms = losses.Terms(count=4.0, mask=jnp.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]))
  assert conv_gram.applies(block.layout, x.shape, terms, False)
  factor = lambda: jax.jit(lambda x: block.input_factor([x], terms))(x)
  with mock.patch.object(kronecker, "_min_chunk_floats", lambda: 1):  # one example per chunk
    chunked = factor()
    with mock.patch.object(conv_gram, "applies", lambda *args: False):
      expected = factor()
  np.testing.assert_allclose(chunked, expected, rtol=1e-5, atol=1e-6)
  # Masked examples are left out: the factor of the unmasked ones alone.
  kept = block.input_factor([x[jnp.array([0, 2, 3, 5])]], losses.Terms(count=4.0))
  np.testing.assert_allclose(chunked, kept, rtol=1e-5, atol=1e-6)
