"""Kernels that carry out the fused AdamW step over a list of leaves.

Every kernel has the signature of :func:`reference.update_leaves` and is tested
against it. ``"xla"`` is the reference rule itself, one fused XLA loop per leaf.
``"native"`` is the compiled CPU kernel (:mod:`native_cpu`), one custom call
for all CPU-resident leaves; ``"auto"`` picks it for the fused ``tx.step``
where it is built (see :func:`resolve_kernel`).

The contract for any other kernel: it must honour every field of
:class:`AdamScalars` (``step_ok`` included), and hand the leaves it cannot take
(complex dtypes, for example) to :func:`reference.update_leaves` so that every
leaf is always updated by the same rule.
"""

from __future__ import annotations

from typing import Callable

import jax

from optax_hybrid.kernels import native_cpu, reference
from optax_hybrid.kernels.reference import AdamScalars, step_scalars

KERNEL_NAMES = ("auto", "xla", "native", "pallas")


def resolve_kernel(kernel: str, *, fused: bool = False) -> Callable:
  """Maps a ``kernel=`` argument to the function that runs the step.

  ``fused`` says which path asks: ``tx.step`` (new params written in place) or
  the Optax ``update`` contract (an update returned). ``"auto"`` picks what
  measures fastest on a CPU (``benchmarks/step.py``): the native kernel for the
  fused step; the XLA rule for ``update``, where XLA fuses the caller's
  ``p + u`` into the step and the custom call would write a full-size update
  buffer instead.

  Raises:
    ValueError: for an unknown name.
    NotImplementedError: for ``"pallas"``, until the Pallas kernel lands.
  """
  if not isinstance(kernel, str) or kernel not in KERNEL_NAMES:
    raise ValueError(
        f"hybrid_adamw: unknown `kernel`={kernel!r}; accepted values are "
        f"{', '.join(repr(k) for k in KERNEL_NAMES)}."
    )
  if kernel == "pallas":
    raise NotImplementedError(
        "hybrid_adamw: kernel='pallas' is not available yet (the fused Pallas "
        "GPU kernel is a separate piece of work); use kernel='xla' or "
        "kernel='auto'."
    )
  if kernel == "xla" or (kernel == "auto" and not fused):
    return reference.update_leaves
  # The compiled CPU kernel where it is built. It only runs for CPU-resident
  # leaves; elsewhere it hands over to the XLA rule. The custom call has no
  # sharding rule yet, so XLA would gather sharded operands onto every device:
  # with several devices the XLA rule is used instead.
  if jax.device_count() > 1:
    return reference.update_leaves
  if native_cpu.available():
    return native_cpu.update_leaves
  if kernel == "native" or jax.default_backend() == "cpu":
    native_cpu.warn_fallback_once()
  return reference.update_leaves


__all__ = ["AdamScalars", "KERNEL_NAMES", "reference", "resolve_kernel", "step_scalars"]
