"""What a K-FAC optimizer holds, for logging and for reading: `stats` and
`describe`.

Both find K-FAC inside whatever the user wraps it in (optax's chains and
wrappers, a TrainState): `stats` in the state, `describe` in the
transformation.
"""

import functools
import types
from typing import Any

import jax
import jax.numpy as jnp

from kfac_optax._src.curvature import summary
from kfac_optax._src.curvature.curvature import Curvature
from kfac_optax._src.curvature.state import ScaleByKFACState
from kfac_optax._src.optimizer.kfac_step import KFACState

_NAN = float("nan")


def stats(opt_state: Any) -> dict[str, jax.Array]:
  """Scalars to log from a state holding `kfac`'s or `scale_by_kfac`'s state.

  Returns, from the first `KFACState` found in ``opt_state`` (any optax
  wrapper or TrainState around it), else the first `ScaleByKFACState`:

  - ``damping``: the damping of the inverses in use, from the last accepted
    refresh (``λ + l2_reg`` for `kfac`; 0 before the first refresh);
  - ``rejected_statistics``, ``rejected_refreshes``, ``rescaled_updates``:
    the counters of `ScaleByKFACState`;
  - ``requested_damping``, ``learning_rate``, ``momentum``, ``rho``,
    ``qmodel_change``, ``fisher_norm``: see `KFACState` (``requested_damping``
    is its ``damping``: the λ the optimizer asks for, adapted or scheduled).
    With only a `ScaleByKFACState` (``scale_by_kfac`` in a user's chain),
    these values, which that chain's other members own, are nan.

  Raises:
    ValueError: if ``opt_state`` holds neither state.
  """
  kinds = (KFACState, ScaleByKFACState)
  found = [node for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds))
           if isinstance(node, kinds)]
  if not found:
    raise ValueError("kfac_optax.stats found no kfac or scale_by_kfac state in "
                     f"the given {type(opt_state).__name__}")
  full = [node for node in found if isinstance(node, KFACState)]
  curvature = full[0].curvature if full else found[0]
  counted = {"damping": curvature.damping,
             "rejected_statistics": curvature.rejected_statistics,
             "rejected_refreshes": curvature.rejected_refreshes,
             "rescaled_updates": curvature.rescaled_updates}
  if full:
    state = full[0]
    return {**counted, "requested_damping": state.damping,
            "learning_rate": state.learning_rate, "momentum": state.momentum,
            "rho": state.rho, "qmodel_change": state.qmodel_change,
            "fisher_norm": state.fisher_norm}
  nan = jnp.full([], _NAN, jnp.float32)
  return {**counted, **{name: nan for name in (
      "requested_damping", "learning_rate", "momentum", "rho", "qmodel_change",
      "fisher_norm")}}


def _curvatures_in(node: Any, seen: set[int]) -> list[Curvature]:
  """The `Curvature`s that ``node`` holds or its functions close over.

  Walks tuples (optax transformations), lists, dicts, functools.partial,
  bound methods, closure cells and the attributes of optax's objects: how
  `scale_by_kfac` (``init`` is `Curvature.init`), `kfac` (closures) and
  optax's combinators (``chain``: closures over its members;
  ``MultiSteps``: an object holding its inner transformation) hold it.
  """
  if isinstance(node, Curvature):
    return [node]
  if id(node) in seen:
    return []
  seen.add(id(node))
  if isinstance(node, (tuple, list)):
    children = list(node)
  elif isinstance(node, dict):
    children = list(node.values())
  elif isinstance(node, functools.partial):
    children = [node.func, *node.args, *node.keywords.values()]
  elif isinstance(node, types.MethodType):
    children = [node.__self__, node.__func__]
  elif type(node).__module__.startswith("optax."):  # e.g. optax.MultiSteps
    children = list(vars(node).values()) if hasattr(node, "__dict__") else []
  elif isinstance(node, types.FunctionType):
    children = []
    for cell in node.__closure__ or ():
      try:
        children.append(cell.cell_contents)
      except ValueError:  # a cell not yet filled
        pass
  else:
    return []
  found = []
  for child in children:
    found += [c for c in _curvatures_in(child, seen) if all(c is not f for f in found)]
  return found


def describe(optimizer: Any, params: Any) -> summary.Summary:
  """What K-FAC does with a model: its block per module, as a table.

  For every module: its block kind (a key of `summary.KINDS`: ``kronecker``,
  ``kron_in_diag``/``kron_out_diag``/``kron_both_diag`` for factors kept
  diagonal by ``max_factor_dim`` or ``layer_overrides``, ``embedding``,
  ``norm``, ``diagonal``, ``fallback`` for params no layer block captures,
  ``skipped``), its factor sizes, its parameter count, and each kind's share
  of the parameters. ``print(describe(tx, params))`` shows the table.

  Args:
    optimizer: the transformation returned by `kfac` or `scale_by_kfac`,
      alone or inside ``optax.chain`` (or another combinator that closes
      over its members), ``optax.MultiSteps`` (or its
      ``gradient_transformation()``), or a `Curvature`.
    params: the model's params (arrays or ``jax.ShapeDtypeStruct``).

  Returns:
    A `summary.Summary`: ``rows`` (module path, kind, factors, parameter
    count), ``shares()``; ``str()`` renders the table.

  Raises:
    ValueError: if ``optimizer`` holds no K-FAC curvature, or several.

  Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp, optax, kfac_optax
    >>> model = nn.Dense(3)
    >>> batch = (jnp.ones((8, 4)), jnp.zeros((8,), jnp.int32))
    >>> params = model.init(jax.random.key(0), batch[0])["params"]
    >>> tx = optax.chain(kfac_optax.scale_by_kfac(
    ...     model.apply, kfac_optax.losses.softmax_cross_entropy(),
    ...     example_batch=batch), optax.sgd(0.1))
    >>> kfac_optax.describe(tx, params).shares()
    {'kronecker': 1.0}
  """
  found = _curvatures_in(optimizer, set())
  if len(found) != 1:
    raise ValueError(
        f"kfac_optax.describe found {len(found) or 'no'} K-FAC curvature"
        f"{'s' if found else ''} in the given {type(optimizer).__name__}; pass "
        "the transformation returned by kfac or scale_by_kfac (alone or in "
        "optax.chain), or a kfac_optax.Curvature built with the same arguments "
        "(e.g. for optax.inject_hyperparams, which builds the optimizer in init)")
  return found[0].describe(params)
