"""K-FAC (Kronecker-factored approximate curvature) as an optax transformation."""

from kfac_optax import layouts
from kfac_optax import losses
from kfac_optax import sharding
from kfac_optax import summary
from kfac_optax.adaptive import norm_constraint
from kfac_optax.blocks import KroneckerFactors
from kfac_optax.curvature import Curvature
from kfac_optax.curvature import model_rngs
from kfac_optax.layers import register_layer
from kfac_optax.summary import FallbackWarning
from kfac_optax.train_state import TrainState
from kfac_optax.transform import KFACState
from kfac_optax.transform import ScaleByKFACState
from kfac_optax.transform import describe
from kfac_optax.transform import kfac
from kfac_optax.transform import scale_by_kfac
from kfac_optax.transform import stats

__all__ = [
    "Curvature",
    "FallbackWarning",
    "KFACState",
    "KroneckerFactors",
    "ScaleByKFACState",
    "TrainState",
    "describe",
    "kfac",
    "layouts",
    "losses",
    "model_rngs",
    "norm_constraint",
    "register_layer",
    "scale_by_kfac",
    "sharding",
    "stats",
    "summary",
]
__version__ = "0.1.0"
