"""Placing K-FAC's state on a mesh (see docs/scaling.md)."""

from kfac_optax._src.sharding import state_shardings

__all__ = ["state_shardings"]
