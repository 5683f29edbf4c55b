"""The ``>>>`` examples in optax_hybrid's docstrings run and print what they show.

Every module of the package is searched (the exported functions' docstrings
and the rest), with the standard library's doctest: each example's output must
match the docstring (``...`` matches anything, whitespace runs compare equal).
"""

import doctest
import importlib
import importlib.util
import pkgutil

import pytest

import optax_hybrid

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(optax_hybrid.__path__, "optax_hybrid.")
    # The native kernel's shared library sits in the package too; it is not Python.
    if importlib.util.find_spec(m.name).origin.endswith(".py"))


@pytest.mark.parametrize("name", ["optax_hybrid"] + MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  for test in doctest.DocTestFinder().find(module, name):
    runner.run(test)
  assert runner.failures == 0, f"{runner.failures} docstring example(s) of {name} failed (output above)"


def test_the_exported_functions_have_examples():
  """The search finds the examples that are there (a broken finder would pass every module)."""
  names = {t.name for m in MODULES for t in doctest.DocTestFinder().find(importlib.import_module(m)) if t.examples}
  for expected in ("optax_hybrid.rules.adamw.hybrid_adamw", "optax_hybrid.schedules.warmup_cosine_schedule",
                   "optax_hybrid.report.memory_report", "optax_hybrid.recipe.standard_optimizer"):
    assert expected in names, sorted(names)


def test_no_example_is_skipped():
  """A ``+SKIP`` directive would exempt an example from running."""
  for name in MODULES:
    source = open(importlib.util.find_spec(name).origin).read()
    assert "doctest: +SKIP" not in source, f"{name} skips a docstring example: make it runnable"
