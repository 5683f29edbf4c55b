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

8-bit block-wise moments (:mod:`optax_hybrid.kernels.quantized`) go through
the same launch. Such a leaf is seen as rows of one quantization block each
(256 values), and a program owns a tile of :data:`ROWS_PER_PROGRAM` whole
rows: it loads ``g``, ``p``, both moments' codes and scales, decodes the
codes (arithmetic on the code bits: no table), steps, and quantizes the new
moments (each row's largest magnitude is reduced in registers), storing codes
and scales in place. About 16 bytes per fp32 parameter instead of 28. The
8-bit leaves of a launch share one copy of that body, between a load and a
store that switch on the leaf (their decay is a runtime factor on the weight
decay), so the kernel's compile time does not grow by a quantizer per leaf.

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
from typing import NamedTuple, Sequence

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

# Quantization blocks per program for 8-bit leaves: a 16 x 256 tile holds as
# many values as BLOCK_SIZE, so both kinds of program do the same work per warp.
ROWS_PER_PROGRAM = 16

# A CUDA kernel's parameters are limited to 4 KiB on older toolchains. A launch
# passes 7 pointers per leaf (g, m, v, p in; p, m, v out): 64 leaves is 3.6 KiB.
MAX_LEAVES_PER_LAUNCH = 64
# The same 3.6 KiB as a pointer budget, the scalars included: an 8-bit leaf
# passes 11 pointers (g, p, two codes and two scales in; p, two codes and two
# scales out), so 40 of them share a launch.
_MAX_POINTERS_PER_LAUNCH = 1 + 7 * MAX_LEAVES_PER_LAUNCH

# Offsets are int32 inside the kernel.
_MAX_ELEMENTS = 2**31 - 1 - BLOCK_SIZE

_GPU_CUSTOM_CALL = "__gpu$xla.gpu.triton"

# Position of the skip flag in the scalars vector (contract.pack_scalars).
_STEP_OK = contract.AdamScalars._fields.index("step_ok")


def _is_quantized(leaf: contract.LeafOperands) -> bool:
  return isinstance(leaf.mu, quantized.QuantizedMoment) or isinstance(leaf.nu, quantized.QuantizedMoment)


def supports(leaf: contract.LeafOperands, fact: contract.LeafFacts) -> bool:
  """Whether a leaf can go through the kernel.

  Real, non-empty float16/bfloat16/float32 leaves whose moments are stored in
  one of those dtypes, or whose two moments are both 8-bit block-wise
  (:class:`~optax_hybrid.kernels.quantized.QuantizedMoment`) with a last axis
  that is a whole number of quantization blocks (a multiple of
  ``quantized.BLOCK_SIZE`` = 256). An 8-bit leaf whose rows end in a shorter
  block takes the reference rule, in the same step.
  """
  dtypes = [leaf.grad.dtype, fact.out_dtype] + ([] if leaf.param is None else [leaf.param.dtype])
  if _is_quantized(leaf):
    moments = (leaf.mu, leaf.nu)
    if not all(isinstance(m, quantized.QuantizedMoment) for m in moments):
      return False
    if any(np.dtype(m.codes.dtype) != quantized.CODE_DTYPE or np.dtype(m.scales.dtype) != quantized.SCALE_DTYPE
           for m in moments):
      return False
    if np.ndim(leaf.grad) == 0 or np.shape(leaf.grad)[-1] % quantized.BLOCK_SIZE:
      return False
  else:
    dtypes += [leaf.mu.dtype, leaf.nu.dtype]
  if any(np.dtype(d) not in contract.STORAGE_DTYPES for d in dtypes):
    return False
  return 0 < int(np.prod(np.shape(leaf.grad))) <= _MAX_ELEMENTS


def _parts(moment) -> list:
  """A moment's arrays: itself, or an 8-bit moment's codes and scales."""
  return list(moment) if isinstance(moment, quantized.QuantizedMoment) else [moment]


def _pointers(leaf: contract.LeafOperands) -> int:
  """Buffers a leaf passes to a launch: its inputs, and as many outputs less the param."""
  n_in = 1 + len(_parts(leaf.mu)) + len(_parts(leaf.nu)) + (leaf.param is not None)
  return 2 * n_in - (leaf.param is not None)


def _launch_groups(leaves: Sequence[contract.LeafOperands]) -> list[slice]:
  """Consecutive leaves, one slice per launch: at most 64 leaves and the pointer budget each."""
  groups, start, pointers = [], 0, 1
  for i, leaf in enumerate(leaves):
    need = _pointers(leaf)
    if i > start and (i - start == MAX_LEAVES_PER_LAUNCH or pointers + need > _MAX_POINTERS_PER_LAUNCH):
      groups.append(slice(start, i))
      start, pointers = i, 1
    pointers += need
  if start < len(leaves):
    groups.append(slice(start, len(leaves)))
  return groups


class _Slots(NamedTuple):
  """Where one leaf's arrays are among a launch's operands and outputs."""

  grad: int
  mu: list  # one operand index per part of the moment (an array, or codes and scales)
  nu: list
  param: int | None
  first_out: int  # index of its first result; the moments' parts follow


def _launch(leaves, facts, scalars, rule, *, skips, interpret, block_size, rows_per_program, num_warps):
  """One ``pallas_call`` over leaves in their kernel views (:func:`_kernel_view`)."""
  rows_tile = (rows_per_program, quantized.BLOCK_SIZE)
  operands, slots, aliases, out_shapes = [scalars], [], {}, []
  starts = [0]
  for leaf, fact in zip(leaves, facts):
    if _is_quantized(leaf):
      starts.append(starts[-1] + -(-int(leaf.grad.shape[0]) // rows_per_program))
    else:
      starts.append(starts[-1] + -(-int(leaf.grad.shape[0]) // block_size))
    grad = len(operands)
    operands.append(leaf.grad)
    moments = []
    for moment in (leaf.mu, leaf.nu):
      moments.append(list(range(len(operands), len(operands) + len(_parts(moment)))))
      operands += _parts(moment)
    param = None
    if leaf.param is not None:
      param = len(operands)
      operands.append(leaf.param)
    slot = _Slots(grad, moments[0], moments[1], param, len(out_shapes))
    # The new param overwrites the old one; an update may overwrite its gradient.
    if rule.write_params:
      aliases[param] = slot.first_out
    elif np.dtype(leaf.grad.dtype) == np.dtype(fact.out_dtype):
      aliases[grad] = slot.first_out
    out_shapes.append(jax.ShapeDtypeStruct(leaf.grad.shape, fact.out_dtype))
    for index in slot.mu + slot.nu:  # every moment array (codes, scales) is updated in place
      aliases[index] = len(out_shapes)
      out_shapes.append(jax.ShapeDtypeStruct(operands[index].shape, operands[index].dtype))
    slots.append(slot)
  n_in = len(operands)

  eight_bit = [i for i, leaf in enumerate(leaves) if _is_quantized(leaf)]

  def kernel(*refs):
    s_ref, outs = refs[0], refs[n_in:]
    program = pl.program_id(0)
    s = contract.AdamScalars(*(s_ref[k] for k in range(_STEP_OK)))
    ok = s_ref[_STEP_OK] != 0

    def step(g, mu, nu, p, s, *, decay, update_dtype):
      """The rule on one tile; a skipped step keeps every moment array (codes and scales included)."""
      first, new_mu, new_nu = reference.adam_leaf_update(
          g, mu, nu, p, s, adamw_mode=rule.adamw_mode, decay=decay, update_dtype=update_dtype,
          write_params=rule.write_params)
      if skips:
        first = jnp.where(ok, first, p if rule.write_params else jnp.zeros_like(first))
        keep = lambda new, old: jnp.where(ok, new, old)
        new_mu, new_nu = jax.tree.map(keep, new_mu, mu), jax.tree.map(keep, new_nu, nu)
      return first, new_mu, new_nu

    # Float-moment leaves: a body per leaf, each with its own static dtypes and decay.
    for i, leaf in enumerate(leaves):
      if i in eight_bit:
        continue
      slot, fact, size = slots[i], facts[i], int(leaf.grad.shape[0])

      @pl.when((program >= starts[i]) & (program < starts[i + 1]))
      def _(i=i, slot=slot, fact=fact, size=size):
        offset = (program - starts[i]) * block_size
        block = pl.ds(pl.multiple_of(offset, block_size), block_size)
        inside = offset + jnp.arange(block_size, dtype=jnp.int32) < size
        load = lambda k: pl_triton.load(refs[k].at[block], mask=inside, other=0)
        p = None if slot.param is None else load(slot.param)
        results = step(load(slot.grad), load(slot.mu[0]), load(slot.nu[0]), p, s, decay=fact.decay,
                       update_dtype=fact.out_dtype)
        for k, value in enumerate(results):
          pl_triton.store(outs[slot.first_out + k].at[block], value, mask=inside)

    if eight_bit:
      # 8-bit leaves: one shared body (the rule with the quantizer is large: a copy per leaf
      # would multiply the kernel's compile time), between a load and a store that switch on the
      # leaf. Each leaf's tile is loaded as float32, its decay is a runtime factor on the weight
      # decay, and the first result is rounded to the leaf's dtype at its store.
      mine = functools.reduce(jnp.logical_or, [(program >= starts[i]) & (program < starts[i + 1])
                                               for i in eight_bit])

      @pl.when(mine)
      def _():
        leaf_index = sum((program >= starts[i + 1]).astype(jnp.int32) for i in eight_bit)  # 8-bit leaves before
        pick = lambda values, dtype: functools.reduce(
            lambda acc, kv: jnp.where(leaf_index == kv[0], jnp.asarray(kv[1], dtype), acc), enumerate(values),
            jnp.zeros([], dtype))
        row0 = (program - pick([starts[i] for i in eight_bit], jnp.int32)) * rows_per_program
        n_rows = pick([int(leaves[i].grad.shape[0]) for i in eight_bit], jnp.int32)
        rows = pl.ds(pl.multiple_of(row0, rows_per_program), rows_per_program)
        inside = row0 + jnp.arange(rows_per_program, dtype=jnp.int32) < n_rows
        tile_inside = jnp.broadcast_to(inside[:, None], rows_tile)
        load_tile = lambda k: pl_triton.load(refs[k].at[rows, :], mask=tile_inside, other=0)
        load_scales = lambda k: pl_triton.load(refs[k].at[rows], mask=inside, other=0)
        reads_param = rule.write_params or any(facts[i].decay for i in eight_bit)

        def loader(slot):
          def load():
            p = jnp.zeros(rows_tile, jnp.float32) if slot.param is None else load_tile(slot.param).astype(jnp.float32)
            return (load_tile(slot.grad).astype(jnp.float32), p, load_tile(slot.mu[0]), load_scales(slot.mu[1]),
                    load_tile(slot.nu[0]), load_scales(slot.nu[1]))
          return load

        g, p, mu_codes, mu_scales, nu_codes, nu_scales = jax.lax.switch(
            leaf_index, [loader(slots[i]) for i in eight_bit])
        # Scales as a (rows, 1) column: the format's scales of a (rows, 256) tile.
        mu = quantized.QuantizedMoment(mu_codes, mu_scales[:, None])
        nu = quantized.QuantizedMoment(nu_codes, nu_scales[:, None])
        decays = pick([1.0 if facts[i].decay else 0.0 for i in eight_bit], jnp.float32)
        first, new_mu, new_nu = step(g, mu, nu, p if reads_param else None,
                                     s._replace(weight_decay=s.weight_decay * decays),
                                     decay=any(facts[i].decay for i in eight_bit), update_dtype=jnp.float32)

        def storer(slot, fact):
          def store():
            pl_triton.store(outs[slot.first_out].at[rows, :], first.astype(fact.out_dtype), mask=tile_inside)
            for k, moment in enumerate((new_mu, new_nu)):
              pl_triton.store(outs[slot.first_out + 1 + 2 * k].at[rows, :], moment.codes, mask=tile_inside)
              pl_triton.store(outs[slot.first_out + 2 + 2 * k].at[rows], moment.scales.reshape(rows_per_program),
                              mask=inside)
          return store

        jax.lax.switch(leaf_index, [storer(slots[i], facts[i]) for i in eight_bit])

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
  results = []
  for leaf, slot in zip(leaves, slots):
    parts = iter(outs[slot.first_out + 1:])
    moment = lambda like: (quantized.QuantizedMoment(next(parts), next(parts))
                           if isinstance(like, quantized.QuantizedMoment) else next(parts))
    first = outs[slot.first_out]
    new_mu = moment(leaf.mu)
    results.append(contract.LeafResult(first, new_mu, moment(leaf.nu)))
  return results


def _kernel_view(leaf: contract.LeafOperands) -> contract.LeafOperands:
  """A leaf as the kernel indexes it: flat (1-D), or for 8-bit moments rows of one quantization block.

  An 8-bit leaf of shape ``(..., L)`` (``L`` a multiple of 256) becomes
  ``(size / 256, 256)`` tiles (grad, param, codes) and ``(size / 256,)``
  scales: row ``r`` is block ``r`` in row-major order, whose scale is
  ``scales.reshape(-1)[r]``.
  """
  if not _is_quantized(leaf):
    return contract.LeafOperands(*(None if x is None else x.reshape(-1) for x in leaf))
  rows = lambda x: None if x is None else x.reshape(-1, quantized.BLOCK_SIZE)
  moment = lambda q: quantized.QuantizedMoment(rows(q.codes), q.scales.reshape(-1))
  return contract.LeafOperands(rows(leaf.grad), moment(leaf.mu), moment(leaf.nu), rows(leaf.param))


def _run(leaves, facts, s, rule, *, interpret, block_size, rows_per_program, num_warps):
  """Every leaf in its kernel view, one launch per group (:func:`_launch_groups`), results reshaped back."""
  views = [_kernel_view(leaf) for leaf in leaves]
  launch = functools.partial(_launch, scalars=contract.pack_scalars(s), rule=rule, skips=s.step_ok is not None,
                             interpret=interpret, block_size=block_size, rows_per_program=rows_per_program,
                             num_warps=num_warps)
  results = []
  for group in _launch_groups(views):
    results += launch(views[group], list(facts[group]))
  shaped = lambda x, like: x.reshape(like.shape)
  return [contract.LeafResult(result.first.reshape(leaf.grad.shape), jax.tree.map(shaped, result.mu, leaf.mu),
                              jax.tree.map(shaped, result.nu, leaf.nu))
          for leaf, result in zip(leaves, results)]


def update_leaves(
    leaves: Sequence[contract.LeafOperands],
    facts: Sequence[contract.LeafFacts],
    s: contract.AdamScalars,
    rule: contract.Rule,
    *,
    block_size: int = BLOCK_SIZE,
    rows_per_program: int = ROWS_PER_PROGRAM,
    num_warps: int = NUM_WARPS,
) -> list[contract.LeafResult]:
  """The kernel contract (:mod:`optax_hybrid.kernels.contract`); one launch per 64 leaves (40 8-bit ones).

  Leaves the kernel does not take (complex, float64, empty, 8-bit with a
  partial last block: :func:`supports`) go to the reference rule in the same
  step. On CUDA and ROCm the kernel is compiled with Triton; elsewhere it runs
  in Pallas interpret mode. ``block_size`` (elements of a float-moment leaf)
  and ``rows_per_program`` (256-value blocks of an 8-bit leaf) set what one
  program updates.

  Raises:
    ValueError: ``block_size`` or ``rows_per_program`` is not a positive power of two.
  """
  for name, value in (("block_size", block_size), ("rows_per_program", rows_per_program)):
    if value <= 0 or value & (value - 1):
      raise ValueError(f"pallas kernel: `{name}` must be a positive power of two, got {value}.")

  def run_pallas(leaves, facts):
    run = functools.partial(_run, facts=facts, s=s, rule=rule, block_size=block_size,
                            rows_per_program=rows_per_program, num_warps=num_warps)
    on_gpu = lambda leaves: run(leaves, interpret=False)
    interpreted = lambda leaves: run(leaves, interpret=True)
    return contract.per_platform({"cuda": on_gpu, "rocm": on_gpu, "default": interpreted}, leaves)

  return reference.with_reference_for_the_rest(supports, run_pallas, leaves, facts, s, rule)


def gpu_launches(hlo_text: str) -> int:
  """The number of Pallas GPU kernel launches in lowered StableHLO text."""
  return hlo_text.count(f"@{_GPU_CUSTOM_CALL}") + hlo_text.count(f'"{_GPU_CUSTOM_CALL}"')
