"""The native CPU kernel: ``native_cpu.cc`` behind an XLA FFI custom call.

The shared library is compiled by the package's own build (``pip install``),
never at first use. If it could not be built, :func:`available` is False,
:func:`why_unavailable` says why, and ``kernel="auto"`` falls back to the XLA
path with a one-line warning.

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

from optax_hybrid.kernels import reference

TARGET = "optax_hybrid_adamw_cpu"
_SYMBOL = "OptaxHybridAdamWCpu"
_LIBRARY_STEM = "_native_cpu"

_state: dict[str, Any] = {"loaded": False, "error": None, "warned": False}


def _library_path() -> str | None:
  here = os.path.dirname(os.path.abspath(__file__))
  for suffix in importlib.machinery.EXTENSION_SUFFIXES:
    path = os.path.join(here, _LIBRARY_STEM + suffix)
    if os.path.exists(path):
      return path
  return None


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
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
  except (OSError, AttributeError, ValueError) as e:
    _state["error"] = f"loading {path} failed: {e}"
    return False
  _state["library"] = library  # keep the shared object loaded
  _state["loaded"] = True
  return True


def available() -> bool:
  """Whether the compiled kernel is installed and registered with XLA."""
  return _load()


def why_unavailable() -> str | None:
  """Why :func:`available` is False (None when it is True)."""
  return None if _load() else _state["error"]


def warn_fallback_once() -> None:
  if not _state["warned"]:
    _state["warned"] = True
    warnings.warn(f"optax_hybrid: native CPU kernel unavailable ({why_unavailable()}); using the XLA path.",
                  RuntimeWarning, stacklevel=3)


_STORAGE = {np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)}
_F32 = np.dtype(jnp.float32)


def supports(grad, mu, nu, param, update_dtype, *, write_params: bool = False) -> bool:
  """Whether the compiled loops cover this leaf's dtypes (see ``run_leaf`` in the C++)."""
  t = np.dtype(grad.dtype)
  s = np.dtype(mu.dtype)
  if t not in _STORAGE or s != np.dtype(nu.dtype) or s not in (_F32, t):
    return False
  if param is not None and np.dtype(param.dtype) != t:
    return False
  expected = t if write_params else (_F32 if s == _F32 else t)
  return np.dtype(update_dtype) == expected


def _pack_scalars(s: reference.AdamScalars) -> jax.Array:
  step_ok = jnp.ones([], jnp.float32) if s.step_ok is None else s.step_ok.astype(jnp.float32)
  return jnp.stack([
      s.learning_rate, s.b1, s.b2, s.eps, s.weight_decay, s.bias_correction1, s.bias_correction2_sqrt, step_ok,
  ]).astype(jnp.float32)


# Leaves per custom call. XLA's compile time grows much faster than linearly in
# the operands of one call (measured for a 1024-leaf step on the 2-core CPU:
# 78 s in one call, 6 s in calls of 64), while each extra call costs
# microseconds at run time.
MAX_LEAVES_PER_CALL = 64


def _native_call(grads, mus, nus, params, decays, out_dtypes, s, *, adamw_mode, write_params):
  if len(grads) > MAX_LEAVES_PER_CALL:
    outs = ([], [], [])
    for start in range(0, len(grads), MAX_LEAVES_PER_CALL):
      part = slice(start, start + MAX_LEAVES_PER_CALL)
      for acc, new in zip(outs, _native_call(grads[part], mus[part], nus[part], params[part], decays[part],
                                             out_dtypes[part], s, adamw_mode=adamw_mode,
                                             write_params=write_params)):
        acc.extend(new)
    return outs
  operands, has_param, aliases, result_types = [], [], {}, []
  for i, (g, m, v, p, d, dt) in enumerate(zip(grads, mus, nus, params, decays, out_dtypes)):
    base = 1 + len(operands)  # operand 0 is the scalars
    operands += [g, m, v]
    aliases[base + 1] = 3 * i + 1
    aliases[base + 2] = 3 * i + 2
    needs_param = write_params or d
    if needs_param:
      operands.append(p)
      if write_params:
        aliases[base + 3] = 3 * i  # the new param overwrites the old one in place
    has_param.append(1 if needs_param else 0)
    result_types += [jax.ShapeDtypeStruct(g.shape, dt), jax.ShapeDtypeStruct(m.shape, m.dtype),
                     jax.ShapeDtypeStruct(v.shape, v.dtype)]
  call = jax.ffi.ffi_call(TARGET, result_types, input_output_aliases=aliases)
  outs = call(
      _pack_scalars(s), *operands,
      adamw_mode=np.int32(adamw_mode), write_params=np.int32(write_params),
      decay=np.asarray([int(d) for d in decays], np.int32), has_param=np.asarray(has_param, np.int32),
  )
  return list(outs[0::3]), list(outs[1::3]), list(outs[2::3])


def update_leaves(
    grads: Sequence[jax.Array],
    mus: Sequence[jax.Array],
    nus: Sequence[jax.Array],
    params: Sequence[jax.Array | None],
    decays: Sequence[bool],
    update_dtypes: Sequence[Any],
    s: reference.AdamScalars,
    *,
    adamw_mode: bool,
    write_params: bool = False,
    direct: bool = False,
) -> tuple[list, list, list]:
  """Same contract as :func:`reference.update_leaves`; one custom call for all supported leaves.

  ``direct=True`` emits the custom call without ``lax.platform_dependent``:
  for host compute on the CPU backend, where the platform is known and a
  ``platform_dependent`` would type its branches' outputs inconsistently.
  """
  n = len(grads)
  rule = dict(adamw_mode=adamw_mode, write_params=write_params)
  native = [i for i in range(n) if supports(grads[i], mus[i], nus[i],
                                            params[i] if (decays[i] or write_params) else None,
                                            update_dtypes[i], write_params=write_params)]
  if not native or not _load():
    return reference.update_leaves(grads, mus, nus, params, decays, update_dtypes, s, **rule)

  def run_native(g, m, v, p, decays, dtypes):
    on_cpu = lambda g, m, v, p: _native_call(g, m, v, p, decays, dtypes, s, **rule)
    if direct:
      return on_cpu(g, m, v, p)
    elsewhere = lambda g, m, v, p: reference.update_leaves(g, m, v, p, decays, dtypes, s, **rule)
    return jax.lax.platform_dependent(g, m, v, p, cpu=on_cpu, default=elsewhere)

  return reference.with_reference_for_the_rest(native, run_native, grads, mus, nus, params, decays,
                                               update_dtypes, s, **rule)
