"""Data-parallel K-FAC on every device of the job, on one host or several.

The global batch is split over a one-axis device mesh ``("data",)`` that
holds every device of every process; parameters and momentum are
replicated, and K-FAC's factors and inverses are spread over the devices,
each owning whole layers. One jitted step computes the gradients and the
K-FAC update; XLA all-reduces the gradients and K-FAC's factor statistics
over the ``data`` axis. The state is donated to the step, so its buffers
are reused in place.

With ``--model-axis N`` the mesh is ``("data", "model")`` with N devices on
"model", and the params (with the momentum) are sharded: each kernel's input
axis over "data" (FSDP), its output axis over "model" (tensor parallel).

Each process loads the same data set, draws the same sequence of global
batches (same seed), and feeds only its own rows of each one: those that the
batch sharding places on its local devices. `jax.make_array_from_process_local_data`
assembles the global array from the pieces. The script is the same for one
process and for several; only the launch differs.

One host (all its devices; ``--cpu-devices 8`` simulates 8 on a CPU)::

  python examples/data_parallel.py --quick
  python examples/data_parallel.py --cpu-devices 8 --quick

Several hosts (here two processes on one machine, 4 simulated CPUs each; on
real hosts give every process the coordinator's address and its own id)::

  python examples/data_parallel.py --coordinator 127.0.0.1:12345 \\
      --num-processes 2 --process-id 0 --cpu-devices 4 --quick &
  python examples/data_parallel.py --coordinator 127.0.0.1:12345 \\
      --num-processes 2 --process-id 1 --cpu-devices 4 --quick
"""

import argparse
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import kfac_optax

try:
  from examples import datasets
  from examples import models
  from examples import side_by_side
except ImportError:  # run as a script: examples/ itself is on sys.path
  import datasets
  import models
  import side_by_side

QUICK_STEPS = 40
QUICK_TRAIN_SIZE = 2048
QUICK_TEST_SIZE = 1024
EVAL_CHUNK = 4096


def add_process_flags(parser):
  """The flags of the devices and processes (`start_jax`); returns their
  argument group."""
  multi = parser.add_argument_group(
      "devices and processes",
      "--coordinator, --num-processes and --process-id start "
      "jax.distributed (all three, or none for one process)")
  multi.add_argument("--coordinator", default=None,
                     help="HOST:PORT of process 0's coordination service")
  multi.add_argument("--num-processes", type=int, default=None)
  multi.add_argument("--process-id", type=int, default=None)
  multi.add_argument("--cpu-devices", type=int, default=None,
                     help="simulate N CPU devices in this process "
                     "(jax_num_cpu_devices)")
  return multi


def check_process_flags(parser, args):
  """A usage error unless the jax.distributed flags come all or none."""
  given = [a is not None for a in
           (args.coordinator, args.num_processes, args.process_id)]
  if any(given) and not all(given):
    parser.error("--coordinator, --num-processes and --process-id go together")


def parse_args(argv=None):
  """Command-line flags; ``argv=None`` reads ``sys.argv``."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  multi = add_process_flags(parser)
  multi.add_argument("--model-axis", type=int, default=1,
                     help="devices on a 'model' mesh axis: with N > 1 the "
                     "params are sharded, FSDP and tensor parallel (needs "
                     "--axis-type auto)")
  multi.add_argument("--axis-type", default="explicit",
                     choices=["explicit", "auto"],
                     help="type of the mesh's data axis (sharding in types, "
                     "or shardings propagated by XLA)")
  parser.add_argument("--dataset", default="auto",
                      choices=["auto", "fashion_mnist", "digits"])
  parser.add_argument("--steps", type=int, default=None,
                      help=f"training steps (default 500, {QUICK_STEPS} "
                      "with --quick)")
  parser.add_argument("--batch-size", type=int, default=256,
                      help="global batch size, a multiple of the number of "
                      "devices")
  datasets.add_subset_flags(parser, QUICK_TRAIN_SIZE, QUICK_TEST_SIZE)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--lr", type=float, default=0.01)
  parser.add_argument("--damping", type=float, default=1e-2)
  parser.add_argument("--momentum", type=float, default=0.9)
  # Cholesky: faster than eigh on CPU (see convnet.py).
  parser.add_argument("--inverse", default="cholesky",
                      choices=["cholesky", "eigh"],
                      help="how K-FAC inverts its damped factors")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                      help="params and activations; K-FAC's statistics and "
                      "inverses stay float32")
  parser.add_argument("--inverse-period", type=int, default=5,
                      help="refresh the factor inverses every N steps")
  parser.add_argument("--log-every", type=int, default=20)
  parser.add_argument("--save-params", default=None, metavar="PATH",
                      help="write the final parameters to PATH (.npz); "
                      "process 0 writes, or every process when PATH "
                      "contains '{process}'")
  parser.add_argument("--quick", action="store_true",
                      help=f"smoke test: {QUICK_STEPS} steps on "
                      f"{QUICK_TRAIN_SIZE} training examples")
  args = parser.parse_args(argv)
  check_process_flags(parser, args)
  if args.model_axis > 1 and args.axis_type != "auto":
    # Under Explicit axes the model's own products of sharded params and a
    # sharded batch would have to name their output shardings.
    parser.error("--model-axis > 1 needs --axis-type auto")
  if args.steps is None:
    args.steps = QUICK_STEPS if args.quick else 500
  if args.quick:
    args.train_size = args.train_size or QUICK_TRAIN_SIZE
    args.test_size = args.test_size or QUICK_TEST_SIZE
  return args


def start_jax(args):
  """Configures devices and joins the job; must run before any JAX work."""
  if args.cpu_devices is not None:
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  if args.coordinator is None:
    return
  # Cross-process collectives on CPU (a no-op for GPU and TPU backends).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=args.coordinator,
                             num_processes=args.num_processes,
                             process_id=args.process_id)


def make_mesh(axis_type, model_axis=1):
  """A mesh over every device of the job: one axis, ``"data"``, or
  ``("data", "model")`` with ``model_axis`` devices on "model"."""
  kind = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[axis_type]
  if model_axis == 1:
    return jax.make_mesh((jax.device_count(),), ("data",), axis_types=(kind,))
  return jax.make_mesh((jax.device_count() // model_axis, model_axis),
                       ("data", "model"), axis_types=(kind,) * 2)


def param_shardings(abstract_params, mesh):
  """Each kernel's input axis over "data" (FSDP) and its output axis (and
  the bias) over "model" (tensor parallel), where they divide; replicated
  on a mesh without a "model" axis."""
  if "model" not in mesh.axis_names:
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), abstract_params)

  def sharding(leaf):
    dims = [None] * leaf.ndim
    if leaf.ndim == 2 and leaf.shape[0] % mesh.shape["data"] == 0:
      dims[0] = "data"
    if leaf.shape[-1] % mesh.shape["model"] == 0:
      dims[-1] = "model"
    return NamedSharding(mesh, P(*dims))
  return jax.tree.map(sharding, abstract_params)


def state_shardings(abstract_state, mesh):
  """Shardings of the train state (params and optimizer state).

  The one place that decides where the state lives: the step's
  ``in_shardings``/``out_shardings`` and the state's creation all use it.
  The Kronecker factors and inverses are split over the devices, each
  owning whole layers; the params and every part of the state shaped like
  them (the momentum) by `param_shardings`; the rest is replicated.
  """
  return kfac_optax.sharding.state_shardings(
      abstract_state, mesh, params=param_shardings(abstract_state.params, mesh))


def local_rows(sharding, global_size):
  """The rows ``[start, stop)`` of a global batch that this process feeds.

  They are the rows `sharding` places on this process's devices (with one
  process: all of them).
  """
  index_map = sharding.addressable_devices_indices_map((global_size,))
  rows = sorted({index[0].indices(global_size)[:2] for index in index_map.values()})
  start, stop = rows[0][0], rows[-1][1]
  if sum(b - a for a, b in rows) != stop - start:
    raise ValueError(f"this process's rows {rows} are not contiguous")
  return start, stop


def global_batch(sharding, arrays, rows):
  """Global arrays sharded by `sharding` from this process's ``rows``.

  Args:
    sharding: the batch sharding (``P("data")`` over the mesh).
    arrays: host arrays with the whole global batch on axis 0; every process
      passes the same ones and only its own rows are read.
    rows: ``(start, stop)`` from `local_rows`.
  """
  start, stop = rows
  return tuple(
      jax.make_array_from_process_local_data(sharding, a[start:stop], a.shape)
      for a in arrays)


def make_train_step(loss, seed, state_sharding, batch_sharding):
  """The jitted, data-parallel ``(state, batch) -> (state, loss)``.

  The random key K-FAC samples targets with is derived from the step count
  inside the program, so it is the same on every device and every process
  without being sent. The state is donated: its buffers are reused for the
  new state, and the state passed in must not be used again.
  """
  replicated = NamedSharding(batch_sharding.mesh, P())

  def step(state, batch):
    def batch_loss(params):
      return loss.value(state.apply_fn({"params": params}, batch[0]), batch)
    value, grads = jax.value_and_grad(batch_loss)(state.params)
    rng = jax.random.fold_in(jax.random.key(seed), state.step)
    return state.apply_gradients(grads=grads, batch=batch, rng=rng), value

  return jax.jit(step, in_shardings=(state_sharding, batch_sharding),
                 out_shardings=(state_sharding, replicated), donate_argnums=0)


def make_evaluate(apply_fn, loss, batch_sharding):
  """``(params, x, y) -> (mean loss, accuracy)``, data-parallel, in chunks.

  Each chunk is padded to a multiple of the number of devices; padded rows
  have weight 0.
  """
  mesh = batch_sharding.mesh
  replicated = NamedSharding(mesh, P())

  def sums(params, x, y, weight):
    logits = apply_fn({"params": params}, x)
    correct = jnp.argmax(logits, axis=-1) == y
    return jnp.sum(weight * loss.nll(logits, y)), jnp.sum(weight * correct)
  sums = jax.jit(sums, out_shardings=(replicated, replicated))

  def evaluate(params, x, y):
    total_loss, correct = 0.0, 0.0
    for start in range(0, len(x), EVAL_CHUNK):
      xc, yc = x[start:start + EVAL_CHUNK], y[start:start + EVAL_CHUNK]
      pad = -len(xc) % mesh.size
      weight = np.concatenate([np.ones(len(xc), np.float32),
                               np.zeros(pad, np.float32)])
      xc = np.concatenate([xc, np.zeros((pad, *xc.shape[1:]), xc.dtype)])
      yc = np.concatenate([yc, np.zeros(pad, yc.dtype)])
      chunk = global_batch(batch_sharding, (xc, yc, weight),
                           local_rows(batch_sharding, len(xc)))
      chunk_loss, chunk_correct = sums(params, *chunk)
      total_loss += float(chunk_loss)
      correct += float(chunk_correct)
    return total_loss / len(x), correct / len(x)
  return evaluate


def host_params(params):
  """The global parameters on every process (gathered where sharded), as a
  flat ``{"Dense_0/kernel": ndarray}`` in float32 (exact for bfloat16
  params; .npz has no bfloat16)."""
  params = multihost_utils.process_allgather(params, tiled=True)
  return {key: np.asarray(value, np.float32) for key, value in
          traverse_util.flatten_dict(params, sep="/").items()}


def save_params(path, params):
  """Writes `host_params` output to ``path`` (``{process}`` is filled in)."""
  if "{process}" not in path and jax.process_index() != 0:
    return
  path = path.format(process=jax.process_index())
  directory = os.path.dirname(path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  np.savez(path, **params)


def log(*args):
  """Prints from process 0 only."""
  if jax.process_index() == 0:
    print(*args, flush=True)


def main(argv=None):
  """Trains the main example's MLP (`models.MLP`) with K-FAC, data-parallel.

  With ``--coordinator`` etc. this joins a `jax.distributed` job first, so it
  must be called before anything else touches JAX's backend.

  Args:
    argv: command-line arguments (default ``sys.argv[1:]``).

  Returns:
    A dict: ``params`` (the final parameters, flat, as numpy), ``losses``
    (mini-batch loss of every step), ``test_loss``, ``test_accuracy``,
    ``devices``, ``processes``, ``seconds`` (training, compilation included).
  """
  args = parse_args(argv)
  start_jax(args)
  mesh = make_mesh(args.axis_type, args.model_axis)
  batch_sharding = NamedSharding(mesh, P("data"))
  if args.batch_size % mesh.size:
    raise ValueError(f"--batch-size {args.batch_size} is not a multiple of "
                     f"the {mesh.size} devices")
  rows = local_rows(batch_sharding, args.batch_size)

  x_train, y_train, x_test, y_test, description = datasets.load_classification(
      args.dataset)
  x_train, y_train = x_train[:args.train_size], y_train[:args.train_size]
  x_test, y_test = x_test[:args.test_size], y_test[:args.test_size]
  num_classes = int(max(y_train.max(), y_test.max())) + 1
  log(f"{description}: {len(x_train)} train / {len(x_test)} test examples; "
      f"{args.steps} steps of global batch {args.batch_size} on "
      f"{mesh.size} devices in {jax.process_count()} process(es), "
      f"{args.batch_size // mesh.size} examples per device")
  print(f"process {jax.process_index()}: {jax.local_device_count()} local "
        f"devices, feeds rows {rows[0]}:{rows[1]} of each global batch",
        flush=True)

  model = models.MLP(num_classes=num_classes, dtype=jnp.dtype(args.dtype))
  loss = kfac_optax.losses.softmax_cross_entropy()
  # K-FAC discovers the layers on an example of a global batch.
  example_batch = (x_train[:args.batch_size], y_train[:args.batch_size])
  tx = kfac_optax.kfac(model.apply, loss, example_batch=example_batch,
                       learning_rate=args.lr, momentum=args.momentum,
                       damping=args.damping, inverse=args.inverse,
                       inverse_update_period=args.inverse_period)

  def create_state():
    params = model.init(jax.random.key(args.seed), x_train[:1])["params"]
    return kfac_optax.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=tx)

  with jax.set_mesh(mesh):
    state_sharding = state_shardings(jax.eval_shape(create_state), mesh)
    # Created directly with its shardings, identically on every process.
    state = jax.jit(create_state, out_shardings=state_sharding)()
    train_step = make_train_step(loss, args.seed, state_sharding,
                                 batch_sharding)
    order = side_by_side.batch_order(len(x_train), args.batch_size,
                                     args.steps, args.seed)
    losses = []
    start = time.perf_counter()
    for i, indices in enumerate(order):
      batch = global_batch(batch_sharding, (x_train[indices], y_train[indices]),
                           rows)
      state, value = train_step(state, batch)
      losses.append(value)
      if i % args.log_every == 0 or i == len(order) - 1:
        log(f"step {i:4d}  loss {float(value):.4f}")
    losses = np.asarray([float(value) for value in losses])
    seconds = time.perf_counter() - start
    test_loss, test_accuracy = make_evaluate(
        model.apply, loss, batch_sharding)(state.params, x_test, y_test)

  log(f"{args.steps} steps in {seconds:.1f}s (compilation included); test "
      f"loss {test_loss:.4f}, accuracy {test_accuracy:.2%}")
  params = host_params(state.params)
  if args.save_params:
    save_params(args.save_params, params)
  return {"params": params, "losses": losses, "test_loss": test_loss,
          "test_accuracy": test_accuracy, "devices": mesh.size,
          "processes": jax.process_count(), "seconds": seconds}


def run_as_script(entry=main):
  """``entry()`` (`main`), then an exit that cannot hang a multi-process job.

  Under `jax.distributed` a worker can hang at interpreter exit, so it shuts
  the client down and leaves with `os._exit`; a failing worker prints its
  traceback and exits at once, so that its peers fail too instead of
  waiting for it in a collective.
  """
  distributed = any(arg.split("=")[0] == "--coordinator" for arg in sys.argv)
  code = 0
  try:
    entry()
  except SystemExit as error:  # argparse: --help, or a usage error
    if not distributed:
      raise
    code = error.code if isinstance(error.code, int) else int(error.code is not None)
  except BaseException:  # noqa: BLE001  also KeyboardInterrupt
    if not distributed:
      raise
    traceback.print_exc()
    code = 1
  if distributed:
    if code == 0:
      jax.distributed.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
  run_as_script()
