"""The README's Python examples run and say what they claim."""

import os
import re

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def python_blocks():
  with open(README) as f:
    return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_readme_examples_run():
  blocks = python_blocks()
  assert len(blocks) >= 2
  for block in blocks:
    namespace = {}
    exec(compile(block, README, "exec"), namespace)  # noqa: S102
    # A trailing "expr  # value" line states the value the user will see.
    last = [line for line in block.strip().splitlines() if line.strip()][-1]
    if "  # " in last:
      expr, claimed = last.split("  # ", 1)
      assert repr(eval(expr, namespace)) == claimed.strip(), (expr, claimed)  # noqa: S307


def test_quick_start_has_exactly_two_commands():
  with open(README) as f:
    text = f.read()
  block = re.search(r"## Quick start\n\n```bash\n(.*?)```", text, flags=re.S).group(1)
  lines = [line for line in block.splitlines() if line.strip()]
  assert len(lines) == 2
  assert "examples/char_gpt.py" in lines[0] and "pytest" in lines[1]
