"""Placing K-FAC's state on a device mesh (docs/scaling.md)."""

from kfac_optax._src.sharding import MIN_SHARDED_BYTES
from kfac_optax._src.sharding import state_shardings

__all__ = ["MIN_SHARDED_BYTES", "state_shardings"]
