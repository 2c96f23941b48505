"""The README's snippets run as written and train."""

import pathlib
import re

import pytest


README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_quick_start_runs(api, capsys):
  section = re.search(r"## Quick start\n(.*?)\n## ", README.read_text(), re.S).group(1)
  snippets = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(snippets) == 2  # linen, then NNX
  snippet = snippets[["linen", "nnx"].index(api)]
  exec(compile(snippet, str(README), "exec"), {})  # pylint: disable=exec-used
  printed = capsys.readouterr().out
  final = float(re.search(r"loss after 20 steps: ([0-9.]+)", printed).group(1))
  assert final < 1.0  # starts near log(10) ≈ 2.3 on this memorisable batch


def test_your_own_layers_snippet_runs(capsys):
  section = re.search(r"## Your own layers\n(.*?)\n## ", README.read_text(), re.S).group(1)
  snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  exec(compile(snippet, str(README), "exec"), {})  # pylint: disable=exec-used
  printed = capsys.readouterr().out
  assert "['c_fc', 'c_proj', 'wte']" in printed
  final = float(re.search(r"loss after 10 steps: ([0-9.]+)", printed).group(1))
  assert final < 3.2  # starts near log(32) ≈ 3.47
