"""The Kronecker-factored peers that race where they run: PSGD Kron and Shampoo.

Issue 40 asks for PSGD Kron and Distributed Shampoo beside the peers that
set the targets (Adam, Muon, Schedule-Free AdamW) wherever they run on
current JAX, and for the exact reason wherever they do not. Neither of
their JAX packages imports unchanged on JAX 0.10 / optax 0.2.8:

- PSGD Kron, ``distributed-kron`` 2.0.0 (PyPI): its annotations subscript
  ``jax.sharding.PartitionSpec`` (``PartitionSpec[str, str]``), which JAX
  0.10's class refuses (``TypeError: type 'P' is not subscriptable``).
  Making the subscript return the class itself lets it import.
- Distributed Shampoo, Google's ``precondition-opt`` 0.3.0 (PyPI, 2023-03:
  the JAX Distributed Shampoo of google-research as a package): it calls
  ``jax.tree_map`` and its siblings, removed in JAX 0.6; aliases to
  ``jax.tree.map`` etc. let it run.

`load` applies those two compatibility aliases (they only add names JAX
removed) and returns each family's ``learning rate -> optax transformation``
or the reason it cannot run. A family that imports can still fail on a
workload, so `probe` runs a few steps of each family in a child process
under a time limit before the race adds it.

Settings, as a user would start: PSGD Kron at its package's defaults
(preconditioner updated with a probability annealed from 1 to 0.03) but
the learning rate and ``partition_grads_into_blocks=False``: with its
default blocks of 256 the first step on the autoencoder, the transformer LM
and the convnet (and of one 784×1000 kernel alone) never finished on 2 CPU
cores, its threads
asleep after compiling (2026-11-28, JAX 0.10.2), while without them the
784×1000 kernel's first step took 2.4 s; Shampoo with blocks of 256, grafted
onto AdaGrad's step (its learning rate on Adam's scale; the package's
RMSProp grafting has no bias correction, so its first steps are
1/√(1-β₂) ≈ 32 times Adam's: the autoencoder's loss went from 550 to 3·10⁴
in 3 steps at 1e-3, against 315 after 20 steps with AdaGrad's), statistics
every step and inverse p-th roots every 10 steps (the default, every step,
costs an eigen-solve per block per step).

  python -m benchmarks.optional_peer_probe autoencoder psgd_kron 3e-4  # one probe
"""

import os
import signal
import subprocess
import sys

import jax
import optax

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("psgd_kron", "shampoo")
PROBE_STEPS = 3


def _add_compat_aliases():
  """The names the two packages use that JAX 0.10 no longer has."""
  spec = jax.sharding.PartitionSpec
  if not hasattr(spec, "__class_getitem__"):
    spec.__class_getitem__ = classmethod(lambda cls, _: cls)
  for name in ("map", "leaves", "flatten", "unflatten", "structure"):
    if not hasattr(jax, f"tree_{name}"):
      setattr(jax, f"tree_{name}", getattr(jax.tree, name))


def _psgd_kron():
  import distributed_kron  # pylint: disable=import-outside-toplevel
  return lambda lr: optax.with_extra_args_support(
      distributed_kron.kron(learning_rate=lr, partition_grads_into_blocks=False))


def _shampoo():
  from precondition import distributed_shampoo  # pylint: disable=import-outside-toplevel
  return lambda lr: optax.with_extra_args_support(
      distributed_shampoo.distributed_shampoo(
          learning_rate=lr, block_size=256,
          graft_type=distributed_shampoo.GraftingType.ADAGRAD,
          statistics_compute_steps=1, preconditioning_compute_steps=10))


_PACKAGES = {"psgd_kron": ("distributed-kron==2.0.0", _psgd_kron),
             "shampoo": ("precondition-opt==0.3.0", _shampoo)}


def load(family):
  """``(learning rate -> optax transformation, None)`` or ``(None, why not)``."""
  package, factory = _PACKAGES[family]
  _add_compat_aliases()
  try:
    return factory(), None
  except ImportError as error:
    return None, f"{package} is not installed or fails to import ({error})"


def probe(workload_module, family, learning_rate, large=False, timeout_s=180.0):
  """None if `PROBE_STEPS` steps of ``family`` train ``workload_module``'s
  workload (a module of benchmarks/) in a child process within
  ``timeout_s``, else why not."""
  command = [sys.executable, "-m", "benchmarks.optional_peer_probe",
             workload_module, family, repr(learning_rate)] + (["--large"] if large else [])
  try:
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT,
                          timeout=timeout_s, check=False)
  except subprocess.TimeoutExpired:
    return (f"its first {PROBE_STEPS} steps did not finish in {timeout_s:.0f} s "
            f"on {jax.default_backend()} (`{' '.join(command[1:])}`)")
  if done.returncode < 0:  # e.g. SIGKILL from the out-of-memory killer
    return (f"its child process was killed by {signal.Signals(-done.returncode).name}"
            " (on Linux, SIGKILL is the out-of-memory killer's)")
  if done.returncode != 0:
    errors = [line for line in done.stderr.splitlines()
              if line and not line[0].isspace() and "Error" in line.split(":")[0]]
    return f"failed on this workload: {(errors or ['no error printed'])[-1]}"
  return None
