"""The Kronecker block of a dense or convolutional layer: ``A ⊗ G``.

A layer ``s = a W + b`` applied at R rows (positions × calls × examples) has
Fisher block ``≈ A ⊗ G``, ``A`` the second moment of its inputs ``[a, 1]``
and ``G`` that of the gradients at its outputs (docs/design.md, "Mathematical
conventions"). Convolutions are dense layers over their im2col patches
(`layouts.ConvLayout`; `conv_gram` forms their Gram cheaply).
"""

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from kfac_optax._src import linalg
from kfac_optax._src import losses
from kfac_optax._src.blocks import conv_gram
from kfac_optax._src.linalg import low_rank


def _min_chunk_floats() -> int:
  """Rows of im2col patches (in floats) that one chunk of a convolution's
  statistics may hold regardless of the activations' size: 16 MiB of
  float32 on CPU, 512 MiB on an accelerator, where each chunk is a launch
  of its own: at 16 MiB the large convnet's statistics step on an H200 was
  a loop over 128 chunks of 16 images, 42 ms against a 6 ms plain step (its
  mean step at the recipe's periods fell from 11.4 to 7.6 ms with this
  bound and TF32 statistics)."""
  return 2**22 if jax.default_backend() == "cpu" else 2**27


class KroneckerFactors(NamedTuple):
  """``A`` (input second moment) and ``G`` (output-gradient second moment).

  Both carry a leading stack axis ``S`` (see `layouts`): ``a`` is
  ``(S, in_dim [+ 1], in_dim [+ 1])``, ``g`` is ``(S, out_dim, out_dim)``.
  A diagonal factor is kept as its diagonal: an embedding's ``a``,
  ``(S, vocab)``; a Kronecker block's ``a`` ``(S, in_dim [+ 1])`` or ``g``
  ``(S, out_dim)`` where that factor is diagonal (`KroneckerBlock`).
  """
  a: jax.Array
  g: jax.Array


def gram(rows: jax.Array, weights: jax.Array | None = None,
         diagonal: bool = False) -> jax.Array:
  """``(S, R, d) -> (S, d, d)``: Σ_rows w r rᵀ per stack slice, float32 (or 64).

  With ``diagonal`` only its diagonal ``Σ_rows w r²``, ``(S, d)``.
  """
  rows = linalg.at_least_float32(rows)
  weighted = rows if weights is None else rows * weights[:, None]
  return jnp.einsum("sri,sri->si" if diagonal else "sri,srj->sij", weighted,
                    rows, precision=linalg.STATISTICS_PRECISION)


def weighted_output_rows(layout, g: jax.Array, terms: losses.Terms
                         ) -> tuple[jax.Array, jax.Array | None]:
  """``(rows, weights)`` of one call's output gradients ``g`` (``(K,
  *output_shape)``; rows are K-major): each row weighted by its term's mask
  (None: all 1)."""
  rows = layout.output_rows(g)
  weights = terms.support().row_weights(g.shape[1:], rows.shape[1] // g.shape[0])
  return rows, None if weights is None else jnp.tile(weights, g.shape[0])


def output_factor(layout, output_grads, terms: losses.Terms, diagonal: bool = False):
  """G = (1/L) Σ_k Σ_rows g gᵀ over every (unmasked) row of every call
  (its diagonal only, with ``diagonal``)."""
  total = 0.0
  for g in output_grads:
    total = total + gram(*weighted_output_rows(layout, g, terms), diagonal)
  return total / terms.count


def _factor_init(stacks: int, size: int, diagonal: bool) -> tuple[jax.Array, jax.Array]:
  """Zero statistics and the identity of one factor (as a vector if diagonal)."""
  shape = (stacks, size) if diagonal else (stacks, size, size)
  identity = jnp.ones(shape) if diagonal else jnp.tile(jnp.eye(size), (stacks, 1, 1))
  return jnp.zeros(shape), identity


# Which factors of a Kronecker block are kept diagonal: (input A, output G).
# These are also `layer_overrides` values (TF K-FAC's approximation names).
KRONECKER_STRUCTURES = {"kron": (False, False), "kron_in_diag": (True, False),
                        "kron_out_diag": (False, True), "kron_both_diag": (True, True)}


@dataclasses.dataclass(frozen=True)
class KroneckerBlock:
  """A layer ``s = a W + b`` (per stack slice): Fisher block ``≈ A ⊗ G``.

  .. math::
    \\bar a = [a, 1],\\quad A = \\frac{1}{R}\\sum_{rows} \\bar a \\bar a^T,\\quad
    G = \\frac{1}{L}\\sum_k \\sum_{rows} g_k g_k^T

  with ``R`` the number of rows (positions × calls × examples). The gradient
  ``V = [∇W; ∇b]`` of shape ``(in_dim + 1, out_dim)`` is preconditioned as
  ``U = (A + π√λ I)⁻¹ V (G + √λ/π I)⁻¹``, independently per stack slice.

  A factor too large to invert (``diagonal_input``/``diagonal_output``, see
  `block_for`) is replaced by its diagonal, ``diag(A)`` or ``diag(G)``: the
  Fisher block becomes ``diag(A) ⊗ G`` or ``A ⊗ diag(G)`` (TF K-FAC's
  ``kron_in_diag``/``kron_out_diag``), whose inverse scales the rows (or
  columns) of ``V`` instead of a matrix product. Only the diagonal is
  accumulated, so no ``d × d`` matrix of that side ever exists. The damping
  split keeps its definition: ``π`` uses the mean eigenvalue ``tr/dim``, and
  a diagonal's is the mean of its entries, equal to the full factor's
  (``tr diag(A) = tr A``); so a layer gets the same ``π`` either way.

  Attributes:
    layout: maps the layer's arrays to rows and matrices (see `layouts`),
      and names its kernel and bias leaves.
    has_bias: whether the layer has a bias (adds the homogeneous coordinate).
    diagonal_input: keep ``A`` as its diagonal.
    diagonal_output: keep ``G`` as its diagonal.
  """

  layout: Any
  has_bias: bool
  diagonal_input: bool = False
  diagonal_output: bool = False

  @property
  def param_names(self) -> tuple[str, ...]:
    names = (self.layout.kernel_name, self.layout.bias_name)
    return names if self.has_bias else names[:1]

  def init(self) -> tuple[KroneckerFactors, KroneckerFactors]:
    """Zero statistics and identity "inverses" (used until the first refresh)."""
    stacks, size = self.layout.num_stacks, self.layout.in_dim + self.has_bias
    (zeros_a, eye_a), (zeros_g, eye_g) = (
        _factor_init(stacks, size, self.diagonal_input),
        _factor_init(stacks, self.layout.out_dim, self.diagonal_output))
    return KroneckerFactors(zeros_a, zeros_g), KroneckerFactors(eye_a, eye_g)

  def statistics(
      self,
      inputs: Sequence[jax.Array],
      output_grads: Sequence[jax.Array],
      terms: losses.Terms,
  ) -> KroneckerFactors:
    """Batch estimates of ``A`` and ``G`` from every call of the layer.

    Args:
      inputs: per call, the layer input.
      output_grads: per call, ``(K, *output_shape)`` gradients of the summed
        NLL with respect to the layer output.
      terms: L and the term mask.
    """
    return KroneckerFactors(
        self.input_factor(inputs, terms),
        output_factor(self.layout, output_grads, terms, self.diagonal_output))

  def input_factor(self, inputs: Sequence[jax.Array], terms: losses.Terms) -> jax.Array:
    """``A``: the mean of ``ā āᵀ`` over every (unmasked) row of every call
    (of ``ā²`` with ``diagonal_input``)."""
    a, num_rows = 0.0, 0.0
    for x in inputs:
      call_gram, count = self._input_gram(x, terms)
      a, num_rows = a + call_gram, num_rows + count
    return a / num_rows

  def _rows(self, x: jax.Array) -> jax.Array:
    rows = self.layout.input_rows(x)
    if self.has_bias:
      rows = jnp.concatenate([rows, jnp.ones_like(rows[..., :1])], 2)
    return rows

  def _input_gram(self, x: jax.Array, terms: losses.Terms):
    """``(Σ_rows w ā āᵀ, Σ_rows w)`` for one call, within bounded memory.

    A layout that expands its input (im2col patches: about kernel-size times
    the activations) is evaluated over equal chunks of the examples (axis 0)
    in a `lax.scan`, so at most a quarter of the activations' size in rows
    exists at once, or `_min_chunk_floats` where that is more: smaller chunks
    gain little memory and make the Gram a long loop of thin products (a
    ResNet's statistics step from 32 examples, one per chunk, cost 90 ms
    over a plain step instead of 65: `benchmarks/statistics_step.py`).
    A chunk's Gram uses the translation structure of its patches where
    `conv_gram.applies`, a third of the products for a 3x3 kernel.
    """
    if not getattr(self.layout, "expands_input", False):
      rows = self._rows(x)
      weights = terms.row_weights(x.shape, rows.shape[1])
      return gram(rows, weights, self.diagonal_input), (
          rows.shape[1] if weights is None else jnp.sum(weights))
    example = jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype)
    rows_per_example = jax.eval_shape(self._rows, example).shape[1]
    floats_per_example = rows_per_example * (self.layout.num_stacks *
                                             (self.layout.in_dim + self.has_bias))
    n = x.shape[0]
    weights = terms.row_weights(x.shape, n * rows_per_example)
    if weights is None:
      weights = jnp.ones((n * rows_per_example,), jnp.float32)
    # The largest divisor of n within budget: chunks need no padded copy.
    budget = max(1, max(x.size // 4, _min_chunk_floats()) // floats_per_example)
    chunk = max(d for d in range(1, min(n, budget) + 1) if n % d == 0)
    num_chunks = n // chunk

    translated = conv_gram.applies(self.layout, x.shape, terms, self.diagonal_input)

    def add_chunk(total, chunk_data):
      xs, ws = chunk_data
      if translated:  # ws is constant within each example
        chunk_gram = conv_gram.input_gram(self.layout, xs, ws, self.has_bias)
      else:
        chunk_gram = gram(self._rows(xs), ws, self.diagonal_input)
      return total + chunk_gram, None
    zeros = _factor_init(self.layout.num_stacks, self.layout.in_dim + self.has_bias,
                         self.diagonal_input)[0]
    total, _ = jax.lax.scan(
        add_chunk, zeros.astype(linalg.at_least_float32(x).dtype),
        (x.reshape(num_chunks, chunk, *x.shape[1:]),
         weights.reshape(num_chunks, chunk * rows_per_example)))
    return total, jnp.sum(weights)

  def damped(self, factors: KroneckerFactors,
             damping: jax.Array) -> KroneckerFactors:
    """The factors with their π-adjusted damping, to invert (`linalg.invert_all`)."""
    damping_a, damping_g = jax.vmap(
        lambda a, g: linalg.pi_adjusted_damping(
            linalg.mean_eigenvalue(a), linalg.mean_eigenvalue(g), damping)
    )(factors.a, factors.g)
    damped = lambda diagonal: linalg.DampedDiagonal if diagonal else linalg.Damped
    return KroneckerFactors(damped(self.diagonal_input)(factors.a, damping_a),
                            damped(self.diagonal_output)(factors.g, damping_g))

  def precondition(self, inverses: KroneckerFactors, grads: dict) -> dict:
    """Maps ``{kernel: ∇W[, bias: ∇b]}`` (leaves by `param_names`) to its
    preconditioned leaves, in the inverses' dtype."""
    if all(isinstance(i, low_rank.LowRankInverse) for i in inverses):
      return self._gradient_leaves(low_rank.sandwich(
          inverses.a, self._gradient_rows(grads, inverses.a.dtype), inverses.g))
    return self.matrix_leaves(sandwich(
        inverses, self.gradient_matrix(grads, inverses.a.dtype)))

  def gradient_matrix(self, grads: dict, dtype) -> jax.Array:
    """``V = [∇W; ∇b]``, ``(S, in_dim [+ 1], out_dim)``."""
    return jnp.concatenate(self._gradient_rows(grads, dtype), 1)

  def matrix_leaves(self, matrix: jax.Array) -> dict:
    """The inverse of `gradient_matrix`."""
    return self._gradient_leaves(jnp.split(matrix, [self.layout.in_dim], 1))

  def _gradient_rows(self, grads: dict, dtype) -> list[jax.Array]:
    """The row blocks of ``V = [∇W; ∇b]``: ``(S, in_dim, out_dim)`` [and
    ``(S, 1, out_dim)``]."""
    kernel, *bias = self.param_names
    rows = [self.layout.kernel_matrix(grads[kernel].astype(dtype))]
    if bias:
      rows.append(self.layout.bias_matrix(grads[bias[0]].astype(dtype))[:, None])
    return rows

  def _gradient_leaves(self, rows: Sequence[jax.Array]) -> dict:
    """The inverse of `_gradient_rows`."""
    layout, (kernel, *bias) = self.layout, self.param_names
    out = {kernel: layout.kernel_from_matrix(rows[0])}
    if bias:
      out[bias[0]] = layout.bias_from_matrix(rows[1][:, 0])
    return out


def sandwich(inverses: KroneckerFactors, stacked: jax.Array) -> jax.Array:
  """``A⁻¹ V G⁻¹`` per stack slice: ``stacked`` ``(S, rows, cols)``; a factor
  kept as its diagonal (a vector per slice) scales rows or columns, one kept
  at a rank is a `low_rank.LowRankInverse`."""
  diagonal = lambda x: not isinstance(x, low_rank.LowRankInverse) and x.ndim == 2
  if diagonal(inverses.a):  # diag(a) @ V scales V's rows
    stacked = inverses.a[:, :, None] * stacked
  else:
    stacked = low_rank.left_multiply(inverses.a, stacked)
  return (stacked * inverses.g[:, None, :] if diagonal(inverses.g)
          else low_rank.right_multiply(stacked, inverses.g))
