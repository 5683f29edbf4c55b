"""Kernels that carry out the step of an update rule over a list of leaves.

Every kernel follows one contract (:mod:`optax_hybrid.kernels.contract`:
``update_leaves(leaves, facts, s, step) -> results``), declares the rules it
implements (its ``RULES``, by rule name, and ``implements(rule)``), and is
tested against :func:`reference.update_leaves`, which runs any rule.
``"xla"`` is the reference itself, one fused XLA loop per leaf. ``"native"``
is the compiled CPU kernel (:mod:`native_cpu`; Adam), one custom call for all
CPU-resident leaves. ``"pallas"`` is the fused GPU kernel (:mod:`pallas_gpu`;
the elementwise rules it lists, its body being the reference's leaf step),
one launch per 64 leaves, run in Pallas interpret mode off the GPU. ``"auto"`` picks the Pallas kernel on a
GPU, and on a CPU the native kernel for the fused ``tx.step`` where it is
built, chosen per platform at lowering (see :func:`kernels_for`).

The contract for any other kernel: it must honour every scalar of the rules it
implements (``step_ok`` included), and hand the leaves it cannot take (another
rule's, complex dtypes...) to :func:`reference.update_leaves` so that every
leaf is always updated by the same rule
(:func:`reference.with_reference_for_the_rest` does the split and the merge).
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from optax_hybrid.kernels import contract, native_cpu, pallas_gpu, reference
from optax_hybrid.kernels.contract import LeafFacts, LeafOperands, LeafResult, Step, lowering_for, step_of

KERNEL_NAMES = ("auto", "xla", "native", "pallas")

Kernel = Callable[..., list]


def check_kernel_name(kernel: str, owner: str = "optax_hybrid") -> str:
  """Validates a ``kernel=`` argument without touching a backend (``owner`` names the function in messages).

  Raises:
    ValueError: for an unknown name.
  """
  if not isinstance(kernel, str) or kernel not in KERNEL_NAMES:
    raise ValueError(
        f"{owner}: unknown `kernel`={kernel!r}; accepted values are "
        f"{', '.join(repr(k) for k in KERNEL_NAMES)}."
    )
  return kernel


def _native_or_reference(kernel: str) -> Kernel:
  """The native kernel on a CPU (:func:`native_cpu.on_cpu`: the library loaded, checked here once), else the
  reference, with a one-line warning."""
  if native_cpu.available():
    return native_cpu.on_cpu
  if kernel == "native" or jax.default_backend() == "cpu":
    native_cpu.warn_fallback_once()
  return reference.update_leaves


def kernels_for(kernel: str, *, fused: bool, runs_on: str = "device", split: str = "direct",
                rule: Any = None, packed: bool = False) -> dict[str, Kernel]:
  """The kernel each platform runs, as ``{platform: kernel}`` for ``lax.platform_dependent``.

  The choice follows the platform the step is *lowered* for
  (:func:`optax_hybrid.kernels.contract.per_platform`): the default backend's
  for a plain ``jit``, the declared one inside :func:`lowering_for`, so a step
  traced on a CPU and lowered for CUDA (the GPU-compile check) is the step a
  GPU runs. ``"default"`` covers every other platform.

  * ``"xla"``: the reference rule everywhere.
  * ``"pallas"``: the Pallas kernel (Triton on CUDA and ROCm, interpret mode
    elsewhere).
  * ``"native"``: the compiled CPU kernel on a CPU
    (:func:`native_cpu.on_cpu`), the reference elsewhere.
  * ``"auto"``: Pallas on CUDA and ROCm; on a CPU the native kernel for the
    fused ``tx.step`` and the reference for ``update``, where XLA fuses the
    caller's ``p + u`` into the step and the custom call would write a
    full-size update buffer instead (``benchmarks/step.py``); with a
    ``packed`` state the native kernel for both (it steps the leaves in
    their flat buffers, where XLA's rule would concatenate them back).

  ``runs_on="host"`` (host compute) runs the native kernel on a
  single-device CPU backend (``split="direct"``), where host compute is the
  same CPU, and the reference elsewhere: a CPU custom call inside a GPU
  program's host region is not something XLA:GPU compiles.
  A custom kernel is single-device code: with ``split="xla"`` (several
  devices, placement unknown) the reference runs instead; with
  ``"shard_map"`` the caller runs it per shard. Given the step's ``rule``, a
  kernel that does not implement it is replaced by the reference.

  Raises:
    ValueError: for an unknown name.
  """
  if kernel not in KERNEL_NAMES:
    check_kernel_name(kernel)
  if kernel in ("native", "auto") and rule is not None and not native_cpu.implements(rule):
    kernel, fused = ("xla", fused) if kernel == "native" else ("auto", False)  # "auto" without native: Pallas or XLA
  fused = fused or packed  # for "auto" on a CPU: the native kernel
  wants_native = kernel == "native" or (kernel == "auto" and fused)
  if runs_on == "host":
    if wants_native and split == "direct" and native_cpu.available():
      return {"cpu": native_cpu.on_cpu, "default": reference.update_leaves}
    return {"default": reference.update_leaves}
  if kernel == "xla" or split == "xla":
    return {"default": reference.update_leaves}
  if kernel == "pallas":
    return {"default": pallas_gpu.update_leaves}
  if kernel == "native":
    return {"cpu": _native_or_reference(kernel), "default": reference.update_leaves}
  on_cpu = _native_or_reference(kernel) if fused else reference.update_leaves
  return {"cuda": pallas_gpu.update_leaves, "rocm": pallas_gpu.update_leaves, "cpu": on_cpu,
          "default": reference.update_leaves}


__all__ = ["KERNEL_NAMES", "LeafFacts", "LeafOperands", "LeafResult", "Step", "check_kernel_name", "contract",
           "kernels_for", "lowering_for", "native_cpu", "pallas_gpu", "reference", "step_of"]
