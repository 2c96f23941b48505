"""The convnet example: a KFC block per convolution, and K-FAC beating Adam.

The training test runs the example itself (`examples.convnet.main`) on a
small slice of real data: Fashion-MNIST when the Debian package is installed,
scikit-learn's 8x8 digits otherwise. Both optimizers start from the same
parameters and see the same batches; CPU runs are deterministic.
"""

import math

import jax
import jax.numpy as jnp
import pytest

import kfac_optax
from examples import convnet
from examples import datasets

DATASET = "fashion_mnist" if datasets.fashion_mnist_available() else "digits"
STEPS, BATCH, TRAIN_SIZE, TEST_SIZE = 40, 64, 1024, 256
# Adam's best learning rate of {1e-3, 3e-3, 1e-2, 3e-2, 1e-1} in exactly this
# setting (loss on the slice after STEPS steps; K-FAC with the example's
# defaults: Fashion-MNIST 0.287, digits 0.058):
#   Fashion-MNIST: 0.740 / 0.566 / 0.426 / 0.612 / -
#   digits:        1.664 / 0.744 / 0.293 / 0.216 / 2.304
ADAM_LR = {"fashion_mnist": 1e-2, "digits": 3e-2}


@pytest.mark.parametrize("side", [28, 8])
def test_every_conv_and_dense_layer_gets_a_kronecker_block(side):
  model = convnet.ConvNet()
  x = jnp.zeros((4, side, side, 1))
  batch = (x, jnp.zeros((4,), jnp.int32))
  params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
  tx = kfac_optax.scale_by_kfac(
      model.apply, kfac_optax.losses.softmax_cross_entropy(),
      example_batch=batch)
  state = jax.eval_shape(tx.init, params)  # shapes only: nothing runs
  assert set(state.factors) == {"Conv_0", "Conv_1", "Dense_0"}
  flat = (side // 4) ** 2 * 16  # two stride-2 SAME pools, 16 channels
  shapes = {k: (f.a.shape, f.g.shape) for k, f in state.factors.items()}
  assert shapes == {"Conv_0": ((1, 26, 26), (1, 16, 16)),
                    "Conv_1": ((1, 401, 401), (1, 16, 16)),
                    "Dense_0": ((1, flat + 1, flat + 1), (1, 10, 10))}


def test_kfac_beats_adam_on_training_loss_at_equal_steps(tmp_path):
  plot = tmp_path / "convnet.png"
  metrics = convnet.main([
      "--dataset", DATASET, "--steps", str(STEPS),
      "--batch-size", str(BATCH), "--train-size", str(TRAIN_SIZE),
      "--test-size", str(TEST_SIZE), "--adam-lr", str(ADAM_LR[DATASET]),
      "--plot", str(plot)])
  assert plot.is_file() and plot.stat().st_size > 0
  for name, values in metrics.items():
    for key, value in values.items():
      assert math.isfinite(value), (name, key, value)
  kfac, adam = metrics["kfac"]["train_loss"], metrics["adam"]["train_loss"]
  assert kfac < adam, f"K-FAC {kfac:.4f} vs Adam {adam:.4f} after {STEPS} steps"
