"""Kernels that carry out the fused AdamW step over a list of leaves.

Every kernel has the signature of :func:`reference.update_leaves` and is tested
against it. ``"xla"`` is the reference rule itself, one fused XLA loop per leaf.
``"native"`` is the compiled CPU kernel (:mod:`native_cpu`), one custom call
for all CPU-resident leaves. ``"pallas"`` is the fused GPU kernel
(:mod:`pallas_gpu`), one launch per 64 leaves, run in Pallas interpret mode off
the GPU. ``"auto"`` picks the Pallas kernel on a GPU, and on a CPU the native
kernel for the fused ``tx.step`` where it is built (see :func:`resolve_kernel`).

The contract for any other kernel: it must honour every field of
:class:`AdamScalars` (``step_ok`` included), and hand the leaves it cannot take
(complex dtypes, for example) to :func:`reference.update_leaves` so that every
leaf is always updated by the same rule (:func:`reference.with_reference_for_the_rest`
does the split and the merge).
"""

from __future__ import annotations

from typing import Callable

import jax

from optax_hybrid.kernels import native_cpu, pallas_gpu, reference
from optax_hybrid.kernels.reference import AdamScalars, step_scalars

KERNEL_NAMES = ("auto", "xla", "native", "pallas")


def check_kernel_name(kernel: str) -> str:
  """Validates a ``kernel=`` argument without touching a backend.

  Raises:
    ValueError: for an unknown name.
  """
  if not isinstance(kernel, str) or kernel not in KERNEL_NAMES:
    raise ValueError(
        f"hybrid_adamw: unknown `kernel`={kernel!r}; accepted values are "
        f"{', '.join(repr(k) for k in KERNEL_NAMES)}."
    )
  return kernel


def resolve_kernel(kernel: str, *, fused: bool = False) -> Callable:
  """Maps a ``kernel=`` argument to the function that runs the step.

  ``fused`` says which path asks: ``tx.step`` (new params written in place) or
  the Optax ``update`` contract (an update returned). ``"auto"`` picks what
  measures fastest on a CPU (``benchmarks/step.py``): the native kernel for the
  fused step; the XLA rule for ``update``, where XLA fuses the caller's
  ``p + u`` into the step and the custom call would write a full-size update
  buffer instead. On a GPU backend ``"auto"`` is the Pallas kernel for both.

  Both custom kernels are single-device code; with several devices
  :func:`optax_hybrid.placement.run_placed_update` runs them per shard under
  ``shard_map`` (or uses the XLA rule where the placement is unknown).

  Raises:
    ValueError: for an unknown name.
  """
  check_kernel_name(kernel)
  if kernel == "xla":
    return reference.update_leaves
  if kernel == "pallas" or (kernel == "auto" and jax.default_backend() == "gpu"):
    return pallas_gpu.update_leaves
  if kernel == "auto" and not fused:
    return reference.update_leaves
  # The compiled CPU kernel where it is built. It only runs for CPU-resident
  # leaves; elsewhere it hands over to the XLA rule.
  if native_cpu.available():
    return native_cpu.update_leaves
  if kernel == "native" or jax.default_backend() == "cpu":
    native_cpu.warn_fallback_once()
  return reference.update_leaves


__all__ = ["AdamScalars", "KERNEL_NAMES", "check_kernel_name", "native_cpu", "pallas_gpu", "reference", "resolve_kernel", "step_scalars"]
