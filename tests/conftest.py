import collections
import importlib.util
import os
import sys

import pytest

# Before anything imports jax: the tests run on the CPU backend. With JAX's CUDA
# plugin installed in the environment (the `gpu-compile` extra) JAX would
# otherwise try CUDA first and could change the default backend of every test.
# Subprocesses started by the tests inherit the variable. An explicit
# JAX_PLATFORMS (a GPU run) is kept.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The float64 NumPy references live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))

from compile_flags import with_fast_compiles  # noqa: E402

# Also before JAX starts: XLA:CPU compiles without LLVM's optimizations, 13%
# less CPU time for the suite (tests/compile_flags.py says what changes).
os.environ["XLA_FLAGS"] = with_fast_compiles(os.environ.get("XLA_FLAGS", ""))

try:
  from hypothesis import Phase, settings
except ImportError:  # the property tests then fail at import, loudly
  pass
else:
  # mutation testing (mutmut, pyproject's [tool.mutmut]) and benchmarks/seeded_bugs.py: stop at the
  # first failing example, no shrinking
  # (a failure is all a killed mutant needs; shrinking jitted steps takes minutes).
  settings.register_profile("mutation", phases=[Phase.explicit, Phase.generate])


def pytest_configure(config):
  # Also declared by pytest-xdist; declared here so that a run without it
  # (`-p no:xdist`) does not warn about the marks below.
  config.addinivalue_line("markers", "xdist_group(name): tests pytest-xdist runs in one worker (docs/records/testing.md)")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the marks
def pytest_collection_modifyitems(config, items):
  """Makes each test file one unit of work for pytest-xdist's ``--dist loadgroup``.

  A worker then runs a whole file, as one process runs it alone: the file's
  module fixtures and in-process compilation caches are built once, not once
  per worker. A file whose tests fall into independent, expensive groups
  marks them itself with ``pytest.mark.xdist_group`` (tests/test_gpu_compile.py
  marks each tier, which compiles in its own subprocesses), and those groups
  are units of their own. Without xdist (``-n 0``) the marks do nothing.
  """
  for item in items:
    if item.get_closest_marker("xdist_group") is None:
      item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# Skips that CI must not have: .ci/run installs torch's CPU wheel and builds the
# native kernel, and the test extra installs Sphinx and MyST (the docs site), so
# all are tested there, and a skip would hide a broken install.
NOT_SKIPPED_IN_CI = ("could not import 'torch'", "native kernel:", "could not import 'sphinx'",
                     "could not import 'myst_parser'", "JAX's CUDA plugin:",
                     "the environment has JAX's CUDA plugin installed")
_skipped_in_ci = []


@pytest.fixture(scope="session")
def cuda_compiler_plugin():
  """JAX's CUDA plugin, for the tests that compile for a GPU (``optax_hybrid.gpu_compile``).

  Unless the environment has it (the ``gpu-compile`` extra), it is installed
  once into ``gpu_compile.cuda_plugin_dir()``, a cache outside the
  environment, from where only ``gpu_compile`` loads it: installing the tests
  leaves what ``import jax`` does in the environment unchanged.
  """
  if importlib.util.find_spec("jax_cuda12_plugin") is not None:
    return
  if not (sys.platform == "linux" and os.uname().machine == "x86_64"):
    pytest.skip(f"JAX's CUDA plugin: no wheel for {sys.platform} {os.uname().machine}")
  from optax_hybrid import gpu_compile
  try:
    gpu_compile.install_cuda_plugin()
  except gpu_compile.GpuCompileError as e:
    pytest.skip(f"JAX's CUDA plugin: {e}")


def _reason(report):
  reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
  return reason.removeprefix("Skipped: ")


def pytest_runtest_logreport(report):
  if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
    if any(marker in _reason(report) for marker in NOT_SKIPPED_IN_CI):
      _skipped_in_ci.append(f"{report.nodeid}: {_reason(report)}")


def pytest_sessionfinish(session, exitstatus):
  if _skipped_in_ci and session.exitstatus == 0:
    session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
  """Lists every skipped test with its reason, whatever the -r flags: nothing is skipped silently."""
  if _skipped_in_ci:
    terminalreporter.section("skipped in CI although CI installs what they need (the run fails)", red=True)
    for line in _skipped_in_ci:
      terminalreporter.write_line(line)
  skipped = terminalreporter.stats.get("skipped", [])
  if not skipped:
    return
  by_reason = collections.defaultdict(list)
  for report in skipped:
    by_reason[_reason(report)].append(report.nodeid)
  terminalreporter.section(f"{len(skipped)} skipped, and why")
  for reason, nodeids in sorted(by_reason.items(), key=lambda item: -len(item[1])):
    terminalreporter.write_line(f"{len(nodeids)} x {reason}")
    for nodeid in nodeids:
      terminalreporter.write_line(f"    {nodeid}")
