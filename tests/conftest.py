"""Test session set-up: 8 simulated CPU devices for the sharding tests, a
quickly compiling CPU backend, and a layer registry restored after every test.

The devices and XLA's flags must be set before JAX initialises its backend;
unsharded computations still run on device 0 alone.
"""

import contextlib
import os
import subprocess
import sys

# The tests check numbers and machinery, not speed, and most of their time
# is XLA compiling small programs. Two settings of XLA:CPU's code generation
# compile them faster; the programs compute the same, only their machine
# code is made differently (and a scatter, which the older emitters below do
# not fuse, runs as a loop):
# - LLVM at optimisation level 0 (the suite on 2 cores: 12:10 -> 8:11);
# - fusions by XLA's older element-wise emitters instead of its MLIR fusion
#   emitters (with level 0 already set, 12:05 -> 8:09 on one machine,
#   2026-11-26). Its flag is set only where this jaxlib's XLA
#   knows it: XLA aborts the process on a flag it does not know.
# A setting the caller made is kept. pytest-xdist's workers and the multi-host
# tests' processes inherit the environment, so only the first process probes.


def _xla_accepts(flag: str) -> bool:
  probe = subprocess.run(
      [sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
      env={**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"},
      capture_output=True, check=False)
  return probe.returncode == 0


def _with_fast_compilation(flags: str) -> str:
  if "xla_backend_optimization_level" not in flags:
    flags += " --xla_backend_optimization_level=0"
  emitters = "--xla_cpu_use_fusion_emitters=false"
  if "xla_cpu_use_fusion_emitters" not in flags and _xla_accepts(emitters):
    flags += " " + emitters
  return flags.strip()


os.environ["XLA_FLAGS"] = _with_fast_compilation(os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# jaxlib's CPU eigh/Cholesky call SciPy's OpenBLAS; with its default threads,
# LAPACK calls running at once in one XLA program can stall on 2 cores. One
# BLAS thread for the whole session (XLA's own matmuls do not use OpenBLAS).
from examples.cpu_threads import single_threaded_lapack  # noqa: E402

single_threaded_lapack().__enter__()  # kept for the whole session


@contextlib.contextmanager
def restored_layer_registry():
  """Undoes the `register_layer` calls made inside: they are global, and the
  examples' ``main`` makes them too."""
  from kfac_optax._src.models import registry  # pylint: disable=import-outside-toplevel
  saved = dict(registry._REGISTRY)  # pylint: disable=protected-access
  try:
    yield
  finally:
    registry._REGISTRY.clear()  # pylint: disable=protected-access
    registry._REGISTRY.update(saved)  # pylint: disable=protected-access


@pytest.fixture(autouse=True)
def _fresh_layer_registry():
  with restored_layer_registry():
    yield
