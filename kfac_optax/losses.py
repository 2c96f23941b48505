"""Predictive distributions: the losses K-FAC models.

A K-FAC loss is the model's predictive distribution, not a loss function: it
gives the training loss (``loss.value(outputs, batch)``), samples targets
for the Fisher, and its output Fisher. Each averages over every leading axis
and reduces its event axis (docs/design.md, "Mathematical conventions");
``joint`` combines several heads' distributions.
"""

from kfac_optax._src.losses import Bernoulli
from kfac_optax._src.losses import Categorical
from kfac_optax._src.losses import DiagonalNormal
from kfac_optax._src.losses import Gaussian
from kfac_optax._src.losses import Joint
from kfac_optax._src.losses import PredictiveLoss
from kfac_optax._src.losses import Terms
from kfac_optax._src.losses import diagonal_normal
from kfac_optax._src.losses import joint
from kfac_optax._src.losses import sigmoid_cross_entropy
from kfac_optax._src.losses import softmax_cross_entropy
from kfac_optax._src.losses import squared_error

__all__ = [
    "Bernoulli",
    "Categorical",
    "DiagonalNormal",
    "Gaussian",
    "Joint",
    "PredictiveLoss",
    "Terms",
    "diagonal_normal",
    "joint",
    "sigmoid_cross_entropy",
    "softmax_cross_entropy",
    "squared_error",
]
