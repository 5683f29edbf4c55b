"""The GPUs :mod:`optax_hybrid.gpu_compile` compiles for: ``GpuTargetConfig`` text protos.

The H100 and H200 targets ship in ``gpu_targets/`` beside this module; a
target may also be any ``GpuTargetConfig`` text proto file.
"""

from __future__ import annotations

import os
import re

__all__ = ["TARGETS", "load_target", "target_device_memory_bytes"]

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
