"""The block of a dense layer shared over time steps, modelled as a series.

Martens, Ba & Johnson (2018): the per-step inputs and output gradients of a
recurrent layer are stationary series; their lag-1 moments correct the
Kronecker block that treats the steps as independent rows.
"""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kfac_optax._src import linalg
from kfac_optax._src import losses
from kfac_optax._src.blocks import kronecker



SERIES_OPTIONS = tuple(linalg.SERIES_DECOMPOSITIONS)  # "series_option1", "series_option2"


class SeriesFactors(NamedTuple):
  """Statistics of a layer shared over time: ``A0``, ``G0`` (fields ``a``,
  ``g``, as in `kronecker.KroneckerFactors`) and the lag-1 ``A1``, ``G1``."""
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
class SeriesBlock(kronecker.KroneckerBlock):
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
    a, g = super().damped(kronecker.KroneckerFactors(factors.a, factors.g), damping)
    steps = jnp.full(factors.a.shape[:1], self.num_steps, factors.a.dtype)
    lagged = lambda damped, lag: linalg.DampedLag(damped.matrix, lag, damped.damping,
                                                  self.option)
    return SeriesInverses(lagged(a, factors.a_lag), lagged(g, factors.g_lag), steps)

  def precondition(self, inverses: SeriesInverses, grads: dict) -> dict:
    a, g = inverses.a, inverses.g
    v = self.gradient_matrix(grads, inverses.steps.dtype)
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
    return self.matrix_leaves(u)


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
  gram = jnp.einsum("tsri,tsrj->sij", rows * w, rows, precision=linalg.STATISTICS_PRECISION)
  lag = jnp.einsum("tsri,tsrj->sij", rows[1:] * jnp.sqrt(w[1:] * w[:-1]), rows[:-1],
                   precision=linalg.STATISTICS_PRECISION)
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
