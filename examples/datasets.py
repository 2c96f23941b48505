"""The examples' data sets, all local (nothing is ever downloaded).

Images: `load_classification` prefers Fashion-MNIST as installed by the
Debian package ``dataset-fashion-mnist`` (idx files under
``/usr/share/datasets/fashion-mnist/``) and falls back to the 8x8 digits that
ship inside scikit-learn; `as_images` gives them back their square shape.

Text: `load_text` is the Python standard library's own documentation, the
help topics of ``pydoc_data.topics`` (the text behind ``help("assert")``
etc., the language reference in plain text), joined in sorted topic order.
It ships with every CPython; on CPython 3.11 it is about 465 K characters
over about 100 distinct characters (the exact text, and so the numbers,
differ slightly between Python versions). The character language models
read it through `Vocabulary`, `split_text` (the last 10% held out for
validation) and `windows`.
"""

import gzip
import math
import os

import numpy as np

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
_FASHION_MNIST_FILES = {
    "x_train": "train-images-idx3-ubyte.gz",
    "y_train": "train-labels-idx1-ubyte.gz",
    "x_test": "t10k-images-idx3-ubyte.gz",
    "y_test": "t10k-labels-idx1-ubyte.gz",
}
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4",
               0x0D: ">f4", 0x0E: ">f8"}
VALIDATION_FRACTION = 0.1


def read_idx(path):
  """Reads a (possibly gzipped) idx file into a numpy array.

  The idx header is two zero bytes, a type code, the number of dimensions
  ``n`` and then ``n`` big-endian uint32 sizes; the data follow row-major.

  Args:
    path: file name; read through gzip when it ends in ``.gz``.

  Returns:
    The array, with the shape and dtype the header gives.
  """
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    raw = f.read()
  if raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
    raise ValueError(f"{path} is not an idx file (header {raw[:4]!r})")
  ndim = raw[3]
  shape = tuple(int(s) for s in np.frombuffer(raw, ">u4", ndim, offset=4))
  dtype = np.dtype(_IDX_DTYPES[raw[2]])
  data = np.frombuffer(raw, dtype, int(np.prod(shape)), offset=4 + 4 * ndim)
  return data.reshape(shape)


def fashion_mnist_available(directory=FASHION_MNIST_DIR):
  """True when all four Fashion-MNIST idx files are in ``directory``."""
  return all(os.path.isfile(os.path.join(directory, name))
             for name in _FASHION_MNIST_FILES.values())


def load_fashion_mnist(directory=FASHION_MNIST_DIR):
  """Fashion-MNIST: 60000 train and 10000 test 28x28 images, 10 classes.

  Returns:
    ``(x_train, y_train, x_test, y_test)``: float32 images in [0, 1]
    flattened to ``(N, 784)`` and int32 labels.
  """
  arrays = {key: read_idx(os.path.join(directory, name))
            for key, name in _FASHION_MNIST_FILES.items()}
  def images(x):
    return (x.reshape(len(x), -1) / 255.0).astype(np.float32)
  return (images(arrays["x_train"]), arrays["y_train"].astype(np.int32),
          images(arrays["x_test"]), arrays["y_test"].astype(np.int32))


def load_digits(test_fraction=0.2):
  """scikit-learn's bundled 8x8 digits, the last ``test_fraction`` as test.

  Returns:
    ``(x_train, y_train, x_test, y_test)``: float32 pixels in [0, 1]
    (raw values are 0..16) as ``(N, 64)`` and int32 labels.
  """
  from sklearn.datasets import load_digits as sklearn_digits  # bundled data
  digits = sklearn_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  split = len(x) - int(round(test_fraction * len(x)))
  return x[:split], y[:split], x[split:], y[split:]


def load_classification(name="auto"):
  """Loads a classification data set from local files only.

  Args:
    name: ``"fashion_mnist"``, ``"digits"`` or ``"auto"`` (Fashion-MNIST when
      the Debian package ``dataset-fashion-mnist`` is installed, digits
      otherwise).

  Returns:
    ``(x_train, y_train, x_test, y_test, description)``: float32 features in
    [0, 1] of shape ``(N, features)``, int32 labels and a human-readable name
    of the data set.
  """
  if name == "auto":
    name = "fashion_mnist" if fashion_mnist_available() else "digits"
  if name == "fashion_mnist":
    if not fashion_mnist_available():
      raise FileNotFoundError(
          f"Fashion-MNIST not found in {FASHION_MNIST_DIR}; install the "
          "Debian package dataset-fashion-mnist or use name='digits'")
    return (*load_fashion_mnist(), "Fashion-MNIST (28x28, 10 classes)")
  if name == "digits":
    return (*load_digits(), "scikit-learn digits (8x8, 10 classes)")
  raise ValueError(
      f"unknown data set {name!r}; use 'auto', 'fashion_mnist' or 'digits'")


def add_subset_flags(parser, quick_train_size, quick_test_size):
  """``--train-size``/``--test-size``: train and evaluate on leading slices."""
  parser.add_argument("--train-size", type=int, default=None,
                      help="use only the first N training examples "
                      f"(default all; {quick_train_size} with --quick)")
  parser.add_argument("--test-size", type=int, default=None,
                      help="use only the first N test examples "
                      f"(default all; {quick_test_size} with --quick)")


def as_images(x):
  """Flattened square grey-scale images ``(N, s*s)`` -> ``(N, s, s, 1)``."""
  side = math.isqrt(x.shape[1])
  if side * side != x.shape[1]:
    raise ValueError(f"{x.shape[1]} features are not a square image")
  return x.reshape(len(x), side, side, 1)


# -- the character text ------------------------------------------------------


def load_text():
  """The stdlib's pydoc help topics as one string, and a description of it."""
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top
  text = "\n".join(topics.topics[name] for name in sorted(topics.topics))
  return text, "CPython's pydoc_data.topics (language reference help text)"


class Vocabulary:
  """Characters <-> integer ids, ids in sorted character order."""

  def __init__(self, text):
    self.chars = sorted(set(text))
    self._ids = {c: i for i, c in enumerate(self.chars)}

  def __len__(self):
    return len(self.chars)

  def encode(self, text):
    return np.fromiter((self._ids[c] for c in text), np.int32, len(text))

  def decode(self, ids):
    return "".join(self.chars[i] for i in ids)


def split_text(ids, validation_fraction=VALIDATION_FRACTION):
  """(train ids, validation ids): the validation part is the end of the text."""
  cut = int(round(len(ids) * (1.0 - validation_fraction)))
  return ids[:cut], ids[cut:]


def windows(ids, starts, length):
  """Inputs and next-character targets, both ``(len(starts), length)``."""
  index = np.asarray(starts)[:, None] + np.arange(length + 1)
  chunk = ids[index]
  return chunk[:, :-1], chunk[:, 1:]


def evaluation_starts(num_ids, length, max_windows=None):
  """Starts of non-overlapping windows that tile ``num_ids`` characters;
  ``max_windows`` keeps that many, evenly spread over the text."""
  starts = np.arange(0, num_ids - length, length)
  if max_windows is not None and len(starts) > max_windows:
    keep = np.linspace(0, len(starts) - 1, max_windows).round().astype(int)
    starts = starts[keep]
  return starts
