"""The README's snippets run as written and train."""

import pathlib
import re


README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_quick_start_runs(capsys):
  snippet = re.search(r"## Quick start\n\n```python\n(.*?)```", README.read_text(),
                      re.S).group(1)
  exec(compile(snippet, str(README), "exec"), {})  # pylint: disable=exec-used
  printed = capsys.readouterr().out
  final = float(re.search(r"loss after 20 steps: ([0-9.]+)", printed).group(1))
  assert final < 1.0  # starts near log(10) ≈ 2.3 on this memorisable batch


def test_flax_nnx_snippet_runs(capsys):
  section = re.search(r"## Flax NNX\n(.*?)\n## ", README.read_text(), re.S).group(1)
  snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  exec(compile(snippet, str(README), "exec"), {})  # pylint: disable=exec-used
  final = float(re.search(r"loss after 20 steps: ([0-9.]+)",
                          capsys.readouterr().out).group(1))
  assert final < 1.0  # as the linen quick start's


def test_your_own_layers_snippet_runs(capsys):
  section = re.search(r"## Your own layers\n(.*?)\n## ", README.read_text(), re.S).group(1)
  snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  exec(compile(snippet, str(README), "exec"), {})  # pylint: disable=exec-used
  printed = capsys.readouterr().out
  assert "['c_fc', 'c_proj', 'wte']" in printed
  final = float(re.search(r"loss after 10 steps: ([0-9.]+)", printed).group(1))
  assert final < 3.2  # starts near log(32) ≈ 3.47
