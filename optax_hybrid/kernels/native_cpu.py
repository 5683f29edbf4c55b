"""The native CPU kernel: ``native_cpu.cc`` behind an XLA FFI custom call.

The shared library is compiled by the package's own build (``pip install``),
never at first use. If it could not be built, :func:`available` is False,
:func:`why_unavailable` says why, and ``kernel="auto"`` falls back to the XLA
path with a one-line warning.

The library is built without ``-march``, so one wheel runs on any CPU of its
architecture; its work loop is compiled once per instruction set (``avx512``,
``avx2`` and ``baseline`` on x86-64, ``baseline`` elsewhere), and the library
picks the widest one the CPU runs when it loads. :func:`isa` says which. The
environment variable ``OPTAX_HYBRID_NATIVE_ISA`` (``auto``, or one of those
names), read when the library loads, forces one; a name the build does not
have, or one the CPU cannot run, leaves the kernel unavailable and
:func:`why_unavailable` names the variable and the accepted values.

One custom call updates every supported leaf of a group (any number of leaves,
each in its own buffer: nothing is concatenated), with the moments aliased in
place. Leaves it cannot take (complex, float64, mixed dtypes it has no loop for)
go to :func:`reference.update_leaves` in the same step, and so does everything
on a non-CPU platform (``lax.platform_dependent`` chooses at lowering time).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from optax_hybrid.kernels import contract, quantized, reference

TARGET = "optax_hybrid_adamw_cpu"
_SYMBOL = "OptaxHybridAdamWCpu"
ISA_VARIABLE = "OPTAX_HYBRID_NATIVE_ISA"
_LIBRARY_STEM = "_native_cpu"

_state: dict[str, Any] = {"loaded": False, "error": None, "warned": False}


def _library_path() -> str | None:
  here = os.path.dirname(os.path.abspath(__file__))
  for suffix in importlib.machinery.EXTENSION_SUFFIXES:
    path = os.path.join(here, _LIBRARY_STEM + suffix)
    if os.path.exists(path):
      return path
  return None


def _c_string_function(library: ctypes.CDLL, name: str):
  function = getattr(library, name)
  function.restype = ctypes.c_char_p
  function.argtypes = []
  return function


def _load() -> bool:
  if _state["loaded"]:
    return True
  if _state["error"] is not None:
    return False
  path = _library_path()
  if path is None:
    _state["error"] = "the native kernel was not built with the package (no compiler at install time?)"
    return False
  try:
    library = ctypes.CDLL(path)
    handler = getattr(library, _SYMBOL)
    isa_name, isa_problem, cpu_runs = (_c_string_function(library, name) for name in (
        "OptaxHybridIsa", "OptaxHybridIsaProblem", "OptaxHybridIsasThisCpuRuns"))
  except OSError as e:
    _state["error"] = f"loading {path} failed: {e}"
    return False
  except AttributeError as e:  # a library built from an older native_cpu.cc
    _state["error"] = f"{e}: built from an older native_cpu.cc? rebuild it (pip install, or setup.py build_ext --inplace)"
    return False
  _state["isas_this_cpu_runs"] = tuple(cpu_runs().decode().split())
  if isa_name() is None:  # OPTAX_HYBRID_NATIVE_ISA names an instruction set the library cannot run here
    _state["error"] = isa_problem().decode()
    return False
  try:
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
  except ValueError as e:
    _state["error"] = f"registering {path} with XLA failed: {e}"
    return False
  _state["isa"] = isa_name().decode()
  _state["library"] = library  # keep the shared object loaded
  _state["loaded"] = True
  return True


def available() -> bool:
  """Whether the compiled kernel is installed and registered with XLA."""
  return _load()


def why_unavailable() -> str | None:
  """Why :func:`available` is False (None when it is True)."""
  return None if _load() else _state["error"]


def isa() -> str | None:
  """The instruction set the kernel's work loop runs: ``"avx512"``, ``"avx2"`` or ``"baseline"``.

  Chosen when the library loads: the widest one this CPU runs, unless
  ``OPTAX_HYBRID_NATIVE_ISA`` names one. None when the kernel is unavailable
  (:func:`why_unavailable` says why).

  Example::

    native_cpu.isa()  # 'avx512' on a CPU with AVX-512
  """
  return _state["isa"] if _load() else None


def isas_this_cpu_runs() -> tuple[str, ...]:
  """The instruction sets the built library has for this CPU, widest first (empty when it did not load)."""
  _load()
  return _state.get("isas_this_cpu_runs", ())


def warn_fallback_once() -> None:
  if not _state["warned"]:
    _state["warned"] = True
    warnings.warn(f"optax_hybrid: native CPU kernel unavailable ({why_unavailable()}); using the XLA path.",
                  RuntimeWarning, stacklevel=3)


_F32 = np.dtype(jnp.float32)


def supports(leaf: contract.LeafOperands, fact: contract.LeafFacts, rule: contract.Rule) -> bool:
  """Whether the compiled loops cover this leaf's dtypes (see ``run_leaf`` in the C++)."""
  if isinstance(leaf.mu, quantized.QuantizedMoment) or isinstance(leaf.nu, quantized.QuantizedMoment):
    return False
  t = np.dtype(leaf.grad.dtype)
  s = np.dtype(leaf.mu.dtype)
  if t not in contract.STORAGE_DTYPES or s != np.dtype(leaf.nu.dtype) or s not in (_F32, t):
    return False
  if leaf.param is not None and np.dtype(leaf.param.dtype) != t:
    return False
  expected = t if rule.write_params else (_F32 if s == _F32 else t)
  return np.dtype(fact.out_dtype) == expected


# Leaves per custom call. XLA's compile time grows much faster than linearly in
# the operands of one call (measured for a 1024-leaf step on the 2-core CPU:
# 78 s in one call, 6 s in calls of 64), while each extra call costs
# microseconds at run time.
MAX_LEAVES_PER_CALL = 64


def _native_call(leaves, facts, s, rule):
  """One custom call over at most :data:`MAX_LEAVES_PER_CALL` leaves."""
  operands, has_param, aliases, result_types = [], [], {}, []
  for i, (leaf, fact) in enumerate(zip(leaves, facts)):
    base = 1 + len(operands)  # operand 0 is the scalars
    operands += [leaf.grad, leaf.mu, leaf.nu]
    aliases[base + 1] = 3 * i + 1
    aliases[base + 2] = 3 * i + 2
    if leaf.param is not None:
      operands.append(leaf.param)
      if rule.write_params:
        aliases[base + 3] = 3 * i  # the new param overwrites the old one in place
    has_param.append(0 if leaf.param is None else 1)
    result_types += [jax.ShapeDtypeStruct(leaf.grad.shape, fact.out_dtype),
                     jax.ShapeDtypeStruct(leaf.mu.shape, leaf.mu.dtype),
                     jax.ShapeDtypeStruct(leaf.nu.shape, leaf.nu.dtype)]
  call = jax.ffi.ffi_call(TARGET, result_types, input_output_aliases=aliases)
  outs = call(
      contract.pack_scalars(s), *operands,
      adamw_mode=np.int32(rule.adamw_mode), write_params=np.int32(rule.write_params),
      decay=np.asarray([int(f.decay) for f in facts], np.int32), has_param=np.asarray(has_param, np.int32),
  )
  return [contract.LeafResult(*outs[3 * i:3 * i + 3]) for i in range(len(leaves))]


def update_leaves(
    leaves: Sequence[contract.LeafOperands],
    facts: Sequence[contract.LeafFacts],
    s: contract.AdamScalars,
    rule: contract.Rule,
    *,
    direct: bool = False,
) -> list[contract.LeafResult]:
  """The kernel contract (:mod:`optax_hybrid.kernels.contract`); one custom call per 64 supported leaves.

  ``direct=True`` emits the custom call without ``lax.platform_dependent``:
  for host compute on the CPU backend, where the platform is known and a
  ``platform_dependent`` would type its branches' outputs inconsistently.
  """
  if not _load():
    return reference.update_leaves(leaves, facts, s, rule)

  def run_native(leaves, facts):
    on_cpu = lambda leaves: contract.in_chunks(lambda l, f: _native_call(l, f, s, rule), leaves, facts,
                                               MAX_LEAVES_PER_CALL)
    if direct:
      return on_cpu(leaves)
    elsewhere = lambda leaves: reference.update_leaves(leaves, facts, s, rule)
    return contract.per_platform({"cpu": on_cpu, "default": elsewhere}, leaves)

  return reference.with_reference_for_the_rest(lambda leaf, fact: supports(leaf, fact, rule), run_native,
                                               leaves, facts, s, rule)
