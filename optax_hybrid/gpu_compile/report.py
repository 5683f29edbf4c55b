"""What XLA:GPU compiled for a target: :class:`GpuCompileReport`, read from a compiled executable."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from optax_hybrid import _compat
from optax_hybrid.gpu_compile.hlo import HloSummary, count_hlo
from optax_hybrid.gpu_compile.step_time import HARDWARE, Hardware, StepTime, estimate
from optax_hybrid.gpu_compile.thunks import CommandBuffers

__all__ = ["GpuCompileReport", "report_of"]

# The host offloader's fallback: device arithmetic on a host-memory value that
# XLA silently turns into (slow) host compute.
_FALLBACK_PATTERNS = ("does device compute in host memory space", "Converting into host compute")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuCompileReport(HloSummary):
  """What XLA:GPU compiled for a target, from :func:`compile_for_gpu`: its HLO's summary and more.

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
      collective_bytes: the optimized HLO's :class:`HloSummary` (its fields,
      inherited), see :func:`count_hlo`.
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
    command_buffers: the instructions XLA runs from command buffers (CUDA
      graphs), read from the thunk plan it wrote for this compile
      (:mod:`optax_hybrid.gpu_compile.thunks`); None when it wrote none.
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
  warnings: tuple[str, ...]
  log: str = dataclasses.field(repr=False)
  hlo: str = dataclasses.field(repr=False)
  parameter_shardings: tuple[str, ...] = ()
  output_shardings: tuple[str, ...] = ()
  command_buffers: CommandBuffers | None = dataclasses.field(default=None, repr=False)

  @property
  def device_peak_bytes(self) -> int:
    return (self.device_argument_bytes + self.device_output_bytes + self.device_temp_bytes
            - self.device_alias_bytes)

  @property
  def host_peak_bytes(self) -> int:
    return self.host_argument_bytes + self.host_output_bytes + self.host_temp_bytes - self.host_alias_bytes

  def step_time(self, hardware: Hardware | str | None = None) -> StepTime:
    """The step time estimated from this program's schedule: :func:`optax_hybrid.gpu_compile.step_time.estimate`.

    Args:
      hardware: a :class:`optax_hybrid.gpu_compile.step_time.Hardware`, or a
        target name; None: this report's target when it is one of :data:`TARGETS`.

    Returns:
      A :class:`optax_hybrid.gpu_compile.step_time.StepTime`.
    """
    if hardware is None:
      if self.target not in HARDWARE:
        raise ValueError(f"No hardware figures for target {self.target!r}: pass `hardware=` "
                         "(an optax_hybrid.gpu_compile.step_time.Hardware).")
      hardware = self.target
    return estimate(self, hardware)

  def kept_shardings(self, tree: Any) -> bool:
    """Whether the program's first results are split as ``tree``'s leaves (arrays or ``jax.ShapeDtypeStruct`` s
    with shardings) went in, leaf for leaf: a step that returns its params and state where it took them."""
    leaves = jax.tree.leaves(tree)
    return list(self.output_shardings[:len(leaves)]) == [str(_compat.hlo_sharding_of(x)) for x in leaves]

  def as_dict(self) -> dict:
    """The figures as a JSON-friendly dict (no HLO, no log)."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
           if f.name not in ("hlo", "log", "command_buffers")}
    out["warnings"] = list(self.warnings)
    out["parameter_shardings"], out["output_shardings"] = list(self.parameter_shardings), list(self.output_shardings)
    out["device_peak_bytes"] = self.device_peak_bytes
    out["host_peak_bytes"] = self.host_peak_bytes
    return out


def report_of(executable: Any, target: str, num_devices: int, log: str,
              command_buffers: CommandBuffers | None = None) -> GpuCompileReport:
  """The report of a compiled executable: its memory statistics, its optimized HLO's counts, XLA's log.

  Args:
    executable: what the compile-only client compiled (``LoadedExecutable``).
    target, num_devices: what it was compiled for.
    log: what XLA wrote to stderr during the compile.
    command_buffers: what XLA's thunk plan runs from command buffers (None: unknown).

  Returns:
    A :class:`GpuCompileReport`.
  """
  stats = executable.get_compiled_memory_stats()
  hlo = "\n".join(m.to_string() for m in executable.hlo_modules())
  summary = count_hlo(hlo)
  warnings = tuple(line for line in log.splitlines() if any(p in line for p in _FALLBACK_PATTERNS))
  return GpuCompileReport(
      **{f.name: getattr(summary, f.name) for f in dataclasses.fields(HloSummary)},
      target=target, num_devices=num_devices,
      device_argument_bytes=stats.argument_size_in_bytes, device_output_bytes=stats.output_size_in_bytes,
      device_temp_bytes=stats.temp_size_in_bytes, device_alias_bytes=stats.alias_size_in_bytes,
      host_argument_bytes=stats.host_argument_size_in_bytes, host_output_bytes=stats.host_output_size_in_bytes,
      host_temp_bytes=stats.host_temp_size_in_bytes, host_alias_bytes=stats.host_alias_size_in_bytes,
      parameter_shardings=_sharding_texts(executable.get_parameter_shardings()),
      output_shardings=_sharding_texts(executable.get_output_shardings()),
      warnings=warnings, log=log, hlo=hlo, command_buffers=command_buffers)


def _sharding_texts(op_shardings: Any) -> tuple[str, ...]:
  """XLA's text of each ``OpSharding`` an executable reports (none for a program of one device)."""
  return tuple(str(_compat.hlo_sharding(op)) for op in op_shardings or ())
