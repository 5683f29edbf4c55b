"""Compile a JAX function for an NVIDIA GPU on a machine without one.

XLA:GPU can compile for a GPU it cannot see, given a ``GpuTargetConfig`` that
describes the chip. :func:`compile_for_gpu` traces a function on the running
backend (normally the CPU, which has ``pinned_host`` memory), lowers it for
CUDA, and compiles it with the compile-only client of a deviceless topology.
XLA:GPU's own passes then run for real, the host-offload passes included, and
the compiled executable tells how many bytes the program needs in device
memory and in host memory, and what it launches.

The result is a :class:`GpuCompileReport`: memory statistics split by memory
space, counts taken from the optimized HLO (kernels, Triton launches,
host<->device transfers, host calls, bytes read and written by the kernels),
the host-offloader fallback warnings XLA printed, and the HLO itself.

Example::

  import jax, jax.numpy as jnp
  from optax_hybrid import gpu_compile

  x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
  report = gpu_compile.compile_for_gpu(lambda a: jnp.sin(a) * 2, x, target="h100")
  report.device_peak_bytes  # 8388608: the argument and the result
  report.kernels            # 1: one fusion

Needs JAX's CUDA plugin (``jax-cuda12-plugin`` and ``jax-cuda12-pjrt``) of
the installed jaxlib's exact version; no GPU and no driver.
:func:`install_cuda_plugin` puts it in a cache directory
(:func:`cuda_plugin_dir`) outside the environment's site-packages, where only
this module loads it: the environment's other JAX programs never see it
(installed into the environment, JAX would load it in every process, and on a
machine without CUDA ``import jax`` logs CUDA errors). A plugin JAX already
loaded (installed with the ``gpu-compile`` extra) is used as it is.

Compile time, not run time: the figures say what XLA planned (buffers, kernels,
copies), not how fast the program runs or how much bandwidth it reaches.
An internal XLA check failure aborts the whole process: compile matrices of
programs in a subprocess.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Callable, Iterator, Sequence

import jax

from optax_hybrid import _compat
from optax_hybrid.kernels.contract import lowering_for

__all__ = [
    "BOOKKEEPING_OPS",
    "GpuCompileError",
    "GpuCompileReport",
    "HloInstruction",
    "HloSummary",
    "LoopTransfers",
    "TARGETS",
    "array_bytes",
    "array_dims",
    "collective_of",
    "collective_payload",
    "COLLECTIVE_OPS",
    "compile_for_gpu",
    "compile_lowered",
    "count_hlo",
    "cuda_plugin_dir",
    "host_call_bytes",
    "in_host_memory",
    "install_cuda_plugin",
    "is_host_call",
    "load_target",
    "loop_transfers",
    "parse_hlo",
    "target_device_memory_bytes",
    "transfer_of",
]

_TARGET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")
TARGETS = {"h100": "h100.txtpb", "h200": "h200.txtpb"}
"""Target names :func:`compile_for_gpu` accepts, and their ``GpuTargetConfig`` files."""

# The host offloader's fallback: device arithmetic on a host-memory value that
# XLA silently turns into (slow) host compute.
_FALLBACK_PATTERNS = ("does device compute in host memory space", "Converting into host compute")

# JAX's CUDA plugin: its two distributions, the package that tells whether it
# is on the path, and the module JAX's plugin discovery imports.
_PLUGIN_PACKAGES = ("jax-cuda12-plugin", "jax-cuda12-pjrt")
_PLUGIN_PACKAGE = "jax_cuda12_plugin"
_PLUGIN_MODULE = "jax_plugins.xla_cuda12"


class GpuCompileError(RuntimeError):
  """The CUDA compiler is unavailable (plugin missing or of another version)."""


# --- targets -----------------------------------------------------------------

def load_target(target: str) -> str:
  """The ``GpuTargetConfig`` text proto of a target.

  Args:
    target: ``"h100"`` (80 GB, 3.35 TB/s), ``"h200"`` (141 GB, 4.8 TB/s), or
      the path of a ``GpuTargetConfig`` text proto file.

  Returns:
    The text proto.

  Raises:
    ValueError: ``target`` is neither a known name nor an existing file.
  """
  if target in TARGETS:
    path = os.path.join(_TARGET_DIR, TARGETS[target])
  elif os.path.isfile(target):
    path = target
  else:
    raise ValueError(f"`target` must be one of {sorted(TARGETS)} or the path of a GpuTargetConfig "
                     f"text proto; got {target!r}.")
  with open(path) as f:
    return f.read()


def target_device_memory_bytes(target: str) -> int:
  """The device memory of a target in bytes (its ``device_memory_size``).

  Args:
    target: as for :func:`load_target`.

  Returns:
    The number of bytes, e.g. 150754820096 for ``"h200"``.

  Raises:
    ValueError: the target has no ``device_memory_size``.
  """
  match = re.search(r"device_memory_size:\s*(\d+)", load_target(target))
  if match is None:
    raise ValueError(f"Target {target!r} has no device_memory_size.")
  return int(match.group(1))


# --- the CUDA plugin ------------------------------------------------------------

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
def _topology_devices(target_text: str, num_devices: int) -> tuple:
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


# --- stderr capture ------------------------------------------------------------

@contextlib.contextmanager
def _captured_stderr() -> Iterator[list]:
  """Redirects file descriptor 2 (XLA's C++ log) to a temporary file; yields a list that gets its text.

  The file is created in ``tempfile.gettempdir()`` (``TMPDIR``) with the prefix
  ``optax_hybrid_gpu_compile_``; if XLA aborts the process the file stays there
  with the abort message. The captured text is written back to stderr after.
  """
  sys.stderr.flush()
  fd, path = tempfile.mkstemp(prefix="optax_hybrid_gpu_compile_", suffix=".log")
  saved = os.dup(2)
  out: list = []
  try:
    os.dup2(fd, 2)
    try:
      yield out
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      # Read through the descriptor: the text survives whoever cleans the temporary directory meanwhile.
      with os.fdopen(os.dup(fd), "rb") as f:
        f.seek(0)
        out.append(f.read().decode(errors="replace"))
      if out[0]:
        sys.stderr.write(out[0])
  finally:
    os.close(saved)
    os.close(fd)
    with contextlib.suppress(FileNotFoundError):
      os.unlink(path)


# --- the optimized HLO ----------------------------------------------------------

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
                "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
                "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1,
                "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\](\{[^}]*\})?")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")

BOOKKEEPING_OPS = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "add-dependency",
    "opt-barrier", "partition-id", "replica-id", "iota-free", "domain",
})
"""Opcodes that launch nothing on the device and move nothing: they only name or regroup buffers."""

COLLECTIVE_OPS = frozenset({"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                            "collective-permute", "collective-broadcast"})
"""Opcodes of collectives between GPUs (each also has an asynchronous ``-start`` / ``-done`` form)."""

# Ops that launch nothing: bookkeeping, control flow (its bodies are walked),
# and the asynchronous transfers and host calls (counted apart).
_NOT_KERNELS = BOOKKEEPING_OPS | frozenset({
    "while", "conditional", "call",
    "copy-start", "copy-done", "call-start", "call-done", "async-start", "async-update", "async-done",
    "custom-call-update", "custom-call-done",
    "send", "send-done", "recv", "recv-done",
})
_CONTROL_FLOW = frozenset({"while", "conditional", "call"})
_TRANSFER_OPS = frozenset({"copy", "dynamic-slice", "dynamic-update-slice"})
# Custom calls that run on the host: XLA's host compute (``HostExecute``) and
# Python callbacks (``jax.pure_callback``, ``io_callback``).
_HOST_CALLBACK_TARGETS = ("HostExecute", "callback", "HostCompute")


@dataclasses.dataclass(frozen=True)
class HloInstruction:
  """One instruction of an HLO computation, as :func:`parse_hlo` reads it.

  Attributes:
    name: its name, without the ``%``.
    shape: its result shape as written (``bf16[4,8]{1,0:S(5)}``, a tuple...).
    opcode: ``fusion``, ``copy-start``, ``while``...
    rest: the text after the opcode's ``(``: operands, then attributes.
  """

  name: str
  shape: str
  opcode: str
  rest: str

  @property
  def operands(self) -> list[str]:
    """The names of its operands, in order."""
    return _operand_names(self.rest)

  @property
  def called(self) -> list[str]:
    """The computations it calls (fusion, loop body and condition, branches, reducers)."""
    return _called(self.rest)

  @property
  def trip_count(self) -> int:
    """A ``while`` op's known trip count, 1 when XLA does not know it."""
    return _trip_count(self.rest)

  @property
  def target(self) -> str | None:
    """A custom call's target (``__cublas$gemm``...), None for other ops."""
    match = re.search(r'custom_call_target="([^"]+)"', self.rest)
    return match.group(1) if match else None


def array_bytes(text: str) -> int:
  """Bytes of every array shape in ``text`` (a shape or a tuple of shapes)."""
  total = 0.0
  for dtype, dims, _ in _ARRAY.findall(text):
    n = 1
    for d in dims.split(","):
      if d:
        n *= int(d)
    total += n * _DTYPE_BYTES[dtype]
  return int(total)


def in_host_memory(shape: str) -> list[bool]:
  """Per array in ``shape``: is its layout in host memory space ``S(5)``?"""
  return ["S(5)" in (layout or "") for _, _, layout in _ARRAY.findall(shape)]


def array_dims(shape: str) -> list[tuple[int, ...]]:
  """The dimensions of every array in ``shape`` (a shape or a tuple of shapes), in order."""
  return [tuple(int(d) for d in dims.split(",") if d) for _, dims, _ in _ARRAY.findall(shape)]


def parse_hlo(text: str) -> tuple[dict[str, list[HloInstruction]], str | None]:
  """Splits HLO module text into computations of instructions; returns them and the entry's name.

  A scheduled module (``is_scheduled=true``, as ``hlo_modules()`` of a
  compiled executable gives it) lists each computation's instructions in the
  order they run.

  Args:
    text: HLO module text.

  Returns:
    ``({computation name: [HloInstruction, ...]}, entry name or None)``.
  """
  computations: dict[str, list[HloInstruction]] = {}
  entry = None
  current = None
  for line in text.splitlines():
    if current is None:
      m = _COMPUTATION.match(line)
      if m and not line.startswith("HloModule"):
        current = m.group(2)
        computations[current] = []
        if m.group(1):
          entry = current
      continue
    if line.startswith("}"):  # "}" or, closing a host computation, '}, execution_thread="host"'
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if m:
      computations[current].append(HloInstruction(*m.groups()))
  return computations, entry


def _operand_names(rest: str) -> list[str]:
  depth, end = 1, len(rest)
  for i, c in enumerate(rest):
    depth += (c == "(") - (c == ")")
    if depth == 0:
      end = i
      break
  return re.findall(r"%([\w.\-]+)", rest[:end])


def _called(rest: str) -> list[str]:
  names = []
  for key in ("calls", "to_apply", "body", "condition", "branch_computations", "true_computation",
              "false_computation"):
    for m in re.finditer(key + r"=\{?([^,}\s]+(?:,\s*%[\w.\-]+)*)\}?", rest):
      names += re.findall(r"%?([\w.\-]+)", m.group(1))
  return names


@dataclasses.dataclass(frozen=True)
class HloSummary:
  """What the optimized HLO launches. See :func:`count_hlo` for the rules."""

  kernels: int
  triton_launches: int
  transfers: int
  host_calls: int
  kernel_bytes: int
  kernel_ops: dict
  transfer_bytes: int = 0
  to_device_bytes: int = 0
  to_host_bytes: int = 0
  collective_bytes: dict = dataclasses.field(default_factory=dict)


def collective_of(ins: HloInstruction, computations: dict) -> HloInstruction | None:
  """The collective ``ins`` starts or is (itself, or the one an ``async-start`` wraps), None for others."""
  if ins.opcode.removesuffix("-start") in COLLECTIVE_OPS:
    return ins
  if ins.opcode == "async-start":
    return next((i for c in ins.called for i in computations.get(c, []) if i.opcode in COLLECTIVE_OPS), None)
  return None


def collective_payload(ins: HloInstruction, shapes: dict) -> int:
  """The bytes a collective (or its ``-start`` / ``async-start``) gathers, scatters or reduces on one GPU.

  The larger of its operands and its result: an asynchronous start's tuple
  shape holds both, each counted alone.
  """
  parts = _top_level(ins.shape) + [shapes.get(o, "") for o in ins.operands]
  return max(array_bytes(part) for part in parts)


def _top_level(shape: str) -> list[str]:
  """The elements of a tuple shape ``(a, (b, c), d)``; ``[shape]`` for an array shape."""
  shape = shape.strip()
  if not shape.startswith("("):
    return [shape]
  parts, depth, begin = [], 0, 1
  for i, c in enumerate(shape):
    depth += (c in "({[") - (c in ")}]")
    if (c == "," and depth == 1) or (depth == 0 and c == ")"):
      parts.append(shape[begin:i].strip())
      begin = i + 1
  return [p for p in parts if p]


def _trip_count(rest: str) -> int:
  """A ``while`` op's known trip count (its backend config), 1 when XLA does not know it."""
  match = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
  return int(match.group(1)) if match else 1


def _moved(nbytes: int, to_host: bool) -> tuple[int, int]:
  """``(to_device, to_host)`` bytes of one transfer."""
  return (0, nbytes) if to_host else (nbytes, 0)


def transfer_of(ins: HloInstruction, shapes: dict) -> tuple[int, int] | None:
  """``(to_device, to_host)`` bytes a transfer instruction moves across the link, None if it is no transfer."""
  operands = [shapes.get(o, "") for o in _operand_names(ins.rest)]
  if ins.opcode == "copy-start":  # (destination, source, context)
    destination = _top_level(ins.shape)[0]
    return _moved(array_bytes(operands[0] if operands else ""), any(in_host_memory(destination)))
  wrapped = re.search(r"calls=%?wrapped_dynamic-(update-)?slice", ins.rest) if ins.opcode == "fusion-start" else None
  if wrapped:
    # An asynchronous slice copy: ((operands...), result, context).
    parts = _top_level(ins.shape)
    result = parts[1] if len(parts) > 2 else ""
    # Read from the computation it calls: an operand's name may say "dynamic-update-slice" too (a slice of
    # a buffer just updated in place).
    if wrapped.group(1):  # the update (operand 1) into a buffer in the result's memory
      update = operands[1] if len(operands) > 1 else ""
      if any(in_host_memory(update)) != any(in_host_memory(result)):
        return _moved(array_bytes(update), any(in_host_memory(result)))
      return None
    source = operands[0] if operands else ""
    if any(in_host_memory(source)) != any(in_host_memory(result)):
      return _moved(array_bytes(result), any(in_host_memory(result)))
    return None
  if ins.opcode in _TRANSFER_OPS:
    spaces = set(in_host_memory(ins.shape)) | {h for o in operands for h in in_host_memory(o)}
    if len(spaces) > 1:
      moved = operands[1:2] if ins.opcode == "dynamic-update-slice" else [ins.shape]
      return _moved(sum(array_bytes(x) for x in moved), any(in_host_memory(ins.shape)))
  return None


def is_host_call(ins: HloInstruction) -> bool:
  """Does ``ins`` run a computation on the host CPU?

  XLA's host compute (a ``call``/``call-start`` whose backend config says
  ``DEVICE_TYPE_HOST``, or a custom call to ``HostExecute``) and custom calls
  to Python callbacks (``jax.pure_callback``, ``io_callback``).
  """
  host_device = "DEVICE_TYPE_HOST" in ins.rest
  if ins.opcode in ("call-start", "call"):
    return host_device
  return ins.opcode in ("custom-call", "custom-call-start") and (
      host_device or any(t in (ins.target or "") for t in _HOST_CALLBACK_TARGETS))


def host_call_bytes(ins: HloInstruction) -> tuple[int, int]:
  """``(to_device, to_host)`` bytes a host call reads from and writes into device memory.

  An asynchronous host call's shape is ``((inputs...), (outputs...), context)``:
  an input in device memory is read across the link, an output in device
  memory is written across it (a new param the host computed, say).
  """
  parts = _top_level(ins.shape)
  if ins.opcode not in ("call-start", "custom-call-start") or len(parts) < 2:
    return 0, 0
  device_bytes = lambda group: sum(array_bytes(x) for x in _top_level(group) if not any(in_host_memory(x)))
  return device_bytes(parts[1]), device_bytes(parts[0])


def count_hlo(text: str) -> HloSummary:
  """Counts the device kernels, transfers and host calls of an optimized HLO module.

  Rules:

  * The entry computation and the bodies of its control flow (``while``,
    ``conditional``, ``call``) run on the device. Each of their instructions
    is a kernel launch unless it is bookkeeping (parameter, constant, tuple,
    get-tuple-element, bitcast, barrier), control flow, or asynchronous
    (``copy-start``/``copy-done``, asynchronous slice copies, host
    ``call-start``/``call-done``, send/recv). So fusions, custom calls
    (cuBLAS, cuDNN, Triton — the Pallas kernels are
    ``__gpu$xla.gpu.triton`` custom calls), collectives and any unfused op (a
    ``copy``, a ``sort``) each count one. Counts are static: an instruction
    inside a ``while`` body counts once, not per trip.
  * ``triton_launches``: custom calls to ``__gpu$xla.gpu.triton`` and fusions
    that XLA emits with Triton (``"kind":"__triton..."``).
  * ``transfers``: host<->device copies: every ``copy-start`` (XLA:GPU emits
    them only between memory spaces), asynchronous ``dynamic-slice`` /
    ``dynamic-update-slice`` copies between the memory spaces (a layer's slice
    brought in from a stack in host memory, a gradient slice written out), and
    synchronous ``copy``, ``dynamic-slice`` and ``dynamic-update-slice`` ops
    whose operands and result are not all in the same memory space (layout
    ``S(5)`` is host memory). Synchronous ones are kernels too.
  * ``host_calls``: computations run on the host CPU: XLA host compute
    (``custom-call-start`` to ``HostExecute``, or any call whose backend config
    says ``DEVICE_TYPE_HOST``) and custom calls to Python host callbacks
    (``jax.pure_callback``, ``io_callback``). Not kernels.
  * ``kernel_ops`` names a ``copy`` between two host-memory buffers
    ``"copy (host->host)"``: a copy of host state that a program updating it
    in place would not make.
  * ``kernel_bytes``: over the kernels, the bytes of their operands plus their
    results: a compile-time proxy for the memory traffic. It overcounts
    in-place updates of part of a buffer and ignores caching.
  * ``collective_bytes``: per collective (``all-gather``, ``reduce-scatter``,
    ``all-reduce``...), the bytes of the buffers it gathers, scatters or
    reduces on each GPU (the larger of its operands and its result), an
    instruction inside a ``while`` body once per trip.
  * ``to_device_bytes``, ``to_host_bytes``: the bytes that cross the
    host-device link per step in each direction: each transfer's payload (a
    ``copy-start``'s operand; a slice copy's slice; a synchronous transfer's
    result, or the update of a ``dynamic-update-slice``), plus what host calls
    read from and write into device memory; an instruction inside a ``while``
    body counts once per trip (the loop's known trip count).
    ``transfer_bytes`` is their sum.

  Args:
    text: the optimized HLO module(s) as text (``exe.hlo_modules()``'s
      ``to_string()``).

  Returns:
    An :class:`HloSummary`; ``kernel_ops`` maps each kernel opcode (custom
    calls by target) to its count.
  """
  computations, entry = parse_hlo(text)
  kernels = triton = transfers = host_calls = kernel_bytes = to_device = to_host = 0
  ops: dict[str, int] = {}
  collectives: dict[str, int] = {}
  if entry is None:
    return HloSummary(0, 0, 0, 0, 0, {})
  seen = set()
  todo = [(entry, 1)]  # (computation, trips per step)
  while todo:
    name, trips = todo.pop()
    if name in seen or name not in computations:
      continue
    seen.add(name)
    shapes = {ins.name: ins.shape for ins in computations[name]}
    for ins in computations[name]:
      if is_host_call(ins):
        host_calls += 1
        down, up = host_call_bytes(ins)
        to_device, to_host = to_device + trips * down, to_host + trips * up
        continue
      if ins.opcode in _CONTROL_FLOW:
        inner = trips * _trip_count(ins.rest) if ins.opcode == "while" else trips
        todo += [(called, inner) for called in _called(ins.rest)]
        continue
      collective = collective_of(ins, computations)
      if collective is not None:
        key = collective.opcode.removesuffix("-start")
        collectives[key] = collectives.get(key, 0) + trips * collective_payload(ins, shapes)
      moved = transfer_of(ins, shapes)
      if moved is not None:
        transfers += 1
        to_device, to_host = to_device + trips * moved[0], to_host + trips * moved[1]
      if ins.opcode in _NOT_KERNELS or ins.opcode in ("fusion-done",) or (
          ins.opcode == "fusion-start" and moved is not None):
        continue
      operands = [shapes.get(o, "") for o in _operand_names(ins.rest)]
      if ins.opcode in ("custom-call", "custom-call-start"):
        key = f"custom-call {ins.target or '?'}"
        triton += ins.target == "__gpu$xla.gpu.triton"
      else:
        key = ins.opcode
        triton += ins.opcode == "fusion" and '"kind":"__triton' in ins.rest
      if ins.opcode in _TRANSFER_OPS and {h for x in [ins.shape] + operands for h in in_host_memory(x)} == {True}:
        key += " (host->host)"
      kernels += 1
      ops[key] = ops.get(key, 0) + 1
      kernel_bytes += array_bytes(ins.shape) + sum(array_bytes(o) for o in operands)
  return HloSummary(kernels, triton, transfers, host_calls, kernel_bytes, dict(sorted(ops.items())),
                    to_device + to_host, to_device, to_host, dict(sorted(collectives.items())))


@dataclasses.dataclass(frozen=True)
class LoopTransfers:
  """The host->device slice copies of one ``while`` body, in schedule order (:func:`loop_transfers`).

  Attributes:
    body: the body computation's name.
    trips: its known trip count (1 when unknown).
    fetches: the asynchronous slice copies into device memory it starts.
    overlapped: how many of them have a device kernel scheduled between their
      start and their done: the copy runs while the device computes.
    carried: how many of them are used only in the next trip (their result
      goes to the loop's carry, not to this trip's arithmetic): a prefetch.
  """

  body: str
  trips: int
  fetches: int
  overlapped: int
  carried: int


def loop_transfers(text: str) -> list[LoopTransfers]:
  """The slice copies host -> device of each ``while`` body of an optimized (scheduled) HLO module.

  XLA schedules a module before it emits it, so the order of a computation's
  instructions in the text is the order they run in. A body that fetches the
  next trip's slice while it computes on this trip's shows ``carried`` copies
  that are ``overlapped``.

  Args:
    text: the optimized HLO module(s) as text.

  Returns:
    One :class:`LoopTransfers` per ``while`` body that fetches anything.
  """
  computations, _ = parse_hlo(text)
  trips = {}
  for instructions in computations.values():
    for ins in instructions:
      if ins.opcode == "while":
        for body in re.findall(r"body=%?([\w.\-]+)", ins.rest):
          trips[body] = _trip_count(ins.rest)
  out = []
  for body, count in trips.items():
    instructions = computations.get(body, [])
    shapes = {ins.name: ins.shape for ins in instructions}
    users: dict[str, list[str]] = {}
    for ins in instructions:
      for operand in _operand_names(ins.rest):
        users.setdefault(operand, []).append(ins.name)
    root = instructions[-1].name if instructions else None
    position = {ins.name: k for k, ins in enumerate(instructions)}
    fetches = overlapped = carried = 0
    for k, ins in enumerate(instructions):
      moved = transfer_of(ins, shapes) if ins.opcode == "fusion-start" else None
      if not moved or not moved[0]:
        continue
      fetches += 1
      done = next((u for u in users.get(ins.name, []) if u.startswith(ins.name.replace("-start", "-done"))
                   or "done" in u), None)
      if done is None:
        continue
      between = instructions[k + 1:position[done]]
      overlapped += any(i.opcode in ("fusion", "custom-call") and "wrapped_dynamic" not in i.rest for i in between)
      # Follow bitcasts and copies: a prefetch reaches the root tuple (the next trip) without arithmetic.
      frontier, reaches_root, computes = [done], False, False
      while frontier:
        name = frontier.pop()
        for user in users.get(name, []):
          opcode = instructions[position[user]].opcode
          if user == root:
            reaches_root = True
          elif opcode in ("bitcast", "copy", "get-tuple-element", "tuple"):
            frontier.append(user)
          else:
            computes = True
      carried += reaches_root and not computes
    if fetches:
      out.append(LoopTransfers(body, count, fetches, overlapped, carried))
  return out


# --- the report ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GpuCompileReport:
  """What XLA:GPU compiled for a target, from :func:`compile_for_gpu`.

  Attributes:
    target: the target name or path.
    num_devices: the number of GPUs compiled for (SPMD partitions).
    device_argument_bytes, device_output_bytes, device_temp_bytes,
      device_alias_bytes: ``get_compiled_memory_stats()`` of device memory
      (per device): arguments, results, scratch, and results that reuse a
      donated argument's buffer.
    host_argument_bytes, host_output_bytes, host_temp_bytes, host_alias_bytes:
      the same for host memory (``pinned_host``).
    device_peak_bytes: arguments + results + temp - aliased: the device
      memory the executable needs at once (an upper bound XLA plans for).
    host_peak_bytes: the same for host memory.
    kernels, triton_launches, transfers, host_calls, kernel_bytes,
      kernel_ops, transfer_bytes, to_device_bytes, to_host_bytes,
      collective_bytes: from the optimized HLO, see :func:`count_hlo`.
    warnings: the host-offloader fallback lines XLA logged ("does device
      compute in host memory space ... Converting into host compute"): each is
      a value in host memory computed on slowly by the host.
    log: everything XLA wrote to stderr during the compile.
    hlo: the optimized HLO text.
    parameter_shardings, output_shardings: the compiled program's sharding
      of each (flattened) argument it kept and of each result, as XLA
      writes them (``"{devices=[1,8,1]<=[8]}"``, ``"{replicated}"``): a
      result replicated where its argument was split means every GPU holds
      it whole.
  """

  target: str
  num_devices: int
  device_argument_bytes: int
  device_output_bytes: int
  device_temp_bytes: int
  device_alias_bytes: int
  host_argument_bytes: int
  host_output_bytes: int
  host_temp_bytes: int
  host_alias_bytes: int
  kernels: int
  triton_launches: int
  transfers: int
  host_calls: int
  kernel_bytes: int
  kernel_ops: dict
  warnings: tuple[str, ...]
  log: str = dataclasses.field(repr=False)
  hlo: str = dataclasses.field(repr=False)
  transfer_bytes: int = 0
  to_device_bytes: int = 0
  to_host_bytes: int = 0
  parameter_shardings: tuple[str, ...] = ()
  output_shardings: tuple[str, ...] = ()
  collective_bytes: dict = dataclasses.field(default_factory=dict)

  @property
  def device_peak_bytes(self) -> int:
    return (self.device_argument_bytes + self.device_output_bytes + self.device_temp_bytes
            - self.device_alias_bytes)

  @property
  def host_peak_bytes(self) -> int:
    return self.host_argument_bytes + self.host_output_bytes + self.host_temp_bytes - self.host_alias_bytes

  def step_time(self, hardware: Any = None) -> Any:
    """The step time estimated from this program's schedule: :func:`optax_hybrid.step_time.estimate`.

    Args:
      hardware: a :class:`optax_hybrid.step_time.Hardware`, or a target
        name; None: this report's target when it is one of :data:`TARGETS`.

    Returns:
      A :class:`optax_hybrid.step_time.StepTime`.
    """
    from optax_hybrid import step_time  # it reads the HLO with this module's functions

    if hardware is None:
      if self.target not in step_time.HARDWARE:
        raise ValueError(f"No hardware figures for target {self.target!r}: pass `hardware=` "
                         "(an optax_hybrid.step_time.Hardware).")
      hardware = self.target
    return step_time.estimate(self.hlo, hardware)

  def as_dict(self) -> dict:
    """The figures as a JSON-friendly dict (no HLO, no log)."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("hlo", "log")}
    out["warnings"] = list(self.warnings)
    out["parameter_shardings"], out["output_shardings"] = list(self.parameter_shardings), list(self.output_shardings)
    out["device_peak_bytes"] = self.device_peak_bytes
    out["host_peak_bytes"] = self.host_peak_bytes
    return out


def _jitted(fn: Callable, donate_argnums: Sequence[int] | int, jit_kwargs: dict) -> Any:
  if hasattr(fn, "trace") and hasattr(fn, "lower"):
    # `donate_argnums=0` donates argument 0: compare with "none given", not with falsiness.
    donated = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    if donated or jit_kwargs:
      raise ValueError("`fn` is already jitted: pass `donate_argnums` and jit options to `jax.jit` itself, "
                       "or pass the plain function.")
    return fn
  return jax.jit(fn, donate_argnums=donate_argnums, **jit_kwargs)


def compile_for_gpu(fn: Callable, *args: Any, target: str = "h100", num_devices: int = 1,
                    donate_argnums: Sequence[int] | int = (), **jit_kwargs: Any) -> GpuCompileReport:
  """Compiles ``fn(*args)`` for a GPU target without a GPU and reports what XLA planned.

  ``fn`` is traced on the running backend with ``args`` (arrays or
  ``jax.ShapeDtypeStruct`` s, whose shardings may name ``pinned_host``),
  lowered with ``lowering_platforms=("cuda",)``, and compiled by the
  compile-only client of a deviceless CUDA topology of ``num_devices`` GPUs.
  Trace-time decisions that read the running backend (``jax.default_backend()``)
  see the CPU; decisions made with ``lax.platform_dependent`` follow CUDA.

  Args:
    fn: the function, plain or already ``jax.jit`` ted (then without
      ``donate_argnums`` and ``jit_kwargs``).
    *args: its arguments. For ``num_devices > 1``, shard them over
      ``num_devices`` devices of the running backend (on a CPU:
      ``XLA_FLAGS=--xla_force_host_platform_device_count=N``); device ``i`` of
      the running backend stands for GPU ``i``.
    target: ``"h100"``, ``"h200"`` or a ``GpuTargetConfig`` text proto file.
    num_devices: GPUs in the topology (``"1x1xN"``), one SPMD partition each.
    donate_argnums: as for ``jax.jit``.
    **jit_kwargs: other ``jax.jit`` options (``in_shardings``, ``static_argnums``...).

  Returns:
    A :class:`GpuCompileReport`.

  Raises:
    GpuCompileError: the CUDA plugin is missing or not of jaxlib's version
      (the message has the pip command), or the topology cannot be built.
    ValueError: unknown target; fewer running devices than ``num_devices``;
      a jitted ``fn`` with jit options.
    jax.errors.JaxRuntimeError: XLA:GPU rejected the program (e.g. ``E1200:
      CompileTimeHostOffloadOutputLocationMismatch``). An internal XLA check
      failure aborts the process instead.

  Example::

    tx = optax_hybrid.hybrid_adamw(1e-3, tiers="host")
    params = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32,
                                        sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}
    state = tx.init(params)  # not jax.eval_shape(tx.init, ...): JAX 0.10 drops its memory kinds
    report = compile_for_gpu(tx.step, params, state, params, target="h200", donate_argnums=(0, 1))
    report.device_peak_bytes, report.host_temp_bytes, report.warnings
  """
  if not isinstance(num_devices, int) or num_devices < 1:
    raise ValueError(f"`num_devices` must be a positive int; got {num_devices!r}.")
  if num_devices > len(jax.devices()):
    raise ValueError(f"Compiling for {num_devices} GPUs traces on {num_devices} devices of the running backend, "
                     f"which has {len(jax.devices())}: set XLA_FLAGS=--xla_force_host_platform_device_count="
                     f"{num_devices} before JAX starts.")
  _topology_devices(load_target(target), num_devices)  # fail early: bad target, no plugin
  # Declared so that the optimizer's kernel choice is CUDA's (kernels.lowering_for).
  with lowering_for("cuda"):
    lowered = _jitted(fn, donate_argnums, jit_kwargs).trace(*args).lower(lowering_platforms=("cuda",))
  return compile_lowered(lowered, target=target, num_devices=num_devices)


def compile_lowered(lowered: Any, target: str = "h100", num_devices: int = 1) -> GpuCompileReport:
  """Compiles an already lowered function for a GPU target (see :func:`compile_for_gpu`).

  Lower once and compile for several targets: ``with
  optax_hybrid.kernels.lowering_for("cuda"): lowered =
  jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` (the
  declaration makes the optimizer choose CUDA's kernels while tracing on the
  CPU).

  Args:
    lowered: a ``jax.stages.Lowered`` lowered for ``"cuda"``.
    target: ``"h100"``, ``"h200"`` or a ``GpuTargetConfig`` text proto file.
    num_devices: GPUs in the topology; the function must have been traced on
      as many devices.

  Returns:
    A :class:`GpuCompileReport`.

  Raises:
    As :func:`compile_for_gpu`.
  """
  devices = _topology_devices(load_target(target), num_devices)
  module = lowered.compiler_ir("stablehlo")
  options = _compat.xla_compile_options(num_devices, devices)
  log: list = []
  try:
    with _captured_stderr() as log:
      executable = devices[0].client.compile(module, executable_devices=_compat.xla_device_list(devices),
                                             compile_options=options)
  except Exception as e:
    if log and log[0].strip():
      e.add_note("XLA's log during the compile:\n" + log[0].strip())
    raise
  log = log[0] if log else ""
  stats = executable.get_compiled_memory_stats()
  hlo = "\n".join(m.to_string() for m in executable.hlo_modules())
  summary = count_hlo(hlo)
  warnings = tuple(line for line in log.splitlines() if any(p in line for p in _FALLBACK_PATTERNS))
  return GpuCompileReport(
      target=target, num_devices=num_devices,
      device_argument_bytes=stats.argument_size_in_bytes, device_output_bytes=stats.output_size_in_bytes,
      device_temp_bytes=stats.temp_size_in_bytes, device_alias_bytes=stats.alias_size_in_bytes,
      host_argument_bytes=stats.host_argument_size_in_bytes, host_output_bytes=stats.host_output_size_in_bytes,
      host_temp_bytes=stats.host_temp_size_in_bytes, host_alias_bytes=stats.host_alias_size_in_bytes,
      kernels=summary.kernels, triton_launches=summary.triton_launches, transfers=summary.transfers,
      host_calls=summary.host_calls, kernel_bytes=summary.kernel_bytes, kernel_ops=summary.kernel_ops,
      transfer_bytes=summary.transfer_bytes, to_device_bytes=summary.to_device_bytes,
      to_host_bytes=summary.to_host_bytes, collective_bytes=summary.collective_bytes,
      parameter_shardings=_sharding_texts(executable.get_parameter_shardings()),
      output_shardings=_sharding_texts(executable.get_output_shardings()),
      warnings=warnings, log=log, hlo=hlo)


def _sharding_texts(op_shardings: Any) -> tuple[str, ...]:
  """XLA's text of each ``OpSharding`` an executable reports (none for a program of one device)."""
  return tuple(str(_compat.hlo_sharding(op)) for op in op_shardings or ())
