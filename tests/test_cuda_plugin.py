"""JAX's CUDA plugin stays out of the environment: ``import jax`` is quiet, and ``gpu_compile`` finds the plugin itself.

The test extra does not install the plugin (``tests/conftest.py``'s
``cuda_compiler_plugin`` fixture puts it in ``gpu_compile.cuda_plugin_dir()``,
a cache outside the environment), so in the test environment a bare ``import
jax`` prints nothing, and ``gpu_compile`` says what to run when the plugin is
missing or of another version. ``tests/test_gpu_compile.py`` shows that it
compiles with the plugin loaded from that cache. Each case runs in a fresh
process (with its own ``XDG_CACHE_HOME``): loading the plugin changes the
process.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JAX_VERSION = importlib.metadata.version("jaxlib")

# In CI (a fresh environment from the README's command) this never skips: tests/conftest.py.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda12_plugin") is not None,
    reason="the environment has JAX's CUDA plugin installed (the gpu-compile extra), which these tests exclude")

COMPILE = """
import jax, jax.numpy as jnp
from optax_hybrid import gpu_compile
try:
  gpu_compile.compile_for_gpu(jnp.sin, jax.ShapeDtypeStruct((8,), jnp.float32), target="h100")
except gpu_compile.GpuCompileError as e:
  print(e)
"""


def run(code: str, **env: str) -> subprocess.CompletedProcess:
  environment = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  environment["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
  return subprocess.run([sys.executable, "-c", code], env=dict(environment, **env), capture_output=True, text=True,
                        timeout=300)


def test_import_jax_and_optax_hybrid_print_nothing():
  """Without JAX_PLATFORMS: with the plugin in site-packages this logged a 30-line CUDA traceback (issue 22)."""
  proc = run("import jax; jax.devices(); import optax_hybrid; jax.numpy.ones(2).block_until_ready()")
  assert proc.returncode == 0, proc.stderr
  assert (proc.stdout, proc.stderr) == ("", "")


def test_without_the_plugin_the_error_names_the_install(tmp_path):
  proc = run(COMPILE, XDG_CACHE_HOME=str(tmp_path))
  directory = os.path.join(tmp_path, "optax_hybrid", f"jax-cuda12-{JAX_VERSION}")
  assert proc.returncode == 0, proc.stderr
  assert "neither installed nor in " + directory in proc.stdout
  assert "gpu_compile.install_cuda_plugin()" in proc.stdout
  assert f"--target {directory} jax-cuda12-plugin=={JAX_VERSION} jax-cuda12-pjrt=={JAX_VERSION}" in proc.stdout


def test_a_plugin_of_another_version_is_refused(tmp_path):
  directory = tmp_path / "optax_hybrid" / f"jax-cuda12-{JAX_VERSION}"
  (directory / "jax_cuda12_plugin").mkdir(parents=True)
  (directory / "jax_cuda12_plugin" / "__init__.py").write_text("")
  for name in ("jax_cuda12_plugin", "jax_cuda12_pjrt"):
    info = directory / f"{name}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.0.1\n")
  proc = run(COMPILE, XDG_CACHE_HOME=str(tmp_path))
  assert proc.returncode == 0, proc.stderr
  assert f"jax-cuda12-plugin 0.0.1 does not match jaxlib {JAX_VERSION}" in proc.stdout
  assert f'pip install "jax-cuda12-plugin=={JAX_VERSION}" "jax-cuda12-pjrt=={JAX_VERSION}"' in proc.stdout


def test_a_failed_install_says_why_and_leaves_nothing(tmp_path):
  code = ("from optax_hybrid import gpu_compile\n"
          "try:\n  gpu_compile.install_cuda_plugin()\nexcept gpu_compile.GpuCompileError as e:\n  print(e)\n")
  # No package index and no configuration: pip cannot find the plugin.
  proc = run(code, XDG_CACHE_HOME=str(tmp_path), PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1",
             PIP_FIND_LINKS=str(tmp_path))
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("Installing the CUDA plugin failed (")
  assert "jax-cuda12-plugin" in proc.stdout
  assert sorted(os.listdir(tmp_path / "optax_hybrid")) == [f"jax-cuda12-{JAX_VERSION}.lock"]
