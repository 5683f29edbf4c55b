"""Kernels that carry out the fused AdamW step over a list of leaves.

Every kernel has the signature of :func:`reference.update_leaves` and is tested
against it. ``"xla"`` is the reference rule itself, one fused XLA loop per leaf.

The contract for any other kernel: it must honour every field of
:class:`AdamScalars` (``step_ok`` included), and hand the leaves it cannot take
(complex dtypes, for example) to :func:`reference.update_leaves` so that every
leaf is always updated by the same rule.
"""

from __future__ import annotations

from typing import Callable

from optax_hybrid.kernels import reference
from optax_hybrid.kernels.reference import AdamScalars, step_scalars

KERNEL_NAMES = ("auto", "xla", "pallas")

_IMPLEMENTED: dict[str, Callable] = {"xla": reference.update_leaves}


def resolve_kernel(kernel: str) -> Callable:
  """Maps a ``kernel=`` argument to the function that runs the step.

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
  if kernel == "auto":
    kernel = "xla"
  return _IMPLEMENTED[kernel]


__all__ = ["AdamScalars", "KERNEL_NAMES", "reference", "resolve_kernel", "step_scalars"]
