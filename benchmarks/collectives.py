"""What a compiled step sends between devices, read from its HLO.

`step_bytes` counts the collectives of an XLA program after SPMD
partitioning (all-reduce, all-gather, reduce-scatter, all-to-all,
collective-permute): per device, the bytes of each collective's result,
which are per-device shapes in partitioned HLO. A collective inside a
conditional's branch runs only when the branch is taken: those are
reported apart (``conditional``), so that a step compiled with a schedule
made unconditional (a period of 1) can be told from one where it is not.
A collective inside a loop counts once per known trip.
"""

import dataclasses
import math
import re

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
                "f64": 8, "c64": 8, "c128": 16}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                "collective-permute")
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(.*?)\s+([a-z][a-z0-9-]*)\(")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass
class Collectives:
  """Bytes per device by collective kind: always run / in a conditional."""
  always: dict
  conditional: dict

  def total(self, where: str = "always") -> int:
    return sum(getattr(self, where).values())


def _bytes(result_type: str) -> int:
  return sum(_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
             for dtype, dims in _SHAPE.findall(result_type))


def _computations(hlo: str) -> dict[str, list[str]]:
  """Computation name -> its instruction lines."""
  found, name = {}, None
  for line in hlo.splitlines():
    header = re.match(r"^(?:ENTRY\s+)?%(\S+)\s.*\{\s*$", line)  # not indented
    if header:
      name = header.group(1)
      found[name] = []
    elif name is not None and line.strip() == "}":
      name = None
    elif name is not None:
      found[name].append(line)
  return found


def step_bytes(hlo: str) -> Collectives:
  """The collectives of a compiled program's text (``compiled.as_text()``)."""
  computations = _computations(hlo)
  entry = next(m.group(1) for m in re.finditer(r"^ENTRY\s+%(\S+)", hlo, re.M))
  result = Collectives({k: 0 for k in _COLLECTIVES}, {k: 0 for k in _COLLECTIVES})

  def visit(name, conditional, trips, seen):
    if name not in computations or (name, conditional) in seen:
      return
    seen = seen | {(name, conditional)}
    for line in computations[name]:
      match = _INSTRUCTION.match(line)
      if match is None:
        continue
      result_type, op = match.groups()
      kind = next((k for k in _COLLECTIVES if op in (k, k + "-start")), None)
      if kind is not None:
        where = result.conditional if conditional else result.always
        where[kind] += trips * _bytes(result_type)
      inner_conditional = conditional or op == "conditional"
      inner_trips = trips * int(_TRIPS.search(line).group(1)) if (
          op == "while" and _TRIPS.search(line)) else trips
      for called in re.findall(r"%([\w.\-]+)", " ".join(
          group for group in re.findall(
              r"(?:calls|to_apply|body|true_computation|false_computation|"
              r"branch_computations)=\{?([^}=]*)", line))):
        visit(called, inner_conditional, inner_trips, seen)
  visit(entry, False, 1, frozenset())
  return result
