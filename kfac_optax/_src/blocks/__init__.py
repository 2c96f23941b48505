"""Curvature blocks: one module per block family, under one contract.

- `contract`: what a block does (`LayerBlock`, `FallbackBlock`).
- `kronecker`: dense, dense-general, einsum and conv layers, ``A ⊗ G``
  (`conv_gram`: a convolution's patch Gram from a third of the products).
- `tiled`: a Kronecker block with its factors cut into diagonal tiles.
- `series`: a dense layer shared over time steps, modelled as a series.
- `embedding`: an embedding table, tied uses merged in.
- `diagonal`: the fallback for params no layer block owns, and norm layers.
- `lifted`: stacks of layers and time axes made by lifted transforms.
- `select`: `block_for`, a captured layer's block from its layout.

The names below are what the rest of the library uses.
"""

from kfac_optax._src.blocks.contract import FallbackBlock
from kfac_optax._src.blocks.contract import LayerBlock
from kfac_optax._src.blocks.diagonal import DiagonalBlock
from kfac_optax._src.blocks.diagonal import NormBlock
from kfac_optax._src.blocks.embedding import EmbeddingBlock
from kfac_optax._src.blocks.kronecker import KRONECKER_STRUCTURES
from kfac_optax._src.blocks.kronecker import KroneckerBlock
from kfac_optax._src.blocks.kronecker import KroneckerFactors
from kfac_optax._src.blocks.lifted import BatchMajor
from kfac_optax._src.blocks.lifted import StackedBlock
from kfac_optax._src.blocks.select import block_for
from kfac_optax._src.blocks.series import SERIES_OPTIONS
from kfac_optax._src.blocks.series import SeriesBlock
from kfac_optax._src.blocks.tiled import TiledKroneckerBlock
from kfac_optax._src.blocks.tiled import tiling
