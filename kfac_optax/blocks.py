"""Curvature blocks: statistics, damped inverses and preconditioning.

A block owns a group of parameter leaves and approximates their Fisher block.
It turns captured layer data into a batch estimate of its statistics, turns
(EMA-averaged) statistics into damped inverses, and applies those inverses to
the gradient leaves it owns. Blocks know nothing about flax: they see arrays
and the names of the parameter leaves of their layer.

Conventions (DESIGN.md section 4): L is the number of loss terms, a row is one
position of one example at which a layer is applied, and every output gradient
``g`` is the gradient of the *summed* per-term NLL, one per output cotangent
``k`` (see `losses.output_cotangents`).
"""

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from kfac_optax import conv_gram
from kfac_optax import layouts
from kfac_optax import linalg
from kfac_optax import losses
from kfac_optax import low_rank

_HIGHEST = jax.lax.Precision.HIGHEST
# Rows of im2col patches that one chunk of a convolution's statistics may
# hold regardless of the activations' size: 16 MiB of float32.
_MIN_CHUNK_FLOATS = 2**22


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


def _gram(rows: jax.Array, weights: jax.Array | None = None,
          diagonal: bool = False) -> jax.Array:
  """``(S, R, d) -> (S, d, d)``: Σ_rows w r rᵀ per stack slice, float32 (or 64).

  With ``diagonal`` only its diagonal ``Σ_rows w r²``, ``(S, d)``.
  """
  rows = linalg.at_least_float32(rows)
  weighted = rows if weights is None else rows * weights[:, None]
  return jnp.einsum("sri,sri->si" if diagonal else "sri,srj->sij", weighted,
                    rows, precision=_HIGHEST)


def _output_factor(layout, output_grads, terms: losses.Terms, diagonal: bool = False):
  """G = (1/L) Σ_k Σ_rows g gᵀ over every (unmasked) row of every call
  (its diagonal only, with ``diagonal``)."""
  total = 0.0
  for g in output_grads:  # g: (K, *output_shape); rows are K-major
    rows = layout.output_rows(g)
    weights = terms.support().row_weights(g.shape[1:], rows.shape[1] // g.shape[0])
    total = total + _gram(rows, None if weights is None else jnp.tile(weights, g.shape[0]),
                          diagonal)
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
        _output_factor(self.layout, output_grads, terms, self.diagonal_output))

  def input_factor(self, inputs: Sequence[jax.Array], terms: losses.Terms) -> jax.Array:
    """``A``: the mean of ``ā āᵀ`` over every (unmasked) row of every call
    (of ``ā²`` with ``diagonal_input``)."""
    a, num_rows = 0.0, 0.0
    for x in inputs:
      gram, count = self._input_gram(x, terms)
      a, num_rows = a + gram, num_rows + count
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
    exists at once, or `_MIN_CHUNK_FLOATS` where that is more: smaller chunks
    gain little memory and make the Gram a long loop of thin products (a
    ResNet's statistics step from 32 examples, one per chunk, cost 90 ms
    over a plain step instead of 65: `benchmarks/statistics_step.py`).
    A chunk's Gram uses the translation structure of its patches where
    `conv_gram.applies`, a third of the products for a 3x3 kernel.
    """
    if not getattr(self.layout, "expands_input", False):
      rows = self._rows(x)
      weights = terms.row_weights(x.shape, rows.shape[1])
      return _gram(rows, weights, self.diagonal_input), (
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
    budget = max(1, max(x.size // 4, _MIN_CHUNK_FLOATS) // floats_per_example)
    chunk = max(d for d in range(1, min(n, budget) + 1) if n % d == 0)
    num_chunks = n // chunk

    translated = conv_gram.applies(self.layout, x.shape, terms, self.diagonal_input)

    def add_chunk(total, chunk_data):
      xs, ws = chunk_data
      if translated:  # ws is constant within each example
        gram = conv_gram.input_gram(self.layout, xs, ws, self.has_bias)
      else:
        gram = _gram(self._rows(xs), ws, self.diagonal_input)
      return total + gram, None
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
    stacked = self._gradient_matrix(grads, inverses.a.dtype)
    if self.diagonal_input:  # diag(a) @ V scales V's rows
      stacked = inverses.a[:, :, None] * stacked
    else:
      stacked = low_rank.left_multiply(inverses.a, stacked)
    stacked = (stacked * inverses.g[:, None, :] if self.diagonal_output
               else low_rank.right_multiply(stacked, inverses.g))
    return self._matrix_leaves(stacked)

  def _gradient_matrix(self, grads: dict, dtype) -> jax.Array:
    """``V = [∇W; ∇b]``, ``(S, in_dim [+ 1], out_dim)``."""
    return jnp.concatenate(self._gradient_rows(grads, dtype), 1)

  def _matrix_leaves(self, matrix: jax.Array) -> dict:
    """The inverse of `_gradient_matrix`."""
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


SERIES_OPTIONS = tuple(linalg.SERIES_DECOMPOSITIONS)  # "series_option1", "series_option2"


class SeriesFactors(NamedTuple):
  """Statistics of a layer shared over time: ``A0``, ``G0`` (fields ``a``,
  ``g``, as in `KroneckerFactors`) and the lag-1 ``A1``, ``G1``."""
  a: jax.Array
  g: jax.Array
  a_lag: jax.Array
  g_lag: jax.Array


class SeriesInverses(NamedTuple):
  """A series block's refreshed factors: `linalg.Whitened` (option 1) or
  `linalg.Transition` (option 2) for ``A`` and ``G``, and the number of time
  steps ``T`` of the batch they were refreshed on (option 1's ``Γ``), ``(S,)``."""
  a: Any
  g: Any
  steps: jax.Array


@dataclasses.dataclass(frozen=True)
class SeriesBlock(KroneckerBlock):
  """A layer applied at ``T`` time steps with shared weights, as a series.

  Martens, Ba & Johnson (2018) model the per-step ``ā_t`` and ``g_t`` as
  stationary series whose Fisher block is
  ``Σ_{t,s} E[ā_t ā_sᵀ] ⊗ E[g_t g_sᵀ]``. With ``R`` rows (T steps × M rows
  per step, masked ones excluded) and ``L`` loss terms:

  .. math::
    A_0 = \\frac{1}{R}\\sum_{t,m} ā_{t} ā_{t}^T,\\quad
    A_1 = \\frac{1}{R}\\sum_{t<T-1,m} ā_{t+1} ā_{t}^T,\\quad
    G_0 = \\frac{1}{L}\\sum_{k,t,m} g g^T,\\quad
    G_1 = \\frac{1}{L}\\sum_{k,t<T-1,m} g_{t+1} g_t^T

  (a pair counts only where both steps are unmasked), damped as
  ``C̃0 = C0 + d_C I`` with the π-split of λ computed from ``A0`` and ``G0``.
  For ``V = [∇W; ∇b]``:

  - ``series_option1`` (exact for the symmetric process model): with
    ``Ψ̂ = C̃0^{-1/2} sym(C1) C̃0^{-1/2} = U diag(ψ) Uᵀ``, ``L = C̃0^{-1/2} U``,
    ``U_out = L_A [(L_Aᵀ V L_G) ∘ Γ] L_Gᵀ``, ``Γ_ij = T γ_T(|ψ_A,i| |ψ_G,j|)``,
    ``γ_T(x) = (1-x)² / (T(1-x²) - 2x(1-x^T))``: the inverse of
    ``(1/T) Σ_{|d|<T} (T-|d|) (Ã0^{1/2} Ψ̂_A^{|d|} Ã0^{1/2}) ⊗ (G̃0^{1/2} Ψ̂_G^{|d|} G̃0^{1/2})``.
  - ``series_option2`` (a linear-dynamics model, for long sequences):
    ``P = C1ᵀ C̃0⁻¹``, ``K = C̃0^{-1/2} E``, ``μ = min(s², 1)`` from the SVD
    ``C̃0^{-1/2} C1 C̃0^{-1/2} = U diag(s) Eᵀ``; ``Z = V - P_A V P_Gᵀ``,
    ``Z = K_A [(K_Aᵀ Z K_G) / (1 - μ_A μ_Gᵀ)] K_Gᵀ``, ``U_out = Z - P_Aᵀ Z P_G``.

  Both equal `KroneckerBlock`'s ``Ã0⁻¹ V G̃0⁻¹`` when ``A1`` or ``G1`` vanish
  (``T·γ_T(0) = 1``). The captured arrays carry the time axis second,
  ``(N, T, ...)`` (gradients ``(K, N, T, ...)``; see `BatchMajor`), so a
  loss mask ``(N, T)`` or ``(N,)`` weighs the rows as in `losses.Terms`.

  Attributes:
    option: ``"series_option1"`` or ``"series_option2"``.
    num_steps: ``T``.

  References:
    Martens, Ba & Johnson, "Kronecker-factored Curvature Approximations for
    Recurrent Neural Networks", ICLR 2018.
  """

  option: str = SERIES_OPTIONS[0]
  num_steps: int = 1

  def init(self) -> tuple[SeriesFactors, SeriesInverses]:
    """Zero statistics and factors that precondition as the identity."""
    # Distinct zero arrays: a donated state must not alias buffers.
    zeros = lambda: super(SeriesBlock, self).init()[0]
    (eye_a, eye_g), stacks = super().init()[1], self.layout.num_stacks
    if self.option == "series_option1":
      a = linalg.Whitened(eye_a, jnp.zeros(eye_a.shape[:2]))
      g = linalg.Whitened(eye_g, jnp.zeros(eye_g.shape[:2]))
    else:
      a = linalg.Transition(zeros().a, eye_a, jnp.zeros(eye_a.shape[:2]))
      g = linalg.Transition(zeros().g, eye_g, jnp.zeros(eye_g.shape[:2]))
    return SeriesFactors(*zeros(), *zeros()), SeriesInverses(a, g, jnp.ones((stacks,)))

  def statistics(self, inputs, output_grads, terms) -> SeriesFactors:
    """Batch estimates of ``A0, G0, A1, G1`` from every call of the layer."""
    a = a_lag = g = g_lag = num_rows = 0.0
    for x, dy in zip(inputs, output_grads):  # x: (N, T, ...), dy: (K, N, T, ...)
      rows = jax.vmap(self._rows, in_axes=1)(x)  # (T, S, M, d): rows of each step
      grad_rows = jax.vmap(self.layout.output_rows, in_axes=2)(dy)  # (T, S, K·M, k)
      weights = _step_weights(terms, x.shape, rows.shape[0] * rows.shape[2])
      gram, lag = _lagged_grams(rows, weights)
      a, a_lag, num_rows = a + gram, a_lag + lag, num_rows + jnp.sum(weights)
      support = (weights > 0).astype(weights.dtype)  # see `losses.Terms`
      gram, lag = _lagged_grams(grad_rows, jnp.tile(support, (1, dy.shape[0])))
      g, g_lag = g + gram, g_lag + lag
    return SeriesFactors(a / num_rows, g / terms.count,
                         a_lag / num_rows, g_lag / terms.count)

  def damped(self, factors: SeriesFactors, damping: jax.Array) -> SeriesInverses:
    """``(C0, C1)`` pairs with the π-split damping, to decompose
    (`linalg.invert_all`)."""
    a, g = super().damped(KroneckerFactors(factors.a, factors.g), damping)
    steps = jnp.full(factors.a.shape[:1], self.num_steps, factors.a.dtype)
    return SeriesInverses(linalg.DampedLag(a.matrix, factors.a_lag, a.damping, self.option),
                          linalg.DampedLag(g.matrix, factors.g_lag, g.damping, self.option),
                          steps)

  def precondition(self, inverses: SeriesInverses, grads: dict) -> dict:
    a, g = inverses.a, inverses.g
    v = self._gradient_matrix(grads, inverses.steps.dtype)
    t = lambda m: jnp.swapaxes(m, -1, -2)
    if self.option == "series_option1":
      gamma = _scaled_gamma(a.psi[:, :, None] * g.psi[:, None, :],
                            inverses.steps[:, None, None])
      u = a.l @ ((t(a.l) @ v @ g.l) * gamma) @ t(g.l)
    else:
      z = v - a.p @ v @ t(g.p)
      denominator = 1.0 - a.mu[:, :, None] * g.mu[:, None, :]
      z = t(a.k) @ z @ g.k / jnp.where(denominator == 0, 1.0, denominator)
      z = a.k @ z @ t(g.k)
      u = z - t(a.p) @ z @ g.p
    return self._matrix_leaves(u)


@dataclasses.dataclass(frozen=True)
class BatchMajor:
  """The block of a layer applied at every step of an nn.RNN/nn.scan over time.

  The lifted transform stacks the layer's captured arrays along a leading
  time axis, ``(T, N, ...)`` (gradients ``(K, T, N, ...)``), while losses
  are batch-major (a mask ``(N, T)``). ``inner`` gets them as ``(N, T, ...)``,
  so its rows are example-major and `losses.Terms` masks line up with them.

  Attributes:
    inner: the block of the layer (`KroneckerBlock` or `SeriesBlock`).
  """

  inner: Any

  @property
  def param_names(self) -> tuple[str, ...]:
    return self.inner.param_names

  def init(self):
    return self.inner.init()

  def statistics(self, inputs, output_grads, terms):
    # An unbatched layer input, (T, features), has no batch axis to swap.
    swap = lambda x, axis: jnp.swapaxes(x, axis, axis + 1) if x.ndim > axis + 2 else x
    return self.inner.statistics([swap(x, 0) for x in inputs],
                                 [swap(g, 1) for g in output_grads], terms)

  def damped(self, factors, damping):
    return self.inner.damped(factors, damping)

  def precondition(self, inverses, grads):
    return self.inner.precondition(inverses, grads)


def _step_weights(terms: losses.Terms, shape: tuple, num_rows: int) -> jax.Array:
  """``(T, M)``: the loss mask's weights of the rows of ``(N, T, ...)``, by step."""
  weights = terms.row_weights(shape, num_rows)  # example-major: (N, T, rows)
  steps = shape[1]
  if weights is None:
    return jnp.ones((steps, num_rows // steps), jnp.float32)
  return jnp.swapaxes(weights.reshape(shape[0], steps, -1), 0, 1).reshape(steps, -1)


def _lagged_grams(rows: jax.Array, weights: jax.Array):
  """``(T, S, R, d)`` rows -> ``(Σ_t w r_t r_tᵀ, Σ_{t<T-1} √(w_{t+1} w_t) r_{t+1} r_tᵀ)``
  (the geometric mean weighs a pair as the output gradients' √w each do)."""
  rows = linalg.at_least_float32(rows)
  w = weights[:, None, :, None]
  gram = jnp.einsum("tsri,tsrj->sij", rows * w, rows, precision=_HIGHEST)
  lag = jnp.einsum("tsri,tsrj->sij", rows[1:] * jnp.sqrt(w[1:] * w[:-1]), rows[:-1],
                   precision=_HIGHEST)
  return gram, lag


def _scaled_gamma(x: jax.Array, steps: jax.Array) -> jax.Array:
  """``Γ = T·γ_T(x)``, ``γ_T(x) = (1-x)² / (T(1-x²) - 2x(1-x^T))``, for x in [0, 1].

  ``1/γ_T(x) = Σ_{|d|<T} (T-|d|) x^{|d|}``. In terms of ``y = 1-x`` (exact)
  the denominator is ``T y (1+x) + 2x expm1(T log1p(-y))``, whose two terms
  cancel to ``~T² y²`` as ``y → 0`` (0/0 at ``x = 1``), losing ``~2ε/(T y)``
  relative; for ``T y < 0.05`` the expansion
  ``1/γ_T = T² - T(T²-1) y/3 + T(T²-1)(T-2) y²/12`` (error ``~(T y)³/60``)
  replaces it: both within a few 10⁻⁶ relative in float32.
  """
  y = 1.0 - x
  near = steps * y < 0.05
  safe_y = jnp.where(near, 0.5, y)  # keeps the unused branch finite
  closed = safe_y ** 2 / (steps * safe_y * (2.0 - safe_y) + 2.0 * (1.0 - safe_y)
                          * jnp.expm1(steps * jnp.log1p(-safe_y)))
  squared = steps * steps - 1.0
  expanded = 1.0 / (steps * steps - steps * squared * y / 3.0
                    + steps * squared * (steps - 2.0) * y * y / 12.0)
  return steps * jnp.where(near, expanded, closed)


@dataclasses.dataclass(frozen=True)
class EmbeddingBlock:
  """An embedding ``E`` (vocab × features): ``A`` diagonal, ``G`` full.

  Lookups (``__call__``) are a dense layer on one-hot rows, so

  .. math::
    A = \\operatorname{diag}(c / R),\\quad
    G = \\frac{1}{L}\\sum_{rows} g g^T,\\quad
    U = (A + π\\sqrt{λ} I)^{-1} V (G + \\sqrt{λ}/π I)^{-1}

  with ``c`` the count of each token id over all ``R`` looked-up positions,
  stored as a vector, so no vocab × vocab matrix ever exists.

  With tied embeddings (``tied``: ``attend(q) = q Eᵀ`` produces logits) ``E``
  is also a dense layer from queries to logits, whose Fisher block in ``E``'s
  orientation is ``diag(G_logits) ⊗ A_q``: the logits' gradient second moment
  (its diagonal only: it is vocab × vocab) on the vocab side and the queries'
  second moment on the feature side. The two uses ``i`` (Fisher blocks
  ``D_i ⊗ F_i``) are combined into one Kronecker product that keeps the
  trace and is exact when one use dominates:

  .. math::
    t_i = \\bar D_i \\bar F_i,\\quad T = \\sum_i t_i,\\quad
    A = \\sum_i t_i D_i / \\bar D_i,\\quad
    G = \\sum_i \\frac{t_i}{T} F_i / \\bar F_i

  where ``X̄`` is the mean eigenvalue. The statistics of each use are kept
  (and averaged) apart, along the factors' leading axis: lookup, then attend.

  Attributes:
    layout: vocabulary and feature sizes.
    tied: whether ``attend`` is called too.
  """

  layout: layouts.EmbeddingLayout
  tied: bool = False
  param_names = ("embedding",)

  def init(self) -> tuple[KroneckerFactors, KroneckerFactors]:
    vocab, out, uses = self.layout.vocab, self.layout.out_dim, 1 + self.tied
    zeros = KroneckerFactors(jnp.zeros((uses, vocab)), jnp.zeros((uses, out, out)))
    return zeros, KroneckerFactors(jnp.ones((1, vocab)), jnp.eye(out)[None])

  def statistics(self, inputs, output_grads, terms, attend=None) -> KroneckerFactors:
    """Lookup statistics (and with ``attend=(queries, logit grads)`` the tied use's)."""
    counts, total = jnp.zeros((self.layout.vocab,), jnp.float32), 0.0
    for ids in inputs:
      weights = terms.row_weights(ids.shape, ids.size)
      weights = jnp.ones(ids.size) if weights is None else weights
      counts = counts.at[jnp.ravel(ids)].add(weights)
      total = total + jnp.sum(weights)
    lookup = KroneckerFactors((counts / total)[None],
                              _output_factor(self.layout, output_grads, terms))
    if not self.tied:
      return lookup
    queries, logit_grads = attend
    projection = KroneckerBlock(layouts.dense(self.layout.features, self.layout.vocab),
                                has_bias=False)
    logits_diagonal = sum(
        jnp.sum(jnp.square(linalg.at_least_float32(g))
                * _mask_like(terms.support(), g.shape[1:])[None], tuple(range(g.ndim - 1)))
        for g in logit_grads) / terms.count
    return KroneckerFactors(
        jnp.concatenate([lookup.a, logits_diagonal[None]]),
        jnp.concatenate([lookup.g, projection.input_factor(queries, terms)]))

  def damped(self, factors, damping) -> KroneckerFactors:
    """The (combined) factors with their π-adjusted damping (`linalg.invert_all`)."""
    a, g = factors.a[0], factors.g[0]
    if self.tied:
      a, g = _combined_kronecker(factors.a, factors.g)
    damping_a, damping_g = linalg.pi_adjusted_damping(
        jnp.mean(a), linalg.mean_eigenvalue(g), damping)
    return KroneckerFactors(linalg.DampedDiagonal(a[None], damping_a),
                            linalg.Damped(g[None], damping_g[None]))

  def precondition(self, inverses, grads) -> dict:
    v = grads["embedding"].astype(inverses.g.dtype)
    return {"embedding": low_rank.right_multiply(
        inverses.a[0][:, None] * v, jax.tree.map(lambda x: x[0], inverses.g))}


def _mask_like(terms: losses.Terms, shape: tuple) -> jax.Array:
  """1 at the unmasked terms of an array of ``shape`` (broadcast over the rest)."""
  mask = terms.mask_for(shape)
  return jnp.ones(()) if mask is None else mask


def _combined_kronecker(diagonals: jax.Array, matrices: jax.Array):
  """``Σ_i D_i ⊗ F_i ≈ A ⊗ G`` (see `EmbeddingBlock`), ``D_i`` diagonal."""
  mean_d = jnp.mean(diagonals, 1)
  mean_f = jax.vmap(linalg.mean_eigenvalue)(matrices)
  weights = mean_d * mean_f
  safe = lambda x: jnp.where(x > 0, x, 1.0)
  a = jnp.einsum("i,iv->v", weights / safe(mean_d), diagonals)
  g = jnp.einsum("i,ijk->jk", weights / safe(mean_f) / safe(jnp.sum(weights)), matrices)
  return a, g


@dataclasses.dataclass(frozen=True)
class DiagonalBlock:
  """Diagonal Fisher for parameter leaves that no structured block owns.

  .. math::
    F = \\frac{1}{L} \\sum_k \\Big(\\sum_{n} ∇_θ \\ell_{n,k}\\Big)^2,
    \\qquad U = ∇ / (F + λ)

  i.e. the squared batch gradient of the summed NLL (per output cotangent
  ``k``) divided by L, which equals ``L · (∇ mean NLL)²``. With targets
  sampled from the model the cross-example terms vanish in expectation, so
  this is an unbiased estimate of the diagonal Fisher ``(1/L) Σ_n (∇ℓ_n)²``.

  Attributes:
    shapes: leaf key -> shape, for every leaf this block owns.
  """

  shapes: dict

  @property
  def names(self) -> tuple:
    return tuple(self.shapes)

  def init(self) -> tuple[dict, dict]:
    """Zero statistics and unit inverses (used until the first refresh)."""
    zeros = {k: jnp.zeros(s, jnp.float32) for k, s in self.shapes.items()}
    ones = {k: jnp.ones(s, jnp.float32) for k, s in self.shapes.items()}
    return zeros, ones

  def statistics(self, param_grads: dict, terms: losses.Terms) -> dict:
    """``param_grads``: leaf -> ``(K, *leaf_shape)`` summed-NLL gradients."""
    return {k: jnp.sum(jnp.square(linalg.at_least_float32(param_grads[k])), 0) / terms.count
            for k in self.names}

  def damped(self, fisher: dict, damping: jax.Array) -> dict:
    """Each leaf's diagonal Fisher with the damping (`linalg.invert_all`)."""
    return {k: linalg.DampedDiagonal(fisher[k], damping) for k in self.names}

  def precondition(self, inverses: dict, grads: dict) -> dict:
    return {k: grads[k].astype(inverses[k].dtype) * inverses[k] for k in self.names}


@dataclasses.dataclass(frozen=True)
class NormBlock(DiagonalBlock):
  """Scale and bias of a normalisation layer: diagonal Fisher, exact.

  .. math::
    F = \\frac{1}{L} \\sum_k \\sum_n (∇θ_{n,k})^2,\\quad U = ∇ / (F + λ)

  with the per-example gradients ``∇scale_n = Σ_positions g ⊙ x̂`` and
  ``∇bias_n = Σ_positions g`` formed from the captured normalised input.

  Attributes:
    layout: where the feature axes are (`layouts.NormLayout`).
  """

  layout: Any = None

  @property
  def param_names(self) -> tuple[str, ...]:
    return self.names

  def statistics(self, inputs, output_grads, terms) -> dict:
    sums = {name: 0.0 for name in self.names}
    for x_hat, g in zip(inputs, output_grads):
      mask = terms.support().mask_for(x_hat.shape)
      if mask is not None:  # masked positions add nothing
        g = g * mask
      x_hat = self.layout.per_example(linalg.at_least_float32(x_hat))  # (N, P, F)
      g = jax.vmap(self.layout.per_example)(linalg.at_least_float32(g))  # (K, N, P, F)
      per_example = {"scale": jnp.einsum("knpf,npf->knf", g, x_hat),
                     "bias": jnp.sum(g, 2)}
      for name in self.names:
        sums[name] = sums[name] + per_example[name]
    return {name: jnp.sum(jnp.square(sums[name]), (0, 1)).reshape(
        self.shapes[name]) / terms.count for name in self.names}


@dataclasses.dataclass(frozen=True)
class StackedBlock:
  """One independent block per slice of a leading layer axis.

  For a layer under ``nn.scan`` (or ``nn.vmap`` over params): its params,
  captured inputs and output gradients all carry a leading axis of size
  ``num_layers``, and every slice gets its own ``inner`` block; statistics,
  inverses and preconditioning are vmapped over the slices.

  Attributes:
    inner: the block of one slice.
    num_layers: the size of the leading axis.
  """

  inner: Any
  num_layers: int

  @property
  def param_names(self) -> tuple[str, ...]:
    return self.inner.param_names

  def init(self):
    return jax.tree.map(lambda x: jnp.repeat(x[None], self.num_layers, 0),
                        self.inner.init())

  def statistics(self, inputs, output_grads, terms):
    return jax.vmap(lambda i, g: self.inner.statistics(i, g, terms),
                    in_axes=(0, 1))(tuple(inputs), tuple(output_grads))

  def damped(self, factors, damping):
    return jax.vmap(lambda f: self.inner.damped(f, damping))(factors)

  def precondition(self, inverses, grads):
    return jax.vmap(self.inner.precondition)(inverses, grads)


def block_for(layout: Any, layer_params: dict, stack_shape: tuple = (),
              other_methods: tuple[str, ...] = (), *, structure: str | None = None,
              max_factor_dim: int | None = None, series: str | None = None,
              time_axes: tuple = ()) -> Any:
  """The curvature block of a captured layer, from its layout and params.

  Args:
    layout: the layer's layout (see `layouts`).
    layer_params: the layer's param leaves (arrays or shape structs).
    stack_shape: leading axes that the params, inputs and output gradients
      share (nn.scan layer stacks); each slice gets its own block.
    other_methods: the layer's other captured methods that the model calls
      (``"attend"``: a tied embedding).
    structure: a key of `KRONECKER_STRUCTURES` that fixes which factors of
      a Kronecker block are diagonal, or None to decide by ``max_factor_dim``.
    max_factor_dim: a Kronecker factor larger than this (``in_dim + 1``
      with a bias, ``out_dim``) is kept diagonal; None: no bound.
    series: a `SERIES_OPTIONS` value for a dense layer with one time axis,
      or None.
    time_axes: the sizes of the leading axes (after the stack axes) that
      the inputs and output gradients have and the params lack: time steps
      of an nn.RNN or nn.scan over time.
  """
  slice_params = {k: jax.ShapeDtypeStruct(v.shape[len(stack_shape):], v.dtype)
                  for k, v in layer_params.items()}
  block = _unstacked_block(layout, slice_params, other_methods, structure,
                           max_factor_dim)
  if series is not None:
    if block.diagonal_input or block.diagonal_output:
      raise ValueError(
          f"{series!r} needs both Kronecker factors in full, but this layer's factors "
          f"(A {layout.in_dim + block.has_bias}², G {layout.out_dim}²) exceed "
          f"max_factor_dim={max_factor_dim}. Fix: raise max_factor_dim (None: "
          "no bound), or give the layer 'independent'.")
    block = SeriesBlock(layout, block.has_bias, option=series,
                        num_steps=time_axes[0])
  if len(time_axes) == 1 and isinstance(block, KroneckerBlock):
    block = BatchMajor(block)
  if stack_shape and other_methods:
    raise NotImplementedError(
        f"{other_methods} calls of a layer stacked by a lifted transform are "
        "not supported; give the layer the diagonal block with layer_overrides")
  for size in reversed(stack_shape):
    block = StackedBlock(block, size)
  return block


def _unstacked_block(layout: Any, layer_params: dict, other_methods: tuple,
                     structure: str | None, max_factor_dim: int | None) -> Any:
  kronecker = not isinstance(layout, (layouts.EmbeddingLayout, layouts.NormLayout))
  if structure is not None and not kronecker:
    raise ValueError(
        f"layer_overrides value {structure!r} is for dense and conv layers "
        f"(Kronecker blocks), but it matched a layer with a {type(layout).__name__}."
        "\nFix: put a pattern for that layer (\"diagonal\", \"skip\") before the "
        "one that matched it, or narrow that pattern")
  if isinstance(layout, layouts.EmbeddingLayout):
    return EmbeddingBlock(layout, tied="attend" in other_methods)
  if isinstance(layout, layouts.NormLayout):
    return NormBlock({k: v.shape for k, v in layer_params.items()}, layout)
  has_bias = layout.bias_name in layer_params
  if structure is None:
    too_large = lambda size: max_factor_dim is not None and size > max_factor_dim
    diagonal = too_large(layout.in_dim + has_bias), too_large(layout.out_dim)
  else:
    diagonal = KRONECKER_STRUCTURES[structure]
  return KroneckerBlock(layout, has_bias, *diagonal)
