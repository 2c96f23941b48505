"""The convnet example: a KFC block per convolution, and K-FAC beating Adam.

The training test runs the example itself (`examples.convnet.main`) on a
small slice of real data: Fashion-MNIST when the Debian package is installed,
scikit-learn's 8x8 digits otherwise. Both optimizers start from the same
parameters and see the same batches; CPU runs are deterministic.
"""

import math

from flax import nnx
import jax
import jax.numpy as jnp
import pytest

import kfac_optax
from examples import convnet
from examples import datasets
from examples import models

DATASET = "fashion_mnist" if datasets.fashion_mnist_available() else "digits"
STEPS, BATCH, TRAIN_SIZE, TEST_SIZE = 40, 64, 1024, 256
# Adam's best learning rate of {1e-3, 3e-3, 1e-2, 3e-2, 1e-1} in exactly this
# setting (loss on the slice after STEPS steps; K-FAC with the example's
# defaults: Fashion-MNIST 0.287, digits 0.058):
#   Fashion-MNIST: 0.740 / 0.566 / 0.426 / 0.612 / -
#   digits:        1.664 / 0.744 / 0.293 / 0.216 / 2.304
ADAM_LR = {"fashion_mnist": 1e-2, "digits": 3e-2}


def _model_and_params(api, x):
  """(the model as K-FAC takes it, its params as shapes, its layer paths)."""
  if api == "linen":
    model = models.ConvNet()
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    return model.apply, params, ("Conv_0", "Conv_1", "Dense_0")
  model = nnx.eval_shape(lambda: models.NnxConvNet(*x.shape[1:3],
                                                   rngs=nnx.Rngs(0)))
  return model, nnx.state(model, nnx.Param), ("convs/0", "convs/1", "dense")


@pytest.mark.parametrize("api", ["linen", "nnx"])
@pytest.mark.parametrize("side", [28, 8])
def test_every_conv_and_dense_layer_gets_a_kronecker_block(side, api):
  x = jnp.zeros((4, side, side, 1))
  batch = (x, jnp.zeros((4,), jnp.int32))
  model, params, (conv0, conv1, dense) = _model_and_params(api, x)
  tx = kfac_optax.scale_by_kfac(
      model, kfac_optax.losses.softmax_cross_entropy(), example_batch=batch)
  state = jax.eval_shape(tx.init, params)  # shapes only: nothing runs
  flat = (side // 4) ** 2 * 16  # two stride-2 SAME pools, 16 channels
  shapes = {k: (f.a.shape, f.g.shape) for k, f in state.factors.items()}
  assert shapes == {conv0: ((1, 26, 26), (1, 16, 16)),
                    conv1: ((1, 401, 401), (1, 16, 16)),
                    dense: ((1, flat + 1, flat + 1), (1, 10, 10))}


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_kfac_beats_adam_on_training_loss_at_equal_steps(api, tmp_path):
  plot = tmp_path / "convnet.png"
  metrics = convnet.main([
      "--dataset", DATASET, "--api", api, "--steps", str(STEPS),
      "--batch-size", str(BATCH), "--train-size", str(TRAIN_SIZE),
      "--test-size", str(TEST_SIZE), "--adam-lr", str(ADAM_LR[DATASET]),
      "--plot", str(plot)])
  assert plot.is_file() and plot.stat().st_size > 0
  for name, values in metrics.items():
    for key, value in values.items():
      assert math.isfinite(value), (name, key, value)
  kfac, adam = metrics["kfac"]["train_loss"], metrics["adam"]["train_loss"]
  assert kfac < adam, f"K-FAC {kfac:.4f} vs Adam {adam:.4f} after {STEPS} steps"
