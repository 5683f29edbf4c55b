"""Compiling a JAX function with the compile-only client of a deviceless CUDA topology."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Any, Callable, Iterator, Sequence

import jax

from optax_hybrid import _compat
from optax_hybrid.gpu_compile.plugin import topology_devices
from optax_hybrid.gpu_compile.report import GpuCompileReport, report_of
from optax_hybrid.gpu_compile.targets import load_target
from optax_hybrid.gpu_compile.thunks import read_command_buffers
from optax_hybrid.kernels.contract import lowering_for

__all__ = ["compile_for_gpu", "compile_lowered"]

# XLA's pass that recomputes values to bring a program's scratch under XLA's memory limit (rematerialization_limit).
_REMATERIALIZATION = "rematerialization"


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
                    donate_argnums: Sequence[int] | int = (), recompute: bool = True,
                    **jit_kwargs: Any) -> GpuCompileReport:
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
    recompute: whether XLA may recompute values to fit the device, as it
      does on the GPU (its rematerialization pass, on by default). False:
      the memory plan of the program as written, whatever it needs, and its
      flops as written: what a placement costs before XLA trades flops for
      memory.
    **jit_kwargs: other ``jax.jit`` options (``in_shardings``, ``static_argnums``...).

  Returns:
    A :class:`GpuCompileReport`.

  Raises:
    GpuCompileError: the CUDA plugin is missing or not of jaxlib's version
      (the message has the pip command), or the topology cannot be built.
    ValueError: unknown target; fewer running devices than ``num_devices``;
      a jitted ``fn`` with jit options; ``recompute`` not a bool.
    jax.errors.JaxRuntimeError: XLA:GPU rejected the program (e.g. ``E1200:
      CompileTimeHostOffloadOutputLocationMismatch``). An internal XLA check
      failure aborts the process instead.

  Example::

    tx = optax_hybrid.hybrid_adamw(1e-3, state_memory_kind="host")
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
  topology_devices(load_target(target), num_devices)  # fail early: bad target, no plugin
  # Declared so that the optimizer's kernel choice is CUDA's (kernels.lowering_for).
  with lowering_for("cuda"):
    lowered = _jitted(fn, donate_argnums, jit_kwargs).trace(*args).lower(lowering_platforms=("cuda",))
  return compile_lowered(lowered, target=target, num_devices=num_devices, recompute=recompute)


def compile_lowered(lowered: Any, target: str = "h100", num_devices: int = 1,
                    recompute: bool = True) -> GpuCompileReport:
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
    recompute: as for :func:`compile_for_gpu`.

  Returns:
    A :class:`GpuCompileReport`.

  Raises:
    As :func:`compile_for_gpu`.
  """
  if not isinstance(recompute, bool):
    raise ValueError(f"`recompute` must be True (XLA may recompute to fit, as on the GPU) or False (the program as "
                     f"written); got {recompute!r}.")
  devices = topology_devices(load_target(target), num_devices)
  module = lowered.compiler_ir("stablehlo")
  log: list = []
  # XLA writes its thunk plan (which kernels run from command buffers) only into a dump: one per compile.
  with tempfile.TemporaryDirectory(prefix="optax_hybrid_gpu_dump_") as dump_dir:
    options = _compat.xla_compile_options(num_devices, devices, dump_to=dump_dir,
                                          disabled_passes=() if recompute else (_REMATERIALIZATION,))
    try:
      with _captured_stderr() as log:
        executable = devices[0].client.compile(module, executable_devices=_compat.xla_device_list(devices),
                                               compile_options=options)
    except Exception as e:
      if log and log[0].strip():
        e.add_note("XLA's log during the compile:\n" + log[0].strip())
      raise
    command_buffers = read_command_buffers(dump_dir)
  log = log[0] if log else ""
  return report_of(executable, target, num_devices, log, command_buffers)
