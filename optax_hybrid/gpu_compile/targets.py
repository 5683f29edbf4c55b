"""The GPUs :mod:`optax_hybrid.gpu_compile` compiles for: ``GpuTargetConfig`` text protos.

The H100 and H200 targets ship in ``gpu_targets/`` beside this module; a
target may also be any ``GpuTargetConfig`` text proto file.
"""

from __future__ import annotations

import os
import re

__all__ = ["TARGETS", "load_target", "rematerialization_limit", "target_device_memory_bytes"]

_TARGET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")
TARGETS = {"h100": "h100.txtpb", "h200": "h200.txtpb"}
"""Target names :func:`~optax_hybrid.gpu_compile.compile_for_gpu` accepts, and their ``GpuTargetConfig`` files."""


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


def rematerialization_limit(target: str, io_bytes: float) -> float:
  r"""The scratch bytes above which XLA:GPU recomputes values to bring a program under its memory limit.

  XLA:GPU's limit for its scheduler and its rematerialization pass
  (``GetSchedulerMemoryLimit`` in XLA's ``gpu_hlo_schedule.cc``):

  .. math:: s\,(0.8\,M - \mathrm{io})

  with :math:`M` the target's device memory, io the program's device inputs
  and outputs (a donated input and the output that reuses it counted once)
  and :math:`s` the slop factor (``--xla_gpu_memory_limit_slop_factor``, read
  from ``XLA_FLAGS``; 95% by default). A program whose scratch
  (``GpuCompileReport.device_temp_bytes``) is above it gets recomputation
  (more flops) from XLA, even with room left on the device. XLA measures the
  scratch before its last passes, so near the limit it may recompute a little
  below it.

  Args:
    target: as for :func:`load_target`.
    io_bytes: the device bytes of the program's inputs and outputs
      (``device_peak_bytes - device_temp_bytes``).

  Returns:
    The limit in bytes (negative when the inputs and outputs alone exceed it).
  """
  slop = re.search(r"--xla_gpu_memory_limit_slop_factor=(\d+)", os.environ.get("XLA_FLAGS", ""))
  return (int(slop.group(1)) if slop else 95) / 100 * (0.8 * target_device_memory_bytes(target) - io_bytes)
