"""The decompositions of the series blocks of recurrent layers.

A layer shared over T time steps may model its steps as a series
(`blocks.series.SeriesBlock`, Martens, Ba & Johnson 2018): its factors are
the moments ``C0`` and the lag-1 moments ``C1``, which a refresh turns into
option 1's whitened lag (`Whitened`) or option 2's linear transition
(`Transition`).
"""

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from kfac_optax._src.linalg import damped


class Whitened(NamedTuple):
  """Series option 1's factor: the whitened, symmetrised lag-1 moment.

  ``Ψ̂ = C̃0^{-1/2} ((C1 + C1ᵀ)/2) C̃0^{-1/2} = U diag(ψ) Uᵀ`` with
  ``C̃0 = C0 + d I``; kept as ``l = C̃0^{-1/2} U`` and ``psi = |ψ|``.
  """
  l: jax.Array
  psi: jax.Array


class Transition(NamedTuple):
  """Series option 2's factor: a linear transition ``x_{t+1} ≈ Pᵀ x_t``.

  ``p = C1ᵀ C̃0⁻¹``; with the SVD ``C̃0^{-1/2} C1 C̃0^{-1/2} = U diag(s) Eᵀ``,
  ``k = C̃0^{-1/2} E`` and ``mu = min(s², 1)``.
  """
  p: jax.Array
  k: jax.Array
  mu: jax.Array


def whitened(c0: jax.Array, c1: jax.Array, damping: jax.Array) -> Whitened:
  """`Whitened` of one (C0, C1) pair; ``|ψ|`` as the original takes it."""
  root = damped.damped_power(c0, damping, -0.5, "eigh")
  psi, u = jnp.linalg.eigh(root @ ((c1 + c1.T) / 2) @ root)
  return Whitened(root @ u, jnp.abs(psi))


def transition(c0: jax.Array, c1: jax.Array, damping: jax.Array) -> Transition:
  """`Transition` of one (C0, C1) pair."""
  root = damped.damped_power(c0, damping, -0.5, "eigh")
  _, s, e_t = jnp.linalg.svd(root @ c1 @ root)
  return Transition(c1.T @ root @ root, root @ e_t.T, jnp.minimum(s * s, 1.0))

SERIES_DECOMPOSITIONS: dict[str, Callable[..., Any]] = {
    "series_option1": whitened, "series_option2": transition}


@dataclasses.dataclass(frozen=True)
class DampedLag:
  """Moments ``C0`` and lag-1 ``C1`` ``(..., d, d)`` with ``damping`` (...),
  to decompose as ``option`` (a key of `SERIES_DECOMPOSITIONS`)."""
  matrix: jax.Array
  lag: jax.Array
  damping: jax.Array
  option: str

jax.tree_util.register_dataclass(DampedLag, data_fields=["matrix", "lag", "damping"],
                                 meta_fields=["option"])
