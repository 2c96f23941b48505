"""Every layer kind against an explicit float64 Kronecker-factored reference.

The reference never uses kfac_optax's layouts. A captured layer is linear in
its kernel, so the rows ``ā`` of its Kronecker block are read off the Jacobian
of the layer output with respect to the kernel (for a convolution: the im2col
patch of every output location, padding, strides and dilations included,
without lax.conv_general_dilated_patches). Output gradients come from autodiff
of the summed NLL with respect to a zero perturbation added to each layer
output in an explicitly written forward pass. Factors are formed from those
row matrices in numpy and the damped solve uses np.kron (tests/brute_force.py).

To keep compile time down, the layers of one family (all convolutions; all
DenseGeneral configurations) are parallel branches of one model, so one
jitted K-FAC update serves every test case of the family. The Conv,
DenseGeneral, Embed and attention tests also run K-FAC on the Flax NNX twin
of their model (`tests/nnx_twins.py`) against the same reference.
"""

import dataclasses
import functools
import itertools
from typing import Any, NamedTuple

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_optax
from kfac_optax._src.models import registry
from tests import brute_force as bf
from tests.nnx_twins import APIS, model_for

LOSS = kfac_optax.losses.softmax_cross_entropy()
DAMPING = 1e-2
CLASSES = 3
BATCH = 3
DIAGONAL = "<diagonal>"


# --------------------------------------------------------------------------
# Shared helpers.


def summed_nll(logits, labels):
  """Σ_n -log softmax(f_n)[y_n], written out."""
  log_p = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  return -jnp.sum(jnp.take_along_axis(log_p, labels[:, None], axis=-1))


def f64(x):
  return np.asarray(x, np.float64)


def random_tree(shapes, seed, scale=1.0):
  """Normal float32 leaves with the shapes of ``shapes`` (numpy, no compile)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda s: jnp.asarray(scale * rng.normal(size=s.shape), jnp.float32), shapes)


def random_params(model, example_input, seed):
  shapes = jax.eval_shape(model.init, jax.random.key(0), example_input)["params"]
  return random_tree(shapes, seed, scale=0.5)


def labels(seed, n=BATCH):
  return jnp.asarray(np.random.default_rng(seed).integers(0, CLASSES, n), jnp.int32)


def kfac_step(model, params, batch, grads, variables=None):
  """One jitted empirical K-FAC update from a fresh state: (updates, state).

  ``model`` as `scale_by_kfac` takes it: a linen apply function or an NNX
  module; ``variables``: the model's other collections.
  """
  tx = kfac_optax.scale_by_kfac(
      model, LOSS, example_batch=batch, estimation="empirical",
      inverse_update_period=1, damping=DAMPING)
  step = jax.jit(lambda g, p, b, v: tx.update(g, tx.init(p), p, batch=b, variables=v))
  return step(grads, params, batch, variables)


def kronecker_reference(rows, out_grads, num_terms, kernel_grads, bias_grads):
  """Per stack slice s: A_s, G_s and the damped Kronecker solve of [∇W_s; ∇b_s].

  Args:
    rows: (S, R, d) layer input rows, without the homogeneous coordinate.
    out_grads: (S, R, o) output-gradient rows of the summed NLL.
    num_terms: L.
    kernel_grads: (S, d, o).
    bias_grads: (S, o), or None for a layer without bias.

  Returns:
    (A (S, d[+1], d[+1]), G (S, o, o), U_kernel (S, d, o), U_bias or None).
  """
  rows, out_grads = f64(rows), f64(out_grads)
  if bias_grads is not None:
    rows = np.concatenate([rows, np.ones((*rows.shape[:2], 1))], axis=2)
  a = np.einsum("sri,srj->sij", rows, rows) / rows.shape[1]
  g = np.einsum("sri,srj->sij", out_grads, out_grads) / num_terms
  solved = [bf.kronecker_precondition(
      a[s], g[s], kernel_grads[s], None if bias_grads is None else bias_grads[s],
      DAMPING) for s in range(len(a))]
  u_kernel = np.stack([u["kernel"] for u in solved])
  u_bias = None if bias_grads is None else np.stack([u["bias"] for u in solved])
  return a, g, u_kernel, u_bias


def dense_reference(inputs, out_grads, num_terms, grads):
  """A plain ``s = a W (+ b)`` over the last axis (one stack slice)."""
  d, o = grads["kernel"].shape
  a, g, u_kernel, u_bias = kronecker_reference(
      f64(inputs).reshape(1, -1, d), f64(out_grads).reshape(1, -1, o), num_terms,
      f64(grads["kernel"])[None],
      f64(grads["bias"])[None] if "bias" in grads else None)
  update = {"kernel": u_kernel[0]}
  if u_bias is not None:
    update["bias"] = u_bias[0]
  return (a, g), update


def assert_block(state_factors, update, expected_factors, expected_update):
  """Factors to 1e-4 and the preconditioned leaves to 1e-3 (relative)."""
  assert set(update) == set(expected_update)
  for name, value in expected_update.items():
    assert update[name].shape == value.shape, name
  assert state_factors.a.shape == expected_factors[0].shape
  assert state_factors.g.shape == expected_factors[1].shape
  assert bf.relative_error(state_factors.a, expected_factors[0]) < 1e-4
  assert bf.relative_error(state_factors.g, expected_factors[1]) < 1e-4
  assert bf.relative_error(update, expected_update) < 1e-3


# --------------------------------------------------------------------------
# Branch models: each branch x_i -> layer_i -> tanh -> flatten; the branches
# are concatenated into one Dense(classes) head.

LAYER_TYPES = {"conv": nn.Conv, "conv_transpose": nn.ConvTranspose,
               "dense_general": nn.DenseGeneral, "einsum": nn.Einsum}
NNX_CONV_TYPES = {"conv": nnx.Conv, "conv_transpose": nnx.ConvTranspose}


@dataclasses.dataclass(frozen=True)
class Branch:
  """One layer under test.

  Attributes:
    name: module name (and state key) of the layer.
    kind: key of LAYER_TYPES.
    x_shape: shape of the branch input, example axis first.
    kwargs: the layer's keyword arguments, as sorted items (hashable).
    lead: the example axis is moved behind this many leading axes before the
      layer (and back after it), so that a DenseGeneral's ``batch_dims``
      (leading axes in flax) slice along axes other than the example axis.
    call: keyword arguments of the layer's call, as sorted items.
  """
  name: str
  kind: str
  x_shape: tuple
  kwargs: tuple
  lead: int = 0
  call: tuple = ()

  def layer(self, **overrides) -> nn.Module:
    return LAYER_TYPES[self.kind](**{**dict(self.kwargs), **overrides})

  def apply(self, params, x, **overrides):
    """The layer on ``x`` as the model calls it (``overrides``: of its
    constructor's arguments)."""
    return self.layer(**overrides).apply({"params": params}, x, **dict(self.call))

  @property
  def equation(self) -> str:
    """An einsum layer's equation, given at construction or per call."""
    return {**dict(self.kwargs), **dict(self.call)}["einsum_str"]

  @property
  def has_bias(self) -> bool:
    return dict(self.kwargs).get("use_bias", True)


def branch(name, kind, x_shape, lead=0, call=None, **kwargs):
  return Branch(name, kind, tuple(x_shape), tuple(sorted(kwargs.items())), lead,
                tuple(sorted((call or {}).items())))


class BranchNet(nn.Module):
  branches: tuple

  @nn.compact
  def __call__(self, xs):
    hidden = []
    for b in self.branches:
      s = b.layer(name=b.name)(jnp.moveaxis(xs[b.name], 0, b.lead), **dict(b.call))
      hidden.append(jnp.tanh(jnp.moveaxis(s, b.lead, 0)).reshape(BATCH, -1))
    return nn.Dense(CLASSES, name="head")(jnp.concatenate(hidden, axis=-1))


def nnx_layer(b: Branch, rngs: nnx.Rngs) -> nnx.Module:
  """The NNX twin of branch ``b``'s layer (axes sorted, as flax's linen sorts
  them)."""
  kwargs = dict(b.kwargs)
  if b.kind == "einsum":
    _, kernel_labels, out_labels = einsum_operands(b.equation, len(b.x_shape))
    sizes = dict(zip(kernel_labels, kwargs["shape"]))
    bias_shape = tuple(sizes[c] for c in out_labels if c in sizes)
    # An equation given per call overrides NNX's required one: here one that
    # sums over the output's last label, which K-FAC would not capture.
    return nnx.Einsum(kwargs.get("einsum_str", b.equation[:-1]), kwargs["shape"],
                      bias_shape if b.has_bias else None, rngs=rngs)
  features = kwargs.pop("features")
  shape = np.moveaxis(np.empty(b.x_shape), 0, b.lead).shape  # as the layer sees it
  if b.kind in NNX_CONV_TYPES:
    return NNX_CONV_TYPES[b.kind](shape[-1], features, rngs=rngs, **kwargs)
  ndim = len(shape)
  axis = kwargs.pop("axis", -1)
  axis = sorted(a % ndim for a in (axis if isinstance(axis, tuple) else (axis,)))
  batch_dims = sorted(kwargs.pop("batch_dims", ()))
  return nnx.LinearGeneral(tuple(shape[a] for a in axis), features, axis=tuple(axis),
                           batch_axis={d: shape[d] for d in batch_dims},
                           rngs=rngs, **kwargs)


class NNXBranchNet(nnx.Module):
  """`BranchNet` in NNX (the head's input width given)."""

  def __init__(self, branches, head_features, rngs):
    self.branches = branches
    for b in branches:
      setattr(self, b.name, nnx_layer(b, rngs))
    self.head = nnx.Linear(head_features, CLASSES, rngs=rngs)

  def __call__(self, xs):
    hidden = []
    for b in self.branches:
      s = getattr(self, b.name)(jnp.moveaxis(xs[b.name], 0, b.lead), **dict(b.call))
      hidden.append(jnp.tanh(jnp.moveaxis(s, b.lead, 0)).reshape(BATCH, -1))
    return self.head(jnp.concatenate(hidden, axis=-1))


def branch_forward(branches, params, xs, perturbations):
  """BranchNet written out, each layer output plus its perturbation."""
  hidden = []
  for b in branches:
    moved = jnp.moveaxis(xs[b.name], 0, b.lead)
    s = b.apply(params[b.name], moved) + perturbations[b.name]
    hidden.append(jnp.tanh(jnp.moveaxis(s, b.lead, 0)).reshape(BATCH, -1))
  h = jnp.concatenate(hidden, axis=-1)
  logits = h @ params["head"]["kernel"] + params["head"]["bias"]
  return logits + perturbations["head"], h


class Reference(NamedTuple):
  """Everything the numpy reference needs about one branch model.

  Attributes:
    inputs: branch -> the layer input, as the layer sees it.
    outputs: branch -> the layer output.
    head_input: (N, D) input of the head.
    output_grads: layer (and "head") -> ∂ summed NLL / ∂ layer output.
    jacobians: branch -> ∂ output / ∂ kernel of the bias-free layer.
  """
  inputs: dict
  outputs: dict
  head_input: Any
  output_grads: dict
  jacobians: dict


@functools.partial(jax.jit, static_argnums=0)
def branch_reference(branches, params, xs, y):
  inputs = {b.name: jnp.moveaxis(xs[b.name], 0, b.lead) for b in branches}
  outputs = {b.name: b.apply(params[b.name], inputs[b.name]) for b in branches}
  zeros = {name: jnp.zeros_like(s) for name, s in outputs.items()}
  zeros["head"] = jnp.zeros((BATCH, CLASSES))

  def loss(perturbations):
    logits, h = branch_forward(branches, params, xs, perturbations)
    return summed_nll(logits, y), h
  output_grads, head_input = jax.grad(loss, has_aux=True)(zeros)
  # The written-out forward pass is the model's.
  error = jnp.max(jnp.abs(branch_forward(branches, params, xs, zeros)[0]
                          - BranchNet(branches).apply({"params": params}, xs)))

  jacobians = {}
  for b in branches:  # the layer is linear in its kernel: ∂y/∂W holds the rows
    jacobians[b.name] = jax.jacfwd(
        lambda k, b=b: b.apply({"kernel": k}, inputs[b.name], use_bias=False))(
            params[b.name]["kernel"])
  return error, Reference(inputs, outputs, head_input, output_grads, jacobians)


class Family(NamedTuple):
  params: Any
  grads: Any
  updates: Any
  state: Any
  reference: Reference


@functools.lru_cache(maxsize=None)
def run_family(branches: tuple, api: str = "linen") -> Family:
  """One K-FAC update and the reference arrays for a tuple of branches, the
  model written in ``api``."""
  model = BranchNet(branches)
  rng = np.random.default_rng(len(branches))
  xs = {b.name: jnp.asarray(rng.normal(size=b.x_shape), jnp.float32)
        for b in branches}
  y = labels(1)
  params = random_params(model, xs, seed=2)
  grads = random_tree(params, seed=3)
  twin = model_for(api, model, lambda rngs: NNXBranchNet(
      branches, params["head"]["kernel"].shape[0], rngs), params)
  updates, state = kfac_step(twin, params, (xs, y), grads)
  forward_error, reference = branch_reference(branches, params, xs, y)
  assert forward_error < 1e-5
  return Family(params, grads, updates, state,
                jax.tree.map(f64, reference))


def check_head(family, branches):
  assert set(family.state.factors) == {b.name for b in branches} | {"head"}
  ref = family.reference
  factors, update = dense_reference(ref.head_input, ref.output_grads["head"], BATCH,
                                    family.grads["head"])
  assert_block(family.state.factors["head"], family.updates["head"], factors, update)


# --------------------------------------------------------------------------
# 1. nn.Conv (KFC): 1-D to 4-D, every padding mode, strides, dilations,
#    groups.

CONV_BRANCHES = (
    # 1-D, inputs (N, 6, C) unless noted.
    branch("c1_same_bias", "conv", (BATCH, 6, 2),
           features=3, kernel_size=(3,), padding="SAME"),
    branch("c1_valid_stride2_nobias", "conv", (BATCH, 6, 2),
           features=3, kernel_size=(3,), padding="VALID", strides=2, use_bias=False),
    branch("c1_explicit_kdil2", "conv", (BATCH, 6, 2),
           features=2, kernel_size=(2,), padding=((1, 2),), kernel_dilation=2),
    branch("c1_causal_kdil2_groups2", "conv", (BATCH, 6, 4),
           features=4, kernel_size=(3,), padding="CAUSAL", kernel_dilation=2,
           feature_group_count=2),
    branch("c1_circular_stride2", "conv", (BATCH, 6, 2),
           features=3, kernel_size=(3,), padding="CIRCULAR", strides=2),
    branch("c1_reflect_kdil2", "conv", (BATCH, 6, 2),
           features=2, kernel_size=(3,), padding="REFLECT", kernel_dilation=2),
    branch("c1_input_dilation_stride2", "conv", (BATCH, 5, 2),
           features=3, kernel_size=(3,), padding=((2, 1),), input_dilation=2,
           strides=2),
    branch("c1_negative_padding", "conv", (BATCH, 7, 2),
           features=2, kernel_size=(2,), padding=((-1, 1),), strides=2),
    branch("c1_extra_leading_axis", "conv", (BATCH, 2, 6, 2),
           features=3, kernel_size=(2,), padding="SAME"),
    # 2-D.
    branch("c2_same_groups2", "conv", (BATCH, 5, 6, 4),
           features=4, kernel_size=(3, 3), padding="SAME", feature_group_count=2),
    branch("c2_valid_strides_nobias", "conv", (BATCH, 5, 6, 2),
           features=3, kernel_size=(2, 3), padding="VALID", strides=(2, 1),
           use_bias=False),
    branch("c2_explicit_kdil", "conv", (BATCH, 5, 6, 2),
           features=3, kernel_size=(2, 2), padding=((1, 2), (0, 1)),
           kernel_dilation=(2, 1)),
    branch("c2_int_padding_stride2", "conv", (BATCH, 5, 5, 2),
           features=2, kernel_size=(3, 3), padding=1, strides=2),
    branch("c2_circular_even_kernel", "conv", (BATCH, 5, 6, 2),
           features=3, kernel_size=(2, 3), padding="CIRCULAR", strides=2,
           kernel_dilation=(1, 2)),
    branch("c2_reflect_groups2_nobias", "conv", (BATCH, 5, 6, 4),
           features=2, kernel_size=(3, 2), padding="REFLECT", feature_group_count=2,
           use_bias=False),
    branch("c2_input_dilation_groups2", "conv", (BATCH, 4, 5, 4),
           features=4, kernel_size=(2, 3), padding=((1, 1), (2, 0)),
           input_dilation=(2, 1), strides=(1, 2), feature_group_count=2),
    branch("c2_depthwise", "conv", (BATCH, 5, 5, 3),
           features=6, kernel_size=(3, 3), padding="SAME", feature_group_count=3),
    # 3-D.
    branch("c3_same_strides", "conv", (BATCH, 4, 4, 3, 2),
           features=2, kernel_size=(2, 2, 2), padding="SAME", strides=(2, 1, 2)),
    branch("c3_valid_groups2_nobias", "conv", (BATCH, 4, 4, 3, 4),
           features=2, kernel_size=(2, 1, 2), padding="VALID", strides=(2, 1, 1),
           feature_group_count=2, use_bias=False),
    branch("c3_explicit_dilations", "conv", (BATCH, 4, 3, 3, 2),
           features=2, kernel_size=(2, 2, 2), padding=((1, 0), (0, 1), (1, 1)),
           kernel_dilation=(1, 2, 1), input_dilation=(1, 1, 2)),
    branch("c3_circular", "conv", (BATCH, 4, 4, 3, 2),
           features=2, kernel_size=(3, 2, 2), padding="CIRCULAR", strides=(1, 2, 1)),
    # 4-D.
    branch("c4_valid_strides", "conv", (BATCH, 3, 3, 2, 3, 2),
           features=2, kernel_size=(2, 2, 1, 2), padding="VALID", strides=(1, 2, 1, 1)),
    # nn.ConvTranspose: the input dilated by the strides, then convolved.
    branch("t1_same_stride2", "conv_transpose", (BATCH, 4, 2),
           features=3, kernel_size=(3,), strides=(2,), padding="SAME"),
    branch("t2_valid_kdil_nobias", "conv_transpose", (BATCH, 3, 4, 2),
           features=2, kernel_size=(2, 3), strides=(2, 1), padding="VALID",
           kernel_dilation=(1, 2), use_bias=False),
    branch("t2_explicit_transpose_kernel", "conv_transpose", (BATCH, 3, 3, 2),
           features=3, kernel_size=(3, 2), strides=(2, 2), padding=((1, 2), (0, 1)),
           transpose_kernel=True),
)
CONV_CASES = {b.name: b for b in CONV_BRANCHES}


def group_columns(matrix, groups):
  """(..., c_out) -> (groups, ..., c_out / groups): output channels per group."""
  width = matrix.shape[-1] // groups
  return np.stack([matrix[..., j * width:(j + 1) * width] for j in range(groups)])


def conv_patches(jacobian, kernel_shape, groups):
  """(groups, R, taps·c_in/groups) im2col rows, in the kernel's order.

  ``y[r, o] = Σ_p patch_r[p] · kernel[p, o]`` for the output channels o of
  the patch's group, so ``∂y[r, o] / ∂kernel[p, o]`` is the patch of row r:
  the Jacobian at one output channel of a group holds every row of it.
  """
  c_out = kernel_shape[-1]
  in_dim = int(np.prod(kernel_shape[:-1]))
  jacobian = jacobian.reshape(-1, c_out, in_dim, c_out)
  width = c_out // groups
  return np.stack([jacobian[:, j * width, :, j * width] for j in range(groups)])


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_matches_brute_force(case, api):
  b = CONV_CASES[case]
  family = run_family(CONV_BRANCHES, api)
  ref, params, grads = family.reference, family.params[b.name], family.grads[b.name]
  # lax.conv_transpose(transpose_kernel=True) convolves the stored kernel
  # flipped along its spatial axes, channel axes swapped: compare in that form.
  # (The map is its own inverse; it acts on an array's trailing kernel axes.)
  layer, rank = b.layer(), params["kernel"].ndim
  applied = ((lambda k: np.swapaxes(np.flip(k, range(k.ndim - rank, k.ndim - 2)), -1, -2))
             if getattr(layer, "transpose_kernel", False) else (lambda k: k))
  kernel = applied(f64(params["kernel"]))
  groups, c_out = getattr(layer, "feature_group_count", 1), kernel.shape[-1]
  in_dim = kernel[..., 0].size
  jacobian = applied(f64(ref.jacobians[b.name]))  # ∂y/∂kernel: (*y, *kernel)
  patches = conv_patches(jacobian, kernel.shape, groups)
  outputs = ref.outputs[b.name]
  assert patches.shape == (groups, outputs[..., 0].size, in_dim)

  # The reference rows reproduce the convolution, group by group.
  bias = f64(params["bias"]) if b.has_bias else np.zeros(c_out)
  np.testing.assert_allclose(
      patches @ group_columns(kernel.reshape(in_dim, c_out), groups)
      + group_columns(bias, groups)[:, None],
      group_columns(outputs.reshape(-1, c_out), groups), atol=1e-5)

  a, g, u_kernel, u_bias = kronecker_reference(
      patches, group_columns(ref.output_grads[b.name].reshape(-1, c_out), groups),
      BATCH, group_columns(applied(f64(grads["kernel"])).reshape(in_dim, c_out), groups),
      group_columns(f64(grads["bias"]), groups) if b.has_bias else None)
  expected = {"kernel": applied(
      np.concatenate(list(u_kernel), axis=-1).reshape(kernel.shape))}
  if b.has_bias:
    expected["bias"] = np.concatenate(list(u_bias))

  size = in_dim + b.has_bias
  assert set(family.state.factors) == set(CONV_CASES) | {"head"}
  assert family.state.factors[b.name].a.shape == (groups, size, size)
  assert_block(family.state.factors[b.name], family.updates[b.name], (a, g), expected)


@pytest.mark.parametrize("api", APIS)
def test_conv_family_head_matches_brute_force(api):
  check_head(run_family(CONV_BRANCHES, api), CONV_BRANCHES)


def test_conv_transpose_rows_reproduce_flax_for_every_padding_and_stride():
  """The layout's patch rows times its kernel matrix are flax's output, for
  kernels reaching more or fewer inputs than the stride (where SAME pads
  differently) and both kernel storages."""
  rng = np.random.default_rng(0)
  configs = [((3,), stride, padding, dilation, stride == 2) for stride, padding, dilation
             in itertools.product((1, 2, 4), ("SAME", "VALID"), (1, 2))]
  configs.append(((2, 3), 2, 1, 1, True))  # 2-D, explicit padding
  for kernel_size, stride, padding, dilation, transpose_kernel in configs:
    rank = len(kernel_size)
    layer = nn.ConvTranspose(3, kernel_size, strides=(stride,) * rank, padding=padding,
                             kernel_dilation=(dilation,) * rank,
                             transpose_kernel=transpose_kernel)
    x = jnp.asarray(rng.normal(size=(2, *(4,) * rank, 2)), jnp.float32)
    variables = layer.init(jax.random.key(0), x)
    y = layer.apply(variables, x)
    layout = registry.kind_of(layer).layout(layer, x, y)
    params = variables["params"]
    assert layout.kernel_shape == params["kernel"].shape
    rows = layout.input_rows(x)[0] @ layout.kernel_matrix(params["kernel"])[0]
    np.testing.assert_allclose(rows + params["bias"], y.reshape(-1, 3), atol=1e-5,
                               err_msg=str((kernel_size, stride, padding, dilation,
                                            transpose_kernel)))
    np.testing.assert_array_equal(
        layout.kernel_from_matrix(layout.kernel_matrix(params["kernel"])),
        params["kernel"])


# --------------------------------------------------------------------------
# 2. nn.DenseGeneral: several contracted axes, several output axes, batch_dims.
#    flax's DenseGeneral (checked): kernel (*batch, *in_features, *features),
#    output (*batch, *other axes in order, *features), axis and batch_dims
#    sorted; batch_dims must be the leading axes 0..k-1.

# Two families: one without and one with batch_dims (the example axis is then
# not the layer input's axis 0). Each also holds one layer declared with its
# axes out of order (flax sorts axis and batch_dims: the same layer).
DENSE_GENERAL_FAMILIES = (
    (
        branch("axes_features_bias", "dense_general", (BATCH, 2, 4, 3),
               features=(2, 3), axis=(-2, -1)),
        branch("axes_features_nobias", "dense_general", (BATCH, 2, 4, 3),
               features=(2, 3), axis=(-2, -1), use_bias=False),
        branch("middle_axis_int_features", "dense_general", (BATCH, 4, 3),
               features=2, axis=1),
        branch("unsorted_axes", "dense_general", (BATCH, 4, 3), features=2,
               axis=(-1, -2)),
    ),
    (
        branch("batch_dims_bias", "dense_general", (BATCH, 2, 4, 3), lead=1,
               features=(2, 3), axis=-1, batch_dims=(0,)),
        branch("batch_dims_axes_nobias", "dense_general", (BATCH, 2, 4, 3), lead=1,
               features=(3, 2), axis=(-2, -1), batch_dims=(0,), use_bias=False),
        branch("two_batch_dims", "dense_general", (BATCH, 2, 3, 2, 3), lead=2,
               features=(2, 2), axis=-1, batch_dims=(0, 1)),
        branch("unsorted_batch_dims", "dense_general", (BATCH, 2, 3, 3), lead=2,
               features=2, axis=-1, batch_dims=(1, 0)),
    ),
)
DENSE_GENERAL_FAMILY = {b.name: family for family in DENSE_GENERAL_FAMILIES
                        for b in family}
DENSE_GENERAL_CASES = {b.name: b for family in DENSE_GENERAL_FAMILIES
                       for b in family if not b.name.startswith("unsorted")}


def check_dense_general(branches, b, api="linen"):
  family = run_family(branches, api)
  ref, params, grads = family.reference, family.params[b.name], family.grads[b.name]
  kernel = f64(params["kernel"])
  kwargs = dict(b.kwargs)
  inputs = ref.inputs[b.name]
  batch_shape = tuple(inputs.shape[i] for i in sorted(kwargs.get("batch_dims", ())))
  features = kwargs["features"]
  features = features if isinstance(features, tuple) else (features,)
  slices, outs = int(np.prod(batch_shape)), int(np.prod(features))
  in_dim = kernel.size // slices // outs

  # ∂y[b, r, o] / ∂kernel[b', i, o'] = x-row[b, r, i] δ(b, b') δ(o, o').
  jacobian = ref.jacobians[b.name].reshape(slices, -1, outs, slices, in_dim, outs)
  rows = np.stack([jacobian[s, :, 0, s, :, 0] for s in range(slices)])
  kernel_mats = kernel.reshape(slices, in_dim, outs)
  bias = (f64(params["bias"]).reshape(slices, outs) if b.has_bias
          else np.zeros((slices, outs)))
  np.testing.assert_allclose(rows @ kernel_mats + bias[:, None],
                             ref.outputs[b.name].reshape(slices, -1, outs), atol=1e-5)

  a, g, u_kernel, u_bias = kronecker_reference(
      rows, ref.output_grads[b.name].reshape(slices, -1, outs), BATCH,
      f64(grads["kernel"]).reshape(slices, in_dim, outs),
      f64(grads["bias"]).reshape(slices, outs) if b.has_bias else None)
  expected = {"kernel": u_kernel.reshape(kernel.shape)}
  if b.has_bias:
    expected["bias"] = u_bias.reshape(params["bias"].shape)

  size = in_dim + b.has_bias
  assert family.state.factors[b.name].a.shape == (slices, size, size)
  assert_block(family.state.factors[b.name], family.updates[b.name], (a, g), expected)
  assert set(family.state.factors) == {c.name for c in branches} | {"head"}


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("case", list(DENSE_GENERAL_CASES))
def test_dense_general_matches_brute_force(case, api):
  check_dense_general(DENSE_GENERAL_FAMILY[case], DENSE_GENERAL_CASES[case], api)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("family", [0, 1], ids=["plain", "batch_dims"])
def test_dense_general_family_head_matches_brute_force(family, api):
  branches = DENSE_GENERAL_FAMILIES[family]
  check_head(run_family(branches, api), branches)


def test_dense_general_axes_in_any_order():
  """axis=(-1, -2) is the layer axis=(-2, -1) is (kernel (4, 3, 2))."""
  branches = DENSE_GENERAL_FAMILIES[0]
  check_dense_general(branches, branches[-1])


def test_dense_general_batch_dims_in_any_order():
  """batch_dims=(1, 0) is the layer batch_dims=(0, 1) is (kernel (2, 3, 3, 2))."""
  branches = DENSE_GENERAL_FAMILIES[1]
  check_dense_general(branches, branches[-1])


# --------------------------------------------------------------------------
# 2b. nn.Einsum: labels in x and the kernel are contracted, in the kernel and
#     y are output features, in all three index stack slices, in x and y
#     index rows; the kernel matrix in kernel order. The reference takes the
#     rows from the Jacobian ∂y/∂kernel and moves axes by label (np.einsum).

EINSUM_BRANCHES = (
    branch("dense_like", "einsum", (BATCH, 2, 4), shape=(4, 3), einsum_str="btd,dk->btk"),
    branch("axes_in_any_order", "einsum", (BATCH, 3, 4), shape=(3, 2, 4),
           einsum_str="btd,khd->bhkt"),
    branch("two_contracted_nobias", "einsum", (BATCH, 2, 2, 3), shape=(3, 2, 4),
           einsum_str="bthd,dhk->btk", use_bias=False),
    branch("stack_leading", "einsum", (BATCH, 3, 4), lead=1, shape=(3, 4, 2),
           einsum_str="hbd,hdk->hbk"),
    branch("stack_last_in_kernel", "einsum", (BATCH, 3, 4), shape=(4, 2, 3),
           einsum_str="bhd,dkh->bkh"),
    branch("ellipsis", "einsum", (BATCH, 3, 4), shape=(4, 2), einsum_str="...d,dk->...k"),
    branch("per_call", "einsum", (BATCH, 3, 4), shape=(4, 2, 3),
           call={"einsum_str": "btd,dkh->bkth"}),
)
EINSUM_CASES = {b.name: b for b in EINSUM_BRANCHES}


def einsum_operands(equation, x_ndim):
  """(x, kernel, y) labels, a leading "..." spelled out in capitals."""
  x, kernel, y = equation.replace("->", ",").split(",")
  ellipsis = "XYZ"[:x_ndim - len(x) + 3] if x.startswith("...") else ""
  return x.replace("...", ellipsis), kernel, y.replace("...", ellipsis)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("case", list(EINSUM_CASES))
def test_einsum_matches_brute_force(case, api):
  b = EINSUM_CASES[case]
  family = run_family(EINSUM_BRANCHES, api)
  ref, params, grads = family.reference, family.params[b.name], family.grads[b.name]
  x, kernel, y = einsum_operands(b.equation, len(b.x_shape))
  stack = "".join(c for c in kernel if c in x and c in y)
  contracted = "".join(c for c in kernel if c in x and c not in y)
  features = "".join(c for c in kernel if c in y and c not in x)
  rows = "".join(c for c in x if c in y and c not in kernel)
  bias_labels = "".join(c for c in y if c in kernel)
  sizes = dict(zip(kernel, params["kernel"].shape))
  slices, in_dim, outs = (int(np.prod([sizes[c] for c in part]))
                          for part in (stack, contracted, features))
  as_rows = lambda array, labels, order, width: np.einsum(
      f"{labels}->{order}", f64(array)).reshape(slices, -1, width)
  as_matrix = lambda array, labels, order, *dims: np.einsum(
      f"{labels}->{order}", f64(array)).reshape(slices, *dims)

  # ∂y[s, r, f] / ∂kernel[s, i, f] at feature f = 0 is row r's input; a
  # stack label, in both of the Jacobian's halves, is read on the diagonal.
  at_feature = lambda labels: tuple(0 if c in features else slice(None) for c in labels)
  jacobian = f64(ref.jacobians[b.name])[at_feature(y) + at_feature(kernel)]
  drop = lambda labels: "".join(c for c in labels if c not in features)
  patches = as_rows(jacobian, drop(y) + drop(kernel), stack + rows + contracted, in_dim)
  kernel_mats = as_matrix(params["kernel"], kernel, stack + contracted + features,
                          in_dim, outs)
  bias = (as_matrix(params["bias"], bias_labels, stack + features, outs)
          if b.has_bias else np.zeros((slices, outs)))
  np.testing.assert_allclose(patches @ kernel_mats + bias[:, None],
                             as_rows(ref.outputs[b.name], y, stack + rows + features, outs),
                             atol=1e-5)

  a, g, u_kernel, u_bias = kronecker_reference(
      patches, as_rows(ref.output_grads[b.name], y, stack + rows + features, outs), BATCH,
      as_matrix(grads["kernel"], kernel, stack + contracted + features, in_dim, outs),
      as_matrix(grads["bias"], bias_labels, stack + features, outs) if b.has_bias else None)
  unmatrix = lambda matrix, parts, labels: np.einsum(
      f"{parts}->{labels}", matrix.reshape([sizes[c] for c in parts]))
  expected = {"kernel": unmatrix(u_kernel, stack + contracted + features, kernel)}
  if b.has_bias:
    expected["bias"] = unmatrix(u_bias, stack + features, bias_labels)
  assert set(family.state.factors) == set(EINSUM_CASES) | {"head"}
  assert_block(family.state.factors[b.name], family.updates[b.name], (a, g), expected)


def test_einsum_layout_rows_and_round_trips():
  """On every case: input rows times the kernel matrix plus the bias are the
  output rows; output rows are K-major within a stack slice; an extra
  leading axis (time steps under nn.RNN) adds rows; kernel and bias come back
  from their matrices."""
  rng = np.random.default_rng(0)
  for b in EINSUM_BRANCHES:
    layer, call = b.layer(), dict(b.call)
    x = jnp.asarray(rng.normal(size=np.moveaxis(np.empty(b.x_shape), 0, b.lead).shape),
                    jnp.float32)
    variables = layer.init(jax.random.key(0), x, **call)
    params, y = variables["params"], layer.apply(variables, x, **call)
    kind = registry.kind_of(layer)
    layout = kind.layout(registry.configured(kind, layer, (x,), call), x, y)
    bias = layout.bias_matrix(params["bias"]) if b.has_bias else 0.0
    minus_y = layer.apply(variables, -x, **call)
    for xs, ys in ((x, y), (jnp.stack([x, -x]), jnp.stack([y, minus_y]))):
      rows = layout.input_rows(xs) @ layout.kernel_matrix(params["kernel"])
      np.testing.assert_allclose(rows + (bias if np.ndim(bias) == 0 else bias[:, None]),
                                 layout.output_rows(ys[None]), atol=1e-5, err_msg=b.name)
    np.testing.assert_allclose(layout.output_rows(jnp.stack([y, 2 * y])), jnp.concatenate(
        [layout.output_rows(y[None]), 2 * layout.output_rows(y[None])], 1), err_msg=b.name)
    np.testing.assert_array_equal(
        layout.kernel_from_matrix(layout.kernel_matrix(params["kernel"])), params["kernel"])
    if b.has_bias:
      np.testing.assert_array_equal(
          layout.bias_from_matrix(layout.bias_matrix(params["bias"])), params["bias"])


class SummingEinsums(nn.Module):
  """Einsums that sum over a label of one operand (t), whether the equation
  is given at construction or per call."""

  @nn.compact
  def __call__(self, x):
    summed = "btd,dk->bk"
    a = nn.Einsum((4, 3), summed, name="at_construction")(x)
    b = nn.Einsum((4, 3), name="per_call")(x, einsum_str=summed)
    return nn.Dense(CLASSES, name="head")(jnp.tanh(jnp.concatenate([a, b], -1)))


def test_einsum_summing_over_a_label_uses_the_diagonal_block():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(BATCH, 3, 4)), jnp.float32)
  model = SummingEinsums()
  assert_diagonal_fallback(
      model, random_params(model, x, seed=2), (x, labels(1)),
      {f"{layer}/{leaf}": (layer, leaf) for layer in ("at_construction", "per_call")
       for leaf in ("kernel", "bias")})


class TwoEquations(nn.Module):
  """One nn.Einsum called with an equation K-FAC expresses and one it does
  not: its block would miss the second call's curvature."""

  @nn.compact
  def __call__(self, x):
    layer = nn.Einsum((4, 3), name="twice")
    both = layer(x, "btd,dk->btk").sum(1) + layer(x, "btd,dk->bk")
    return nn.Dense(CLASSES, name="head")(both)


def test_an_einsum_called_with_a_captured_and_an_uncaptured_equation_is_an_error():
  x = jnp.zeros((BATCH, 3, 4))
  model = TwoEquations()
  params = model.init(jax.random.key(0), x)["params"]
  tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=(x, labels(1)))
  with pytest.raises(ValueError, match="the layer at 'twice' is called with inputs that "
                     "need different curvature layouts"):
    tx.init(params)


# --------------------------------------------------------------------------
# 3. nn.Embed: diagonal A from token counts, never a vocab x vocab array.

VOCAB, EMBED_DIM = 7, 3


class EmbedNet(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    e = nn.Embed(VOCAB, EMBED_DIM, name="embed")(tokens)
    return nn.Dense(CLASSES, name="head")(e.mean(axis=1))


class NNXEmbedNet(nnx.Module):
  """`EmbedNet` in NNX."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, EMBED_DIM, rngs=rngs)
    self.head = nnx.Linear(EMBED_DIM, CLASSES, rngs=rngs)

  def __call__(self, tokens):
    return self.head(self.embed(tokens).mean(axis=1))


@pytest.mark.parametrize("api", APIS)
def test_embed_matches_brute_force(api):
  n, t = 4, 5
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, VOCAB - 1, (n, t)), jnp.int32)  # id 6 unseen
  y = labels(1, n)
  params = random_params(EmbedNet(), tokens, seed=2)
  grads = random_tree(params, seed=3)
  out, state = kfac_step(model_for(api, EmbedNet(), NNXEmbedNet, params), params,
                         (tokens, y), grads)

  def forward(perturbations):
    e = params["embed"]["embedding"][tokens] + perturbations["embed"]
    pooled = e.mean(axis=1)
    logits = pooled @ params["head"]["kernel"] + params["head"]["bias"]
    return summed_nll(logits + perturbations["head"], y), (pooled, logits)
  zeros = {"embed": jnp.zeros((n, t, EMBED_DIM)), "head": jnp.zeros((n, CLASSES))}
  out_grads, (pooled, logits) = jax.jit(jax.grad(forward, has_aux=True))(zeros)
  np.testing.assert_allclose(logits, EmbedNet().apply({"params": params}, tokens),
                             atol=1e-5)

  one_hot = np.eye(VOCAB)[np.asarray(tokens).reshape(-1)]  # (N T, vocab) rows
  a_diag = one_hot.mean(axis=0)  # the diagonal of mean ā āᵀ: token frequencies
  np.testing.assert_allclose(one_hot.T @ one_hot / (n * t), np.diag(a_diag))
  rows_g = f64(out_grads["embed"]).reshape(-1, EMBED_DIM)
  g = rows_g.T @ rows_g / n
  expected = bf.kronecker_precondition(
      np.diag(a_diag), g, grads["embed"]["embedding"], None, DAMPING)

  assert a_diag[-1] == 0 and set(state.factors) == {"embed", "head"}
  assert state.factors["embed"].a.shape == (1, VOCAB)
  assert bf.relative_error(state.factors["embed"].a, a_diag[None]) < 1e-4
  assert bf.relative_error(state.factors["embed"].g, g[None]) < 1e-4
  assert out["embed"]["embedding"].shape == (VOCAB, EMBED_DIM)
  assert bf.relative_error(out["embed"], {"embedding": expected["kernel"]}) < 1e-3
  for leaf in jax.tree.leaves((state.factors["embed"], state.inverses["embed"])):
    assert leaf.shape.count(VOCAB) <= 1, leaf.shape
  head_factors, head_update = dense_reference(pooled, out_grads["head"], n, grads["head"])
  assert_block(state.factors["head"], out["head"], head_factors, head_update)


class TiedLM(nn.Module):
  """Tied embeddings: the same table looks tokens up and scores the logits."""

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(VOCAB, EMBED_DIM, name="embed")
    h = jnp.tanh(nn.Dense(EMBED_DIM, use_bias=False, name="mix")(embed(tokens)))
    return embed.attend(h)


class NNXTiedLM(nnx.Module):
  """`TiedLM` in NNX."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, EMBED_DIM, rngs=rngs)
    self.mix = nnx.Linear(EMBED_DIM, EMBED_DIM, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    return self.embed.attend(jnp.tanh(self.mix(self.embed(tokens))))


@pytest.mark.parametrize("api", APIS)
def test_tied_embedding_combines_lookup_and_attend_statistics(api):
  n, t = 4, 5
  rng = np.random.default_rng(4)
  tokens = jnp.asarray(rng.integers(0, VOCAB, (n, t)), jnp.int32)
  y = jnp.asarray(rng.integers(0, VOCAB, (n, t)), jnp.int32)  # a label per token
  params = random_params(TiedLM(), tokens, seed=5)
  grads = random_tree(params, seed=6)
  out, state = kfac_step(model_for(api, TiedLM(), NNXTiedLM, params), params,
                         (tokens, y), grads)

  def forward(perturbations):
    table = params["embed"]["embedding"]
    e = table[tokens] + perturbations["lookup"]
    h = jnp.tanh(e @ params["mix"]["kernel"] + perturbations["mix"])
    logits = h @ table.T + perturbations["attend"]
    return summed_nll(logits.reshape(-1, VOCAB), y.reshape(-1)), h
  zeros = {"lookup": jnp.zeros((n, t, EMBED_DIM)), "mix": jnp.zeros((n, t, EMBED_DIM)),
           "attend": jnp.zeros((n, t, VOCAB))}
  out_grads, h = jax.jit(jax.grad(forward, has_aux=True))(zeros)
  num_terms = n * t

  # Each use i of the table E (vocab x features) has a Fisher block D_i ⊗ F_i.
  one_hot = np.eye(VOCAB)[np.asarray(tokens).reshape(-1)]
  lookup_g = f64(out_grads["lookup"]).reshape(-1, EMBED_DIM)
  logits_g = f64(out_grads["attend"]).reshape(-1, VOCAB)
  queries = f64(h).reshape(-1, EMBED_DIM)
  uses = [(one_hot.mean(0), lookup_g.T @ lookup_g / num_terms),      # lookup
          ((logits_g**2).sum(0) / num_terms, queries.T @ queries / len(queries))]  # attend
  # ... combined into one Kronecker product with the same trace.
  a, g = bf.combined_kronecker(uses)
  expected = bf.kronecker_precondition(
      np.diag(a), g, grads["embed"]["embedding"], None, DAMPING)

  assert state.factors["embed"].a.shape == (2, VOCAB)
  assert bf.relative_error(state.factors["embed"].a, np.stack([d for d, _ in uses])) < 1e-4
  assert bf.relative_error(state.factors["embed"].g, np.stack([f for _, f in uses])) < 1e-4
  assert bf.relative_error(out["embed"], {"embedding": expected["kernel"]}) < 1e-3
  for leaf in jax.tree.leaves((state.factors["embed"], state.inverses["embed"])):
    assert leaf.shape.count(VOCAB) <= 1, leaf.shape
  mix_factors, mix_update = dense_reference(
      f64(params["embed"]["embedding"])[tokens], out_grads["mix"], num_terms,
      grads["mix"])
  assert_block(state.factors["mix"], out["mix"], mix_factors, mix_update)


# --------------------------------------------------------------------------
# 4. nn.MultiHeadDotProductAttention: four DenseGeneral projections.

HEADS, HEAD_DIM, WIDTH = 2, 2, 3
PROJECTIONS = ("query", "key", "value", "out")


class AttentionNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.MultiHeadDotProductAttention(
        num_heads=HEADS, qkv_features=HEADS * HEAD_DIM, out_features=WIDTH,
        name="attn")(x)
    return nn.Dense(CLASSES, name="head")(jnp.tanh(h).mean(axis=1))


class NNXAttentionNet(nnx.Module):
  """`AttentionNet` in NNX."""

  def __init__(self, rngs):
    self.attn = nnx.MultiHeadAttention(
        HEADS, WIDTH, qkv_features=HEADS * HEAD_DIM, out_features=WIDTH,
        decode=False, rngs=rngs)
    self.head = nnx.Linear(WIDTH, CLASSES, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.attn(x)).mean(axis=1))


def attention_forward(params, x, perturbations):
  """Self-attention written out; perturbations on q, k, v, out and logits."""
  p = params["attn"]
  def project(name):
    return (jnp.einsum("ntd,dhf->nthf", x, p[name]["kernel"]) + p[name]["bias"]
            + perturbations[name])
  q, k, v = project("query"), project("key"), project("value")
  scores = jnp.einsum("nqhf,nkhf->nhqk", q, k) / np.sqrt(HEAD_DIM)
  mixed = jnp.einsum("nhqk,nkhf->nqhf", jax.nn.softmax(scores, axis=-1), v)
  s = (jnp.einsum("nqhf,hfe->nqe", mixed, p["out"]["kernel"]) + p["out"]["bias"]
       + perturbations["out"])
  pooled = jnp.tanh(s).mean(axis=1)
  logits = pooled @ params["head"]["kernel"] + params["head"]["bias"]
  return logits + perturbations["head"], {"mixed": mixed, "pooled": pooled}


@pytest.mark.parametrize("api", APIS)
def test_attention_projections_are_found_and_match_brute_force(api):
  n, t = BATCH, 4
  x = jnp.asarray(np.random.default_rng(0).normal(size=(n, t, WIDTH)), jnp.float32)
  y = labels(1)
  params = random_params(AttentionNet(), x, seed=2)
  grads = random_tree(params, seed=3)
  out, state = kfac_step(model_for(api, AttentionNet(), NNXAttentionNet, params),
                         params, (x, y), grads)

  assert set(state.factors) == {f"attn/{name}" for name in PROJECTIONS} | {"head"}
  assert set(state.inverses) == set(state.factors)

  qkv = HEADS * HEAD_DIM
  zeros = {name: jnp.zeros((n, t, HEADS, HEAD_DIM)) for name in PROJECTIONS[:3]}
  zeros.update(out=jnp.zeros((n, t, WIDTH)), head=jnp.zeros((n, CLASSES)))
  def loss(perturbations):
    logits, inner = attention_forward(params, x, perturbations)
    return summed_nll(logits, y), (logits, inner)
  out_grads, (logits, inner) = jax.jit(jax.grad(loss, has_aux=True))(zeros)
  np.testing.assert_allclose(logits, AttentionNet().apply({"params": params}, x),
                             atol=1e-5)

  layer_inputs = {"query": x, "key": x, "value": x, "out": inner["mixed"]}
  for name in PROJECTIONS:
    p, gp = params["attn"][name], grads["attn"][name]
    in_dim, out_dim = (qkv, WIDTH) if name == "out" else (WIDTH, qkv)
    flat = {"kernel": f64(gp["kernel"]).reshape(in_dim, out_dim),
            "bias": f64(gp["bias"]).reshape(out_dim)}
    factors, update = dense_reference(
        f64(layer_inputs[name]).reshape(-1, in_dim),
        f64(out_grads[name]).reshape(-1, out_dim), n, flat)
    expected = {"kernel": update["kernel"].reshape(p["kernel"].shape),
                "bias": update["bias"].reshape(p["bias"].shape)}
    assert_block(state.factors[f"attn/{name}"], out["attn"][name], factors, expected)
  head_factors, head_update = dense_reference(
      inner["pooled"], out_grads["head"], n, grads["head"])
  assert_block(state.factors["head"], out["head"], head_factors, head_update)


# --------------------------------------------------------------------------
# 5. Layers without a Kronecker block (ConvLocal; a circular ConvTranspose,
#    which sums its output over periods after convolving): the diagonal
#    fallback.


class UnregisteredNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.ConvTranspose(2, (3,), strides=(2,), padding="CIRCULAR",
                                  name="transpose")(x))
    h = jnp.tanh(nn.ConvLocal(2, (2,), padding="VALID", name="local")(h))
    return nn.Dense(CLASSES, name="head")(h.reshape(x.shape[0], -1))


def assert_diagonal_fallback(model, params, batch, fallback, variables=None):
  """Every leaf of ``fallback`` (``{key: (layer, leaf)}``) in the diagonal
  fallback, its Fisher the mean squared per-example gradient and its update
  the damped diagonal solve; the rest of the net is the "head" block."""
  grads = random_tree(params, seed=3)
  out, state = kfac_step(model.apply, params, batch, grads, variables)
  assert set(state.factors) == {"head", DIAGONAL}
  assert set(state.factors[DIAGONAL]) == set(fallback)

  def example_loss(p, xn, yn):
    outputs = model.apply({"params": p, **(variables or {})}, xn[None],
                          mutable=list(variables or ()))[0]
    return summed_nll(outputs, yn[None])
  per_example = jax.jit(jax.vmap(jax.grad(example_loss), (None, 0, 0)))(params, *batch)
  for key, (layer, leaf) in fallback.items():
    fisher = f64(per_example[layer][leaf]).sum(axis=0) ** 2 / BATCH
    assert state.factors[DIAGONAL][key].shape == params[layer][leaf].shape
    assert bf.relative_error(state.factors[DIAGONAL][key], fisher) < 1e-4
    expected = f64(grads[layer][leaf]) / (fisher + DAMPING)
    assert bf.relative_error(out[layer][leaf], expected) < 1e-3


def test_circular_conv_transpose_and_conv_local_use_the_diagonal_block():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(BATCH, 4, 2)), jnp.float32)
  model = UnregisteredNet()
  params = random_params(model, x, seed=2)
  assert_diagonal_fallback(
      model, params, (x, labels(1)),
      {f"{layer}/{leaf}": (layer, leaf)
       for layer in ("transpose", "local") for leaf in ("kernel", "bias")})


class NormalizedWeightsNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.WeightNorm(nn.Dense(3, name="weight_normed"), name="wn")(x))
    h = jnp.tanh(nn.SpectralNorm(nn.Dense(3, name="spectral"), name="sn")(
        h, update_stats=True))
    return nn.Dense(CLASSES, name="head")(h)


def test_layers_under_map_variables_use_the_diagonal_block():
  """nn.WeightNorm and nn.SpectralNorm apply a Dense with W / ‖W‖ or W / σ(W)
  (nn.map_variables): the Fisher of the stored W is not the Kronecker
  product of the Dense's input and output-gradient moments, so the Dense
  and the wrappers' own params go to the diagonal fallback. SpectralNorm's
  power-iteration vector, created at init from a 'params' key, does not
  stop init."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(BATCH, 5)), jnp.float32)
  model = NormalizedWeightsNet()
  params = random_params(model, x, seed=2)
  batch_stats = model.init(jax.random.key(0), x)["batch_stats"]
  fallback = {f"{layer}/{leaf}": (layer, leaf)
              for layer in ("weight_normed", "spectral") for leaf in ("kernel", "bias")}
  fallback["wn/weight_normed/kernel/scale"] = ("wn", "weight_normed/kernel/scale")
  assert_diagonal_fallback(model, params, (x, labels(1)), fallback,
                           {"batch_stats": batch_stats})


class StandardizedConv(nn.Conv):
  """big_vision's BiT ``StdConv``: its ``param`` returns the kernel
  standardised over its input axes (weight standardisation)."""

  def param(self, name, *args, **kwargs):
    value = super().param(name, *args, **kwargs)
    if name != "kernel":
      return value
    centred = value - value.mean(axis=(0, 1), keepdims=True)
    return centred / jnp.sqrt(jnp.square(centred).mean(axis=(0, 1), keepdims=True) + 1e-8)


class StandardizedConvNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(StandardizedConv(3, (2,), name="standardized")(x))
    return nn.Dense(CLASSES, name="head")(h.mean(axis=1))


def test_a_layer_whose_param_method_transforms_its_kernel_uses_the_diagonal_block():
  """A conv whose own ``param`` standardises the kernel applies a function
  of the stored params, as nn.map_variables does: diagonal fallback."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(BATCH, 4, 2)), jnp.float32)
  model = StandardizedConvNet()
  params = random_params(model, x, seed=2)
  assert_diagonal_fallback(model, params, (x, labels(1)),
                           {f"standardized/{leaf}": ("standardized", leaf)
                            for leaf in ("kernel", "bias")})


class ScaledDense(nn.Dense):
  """A subclass with its own ``__call__`` around ``super().__call__``."""

  @nn.compact
  def __call__(self, x):
    gain = self.param("gain", nn.initializers.constant(3.0), (self.features,))
    return super().__call__(x) * gain


class OwnKernelDense(nn.Dense):
  """A subclass whose ``__call__`` never calls the Dense it inherits."""

  @nn.compact
  def __call__(self, x):
    return x @ self.param("kernel", nn.initializers.lecun_normal(),
                          (x.shape[-1], self.features))


class SubclassedNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    return ScaledDense(CLASSES, name="head")(
        jnp.tanh(OwnKernelDense(4, name="own")(x)))


def scaled_head_factors(h, kernel, bias, gain, y):
  """The empirical ``(A, G)`` of the Dense inside a gained head,
  ``logits = (h W + b) ⊙ gain``: ``A`` the mean of ``[h, 1][h, 1]ᵀ``, ``G``
  the mean of ``g gᵀ`` with ``g = gain ⊙ (softmax(logits) - e_y)``."""
  logits = (h @ kernel + bias) * gain
  probs = np.exp(logits - logits.max(1, keepdims=True))
  probs /= probs.sum(1, keepdims=True)
  g = gain * (probs - np.eye(CLASSES)[np.asarray(y)])
  a_bar = np.concatenate([h, np.ones((len(h), 1))], 1)
  return a_bar.T @ a_bar / len(h), g.T @ g / len(h)


def test_a_subclass_with_its_own_call_is_the_layer_inside_it():
  """The head's block is its inner Dense call's: ``A`` the mean of its
  ``[h, 1][h, 1]ᵀ``, ``G`` the mean of ``(gain ⊙ (p - e_y))(...)ᵀ`` (the
  gradient at the inner output, empirical); the gain and a subclass that
  never calls its Dense go to the diagonal fallback."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(BATCH, 5)), jnp.float32)
  y = labels(1)
  model = SubclassedNet()
  params = random_params(model, x, seed=2)
  _, state = kfac_step(model.apply, params, (x, y), random_tree(params, seed=3))
  assert set(state.factors) == {"head", DIAGONAL}
  assert set(state.factors[DIAGONAL]) == {"own/kernel", "head/gain"}
  p = jax.tree.map(f64, params)
  h = np.tanh(f64(x) @ p["own"]["kernel"])
  want = scaled_head_factors(h, p["head"]["kernel"], p["head"]["bias"],
                             p["head"]["gain"], y)
  for got, expected in zip(state.factors["head"], want):
    assert bf.relative_error(got[0], expected) < 1e-5


class NNXScaledLinear(nnx.Linear):
  """`ScaledDense` in NNX."""

  def __init__(self, *args, rngs, **kwargs):
    super().__init__(*args, rngs=rngs, **kwargs)
    self.gain = nnx.Param(jnp.full((self.out_features,), 3.0))

  def __call__(self, x):
    return super().__call__(x) * self.gain[...]


class NNXOwnKernelLinear(nnx.Linear):
  """`OwnKernelDense` in NNX: a standardised kernel, never the inherited call."""

  def __call__(self, x):
    kernel = self.kernel[...]
    return x @ ((kernel - kernel.mean(0)) / jnp.sqrt(kernel.var(0) + 1e-8))


class NNXSubclassedNet(nnx.Module):

  def __init__(self, rngs):
    self.own = NNXOwnKernelLinear(5, 4, use_bias=False, rngs=rngs)
    self.head = NNXScaledLinear(4, CLASSES, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.own(x)))


def test_an_nnx_subclass_with_its_own_call_is_the_layer_inside_it():
  """As `test_a_subclass_with_its_own_call_is_the_layer_inside_it`, in NNX."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(BATCH, 5)), jnp.float32)
  y = labels(1)
  model = NNXSubclassedNet(nnx.Rngs(2))
  params = nnx.state(model, nnx.Param)
  _, state = kfac_step(model, params, (x, y), random_tree(params, seed=3))
  assert set(state.factors) == {"head", DIAGONAL}
  assert set(state.factors[DIAGONAL]) == {"own/kernel", "head/gain"}
  kernel = f64(model.own.kernel[...])
  h = np.tanh(f64(x) @ ((kernel - kernel.mean(0)) / np.sqrt(kernel.var(0) + 1e-8)))
  want = scaled_head_factors(h, f64(model.head.kernel[...]), f64(model.head.bias[...]),
                             f64(model.head.gain[...]), y)
  for got, expected in zip(state.factors["head"], want):
    assert bf.relative_error(got[0], expected) < 1e-5


class SharedQueriesNet(nn.Module):
  """Learned queries (DETR, Perceiver): a Dense whose input has no example
  axis, its output added to every example's."""

  @nn.compact
  def __call__(self, x):
    queries = self.param("queries", nn.initializers.normal(1.0), (x.shape[1], 3))
    h = jnp.tanh(x + nn.Dense(x.shape[-1], name="shared")(queries))
    return nn.Dense(CLASSES, name="head")(h.mean(axis=1))


def test_a_layer_without_example_axis_sums_the_examples_output_gradients():
  """Its rows are shared by every example, so its g is the sum over the
  examples of their gradients, cross terms kept (docs/design.md, "Mathematical conventions"):
  G = (1/L) Σ_t (Σ_n g_nt)(Σ_n g_nt)ᵀ, A the mean over the T shared rows."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(BATCH, 3, 2)), jnp.float32)
  y = labels(1)
  model = SharedQueriesNet()
  params = random_params(model, x, seed=2)
  _, state = kfac_step(model.apply, params, (x, y), random_tree(params, seed=3))

  def example_loss(delta, xn, yn):  # delta perturbs the shared layer's output
    shared = params["shared"]
    out = params["queries"] @ shared["kernel"] + shared["bias"] + delta
    h = jnp.tanh(xn[None] + out)
    return summed_nll(h.mean(axis=1) @ params["head"]["kernel"] + params["head"]["bias"],
                      yn[None])
  per_example = jax.vmap(jax.grad(example_loss), (None, 0, 0))(jnp.zeros((3, 2)), x, y)
  summed = f64(per_example).sum(axis=0)  # (T, out): one row per shared position
  rows = np.concatenate([f64(params["queries"]), np.ones((3, 1))], 1)
  assert bf.relative_error(state.factors["shared"].a[0], rows.T @ rows / 3) < 1e-5
  assert bf.relative_error(state.factors["shared"].g[0], summed.T @ summed / BATCH) < 1e-4


class RecurrentNet(nn.Module):
  cell: type

  @nn.compact
  def __call__(self, x):
    h = nn.RNN(self.cell(4, name="cell"), name="rnn",
               variable_axes={"kfac_inputs": 0, "kfac_perturbations": 0})(x)
    return nn.Dense(CLASSES, name="head")(h[:, -1])


def test_optimized_lstm_cell_gets_the_blocks_of_lstm_cell():
  """nn.OptimizedLSTMCell multiplies its gate kernels concatenated, out of
  the hooks' reach; K-FAC runs it as nn.LSTMCell (the same function and
  param names, one nn.Dense per gate): its factors and update are those of
  the LSTMCell model with the same params, to float32 round-off."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(BATCH, 3, 2)), jnp.float32)
  batch = (x, labels(1))
  params = random_params(RecurrentNet(nn.LSTMCell), x, seed=2)
  grads = random_tree(params, seed=3)
  optimized, plain = RecurrentNet(nn.OptimizedLSTMCell), RecurrentNet(nn.LSTMCell)
  np.testing.assert_allclose(optimized.apply({"params": params}, x),
                             plain.apply({"params": params}, x), rtol=1e-6)
  out, state = kfac_step(optimized.apply, params, batch, grads)
  expected_out, expected_state = kfac_step(plain.apply, params, batch, grads)
  assert set(state.factors) == {"head"} | {f"cell/{g}" for g in (
      "ii", "if", "ig", "io", "hi", "hf", "hg", "ho")}
  assert bf.relative_error(state.factors, expected_state.factors) < 1e-5
  assert bf.relative_error(out, expected_out) < 1e-5


# --------------------------------------------------------------------------
# 6. register_layer: a user module gets a Kronecker block.


class Affine(nn.Module):
  """A user layer ``x @ kernel + bias`` with its own parameters."""
  features: int

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.lecun_normal(),
                        (x.shape[-1], self.features))
    bias = self.param("bias", nn.initializers.zeros, (self.features,))
    return x @ kernel + bias


class AffineNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(Affine(4, name="affine")(x)).mean(axis=1)
    return nn.Dense(CLASSES, name="head")(h)


@pytest.fixture
def registered_affine():
  kfac_optax.register_layer(Affine, "dense")  # undone by conftest after the test


def affine_problem():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(BATCH, 5, 2)), jnp.float32)
  params = random_params(AffineNet(), x, seed=2)
  return params, (x, labels(1)), random_tree(params, seed=3)


def test_unregistered_user_layer_falls_back_to_the_diagonal():
  params, batch, _ = affine_problem()
  tx = kfac_optax.scale_by_kfac(AffineNet().apply, LOSS, example_batch=batch)
  state = jax.eval_shape(tx.init, params)
  assert set(state.factors) == {"head", DIAGONAL}
  assert set(state.factors[DIAGONAL]) == {"affine/kernel", "affine/bias"}


def test_registered_user_layer_matches_brute_force(registered_affine):
  del registered_affine
  params, (x, y), grads = affine_problem()
  out, state = kfac_step(AffineNet().apply, params, (x, y), grads)
  assert set(state.factors) == {"affine", "head"}

  def forward(perturbations):
    p = params["affine"]
    s = x @ p["kernel"] + p["bias"] + perturbations["affine"]
    pooled = jnp.tanh(s).mean(axis=1)
    logits = pooled @ params["head"]["kernel"] + params["head"]["bias"]
    return summed_nll(logits + perturbations["head"], y), (pooled, logits)
  zeros = {"affine": jnp.zeros((BATCH, 5, 4)), "head": jnp.zeros((BATCH, CLASSES))}
  out_grads, (pooled, logits) = jax.jit(jax.grad(forward, has_aux=True))(zeros)
  np.testing.assert_allclose(logits, AffineNet().apply({"params": params}, x),
                             atol=1e-5)

  factors, update = dense_reference(x, out_grads["affine"], BATCH, grads["affine"])
  assert_block(state.factors["affine"], out["affine"], factors, update)
  head_factors, head_update = dense_reference(pooled, out_grads["head"], BATCH,
                                              grads["head"])
  assert_block(state.factors["head"], out["head"], head_factors, head_update)


def test_registry_is_restored_after_registration():
  assert Affine not in registry._REGISTRY  # pylint: disable=protected-access
