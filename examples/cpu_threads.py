"""CPU thread settings for K-FAC's LAPACK calls (the examples, benchmarks and
tests all run K-FAC under `single_threaded_lapack`)."""

import contextlib


def single_threaded_lapack():
  """A context that runs OpenBLAS (jaxlib's CPU LAPACK) on one thread.

  K-FAC inverts its factors with LAPACK (``eigh``), which jaxlib takes from
  SciPy's OpenBLAS. With its default threading on a small, busy CPU machine a
  257 x 257 ``eigh`` took about 120 ms instead of 5 ms single-threaded, and
  the inverse refreshes dominated K-FAC's time. XLA's own matmuls do not use
  OpenBLAS, so Adam is unaffected. A no-op without ``threadpoolctl`` (a
  scikit-learn dependency).
  """
  try:
    import scipy.linalg  # pylint: disable=g-import-not-at-top,unused-import
    import threadpoolctl  # pylint: disable=g-import-not-at-top
  except ImportError:
    return contextlib.nullcontext()
  # scipy.linalg loads SciPy's OpenBLAS, so the limit reaches it.
  return threadpoolctl.threadpool_limits(1, user_api="blas")
