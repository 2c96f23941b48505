"""A state or params tree K-FAC cannot read is an error naming cause and fix.

Before, a `scale_by_kfac` state given to `kfac` raised an AttributeError, and
a state of another model (or params with a leaf added since ``init``) a raw
pytree structure error naming ``<diagonal>``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import kfac_optax
from tests import brute_force as bf

PARAMS, BATCH = bf.tiny_problem()
APPLY = bf.TinyMLP().apply
LOSS = kfac_optax.losses.softmax_cross_entropy()
GRADS = jax.tree.map(jnp.ones_like, PARAMS)
KEY = jax.random.key(0)
FIX_STATE = (
    "Fix: pass the state this transformation's init returned (opt_state = "
    "tx.init(params) with the same tx); restore a checkpoint with a target "
    "built from the same tx.")
FIX_PARAMS = (
    "Fix: make the state with this transformation's init on these params "
    "(tx.init(params)); a state of another model, or of params that gained "
    "or lost leaves since, does not fit.")


def scale_by_kfac(apply_fn=APPLY):
  return kfac_optax.scale_by_kfac(apply_fn, LOSS, example_batch=BATCH)


def kfac():
  return kfac_optax.kfac(APPLY, LOSS, example_batch=BATCH, learning_rate=0.1)


@pytest.mark.parametrize("made_by, given_to, message", [
    (scale_by_kfac, kfac,
     "kfac's update got a ScaleByKFACState as its state, not the KFACState "
     "that kfac's init makes.\n"),
    (kfac, scale_by_kfac,
     "scale_by_kfac's update got a KFACState as its state, not the "
     "ScaleByKFACState that scale_by_kfac's init makes.\n"),
])
def test_a_state_of_the_other_transformation(made_by, given_to, message):
  with pytest.raises(TypeError) as error:
    given_to().update(GRADS, made_by().init(PARAMS), PARAMS, batch=BATCH, rng=KEY)
  assert str(error.value) == message + FIX_STATE


def test_params_with_a_leaf_added_since_init():
  tx = scale_by_kfac()
  state = tx.init(PARAMS)
  extra = {**PARAMS, "gate": jnp.ones(3)}
  with pytest.raises(ValueError) as error:
    tx.update({**GRADS, "gate": jnp.ones(3)}, state, extra, batch=BATCH, rng=KEY)
  assert str(error.value) == (
      "the K-FAC state does not fit these params: block '<diagonal>': missing "
      "from the state.\n" + FIX_PARAMS)


def test_a_state_of_another_model():
  other = nn.Dense(3)
  other_params = other.init(KEY, BATCH[0])["params"]
  state = scale_by_kfac(other.apply).init(other_params)
  with pytest.raises(ValueError) as error:
    scale_by_kfac().update(GRADS, state, PARAMS, batch=BATCH, rng=KEY)
  assert str(error.value) == (
      "the K-FAC state does not fit these params: block 'hidden': missing from "
      "the state; block 'nobias': missing from the state; block 'out': missing "
      "from the state; block '': in the state, not in this model.\n" + FIX_PARAMS)


def test_a_state_of_the_same_model_on_wider_inputs():
  params, batch = bf.tiny_problem(d_in=7)  # the hidden layer's A: 8×8, not 6×6
  state = scale_by_kfac().init(PARAMS)
  tx = kfac_optax.scale_by_kfac(APPLY, LOSS, example_batch=batch)
  with pytest.raises(ValueError) as error:
    tx.update(jax.tree.map(jnp.ones_like, params), state, params, batch=batch,
              rng=KEY)
  assert str(error.value) == (
      "the K-FAC state does not fit these params: block 'hidden': shapes "
      "KroneckerFactors(a=(1, 6, 6), g=(1, 4, 4)) in the state, "
      "KroneckerFactors(a=(1, 8, 8), g=(1, 4, 4)) for these params.\n" + FIX_PARAMS)
