"""The networks the examples train (the benchmarks and tests train them too).

- `MLP` / `NnxMLP`: the main example's classifier (``mlp_classifier.py``,
  ``data_parallel.py``), in Flax linen and in Flax NNX.
- `ConvNet` / `NnxConvNet`: the TensorFlow K-FAC example's convnet
  (``convnet.py``).
- `TransformerLM`: the character-level transformer (``transformer_lm.py``).
- `FlaxConv1D`: Hugging Face's ``Conv1D`` layout, a Dense layer whose kernel
  is stored ``(out, in)`` (``gpt2_hf_style.py``).
- `DecoderLM`: a decoder-only transformer whose params carry logical axis
  names, placed by `FSDP_TP_RULES` (``benchmarks/sharded_state.py``).
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


# Logical axis names of `DecoderLM`'s params, and where a sharded job puts
# them on a ("data", "model") mesh: FSDP splits the embedding axis over
# "data", tensor parallelism the heads, the MLP and the vocabulary over
# "model" (Megatron's column- and row-parallel layers). The key/value heads
# of grouped attention are fewer than the query heads, so they stay whole.
FSDP_TP_RULES = (("embed", "data"), ("heads", "model"), ("mlp", "model"),
                 ("vocab", "model"), ("kv_heads", None), ("head_dim", None))


def rotary(x: jax.Array) -> jax.Array:
  """Rotary position embedding of ``(batch, position, heads, head_dim)``:
  each pair of features turned by an angle that grows with the position."""
  half = x.shape[-1] // 2
  frequencies = 10_000.0 ** (-jnp.arange(half) / half)
  angles = jnp.arange(x.shape[1])[:, None] * frequencies  # (position, half)
  cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
  first, second = x[..., :half], x[..., half:]
  return jnp.concatenate([first * cos - second * sin, first * sin + second * cos], -1)


class DecoderBlock(nn.Module):
  """Pre-norm decoder block: RMSNorm, grouped-query causal attention with
  rotary positions, RMSNorm, gated (SwiGLU) MLP; no biases. Every param
  carries logical axis names (`FSDP_TP_RULES`)."""
  width: int
  heads: int
  kv_heads: int
  mlp: int

  @nn.compact
  def __call__(self, x):
    init, head_dim = nn.initializers.lecun_normal(), self.width // self.heads
    dense = lambda features, names, axis=-1: nn.DenseGeneral(
        features, axis=axis, use_bias=False,
        kernel_init=nn.with_logical_partitioning(init, names))
    norm = lambda: nn.RMSNorm(scale_init=nn.with_logical_partitioning(
        nn.initializers.ones, ("embed",)))
    h = norm()(x)
    q = rotary(dense((self.heads, head_dim), ("embed", "heads", "head_dim"))(h))
    k = rotary(dense((self.kv_heads, head_dim), ("embed", "kv_heads", "head_dim"))(h))
    v = dense((self.kv_heads, head_dim), ("embed", "kv_heads", "head_dim"))(h)
    group = self.heads // self.kv_heads
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim)
    positions = jnp.arange(x.shape[1])
    logits = jnp.where(positions[:, None] >= positions, logits, -1e9)
    attended = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v)
    x = x + dense(self.width, ("heads", "head_dim", "embed"), axis=(-2, -1))(attended)
    h = norm()(x)
    gated = nn.silu(dense(self.mlp, ("embed", "mlp"))(h)) * dense(self.mlp, ("embed", "mlp"))(h)
    return x + dense(self.width, ("mlp", "embed"))(gated)


class DecoderLM(nn.Module):
  """Decoder-only transformer LM of `DecoderBlock`s, token embedding and an
  untied output head, every param with logical axis names."""
  vocab: int = 256
  width: int = 128
  depth: int = 2
  heads: int = 8
  kv_heads: int = 2
  mlp: int = 512

  @nn.compact
  def __call__(self, ids):
    part = nn.with_logical_partitioning
    x = nn.Embed(self.vocab, self.width, embedding_init=part(
        nn.initializers.normal(0.02), ("vocab", "embed")))(ids)
    for _ in range(self.depth):
      x = DecoderBlock(self.width, self.heads, self.kv_heads, self.mlp)(x)
    x = nn.RMSNorm(scale_init=part(nn.initializers.ones, ("embed",)))(x)
    return nn.Dense(self.vocab, use_bias=False, kernel_init=part(
        nn.initializers.lecun_normal(), ("embed", "vocab")))(x)
