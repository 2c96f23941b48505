"""Params-like trees as flat ``{leaf path: leaf}`` dicts.

K-FAC keys everything per layer by module path (flax's keys into the params
tree), never by call order; these helpers give every leaf its path as a
tuple of strings and put a flat dict back into its tree.
"""

from typing import Any, Callable

import jax

Path = tuple[str, ...]


def key(path: Path) -> str:
  """A path as K-FAC names it in keys and messages: joined by "/"."""
  return "/".join(path)


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None
            ) -> tuple[dict[Path, Any], Any]:
  """A tree -> ({leaf path: leaf}, treedef), leaf paths as tuples of str."""
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  def name(entry):
    for attribute in ("key", "name", "idx"):
      if hasattr(entry, attribute):
        return str(getattr(entry, attribute))
    return str(entry)
  return {tuple(name(e) for e in path): leaf for path, leaf in pairs}, treedef


def rebuild(treedef: Any, flat: dict[Path, Any]) -> Any:
  """Inverse of `flatten` (``flat`` must keep `flatten`'s key order)."""
  return treedef.unflatten(list(flat.values()))
