"""The README's quick-start snippet runs as written and trains."""

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
