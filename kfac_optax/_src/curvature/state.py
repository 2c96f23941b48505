"""`ScaleByKFACState`: the state of `scale_by_kfac` and of `Curvature`."""

from typing import Any, NamedTuple

import jax

FALLBACK = "<diagonal>"  # state key of the diagonal fallback block


class ScaleByKFACState(NamedTuple):
  """State of `scale_by_kfac` (and of `Curvature`).

  Attributes:
    count: updates so far (``t`` of docs/design.md; 0 on the first update).
    stats_count: statistics updates folded into ``factors`` so far.
    factors: block key -> debiased EMA of the block's statistics:
      `blocks.KroneckerFactors` ``(A, G)`` for a layer (key: its module path
      joined by "/"), ``{leaf path: F}`` for the diagonal fallback (key
      ``"<diagonal>"``); a `block_stacks.BlockStacks`, which holds the
      Kronecker blocks' factors in stacks split over the mesh and gives
      each block's by its key.
    inverses: block key -> damped inverses from the last accepted refresh,
      same layout (identities before the first).
    damping: the damping λ of the inverses in use (0 before the first
      accepted refresh, which needs a positive one).
    rejected_statistics: statistics updates whose batch statistics were not
      finite, so the factors kept their previous values.
    rejected_refreshes: inverse refreshes that kept every previous inverse,
      because the damping was not a positive finite number or some block's
      damped inverse was not finite.
    rescaled_updates: updates scaled down to fit the parameter dtype
      (see `Curvature.precondition`).

  Factors, inverses and damping are float64 when the params are float64
  (or any of them is), else float32.
  """
  count: jax.Array
  stats_count: jax.Array
  factors: dict[str, Any]
  inverses: dict[str, Any]
  damping: jax.Array
  rejected_statistics: jax.Array
  rejected_refreshes: jax.Array
  rescaled_updates: jax.Array
