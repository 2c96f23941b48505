"""Low-rank factor inverses (``factor_rank``) against explicit eigendecompositions."""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
import numpy as np
import pytest

import kfac_optax
from kfac_optax._src import linalg
from kfac_optax._src.linalg import low_rank
from tests import brute_force as bf


def truncated_inverse(matrix, damping, rank):
  """``(M + δI)⁻¹`` of M's top-``rank`` eigenpairs plus the mean of the
  others on the rest, from numpy's eigh in float64."""
  matrix = np.asarray(matrix, np.float64)
  values, vectors = np.linalg.eigh(matrix)
  values = np.maximum(values, 0.0)
  top, basis = values[-rank:], vectors[:, -rank:]
  rest = max(np.trace(matrix) - top.sum(), 0.0) / (len(matrix) - rank)
  projector = basis @ basis.T
  return ((basis / (top + damping)) @ basis.T
          + (np.eye(len(matrix)) - projector) / (rest + damping))


def dense(inverse):
  """The matrix that a single `LowRankInverse` stands for."""
  basis = np.asarray(inverse.basis, np.float64)
  return (float(inverse.floor) * np.eye(len(basis))
          + (basis * np.asarray(inverse.weights, np.float64)) @ basis.T)


def decaying_psd(key, size, decay=0.7):
  """A random PSD matrix with eigenvalues ``decay**i``: clear gaps."""
  q, _ = jnp.linalg.qr(jax.random.normal(key, (size, size)))
  return (q * decay ** jnp.arange(size)) @ q.T


def test_orthonormal_columns_span_and_rank_deficit():
  key1, key2 = jax.random.split(jax.random.key(0))
  y = jax.random.normal(key1, (50, 12)) * jnp.logspace(0, -3, 12)
  q = low_rank.orthonormal_columns(y)
  np.testing.assert_allclose(q.T @ q, np.eye(12), atol=1e-5)
  np.testing.assert_allclose(q @ (q.T @ y), y, atol=1e-5)

  # Six independent columns, two repeats, four zeros: six unit columns.
  x = jax.random.normal(key2, (50, 6))
  q = low_rank.orthonormal_columns(
      jnp.concatenate([x, x[:, :2] + x[:, 2:4], jnp.zeros((50, 4))], 1))
  norms = np.linalg.norm(q, axis=0)
  np.testing.assert_allclose(np.sort(norms), [0] * 6 + [1] * 6, atol=1e-5)
  kept = q[:, norms > 0.5]
  np.testing.assert_allclose(kept @ (kept.T @ x), x, atol=1e-5)


def test_warm_started_refreshes_reach_the_truncated_inverse():
  matrix, damping, rank = decaying_psd(jax.random.key(1), 60), 1e-3, 5
  refresh = jax.jit(low_rank.damped_inverse)
  inverse = refresh(matrix, damping, jnp.zeros((60, rank)))
  for _ in range(3):  # each refresh starts from the last one's basis
    inverse = refresh(matrix, damping, inverse.basis)
  np.testing.assert_allclose(inverse.basis.T @ inverse.basis, np.eye(rank), atol=1e-5)
  expected = truncated_inverse(matrix, damping, rank)
  assert bf.relative_error(dense(inverse), expected) < 1e-4


def test_exact_where_the_factor_has_at_most_rank_eigenvalues():
  x = jax.random.normal(jax.random.key(2), (4, 30))
  matrix, damping = x.T @ x / 4, 0.1  # rank 4
  inverse = jax.jit(low_rank.damped_inverse)(matrix, damping, jnp.zeros((30, 6)))
  expected = np.linalg.inv(np.asarray(matrix, np.float64) + damping * np.eye(30))
  assert bf.relative_error(dense(inverse), expected) < 1e-5


def test_a_stack_is_refreshed_as_each_matrix_alone():
  # Batched over the stack (one Gram-Schmidt loop for all), each matrix
  # with its own damping, and its own start: a basis, or none yet.
  keys = jax.random.split(jax.random.key(6), 3)
  matrices = jnp.stack([decaying_psd(k, 25, decay) for k, decay in
                        zip(keys, (0.7, 0.8, 0.9))])
  dampings = jnp.array([1e-3, 1e-2, 0.1])
  warm = jax.jit(low_rank.damped_inverse)(matrices[0], 1e-3, jnp.zeros((25, 4))).basis
  bases = jnp.stack([warm, jnp.zeros((25, 4)), warm])
  stacked = jax.jit(low_rank.damped_inverse)(matrices, dampings, bases)
  for i in range(3):
    alone = jax.jit(low_rank.damped_inverse)(matrices[i], dampings[i], bases[i])
    assert bf.relative_error(dense(jax.tree.map(lambda x: x[i], stacked)),
                             dense(alone)) < 1e-5


def test_products_match_the_dense_matrix():
  keys = jax.random.split(jax.random.key(3), 3)
  basis, _ = jnp.linalg.qr(jax.random.normal(keys[0], (2, 9, 3)))
  inverse = low_rank.LowRankInverse(basis, jnp.array([[1.0, 2.0, 3.0], [0.5, 0.0, -0.2]]),
                                    jnp.array([0.7, 2.0]))
  matrices = np.stack([dense(jax.tree.map(lambda x: x[i], inverse)) for i in range(2)])
  v = jax.random.normal(keys[1], (2, 9, 4))
  w = jax.random.normal(keys[2], (2, 4, 9))
  assert bf.relative_error(low_rank.left_multiply(inverse, v), matrices @ v) < 1e-6
  assert bf.relative_error(low_rank.right_multiply(w, inverse), w @ matrices) < 1e-6

  # Both sides at once, on V given as a kernel's rows and a bias row.
  right_basis, _ = jnp.linalg.qr(jax.random.normal(keys[2], (2, 4, 2)))
  right = low_rank.LowRankInverse(right_basis, jnp.array([[0.3, -0.1], [1.5, 2.0]]),
                                  jnp.array([1.1, 0.4]))
  right_matrices = np.stack([dense(jax.tree.map(lambda x: x[i], right))
                             for i in range(2)])
  blocks = low_rank.sandwich(inverse, [v[:, :8], v[:, 8:]], right)
  assert [b.shape for b in blocks] == [(2, 8, 4), (2, 1, 4)]
  assert bf.relative_error(jnp.concatenate(blocks, 1),
                           matrices @ np.asarray(v, np.float64) @ right_matrices) < 1e-6


@pytest.mark.parametrize("distributed", [False, True])
def test_invert_all_keeps_large_factors_at_rank(distributed):
  keys = jax.random.split(jax.random.key(4), 3)
  tree = {
      "large": linalg.Damped(jnp.stack([decaying_psd(k, 20) for k in keys[:2]]),
                             jnp.array([0.1, 0.3])),
      "small": linalg.Damped(decaying_psd(keys[2], 3)[None], jnp.array([0.2])),
  }
  identities = linalg.low_rank_identities(
      tree, {"large": jnp.broadcast_to(jnp.eye(20), (2, 20, 20)),
             "small": jnp.eye(3)[None]}, rank=3)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  stacks = linalg.stack_sharding(mesh) if distributed else None
  refresh = jax.jit(lambda t, previous: linalg.invert_all(
      t, "cholesky", stacks, previous=previous, rank=3))
  inverted = refresh(tree, identities)
  for _ in range(4):
    inverted = refresh(tree, inverted)

  assert jax.tree.structure(inverted) == jax.tree.structure(identities)
  np.testing.assert_array_equal(dense(jax.tree.map(lambda x: x[0], identities["large"])),
                                np.eye(20))
  for i in range(2):
    expected = truncated_inverse(tree["large"].matrix[i], tree["large"].damping[i], 3)
    actual = dense(jax.tree.map(lambda x: x[i], inverted["large"]))
    assert bf.relative_error(actual, expected) < 1e-4
  np.testing.assert_allclose(
      inverted["small"][0],
      np.linalg.inv(np.asarray(tree["small"].matrix[0]) + 0.2 * np.eye(3)), rtol=1e-4)


@pytest.mark.parametrize("rank", [2, 3])
def test_update_matches_explicit_kronecker_of_truncated_factors(rank):
  """Rank 2: every factor at low rank (`low_rank.sandwich`); rank 3: the
  3-row output factors stay exact, the input factors low rank."""
  params, batch = bf.tiny_problem(n=6, d_in=5)
  model, damping = bf.TinyMLP(), 1e-2
  tx = kfac_optax.scale_by_kfac(
      model.apply, kfac_optax.losses.softmax_cross_entropy(), example_batch=batch,
      damping=damping, estimation="empirical", factor_rank=rank)
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(5), p.shape), params)
  updates, state = jax.jit(lambda s: tx.update(grads, s, params, batch=batch))(
      tx.init(params))
  # Factors up to 6 rows: the iterated subspace (rank + OVERSAMPLE) is all of
  # it, so the refresh is the truncation exactly.
  assert all(isinstance(inverse, low_rank.LowRankInverse)  # `low_rank.sandwich`
             for inverse in state.inverses["hidden"])
  assert isinstance(state.inverses["out"].g, low_rank.LowRankInverse) == (rank < 3)

  expected = {}
  for name, (a, g) in bf.factors(params, batch, "empirical").items():
    damping_a, damping_g = bf.pi_damping(a, g, damping)
    inverse_a, inverse_g = (
        truncated_inverse(f, d, rank) if len(f) > rank
        else np.linalg.inv(np.asarray(f, np.float64) + d * np.eye(len(f)))
        for f, d in ((a, damping_a), (g, damping_g)))
    v = np.asarray(grads[name]["kernel"], np.float64)
    if "bias" in grads[name]:
      v = np.concatenate([v, np.asarray(grads[name]["bias"], np.float64)[None]])
    # (Â ⊗ Ĝ)⁻¹ vec(V) with explicit Kronecker products of the truncations.
    u = (np.kron(inverse_a, inverse_g) @ v.reshape(-1)).reshape(v.shape)
    expected[name] = {"kernel": u[:len(grads[name]["kernel"])]}
    if "bias" in grads[name]:
      expected[name]["bias"] = u[-1]
  assert bf.relative_error(updates, expected) < 1e-3  # float32, as exact K-FAC's

  exact = kfac_optax.scale_by_kfac(
      model.apply, kfac_optax.losses.softmax_cross_entropy(), example_batch=batch,
      damping=damping, estimation="empirical")
  exact_updates, _ = exact.update(grads, exact.init(params), params, batch=batch)
  assert bf.relative_error(exact_updates, expected) > 1e-2  # the truncation mattered


def test_factor_rank_must_be_a_positive_int():
  params, batch = bf.tiny_problem()
  for bad in (0, 2.5, "32"):
    with pytest.raises(ValueError, match="factor_rank must be a positive Python int"):
      kfac_optax.scale_by_kfac(bf.TinyMLP().apply,
                               kfac_optax.losses.softmax_cross_entropy(),
                               example_batch=batch, factor_rank=bad)
