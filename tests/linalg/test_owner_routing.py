"""`owner_routing.at_owners` equals each slot's product computed in one
place, for matrices of every layout FSDP and tensor parallelism give
(rows, columns or both split, over one axis or two, or replicated), on
meshes of either orientation, and hands each result back in its layout."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from kfac_optax._src.linalg import owner_routing

SPECS = (P(None, "data", "model"), P(None, "model", "data"), P(None, None, "model"),
         P(None, ("data", "model"), None), P(None, None, None),
         P(None, ("model", "data"), None), P(None, None, ("model", "data")))
COUNTS = (1, 2, 1, 1, 3, 1, 1)  # 10 slots used of 16


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (8, 1)])
def test_each_slot_is_multiplied_by_its_own_factor_on_its_owner(shape):
  mesh = jax.make_mesh(shape, ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rng = np.random.default_rng(0)
  rows, cols, slots = 8, 16, 16
  matrices = [rng.normal(size=(k, rows, cols)).astype(np.float32) for k in COUNTS]
  left = rng.normal(size=(slots, rows, rows)).astype(np.float32)
  right = rng.normal(size=(slots, cols, cols)).astype(np.float32)
  placed = [jax.device_put(m, NamedSharding(mesh, s)) for m, s in zip(matrices, SPECS)]
  owned = jax.device_put((left, right), NamedSharding(mesh, P(("data", "model"))))
  layouts = [owner_routing.MatrixLayout.of(s, 3) for s in SPECS]

  @jax.jit
  def routed(owned, *matrices):
    # The slot's own factors on both sides: a wrong slot, row or column order shows.
    return owner_routing.at_owners(lambda f, v: f[0] @ v @ f[1], owned, list(matrices),
                                   layouts, slots, ("data", "model"))
  with jax.set_mesh(mesh):
    results = routed(owned, *placed)
  first = np.cumsum((0,) + COUNTS)
  for matrix, result, given, start in zip(matrices, results, placed, first):
    used = slice(start, start + len(matrix))
    expected = left[used] @ matrix @ right[used]
    np.testing.assert_allclose(np.asarray(result), expected, rtol=1e-5, atol=1e-5)
    assert result.sharding.is_equivalent_to(given.sharding, 3)


@pytest.mark.parametrize("shape", [(2, 4), (8, 1)])
def test_results_kept_on_the_owners_form_the_slots_stack(shape):
  """Without the way back (a factor's statistics): slot t of the result is
  the Gram of slot t's matrix, zeros in the padding, split like the slots."""
  mesh = jax.make_mesh(shape, ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rng = np.random.default_rng(1)
  matrices = [rng.normal(size=(k, 8, 16)).astype(np.float32) for k in COUNTS]
  placed = [jax.device_put(m, NamedSharding(mesh, s)) for m, s in zip(matrices, SPECS)]
  layouts = [owner_routing.MatrixLayout.of(s, 3) for s in SPECS]
  gram = lambda _, v: v.swapaxes(1, 2) @ v
  with jax.set_mesh(mesh):
    stack = jax.jit(lambda *m: owner_routing.at_owners(
        gram, (), list(m), layouts, 16, ("data", "model"), back=False))(*placed)
  expected = np.concatenate([gram(None, m) for m in matrices] + [np.zeros((6, 16, 16))])
  np.testing.assert_allclose(np.asarray(stack), expected, rtol=1e-5, atol=1e-4)
  assert stack.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "model"))), 3)


@pytest.mark.parametrize("shape", [(2, 4), (8, 1)])
def test_partial_results_summed_on_the_owners(shape):
  """`summed_at_owners`: each device's Gram of its own rows (its part of
  rows an axis replicates), added up on the slot's owner, is the slot's
  Gram, for rows split over one axis, two, or none."""
  mesh = jax.make_mesh(shape, ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  specs = (P(None, "data", None), P(None, ("model", "data"), None),
           P(None, None, None), P(None, "model", None))
  counts = (2, 1, 3, 1)
  rng = np.random.default_rng(2)
  matrices = [rng.normal(size=(k, 16, 8)).astype(np.float32) for k in counts]
  placed = [jax.device_put(m, NamedSharding(mesh, s)) for m, s in zip(matrices, specs)]
  layouts = [owner_routing.MatrixLayout.of(s, 3) for s in specs]
  gram = lambda v: v.swapaxes(1, 2) @ v
  with jax.set_mesh(mesh):
    stack = jax.jit(lambda *m: owner_routing.summed_at_owners(
        gram, list(m), layouts, 8, ("data", "model")))(*placed)
  expected = np.concatenate([gram(m) for m in matrices] + [np.zeros((1, 8, 8))])
  np.testing.assert_allclose(np.asarray(stack), expected, rtol=1e-5, atol=1e-4)
  assert stack.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "model"))), 3)


def test_layout_of_a_spec():
  layout = owner_routing.MatrixLayout
  assert layout.of(P("data", "model"), 2) == layout(("data",), ("model",))
  assert layout.of(P(None, ("model", "data"), None), 3) == layout(("model", "data"), ())
  assert layout.of(P(None, None, "data"), 3) == layout((), ("data",))
  assert layout.of(P("data"), 3) is None  # the stack axis split
  assert owner_routing.routable((3, 8, 16), 8) and not owner_routing.routable((3, 16, 12), 8)
