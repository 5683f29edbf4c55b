"""Checking a jaxpr for device arithmetic on host-memory values: what XLA:GPU would silently run on the host.

On a GPU, XLA turns an operation that computes on a value in host memory
outside a host-compute region into host compute, with only a log warning
(:class:`~optax_hybrid.gpu_compile.GpuCompileReport`'s ``warnings``); on a CPU
it just runs. :func:`host_arithmetic_outside_host_compute` finds such
operations in the jaxpr, with no compiler.
"""

from __future__ import annotations

from typing import Any

from optax_hybrid import _compat
from optax_hybrid._compat import HOST

__all__ = ["host_arithmetic_outside_host_compute", "sub_jaxprs"]

# Primitives that move or relabel data without computing on it.
# A layout constraint (host compute's operands: _compat.row_major) only fixes
# how a value is laid out; a dynamic slice cuts a part of a host array to be
# moved, and a dynamic update slice writes a moved part into one (XLA:GPU
# makes each a copy across the link: scan_layers' slices of a layer stack).
_DATA_MOVEMENT = frozenset({"device_put", "copy", "copy_p", "optimization_barrier", "layout_constraint",
                            "dynamic_slice", "dynamic_update_slice"})


def sub_jaxprs(eqn) -> list:
  """The jaxprs an equation holds in its parameters (a ``pjit``'s, a ``scan``'s body, a ``cond``'s branches...)."""
  subs = []
  for value in eqn.params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, _compat.ClosedJaxpr):
        subs.append(v.jaxpr)
      elif isinstance(v, _compat.Jaxpr):
        subs.append(v)
  return subs


def host_arithmetic_outside_host_compute(jaxpr: Any) -> list[str]:
  """Lists the operations that compute on a host-memory value outside host compute.

  On a GPU, XLA turns such an operation into host compute silently (with only a
  log warning), which is slow; on a CPU it just runs, so the mistake would go
  unnoticed in CPU tests. Run this on ``jax.make_jaxpr(train_step)(...)``: an
  empty list means every computation on host-resident values is inside
  ``compute_on('device_host')`` and everything else only moves them.

  Args:
    jaxpr: a ``ClosedJaxpr`` or ``Jaxpr``.

  Returns:
    One line per offending equation: the primitive and the host-typed operands.
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  found: list[str] = []

  def visit(jx):
    for eqn in jx.eqns:
      name = eqn.primitive.name
      if name == "compute_on":
        continue  # explicit host (or device) compute: allowed by design
      subs = sub_jaxprs(eqn)
      if subs:
        for sub in subs:
          visit(sub)
        continue
      if name in _DATA_MOVEMENT:
        continue
      host_inputs = [
          str(v.aval) for v in eqn.invars
          if getattr(getattr(v, "aval", None), "memory_space", None) == HOST
      ]
      if host_inputs:
        found.append(f"{name} on {', '.join(host_inputs)}")

  visit(jaxpr)
  return found
