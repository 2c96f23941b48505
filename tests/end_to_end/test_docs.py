"""The README's and docs/'s snippets run as written, and their links resolve.

Every ```python block of a docs/ page runs, in order, in one namespace per
page (a page's blocks build on each other, as a reader reads them), in a
temporary working directory. A fragment that cannot run alone is fenced
```python fragment, visibly, and is not run; every page with Python
snippets has at least one that runs. The README's Quick start and the
layer-registration snippet also have their printed results checked.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
RUN, FRAGMENT = "python", "python fragment"
REGISTRATION = "register_layer(FlaxConv1D"
_FENCE = re.compile(r"^```([^`\n]*)\n(.*?)^```[ \t]*$", re.S | re.M)


def code_blocks(path: pathlib.Path) -> list[tuple[str, str, int]]:
  """``(info string, code, line of its first code line)`` of every fenced block."""
  text = path.read_text()
  return [(m.group(1).strip(), m.group(2), text.count("\n", 0, m.start(2)) + 1)
          for m in _FENCE.finditer(text)]


def run_block(path: pathlib.Path, code: str, line: int, namespace: dict) -> None:
  """Runs ``code`` so that a traceback names the page and its line."""
  padded = "\n" * (line - 1) + code
  exec(compile(padded, str(path), "exec"), namespace)  # pylint: disable=exec-used


def loss_after(printed: str, steps: int) -> float:
  return float(re.search(rf"loss after {steps} steps: ([0-9.]+)", printed).group(1))


# -- README ------------------------------------------------------------------


def test_readme_is_a_front_door():
  text = README.read_text()
  assert len(text.encode()) <= 12_000
  head = "\n".join(text.splitlines()[:60])
  assert 'pip install -e ".[examples]" && python examples/mlp_classifier.py' in head
  assert 'pip install -e ".[test]" && python -m pytest' in head
  ci = (ROOT / ".ci" / "run").read_text()  # the README says this is what CI runs
  assert re.search(r'^pip install .*-e "\.\[test\]"', ci, re.M)
  assert re.search(r"^python -m pytest$", ci, re.M)
  blocks = [info for info, _, _ in code_blocks(README) if info.startswith("py")]
  assert blocks == [RUN, RUN]  # the Quick start's two, both run below


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_quick_start_runs(api, capsys):
  section = re.search(r"## Quick start\n(.*?)\n## ", README.read_text(), re.S).group(1)
  snippets = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(snippets) == 2  # linen, then NNX
  snippet = snippets[["linen", "nnx"].index(api)]
  line = README.read_text().index(snippet)
  run_block(README, snippet, README.read_text().count("\n", 0, line) + 1, {})
  assert loss_after(capsys.readouterr().out, 20) < 1.0  # starts near log(10) ≈ 2.3


# -- docs/ -------------------------------------------------------------------


def test_the_pages_exist():
  names = {page.name for page in PAGES}
  assert {"settings.md", "models.md", "scaling.md", "operations.md",
          "design.md"} <= names


def test_the_registration_snippet_is_on_one_page():
  found = [page.name for page in PAGES for info, code, _ in code_blocks(page)
           if info == RUN and REGISTRATION in code]
  assert len(found) == 1, found


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_page_snippets_run(page, capsys, monkeypatch, tmp_path):
  blocks = code_blocks(page)
  python = [(info, code, line) for info, code, line in blocks
            if info.split(" ")[0] in ("python", "py", "python3")]
  unknown = [f"line {line}: {info!r}" for info, _, line in python
             if info not in (RUN, FRAGMENT)]
  assert not unknown, f"fence Python as {RUN!r} or {FRAGMENT!r}: {unknown}"
  runnable = [(code, line) for info, code, line in python if info == RUN]
  if python:
    assert runnable, f"{page.name} has Python snippets but none that runs"
  monkeypatch.chdir(tmp_path)  # files a snippet writes stay in a temporary folder
  namespace = {"__name__": f"docs_{page.stem}"}
  for code, line in runnable:
    capsys.readouterr()
    run_block(page, code, line, namespace)
    printed = capsys.readouterr().out
    if REGISTRATION in code:
      assert "['c_fc', 'c_proj', 'wte']" in printed  # no diagonal fallback
      assert loss_after(printed, 10) < 3.2  # starts near log(32) ≈ 3.47


# -- links -------------------------------------------------------------------


def _slug(heading: str) -> str:
  """GitHub's anchor of a heading."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
  text = _FENCE.sub("", path.read_text())  # a "# comment" in a code block is no heading
  found, seen = set(), {}
  for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", text, re.M):
    slug = _slug(heading)
    found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
    seen[slug] = seen.get(slug, 0) + 1
  return found


@pytest.mark.parametrize("path", [README, *PAGES],
                         ids=["README.md", *[page.name for page in PAGES]])
def test_links_resolve(path):
  text = _FENCE.sub("", path.read_text())
  broken = []
  for target in re.findall(r"\]\(([^)\s]+)\)", text):
    if re.match(r"[a-z]+:", target):  # https:, mailto:
      continue
    file, _, anchor = target.partition("#")
    linked = (path.parent / file).resolve() if file else path
    if not linked.exists():
      broken.append(target)
    elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
      broken.append(target)
  assert not broken, f"{path.name}: links to nothing: {broken}"
