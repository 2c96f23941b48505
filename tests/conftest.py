"""Test session set-up: 8 simulated CPU devices for the sharding tests.

Must run before JAX initialises its backend; unsharded computations still
run on device 0 alone.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

# jaxlib's CPU eigh/Cholesky call SciPy's OpenBLAS; with its default threads,
# LAPACK calls running at once in one XLA program can stall on 2 cores. One
# BLAS thread for the whole session (XLA's own matmuls do not use OpenBLAS).
from examples.transformer_lm import single_threaded_lapack  # noqa: E402

single_threaded_lapack().__enter__()  # kept for the whole session
