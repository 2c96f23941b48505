"""PSGD Kron and Shampoo join a race where they run, and say why where not.

Their packages are not in ``.[test]``: in CI they are missing, which the
race must report; the tests that train with them run where ``.[bench]`` is
installed.
"""

import argparse
import subprocess

import jax
import numpy as np
import optax
import pytest

from benchmarks import autoencoder
from benchmarks import harness
from benchmarks import optional_peers


def test_compat_aliases_give_back_the_names_current_jax_removed():
  optional_peers._add_compat_aliases()  # pylint: disable=protected-access
  assert jax.sharding.PartitionSpec[str, str] is jax.sharding.PartitionSpec
  tree = {"a": 1.0, "b": (2.0,)}
  assert jax.tree_map(lambda x: 2 * x, tree) == {"a": 2.0, "b": (4.0,)}
  assert jax.tree_leaves(tree) == [1.0, 2.0]


def test_a_missing_package_is_named_with_the_import_error(monkeypatch):
  def missing():
    raise ImportError("No module named 'distributed_kron'")
  monkeypatch.setitem(optional_peers._PACKAGES, "psgd_kron",  # pylint: disable=protected-access
                      ("distributed-kron==2.0.0", missing))
  assert optional_peers.load("psgd_kron") == (
      None, "distributed-kron==2.0.0 is not installed or fails to import "
      "(No module named 'distributed_kron')")


def test_a_probe_that_fails_reports_the_childs_error_line():
  assert optional_peers.probe("no_such_workload", "shampoo", 1e-3) == (
      "failed on this workload: ModuleNotFoundError: No module named "
      "'benchmarks.no_such_workload'")


def test_a_probe_that_outlives_its_limit_names_the_command(monkeypatch):
  def too_slow(command, **kwargs):
    raise subprocess.TimeoutExpired(command, kwargs["timeout"])
  monkeypatch.setattr(optional_peers.subprocess, "run", too_slow)
  assert optional_peers.probe("autoencoder", "psgd_kron", 3e-4, timeout_s=5) == (
      f"its first 3 steps did not finish in 5 s on {jax.default_backend()} "
      "(`-m benchmarks.optional_peer_probe autoencoder psgd_kron 0.0003`)")


def test_a_probe_killed_by_a_signal_names_it(monkeypatch):
  monkeypatch.setattr(optional_peers.subprocess, "run", lambda command, **kwargs:
                      subprocess.CompletedProcess(command, -9, "", ""))
  assert optional_peers.probe("resnet", "psgd_kron", 1e-3) == (
      "its child process was killed by SIGKILL (on Linux, SIGKILL is the "
      "out-of-memory killer's)")


def test_the_race_adds_each_rate_of_a_family_that_runs_and_the_reason_of_one_that_does_not(
    monkeypatch):
  monkeypatch.setattr(optional_peers, "load", lambda family: (
      (optax.sgd, None) if family == "shampoo" else (None, "not installed")))
  monkeypatch.setattr(optional_peers, "probe", lambda *args: None)
  workload = autoencoder.workload(True)
  args = argparse.Namespace(psgd_kron_lrs=[1e-4], shampoo_lrs=[1e-3, 1e-2],
                            large=False)
  contenders, unavailable = harness.optional_contenders(
      workload, args, harness.train_step(workload))
  assert [(c.name, c.family) for c in contenders] == [
      ("shampoo lr=0.001", "shampoo"), ("shampoo lr=0.01", "shampoo")]
  assert unavailable == {"psgd_kron": "not installed"}


def test_default_rates_follow_the_workloads_adam_rate_and_quick_runs_none():
  full = harness.parse_args([], autoencoder.DEFAULTS, "")
  assert full.psgd_kron_lrs == [full.muon_adam_lr / 3]
  assert full.shampoo_lrs == [full.muon_adam_lr]
  quick = harness.parse_args(["--quick"], autoencoder.DEFAULTS, "")
  assert quick.psgd_kron_lrs == quick.shampoo_lrs == []


@pytest.mark.parametrize("family", optional_peers.FAMILIES)
def test_each_family_that_imports_trains_a_small_problem(family):
  make, reason = optional_peers.load(family)
  if reason:
    pytest.skip(reason)
  target = np.linspace(-1.0, 1.0, 12).reshape(3, 4)
  params = {"w": np.zeros((3, 4), np.float32)}
  tx = make(3e-2)
  loss = lambda p: jax.numpy.sum((p["w"] - target) ** 2)
  state = tx.init(params)
  first = loss(params)
  for _ in range(20):
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    params = optax.apply_updates(params, updates)
  assert loss(params) < 0.5 * first
