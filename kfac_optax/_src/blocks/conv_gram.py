"""A convolution's input factor from the translation structure of its patches.

KFC's input factor (Grosse & Martens 2016) is the Gram of the im2col
patches, one row per output position. Group a patch's entries by the
kernel's offset ``p`` along the first spatial axis (``k`` offsets, kernel
dilation ``δ``, stride 1 along that axis), and let ``y_n[u]`` be the patch
over the other spatial axes at row ``u`` of example ``n``'s padded input.
With ``L`` output rows, the Gram's ``(p, q)`` block is

.. math::
  B(p, q) = \\sum_n w_n \\sum_{o=0}^{L-1} y_n[o + pδ]\\, y_n[o + qδ]^T .

Every block on the diagonal ``d = q - p`` sums the same products
``y[u] y[u + dδ]ᵀ`` over a window of ``L`` rows shifted by ``pδ``, so

.. math::
  B(p, p + d) = B(0, d) + \\sum_{u=L}^{L+pδ-1} E_d(u) - \\sum_{u=0}^{pδ-1} E_d(u),
  \\qquad E_d(u) = \\sum_n w_n\\, y_n[u]\\, y_n[u + dδ]^T .

The first block row ``B(0, ·)`` is one product of the first offset's
columns of the patches with all of them, ``1/k`` of the Gram's FLOPs; the
corrections ``E_d(u)`` come from the ``(k - 1 - d)δ`` rows at either edge of
the padded input, and vanish where a row is zero padding. A 3x3 "SAME"
convolution on an ``h``-row map needs two of them, ``2/(3h)`` of the first
block row's products; on the ResNet benchmark's layers the Gram takes
1.5-2x less time than the whole patches' (`benchmarks/statistics_step.py`).
"""

import jax
import jax.numpy as jnp
import numpy as np

from kfac_optax._src import layouts
from kfac_optax._src import linalg
from kfac_optax._src import losses

# Narrower first-offset blocks (kernel width x channels per group) make the
# first block row a thin product that XLA:CPU runs no faster than the whole
# Gram: at batch 128, 3x3 kernels over 8 channels (24) broke even, over 4 lost.
_MIN_WIDTH = 32


def applies(layout, x_shape: tuple, terms: losses.Terms, diagonal: bool) -> bool:
  """Whether `input_gram` gives this layer's input Gram.

  It needs a full (not diagonal) factor, a convolution more than one tap high
  with stride 1 along its first spatial axis, and row weights that are
  constant within an example (a mask over the batch axes only, or none);
  and it is used where it is faster, for blocks at least `_MIN_WIDTH` wide.
  """
  if diagonal or not isinstance(layout, layouts.ConvLayout):
    return False
  if layout.kernel_size[0] == 1 or layout.strides[0] != 1:
    return False
  if layout.in_dim // layout.kernel_size[0] < _MIN_WIDTH:
    return False
  batch_axes = len(x_shape) - len(layout.kernel_size) - 1
  return terms.mask_for(x_shape) is None or terms.mask.ndim <= batch_axes


def _zero_rows(layout, spatial: tuple) -> np.ndarray:
  """Which rows (first spatial axis) of ``layout.padded_input`` are zero
  padding, for an input of ``spatial`` shape."""
  with jax.ensure_compile_time_eval():
    marker = np.asarray(layout.padded_input(jnp.ones((1, *spatial, 1), jnp.float32)))
  return ~marker.reshape(marker.shape[1], -1).any(1)


def _corrections(kernel: int, dilation: int, rows: int, zero_rows: np.ndarray):
  """The edge products and signs of every block ``B(p, p + d)``.

  Returns ``blocks``, the ``(p, d)`` of the blocks on and above the
  diagonal, ``pairs``, the ``(u, d)`` of every ``E_d(u)`` needed (none with
  a row of zero padding, whose product is zero), and ``signs``,
  ``(blocks, pairs)``: block ``(p, d)`` is ``B(0, d) + signs[block] @ E``.
  """
  blocks = [(p, d) for p in range(kernel) for d in range(kernel - p)]
  edges = {(p, d): [(u, sign) for u, sign in
                    [(u, -1.0) for u in range(p * dilation)] +
                    [(u, 1.0) for u in range(rows, rows + p * dilation)]
                    if not (zero_rows[u] or zero_rows[u + d * dilation])]
           for p, d in blocks}
  pairs = sorted({(u, d) for (_, d), edge in edges.items() for u, _ in edge})
  signs = np.zeros((len(blocks), len(pairs)), np.float32)
  for b, block in enumerate(blocks):
    for u, sign in edges[block]:
      signs[b, pairs.index((u, block[1]))] += sign
  return blocks, pairs, signs


def _per_group(windows: jax.Array, *shape) -> jax.Array:
  """Windows ``(..., taps, groups, c)`` as ``(groups, *shape)``, the windows'
  other axes in their order (taps and channels last)."""
  return jnp.moveaxis(windows, -2, 0).reshape(windows.shape[-2], *shape)


def input_gram(layout, x: jax.Array, row_weights: jax.Array,
               has_bias: bool) -> jax.Array:
  """``Σ_rows w ā āᵀ`` of a convolution's patches (`applies` must hold).

  Args:
    layout: a `layouts.ConvLayout`.
    x: the layer input, with batch axes first.
    row_weights: a weight per row of ``layout.input_rows(x)``, the same for
      every row of an example.
    has_bias: append the homogeneous coordinate ``1`` to every patch.

  Returns:
    ``(groups, in_dim [+ 1], in_dim [+ 1])``, float32 (or 64), equal to the
    Gram of ``layout.input_rows(x)`` (with a column of ones if ``has_bias``).
  """
  kernel, dilation = layout.kernel_size[0], layout.kernel_dilation[0]
  groups, width = layout.groups, layout.in_dim // kernel
  padded = linalg.at_least_float32(layout.padded_input(x))
  num_rows = padded.shape[1] - (kernel - 1) * dilation  # output rows, L

  windows = layout.windows(padded)  # (N, *outputs, taps, groups, c)
  per_example = int(np.prod(windows.shape[1:-3]))
  patches = _per_group(windows, -1, kernel, width)  # (G, R, p, f)
  flat_patches = patches.reshape(groups, -1, layout.in_dim)
  example_weights = row_weights.reshape(-1, per_example)[:, 0]
  weighted_first = patches[:, :, 0] * row_weights[:, None].astype(patches.dtype)
  first_row = jnp.einsum("gri,grj->gij", weighted_first, flat_patches,
                         precision=linalg.STATISTICS_PRECISION)

  blocks, pairs, signs = _corrections(kernel, dilation, num_rows,
                                      _zero_rows(layout, x.shape[-padded.ndim + 1:-1]))
  if pairs:
    rows = sorted({r for u, d in pairs for r in (u, u + d * dilation)})
    # The rows as examples of height 1, row-major: (rows * N, 1, *other axes, c).
    slabs = jnp.moveaxis(padded[:, np.asarray(rows)], 1, 0)
    slabs = layout.windows(slabs.reshape(-1, 1, *slabs.shape[2:]), slice(1, None))
    slabs = _per_group(slabs, len(rows), -1, width)  # (G, rows, N * M, f)
    lhs = slabs[:, np.asarray([rows.index(u) for u, _ in pairs])]
    rhs = slabs[:, np.asarray([rows.index(u + d * dilation) for u, d in pairs])]
    lhs = lhs * jnp.repeat(example_weights, lhs.shape[2] // len(example_weights)
                           )[:, None].astype(lhs.dtype)
    edges = jnp.einsum("gpri,gprj->gpij", lhs, rhs, precision=linalg.STATISTICS_PRECISION)
    corrections = jnp.einsum("bp,gpij->gbij", signs, edges, precision=linalg.STATISTICS_PRECISION)
  block = {pd: first_row[:, :, pd[1] * width:(pd[1] + 1) * width] +
               (corrections[:, b] if pairs else 0.0)
           for b, pd in enumerate(blocks)}
  gram = jnp.concatenate([
      jnp.concatenate([block[p, q - p] if q >= p else jnp.swapaxes(block[q, p - q], 1, 2)
                       for q in range(kernel)], 2)
      for p in range(kernel)], 1)
  if not has_bias:
    return gram
  sums = jnp.einsum("grj,r->gj", flat_patches, row_weights.astype(patches.dtype),
                    precision=linalg.STATISTICS_PRECISION)
  count = jnp.broadcast_to(jnp.sum(row_weights).astype(gram.dtype), (groups, 1, 1))
  return jnp.concatenate([jnp.concatenate([gram, sums[:, :, None]], 2),
                          jnp.concatenate([sums[:, None, :], count], 2)], 1)
