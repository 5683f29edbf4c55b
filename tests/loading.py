"""Loads the repository's scripts (examples, benchmarks) as modules, for tests that call their main()."""

import importlib.util
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)


def load_script(relative_path: str):
  """Imports ``ROOT/relative_path`` under its file name; registered in sys.modules (Linen dataclasses look it up)."""
  name = os.path.splitext(os.path.basename(relative_path))[0]
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relative_path))
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module
