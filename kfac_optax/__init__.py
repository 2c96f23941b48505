"""K-FAC (Kronecker-factored approximate curvature) as an optax transformation.

The public surface: the names below, and the modules `kfac_optax.losses`
(predictive distributions), `kfac_optax.layouts` (layer layouts for
`register_layer`) and `kfac_optax.sharding` (placing the state on a mesh).
Everything under `kfac_optax._src` is internal (docs/design.md maps it).
"""

from kfac_optax import layouts
from kfac_optax import losses
from kfac_optax import sharding
from kfac_optax._src.blocks.kronecker import KroneckerFactors
from kfac_optax._src.curvature.curvature import Curvature
from kfac_optax._src.curvature.model_call import model_rngs
from kfac_optax._src.curvature.options import CurvatureOptions
from kfac_optax._src.curvature.state import ScaleByKFACState
from kfac_optax._src.curvature.summary import FallbackWarning
from kfac_optax._src.curvature.summary import Summary
from kfac_optax._src.models.registry import register_layer
from kfac_optax._src.optimizer.adaptive import norm_constraint
from kfac_optax._src.optimizer.inspection import describe
from kfac_optax._src.optimizer.inspection import stats
from kfac_optax._src.optimizer.kfac import kfac
from kfac_optax._src.optimizer.kfac_step import KFACState
from kfac_optax._src.optimizer.scale_by_kfac import scale_by_kfac
from kfac_optax._src.optimizer.schedule_free import schedule_free_kfac
from kfac_optax._src.train_state import TrainState

__all__ = [
    "Curvature",
    "CurvatureOptions",
    "FallbackWarning",
    "KFACState",
    "KroneckerFactors",
    "ScaleByKFACState",
    "Summary",
    "TrainState",
    "describe",
    "kfac",
    "layouts",
    "losses",
    "model_rngs",
    "norm_constraint",
    "register_layer",
    "scale_by_kfac",
    "schedule_free_kfac",
    "sharding",
    "stats",
]
__version__ = "0.1.0"
