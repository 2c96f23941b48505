"""Layer layouts: how a layer's arrays map onto a Kronecker block.

A layout function given to `kfac_optax.register_layer` returns one of these
for a layer call: `DenseLayout` (e.g. ``dense(d_in, d_out,
kernel_name="w", kernel_order="out_in")``), `EinsumLayout` or `ConvLayout`.
"""

from kfac_optax._src.layouts import KERNEL_ORDERS
from kfac_optax._src.layouts import ConvLayout
from kfac_optax._src.layouts import DenseLayout
from kfac_optax._src.layouts import EinsumLayout
from kfac_optax._src.layouts import EmbeddingLayout
from kfac_optax._src.layouts import NormLayout
from kfac_optax._src.layouts import dense

__all__ = [
    "KERNEL_ORDERS",
    "ConvLayout",
    "DenseLayout",
    "EinsumLayout",
    "EmbeddingLayout",
    "NormLayout",
    "dense",
]
