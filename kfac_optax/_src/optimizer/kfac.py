"""`kfac`: the optimizer to drop in, K-FAC with a learning rate and momentum.

The direction is `scale_by_kfac`'s (the curvature work is `Curvature`'s);
`kfac` adds the learning rate and momentum (fixed, scheduled, or chosen by
the quadratic model), an optional norm constraint, adaptive damping and
burn-in. Its update and state (`KFACState`) are `kfac_step`'s.
"""

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from kfac_optax._src import checks
from kfac_optax._src import losses
from kfac_optax._src import param_boxes
from kfac_optax._src.curvature import explicit_axes
from kfac_optax._src.curvature import options
from kfac_optax._src.curvature import sub_batch
from kfac_optax._src.curvature.curvature import Curvature
from kfac_optax._src.optimizer import kfac_step
from kfac_optax._src.optimizer import scale_by_kfac
from kfac_optax._src.optimizer import update_args
from kfac_optax._src.optimizer.kfac_step import KFACState

_OPTIONS = options.DEFAULTS
# Chosen from the stability suite (benchmarks/STABILITY.md): with a given
# learning rate, "auto" means momentum 0.9 and a norm constraint (KL clipping)
# of 1e-3, which kept every suite model finite at learning rates 0.03 and 0.1.
FIXED_MOMENTUM = 0.9
FIXED_NORM_CONSTRAINT = 1e-3


def _resolved_modes(learning_rate: Any, momentum: Any, norm_constraint: Any,
                    adaptive_damping: bool | None) -> tuple[Any, Any, bool]:
  """``(momentum, norm_constraint, adaptive_damping)`` with their ``"auto"``
  and None defaults resolved by whether a learning rate is given."""
  for name, value in (("momentum", momentum), ("norm_constraint", norm_constraint)):
    if isinstance(value, str) and value != "auto":
      raise ValueError(f'{name} must be a number, None or "auto", got {value!r}')
  fixed = learning_rate is not None
  if momentum == "auto":
    momentum = FIXED_MOMENTUM if fixed else None
  if norm_constraint == "auto":
    norm_constraint = FIXED_NORM_CONSTRAINT if fixed else None
  if adaptive_damping is None:
    adaptive_damping = not fixed
  return momentum, norm_constraint, adaptive_damping


def _check_kfac_settings(arguments: dict[str, Any]) -> None:
  """`kfac`'s own settings, resolved (`Curvature` checks the shared ones)."""
  learning_rate = arguments["learning_rate"]
  if callable(learning_rate):  # a warmup from 0 (optax's usual) moves nothing at first
    checks.in_range("learning_rate", learning_rate, 0.0)
  elif learning_rate is not None:
    checks.positive("learning_rate", learning_rate)
  if arguments["norm_constraint"] is not None:
    checks.positive("norm_constraint", arguments["norm_constraint"])
  for name in ("damping", "min_damping", "max_damping"):
    checks.positive(name, arguments[name])
  checks.ordered("min_damping", arguments["min_damping"],
                 "max_damping", arguments["max_damping"])
  checks.count("damping_adaptation_interval",
               arguments["damping_adaptation_interval"], 1)
  checks.in_range("damping_adaptation_decay", arguments["damping_adaptation_decay"],
                  0.0, 1.0, low_open=True)
  checks.in_range("l2_reg", arguments["l2_reg"], 0.0)
  checks.count("num_burnin_steps", arguments["num_burnin_steps"], 0)
  if arguments["norm_constraint"] is not None and learning_rate is None:
    raise ValueError("norm_constraint bounds the step of a given learning "
                     "rate; with learning_rate=None the quadratic model "
                     "already chooses the step size")
  checks.static_size("quadratic_batch_size", arguments["quadratic_batch_size"],
                     none_allowed=True)
  if arguments["quadratic_batch_size"] is not None and (
      learning_rate is not None and arguments["momentum"] is not None):
    raise ValueError(
        "quadratic_batch_size sizes the automatic mode's quadratic model, "
        "which a fixed learning_rate and momentum do not build.\nFix: "
        "learning_rate=None (or momentum=None), or quadratic_batch_size=None")
  if arguments["adaptive_damping"] and callable(arguments["damping"]):
    raise ValueError("adaptive_damping adapts λ itself: give damping as the "
                     "initial value, not a schedule")


@options.document
def kfac(
    apply_fn: Callable[..., Any],
    loss: losses.PredictiveLoss,
    *,
    example_batch: Any,
    learning_rate: optax.ScalarOrSchedule | None = None,
    momentum: optax.ScalarOrSchedule | str | None = "auto",
    damping: optax.ScalarOrSchedule = scale_by_kfac.DEFAULT_DAMPING,
    inputs: Callable[[Any], Any] | None = _OPTIONS.inputs,
    outputs: Callable[[Any], Any] | None = _OPTIONS.outputs,
    ema_decay: float = _OPTIONS.ema_decay,
    inverse_update_period: int = _OPTIONS.inverse_update_period,
    stats_update_period: int = _OPTIONS.stats_update_period,
    curvature_warmup: int = _OPTIONS.curvature_warmup,
    estimation: str = _OPTIONS.estimation,
    inverse: str = _OPTIONS.inverse,
    num_samples: int = _OPTIONS.num_samples,
    apply_kwargs: dict[str, Any] | None = _OPTIONS.apply_kwargs,
    layer_overrides: dict[str, str] | None = _OPTIONS.layer_overrides,
    tied_embeddings: dict[str, str] | None = _OPTIONS.tied_embeddings,
    mesh: jax.sharding.Mesh | None = _OPTIONS.mesh,
    axis_name: str | tuple[str, ...] | None = _OPTIONS.axis_name,
    max_factor_dim: int | str | None = _OPTIONS.max_factor_dim,
    curvature_batch_size: int | None = _OPTIONS.curvature_batch_size,
    factor_rank: int | None = _OPTIONS.factor_rank,
    factor_block_size: int | None = _OPTIONS.factor_block_size,
    norm_constraint: float | str | None = "auto",
    adaptive_damping: bool | None = None,
    damping_adaptation_interval: int = 5,
    damping_adaptation_decay: float = 0.95,
    min_damping: float = 1e-8,
    max_damping: float = math.inf,
    l2_reg: float = 0.0,
    num_burnin_steps: int = 0,
    quadratic_batch_size: int | None = None,
) -> optax.GradientTransformationExtraArgs:
  """K-FAC with a learning rate and momentum: the optimizer to drop in.

  Each update is ``δ = α v + μ δ_prev`` with ``v = F̂⁻¹ g`` the K-FAC
  preconditioned gradient (`scale_by_kfac`, damped with ``λ + l2_reg``).
  Two ways to use it:

  - **Automatic** (the default: no ``learning_rate``): α and μ minimise the
    damped quadratic model ``q(δ) = gᵀδ + ½ δᵀ(F + (λ + l2_reg) I)δ`` along
    ``v`` and ``δ_prev``, with exact Fisher(=GGN)-vector products on the
    batch (two forward-mode passes; the "qmodel" momentum of the TF K-FAC
    optimizer), and λ adapts. Safeguards (`adaptive.quadratic_coefficients`):
    μ is the model's best in [0, 1]; nearly parallel ``v`` and ``δ_prev``
    fall back to α alone; a step the model does not predict to lower the
    loss is not taken. ``momentum=0`` solves α alone, along ``v``: one
    tangent, not two (docs/settings.md, when it pays).
  - **Fixed** ``learning_rate`` (a float or a schedule): ``α = -lr``, and
    ``momentum="auto"`` means μ = 0.9; with ``norm_constraint=c`` (``"auto"``:
    1e-3), α is scaled down so that ``α² vᵀ F̂ v = α² vᵀ g ≤ c`` (Ba et al.
    2017). Recommended: ``learning_rate=0.03`` with damping 1e-2 (the
    stability suite's settings, benchmarks/STABILITY.md).
    ``learning_rate=None`` with a given ``momentum``, or a given
    ``learning_rate`` with ``momentum=None``, solves for the free one only.

  ``adaptive_damping`` (default: on in the automatic mode) measures the
  reduction ratio ``ρ = (h(θ+δ) - h(θ)) / q₀(δ)`` (``q₀`` without λ; one
  extra forward pass) every ``damping_adaptation_interval`` steps, and on
  every step after a poor one (ρ < ¼ or nan) until a good one, and moves λ
  by the Levenberg-Marquardt rule of Martens & Grosse (2015, section 6.5),
  see `adaptive.levenberg_marquardt`. A step the model does not predict to
  lower the loss has ρ = nan; a measured step with ρ < 0 or nan is not
  taken (zero update, momentum restarted). In the automatic mode a step
  whose model predicts a decrease more than four times the last step's,
  or more than four times a loss that cannot be negative, is measured
  too, and not taken if its loss rose (λ then raised).

  The first ``num_burnin_steps`` updates only gather statistics and return
  zero updates. ``curvature_batch_size`` applies to the factors only: the
  quadratic model's exact Fisher products, and the losses that adaptive
  damping compares, use the whole batch like the gradient (they size the
  step, so they see the data the step is taken on). On a large batch the
  model's pass costs as much as 1.6 gradients; ``quadratic_batch_size=n``
  takes its curvature term (``vᵀFv`` and the other entries of its 2×2
  matrix) from the first n examples, an unbiased estimate of the batch's,
  at about n/B of the cost, and ρ the loss change on the same examples;
  the model's gradient term stays the batch's. With 250 of the deep
  autoencoder's 1000 images the steps to every target were the whole
  batch's within 3 and the automatic step 1.29× the fixed one's (1.76×
  without); 32 of 128 images lost steps. On the transformer LM, 8 or 16
  of its 32 sequences took 1.05-1.13× the whole batch's steps to its
  early losses at 0.78-0.86× its step, once the steps predicted to lower
  the loss far more than the last were measured (before, such unmeasured
  steps made the loss spike with 16 sequences in two of four seeds;
  benchmarks/RESULTS.md, "The automatic mode's model from a sub-batch";
  docs/settings.md).

  ``l2_reg`` is the coefficient η of an L2 term ``η/2 ‖θ‖²`` that the user
  adds to the loss (its gradient is the user's): it is added to the
  curvature (damping and quadratic model), as in the original optimizers.

  Args:
    apply_fn: the flax apply function, e.g. ``model.apply``, or an NNX
      model (see `scale_by_kfac`).
    loss: the model's predictive distribution (`kfac_optax.losses`).
    example_batch: see `scale_by_kfac`.
    learning_rate: a float > 0, a schedule of the step (>= 0 at count 0:
      a warmup from 0 takes no step at first), or None (the automatic
      mode: chosen by the quadratic model).
    momentum: a float, a schedule, None (chosen by the quadratic model), or
      ``"auto"``: None without a learning rate, else 0.9.
    damping: the Tikhonov λ (see `scale_by_kfac`); with
      ``adaptive_damping``, the initial λ.
    {curvature_options}
    norm_constraint: c, None, or ``"auto"``: 1e-3 with a given learning
      rate, None without (the quadratic model already sizes the step).
    adaptive_damping: adapt λ by the Levenberg-Marquardt rule; None: when
      ``learning_rate`` is None.
    damping_adaptation_interval: steps between adaptations.
    damping_adaptation_decay: ω = decay ** interval.
    min_damping: lower clip of the adapted λ.
    max_damping: upper clip of the adapted λ.
    l2_reg: η ≥ 0, the coefficient of the ``η/2 ‖θ‖²`` in the user's loss:
      added to the curvature, and to the loss change ``ρ`` measures.
    num_burnin_steps: leading updates that return zeros (an int ≥ 0).
    quadratic_batch_size: the quadratic model's Fisher products from the
      first n examples of the batch (a positive Python int, at most the
      batch size), or None (the whole batch); only where the model solves
      α or μ.

  Settings are checked where given: ``learning_rate`` > 0 when given,
  ``norm_constraint`` > 0, ``damping`` > 0, ``0 < min_damping ≤
  max_damping``, ``damping_adaptation_interval`` a positive int,
  ``damping_adaptation_decay`` in (0, 1], and those of `scale_by_kfac`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs
    ``batch=`` (and ``rng=`` for random estimation modes). Arguments are
    spelled out so that ``optax.inject_hyperparams(kfac, static_args=
    ("apply_fn", "num_samples"))`` can inject the numeric ones (list
    ``inputs`` and ``outputs`` there too when given, optax taking every
    callable for a schedule, and ``curvature_batch_size``, ``factor_rank``,
    ``factor_block_size``, ``max_factor_dim`` and ``quadratic_batch_size``
    when given a number; docs/settings.md).

  Raises:
    ValueError: for a setting outside its range (a schedule: at count 0).

  References:
    Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored
    Approximate Curvature", ICML 2015; Ba, Grosse & Martens, "Distributed
    Second-Order Optimization using Kronecker-Factored Approximations",
    ICLR 2017.
  """
  settings = dict(locals())
  momentum, norm_constraint, adaptive_damping = _resolved_modes(
      learning_rate, momentum, norm_constraint, adaptive_damping)
  _check_kfac_settings(locals())
  curvature = Curvature(apply_fn, loss, example_batch, **options.of(settings))
  step = functools.partial(kfac_step.step, kfac_step.Settings(
      curvature, learning_rate, momentum, norm_constraint, adaptive_damping,
      damping, damping_adaptation_interval, damping_adaptation_decay,
      min_damping, max_damping, l2_reg, num_burnin_steps, quadratic_batch_size))

  def init_fn(params):
    # Distinct buffers: a state passed with donate_argnums must not alias.
    # Zeros until measured: a finite state holds only finite numbers.
    unmeasured = [jnp.zeros([], jnp.float32) for _ in range(5)]
    first_damping = update_args.value_at(damping, checks.zero_count())
    # previous_update keeps the params' boxes (their partitioning), as
    # optax's own momentum does, and their sharding: zeros made from the
    # params (not a constant) let a jitted init place it where they are.
    curvature_state = curvature.init(params)
    if quadratic_batch_size != curvature.curvature_batch_size:  # else run there
      sub_batch.check_model_runs(curvature, params, quadratic_batch_size,
                                 "quadratic_batch_size")
    return KFACState(
        curvature_state, jax.tree.map(lambda p: p * 0, params),
        jnp.zeros([], jnp.int32), jnp.asarray(first_damping, jnp.float32) + 0.0,
        *unmeasured)

  def update_fn(grads, state, params=None, *, batch=None, rng=None,
                variables=None, **extra_args):
    del extra_args
    given, boxed_params = grads, params
    grads, params = param_boxes.values(grads), param_boxes.values(params)
    update_args.check(curvature.estimation, grads, batch, params, rng, "kfac")
    update_args.check_state(state, KFACState, "kfac")
    boxed_previous = state.previous_update
    delta, state = explicit_axes.update_with_auto_axes(
        kfac, settings, step, grads,
        state._replace(previous_update=param_boxes.values(boxed_previous)), params,
        batch, dict(variables or {}), rng, curvature.declared_specs(boxed_params))
    return param_boxes.like(given, delta), state._replace(
        previous_update=param_boxes.like(boxed_previous, state.previous_update))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
