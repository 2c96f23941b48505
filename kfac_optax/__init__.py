"""K-FAC (Kronecker-factored approximate curvature) as an optax transformation."""

from kfac_optax import losses
from kfac_optax import sharding
from kfac_optax.blocks import KroneckerFactors
from kfac_optax.layers import register_layer
from kfac_optax.train_state import TrainState
from kfac_optax.transform import ScaleByKFACState
from kfac_optax.transform import kfac
from kfac_optax.transform import scale_by_kfac

__all__ = [
    "KroneckerFactors",
    "ScaleByKFACState",
    "TrainState",
    "kfac",
    "losses",
    "register_layer",
    "scale_by_kfac",
    "sharding",
]
__version__ = "0.1.0"
