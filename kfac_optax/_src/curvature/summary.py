"""What K-FAC does with a model: one row per block, and the fallback warning.

`summarize` turns a curvature plan (which block owns which params leaves)
into a `Summary`: per module its block kind, factor sizes and parameter
count, and each kind's share of the parameters; ``str(summary)`` is a table.
`kfac_optax.describe` builds one from an optimizer, and `Curvature.init`
warns (`FallbackWarning`) when most parameters fall to the diagonal fallback.
`warn` gives init's warnings the user's line.
"""

import dataclasses
import math
import sys
import warnings
from typing import Any, Callable, NamedTuple

from kfac_optax._src import blocks
from kfac_optax._src.linalg import low_rank

# Every kind, in table order, with what its preconditioner is.
KINDS = {
    "kronecker": "A ⊗ G, neither factor kept diagonal",
    "kron_in_diag": "diag(A) ⊗ G: input factor kept diagonal",
    "kron_out_diag": "A ⊗ diag(G): output factor kept diagonal",
    "kron_both_diag": "diag(A) ⊗ diag(G): both kept diagonal",
    "series_option1": "A0, A1 and G0, G1: time steps as a stationary series",
    "series_option2": "A0, A1 and G0, G1: time steps as linear dynamics",
    "embedding": "diag(A) ⊗ G, A the token frequencies",
    "tied embedding": "diag(A) ⊗ G, lookup and logits uses combined",
    "norm": "exact diagonal Fisher of scale and bias",
    "diagonal": "diagonal Fisher, chosen by layer_overrides",
    "fallback": "diagonal Fisher: no layer block captures these params",
    "skipped": "not preconditioned (layer_overrides 'skip')",
}
_STRUCTURE_KINDS = {diagonal: "kronecker" if name == "kron" else name
                    for name, diagonal in blocks.KRONECKER_STRUCTURES.items()}


class FallbackWarning(UserWarning):
  """Most of a model's parameters get only K-FAC's diagonal fallback."""


class Factor(NamedTuple):
  """One factor of a block: ``size × size``, or its diagonal of ``size``.

  Attributes:
    name: ``"A"`` (input side), ``"G"`` (output side), or for a diagonal
      block the params leaf's name.
    size: the factor's dimension.
    diagonal: whether only its diagonal is kept.
    rank: the rank of its inverse where it is kept at ``factor_rank``
      (`linalg.low_rank`), else None.
    tile: the rows of its diagonal tiles where it is kept as them
      (``factor_block_size``), else None.
  """
  name: str
  size: int
  diagonal: bool
  rank: int | None = None
  tile: int | None = None

  def text(self) -> str:
    if self.diagonal:
      return f"{self.name} diag {self.size}"
    if self.tile:
      count, size = blocks.tiling(self.size, self.tile)
      return f"{self.name} {self.size} as {count} tiles {size}×{size}"
    return f"{self.name} {self.size}×{self.size}" + (f" rank {self.rank}" if self.rank else "")


@dataclasses.dataclass(frozen=True)
class Row:
  """One module's block.

  Attributes:
    path: the module path joined by "/" ("" for the root module).
    kind: a key of `KINDS`.
    factors: the factors of one slice (empty for ``"skipped"``).
    stacks: independent slices with factors of these sizes (nn.scan layers
      × groups of a grouped convolution × DenseGeneral batch indices).
    num_params: parameters the block owns.
  """
  path: str
  kind: str
  factors: tuple[Factor, ...]
  stacks: int
  num_params: int

  def factor_text(self) -> str:
    """E.g. ``"A 785×785 · G 10×10"``, ``"A diag 4609 · G 512×512"``,
    ``"A 785×785 rank 32 · G 10×10"``, ``"A 129 as 3 tiles 64×64 · G 10×10"``."""
    if not self.factors:
      return "-"
    text = " · ".join(f.text() for f in self.factors)
    return text if self.stacks == 1 else f"{self.stacks} × ({text})"


@dataclasses.dataclass(frozen=True)
class Summary:
  """The blocks K-FAC gives a model; ``str()`` renders them as a table.

  Attributes:
    rows: one per module (per module whose params share a kind, for the
      diagonal fallback and skipped params), in params-tree order.
  """
  rows: tuple[Row, ...]

  @property
  def num_params(self) -> int:
    return sum(row.num_params for row in self.rows)

  def shares(self) -> dict[str, float]:
    """Kind -> its fraction of all parameters (kinds present only)."""
    total = max(self.num_params, 1)
    counts = {kind: sum(r.num_params for r in self.rows if r.kind == kind)
              for kind in KINDS}
    return {kind: count / total for kind, count in counts.items()
            if any(r.kind == kind for r in self.rows)}

  def largest(self, kind: str, count: int) -> tuple[Row, ...]:
    """The ``count`` rows of ``kind`` with the most parameters."""
    return tuple(sorted((r for r in self.rows if r.kind == kind),
                        key=lambda r: -r.num_params)[:count])

  def __str__(self) -> str:
    header = ("module", "block", "factors", "params")
    cells = [(r.path or "(root)", r.kind, r.factor_text(), f"{r.num_params:,}")
             for r in self.rows]
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(4)]
    render = lambda line: "  ".join(
        [*(cell.ljust(w) for cell, w in zip(line[:3], widths)),
         line[3].rjust(widths[3])]).rstrip()
    lines = [render(header), render(tuple("-" * w for w in widths)),
             *map(render, cells), "",
             f"{self.num_params:,} parameters:"]
    kind_width = max(len(kind) for kind in KINDS)
    lines += [f"  {share:6.1%}  {kind.ljust(kind_width)}  {KINDS[kind]}"
              for kind, share in self.shares().items()]
    ranks = sorted({f.rank for row in self.rows for f in row.factors if f.rank})
    if ranks:
      lines.append(f"Factors marked rank {', '.join(map(str, ranks))}: inverted at that "
                   "rank (their top eigenpairs, the other eigenvalues by their mean).")
    return "\n".join(lines)

  __repr__ = __str__  # a REPL shows the table


def _kind_and_factors(block: Any) -> tuple[str, tuple[Factor, ...], int]:
  """``(kind, factors of one slice, number of slices)`` of a layer block."""
  stacks = 1
  while isinstance(block, blocks.StackedBlock):
    stacks, block = stacks * block.num_layers, block.inner
  if isinstance(block, blocks.BatchMajor):  # time steps are rows
    block = block.inner
  if isinstance(block, blocks.SeriesBlock):
    layout = block.layout
    return (block.option, (Factor("A0,A1", layout.in_dim + block.has_bias, False),
                           Factor("G0,G1", layout.out_dim, False)),
            stacks * layout.num_stacks)
  if isinstance(block, blocks.KroneckerBlock):
    layout, tile = block.layout, getattr(block, "tile", None)
    factors = (Factor("A", layout.in_dim + block.has_bias, block.diagonal_input),
               Factor("G", layout.out_dim, block.diagonal_output))
    return (_STRUCTURE_KINDS[block.diagonal_input, block.diagonal_output],
            tuple(f._replace(tile=tile) if tile and f.size > tile else f
                  for f in factors), stacks * layout.num_stacks)
  if isinstance(block, blocks.EmbeddingBlock):
    return ("tied embedding" if block.tied else "embedding",
            (Factor("A", block.layout.vocab, True),
             Factor("G", block.layout.out_dim, False)), stacks)
  if isinstance(block, blocks.NormBlock):
    return "norm", tuple(Factor(name, math.prod(shape), True)
                         for name, shape in block.shapes.items()), stacks
  return type(block).__name__, (), stacks


def summarize(layers: dict[str, tuple[tuple[str, ...], Any]],
              fallback_paths: dict[str, tuple[str, ...]],
              param_shapes: dict[tuple[str, ...], tuple[int, ...]],
              override_for: Callable[[tuple[str, ...]], str | None],
              factor_rank: int | None = None) -> Summary:
  """The summary of a curvature plan.

  Args:
    layers: block key -> (module path, layer block).
    fallback_paths: diagonal-fallback leaf key -> leaf path.
    param_shapes: every params leaf path -> its shape, in params-tree order.
    override_for: module path -> its ``layer_overrides`` choice, or None.
    factor_rank: the rank that full factors above it are inverted at
      (series blocks excepted), or None.

  Returns:
    One row per layer block, and per module the rows of its params in the
    diagonal fallback (kind ``"diagonal"`` where ``layer_overrides`` chose
    it, else ``"fallback"``) and of its params no block owns (``"skipped"``),
    ordered by each module's first leaf.
  """
  groups = {}  # (module path, kind) -> [factors, stacks, leaves]
  for path, block in layers.values():
    kind, factors, stacks = _kind_and_factors(block)
    if kind not in blocks.SERIES_OPTIONS:
      factors = tuple(f._replace(rank=factor_rank)
                      if not f.diagonal and low_rank.applies(f.size, factor_rank) else f
                      for f in factors)
    groups[path, kind] = [factors, stacks, [path + (n,) for n in block.param_names]]
  owned = {leaf for _, _, leaves in groups.values() for leaf in leaves}
  fallback = set(fallback_paths.values())
  for leaf, shape in param_shapes.items():
    if leaf in owned:
      continue
    module, factors = leaf[:-1], (Factor(leaf[-1], math.prod(shape), True),)
    if leaf not in fallback:
      kind, factors = "skipped", ()
    elif override_for(module) == "diagonal":
      kind = "diagonal"
    else:
      kind = "fallback"
    group = groups.setdefault((module, kind), [(), 1, []])
    group[0] += factors
    group[2].append(leaf)
  order = {leaf: i for i, leaf in enumerate(param_shapes)}
  ordered = sorted(groups.items(), key=lambda item: min(
      order.get(leaf, len(order)) for leaf in item[1][2]))
  return Summary(tuple(
      Row("/".join(module), kind, factors, stacks,
          sum(math.prod(param_shapes[leaf]) for leaf in leaves))
      for (module, kind), (factors, stacks, leaves) in ordered))


# The packages between a user's call and K-FAC's warnings (tx.init runs
# through optax's chains, jax's tracing, NNX's Optimizer).
_LIBRARIES = ("kfac_optax", "optax", "jax", "flax")


def warn(message: str, category: type[Warning] = UserWarning) -> None:
  """``warnings.warn`` attributed to the first frame outside `_LIBRARIES`:
  the user's ``tx.init`` (or ``nnx.Optimizer``) line, however deep K-FAC
  sits in a chain."""
  frame, level = sys._getframe(1), 2  # pylint: disable=protected-access
  while frame.f_back is not None and (
      frame.f_globals.get("__name__", "").partition(".")[0] in _LIBRARIES):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, category, stacklevel=level)


def warn_if_mostly_fallback(summary: Summary) -> None:
  """`FallbackWarning` when more than half of the parameters are in the
  diagonal fallback, naming its three largest modules."""
  share = summary.shares().get("fallback", 0.0)
  if share <= 0.5:
    return
  largest = ", ".join(f"'{row.path or '(root)'}' ({row.num_params:,})"
                      for row in summary.largest("fallback", 3))
  warn(
      f"{share:.0%} of the parameters get only K-FAC's diagonal fallback: no "
      f"layer block captures them. Largest: {largest}. Layers under "
      "nn.map_variables (nn.WeightNorm, nn.SpectralNorm) or whose own "
      "`param` transforms their params (a weight-standardised conv) stay "
      "there by design, and so do layers run through flax's bridges (linen layers "
      "in nnx.bridge.ToNNX, NNX ones in nnx.bridge.to_linen); if these "
      "are dense- or conv-like layers of your own, declare "
      "their module class with kfac_optax.register_layer to give them "
      "Kronecker blocks, and write raw matmuls or einsums of self.param "
      "(linen) or nnx.Param (NNX) kernels as layers: nn.Dense or nnx.Linear, "
      "nn.DenseGeneral or nnx.LinearGeneral, nn.Einsum or nnx.Einsum. "
      "kfac_optax.describe(tx, params) lists every block. "
      "Layers meant to stay diagonal: layer_overrides={pattern: 'diagonal'} "
      "(not counted here).",
      FallbackWarning)
