"""Linear algebra of the inverse refresh: damped factors and their inverses.

Modules, one idea each:

- `precision`: the dtype of statistics and inverses (float32, or float64),
  and the matmul precision of the statistics.
- `damped`: a damped factor (`Damped`, `DampedDiagonal`), the π-adjusted
  split of λ between a block's factors, one matrix's damped inverse or power.
- `newton_schulz`, `cholesky`, `low_rank`: the inverse methods besides eigh
  (matrix products only; a blocked Cholesky; top-k eigenpairs plus the mean
  of the rest).
- `series`: the decompositions of the series blocks of recurrent layers.
- `stacked_inverses`: `invert_all`, every factor of a refresh inverted in
  stacks of similar size.
- `distributed`: a function over a stack of matrices, split over the devices
  of a mesh.
- `owner_routing`: matrices moved from the params' layout to the devices
  that own their slots in such a stack, and back.

The names below are what the rest of the library uses.
"""

from kfac_optax._src.linalg.damped import Damped
from kfac_optax._src.linalg.damped import DampedDiagonal
from kfac_optax._src.linalg.damped import INVERSE_METHODS
from kfac_optax._src.linalg.damped import mean_eigenvalue
from kfac_optax._src.linalg.damped import pi_adjusted_damping
from kfac_optax._src.linalg.distributed import constrain
from kfac_optax._src.linalg.distributed import rows_over_mesh
from kfac_optax._src.linalg.distributed import rows_typed
from kfac_optax._src.linalg.distributed import stack_sharding
from kfac_optax._src.linalg.distributed import StackSharding
from kfac_optax._src.linalg.owner_routing import MatrixLayout
from kfac_optax._src.linalg.owner_routing import at_owners
from kfac_optax._src.linalg.owner_routing import routable
from kfac_optax._src.linalg.owner_routing import summed_at_owners
from kfac_optax._src.linalg.precision import STATISTICS_PRECISION
from kfac_optax._src.linalg.precision import at_least_float32
from kfac_optax._src.linalg.precision import curvature_dtype
from kfac_optax._src.linalg.series import DampedLag
from kfac_optax._src.linalg.series import SERIES_DECOMPOSITIONS
from kfac_optax._src.linalg.series import Transition
from kfac_optax._src.linalg.series import Whitened
from kfac_optax._src.linalg.stacked_inverses import invert_all
from kfac_optax._src.linalg.stacked_inverses import low_rank_identities
