"""An orbax checkpoint of a K-FAC TrainState restores in a fresh process and
training continues bit-identically to an uninterrupted run.

Run as a script (``python -m tests.optimizer.test_checkpoint MODE DIR``), one process
per mode: ``save`` trains K steps, saves, trains M more and records the
result; ``resume`` restores the checkpoint in a fresh process, trains M
steps and records its result.
"""

import os
import subprocess
import sys

import jax
import numpy as np

K, M = 3, 3


def _train(mode: str, directory: str) -> None:
  import orbax.checkpoint as ocp

  import kfac_optax
  from tests import brute_force as bf

  params, batch = bf.tiny_problem()
  model, loss = bf.TinyMLP(), kfac_optax.losses.softmax_cross_entropy()
  tx = kfac_optax.kfac(model.apply, loss, example_batch=batch, learning_rate=0.1,
                       momentum=0.9, damping=lambda count: 1e-2 / (1 + count),
                       inverse_update_period=2)

  @jax.jit
  def step(state, seed):
    batch = bf.tiny_problem(seed=1)[1]
    grads = jax.grad(lambda p: loss.value(model.apply({"params": p}, batch[0]),
                                          batch))(state.params)
    return state.apply_gradients(grads=grads, batch=batch,
                                 rng=jax.random.fold_in(jax.random.key(0), seed))

  # The restore target comes from the same tx: it fixes the tree structure,
  # the NamedTuple types and every leaf's shape and dtype.
  state = kfac_optax.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  checkpoint = os.path.join(directory, "checkpoint")
  checkpointer = ocp.StandardCheckpointer()
  if mode == "save":
    for seed in range(K):
      state = step(state, seed)
    checkpointer.save(checkpoint, state)
    checkpointer.wait_until_finished()
  else:
    state = checkpointer.restore(checkpoint, state)
  for seed in range(K, K + M):
    state = step(state, seed)
  np.savez(os.path.join(directory, f"{mode}.npz"),
           *[np.asarray(leaf) for leaf in jax.tree.leaves(state)])


def test_restored_checkpoint_continues_bit_identically(tmp_path):
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [root, os.environ.get("PYTHONPATH", "")])}
  for mode in ("save", "resume"):
    subprocess.run([sys.executable, "-m", "tests.optimizer.test_checkpoint", mode, str(tmp_path)],
                   cwd=root, env=env, check=True, timeout=300)
  uninterrupted = np.load(tmp_path / "save.npz")
  resumed = np.load(tmp_path / "resume.npz")
  assert len(uninterrupted.files) == len(resumed.files) > 20
  for name in uninterrupted.files:
    np.testing.assert_array_equal(resumed[name], uninterrupted[name])


if __name__ == "__main__":
  _train(*sys.argv[1:])
