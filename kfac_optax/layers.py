"""Registry: which flax module classes K-FAC captures, and as which block kind."""

import flax.linen as nn

# Module class -> block kind (a key of `blocks.BLOCK_KINDS`). Looked up along
# the module's MRO, so subclasses of a registered class are captured too.
_KINDS: dict[type, str] = {nn.Dense: "dense"}


def kind_of(module: nn.Module) -> str | None:
  """The block kind of a flax module instance, or None if it is not captured."""
  for cls in type(module).__mro__:
    if cls in _KINDS:
      return _KINDS[cls]
  return None
