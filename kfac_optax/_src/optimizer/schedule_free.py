"""`schedule_free_kfac`: K-FAC's steps under schedule-free averaging.

Why: with a constant learning rate K-FAC's iterates settle into a band above
the loss that averaging reaches; on the transformer LM of the benchmarks
Schedule-Free AdamW set the 120-s target there. Schedule-free averaging
(Defazio et al. 2024) needs no schedule and no horizon, and any base
optimizer's steps can feed it: here K-FAC's, taken at the point where the
gradient (and the curvature's statistics) are measured.
"""

from typing import Any, Callable

import optax

from kfac_optax._src import checks
from kfac_optax._src import losses
from kfac_optax._src.optimizer import kfac as kfac_alias

# The KL bound of the base steps. The averaged iterate moves less than the
# base sequence, and without momentum nothing lengthens a clipped step (with
# μ = 0.7 `kfac`'s bound of 1e-3 lets steps grow 3.3-fold, ~1e-2 in the
# Fisher norm): on the benchmarks' LM, 1e-2 was slower than 3e-2, and 1e-1
# no faster (benchmarks/RESULTS.md, "Schedule-free K-FAC").
SCHEDULE_FREE_NORM_CONSTRAINT = 3e-2


def schedule_free_kfac(
    apply_fn: Callable[..., Any],
    loss: losses.PredictiveLoss,
    *,
    example_batch: Any,
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    weight_lr_power: float = 2.0,
    norm_constraint: float | None = SCHEDULE_FREE_NORM_CONSTRAINT,
    **kfac_settings: Any,
) -> optax.GradientTransformationExtraArgs:
  r"""K-FAC's steps averaged the schedule-free way.

  The params the model trains with (where the gradient, the statistics and
  the loss are taken) are ``y``; K-FAC's step ``δ_t`` at ``y_t`` (`kfac`
  with momentum 0: ``δ = α v``, ``v = F̂⁻¹ g``, ``α = -lr`` shrunk so that
  ``α² vᵀg ≤ norm_constraint``) moves a base sequence ``z``, and ``y`` is an
  interpolation of ``z`` and its weighted running average ``x``:

  .. math::

    z_{t+1} = z_t + δ_t, \quad
    x_{t+1} = (1 - c_{t+1}) x_t + c_{t+1} z_{t+1}, \quad
    y_{t+1} = b_1 x_{t+1} + (1 - b_1) z_{t+1},

  with ``c_{t+1} = w_t / Σ_{i≤t} w_i``, ``w_t = (max_{i≤t} lr_i)^p``
  (``p = weight_lr_power``; optax's weights: a warm-up's early steps weigh
  less, a decay's late ones do not; ``1/(t+1)`` for a constant rate) and
  ``x_0 = y_0 = z_0``. The interpolation takes momentum's place, so
  ``momentum`` is not a setting.
  Evaluate at ``x``: ``optax.contrib.schedule_free_eval_params(opt_state,
  params)``.

  Args:
    apply_fn: the flax apply function or NNX model (see `kfac`).
    loss: the model's predictive distribution (`kfac_optax.losses`).
    example_batch: see `scale_by_kfac`.
    learning_rate: a float > 0 or a schedule: K-FAC's rate, and the
      averaging weights' ``lr_t``.
    b1: the interpolation ``b_1`` in [0, 1).
    weight_lr_power: ``p``, the power of the rate in the averaging weights.
    norm_constraint: K-FAC's KL bound ``c`` of each base step (None: off).
    **kfac_settings: any other setting of `kfac` (damping, periods,
      curvature options), except ``momentum``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (``update`` needs
    ``batch=``, as `kfac`'s); its state is optax's ``ScheduleFreeState``
    around `KFACState`, which `kfac_optax.stats` finds.

  Raises:
    ValueError: for ``momentum`` or ``learning_rate=None`` (the quadratic
      model sizes its own steps; averaging needs a rate to weight them), a
      ``b1`` outside [0, 1), a negative ``weight_lr_power``, and `kfac`'s
      own errors.

  Example:
    >>> tx = kfac_optax.schedule_free_kfac(
    ...     model.apply, kfac_optax.losses.softmax_cross_entropy(),
    ...     example_batch=batch, learning_rate=3e-2, damping=1e-4,
    ...     stats_update_period=10, inverse_update_period=10)  # doctest: +SKIP

  References:
    Defazio, Yang, Mehta, Mishchenko, Khaled & Cutkosky, "The Road Less
    Scheduled", NeurIPS 2024.
  """
  if "momentum" in kfac_settings:
    raise ValueError("schedule_free_kfac has no momentum: the interpolation "
                     "b1 between the steps and their average takes its place")
  if learning_rate is None:
    raise ValueError("schedule_free_kfac needs a learning_rate: the averaging "
                     "weights its steps by the rate (the automatic mode, "
                     "learning_rate=None, is kfac's)")
  checks.in_range("b1", b1, 0.0, 1.0, high_open=True)
  checks.in_range("weight_lr_power", weight_lr_power, 0.0)
  base = kfac_alias.kfac(apply_fn, loss, example_batch=example_batch,
                         learning_rate=learning_rate, momentum=0.0,
                         norm_constraint=norm_constraint, **kfac_settings)
  # optax's averaging counts its steps from 1, K-FAC from 0: each step's
  # weight should come from the rate that step was taken with.
  weight_rate = ((lambda count: learning_rate(count - 1)) if callable(learning_rate)
                 else learning_rate)
  return optax.contrib.schedule_free(base, weight_rate, b1=b1,
                                     weight_lr_power=weight_lr_power)
