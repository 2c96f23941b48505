"""Validation of numeric settings, where they are given.

Each check raises a ``ValueError`` naming the argument, the value and the
valid range. A schedule is checked at count 0. Traced values (a
hyperparameter injected with `optax.inject_hyperparams`, inside `jax.jit`)
cannot be checked here; the curvature treats an invalid traced damping as a
rejected inverse refresh instead (see `curvature.Curvature.update`).
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def zero_count() -> jax.Array:
  """Step 0 as optax's schedules get it."""
  return jnp.zeros([], jnp.int32)


def _concrete(name: str, value: Any) -> tuple[str, Any]:
  """``(how to name it, its value)``; the value is None when traced.

  A schedule is called as optax calls it, with an int32 array count: a
  schedule written for arrays may fail on a Python int (``0 ** -0.5`` of
  an rsqrt part that ``optax.join_schedules`` discards at count 0).
  """
  if callable(value):
    name, value = f"{name} (a schedule, at count 0)", value(zero_count())
    if not isinstance(value, jax.core.Tracer) and np.ndim(value) == 0:
      value = np.asarray(value).item()  # a number in the message
  if isinstance(value, jax.core.Tracer):
    return name, None
  return name, value


def _as_number(value: Any) -> float:
  return float(np.asarray(value))


def in_range(name: str, value: Any, low: float = -math.inf, high: float = math.inf,
             *, low_open: bool = False, high_open: bool = False) -> None:
  """``value`` (a number or a schedule) lies in the interval from low to high.

  Args:
    name: the argument's name, for the message.
    value: a number, a scalar array or a schedule; a traced value passes.
    low, high: the bounds (infinite: unbounded).
    low_open, high_open: whether the bound itself is excluded.
  """
  name, value = _concrete(name, value)
  if value is None:
    return
  number = _as_number(value)
  above = number > low if low_open else number >= low
  below = number < high if high_open else number <= high
  if not (above and below):  # also catches nan
    if high == math.inf:
      valid = f"{'>' if low_open else '>='} {low:g}"
    else:
      valid = (f"in {'(' if low_open else '['}{low:g}, {high:g}"
               f"{')' if high_open else ']'}")
    raise ValueError(f"{name} must be {valid}, got {value!r}")


def positive(name: str, value: Any) -> None:
  """``value > 0`` (a number or a schedule)."""
  in_range(name, value, 0.0, low_open=True)


def count(name: str, value: Any, minimum: int) -> None:
  """``value`` is an integer ``>= minimum``: a Python int or an integer array.

  Integer arrays are what `optax.inject_hyperparams` passes for int settings.
  """
  if isinstance(value, jax.core.Tracer):
    return
  integral = (not isinstance(value, bool) and np.ndim(value) == 0
              and np.issubdtype(np.asarray(value).dtype, np.integer))
  if not integral or int(value) < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def is_positive_int(value: Any) -> bool:
  """Whether ``value`` is a Python int >= 1 (a size the trace is built with)."""
  return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def static_size(name: str, value: Any, none_allowed: bool) -> None:
  """``value`` is a positive Python int (or None where ``none_allowed``): a
  size that shapes the program, so never an injected array."""
  if not (is_positive_int(value) or (value is None and none_allowed)):
    valid = "a positive Python int" + (" or None" if none_allowed else "")
    raise ValueError(f"{name} must be {valid}, got {value!r}; with "
                     "optax.inject_hyperparams, list it in static_args")


def ordered(low_name: str, low: Any, high_name: str, high: Any) -> None:
  """``low <= high`` (when both are concrete)."""
  low_name, low = _concrete(low_name, low)
  high_name, high = _concrete(high_name, high)
  if low is not None and high is not None and not _as_number(low) <= _as_number(high):
    raise ValueError(f"{low_name} must be <= {high_name}, got {low!r} > {high!r}")


def random_key(name: str, value: Any) -> None:
  """``value`` is one jax.random key, typed or raw.

  Accepted: a typed key of shape ``()`` (``jax.random.key(seed)``) and a raw
  uint32 key of the default implementation's shape (``(2,)`` for threefry:
  ``jax.random.PRNGKey(seed)``, or such a numpy array), traced or not.
  Anything else (a Python int seed, a float or int32 array, a stack of keys)
  would fail deep inside a sampling call, or silently reuse one key.
  """
  shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    valid = shape == ()
  else:
    raw = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    valid = dtype == np.uint32 and tuple(shape) == raw.shape
  if not valid:
    got = (f"an array of shape {tuple(shape)} and dtype {dtype}" if dtype is not None
           else f"{type(value).__name__} {value!r}")
    raise TypeError(
        f"{name} must be one jax.random key, jax.random.key(seed) (or a raw "
        f"jax.random.PRNGKey(seed)), got {got}.\nFix: pass a fresh key each "
        f"step, e.g. {name}=jax.random.fold_in(jax.random.key(0), step).")
