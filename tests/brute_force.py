"""Explicit float64 reference computations for a tiny tanh MLP.

Nothing here uses kfac_optax: per-example Jacobians come from the chain rule
written out by hand, Kronecker products from np.kron and inverses from
np.linalg.solve, so the tests compare two independent computations.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


class TinyMLP(nn.Module):
  """x -> Dense(4) -> tanh -> Dense(3, no bias) -> tanh -> Dense(3)."""

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(4, name="hidden")(x))
    h = jnp.tanh(nn.Dense(3, use_bias=False, name="nobias")(h))
    return nn.Dense(3, name="out")(h)


LAYERS = ("hidden", "nobias", "out")


def tiny_problem(seed=0, n=6, d_in=5, classes=3):
  """Params of TinyMLP and one batch (x, integer labels)."""
  keys = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(keys[0], (n, d_in))
  y = jax.random.randint(keys[1], (n,), 0, classes)
  params = TinyMLP().init(keys[2], x)["params"]
  return params, (x, y)


def forward(params, x):
  """Layer inputs a_l, pre-activations s_l, and per-example Jacobians df/ds_l."""
  p = jax.tree.map(lambda v: np.asarray(v, np.float64), params)
  a1 = np.asarray(x, np.float64)
  s1 = a1 @ p["hidden"]["kernel"] + p["hidden"]["bias"]
  a2 = np.tanh(s1)
  s2 = a2 @ p["nobias"]["kernel"]
  a3 = np.tanh(s2)
  f = a3 @ p["out"]["kernel"] + p["out"]["bias"]
  n, c = f.shape
  # J_l[n] = d f_n / d s_l,n, shape (C, d_l); written out by the chain rule.
  j_out = np.broadcast_to(np.eye(c), (n, c, c))
  # f_c = Σ_i tanh(s2_i) W3[i, c] + b3_c  =>  df_c/ds2_i = W3[i, c] (1 - a3_i²)
  j_nobias = np.einsum("ic,ni->nci", p["out"]["kernel"], 1 - a3 ** 2)
  # s2_i = Σ_k tanh(s1_k) W2[k, i]  =>  df_c/ds1_k = Σ_i J2[c, i] W2[k, i] (1 - a2_k²)
  j_hidden = np.einsum("nci,ki,nk->nck", j_nobias, p["nobias"]["kernel"], 1 - a2 ** 2)
  inputs = {"hidden": (a1, True), "nobias": (a2, False), "out": (a3, True)}
  jacobians = {"hidden": j_hidden, "nobias": j_nobias, "out": j_out}
  return f, inputs, jacobians


def softmax(f):
  e = np.exp(f - f.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def factors(params, batch, estimation):
  """{layer: (A, G)} for one batch: A = mean ā āᵀ, G = (1/N) Σ_n J_nᵀ M_n J_n.

  M_n is (p - e_y)(p - e_y)ᵀ for "empirical" and diag(p) - p pᵀ for "exact".
  """
  x, y = batch
  f, inputs, jacobians = forward(params, x)
  p = softmax(f)
  n, c = f.shape
  if estimation == "empirical":
    r = p - np.eye(c)[np.asarray(y)]
    m = np.einsum("ni,nj->nij", r, r)
  else:
    m = np.einsum("ni,ij->nij", p, np.eye(c)) - np.einsum("ni,nj->nij", p, p)
  out = {}
  for name in LAYERS:
    a, bias = inputs[name]
    a_bar = np.concatenate([a, np.ones((n, 1))], 1) if bias else a
    j = jacobians[name]
    out[name] = (a_bar.T @ a_bar / n,
                 np.einsum("nci,ncd,ndj->ij", j, m, j) / n)
  return out


def pi_damping(a, g, damping):
  pi = np.sqrt((np.trace(a) / len(a)) / (np.trace(g) / len(g)))
  return pi * np.sqrt(damping), np.sqrt(damping) / pi


def kronecker_precondition(a, g, kernel_grad, bias_grad, damping):
  """Solves (A_d ⊗ G_d) vec(U) = vec(V) with an explicit Kronecker product."""
  v = np.asarray(kernel_grad, np.float64)
  if bias_grad is not None:
    v = np.concatenate([v, np.asarray(bias_grad, np.float64)[None]])
  da, dg = pi_damping(a, g, damping)
  big = np.kron(a + da * np.eye(len(a)), g + dg * np.eye(len(g)))
  # Row-major vec: vec(A V G) = (A ⊗ G) vec(V) for symmetric G.
  u = np.linalg.solve(big, v.reshape(-1)).reshape(v.shape)
  if bias_grad is None:
    return {"kernel": u}
  return {"kernel": u[:-1], "bias": u[-1]}


def combined_kronecker(uses):
  """Σ_i diag(d_i) ⊗ F_i ≈ diag(a) ⊗ g keeping the trace (a tied embedding).

  Each use i of a table E (vocab x features) has the Fisher block
  diag(d_i) ⊗ F_i; with t_i = mean(d_i) · tr(F_i)/dim(F_i) and T = Σ t_i,
  a = Σ t_i d_i / mean(d_i) and g = Σ (t_i / T) F_i / (tr(F_i)/dim(F_i)).
  """
  t = [d.mean() * np.trace(f) / len(f) for d, f in uses]
  a = sum(w * d / d.mean() for w, (d, _) in zip(t, uses))
  g = sum(w / sum(t) * f / (np.trace(f) / len(f)) for w, (_, f) in zip(t, uses))
  np.testing.assert_allclose(np.trace(np.kron(np.diag(a), g)),
                             sum(np.trace(np.kron(np.diag(d), f)) for d, f in uses))
  return a, g


def precondition(all_factors, grads, damping):
  return {name: kronecker_precondition(
      *all_factors[name], grads[name]["kernel"], grads[name].get("bias"), damping)
          for name in LAYERS}


def relative_error(actual, expected):
  actual = np.concatenate([np.ravel(np.asarray(v, np.float64))
                           for v in jax.tree.leaves(actual)])
  expected = np.concatenate([np.ravel(v) for v in jax.tree.leaves(expected)])
  return np.linalg.norm(actual - expected) / np.linalg.norm(expected)
