"""`scale_by_kfac`: gradients to K-FAC's preconditioned direction.

The optax transformation of the preconditioner alone, with no learning rate:
chain it with momentum and ``-learning_rate`` (`kfac` is that chain, and
more), or any optax transforms. The curvature work is `Curvature`'s.
"""

from typing import Any, Callable

import jax
import optax

from kfac_optax._src import checks
from kfac_optax._src import losses
from kfac_optax._src import param_boxes
from kfac_optax._src.curvature import explicit_axes
from kfac_optax._src.curvature import options
from kfac_optax._src.curvature.curvature import Curvature
from kfac_optax._src.curvature.state import ScaleByKFACState
from kfac_optax._src.optimizer import update_args

DEFAULT_DAMPING = 1e-2
_OPTIONS = options.DEFAULTS


@options.document
def scale_by_kfac(
    apply_fn: Callable[..., Any],
    loss: losses.PredictiveLoss,
    *,
    example_batch: Any,
    damping: optax.ScalarOrSchedule = DEFAULT_DAMPING,
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
) -> optax.GradientTransformationExtraArgs:
  """Preconditions gradients with K-FAC's damped Kronecker-factored Fisher.

  Each captured layer gets its own block (docs/models.md, "The layers
  K-FAC knows"): ``nn.Dense``, ``nn.DenseGeneral``, ``nn.Einsum``,
  ``nn.Conv`` and ``nn.ConvTranspose`` (over im2col patches) a Kronecker block
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
  ``count % inverse_update_period == 0``; both on the first update and on
  every update while ``count < curvature_warmup``.

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
    damping: Tikhonov λ > 0 (``F + λI``), a float or a schedule of the
      count. A refresh whose λ is not positive and finite (a schedule that
      reaches 0, an injected value) keeps the previous inverses and is
      counted in the state's ``rejected_refreshes``.
    {curvature_options}

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
  curvature = Curvature(apply_fn, loss, example_batch, **options.of(settings))

  def update_fn(updates, state, params=None, *, batch=None, rng=None,
                variables=None, **extra_args):
    del extra_args  # optax.chain forwards every member's keywords
    boxed_params = params
    grads, params = param_boxes.values(updates), param_boxes.values(params)
    update_args.check(curvature.estimation, grads, batch, params, rng,
                      "scale_by_kfac")
    update_args.check_state(state, ScaleByKFACState, "scale_by_kfac")
    direction, state = explicit_axes.update_with_auto_axes(
        scale_by_kfac, settings, precondition, grads, state, params, batch,
        dict(variables or {}), rng, curvature.declared_specs(boxed_params))
    return param_boxes.like(updates, direction), state

  def precondition(grads, state, params, batch, variables, rng):
    state = curvature.update(state, params, batch=batch, rng=rng,
                             variables=variables,
                             damping=update_args.value_at(damping, state.count))
    return curvature.precondition_and_count(state, grads)

  return optax.GradientTransformationExtraArgs(curvature.init, update_fn)
