"""The options that `Curvature`, `scale_by_kfac` and `kfac` share.

They are defined once, here: name, default, check and doc. `Curvature`
inherits `CurvatureOptions`; the two transformations spell them out as
keyword arguments (``optax.inject_hyperparams`` reads a factory's signature),
take their defaults from `DEFAULTS`, hand them on with `of`, and get their
docs from `document`. tests/optimizer/test_options.py checks that every
signature lists all of them, in this order, with these defaults.
"""

import dataclasses
import fnmatch
from typing import Any, Callable, Mapping

import jax

from kfac_optax._src import blocks
from kfac_optax._src import checks
from kfac_optax._src import linalg
from kfac_optax._src import losses
from kfac_optax._src import tree_paths
from kfac_optax._src.curvature import replicas
from kfac_optax._src.models import nnx_capture

# Factors above this size are kept diagonal by default (max_factor_dim="auto").
# Timed with benchmarks/factor_inverse.py (results/factor_inverse.json): on
# 2 CPU cores one float32 eigh takes 0.53 s at 2048, 3.6 s at 4096, 12 s at
# 6144 and 28 s at 8192 (cholesky 4 to 5 times faster). 4096 keeps a refresh of
# the largest factors of common models (GPT-2 small's 3073) within seconds;
# VGG16's 25089-wide fully connected input becomes diagonal.
DEFAULT_MAX_FACTOR_DIM = 4096

# The choices of layer_overrides.
OVERRIDES = ("skip", "diagonal", *blocks.KRONECKER_STRUCTURES, "independent",
             *blocks.SERIES_OPTIONS)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class CurvatureOptions:
  """How K-FAC runs the model, estimates the curvature and inverts it.

  Every option is checked where it is given (a `ValueError` or `TypeError`
  naming it, its value and the valid range).

  Attributes:
    inputs: batch -> apply_fn's positional input (or a plain tuple of
      them; a NamedTuple such as jraph's ``GraphsTuple`` is one input);
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
    ema_decay: ρ of the debiased EMA of the statistics, in [0, 1).
    inverse_update_period: refresh damped inverses every this many updates
      (a positive int).
    stats_update_period: fold in statistics every this many updates (a
      positive int).
    curvature_warmup: the first this many updates fold in statistics and
      refresh inverses on every update, whatever the two periods say (an
      int >= 0; default 0). Early in training the curvature changes fastest
      and an inverse from the first batch alone steers every step up to the
      next refresh. On the transformer LM of examples/, 10 warm-up
      updates with inverses every 10 (against neither, inverses every 50)
      cut the steps to the peers' losses of steps 100-400 by 17-20%, and
      with damping 1e-4 by 29-34%; on the deep autoencoder they did not
      pay (benchmarks/RESULTS.md, "Curvature warm-up").
    estimation: how output gradients are drawn: ``"fisher"`` (targets
      sampled from the model, needs ``rng``), ``"empirical"`` (batch
      targets), ``"exact"`` (one backward pass per output dimension),
      ``"curvature_prop"`` (random-sign combinations of the exact ones,
      needs ``rng``).
    inverse: how the refresh inverts the damped factors: ``"eigh"``,
      ``"cholesky"`` (LAPACK, eigh for a factor where it fails; on CPU
      through SciPy's OpenBLAS), ``"newton_schulz"`` (matrix products only,
      started from the previous inverse, Cholesky where it stays
      inaccurate; `linalg.newton_schulz.newton_schulz_inverse`), or
      ``"auto"`` (default): ``"cholesky"``, measured fastest in a training
      step on CPU and 30× faster than eigh in a refresh on a GPU
      (`linalg.damped.resolve_inverse`; benchmarks/RESULTS.md, "The inverse
      refresh on a busy CPU" and "GPU (H200): summary").
    num_samples: draws per example for ``"fisher"`` and ``"curvature_prop"``,
      a positive int.
    apply_kwargs: constant keyword arguments for ``apply_fn`` (e.g.
      ``{"train": True}``).
    layer_overrides: ``{path pattern: choice}``, patterns in `fnmatch`
      syntax over module paths joined by "/" (e.g. ``"encoder/*"``); the
      first matching pattern wins. ``"skip"`` leaves the gradients of every
      param of the module unpreconditioned (captured layer or not: a
      head the loss does not read, which ``init`` refuses otherwise); ``"diagonal"`` gives its params the diagonal block
      instead of their structured one. For dense and conv layers,
      ``"kron_in_diag"`` keeps the input factor diagonal (``diag(A) ⊗ G``),
      ``"kron_out_diag"`` the output factor (``A ⊗ diag(G)``),
      ``"kron_both_diag"`` both, and ``"kron"`` neither, whatever
      ``max_factor_dim`` says. For a dense layer applied at every step of an
      ``nn.RNN``/``nn.scan`` over time, ``"independent"`` (the default)
      counts the steps as rows, ``"series_option1"``/``"2"`` model them as
      a series (`blocks.series.SeriesBlock`, Martens, Ba & Johnson 2018).
    tied_embeddings: ``{call path: embedding path}`` for a layer call that
      computes logits with an ``nn.Embed``'s table transposed through a
      submodule's own ``.apply`` (Hugging Face's ``tie_word_embeddings``:
      ``self.lm_head.apply({"params": {"kernel": wte.T}}, h)`` is
      ``{"lm_head": "transformer/wte"}``): its statistics join the
      embedding's block as a tied ``attend`` use. Such a call has no params
      of its own; undeclared, it gets no block and ``init`` warns, naming it.
    mesh: devices to spread K-FAC's factors over. ``init`` stacks the
      Kronecker blocks' factors of one shape and splits the stacks over all
      mesh axes, so each of N devices keeps, inverts and applies about 1/N
      of them (`curvature.block_stacks`); the other blocks' refresh is
      stacked by similar size (`linalg.stacked_inverses.invert_all`), split
      the same way and all-gathered. Default: the context mesh
      (``jax.set_mesh``) if any, else no distribution.
    axis_name: for a step written per device (``jax.pmap``, or
      ``jax.shard_map`` over a batch axis): the axis name, or tuple of
      names, that splits the batch, the one the step averages its gradients
      over with ``lax.pmean``. K-FAC averages what it measures on its share
      of the batch over the same axes (the factors' statistics; the
      automatic mode's quadratic model and loss changes), so that every
      replica keeps one state and takes the step of one device on the whole
      batch (equal shares; `curvature.replicas`). None (default): no such
      axes; inside ``pmap``/``shard_map`` ``update`` then raises a
      `ValueError`, as the devices could be replicas or independent models;
      ``()`` for independent models, one per device. Not needed under
      ``jax.jit`` with shardings (``mesh``), where the program sees the
      whole batch.
    max_factor_dim: a dense or conv layer's factor larger than this (input:
      ``in_dim``, conv ``kh·kw·c_in``, a bias's extra row not counted;
      output: ``out_dim``) is kept diagonal (``diag(A) ⊗ G`` or ``A ⊗ diag(G)``, see
      `blocks.kronecker.KroneckerBlock`): a positive Python int, None (no bound) or
      ``"auto"``: 4096, from timing one float32 eigh on 2 CPU cores (0.53 s
      at 2048, 3.6 s at 4096, 12 s at 6144, 28 s at 8192; cholesky 4 to 5
      times faster; `benchmarks/factor_inverse.py`), and no bound with
      ``factor_rank`` or ``factor_block_size``. Embeddings keep their full output factor.
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
      (`linalg.low_rank`; the eigenpairs by subspace iteration from the
      previous refresh's). Preconditioning a d-row factor then costs
      O(d·k) per column instead of O(d²), the refresh O(d²·k) instead of
      O(d³): for wide layers (image inputs, conv patches) whose factors'
      spectra decay fast. `Curvature.multiply` stays exact. See
      benchmarks/RESULTS.md, "Low-rank factor inverses".
    factor_block_size: a positive Python int t, or None (whole factors). A
      dense, einsum or conv layer's full factor of more than t rows keeps
      only its diagonal tiles of t × t, the last padded
      (`blocks.tiled.TiledKroneckerBlock`): the block becomes
      ``⊕_ij A_ii ⊗ G_jj``, each tile of the gradient matrix preconditioned
      on its own (``O(d·t)`` per column, a refresh of ``O(d·t²)``). For
      sharded jobs: with t dividing the rows and columns each device holds
      of a kernel (FSDP, tensor parallelism), each device keeps the tiles
      of its own shard and preconditions it in place, moving nothing
      (docs/scaling.md, "Tiled factors"). ``max_factor_dim="auto"`` then
      sets no bound. Not with ``factor_rank``.
  """

  inputs: Callable[[Any], Any] | None = None
  outputs: Callable[[Any], Any] | None = None
  ema_decay: float = 0.95
  inverse_update_period: int = 5
  stats_update_period: int = 1
  curvature_warmup: int = 0
  estimation: str = "fisher"
  inverse: str = "auto"
  num_samples: int = 1
  apply_kwargs: dict[str, Any] | None = None
  layer_overrides: dict[str, str] | None = None
  tied_embeddings: dict[str, str] | None = None
  mesh: jax.sharding.Mesh | None = None
  axis_name: str | tuple[str, ...] | None = None
  max_factor_dim: int | str | None = "auto"
  curvature_batch_size: int | None = None
  factor_rank: int | None = None
  factor_block_size: int | None = None

  def __post_init__(self):
    if self.estimation not in losses.ESTIMATIONS:
      raise ValueError(f"estimation must be one of {losses.ESTIMATIONS}, "
                       f"got {self.estimation!r}")
    if self.inverse not in linalg.INVERSE_METHODS:
      raise ValueError(f"inverse must be one of {linalg.INVERSE_METHODS}, "
                       f"got {self.inverse!r}")
    checks.in_range("ema_decay", self.ema_decay, 0.0, 1.0, high_open=True)
    checks.count("inverse_update_period", self.inverse_update_period, 1)
    checks.count("stats_update_period", self.stats_update_period, 1)
    checks.count("curvature_warmup", self.curvature_warmup, 0)
    checks.static_size("num_samples", self.num_samples, none_allowed=False)
    for name in ("curvature_batch_size", "factor_rank", "factor_block_size"):
      checks.static_size(name, getattr(self, name), none_allowed=True)
    if self.factor_rank is not None and self.factor_block_size is not None:
      raise ValueError(
          f"factor_rank={self.factor_rank} and factor_block_size="
          f"{self.factor_block_size} are two ways to make large factors cheap, "
          "and K-FAC applies one at a time. Fix: give one of them (None for "
          "the other): factor_block_size for sharded params, factor_rank for "
          "wide layers whose factors' spectra decay fast.")
    bound = self.max_factor_dim
    if not (bound is None or (isinstance(bound, str) and bound == "auto")
            or checks.is_positive_int(bound)):
      raise ValueError(
          "max_factor_dim must be a positive Python int, None (no bound) or "
          f"\"auto\" ({DEFAULT_MAX_FACTOR_DIM}), got {self.max_factor_dim!r}; with "
          "optax.inject_hyperparams, list it in static_args")
    replicas.check_axis_name(self.axis_name)
    for pattern, choice in (self.layer_overrides or {}).items():
      if choice not in OVERRIDES:
        raise ValueError(f"layer_overrides[{pattern!r}] must be one of "
                         f"{OVERRIDES}, got {choice!r}")
    if "rngs" in (self.apply_kwargs or {}):
      raise ValueError(
          "apply_kwargs must not hold 'rngs': K-FAC's pass draws its own "
          "randomness from update's rng= (it seeds 'dropout' and, through "
          "flax's fallback to 'params', every other stream), as the user's "
          f"step draws its own. {nnx_capture.CALL_RNGS_FIX}")
    for source, target in (self.tied_embeddings or {}).items():
      if not (isinstance(source, str) and isinstance(target, str)):
        raise TypeError(
            "tied_embeddings must map a call's module path to an nn.Embed's "
            f"path, both strings joined by '/', got {source!r}: {target!r}")

  def override_for(self, path: tree_paths.Path) -> str | None:
    """The ``layer_overrides`` choice of the module at ``path``: the first
    pattern that matches it, else None."""
    name = tree_paths.key(path)
    return next((choice for pattern, choice in (self.layer_overrides or {}).items()
                 if fnmatch.fnmatchcase(name, pattern)), None)

  def factor_dim_bound(self) -> int | None:
    """The bound ``max_factor_dim`` sets; ``"auto"`` stands for the
    inverse's O(d³) cost, which ``factor_rank`` and ``factor_block_size``
    avoid."""
    if self.max_factor_dim != "auto":
      return self.max_factor_dim
    cheap = self.factor_rank is not None or self.factor_block_size is not None
    return None if cheap else DEFAULT_MAX_FACTOR_DIM


DEFAULTS = CurvatureOptions()
NAMES = tuple(field.name for field in dataclasses.fields(CurvatureOptions))


def of(arguments: Mapping[str, Any]) -> dict[str, Any]:
  """The options among a transformation's ``arguments`` (its ``locals()``)."""
  return {name: arguments[name] for name in NAMES}


def document(function: Callable[..., Any]) -> Callable[..., Any]:
  """Puts the options' docs into ``function``'s docstring, at the line that
  reads ``{curvature_options}`` in its Args section."""
  attributes = CurvatureOptions.__doc__.split("  Attributes:\n", 1)[1].rstrip()
  function.__doc__ = function.__doc__.replace("    {curvature_options}", attributes)
  return function
