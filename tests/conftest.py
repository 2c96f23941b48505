"""Test session set-up: 8 simulated CPU devices for the sharding tests, a
quickly compiling CPU backend, and a layer registry restored after every test.

The devices and XLA's flags must be set before JAX initialises its backend;
unsharded computations still run on device 0 alone.
"""

import contextlib
import os

# The tests check numbers and machinery, not speed, and most of their time
# is XLA compiling small programs. LLVM at optimisation level 0 compiles
# them in about half the time (the suite on 2 cores: 12:10 -> 8:11); the HLO
# programs are unchanged, only their machine code is less optimised. A
# level the caller set is kept; subprocesses (multi-host tests) inherit it.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# jaxlib's CPU eigh/Cholesky call SciPy's OpenBLAS; with its default threads,
# LAPACK calls running at once in one XLA program can stall on 2 cores. One
# BLAS thread for the whole session (XLA's own matmuls do not use OpenBLAS).
from examples.transformer_lm import single_threaded_lapack  # noqa: E402

single_threaded_lapack().__enter__()  # kept for the whole session


@contextlib.contextmanager
def restored_layer_registry():
  """Undoes the `register_layer` calls made inside: they are global, and the
  examples' ``main`` makes them too."""
  from kfac_optax import layers  # pylint: disable=import-outside-toplevel
  saved = dict(layers._REGISTRY)  # pylint: disable=protected-access
  try:
    yield
  finally:
    layers._REGISTRY.clear()  # pylint: disable=protected-access
    layers._REGISTRY.update(saved)  # pylint: disable=protected-access


@pytest.fixture(autouse=True)
def _fresh_layer_registry():
  with restored_layer_registry():
    yield
