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


# -- series blocks (recurrent layers, Martens, Ba & Johnson 2018) ------------


def series_statistics(x, g, mask=None, bias=True):
  """A0, A1, G0, G1 by explicit loops over examples and steps.

  ``x``: (N, T, d) inputs, ``g``: (N, T, k) output gradients, ``mask``:
  (N, T) 0/1 or weights, or None. R counts the unmasked rows, L the unmasked
  loss terms (one per example and step here), both by weight; a lag pair
  weighs √(w w') (0 unless both steps are unmasked).
  """
  x, g = np.asarray(x, np.float64), np.asarray(g, np.float64)
  n, t = x.shape[:2]
  w = np.ones((n, t)) if mask is None else np.asarray(mask, np.float64)
  a = np.concatenate([x, np.ones((n, t, 1))], 2) if bias else x
  a0, a1 = np.zeros((a.shape[2],) * 2), np.zeros((a.shape[2],) * 2)
  g0, g1 = np.zeros((g.shape[2],) * 2), np.zeros((g.shape[2],) * 2)
  for i in range(n):
    for s in range(t):
      a0 += w[i, s] * np.outer(a[i, s], a[i, s])
      g0 += w[i, s] * np.outer(g[i, s], g[i, s])
      if s + 1 < t:
        pair = np.sqrt(w[i, s + 1] * w[i, s])
        a1 += pair * np.outer(a[i, s + 1], a[i, s])
        g1 += pair * np.outer(g[i, s + 1], g[i, s])
  rows = terms = w.sum()
  return a0 / rows, a1 / rows, g0 / terms, g1 / terms


def _inverse_root(c, d):
  w, q = np.linalg.eigh(c)
  return (q / np.sqrt(np.maximum(w, 0) + d)) @ q.T


def _whitened(c0, c1, d):
  root = _inverse_root(c0, d)
  psi, u = np.linalg.eigh(root @ (c1 + c1.T) / 2 @ root)
  return root @ u, psi


def series_option1(stats, v, damping, steps):
  """``L_A [(L_Aᵀ V L_G) ∘ T γ_T(|ψ_A| |ψ_G|)] L_Gᵀ`` from explicit eigh."""
  a0, a1, g0, g1 = stats
  da, dg = pi_damping(a0, g0, damping)
  (la, psi_a), (lg, psi_g) = _whitened(a0, a1, da), _whitened(g0, g1, dg)
  x = np.abs(psi_a)[:, None] * np.abs(psi_g)[None, :]
  gamma = (1 - x) ** 2 / (steps * (1 - x ** 2) - 2 * x * (1 - x ** steps))
  return la @ ((la.T @ v @ lg) * steps * gamma) @ lg.T


def series_option1_fisher(stats, damping, steps, absolute=True):
  """``(1/T) Σ_{|d|<T} (T-|d|) (Ã0^{1/2} Ψ̂_A^{|d|} Ã0^{1/2}) ⊗ (G̃0^{1/2} Ψ̂_G^{|d|} G̃0^{1/2})``.

  With ``absolute`` Ψ̂ is replaced by ``U |ψ| Uᵀ`` (the original's choice).
  """
  a0, a1, g0, g1 = stats
  da, dg = pi_damping(a0, g0, damping)

  def parts(c0, c1, d):
    w, q = np.linalg.eigh(c0)
    root = (q * np.sqrt(np.maximum(w, 0) + d)) @ q.T
    inverse_root = np.linalg.inv(root)
    psi, u = np.linalg.eigh(inverse_root @ (c1 + c1.T) / 2 @ inverse_root)
    psi = np.abs(psi) if absolute else psi
    return root, u, psi
  (ra, ua, pa), (rg, ug, pg) = parts(a0, a1, da), parts(g0, g1, dg)
  fisher = 0.0
  for lag in range(-(steps - 1), steps):
    k = abs(lag)
    left = ra @ (ua * pa ** k) @ ua.T @ ra
    right = rg @ (ug * pg ** k) @ ug.T @ rg
    fisher = fisher + (steps - k) * np.kron(left, right)
  return fisher / steps


def series_option2(stats, v, damping):
  """Option 2's steps with ``P``, ``K``, ``μ`` from explicit inv and SVD."""
  a0, a1, g0, g1 = stats
  da, dg = pi_damping(a0, g0, damping)

  def parts(c0, c1, d):
    root = _inverse_root(c0, d)
    _, s, e_t = np.linalg.svd(root @ c1 @ root)
    return c1.T @ np.linalg.inv(c0 + d * np.eye(len(c0))), root @ e_t.T, np.minimum(s ** 2, 1)
  (pa, ka, mua), (pg, kg, mug) = parts(a0, a1, da), parts(g0, g1, dg)
  z = v - pa @ v @ pg.T
  denominator = 1 - mua[:, None] * mug[None, :]
  z = ka.T @ z @ kg / np.where(denominator == 0, 1, denominator)
  z = ka @ z @ kg.T
  return z - pa.T @ z @ pg
