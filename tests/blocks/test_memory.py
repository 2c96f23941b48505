"""Convolution statistics stay within bounded memory (chunked im2col)."""

import dataclasses

import jax
import jax.numpy as jnp

from kfac_optax._src import blocks
from kfac_optax._src import layouts
from kfac_optax._src import losses

CONV = layouts.ConvLayout(kernel_size=(3, 3), strides=(1, 1), input_dilation=(1, 1),
                          kernel_dilation=(1, 1), padding="SAME", pre_padding=None,
                          in_channels=64, out_channels=64)


class Unchunked(layouts.ConvLayout):
  expands_input = False  # what the statistics would cost without chunking


def temporary_bytes(layout):
  """XLA's buffer assignment for the statistics pass of one conv call."""
  block = blocks.KroneckerBlock(layout, has_bias=True)
  inputs = jax.ShapeDtypeStruct((256, 32, 32, 64), jnp.float32)
  output_grads = jax.ShapeDtypeStruct((1, 256, 32, 32, 64), jnp.float32)
  compiled = jax.jit(
      lambda x, g: block.statistics((x,), (g,), losses.Terms(256))
  ).lower(inputs, output_grads).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_conv_statistics_peak_memory_under_twice_the_activations():
  activation_bytes = 256 * 32 * 32 * 64 * 4  # the captured input, 64 MiB
  assert temporary_bytes(CONV) < 2 * activation_bytes
  # The full patch matrix (~9x the activations) would not fit the bound.
  assert temporary_bytes(Unchunked(**dataclasses.asdict(CONV))) > 8 * activation_bytes
