r"""The fused AdamW step as a Pallas GPU kernel: one launch per group of leaves.

Each launch takes up to :data:`MAX_LEAVES_PER_LAUNCH` leaves, each in its own
buffer (nothing is concatenated, so nothing is copied and the state stays
shaped like the params). The grid is the concatenation of every leaf's blocks:
program ``i`` finds its leaf in a static offsets table (block starts, known at
trace time) and updates one block of it. Per element the kernel reads
:math:`g, m, v` (and :math:`p` when it is needed) once and writes :math:`m, v`
and the new parameter (or the update) once, in place through
``input_output_aliases``: 28 bytes per fp32 parameter, the floor. The arithmetic
is :func:`reference.adam_leaf_update` itself, applied to a block, so the kernel
cannot drift from the rule it is tested against.

Hyperparameters (learning rate, betas, eps, weight decay, both bias
corrections, the skip flag) arrive as a float32 vector operand, so a changing
learning rate or step count never recompiles.

On a GPU the kernel is lowered with Pallas' Triton backend. The Mosaic GPU
backend (JAX's default for ``pallas_call`` on GPUs) pipelines every operand's
block into shared memory for every program; with one operand set per leaf that
would copy every leaf's block in every program. Triton refs are plain pointers:
a program only touches the leaf it owns. On other platforms (the CPU tests) the
same kernel runs in Pallas interpret mode, chosen at lowering time by
``lax.platform_dependent``.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from optax_hybrid.kernels import reference

# Elements per program, and warps per program. Power-of-two blocks are a Triton
# requirement; 4096 fp32 elements per 8 warps is 16 per thread, enough
# independent loads in flight to saturate HBM (benchmarks/gpu_check.py sweeps
# alternatives).
BLOCK_SIZE = 4096
NUM_WARPS = 8

# A CUDA kernel's parameters are limited to 4 KiB on older toolchains. A launch
# passes 7 pointers per leaf (g, m, v, p in; p, m, v out): 64 leaves is 3.6 KiB.
MAX_LEAVES_PER_LAUNCH = 64

_STORAGE = {np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)}
# Offsets are int32 inside the kernel.
_MAX_ELEMENTS = 2**31 - 1 - BLOCK_SIZE

_GPU_CUSTOM_CALL = "__gpu$xla.gpu.triton"

# Order of the scalars vector.
_LR, _B1, _B2, _EPS, _WD, _BC1, _BC2_SQRT, _STEP_OK = range(8)


def supports(grad, mu, nu, param, update_dtype) -> bool:
  """Whether a leaf can go through the kernel (real float16/bfloat16/float32 leaves, non-empty)."""
  dtypes = [grad.dtype, mu.dtype, nu.dtype, update_dtype] + ([] if param is None else [param.dtype])
  if any(np.dtype(d) not in _STORAGE for d in dtypes):
    return False
  return 0 < int(np.prod(np.shape(grad))) <= _MAX_ELEMENTS


def _pack_scalars(s: reference.AdamScalars) -> jax.Array:
  step_ok = jnp.ones([], jnp.float32) if s.step_ok is None else s.step_ok.astype(jnp.float32)
  return jnp.stack([
      s.learning_rate, s.b1, s.b2, s.eps, s.weight_decay, s.bias_correction1, s.bias_correction2_sqrt, step_ok,
  ]).astype(jnp.float32)


def _launch(grads, mus, nus, params, decays, out_dtypes, scalars, *, adamw_mode, write_params, skips,
            interpret, block_size, num_warps):
  """One ``pallas_call`` over a list of flat, non-empty leaves."""
  sizes = [int(g.shape[0]) for g in grads]
  starts = np.cumsum([0] + [-(-n // block_size) for n in sizes]).tolist()
  reads_param = [write_params or d for d in decays]

  operands, slots, aliases = [scalars], [], {}
  out_shapes = []
  for i, (g, m, v, p, dt) in enumerate(zip(grads, mus, nus, params, out_dtypes)):
    slot = {"g": len(operands), "m": len(operands) + 1, "v": len(operands) + 2}
    operands += [g, m, v]
    if reads_param[i]:
      slot["p"] = len(operands)
      operands.append(p)
    # The new param overwrites the old one; an update may overwrite its gradient.
    if write_params:
      aliases[slot["p"]] = 3 * i
    elif np.dtype(g.dtype) == np.dtype(dt):
      aliases[slot["g"]] = 3 * i
    aliases[slot["m"]] = 3 * i + 1
    aliases[slot["v"]] = 3 * i + 2
    slots.append(slot)
    out_shapes += [jax.ShapeDtypeStruct(g.shape, dt), jax.ShapeDtypeStruct(m.shape, m.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype)]
  n_in = len(operands)

  def kernel(*refs):
    s_ref, outs = refs[0], refs[n_in:]
    program = pl.program_id(0)
    s = reference.AdamScalars(*(s_ref[k] for k in range(_STEP_OK)))
    for i, slot in enumerate(slots):

      @pl.when((program >= starts[i]) & (program < starts[i + 1]))
      def _(i=i, slot=slot):
        offset = (program - starts[i]) * block_size
        block = pl.ds(pl.multiple_of(offset, block_size), block_size)
        inside = offset + jnp.arange(block_size, dtype=jnp.int32) < sizes[i]
        load = lambda name: pl_triton.load(refs[slot[name]].at[block], mask=inside, other=0)
        g, m, v = load("g"), load("m"), load("v")
        p = load("p") if "p" in slot else None
        first, new_m, new_v = reference.adam_leaf_update(
            g, m, v, p, s, adamw_mode=adamw_mode, decay=decays[i], update_dtype=out_dtypes[i],
            write_params=write_params)
        if skips:
          ok = s_ref[_STEP_OK] != 0
          first = jnp.where(ok, first, p if write_params else jnp.zeros_like(first))
          new_m, new_v = jnp.where(ok, new_m, m), jnp.where(ok, new_v, v)
        for out, value in zip(outs[3 * i:3 * i + 3], (first, new_m, new_v)):
          pl_triton.store(out.at[block], value, mask=inside)

  call = pl.pallas_call(
      kernel,
      out_shape=out_shapes,
      grid=(starts[-1],),
      input_output_aliases=aliases,
      interpret=interpret,
      compiler_params=pl_triton.CompilerParams(num_warps=num_warps),
      name="optax_hybrid_adamw",
  )
  outs = call(*operands)
  return list(outs[0::3]), list(outs[1::3]), list(outs[2::3])


def _run(grads, mus, nus, params, decays, out_dtypes, scalars, *, interpret, block_size, num_warps, **rule):
  shapes = [g.shape for g in grads]
  flat = lambda xs: [None if x is None else x.reshape(-1) for x in xs]
  grads, mus, nus, params = flat(grads), flat(mus), flat(nus), flat(params)
  outs = ([], [], [])
  for start in range(0, len(grads), MAX_LEAVES_PER_LAUNCH):
    part = slice(start, start + MAX_LEAVES_PER_LAUNCH)
    for acc, new in zip(outs, _launch(grads[part], mus[part], nus[part], params[part], decays[part],
                                      out_dtypes[part], scalars, interpret=interpret, block_size=block_size,
                                      num_warps=num_warps, **rule)):
      acc.extend(new)
  return tuple([x.reshape(shape) for x, shape in zip(xs, shapes)] for xs in outs)


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
    block_size: int = BLOCK_SIZE,
    num_warps: int = NUM_WARPS,
) -> tuple[list, list, list]:
  """Same contract as :func:`reference.update_leaves`; one launch per :data:`MAX_LEAVES_PER_LAUNCH` leaves.

  Leaves the kernel does not take (complex, float64, empty) go to the
  reference rule in the same step. On CUDA and ROCm the kernel is compiled
  with Triton; elsewhere it runs in Pallas interpret mode.
  """
  if block_size <= 0 or block_size & (block_size - 1):
    raise ValueError(f"pallas kernel: `block_size` must be a positive power of two, got {block_size}.")
  n = len(grads)
  rule = dict(adamw_mode=adamw_mode, write_params=write_params)
  taken = [i for i in range(n) if supports(grads[i], mus[i], nus[i],
                                           params[i] if (decays[i] or write_params) else None,
                                           update_dtypes[i])]

  def run_pallas(g, m, v, p, decays, dtypes):
    run = functools.partial(_run, decays=decays, out_dtypes=dtypes, scalars=_pack_scalars(s),
                            skips=s.step_ok is not None, block_size=block_size, num_warps=num_warps, **rule)
    on_gpu = lambda *ops: run(*ops, interpret=False)
    interpreted = lambda *ops: run(*ops, interpret=True)
    return jax.lax.platform_dependent(g, m, v, p, cuda=on_gpu, rocm=on_gpu, default=interpreted)

  return reference.with_reference_for_the_rest(taken, run_pallas, grads, mus, nus, params, decays,
                                               update_dtypes, s, **rule)


def gpu_launches(hlo_text: str) -> int:
  """The number of Pallas GPU kernel launches in lowered StableHLO text."""
  return hlo_text.count(f"@{_GPU_CUSTOM_CALL}") + hlo_text.count(f'"{_GPU_CUSTOM_CALL}"')
