"""The optax transformations: `scale_by_kfac` and the `kfac` optimizer.

`scale_by_kfac` turns gradients into K-FAC's preconditioned direction (the
curvature work lives in `curvature.Curvature`). `kfac` is the optimizer to
drop in: the direction, a learning rate and momentum (fixed, scheduled, or
chosen by the quadratic model), an optional norm constraint, adaptive
damping and burn-in (`adaptive`). `stats` reads either's state for logging,
`describe` lists the blocks either gives a model.
"""

import dataclasses
import functools
import math
import types
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kfac_optax import adaptive
from kfac_optax import checks
from kfac_optax import losses
from kfac_optax import nnx_capture
from kfac_optax import summary
from kfac_optax.curvature import Curvature
from kfac_optax.curvature import ScaleByKFACState
from kfac_optax.curvature import flatten

_NAN = float("nan")
# Chosen from the stability suite (benchmarks/STABILITY.md): with a given
# learning rate, "auto" means momentum 0.9 and a norm constraint (KL clipping)
# of 1e-3, which kept every suite model finite at learning rates 0.03 and 0.1.
FIXED_MOMENTUM = 0.9
FIXED_NORM_CONSTRAINT = 1e-3
DEFAULT_DAMPING = 1e-2


def _value_at(hyperparameter: Any, count: jax.Array) -> jax.Array:
  return hyperparameter(count) if callable(hyperparameter) else hyperparameter


def _check_update_args(curvature: Curvature, grads, batch, params, rng, name: str):
  if batch is None:
    raise TypeError(
        f"{name}'s update needs the training batch: call "
        "tx.update(grads, state, params, batch=batch, rng=rng), or "
        "kfac_optax.TrainState.apply_gradients(grads=..., batch=..., rng=...). "
        "If you did, a wrapper between you and it dropped them: one that is "
        "not an optax.GradientTransformationExtraArgs, such as an "
        "optax.MultiSteps inside optax.chain (put the chain inside "
        "MultiSteps instead: MultiSteps(optax.chain(..., kfac(...)), k)).")
  if params is None:
    raise TypeError(f"{name}'s update needs params: "
                    "tx.update(grads, state, params, batch=batch, rng=rng)")
  _check_grads_fit(grads, params, name)
  if curvature.estimation in ("fisher", "curvature_prop") and rng is None:
    raise TypeError(
        f'estimation="{curvature.estimation}" draws random output gradients '
        "and needs rng=: pass a fresh jax.random key each step (or use "
        'estimation="empirical" or "exact")')
  if rng is not None:
    checks.random_key("rng", rng)


def _check_grads_fit(grads, params, name: str) -> None:
  """The gradients must be params-shaped: same leaves, same shapes."""
  flat_grads, flat_params = flatten(grads)[0], flatten(params)[0]
  wrong = []
  for path in {**flat_params, **flat_grads}:
    shapes = [tuple(jnp.shape(tree[path])) if path in tree else "missing"
              for tree in (flat_grads, flat_params)]
    if shapes[0] != shapes[1]:
      wrong.append(f"{'/'.join(path)}: {shapes[0]} vs {shapes[1]}")
  if wrong:
    raise ValueError(
        f"{name}'s update got grads that do not match params (grads shape vs "
        f"params shape): {'; '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}."
        "\nFix: pass the gradients of these params, tx.update(grads, state, "
        "params, ...) with grads = jax.grad(loss_fn)(params): the same tree "
        "and shapes as params.")


def _curvature_of(arguments: dict[str, Any]) -> Curvature:
  """The `Curvature` that a transformation's arguments (by name) configure."""
  names = {field.name for field in dataclasses.fields(Curvature)}
  return Curvature(**{k: v for k, v in arguments.items() if k in names})


def _explicit_mesh(trees: Any) -> jax.sharding.AbstractMesh | None:
  """The mesh whose Explicit axes (``jax.make_mesh``'s default) type the
  step: the context mesh (``jax.set_mesh``), else that of an argument's
  sharding (arrays placed on such a mesh outside any context); None if none."""
  meshes = [jax.sharding.get_abstract_mesh()] + [
      jax.typeof(leaf).sharding.mesh for leaf in jax.tree.leaves(trees)
      if isinstance(leaf, jax.Array)]
  return next((mesh for mesh in meshes if not mesh.empty and any(
      kind == jax.sharding.AxisType.Explicit for kind in mesh.axis_types)), None)


def _array_settings(settings: dict[str, Any]) -> dict[str, Any]:
  """The settings given as arrays (or trees of them, e.g. a jax.Array
  ``example_batch``): `optax.inject_hyperparams` passes its values so."""
  found = {}
  for name, value in settings.items():
    leaves = jax.tree.leaves(value) if name not in ("apply_fn", "loss", "mesh") else []
    if leaves and all(isinstance(leaf, jax.Array) for leaf in leaves):
      found[name] = value
  return found


def _update_with_auto_axes(make: Callable[..., Any], settings: dict[str, Any],
                           direct: Callable[..., Any], grads: Any, state: Any,
                           params: Any, batch: Any, variables: dict, rng: Any):
  """``direct(grads, state, params, batch, variables, rng)``, K-FAC's update,
  with any Explicit mesh axes made Auto.

  Under Explicit mesh axes every reshape, scan or contraction over the
  batch-sharded axis (in the model's own layers too) would need its output
  sharding named. K-FAC's pass runs with those axes made Auto instead, so XLA
  propagates shardings (and all-reduces the statistics) as under Auto axes;
  the updates and the state keep their shardings. There the transformation
  is rebuilt, ``make(**settings)``, with the settings given as arrays as
  arguments, so they are made Auto too (closed over, an array typed by
  Explicit axes could not meet the Auto ones); inside, no axis is Explicit
  and its update runs ``direct``.
  """
  mesh = _explicit_mesh((grads, state, params, batch, variables, rng))
  if mesh is None:
    return direct(grads, state, params, batch, variables, rng)
  explicit = tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                   if kind == jax.sharding.AxisType.Explicit)

  def update(grads, state, params, batch, variables, rng, arrays):
    return make(**{**settings, **arrays}).update(
        grads, state, params, batch=batch, variables=variables, rng=rng)
  out_sharding = jax.tree.map(lambda x: jax.typeof(x).sharding.spec, (grads, state))
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.sharding.auto_axes(update, axes=explicit, out_sharding=out_sharding)(
        grads, state, params, batch, variables, rng, _array_settings(settings))


def scale_by_kfac(
    apply_fn: Callable[..., Any],
    loss: losses.PredictiveLoss,
    *,
    example_batch: Any,
    inputs: Callable[[Any], Any] | None = None,
    outputs: Callable[[Any], Any] | None = None,
    damping: optax.ScalarOrSchedule = DEFAULT_DAMPING,
    ema_decay: float = 0.95,
    inverse_update_period: int = 5,
    stats_update_period: int = 1,
    estimation: str = "fisher",
    inverse: str = "auto",
    num_samples: int = 1,
    apply_kwargs: dict[str, Any] | None = None,
    layer_overrides: dict[str, str] | None = None,
    tied_embeddings: dict[str, str] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    max_factor_dim: int | str | None = "auto",
    curvature_batch_size: int | None = None,
    factor_rank: int | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Preconditions gradients with K-FAC's damped Kronecker-factored Fisher.

  Each captured layer gets its own block (`layers`; the README's "Layers"
  table): ``nn.Dense``, ``nn.DenseGeneral``, ``nn.Einsum``, ``nn.Conv``
  and ``nn.ConvTranspose`` (over im2col patches) a Kronecker block
  ``A ⊗ G``; ``nn.Embed`` (a tied ``attend`` use merged in) a Kronecker
  block with ``A`` diagonal; ``nn.LayerNorm``, ``nn.RMSNorm``,
  ``nn.GroupNorm``, ``nn.InstanceNorm`` and ``nn.BatchNorm`` an exact
  diagonal block for scale and bias; modules given to `register_layer` the
  block of their kind. Parameters of no such layer (and layers overridden with
  ``"diagonal"``) share the diagonal fallback ``∇ / (F + λ)``. For a
  Kronecker block, with ``V = [∇W; ∇b]``:

  .. math::
    A = \\mathbb{E}[\\bar a \\bar a^T],\\quad
    G = \\tfrac{1}{L}\\textstyle\\sum g g^T,\\quad
    U = (A + π\\sqrt{λ} I)^{-1} V (G + \\sqrt{λ}/π I)^{-1}

  with ``ā = [a, 1]`` (bias last), ``g`` the gradient of the summed
  per-term NLL with respect to the layer output, L the number of loss terms
  and ``π = sqrt((tr A / dim A) / (tr G / dim G))``. ``A`` and ``G`` are
  debiased EMAs of batch estimates (equal to the batch estimate after the
  first statistics update). Statistics are folded in when
  ``count % stats_update_period == 0``, then inverses are refreshed when
  ``count % inverse_update_period == 0``; both on the first update.

  The returned direction has no learning rate: chain it with momentum and
  ``-learning_rate`` (see `kfac`), or any optax transforms.

  Args:
    apply_fn: the flax apply function, e.g. ``model.apply``, or a Flax NNX
      model (an ``nnx.Module``; see `nnx_capture`): its graph and non-param
      state are read here, and the params tree is ``nnx.state(model,
      nnx.Param)``, with Variables or pure arrays at its leaves.
    loss: the model's predictive distribution, a `kfac_optax.losses` loss.
    example_batch: a batch (or tree of ``jax.ShapeDtypeStruct``) with the
      structure of a training batch; traced once in ``init`` to find layers.
    inputs: batch -> apply_fn's positional input (or tuple of them);
      default ``batch[0]`` for tuple/list batches. ``apply_fn`` is called as
      ``apply_fn({"params": params, **variables}, *inputs(batch),
      mutable=..., rngs=kfac_optax.model_rngs(key), **apply_kwargs)``
      (``"dropout"`` and ``"params"``, flax's fallback for every other
      random stream).
    outputs: apply_fn's return value -> the array the loss reads, for models
      that return a dict or a dataclass (e.g. ``lambda out: out["logits"]``,
      or ``lambda out: out.logits`` for a Hugging Face ``ModelOutput``);
      default: the return value itself, which must then be an array. Used
      wherever K-FAC runs the model (statistics, the quadratic model, exact
      products).
    damping: Tikhonov λ > 0 (``F + λI``), a float or a schedule of the
      count. A refresh whose λ is not positive and finite (a schedule that
      reaches 0, an injected value) keeps the previous inverses and is
      counted in the state's ``rejected_refreshes``.
    ema_decay: ρ of the debiased EMA of the statistics, in [0, 1).
    inverse_update_period: refresh damped inverses every this many updates
      (a positive int).
    stats_update_period: fold in statistics every this many updates (a
      positive int).
    estimation: how output gradients are drawn: ``"fisher"`` (targets
      sampled from the model, needs ``rng``), ``"empirical"`` (batch
      targets), ``"exact"`` (one backward pass per output dimension),
      ``"curvature_prop"`` (random-sign combinations of the exact ones,
      needs ``rng``).
    inverse: how the refresh inverts the damped factors: ``"eigh"``,
      ``"cholesky"`` (LAPACK, eigh for a factor where it fails; on CPU
      through SciPy's OpenBLAS), ``"newton_schulz"`` (matrix
      products only, started from the previous inverse, Cholesky where it
      stays inaccurate; `linalg.newton_schulz_inverse`), or ``"auto"``
      (default): ``"cholesky"`` on CPU, where it was measured fastest
      in a training step, ``"eigh"`` on other backends
      (`linalg.resolve_inverse`). See benchmarks/RESULTS.md, "The inverse
      refresh on a busy CPU".
    num_samples: draws per example for ``"fisher"`` and ``"curvature_prop"``,
      a positive int.
    apply_kwargs: constant keyword arguments for ``apply_fn`` (e.g.
      ``{"train": True}``).
    layer_overrides: ``{path pattern: choice}``, patterns in `fnmatch`
      syntax over module paths joined by "/" (e.g. ``"encoder/*"``); the
      first matching pattern wins. ``"skip"`` leaves the layer's gradients
      unpreconditioned; ``"diagonal"`` gives its params the diagonal block
      instead of their structured one. For dense and conv layers,
      ``"kron_in_diag"`` keeps the input factor diagonal (``diag(A) ⊗ G``),
      ``"kron_out_diag"`` the output factor (``A ⊗ diag(G)``),
      ``"kron_both_diag"`` both, and ``"kron"`` neither, whatever
      ``max_factor_dim`` says. For a dense layer applied at every step of an
      ``nn.RNN``/``nn.scan`` over time, ``"independent"`` (the default)
      counts the steps as rows, ``"series_option1"``/``"2"`` model them as
      a series (`blocks.SeriesBlock`, Martens, Ba & Johnson 2018).
    tied_embeddings: ``{call path: embedding path}`` for a layer call that
      computes logits with an ``nn.Embed``'s table transposed through a
      submodule's own ``.apply`` (Hugging Face's ``tie_word_embeddings``:
      ``self.lm_head.apply({"params": {"kernel": wte.T}}, h)`` is
      ``{"lm_head": "transformer/wte"}``): its statistics join the
      embedding's block as a tied ``attend`` use. Such a call has no params
      of its own; undeclared, it gets no block and ``init`` warns, naming it.
    mesh: devices to spread the inverse refresh over. Factor matrices of
      similar size are stacked (`linalg.invert_all`) and each stack is split
      over all mesh axes, so each of N devices inverts about 1/N of them,
      then the inverses are all-gathered. Default: the context mesh
      (``jax.set_mesh``) if any, else no distribution.
    max_factor_dim: a dense or conv layer's factor larger than this (input:
      ``in_dim + 1`` with a bias, conv ``kh·kw·c_in [+ 1]``; output:
      ``out_dim``) is kept diagonal (``diag(A) ⊗ G`` or ``A ⊗ diag(G)``, see
      `blocks.KroneckerBlock`): a positive Python int, None (no bound) or
      ``"auto"``: 4096, from timing one float32 eigh on 2 CPU cores (0.53 s
      at 2048, 3.6 s at 4096, 12 s at 6144, 28 s at 8192; cholesky 4 to 5
      times faster; `benchmarks/factor_inverse.py`), and no bound with
      ``factor_rank``. Embeddings keep their full output factor.
      ``layer_overrides`` choices ``"kron*"`` take precedence.
    curvature_batch_size: statistics from the first n examples of the batch
      (every leaf of the batch sliced on its leading axis; the capture's
      forward and sampled backward pass run on them only): a positive
      Python int at most the batch size, or None (the whole batch). The
      gradient is the caller's, from the whole batch. Martens & Grosse
      (2015) estimate the statistics on a subset of the mini-batch; the
      step costs less, the factors are noisier (the EMA averages over
      steps). See benchmarks/RESULTS.md, "Statistics from a sub-batch".
    factor_rank: a positive Python int k, or None (every inverse exact). A
      full factor M of more than k rows is inverted at rank k: with μ its
      top k eigenvalues (eigenvectors U) and ρ the mean of the others,
      ``(M + δI)⁻¹ ≈ U diag(1/(μ+δ) - 1/(ρ+δ)) Uᵀ + I/(ρ+δ)``
      (`kfac_optax.low_rank`; the eigenpairs by subspace iteration from the
      previous refresh's). Preconditioning a d-row factor then costs
      O(d·k) per column instead of O(d²), the refresh O(d²·k) instead of
      O(d³): for wide layers (image inputs, conv patches) whose factors'
      spectra decay fast. `Curvature.multiply` stays exact. See
      benchmarks/RESULTS.md, "Low-rank factor inverses".

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes
    ``(grads, state, params, *, batch, rng=None, variables=None)``. ``variables``
    holds other collections the model needs (e.g. ``{"batch_stats": ...}``);
    they are mutable in K-FAC's pass and its changes to them are discarded.
    ``rng`` also seeds the ``"dropout"`` stream of K-FAC's pass (without
    it, the statistics' masks come from the step count); it must be
    one key (``jax.random.key`` or a raw ``jax.random.PRNGKey``), and
    ``grads`` must have the params' tree and shapes (else a ``TypeError``
    or ``ValueError`` naming the argument); updates come back in the
    structure of ``grads`` (``nnx.Variable`` leaves where it has them).
    For an NNX model, ``variables`` is any part of its other state, e.g.
    ``nnx.state(model, nnx.BatchStat)``.
    Updates are computed in float32 (float64 for float64 params) and
    returned in the gradients' dtype; one that would not fit it is scaled
    down (see `Curvature.precondition_and_count`) and counted in the state's
    ``rescaled_updates``.

  Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp, kfac_optax
    >>> model = nn.Dense(3)
    >>> batch = (jnp.ones((8, 4)), jnp.zeros((8,), jnp.int32))
    >>> params = model.init(jax.random.key(0), batch[0])["params"]
    >>> tx = kfac_optax.scale_by_kfac(
    ...     model.apply, kfac_optax.losses.softmax_cross_entropy(),
    ...     example_batch=batch, estimation="empirical")
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params, batch=batch)

  Raises:
    ValueError: for a setting outside its range (a schedule: at count 0).

  References:
    Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored
    Approximate Curvature", ICML 2015.
  """
  settings = dict(locals())
  checks.positive("damping", damping)
  curvature = _curvature_of(settings)

  def update_fn(updates, state, params=None, *, batch=None, rng=None,
                variables=None, **extra_args):
    del extra_args  # optax.chain forwards every member's keywords
    grads, params = nnx_capture.pure(updates), nnx_capture.pure(params)
    _check_update_args(curvature, grads, batch, params, rng, "scale_by_kfac")
    direction, state = _update_with_auto_axes(
        scale_by_kfac, settings, precondition, grads, state, params, batch,
        dict(variables or {}), rng)
    return nnx_capture.like(updates, direction), state

  def precondition(grads, state, params, batch, variables, rng):
    state = curvature.update(state, params, batch=batch, rng=rng,
                             variables=variables,
                             damping=_value_at(damping, state.count))
    return curvature.precondition_and_count(state, grads)

  return optax.GradientTransformationExtraArgs(curvature.init, update_fn)


class KFACState(NamedTuple):
  """State of `kfac`.

  Attributes:
    curvature: the `ScaleByKFACState` of its preconditioner.
    previous_update: the last update δ (params-shaped; zero at first).
    count: updates so far.
    damping: λ, adapted in place with ``adaptive_damping``.
    learning_rate, momentum: the last step's ``-α`` and ``μ`` in
      ``δ = α v + μ δ_prev`` (v the preconditioned gradient).
    rho: the last measured reduction ratio (nan before the first).
    qmodel_change: the damped quadratic model's predicted change of the
      loss for the last step where it was computed (nan before); ``rho``
      divides the measured change by the undamped model's.
    fisher_norm: the last step's approximate squared Fisher norm of its
      gradient part, ``α² vᵀ F̂ v = α² vᵀ g``.
  """
  curvature: ScaleByKFACState
  previous_update: Any
  count: jax.Array
  damping: jax.Array
  learning_rate: jax.Array
  momentum: jax.Array
  rho: jax.Array
  qmodel_change: jax.Array
  fisher_norm: jax.Array


def _check_kfac_settings(arguments: dict[str, Any]) -> None:
  """`kfac`'s own numeric settings (`Curvature` checks the shared ones)."""
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


def kfac(
    apply_fn: Callable[..., Any],
    loss: losses.PredictiveLoss,
    *,
    example_batch: Any,
    learning_rate: optax.ScalarOrSchedule | None = None,
    momentum: optax.ScalarOrSchedule | str | None = "auto",
    inputs: Callable[[Any], Any] | None = None,
    outputs: Callable[[Any], Any] | None = None,
    damping: optax.ScalarOrSchedule = DEFAULT_DAMPING,
    ema_decay: float = 0.95,
    inverse_update_period: int = 5,
    stats_update_period: int = 1,
    estimation: str = "fisher",
    inverse: str = "auto",
    num_samples: int = 1,
    apply_kwargs: dict[str, Any] | None = None,
    layer_overrides: dict[str, str] | None = None,
    tied_embeddings: dict[str, str] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    max_factor_dim: int | str | None = "auto",
    curvature_batch_size: int | None = None,
    factor_rank: int | None = None,
    norm_constraint: float | str | None = "auto",
    adaptive_damping: bool | None = None,
    damping_adaptation_interval: int = 5,
    damping_adaptation_decay: float = 0.95,
    min_damping: float = 1e-8,
    max_damping: float = math.inf,
    l2_reg: float = 0.0,
    num_burnin_steps: int = 0,
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
    loss is not taken.
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
  taken (zero update, momentum restarted).

  The first ``num_burnin_steps`` updates only gather statistics and return
  zero updates.

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
    inputs, outputs, damping, ema_decay, inverse_update_period,
    stats_update_period, estimation, inverse, num_samples, apply_kwargs,
    layer_overrides, tied_embeddings, mesh, max_factor_dim,
    curvature_batch_size, factor_rank:
      see `scale_by_kfac`. With ``adaptive_damping``, ``damping`` is the
      initial λ. ``curvature_batch_size`` applies to the factors only: the
      quadratic model's exact Fisher products, and the losses that
      adaptive damping compares, use the whole batch like the gradient
      (they size the step, so they see the data the step is taken on).
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

  Settings are checked where given: ``learning_rate`` > 0 when given,
  ``norm_constraint`` > 0, ``damping`` > 0, ``0 < min_damping ≤
  max_damping``, ``damping_adaptation_interval`` a positive int,
  ``damping_adaptation_decay`` in (0, 1], and those of `scale_by_kfac`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs
    ``batch=`` (and ``rng=`` for random estimation modes). Arguments are
    spelled out so that ``optax.inject_hyperparams(kfac, static_args=
    ("apply_fn", "num_samples"))`` can inject the numeric ones (list
    ``curvature_batch_size`` and ``factor_rank`` there too when given).

  Raises:
    ValueError: for a setting outside its range (a schedule: at count 0).

  References:
    Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored
    Approximate Curvature", ICML 2015; Ba, Grosse & Martens, "Distributed
    Second-Order Optimization using Kronecker-Factored Approximations",
    ICLR 2017.
  """
  settings = dict(locals())
  for name, value in (("momentum", momentum), ("norm_constraint", norm_constraint)):
    if isinstance(value, str) and value != "auto":
      raise ValueError(f'{name} must be a number, None or "auto", got {value!r}')
  fixed = learning_rate is not None
  if momentum == "auto":
    momentum = FIXED_MOMENTUM if fixed else None
  if norm_constraint == "auto":
    norm_constraint = FIXED_NORM_CONSTRAINT if fixed else None
  if adaptive_damping is None:
    adaptive_damping = learning_rate is None
  _check_kfac_settings(locals())
  curvature = _curvature_of(locals())
  if norm_constraint is not None and learning_rate is None:
    raise ValueError("norm_constraint bounds the step of a given learning "
                     "rate; with learning_rate=None the quadratic model "
                     "already chooses the step size")
  if adaptive_damping and callable(damping):
    raise ValueError("adaptive_damping adapts λ itself: give damping as the "
                     "initial value, not a schedule")
  solve = learning_rate is None or momentum is None

  def init_fn(params):
    # Distinct buffers: a state passed with donate_argnums must not alias.
    nans = [jnp.full([], _NAN, jnp.float32) for _ in range(5)]
    return KFACState(
        curvature.init(params),
        jax.tree.map(jnp.zeros_like, nnx_capture.pure(params)),
        jnp.zeros([], jnp.int32),
        jnp.asarray(_value_at(damping, 0), jnp.float32) + 0.0, *nans)

  def update_fn(grads, state, params=None, *, batch=None, rng=None,
                variables=None, **extra_args):
    del extra_args
    given, grads, params = grads, nnx_capture.pure(grads), nnx_capture.pure(params)
    _check_update_args(curvature, grads, batch, params, rng, "kfac")
    delta, state = _update_with_auto_axes(kfac, settings, step, grads, state, params,
                                          batch, dict(variables or {}), rng)
    return nnx_capture.like(given, delta), state

  def step(grads, state, params, batch, variables, rng):
    count = state.count
    damping_now = (state.damping if adaptive_damping
                   else jnp.asarray(_value_at(damping, count), jnp.float32))
    curvature_state = curvature.update(
        state.curvature, params, batch=batch, rng=rng, variables=variables,
        damping=damping_now + l2_reg)
    v, curvature_state = curvature.precondition_and_count(curvature_state, grads)
    previous = state.previous_update
    vg = adaptive.tree_dot(v, grads)
    lr = None if learning_rate is None else _value_at(learning_rate, count)
    mu = None if momentum is None else _value_at(momentum, count)
    qmodel_change = state.qmodel_change
    if solve:
      directions = (v, previous)
      outputs, tangents = curvature.output_tangents(
          params, batch, jax.tree.map(lambda a, b: jnp.stack([a, b.astype(a.dtype)]),
                                      *directions), variables, rng)
      fisher = curvature.output_fisher(outputs, batch, tangents)
      flat = lambda x: x.reshape(2, -1).astype(jnp.float32)
      gram = jnp.array([[adaptive.tree_dot(a, b) for b in directions]
                        for a in directions])
      # Without λ: the model whose change ρ compares with the loss's.
      undamped = flat(tangents) @ flat(fisher).T + l2_reg * gram
      linear = jnp.stack([vg, adaptive.tree_dot(grads, previous)])
      alpha, mu_now, qmodel_change = adaptive.quadratic_coefficients(
          undamped + damping_now * gram, linear, lr, mu, gram[1, 1] > 0)
    else:
      alpha = -jnp.asarray(lr, jnp.float32)
      if norm_constraint is not None:
        alpha = alpha * adaptive.norm_constraint_scale(vg, lr, norm_constraint)
      mu_now = jnp.asarray(mu, jnp.float32)
    moving = count >= num_burnin_steps
    delta = jax.tree.map(
        lambda a, p: jnp.where(moving, alpha * a + mu_now * p, 0).astype(a.dtype),
        v, previous)

    rho, new_damping = state.rho, damping_now
    if adaptive_damping:
      def undamped_change():
        """``q₀(δ)`` (the model without λ) and the outputs at ``params``."""
        if solve:  # the model along v and p is already known
          c = jnp.stack([alpha, mu_now])
          return linear @ c + 0.5 * c @ undamped @ c, outputs
        model_outputs, tangent = jax.jvp(
            lambda p: curvature.forward(p, batch, variables, rng), (params,), (delta,))
        fisher_tangent = curvature.output_fisher(model_outputs, batch, tangent)
        return (adaptive.tree_dot(grads, delta)
                + 0.5 * (jnp.vdot(tangent.astype(jnp.float32), fisher_tangent)
                         + l2_reg * adaptive.tree_dot(delta, delta))), model_outputs

      def measure(_):
        change, model_outputs = undamped_change()
        moved = curvature.loss_value(optax.apply_updates(params, delta), batch,
                                     variables, rng)
        # The user's loss holds the L2 term the model's l2_reg stands for:
        # η/2 (‖θ+δ‖² - ‖θ‖²) of the change is its.
        actual = (moved - loss.value(model_outputs, batch) + l2_reg * (
            adaptive.tree_dot(params, delta) + 0.5 * adaptive.tree_dot(delta, delta)))
        # ρ compares an actual decrease with a predicted one: a step the model
        # does not predict to decrease the loss (a fixed learning rate that
        # overshoots) is a failed step, ρ = nan, whatever the loss did.
        return jnp.where(change < 0, actual / jnp.where(change < 0, change, 1.0),
                         _NAN).astype(state.rho.dtype)  # float64 targets, x64
      # Measured every interval, and every step after a poor step (ρ < ¼ or
      # non-finite) until a good one, so λ reacts within a few steps.
      due = moving & (((count - num_burnin_steps) % damping_adaptation_interval == 0)
                      | ~(state.rho >= 0.25))
      rho = jax.lax.cond(due, measure, lambda _: state.rho, None)
      new_damping = jnp.where(due, adaptive.levenberg_marquardt(
          damping_now, rho, damping_adaptation_decay, damping_adaptation_interval,
          min_damping, max_damping), damping_now)
      # A measured step that raised the loss, made it non-finite or was not
      # predicted to lower it is not taken; the momentum restarts from zero.
      rejected = due & ~(rho >= 0.0)
      delta = jax.tree.map(lambda d: jnp.where(rejected, jnp.zeros_like(d), d), delta)

    new_state = KFACState(
        curvature_state, delta, optax.safe_increment(count), new_damping,
        -alpha, mu_now, rho, jnp.asarray(qmodel_change, jnp.float32),
        jnp.square(alpha) * vg)
    return delta, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def stats(opt_state: Any) -> dict[str, jax.Array]:
  """Scalars to log from a state holding `kfac`'s or `scale_by_kfac`'s state.

  Returns, from the first `KFACState` found in ``opt_state`` (any optax
  wrapper or TrainState around it), else the first `ScaleByKFACState`:

  - ``damping``: the damping of the inverses in use, from the last accepted
    refresh (``λ + l2_reg`` for `kfac`; nan before the first refresh);
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
