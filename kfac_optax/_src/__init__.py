"""kfac_optax's internals: importable, but they may change without notice.

The public surface is `kfac_optax` itself (its ``__all__``) and its modules
`kfac_optax.losses`, `kfac_optax.layouts` and `kfac_optax.sharding`.
docs/design.md maps these modules:

- `optimizer`: the optax transformations (`scale_by_kfac`, `kfac`).
- `curvature`: the curvature of one model (`Curvature`, its options, plan
  and state).
- `models`: the linen and NNX front-ends and the layer registry.
- `blocks`: the curvature blocks, one module per family.
- `linalg`: damped factor inverses.
- `losses`, `layouts`, `sharding`, `train_state`, `checks`, `tree_paths`,
  `param_boxes`: one module each.
"""
