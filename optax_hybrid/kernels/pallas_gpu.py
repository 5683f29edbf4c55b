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
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from optax_hybrid.kernels import contract, quantized, reference

# Elements per program, and warps per program. Power-of-two blocks are a Triton
# requirement; 4096 fp32 elements per 8 warps is 16 per thread, enough
# independent loads in flight to saturate HBM (benchmarks/gpu_check.py sweeps
# alternatives).
BLOCK_SIZE = 4096
NUM_WARPS = 8

# A CUDA kernel's parameters are limited to 4 KiB on older toolchains. A launch
# passes 7 pointers per leaf (g, m, v, p in; p, m, v out): 64 leaves is 3.6 KiB.
MAX_LEAVES_PER_LAUNCH = 64

# Offsets are int32 inside the kernel.
_MAX_ELEMENTS = 2**31 - 1 - BLOCK_SIZE

_GPU_CUSTOM_CALL = "__gpu$xla.gpu.triton"

# Position of the skip flag in the scalars vector (contract.pack_scalars).
_STEP_OK = contract.AdamScalars._fields.index("step_ok")


def supports(leaf: contract.LeafOperands, fact: contract.LeafFacts) -> bool:
  """Whether a leaf can go through the kernel (real float16/bfloat16/float32 leaves, non-empty)."""
  if isinstance(leaf.mu, quantized.QuantizedMoment) or isinstance(leaf.nu, quantized.QuantizedMoment):
    return False
  dtypes = [leaf.grad.dtype, leaf.mu.dtype, leaf.nu.dtype, fact.out_dtype]
  dtypes += [] if leaf.param is None else [leaf.param.dtype]
  if any(np.dtype(d) not in contract.STORAGE_DTYPES for d in dtypes):
    return False
  return 0 < int(np.prod(np.shape(leaf.grad))) <= _MAX_ELEMENTS


def _launch(leaves, facts, scalars, rule, *, skips, interpret, block_size, num_warps):
  """One ``pallas_call`` over a list of flat, non-empty leaves."""
  sizes = [int(leaf.grad.shape[0]) for leaf in leaves]
  starts = np.cumsum([0] + [-(-n // block_size) for n in sizes]).tolist()

  operands, slots, aliases = [scalars], [], {}
  out_shapes = []
  for i, (leaf, fact) in enumerate(zip(leaves, facts)):
    slot = {"g": len(operands), "m": len(operands) + 1, "v": len(operands) + 2}
    operands += [leaf.grad, leaf.mu, leaf.nu]
    if leaf.param is not None:
      slot["p"] = len(operands)
      operands.append(leaf.param)
    # The new param overwrites the old one; an update may overwrite its gradient.
    if rule.write_params:
      aliases[slot["p"]] = 3 * i
    elif np.dtype(leaf.grad.dtype) == np.dtype(fact.out_dtype):
      aliases[slot["g"]] = 3 * i
    aliases[slot["m"]] = 3 * i + 1
    aliases[slot["v"]] = 3 * i + 2
    slots.append(slot)
    out_shapes += [jax.ShapeDtypeStruct(leaf.grad.shape, fact.out_dtype),
                   jax.ShapeDtypeStruct(leaf.mu.shape, leaf.mu.dtype),
                   jax.ShapeDtypeStruct(leaf.nu.shape, leaf.nu.dtype)]
  n_in = len(operands)

  def kernel(*refs):
    s_ref, outs = refs[0], refs[n_in:]
    program = pl.program_id(0)
    s = contract.AdamScalars(*(s_ref[k] for k in range(_STEP_OK)))
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
            g, m, v, p, s, adamw_mode=rule.adamw_mode, decay=facts[i].decay, update_dtype=facts[i].out_dtype,
            write_params=rule.write_params)
        if skips:
          ok = s_ref[_STEP_OK] != 0
          first = jnp.where(ok, first, p if rule.write_params else jnp.zeros_like(first))
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
  return [contract.LeafResult(*outs[3 * i:3 * i + 3]) for i in range(len(leaves))]


def _run(leaves, facts, s, rule, *, interpret, block_size, num_warps):
  """Every leaf flattened to 1-D, one launch per :data:`MAX_LEAVES_PER_LAUNCH` leaves, results reshaped back."""
  flat = [contract.LeafOperands(*(None if x is None else x.reshape(-1) for x in leaf)) for leaf in leaves]
  launch = functools.partial(_launch, scalars=contract.pack_scalars(s), rule=rule, skips=s.step_ok is not None,
                             interpret=interpret, block_size=block_size, num_warps=num_warps)
  results = contract.in_chunks(launch, flat, list(facts), MAX_LEAVES_PER_LAUNCH)
  return [contract.LeafResult(*(x.reshape(leaf.grad.shape) for x in result))
          for leaf, result in zip(leaves, results)]


def update_leaves(
    leaves: Sequence[contract.LeafOperands],
    facts: Sequence[contract.LeafFacts],
    s: contract.AdamScalars,
    rule: contract.Rule,
    *,
    block_size: int = BLOCK_SIZE,
    num_warps: int = NUM_WARPS,
) -> list[contract.LeafResult]:
  """The kernel contract (:mod:`optax_hybrid.kernels.contract`); one launch per 64 leaves.

  Leaves the kernel does not take (complex, float64, empty) go to the
  reference rule in the same step. On CUDA and ROCm the kernel is compiled
  with Triton; elsewhere it runs in Pallas interpret mode.
  """
  if block_size <= 0 or block_size & (block_size - 1):
    raise ValueError(f"pallas kernel: `block_size` must be a positive power of two, got {block_size}.")

  def run_pallas(leaves, facts):
    run = functools.partial(_run, facts=facts, s=s, rule=rule, block_size=block_size, num_warps=num_warps)
    on_gpu = lambda leaves: run(leaves, interpret=False)
    interpreted = lambda leaves: run(leaves, interpret=True)
    return contract.per_platform({"cuda": on_gpu, "rocm": on_gpu, "default": interpreted}, leaves)

  return reference.with_reference_for_the_rest(supports, run_pallas, leaves, facts, s, rule)


def gpu_launches(hlo_text: str) -> int:
  """The number of Pallas GPU kernel launches in lowered StableHLO text."""
  return hlo_text.count(f"@{_GPU_CUSTOM_CALL}") + hlo_text.count(f'"{_GPU_CUSTOM_CALL}"')
