"""The benchmarks' quick modes run every contender; their machinery is right.

kfac-jax is optional (CI installs only ``.[test]``): without it the kfac-jax
contenders are left out, the benchmark says why, and the test that compares
the two K-FACs step by step is skipped with that reason.
"""

import json
import math
import time
import warnings

import jax
import jax.numpy as jnp
import flax
import numpy as np
import optax
import pytest

import kfac_optax
from benchmarks import autoencoder
from benchmarks import convnet
from benchmarks import harness
from benchmarks import resnet
from benchmarks import transformer_lm

KFAC_JAX, WHY_NO_KFAC_JAX = harness.import_kfac_jax()


WORKLOADS = [autoencoder, convnet, transformer_lm, resnet]


@pytest.mark.parametrize("module", WORKLOADS,
                         ids=[m.__name__.split(".")[-1] for m in WORKLOADS])
def test_quick_mode_runs_every_contender_and_writes_reports(module, tmp_path):
  markdown = tmp_path / "RESULTS.md"
  argv = ["--quick", "--out-dir", str(tmp_path), "--markdown", str(markdown)]
  if KFAC_JAX is None:
    warnings.warn(f"kfac-jax contenders not run: {WHY_NO_KFAC_JAX}")
    argv += ["--kfac-jax", "skip"]
  results = module.main(argv)

  quick = harness.parse_args(["--quick"], module.DEFAULTS, "")
  expected = {"kfac_optax", harness.RECIPE_NAME, f"adam lr={quick.adam_lrs[0]:g}",
              f"muon lr={quick.muon_lrs[0]:g}",
              f"schedule-free-adamw lr={quick.schedule_free_lrs[0]:g}"}
  if module.DEFAULTS.get("tuned"):
    expected.add("kfac_optax (tuned)")
  if module.DEFAULTS.get("adaptive"):
    expected.add("kfac_optax (adaptive)")
  runs_kfac_jax = KFAC_JAX is not None and not module.workload(True).kfac_jax_unsupported
  if runs_kfac_jax:
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
  assert len(results["goals"]) == sum(
      len(kfacs if goal.contenders is None else set(goal.contenders) & set(kfacs))
      for goal in module.GOALS)

  saved = json.loads((tmp_path / f"{module.__name__.split('.')[-1]}.json").read_text())
  assert set(saved["rows"]) == expected
  assert (tmp_path / f"{saved['name']}.png").stat().st_size > 10_000
  text = markdown.read_text()
  assert f"<!-- {saved['name']}:begin" in text
  assert all(f"| {name} |" in text for name in expected)


def test_markdown_section_is_replaced_in_place(tmp_path):
  path = tmp_path / "RESULTS.md"
  path.write_text("# Benchmark results\n\nintro\n")
  harness.update_markdown(str(path), "other", "kept")
  for body in ("first", "second"):
    harness.update_markdown(str(path), "mine", body)
  text = path.read_text()
  assert "second" in text and "first" not in text and "kept" in text
  assert text.count("<!-- mine:begin") == 1


class _Sleeper:
  """A contender whose steps take ``seconds`` each and whose loss is its step."""

  def __init__(self, name, family, seconds, losses=None, max_steps=None):
    self.name, self.family, self.settings = name, family, {}
    self.seconds, self.losses, self.max_steps = seconds, losses, max_steps

  def start(self, params):
    return jnp.zeros([])

  def step(self, state, batch, rng, i):
    time.sleep(self.seconds)
    return state, jnp.asarray(self.losses[i] if self.losses else float(i))


class _NoBatches:
  def __call__(self, i):
    return None, None


def test_wall_clock_race_stops_each_contender_at_its_budget():
  budget = 0.2
  fast = _Sleeper("fast", "adam", 0.01)
  slow = _Sleeper("slow", "kfac_optax", 0.05)
  capped = _Sleeper("capped", "kfac_optax", 0.01, max_steps=3)
  record = harness.race([fast, slow, capped], None, _NoBatches(), None,
                        budget_s=budget)
  for name in ("fast", "slow"):
    step_s = record[name]["step_s"]
    assert sum(step_s[:-1]) < budget <= sum(step_s), name
  assert len(record["fast"]["step_s"]) > 2 * len(record["slow"]["step_s"])
  assert len(record["capped"]["step_s"]) == 3
  with pytest.raises(ValueError, match="steps or budget_s"):
    harness.race([fast], None, _NoBatches(), None)


def test_budget_target_is_the_best_peers_final_loss_and_its_own_time():
  """B<s>s: the lowest final loss of any peer, smoothed over BUDGET_WINDOW
  steps; ratios of seconds to it (to that peer's), on curves smoothed the
  same way."""
  def record(losses, seconds):
    return dict(loss=list(losses), step_s=[seconds] * len(losses))
  window = harness.BUDGET_WINDOW
  # Ends lowest, with a last dip that a 10-step window would take as its loss.
  muon_a = [5.0] * 40 + [1.0] * (window - 10) + [0.5] * 10
  adam_b = [3.0] * 100
  kfac = [4.0, 2.0, 1.0] + [0.5] * 80
  contenders = [_Sleeper("muon a", "muon", 0), _Sleeper("adam b", "adam", 0),
                _Sleeper("kfac", "kfac_optax", 0)]
  for contender, rate in zip(contenders, (0.1, 0.1)):
    contender.settings = dict(learning_rate=rate)
  records = [{"muon a": record(muon_a, 1.0), "adam b": record(adam_b, 1.0),
              "kfac": record(kfac, 2.0)}]
  rows, summary = harness.summarize(contenders, records, {}, [2], 2, budget_s=20.0)
  budget_target = summary["targets"][-1]
  assert budget_target["label"] == "B20s" and budget_target["source"] == "muon a"
  assert budget_target["loss"] == pytest.approx(0.9)  # np.mean(muon_a[-window:])
  reach = lambda losses, seconds: harness.first_reach(
      harness.trailing_mean(losses, window), [seconds] * len(losses),
      budget_target["loss"])
  muon_steps, muon_seconds = reach(muon_a, 1.0)
  kfac_steps, kfac_seconds = reach(kfac, 2.0)
  assert muon_steps == len(muon_a)  # its smoothed curve touches 0.9 only at the end
  assert budget_target["source_seconds"] == muon_seconds == muon_steps * 1.0
  assert rows["kfac"]["to_target"][-1] == dict(steps=kfac_steps, seconds=kfac_seconds)
  assert kfac_steps < len(kfac)
  assert rows["kfac"]["budget_target_time_vs_peer"] == pytest.approx(
      kfac_seconds / muon_seconds)
  assert rows["adam b"]["budget_target_time_vs_peer"] is None  # never reached
  # T2 was set by adam b (3.0 against muon a's 5.0), which reached it at its
  # first step (1 s) and kfac at its second (4 s): kfac's worst ratio.
  assert summary["targets"][0]["source"] == "adam b"
  assert rows["kfac"]["target_time_vs_peer"]["T2"] == pytest.approx(4.0)
  assert rows["kfac"]["worst_target_time_vs_peer"] == pytest.approx(4.0)
  assert kfac_seconds / muon_seconds < 4.0
  assert rows["adam b"]["worst_target_time_vs_peer"] is None
  # A grid of one rate is at its own edge: the table flags it.
  assert summary["best_of"]["muon"] == dict(
      name="muon a", loss=pytest.approx(0.9), at_grid_edge=True)


def test_muon_gets_each_kernel_as_its_input_by_output_matrix():
  """Dense (in, out), convolution (window, in, out) and attention
  (in, heads, head_dim) / (heads, head_dim, out) kernels: the reduction axes
  multiply to the layer's fan-in; embeddings, biases and scales go to Adam."""
  class Tiny(flax.linen.Module):
    @flax.linen.compact
    def __call__(self, ids):
      x = flax.linen.Embed(11, 8)(ids)
      x = flax.linen.MultiHeadDotProductAttention(2, name="attention")(x)
      x = flax.linen.LayerNorm()(x)
      x = flax.linen.Conv(6, (3,), use_bias=False)(x)
      x = flax.linen.Conv(5, (2, 2))(x[..., None])
      return flax.linen.Dense(3)(x)

  params = jax.eval_shape(Tiny().init, jax.random.key(0),
                          jnp.zeros((2, 4), jnp.int32))["params"]
  by_path = lambda tree: {"/".join(k.key for k in path): leaf for path, leaf in
                          jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: (
                              x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)))[0]}
  shapes = {name: leaf.shape for name, leaf in by_path(params).items()}
  dims = by_path(harness.muon_dimension_numbers(params))
  axes = lambda a: a if isinstance(a, tuple) else (a,)
  fan_in = {}
  for name, spec in dims.items():
    if spec is not None:
      reduction, output = axes(spec.reduction_axis), axes(spec.output_axis)
      assert sorted(reduction + output) == list(range(len(shapes[name]))), name
      fan_in[name] = math.prod(shapes[name][a] for a in reduction)
  assert fan_in == {"attention/query/kernel": 8, "attention/key/kernel": 8,
                    "attention/value/kernel": 8, "attention/out/kernel": 8,
                    "Conv_0/kernel": 3 * 8, "Conv_1/kernel": 2 * 2 * 1,
                    "Dense_0/kernel": 5}
  assert dims["Embed_0/embedding"] is None and dims["Dense_0/bias"] is None
  assert dims["LayerNorm_0/scale"] is None


def test_targets_use_the_smoothed_loss_and_summed_step_times():
  smoothed = harness.trailing_mean([10.0, 8.0, 6.0, 4.0], window=2)
  np.testing.assert_allclose(smoothed, [10.0, 9.0, 7.0, 5.0])
  assert harness.first_reach(smoothed, [1.0, 2.0, 3.0, 4.0], 7.0) == (3, 6.0)
  assert harness.first_reach(smoothed, [1.0] * 4, 1.0) == (None, None)
  # A run that blew up stays far above any target, however long it lasts.
  blown_up = harness.trailing_mean([1.0] * 5 + [2e32] * 600 + [1e17] * 20, window=10)
  np.testing.assert_allclose(blown_up[[4, 9, -16, -1]], [1.0, 1e32, 1e32 + 5e16, 1e17])


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
