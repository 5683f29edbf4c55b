"""JAX's CUDA plugin, the compiler of :mod:`optax_hybrid.gpu_compile`, kept in a cache directory.

:func:`install_cuda_plugin` installs the plugin of jaxlib's exact version into
:func:`cuda_plugin_dir`, outside the environment's site-packages, so that only
a deviceless compile loads it (:func:`topology_devices`); a plugin JAX already
loaded (installed with the ``gpu-compile`` extra) is used as it is.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

import jax

__all__ = ["GpuCompileError", "cuda_plugin_dir", "install_cuda_plugin", "topology_devices"]

# JAX's CUDA plugin: its two distributions, the package that tells whether it
# is on the path, and the module JAX's plugin discovery imports.
_PLUGIN_PACKAGES = ("jax-cuda12-plugin", "jax-cuda12-pjrt")
_PLUGIN_PACKAGE = "jax_cuda12_plugin"
_PLUGIN_MODULE = "jax_plugins.xla_cuda12"


class GpuCompileError(RuntimeError):
  """The CUDA compiler is unavailable (plugin missing or of another version)."""


def cuda_plugin_dir() -> str:
  """The directory :func:`install_cuda_plugin` installs JAX's CUDA plugin into, and where it is loaded from.

  ``$XDG_CACHE_HOME/optax_hybrid/jax-cuda12-<jaxlib version>`` (``~/.cache``
  when ``XDG_CACHE_HOME`` is unset). It is on no process's path: JAX does not
  load the plugin when it starts; :func:`compile_for_gpu` loads it from here
  when JAX has not loaded one of its own.

  Returns:
    The directory's path (it may not exist yet).
  """
  cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(cache, "optax_hybrid", f"jax-cuda12-{importlib.metadata.version('jaxlib')}")


def _pip_command(target: str) -> list[str]:
  jax_version = importlib.metadata.version("jaxlib")
  return [sys.executable, "-m", "pip", "install", "--no-deps", "--target", target,
          *(f"{package}=={jax_version}" for package in _PLUGIN_PACKAGES)]


def _install_hint() -> str:
  return ("python -c 'from optax_hybrid import gpu_compile; gpu_compile.install_cuda_plugin()' "
          f"(runs {shlex.join(_pip_command(cuda_plugin_dir()))})")


def install_cuda_plugin() -> str:
  """Installs JAX's CUDA plugin of jaxlib's version into :func:`cuda_plugin_dir`, unless it is there.

  Runs ``pip install --no-deps --target`` (about 480 MB) into a temporary
  directory beside it, renamed into place when complete, under a file lock:
  concurrent calls (test workers) install once.

  Returns:
    :func:`cuda_plugin_dir`.

  Raises:
    GpuCompileError: pip failed (its output is in the message).
  """
  import fcntl  # the plugin exists for Linux only

  directory = cuda_plugin_dir()
  if os.path.isdir(directory):
    return directory
  os.makedirs(os.path.dirname(directory), exist_ok=True)
  with open(directory + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not os.path.isdir(directory):
      partial = tempfile.mkdtemp(prefix=os.path.basename(directory) + ".partial-", dir=os.path.dirname(directory))
      proc = subprocess.run(_pip_command(partial), capture_output=True, text=True)
      if proc.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise GpuCompileError(f"Installing the CUDA plugin failed ({shlex.join(proc.args)}):\n{proc.stderr[-3000:]}")
      os.rename(partial, directory)
  return directory


def _check_plugin_versions() -> None:
  """Raises a :class:`GpuCompileError` if the plugin on the path is not of jaxlib's version."""
  jax_version = importlib.metadata.version("jaxlib")
  for package in _PLUGIN_PACKAGES:
    try:
      version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      raise GpuCompileError(f"Compiling for a GPU needs {package} {jax_version}, which is not installed: "
                            f"{_install_hint()}.") from None
    if version != jax_version:
      raise GpuCompileError(
          f"{package} {version} does not match jaxlib {jax_version}: install {jax_version} where {version} is "
          f'(pip install "jax-cuda12-plugin=={jax_version}" "jax-cuda12-pjrt=={jax_version}"), or uninstall '
          f"it and use {_install_hint()}.")


def _put_plugin_on_path() -> None:
  """Appends :func:`cuda_plugin_dir` to ``sys.path`` if no CUDA plugin is importable; checks its version."""
  if importlib.util.find_spec(_PLUGIN_PACKAGE) is None:
    directory = cuda_plugin_dir()
    if not os.path.isdir(directory):
      raise GpuCompileError(f"Compiling for a GPU needs JAX's CUDA plugin, which is neither installed nor in "
                            f"{directory}: {_install_hint()}.")
    sys.path.append(directory)
    importlib.invalidate_caches()
  _check_plugin_versions()


def _register_plugin() -> None:
  """Registers the CUDA plugin with JAX, as JAX's plugin discovery does when it starts.

  Needed when JAX started without the plugin on its path (it is loaded from
  :func:`cuda_plugin_dir`), or when the plugin's own start failed because the
  machine has no CUDA (it checks the CUDA runtime unless ``JAX_PLATFORMS``
  excludes CUDA): compiling needs no CUDA runtime, so that check is skipped.
  """
  module = importlib.import_module(_PLUGIN_MODULE)
  saved = os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
  os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
  try:
    module.initialize()
  finally:
    if saved is None:
      del os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"]
    else:
      os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = saved


@functools.lru_cache(maxsize=None)
def topology_devices(target_text: str, num_devices: int) -> tuple:
  """The devices of a deviceless CUDA topology of ``num_devices`` GPUs of a target (one per text and count).

  Loads the plugin first: the one JAX loaded, or else the one in :func:`cuda_plugin_dir`.

  Raises:
    GpuCompileError: the plugin is missing or not of jaxlib's version, or the topology cannot be built.
  """
  from jax.experimental import topologies

  jax.devices()  # JAX first loads the plugins on its own path
  _put_plugin_on_path()
  # Whole nodes of 8 GPUs ("1x2x8": two hosts, one process each) past one node.
  hosts = num_devices // 8 if num_devices > 8 and num_devices % 8 == 0 else 1
  get = functools.partial(topologies.get_topology_desc, platform="cuda", target_config=target_text,
                          topology=f"1x{hosts}x{num_devices // hosts}")
  try:
    try:
      topology = get()
    except NotImplementedError:  # JAX has not registered the plugin
      _register_plugin()
      topology = get()
  except Exception as e:  # the plugin's own error, whatever its type
    raise GpuCompileError(f"Could not build a deviceless CUDA topology of {num_devices} device(s): {e}") from e
  return tuple(topology.devices)
