"""The networks the examples train (the benchmarks and tests train them too).

- `MLP` / `NnxMLP`: the main example's classifier (``mlp_classifier.py``,
  ``data_parallel.py``), in Flax linen and in Flax NNX.
- `ConvNet` / `NnxConvNet`: the TensorFlow K-FAC example's convnet
  (``convnet.py``).
- `TransformerLM`: the character-level transformer (``transformer_lm.py``).
- `FlaxConv1D`: Hugging Face's ``Conv1D`` layout, a Dense layer whose kernel
  is stored ``(out, in)`` (``gpt2_hf_style.py``).
"""

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp

ACTIVATIONS = {"relu": nn.relu, "tanh": jnp.tanh}


class MLP(nn.Module):
  """Fully connected classifier: features -> 256 -> 128 -> classes, tanh."""
  num_classes: int = 10
  hidden: tuple[int, ...] = (256, 128)
  dtype: jnp.dtype = jnp.float32  # params and activations

  @nn.compact
  def __call__(self, x):
    dense = lambda width: nn.Dense(width, dtype=self.dtype, param_dtype=self.dtype)
    for width in self.hidden:
      x = jnp.tanh(dense(width)(x))
    return dense(self.num_classes)(x)


class NnxMLP(nnx.Module):
  """`MLP` as an ``nnx.Module``: the same layers, widths and initializers."""

  def __init__(self, num_features: int, num_classes: int = 10,
               hidden: tuple[int, ...] = (256, 128), *, rngs: nnx.Rngs):
    widths = (num_features, *hidden)
    self.hidden = nnx.List([nnx.Linear(a, b, rngs=rngs)
                            for a, b in zip(widths[:-1], widths[1:])])
    self.head = nnx.Linear(widths[-1], num_classes, rngs=rngs)

  def __call__(self, x):
    for layer in self.hidden:
      x = jnp.tanh(layer(x))
    return self.head(x)


class ConvNet(nn.Module):
  """conv 5x5 → pool 3x3/2 → conv 5x5 → pool 3x3/2 → linear, channels last.

  Works on any square (or not) ``(N, H, W, C)`` input: 28x28 Fashion-MNIST
  ends in a 7x7x16 feature map, 8x8 digits in a 2x2x16 one.
  """
  num_classes: int = 10
  features: int = 16
  activation: str = "relu"

  @nn.compact
  def __call__(self, x):
    act = ACTIVATIONS[self.activation]
    for _ in range(2):
      x = act(nn.Conv(self.features, (5, 5), padding="SAME")(x))
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))


class NnxConvNet(nnx.Module):
  """`ConvNet` as an ``nnx.Module`` for ``(N, height, width, 1)`` images."""

  def __init__(self, height: int, width: int, num_classes: int = 10,
               features: int = 16, activation: str = "relu", *,
               rngs: nnx.Rngs):
    self.convs = nnx.List([nnx.Conv(1, features, (5, 5), padding="SAME",
                                    rngs=rngs),
                           nnx.Conv(features, features, (5, 5), padding="SAME",
                                    rngs=rngs)])
    # Each SAME pool of stride 2 halves a side, rounding up.
    flat = -(-height // 4) * -(-width // 4) * features
    self.dense = nnx.Linear(flat, num_classes, rngs=rngs)
    self.activation = activation

  def __call__(self, x):
    act = ACTIVATIONS[self.activation]
    for conv in self.convs:
      x = nnx.max_pool(act(conv(x)), (3, 3), strides=(2, 2), padding="SAME")
    return self.dense(x.reshape(x.shape[0], -1))


class Block(nn.Module):
  """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""
  width: int
  num_heads: int
  mlp_ratio: int = 4

  @nn.compact
  def __call__(self, x, mask):
    h = nn.LayerNorm(name="ln_attention")(x)
    x = x + nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, qkv_features=self.width,
        deterministic=True, name="attention")(h, mask=mask)
    h = nn.LayerNorm(name="ln_mlp")(x)
    h = nn.gelu(nn.Dense(self.mlp_ratio * self.width, name="mlp_in")(h))
    return x + nn.Dense(self.width, name="mlp_out")(h)


class TransformerLM(nn.Module):
  """Causal character model: ``(B, T)`` ids -> ``(B, T, vocab)`` logits.

  Token embedding plus learned position embedding, ``num_blocks`` `Block`s
  of causal multi-head self-attention and a ``mlp_ratio``-wide MLP, a final
  LayerNorm and a dense readout to the vocabulary.
  """
  vocab_size: int
  max_length: int
  width: int = 64
  num_heads: int = 4
  num_blocks: int = 2

  @nn.compact
  def __call__(self, tokens):
    # Positions as a (B, T) lookup (not a shared (T,) one), so each example's
    # positions are rows of the embedding's K-FAC statistics.
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
    x = (nn.Embed(self.vocab_size, self.width, name="token_embedding")(tokens)
         + nn.Embed(self.max_length, self.width, name="position_embedding")(positions))
    mask = nn.make_causal_mask(tokens)  # (B, 1, T, T)
    for i in range(self.num_blocks):
      x = Block(self.width, self.num_heads, name=f"block_{i}")(x, mask)
    x = nn.LayerNorm(name="ln_final")(x)
    return nn.Dense(self.vocab_size, name="readout")(x)


class FlaxConv1D(nn.Module):
  """A Dense layer with its kernel stored ``(features, in_features)``.

  Hugging Face's Flax ``Conv1D`` (GPT-2's projections): applied as
  ``x @ kernel.T + bias``. K-FAC takes it once told so::

    kfac_optax.register_layer(FlaxConv1D, "dense", kernel_layout="out_in")
  """
  features: int
  use_bias: bool = True

  @nn.compact
  def __call__(self, inputs):
    kernel = self.param("kernel", nn.initializers.normal(0.02),
                        (self.features, inputs.shape[-1]))
    y = jax.lax.dot_general(inputs, kernel.T, (((inputs.ndim - 1,), (0,)), ((), ())))
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros, (self.features,))
    return y
