"""The block of an embedding table: token frequencies ⊗ output moments.

Lookups are a dense layer on one-hot rows, so ``A`` is diagonal; a tied use
as the output projection (``attend``) adds a second Kronecker term, merged
into one product.
"""

import dataclasses

import jax
import jax.numpy as jnp

from kfac_optax._src import layouts
from kfac_optax._src import linalg
from kfac_optax._src import losses
from kfac_optax._src.blocks import kronecker
from kfac_optax._src.linalg import low_rank


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

  def init(self) -> tuple[kronecker.KroneckerFactors, kronecker.KroneckerFactors]:
    vocab, out, uses = self.layout.vocab, self.layout.out_dim, 1 + self.tied
    zeros = kronecker.KroneckerFactors(jnp.zeros((uses, vocab)),
                                       jnp.zeros((uses, out, out)))
    return zeros, kronecker.KroneckerFactors(jnp.ones((1, vocab)), jnp.eye(out)[None])

  def statistics(self, inputs, output_grads, terms,
                 attend=None) -> kronecker.KroneckerFactors:
    """Lookup statistics (and with ``attend=(queries, logit grads)`` the tied use's)."""
    counts, total = jnp.zeros((self.layout.vocab,), jnp.float32), 0.0
    for ids in inputs:
      weights = terms.row_weights(ids.shape, ids.size)
      weights = jnp.ones(ids.size) if weights is None else weights
      counts = counts.at[jnp.ravel(ids)].add(weights)
      total = total + jnp.sum(weights)
    lookup = kronecker.KroneckerFactors((counts / total)[None],
                              kronecker.output_factor(self.layout, output_grads, terms))
    if not self.tied:
      return lookup
    queries, logit_grads = attend
    projection = kronecker.KroneckerBlock(
        layouts.dense(self.layout.features, self.layout.vocab), has_bias=False)
    logits_diagonal = sum(
        jnp.sum(jnp.square(linalg.at_least_float32(g))
                * _mask_like(terms.support(), g.shape[1:])[None], tuple(range(g.ndim - 1)))
        for g in logit_grads) / terms.count
    return kronecker.KroneckerFactors(
        jnp.concatenate([lookup.a, logits_diagonal[None]]),
        jnp.concatenate([lookup.g, projection.input_factor(queries, terms)]))

  def damped(self, factors, damping) -> kronecker.KroneckerFactors:
    """The (combined) factors with their π-adjusted damping (`linalg.invert_all`)."""
    a, g = factors.a[0], factors.g[0]
    if self.tied:
      a, g = _combined_kronecker(factors.a, factors.g)
    damping_a, damping_g = linalg.pi_adjusted_damping(
        jnp.mean(a), linalg.mean_eigenvalue(g), damping)
    return kronecker.KroneckerFactors(linalg.DampedDiagonal(a[None], damping_a),
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
