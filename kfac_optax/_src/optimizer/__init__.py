"""The optax transformations and what they add to the curvature.

- `scale_by_kfac`: the preconditioner, ``g -> F̂⁻¹ g``.
- `kfac`: the optimizer to drop in (`kfac_step`: its update as named steps,
  and `KFACState`).
- `schedule_free`: `kfac`'s steps under schedule-free averaging.
- `adaptive`: the quadratic model's coefficients, the Levenberg-Marquardt
  rule, the norm constraint.
- `update_args`: checks of what ``update`` is given.
- `inspection`: `stats` and `describe`.
"""
