"""The curvature of one model: its options, plan, state, statistics, products.

- `options`: `CurvatureOptions`, the options shared with the optimizers.
- `model_call`: how K-FAC calls the model (``inputs=``, ``outputs=``,
  ``apply_kwargs``, `model_rngs`).
- `plan`: which block owns which params, found by tracing the model once,
  with the checks of what it finds.
- `state`: `ScaleByKFACState`.
- `curvature`: `Curvature`: ``init``, ``update`` and the products.
- `summary`: what `describe` shows, and ``init``'s warnings.
- `canonical_convolutions`: the capture pass's convolutions in XLA:CPU's
  fast layout.
- `explicit_axes`: the update under Explicit mesh axes, K-FAC's math on
  Auto axes and the model's passes on the user's Explicit ones.

Curvature knows nothing of which Flax API the model is written in (that is
`models`) nor of how blocks invert their factors (`blocks`, `linalg`).
"""
