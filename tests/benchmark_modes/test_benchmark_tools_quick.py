"""Quick modes of the benchmark tools that are not workloads: the recipe
sweep, the sub-batch race, forward sharing, the step profile, the compile
time, the statistics step, the automatic mode's trace and cost (a file of their
own, so that the suite's workers share the benchmarks' compile time)."""

import math

import pytest

from benchmarks import harness
from benchmarks.studies import automatic_cost
from benchmarks.studies import automatic_trace
from benchmarks.studies import compile_time
from benchmarks.studies import curvature_batch
from benchmarks.studies import forward_sharing
from benchmarks.studies import recipe_sweep
from benchmarks.studies import statistics_step
from benchmarks.studies import step_profile
from kfac_optax._src.curvature import canonical_convolutions
from kfac_optax._src.curvature import curvature


def test_recipe_sweep_estimates_each_candidates_time_to_the_budget_target(
    monkeypatch):
  """Steps to the workload's targets, and the estimated time ratio: steps to
  B120s × the candidate's mean step / the best peer's seconds to B120s."""
  targets = [dict(label="T50", loss=1e9, window=harness.WINDOW),
             dict(label="B120s", loss=1e9, source_seconds=2.0, source="muon",
                  window=harness.BUDGET_WINDOW)]
  monkeypatch.setattr(recipe_sweep, "reference_run",
                      lambda name, race: (targets, 50.0, "2026-01-01"))
  configs = "learning_rate=0.03,damping=0.01;learning_rate=0.003,norm_constraint=None"
  result = recipe_sweep.main(["--quick", "--workload", "convnet",
                              "--configs", configs])
  rows = result["rows"]
  assert list(rows) == ["lr=0.03 damping=0.01", "lr=0.003 clip=None"]
  for row in rows.values():
    assert row["steps"] == recipe_sweep.QUICK_STEPS
    assert row["settings"]["stats_update_period"] == harness.RECIPE["stats_update_period"]
    assert row["to_target"] == [1, 1]  # every loss is below 1e9
    assert row["estimated_budget_time_vs_peer"] == pytest.approx(
        row["mean_ms"] / 1e3 / 2.0)
  assert "| lr=0.003 clip=None |" in recipe_sweep.markdown(result)


def test_recipe_sweep_without_the_workloads_race_names_the_command_that_writes_it(
    monkeypatch, tmp_path):
  monkeypatch.setattr(harness, "RESULTS_DIR", str(tmp_path))
  path = tmp_path / f"convnet_large{harness.backend_suffix()}.json"
  with pytest.raises(FileNotFoundError) as error:
    recipe_sweep.main(["--quick", "--workload", "convnet", "--large"])
  assert str(error.value) == (
      f"no {path}: the sweep's targets come from a full race of the workload on "
      "this backend; run python benchmarks/convnet.py --large first")
  # --reference names the run whose targets to read instead.
  with pytest.raises(FileNotFoundError) as error:
    recipe_sweep.main(["--quick", "--workload", "convnet", "--large",
                       "--reference", "convnet_large_tpu"])
  assert str(error.value).startswith(f"no {tmp_path / 'convnet_large_tpu.json'}:")


def test_curvature_batch_quick_mode_races_every_sub_batch():
  rows = curvature_batch.main(["--quick"])["rows"]
  sizes = [row["settings"].get("curvature_batch_size") for row in rows.values()]
  assert sizes[:3] == [4 * sizes[2], 2 * sizes[2], sizes[2]] and sizes[3] is None
  assert all(row["steps"] == 3 for row in rows.values())


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


def test_statistics_step_quick_mode_times_each_variant_by_step_kind():
  original = canonical_convolutions.canonical_convolutions
  rows = statistics_step.main(["--quick"])["rows"]
  assert list(rows) == [name for name, _, _ in statistics_step.QUICK_VARIANTS]
  plain, every_step, *under_cond = rows.values()
  assert plain["with_statistics_ms"] is None and plain["without_statistics_ms"] > 0
  assert every_step["without_statistics_ms"] is None
  for row in under_cond:  # steps 1-3: statistics at step 2 only
    assert row["with_statistics_ms"] > 0 and row["without_statistics_ms"] > 0
    assert row["statistics_cost_ms"] == pytest.approx(
        row["with_statistics_ms"] - plain["without_statistics_ms"])
  # The quick run's patched variant ("convolutions as traced") was undone.
  assert canonical_convolutions.canonical_convolutions is original


def test_compile_time_quick_mode_times_adam_and_the_recipe():
  (rows,) = compile_time.main(["--quick", "--workloads", "autoencoder"]).values()
  assert list(rows) == ["adam lr=0.001", harness.RECIPE_NAME]
  assert rows["adam lr=0.001"]["compile_vs_adam"] == 1.0
  recipe = rows[harness.RECIPE_NAME]
  assert recipe["compile_vs_adam"] == recipe["compile_s"] / rows["adam lr=0.001"]["compile_s"]
  assert recipe["stablehlo_lines"] > rows["adam lr=0.001"]["stablehlo_lines"] > 0


def test_compile_time_parts_drop_each_scheduled_branch():
  scheduled = curvature.on_schedule
  (rows,) = compile_time.main(["--quick", "--parts", "--workloads", "autoencoder"]).values()
  assert curvature.on_schedule is scheduled
  lines = {label.removeprefix(harness.RECIPE_NAME).strip(): row["stablehlo_lines"]
           for label, row in rows.items() if label.startswith(harness.RECIPE_NAME)}
  assert lines[""] > lines["without the refresh"] > lines["without both"]
  assert lines[""] > lines["without the statistics"] > lines["without both"]


def test_automatic_trace_quick_mode_reads_the_controls_from_the_state():
  rows = automatic_trace.main(["--quick"])
  assert [row[0] for row in rows] == [0, 1, 2]
  assert all(math.isfinite(loss) and damping > 0 for _, loss, _, damping in rows)


def test_automatic_cost_quick_mode_times_each_contender():
  (medians,) = automatic_cost.main(["--quick"]).values()
  assert list(medians) == list(automatic_cost.contenders(1))
  assert all(math.isfinite(m) and m > 0 for m in medians.values())
