"""Model front-ends and the layer registry.

- `capture`: the contract every front-end keeps (K-FAC's collections, what
  discovery finds, one forward pass and one vjp).
- `linen_capture`: linen models, through a method interceptor.
- `nnx_capture`: NNX models, through a hooked copy of the module.
- `front_end`: which of the two runs a given model.
- `kinds`: how each kind of flax layer maps to a layout (`layouts`).
- `registry`: which module classes are captured as which kind
  (`register_layer`).

Nothing here knows about curvature blocks or inverses.
"""
