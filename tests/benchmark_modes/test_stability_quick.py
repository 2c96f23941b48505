"""The stability suite's quick mode: ten steps of its K-FAC configurations.

A smoke test of the suite's machinery and of the K-FAC configurations; the
full suite's verdict is in benchmarks/STABILITY.md. The quick run trains two
of the nine models (compilation is most of its time); six others train
with K-FAC in other tests (self_attention and cnn_bn_dropout in
test_adaptive, the LSTM in test_lstm_example, the transformer LM,
autoencoder and BatchNorm ResNet in the benchmarks' quick modes), the ViT
only in the full suite (its head's unread call: test_reach), and every
model is built here.
"""

import json
import math

import jax
import numpy as np
import pytest

from benchmarks import harness
from benchmarks import stability
from benchmarks import stability_problems

QUICK_ADAM = f"adam lr={stability.QUICK_ADAM_LR:g}"
QUICK_MODELS = ("mlp", "gpt_lm")
# The recipe's configuration is the benchmarks' recipe contender, which their
# quick modes train.
QUICK_CONFIGS = ("kfac_default", "kfac_auto")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  """The quick run's results and its output folder (run once, ~1 min)."""
  out = tmp_path_factory.mktemp("stability")
  results = stability.main(["--quick", "--models", ",".join(QUICK_MODELS),
                            "--configs", ",".join([*QUICK_CONFIGS, "adam"]),
                            "--out-dir", str(out),
                            "--markdown", str(out / "STABILITY.md")])
  return results, out


@pytest.mark.parametrize("name", sorted(stability_problems.PROBLEMS))
def test_every_model_builds_with_a_finite_initial_loss(name):
  problem = stability_problems.make_problem(name, quick=True)
  batch = problem.batch(np.arange(problem.batch_size))
  loss, _ = problem.loss_fn(problem.params, problem.variables, batch,
                            jax.random.key(0))
  assert math.isfinite(float(loss)), name


def test_results_hold_every_model_and_contender(quick_run):
  results, out = quick_run
  assert set(results["models"]) == set(QUICK_MODELS)
  for model, result in results["models"].items():
    assert not result["failed"], model
    assert set(result["rows"]) == {*QUICK_CONFIGS, QUICK_ADAM}, model
    assert result["best_adam"] == QUICK_ADAM
    for name, row in result["rows"].items():
      assert 0 < row["steps"] <= stability.QUICK_STEPS, (model, name)
      assert row["mean_ms"] > 0 and row["compile_s"] > 0, (model, name)
      assert row["diverged"] == (row["first_nonfinite_step"] is not None)
    for name in QUICK_CONFIGS:
      stats = result["rows"][name]["stats"]
      assert set(stats) == set(stability.TRACKED_STATS), (model, name)
      assert 0 < stats["requested_damping"]["min"] <= stats["requested_damping"]["max"], (
          model, name)

  saved = json.loads((out / "stability.json").read_text())
  assert set(saved["models"]) == set(QUICK_MODELS)
  text = (out / "STABILITY.md").read_text()
  assert "`python benchmarks/stability.py --quick" in text
  assert all(f"| {model} | kfac_auto |" in text for model in QUICK_MODELS)


def test_kfac_losses_are_finite(quick_run):
  results, _ = quick_run
  for model, result in results["models"].items():
    assert list(result["per_seed"]) == [0]  # the quick run's one seed
    for name in QUICK_CONFIGS:
      row = result["per_seed"][0]["rows"][name]
      assert row["steps"] == stability.QUICK_STEPS, (model, name)
      assert np.all(np.isfinite(row["losses"])), (model, name, row["losses"])
      assert math.isfinite(row["final_loss"]), (model, name)


def _run(final_loss, steps_to_adam, diverged_at=None, family="kfac_optax"):
  """A contender's row of one seed's `stability.run_model` entry."""
  return dict(family=family, settings={}, steps=diverged_at or 300,
              final_loss=final_loss, diverged=diverged_at is not None,
              first_nonfinite_step=diverged_at, mean_ms=2.0, compile_s=1.0,
              steps_to_adam=steps_to_adam, seconds_to_adam=steps_to_adam,
              vs_adam=final_loss / 2.0,
              **({"stats": {k: dict(min=0.1, max=0.2)
                            for k in stability.TRACKED_STATS}}
                 if family == "kfac_optax" else {}))


def test_seeds_are_summarised_by_medians_with_a_diverged_run_the_worst():
  entries = {seed: dict(description="d", batch_size=8, num_examples=64,
                        num_params=10, best_adam="adam", failed={},
                        rows={"kfac": kfac, "adam": _run(2.0, 250, family="adam")})
             for seed, kfac in enumerate([_run(1.0, 100), _run(math.nan, None, 40),
                                          _run(3.0, None)])}
  entries[2]["failed"] = {"other": "error"}
  summary = stability.over_seeds(entries)
  row = summary["rows"]["kfac"]
  assert row["final_loss"] == 3.0  # 1, 3 and the diverged run's inf
  assert row["steps_to_adam"] is None  # reached in one seed of three
  assert row["diverged"] and row["diverged_at"] == {1: 40}
  assert row["first_nonfinite_step"] == 40 and row["steps"] == 40
  assert row["vs_adam"] == 1.5
  assert summary["rows"]["adam"]["steps_to_adam"] == 250
  assert summary["failed"] == {"other": "error"} and summary["best_adam"] == "adam"
  assert summary["per_seed"] is entries


# kfac-jax's automatic mode as an optional contender (skipped without kfac-jax).

KFAC_JAX, WHY_NO_KFAC_JAX = harness.import_kfac_jax()
needs_kfac_jax = pytest.mark.skipif(
    KFAC_JAX is None, reason=f"kfac-jax not available: {WHY_NO_KFAC_JAX}")


@pytest.fixture(scope="module")
def kfac_jax_run(tmp_path_factory):
  """The comparison's quick run on a model kfac-jax runs and one it cannot."""
  out = tmp_path_factory.mktemp("stability_kfac_jax")
  results = stability.main(["--quick", "--models", "mlp,self_attention",
                            "--configs", ",".join(stability.COMPARISON),
                            "--out-dir", str(out),
                            "--markdown", str(out / "STABILITY.md")])
  return results, out


@needs_kfac_jax
def test_kfac_jax_contender_races_or_records_its_error(kfac_jax_run):
  results, out = kfac_jax_run
  row = results["models"]["mlp"]["per_seed"][0]["rows"][stability.KFAC_JAX]
  assert row["family"] == "kfac_jax" and row["steps"] == stability.QUICK_STEPS
  assert np.all(np.isfinite(row["losses"])), row["losses"]
  # kfac-jax 0.0.8 cannot match nn.SelfAttention's per-head Dense layers.
  attention = results["models"]["self_attention"]
  assert "Incompatible shapes" in attention["failed"][stability.KFAC_JAX]
  assert {"kfac_auto", QUICK_ADAM} <= set(attention["rows"])

  assert (out / "stability_kfac_jax.json").is_file()
  text = (out / "STABILITY.md").read_text()
  assert "## Against kfac-jax's automatic mode" in text
  assert "| mlp | kfac_jax_auto |" in text and "- **self_attention:** `" in text


@needs_kfac_jax
@pytest.mark.parametrize("model", ["gpt_lm", "autoencoder"])
def test_kfac_jax_sees_the_trained_loss(model):
  """kfac-jax's exact GGN of the registered loss equals J^T H J of
  `loss.value` (brute force): the weight 1/T of a per-position loss."""
  problem = stability_problems.make_problem(model, quick=True)
  batch, rng = problem.example_batch, jax.random.key(0)
  curvature = KFAC_JAX.ImplicitExactCurvature(problem.kfac_jax_loss(KFAC_JAX))
  vector = jax.tree.map(lambda x: jax.random.normal(jax.random.key(1), x.shape),
                        problem.params)
  theirs = jax.jit(curvature.multiply_ggn)(
      (problem.params, problem.variables, rng, batch), vector)

  @jax.jit
  def brute_force(params, vector):
    def outputs(params):
      return problem.outputs(params, problem.variables, batch, rng)[0]
    value, tangent = jax.jvp(outputs, (params,), (vector,))
    loss_grad = jax.grad(lambda o: problem.loss.value(o, batch))
    hessian_tangent = jax.jvp(loss_grad, (value,), (tangent,))[1]
    return jax.vjp(outputs, params)[1](hessian_tangent)[0]
  brute = brute_force(problem.params, vector)
  theirs, brute = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
                   for t in (theirs, brute))
  assert np.linalg.norm(theirs - brute) <= 1e-4 * np.linalg.norm(brute)
