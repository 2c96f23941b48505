"""Test session set-up: 8 simulated CPU devices for the sharding tests.

Must run before JAX initialises its backend; unsharded computations still
run on device 0 alone.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)
