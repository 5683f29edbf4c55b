"""Kernels that carry out the step of an update rule over a list of leaves.

Every kernel follows one contract (:mod:`optax_hybrid.kernels.contract`:
``update_leaves(leaves, facts, s, step) -> results``), declares the rules it
implements (its ``RULES``, by rule name, and ``implements(rule)``) and where it
runs (its ``route``: ``{platform: kernel}`` for where the leaves are stepped,
the plan's split and the rule; :data:`ROUTES` names each), and is tested
against :func:`reference.update_leaves`, which runs any rule.
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

from optax_hybrid.kernels import contract, native_cpu, pallas_gpu, reference
from optax_hybrid.kernels.contract import LeafFacts, LeafOperands, LeafResult, Step, lowering_for, step_of

Kernel = Callable[..., list]


def _auto(*, fused: bool, runs_on: str, split: str, rule: Any, packed: bool) -> dict[str, Kernel]:
  """``kernel="auto"``'s table: the Pallas kernel's on CUDA and ROCm; on a CPU the native kernel's for the fused
  ``tx.step``, and for ``update`` too with a ``packed`` state, where it implements the rule; else the reference.

  For ``update`` on a CPU XLA fuses the caller's ``p + u`` into the rule,
  where the custom call would write a full-size update buffer instead
  (``benchmarks/step.py``); a packed state is stepped in its flat buffers
  by the native kernel, where XLA's rule would concatenate them back.
  """
  where = {"fused": fused, "runs_on": runs_on, "split": split, "rule": rule, "packed": packed}
  wants_native = (fused or packed) and (rule is None or native_cpu.implements(rule))
  cpu = native_cpu.route(**where, asked=False) if wants_native else reference.route(**where)
  if runs_on == "host" or split == "xla":  # no Triton launch there: the CPU's table is the table
    return cpu
  gpu = pallas_gpu.route(**where)["default"]
  return {"cuda": gpu, "rocm": gpu, "cpu": cpu.get("cpu", cpu["default"]), "default": reference.update_leaves}


#: Each ``kernel=`` name's route: ``route(*, fused, runs_on, split, rule, packed) -> {platform: kernel}``, the
#: kernel's own (its module's ``route``) or, for ``"auto"``, a choice among them. The names ``kernel=`` accepts.
ROUTES: dict[str, Callable[..., dict]] = {"auto": _auto, "xla": reference.route, "native": native_cpu.route,
                                          "pallas": pallas_gpu.route}
#: The built-in kernels' names.
KERNEL_NAMES = tuple(ROUTES)


def check_kernel_name(kernel: str, owner: str = "optax_hybrid") -> str:
  """Validates a ``kernel=`` argument without touching a backend (``owner`` names the function in messages).

  Raises:
    ValueError: for an unknown name.
  """
  if not isinstance(kernel, str) or kernel not in ROUTES:
    raise ValueError(
        f"{owner}: unknown `kernel`={kernel!r}; accepted values are "
        f"{', '.join(repr(k) for k in ROUTES)}."
    )
  return kernel


def kernels_for(kernel: str, *, fused: bool, runs_on: str = "device", split: str = "direct",
                rule: Any = None, packed: bool = False) -> dict[str, Kernel]:
  """The kernel each platform runs, as ``{platform: kernel}`` for ``lax.platform_dependent``: ``kernel``'s route
  (:data:`ROUTES`).

  The choice follows the platform the step is *lowered* for
  (:func:`optax_hybrid.kernels.contract.per_platform`): the default backend's
  for a plain ``jit``, the declared one inside :func:`lowering_for`, so a step
  traced on a CPU and lowered for CUDA (the GPU-compile check) is the step a
  GPU runs. ``"default"`` covers every other platform.

  * ``"xla"``: the reference rule everywhere (:func:`reference.route`).
  * ``"pallas"``: the Pallas kernel (Triton on CUDA and ROCm, interpret mode
    elsewhere; :func:`pallas_gpu.route`).
  * ``"native"``: the compiled CPU kernel on a CPU (:func:`native_cpu.route`),
    the reference elsewhere.
  * ``"auto"``: Pallas on CUDA and ROCm; on a CPU the native kernel for the
    fused ``tx.step``, and for ``update`` with a ``packed`` state, where it
    implements the rule; the reference for the rest.

  ``fused``: for ``tx.step`` (True) or ``update``; ``runs_on``: where the
  leaves are stepped (``"device"``, or ``"host"``: host compute); ``split``:
  the plan's (:attr:`optax_hybrid.plan.Plan.split`: a custom kernel is
  single-device code, run per shard for ``"shard_map"`` and replaced by the
  reference for ``"xla"``); ``rule``: the rule the steps run, a kernel that
  does not implement it giving way to the reference; ``packed``: the state's
  layout is packed.

  Raises:
    ValueError: for an unknown name.
    TypeError: for a route that gives no ``{platform: kernel}`` table with a ``"default"``.
  """
  table = ROUTES[check_kernel_name(kernel)](fused=fused, runs_on=runs_on, split=split, rule=rule, packed=packed)
  if not isinstance(table, dict) or "default" not in table or not all(map(callable, table.values())):
    raise TypeError(f"kernels.ROUTES[{kernel!r}] must return {{platform: kernel}}, kernels callable and "
                    f"\"default\" covering the platforms not named; it returned {table!r}.")
  return table


__all__ = ["KERNEL_NAMES", "ROUTES", "LeafFacts", "LeafOperands", "LeafResult", "Step", "check_kernel_name",
           "contract", "kernels_for", "lowering_for", "native_cpu", "pallas_gpu", "reference", "step_of"]
