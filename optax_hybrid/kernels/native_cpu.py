"""The native CPU kernel: ``native_cpu.cc`` behind an XLA FFI custom call.

The shared library is compiled by the package's own build (``pip install``),
never at first use. If it could not be built, :func:`available` is False,
:func:`why_unavailable` says why, and ``kernel="auto"`` falls back to the XLA
path with a one-line warning.

The library is built without ``-march``, so one wheel runs on any CPU of its
architecture; its work loop is compiled once per instruction set
(``avx512vbmi``, ``avx512``, ``avx2`` and ``baseline`` on x86-64, ``baseline``
elsewhere; ``avx512vbmi`` is ``avx512`` with 8-bit moments decoded by byte
permutes instead of gathers), and the library picks the widest one the CPU
runs when it loads. :func:`isa` says which. The
environment variable ``OPTAX_HYBRID_NATIVE_ISA`` (``auto``, or one of those
names), read when the library loads, forces one; a name the build does not
have, or one the CPU cannot run, leaves the kernel unavailable and
:func:`why_unavailable` names the variable and the accepted values.

One custom call updates every supported leaf of a group (any number of leaves,
each in its own buffer: nothing is concatenated), with the moments aliased in
place: float moments, or 8-bit block-wise ones
(:class:`quantized.QuantizedMoment`: codes and scales, both updated in place,
block by block, with the code maps and thresholds of :mod:`quantized` passed as
an operand). It implements one rule: Adam (:func:`implements`). Leaves of
other rules, and leaves it cannot take (complex, float64, mixed dtypes it has
no loop for), go to :func:`reference.update_leaves` in the same step, and so
does everything on a non-CPU platform (``lax.platform_dependent`` chooses at
lowering time).
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
from jax import lax

from optax_hybrid import _compat
from optax_hybrid.base import DECOUPLED
from optax_hybrid.kernels import contract, packed, quantized, reference

TARGET = "optax_hybrid_adamw_cpu"
_SYMBOL = "OptaxHybridAdamWCpu"
#: The call over leaves whose moments are packed into pools (:mod:`optax_hybrid.kernels.packed`).
PACKED_TARGET = "optax_hybrid_adamw_packed_cpu"
_PACKED_SYMBOL = "OptaxHybridAdamWPackedCpu"
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
    handler, packed_handler = getattr(library, _SYMBOL), getattr(library, _PACKED_SYMBOL)
    isa_name, isa_problem = (_c_string_function(library, name)
                             for name in ("OptaxHybridIsa", "OptaxHybridIsaProblem"))
  except OSError as e:
    _state["error"] = f"loading {path} failed: {e}"
    return False
  except AttributeError as e:  # a library built from an older native_cpu.cc
    _state["error"] = f"{e}: built from an older native_cpu.cc? rebuild it (pip install, or setup.py build_ext --inplace)"
    return False
  if isa_name() is None:  # OPTAX_HYBRID_NATIVE_ISA names an instruction set the library cannot run here
    _state["error"] = isa_problem().decode()
    return False
  try:
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    jax.ffi.register_ffi_target(PACKED_TARGET, jax.ffi.pycapsule(packed_handler), platform="cpu")
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
  """The instruction set the kernel's work loop runs: ``"avx512vbmi"``, ``"avx512"``, ``"avx2"`` or ``"baseline"``.

  Chosen when the library loads: the widest one this CPU runs, unless
  ``OPTAX_HYBRID_NATIVE_ISA`` names one. None when the kernel is unavailable
  (:func:`why_unavailable` says why).

  Example::

    native_cpu.isa()  # 'avx512vbmi' on a CPU with AVX-512 VBMI (Ice Lake, Zen 4 and later)
  """
  return _state["isa"] if _load() else None


def warn_fallback_once() -> None:
  if not _state["warned"]:
    _state["warned"] = True
    warnings.warn(f"optax_hybrid: native CPU kernel unavailable ({why_unavailable()}); using the XLA path.",
                  RuntimeWarning, stacklevel=3)


_F32 = np.dtype(jnp.float32)
_QUANTIZED = quantized.QuantizedMoment

# The 8-bit format's tables, one operand of every call (rows in this order:
# the kernel reads them by position): the first moment's code map, the second
# moment's, then their thresholds. quantized.py is their single source.
CODE_TABLES = np.stack([quantized.SIGNED_MAP, quantized.UNSIGNED_MAP, quantized.SIGNED_THRESHOLDS,
                        quantized.UNSIGNED_THRESHOLDS]).astype(np.float32)


#: The rules the C++ loops compute, by :attr:`optax_hybrid.base.UpdateRule.name`: Adam's.
RULES = frozenset({"adam"})


def implements(rule: Any) -> bool:
  """The rule the C++ loops compute: Adam (decoupled or L2 decay), without Nesterov momentum or ``eps_root``."""
  return rule.name in RULES and not rule.nesterov and not rule.uses_eps_root


def implements_master(master: Any) -> bool:
  """The master formats the C++ loops take: none (:data:`~optax_hybrid.masters.NO_MASTER`), or a copy stepped as
  the param (``steps_as_param``)."""
  return not master.active or master.steps_as_param


# The scalars the C++ reads, in this order (then the skip flag): AdamW's.
SCALARS = ("learning_rate", "b1", "b2", "eps", "weight_decay", "bias_correction1", "bias_correction2_sqrt")


def _supports_quantized(leaf: contract.LeafOperands, fact: contract.LeafFacts, step: contract.Step) -> bool:
  """8-bit moments: both quantized, codes shaped like the leaf, scales per block; float32 updates or new params."""
  shape = tuple(leaf.grad.shape)
  if not all(isinstance(m, _QUANTIZED) for m in leaf.state) or len(shape) == 0:
    return False
  for moment in leaf.state:
    if (tuple(moment.codes.shape) != shape or np.dtype(moment.codes.dtype) != quantized.CODE_DTYPE
        or tuple(moment.scales.shape) != quantized.scales_shape(shape)
        or np.dtype(moment.scales.dtype) != quantized.SCALE_DTYPE):
      return False
  expected = np.dtype(leaf.grad.dtype) if step.write_params else _F32
  return np.dtype(fact.out_dtype) == expected


def supports(leaf: contract.LeafOperands, fact: contract.LeafFacts, step: contract.Step) -> bool:
  """Whether the compiled loops cover this leaf: its rule (:func:`implements`) and dtypes (``run_leaf`` in the C++)."""
  t = np.dtype(leaf.grad.dtype)
  if fact.moments is not None and "native" not in fact.moments.kernels:  # a format it does not implement
    return False
  if isinstance(leaf.param, packed.PackedSlice):  # a packed master stepped as the param: params are operands
    return False
  if t not in contract.STORAGE_DTYPES or (leaf.param is not None and np.dtype(leaf.param.dtype) != t):
    return False
  mu, nu = leaf.state
  if isinstance(mu, _QUANTIZED) or isinstance(nu, _QUANTIZED):
    return _supports_quantized(leaf, fact, step)
  s = np.dtype(mu.dtype)
  if s != np.dtype(nu.dtype) or s not in (_F32, t):
    return False
  expected = t if step.write_params else (_F32 if s == _F32 else t)
  return np.dtype(fact.out_dtype) == expected


# Leaves per custom call. XLA's compile time grows much faster than linearly in
# the operands of one call (docs/records/benchmarks.md, "Trace, lower and
# compile time for a 1024-leaf tree"), while each extra call costs
# microseconds at run time.
MAX_LEAVES_PER_CALL = 64


def _native_call(leaves, facts, s, step):
  """One custom call over at most :data:`MAX_LEAVES_PER_CALL` leaves.

  Per leaf, the operands are the gradient, mu's arrays, nu's arrays (one
  array, or codes and scales) and the param if read; the results are the
  first result and the moments' arrays, each aliased to its operand.
  """
  operands, has_param, aliases, result_types = [], [], {}, []
  for leaf, fact in zip(leaves, facts):
    first_result = len(result_types)
    moments = jax.tree.leaves(leaf.state)  # [mu, nu], or codes and scales of each
    base = 2 + len(operands)  # operands 0 and 1 are the scalars and the code tables
    operands += [leaf.grad, *moments]
    result_types.append(jax.ShapeDtypeStruct(leaf.grad.shape, fact.out_dtype))
    for k, x in enumerate(moments):
      aliases[base + 1 + k] = len(result_types)
      result_types.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
    if leaf.param is not None:
      if step.write_params:
        aliases[base + 1 + len(moments)] = first_result  # the new param overwrites the old one in place
      operands.append(leaf.param)
    has_param.append(0 if leaf.param is None else 1)
  # The tables go where the leaves are (host memory inside host compute).
  tables = _compat.move(jnp.asarray(CODE_TABLES), _compat.memory_space_of(leaves[0].grad))
  call = jax.ffi.ffi_call(TARGET, result_types, input_output_aliases=aliases)
  outs = iter(call(
      contract.pack_scalars(s, SCALARS), tables, *operands,
      adamw_mode=np.int32(step.decay == DECOUPLED), write_params=np.int32(step.write_params),
      block_size=np.int32(quantized.BLOCK_SIZE), decay=np.asarray([int(f.decay) for f in facts], np.int32),
      has_param=np.asarray(has_param, np.int32),
      quantized=np.asarray([int(isinstance(leaf.state[0], _QUANTIZED)) for leaf in leaves], np.int32),
  ))
  results = []
  for leaf in leaves:
    first = next(outs)
    structure = jax.tree.structure(tuple(leaf.state))
    results.append(contract.LeafResult(first, structure.unflatten([next(outs) for _ in range(structure.num_leaves)])))
  return results


def _pools(leaves: Sequence[contract.LeafOperands]) -> dict[str, Any]:
  """``{key: pool}`` of the pools the leaves' moments are packed into, in the order first met."""
  pools = {}
  for leaf in leaves:
    for x in jax.tree.leaves(leaf.state, is_leaf=packed.is_slice):
      pools.setdefault(x.key, x.pool)
  return pools


# Slot of each of a leaf's moment arrays in the packed call (native_cpu.cc: AdamWPackedImpl):
# mu and nu, or mu's codes and scales then nu's.
_FLOAT_SLOTS, _QUANTIZED_SLOTS = (0, 2), (0, 1, 2, 3)


def _packed_call(leaves, facts, s, step, pools: dict[str, Any]) -> tuple[list, dict[str, Any]]:
  """One custom call over at most :data:`MAX_LEAVES_PER_CALL` leaves whose moments are in ``pools``.

  Per leaf, the operands are the gradient and the param if read, the results
  the first result (aliased to the param when it is written); then every
  pool, updated in place. Returns the first results and the new pools.
  """
  keys = list(pools)
  operands, has_param, aliases = [], [], {}
  slot_pool = np.full((len(leaves), 4), -1, np.int32)
  slot_offset = np.zeros((len(leaves), 4), np.int64)
  for i, leaf in enumerate(leaves):
    operands.append(leaf.grad)
    if leaf.param is not None:
      if step.write_params:
        aliases[2 + len(operands)] = i  # the new param overwrites the old one in place
      operands.append(leaf.param)
    has_param.append(0 if leaf.param is None else 1)
    arrays = jax.tree.leaves(leaf.state, is_leaf=packed.is_slice)
    for slot, x in zip(_QUANTIZED_SLOTS if isinstance(leaf.state[0], _QUANTIZED) else _FLOAT_SLOTS, arrays):
      slot_pool[i, slot], slot_offset[i, slot] = keys.index(x.key), x.offset
  first = 2 + len(operands)  # operands 0 and 1 are the scalars and the code tables
  aliases.update({first + k: len(leaves) + k for k in range(len(keys))})
  result_types = [jax.ShapeDtypeStruct(leaf.grad.shape, fact.out_dtype) for leaf, fact in zip(leaves, facts)]
  result_types += [jax.ShapeDtypeStruct(pools[k].shape, pools[k].dtype) for k in keys]
  tables = _compat.move(jnp.asarray(CODE_TABLES), _compat.memory_space_of(leaves[0].grad))
  outs = jax.ffi.ffi_call(PACKED_TARGET, result_types, input_output_aliases=aliases)(
      contract.pack_scalars(s, SCALARS), tables, *operands, *(pools[k] for k in keys),
      adamw_mode=np.int32(step.decay == DECOUPLED), write_params=np.int32(step.write_params),
      block_size=np.int32(quantized.BLOCK_SIZE), n_pools=np.int32(len(keys)),
      decay=np.asarray([int(f.decay) for f in facts], np.int32), has_param=np.asarray(has_param, np.int32),
      quantized=np.asarray([int(isinstance(leaf.state[0], _QUANTIZED)) for leaf in leaves], np.int32),
      slot_pool=slot_pool.ravel(), slot_offset=slot_offset.ravel())
  return list(outs[:len(leaves)]), dict(zip(keys, outs[len(leaves):]))


def _in_pools(leaves, facts, s, step) -> list[contract.LeafResult]:
  """Leaves whose moments are packed: calls of at most 64 leaves, each updating the pools in place.

  The pools pass from one call to the next; every leaf's new state is a
  slice of the last call's pools.
  """
  pools, firsts = _pools(leaves), []
  for start in range(0, len(leaves), MAX_LEAVES_PER_CALL):
    part = slice(start, start + MAX_LEAVES_PER_CALL)
    part_firsts, pools = _packed_call(leaves[part], facts[part], s, step, pools)
    firsts += part_firsts
  moved = lambda x: packed.PackedSlice(pools[x.key], x.key, x.offset, x.shape)
  return [contract.LeafResult(f, jax.tree.map(moved, tuple(leaf.state),
                                              is_leaf=packed.is_slice))
          for f, leaf in zip(firsts, leaves)]


def route(*, fused: bool, runs_on: str, split: str, rule: Any, packed: bool, asked: bool = True) -> dict[str, Any]:
  """``kernel="native"``'s table (:func:`optax_hybrid.kernels.kernels_for`): :func:`on_cpu` on a CPU, the
  reference elsewhere.

  The reference everywhere for a rule the loops do not compute
  (:func:`implements`) and for a split the plan cannot see (``split="xla"``:
  the kernel is single-device code). In host compute (``runs_on="host"``)
  :func:`on_cpu` only on a one-device CPU backend (``split="direct"``), where
  host compute is that CPU: a CPU custom call inside a GPU program's host
  region is not something XLA:GPU compiles. Where the library is not built,
  the reference, with a one-line warning: always when the kernel was
  ``asked`` for by name, on a CPU backend when ``"auto"`` would have picked it.
  """
  del fused, packed
  reference_only = {"default": reference.update_leaves}
  if (rule is not None and not implements(rule)) or split == "xla":
    return reference_only
  if runs_on == "host":
    return {"cpu": on_cpu, **reference_only} if split == "direct" and available() else reference_only
  if not available():
    if asked or jax.default_backend() == "cpu":
      warn_fallback_once()
    return {"cpu": reference.update_leaves, **reference_only}
  return {"cpu": on_cpu, **reference_only}


def update_leaves(
    leaves: Sequence[contract.LeafOperands],
    facts: Sequence[contract.LeafFacts],
    s: Any,
    step: contract.Step,
    *,
    direct: bool = False,
) -> list[contract.LeafResult]:
  """The kernel contract (:mod:`optax_hybrid.kernels.contract`); one custom call per 64 supported leaves.

  Leaves of a rule it does not implement (:func:`implements`) and leaves it
  has no loop for take the reference rule in the same step. Of the master
  formats (:mod:`optax_hybrid.masters`) it takes a float32 copy (stepped as
  the param, the new param rounded beside it:
  :func:`reference.with_master_as_param`); ``"kahan"`` and ``"stochastic"``
  leaves take the reference (:func:`implements_master`). Off a CPU the
  reference runs (``lax.platform_dependent`` picks at lowering); ``direct=True``
  emits the custom call without it (:func:`on_cpu`).
  """
  if not _load() or not implements(step.rule) or not implements_master(step.master):
    return reference.update_leaves(leaves, facts, s, step)
  if leaves and packed.is_packed(leaves[0].state[0] if leaves[0].state else None):
    step = step._replace(packed=True)  # packed moments (every leaf of a step, or none): the calls take the pools
  if direct:
    return on_cpu(leaves, facts, s, step)
  return contract.per_platform({"cpu": on_cpu, "default": reference.update_leaves}, leaves, facts, s, step)


def on_cpu(
    leaves: Sequence[contract.LeafOperands],
    facts: Sequence[contract.LeafFacts],
    s: Any,
    step: contract.Step,
) -> list[contract.LeafResult]:
  """:func:`update_leaves` where the plan routed the step (:func:`optax_hybrid.kernels.kernels_for`): on a CPU,
  the library loaded and the rule implemented, checked once; the master format and the layout are read from
  ``step``.

  The custom call is emitted directly: for a step lowered for a CPU, and for
  host compute on the CPU backend, where a ``platform_dependent`` would type
  its branches' outputs inconsistently. As
  :func:`reference.with_reference_for_the_rest`: the reference steps the
  leaves :func:`supports` does not take, first; the others go in calls of at
  most :data:`MAX_LEAVES_PER_CALL` leaves (packed moments: each call updating
  the pools in place, :func:`_in_pools`). Where the reference's packed leaves
  share a pool with the kernel's (pools are per dtype, so rarely), they read
  it before the calls update it in place: a barrier orders those reads first.
  """
  if step.master.active:
    if not implements_master(step.master):
      return reference.update_leaves(leaves, facts, s, step)
    return reference.with_master_as_param(lambda l, f, plain: on_cpu(l, f, s, plain), leaves, facts, step)
  taken = [supports(leaf, fact, step) for leaf, fact in zip(leaves, facts)]
  pick = lambda xs, want: [x for x, t in zip(xs, taken) if t == want]
  rule_out = reference.update_leaves(pick(leaves, False), pick(facts, False), s, step) if not all(taken) else []
  if not any(taken):
    return rule_out
  kept, kept_facts = pick(leaves, True), pick(facts, True)
  if step.packed:
    pools = _pools(kept)
    shared = {k: pools[k] for k in _pools(pick(leaves, False)) if k in pools}
    if shared:
      shared, rule_out = lax.optimization_barrier((shared, rule_out))
      now = lambda x: packed.PackedSlice(shared.get(x.key, x.pool), x.key, x.offset, x.shape)
      kept = [leaf._replace(state=jax.tree.map(now, tuple(leaf.state), is_leaf=packed.is_slice)) for leaf in kept]
    kernel_out = _in_pools(kept, kept_facts, s, step)
  else:
    kernel_out = [result for start in range(0, len(kept), MAX_LEAVES_PER_CALL)
                  for result in _native_call(kept[start:start + MAX_LEAVES_PER_CALL],
                                             kept_facts[start:start + MAX_LEAVES_PER_CALL], s, step)]
  kernel_out, rule_out = iter(kernel_out), iter(rule_out)
  return [next(kernel_out) if t else next(rule_out) for t in taken]
