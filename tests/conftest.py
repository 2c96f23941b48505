"""Test session set-up: 8 simulated CPU devices for the sharding tests.

Must run before JAX initialises its backend; unsharded computations still
run on device 0 alone.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

# jaxlib's CPU eigh/Cholesky call SciPy's OpenBLAS; with its default threads,
# LAPACK calls running at once in one XLA program can stall on 2 cores. One
# BLAS thread for the whole session (XLA's own matmuls do not use OpenBLAS).
import scipy.linalg  # noqa: E402,F401  loads the OpenBLAS that jaxlib calls
import threadpoolctl  # noqa: E402

_BLAS_LIMIT = threadpoolctl.threadpool_limits(1, user_api="blas")
