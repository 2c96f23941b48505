"""The package's layout stays readable (the limits docs/design.md states):
no import circle between its modules, no class over 300 lines of code and
no function over 80 (docstrings, comments and blank lines not counted), at
most ten entries at its top level, and public modules that only name what
they export from kfac_optax/_src."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "kfac_optax"
MODULES = {".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
           .removesuffix(".__init__"): path for path in PACKAGE.rglob("*.py")}


def imported_modules(name: str, path: pathlib.Path) -> set[str]:
  """The package's modules that module ``name`` imports at its top level
  (an import of a package counts as one of its ``__init__``)."""
  found = set()
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for alias in node.names:
        candidate = f"{node.module}.{alias.name}"
        found.add(candidate if candidate in MODULES else node.module)
    elif isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
  return {module for module in found if module in MODULES and module != name}


def test_no_import_circle():
  graph = {name: imported_modules(name, path) for name, path in MODULES.items()}
  # A package's __init__ that re-exports its own modules is not a circle
  # with them: drop the edges from a module to the packages above it.
  graph = {name: {m for m in edges if not name.startswith(m + ".")}
           for name, edges in graph.items()}
  state = {}

  def visit(name, trail):
    state[name] = "open"
    for child in sorted(graph[name]):
      assert state.get(child) != "open", " -> ".join(trail + [name, child])
      if child not in state:
        visit(child, trail + [name])
    state[name] = "done"
  for name in sorted(graph):
    if name not in state:
      visit(name, [])


def code_lines(node: ast.AST, lines: list[str]) -> int:
  docstrings = set()
  for inner in ast.walk(node):
    body = getattr(inner, "body", None)
    if (isinstance(inner, (ast.FunctionDef, ast.ClassDef)) and body
        and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)):
      docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
  return sum(1 for number in range(node.lineno, node.end_lineno + 1)
             if number not in docstrings and lines[number - 1].strip()
             and not lines[number - 1].strip().startswith("#"))


def test_no_class_over_300_and_no_function_over_80_lines_of_code():
  too_long = []
  for name, path in MODULES.items():
    lines = path.read_text().splitlines()
    for node in ast.walk(ast.parse(path.read_text())):
      limit = {ast.ClassDef: 300, ast.FunctionDef: 80}.get(type(node))
      if limit and code_lines(node, lines) > limit:
        too_long.append(f"{name}.{node.name}: {code_lines(node, lines)} > {limit}")
  assert not too_long


def test_the_top_level_is_the_public_surface():
  entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
  assert len(entries) <= 10, entries
  for name in ("losses", "layouts", "sharding"):
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    statements = [node for node in tree.body
                  if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    assert all(isinstance(node, ast.ImportFrom) and node.module.startswith("kfac_optax._src")
               or isinstance(node, ast.Assign) and node.targets[0].id == "__all__"
               for node in statements), name
