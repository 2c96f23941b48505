"""NNX twins of linen test models, so that one brute-force test checks both.

A twin is an ``nnx.Module`` with the linen model's module paths; built
abstractly and given the linen model's variables, it computes the same
function, so a test's explicit reference (written from the linen model's
params) holds for K-FAC run on either.
"""

from flax import nnx
import jax
import jax.numpy as jnp

APIS = ("linen", "nnx")


def twin_of(make, linen_variables) -> nnx.Module:
  """The NNX model ``make(rngs)`` holding the linen twin's variables (its
  params and, by the same names, BatchNorm statistics): built abstractly,
  so no initializer runs."""
  model = nnx.eval_shape(lambda: make(nnx.Rngs(0)))
  state = {}
  for collection in linen_variables.values():
    state = nnx.merge_state(state, jax.tree.map(jnp.asarray, dict(collection)))
  nnx.update(model, nnx.State(state))
  return model


def model_for(api, linen, make_nnx, params):
  """The model as `kfac_optax.scale_by_kfac` takes it: for ``api="linen"``
  ``linen.apply``, for ``"nnx"`` the twin ``make_nnx(rngs)`` holding
  ``params``. Either takes the linen params tree (a plain dict) as is."""
  if api == "linen":
    return linen.apply
  return twin_of(make_nnx, {"params": params})
