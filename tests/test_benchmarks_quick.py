"""The benchmarks' quick modes run every contender; their machinery is right.

kfac-jax is optional (CI installs only ``.[test]``): without it the kfac-jax
contenders are left out, the benchmark says why, and the test that compares
the two K-FACs step by step is skipped with that reason.
"""

import json
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_optax
from benchmarks import autoencoder
from benchmarks import convnet
from benchmarks import forward_sharing
from benchmarks import harness
from benchmarks import step_profile

KFAC_JAX, WHY_NO_KFAC_JAX = harness.import_kfac_jax()


@pytest.mark.parametrize("module", [autoencoder, convnet], ids=["autoencoder", "convnet"])
def test_quick_mode_runs_every_contender_and_writes_reports(module, tmp_path):
  markdown = tmp_path / "RESULTS.md"
  argv = ["--quick", "--out-dir", str(tmp_path), "--markdown", str(markdown)]
  if KFAC_JAX is None:
    warnings.warn(f"kfac-jax contenders not run: {WHY_NO_KFAC_JAX}")
    argv += ["--kfac-jax", "skip"]
  results = module.main(argv)

  expected = {"kfac_optax", "kfac_optax (tuned)",
              *(f"adam lr={lr:g}" for lr in module.DEFAULTS["adam_lrs"])}
  if module.DEFAULTS.get("adaptive"):
    expected.add("kfac_optax (adaptive)")
  if KFAC_JAX is not None:
    expected |= {harness.KFAC_JAX_MATCHED, "kfac-jax (adaptive)"}
  else:
    assert results["kfac_jax_unavailable"]
  assert not results["failed"]
  rows = results["rows"]
  assert set(rows) == expected
  for name, row in rows.items():
    assert row["steps"] == module.DEFAULTS["quick_steps"], name
    assert all(math.isfinite(v) for v in row["losses"]), name
    assert all(t > 0 for t in row["step_s"]), name
    assert row["median_ms"] > 0 and row["compile_s"] > 0, name
  assert rows["kfac_optax"]["mean_vs_adam"] > 0
  kfacs = [name for name in expected if name.startswith("kfac_optax")]
  assert len(results["goals"]) == len(module.GOALS) * len(kfacs)

  saved = json.loads((tmp_path / f"{module.__name__.split('.')[-1]}.json").read_text())
  assert set(saved["rows"]) == expected
  assert (tmp_path / f"{saved['name']}.png").stat().st_size > 10_000
  text = markdown.read_text()
  assert f"<!-- {saved['name']}:begin" in text
  assert all(f"| {name} |" in text for name in expected)


def test_forward_pass_is_shared_only_without_a_statistics_cond():
  (result,) = forward_sharing.main(["--quick"]).values()
  shared = result["stats_update_period=1"]
  assert shared["shared"]
  step = shared["counts"]["training step"]
  assert step["forward"] == shared["counts"]["user gradient"]["forward"] > 0
  assert not result["stats_update_period=2"]["shared"]


def test_step_profile_quick_mode_times_every_part():
  (result,) = step_profile.main(["--quick"]).values()
  assert len(result["median_ms"]) == 5
  assert all(v > 0 for v in result["median_ms"].values())
  assert set(result["op_ms_per_step"]) == set(step_profile.PARTS)
  assert sum(result["op_ms_per_step"].values()) > 0


def test_markdown_section_is_replaced_in_place(tmp_path):
  path = tmp_path / "RESULTS.md"
  path.write_text("# Benchmark results\n\nintro\n")
  harness.update_markdown(str(path), "other", "kept")
  for body in ("first", "second"):
    harness.update_markdown(str(path), "mine", body)
  text = path.read_text()
  assert "second" in text and "first" not in text and "kept" in text
  assert text.count("<!-- mine:begin") == 1


def test_targets_use_the_smoothed_loss_and_summed_step_times():
  smoothed = harness.trailing_mean([10.0, 8.0, 6.0, 4.0], window=2)
  np.testing.assert_allclose(smoothed, [10.0, 9.0, 7.0, 5.0])
  assert harness.first_reach(smoothed, [1.0, 2.0, 3.0, 4.0], 7.0) == (3, 6.0)
  assert harness.first_reach(smoothed, [1.0] * 4, 1.0) == (None, None)


def test_kfac_jax_matched_settings_take_the_same_steps():
  """With the exact Fisher (no sampling) both K-FACs take the same steps.

  Checks that "matched" settings match: damping split, EMA, inverse
  schedule, momentum and learning-rate conventions.
  """
  if KFAC_JAX is None:
    pytest.skip(f"kfac-jax not available: {WHY_NO_KFAC_JAX}")
  data = np.random.default_rng(0).random((4 * 16, 20)).astype(np.float32)
  workload = harness.Workload(
      name="tiny", title="tiny", description="", data=data, batch_size=16,
      model=autoencoder.Autoencoder(hidden=(12, 6), code=3),
      loss=kfac_optax.losses.sigmoid_cross_entropy(targets=lambda b: b),
      inputs=lambda b: b,
      register_kfac_jax_loss=lambda kj, logits, b: (
          kj.register_sigmoid_cross_entropy_loss(logits, b)))
  params = workload.model.init(jax.random.key(0), data[:16])["params"]
  fixed = dict(learning_rate=0.05, momentum=0.9, damping=0.5)
  ours = harness.optax_contender(
      "ours", "kfac_optax", harness.kfac_optax_tx(
          workload, data[:16], estimation="exact", inverse_update_period=2,
          inverse="cholesky", norm_constraint=None,  # kfac-jax: no KL clipping
          **fixed), {}, workload, harness.train_step(workload))
  theirs = harness.kfac_jax_contender(
      "theirs", KFAC_JAX, harness.kfac_jax_loss(workload, KFAC_JAX), data[:16],
      0, settings={},
      optimizer_kwargs=dict(curvature_ema=0.95, inverse_update_period=2,
                            estimation_mode="fisher_exact"),
      step_kwargs=fixed)
  state_ours, state_theirs = ours.start(params), theirs.start(params)
  with harness.single_threaded_lapack():
    for i in range(4):
      batch, rng = jnp.asarray(data[16 * i:16 * (i + 1)]), jax.random.key(i)
      state_ours, loss_ours = ours.step(state_ours, batch, rng, i)
      state_theirs, loss_theirs = theirs.step(state_theirs, batch, rng, i)
      np.testing.assert_allclose(float(loss_ours), float(loss_theirs), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(state_ours.params), jax.tree.leaves(state_theirs[0])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)
  moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(state_ours.params), jax.tree.leaves(params)))
  assert moved > 1e-2  # the updates were not negligible
