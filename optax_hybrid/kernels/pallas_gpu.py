r"""Any update rule as a Pallas GPU kernel: one launch per group of leaves.

Each launch takes up to :data:`MAX_LEAVES_PER_LAUNCH` leaves, each in its own
buffer (nothing is concatenated, so nothing is copied and the state stays
shaped like the params). The grid is the concatenation of every leaf's blocks:
program ``i`` finds its leaf in a static offsets table (block starts, known at
trace time) and updates one block of it. Per element the kernel reads the
gradient, the rule's state (:math:`m, v` for Adam) and :math:`p` when it is
needed once, and writes the state and the new parameter (or the update) once,
in place through ``input_output_aliases``: 28 bytes per fp32 parameter for
Adam, the floor. The arithmetic is :func:`reference.leaf_update` itself,
applied to a block, so the kernel cannot drift from the rule it is tested
against. It runs the elementwise rules it lists (:data:`RULES`,
:func:`implements`): the built-in ones; another rule's leaves take the
reference, in the same step.

8-bit block-wise state (:mod:`optax_hybrid.kernels.quantized`) goes through
the same launch. Such a leaf is seen as rows of one quantization block each
(256 values), and a program owns a tile of :data:`ROWS_PER_PROGRAM` whole
rows: it loads ``g``, ``p``, each field's codes and scales, decodes the
codes (arithmetic on the code bits: no table), steps, and quantizes the new
values (each row's largest magnitude is reduced in registers), storing codes
and scales in place. About 16 bytes per fp32 parameter instead of 28 for
Adam. The 8-bit leaves of a launch share one copy of that body, between a load
and a store that switch on the leaf (their decay is a runtime factor on the
weight decay), so the kernel's compile time does not grow by a quantizer per
leaf.

The rule's scalars (for Adam: learning rate, betas, eps, weight decay, both
bias corrections) and the skip flag arrive as a float32 vector operand, so a
changing learning rate or step count never recompiles.

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
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from optax_hybrid import masters
from optax_hybrid.kernels import contract, packed, quantized, reference

# Elements per program, and warps per program. Power-of-two blocks are a Triton
# requirement; 4096 fp32 elements per 8 warps is 16 per thread, enough
# independent loads in flight to saturate HBM (benchmarks/gpu_check.py sweeps
# alternatives).
BLOCK_SIZE = 4096
NUM_WARPS = 8

# Quantization blocks per program for 8-bit leaves: a 16 x 256 tile holds as
# many values as BLOCK_SIZE, so both kinds of program do the same work per warp.
ROWS_PER_PROGRAM = 16

# A CUDA kernel's parameters are limited to 4 KiB on older toolchains. An Adam
# launch passes 7 pointers per leaf (g, m, v, p in; p, m, v out): 64 leaves is 3.6 KiB.
MAX_LEAVES_PER_LAUNCH = 64
# The same 3.6 KiB as a pointer budget, the scalars included: an 8-bit Adam
# leaf passes 11 pointers (g, p, two codes and two scales in; p, two codes and
# two scales out), so 40 of them share a launch.
_MAX_POINTERS_PER_LAUNCH = 1 + 7 * MAX_LEAVES_PER_LAUNCH

# Offsets are int32 inside the kernel.
_MAX_ELEMENTS = 2**31 - 1 - BLOCK_SIZE

#: The rules the kernel runs, by :attr:`optax_hybrid.base.UpdateRule.name`. Its body is the reference's leaf
#: step on a tile, which is right for a rule whose every value steps from that value's gradient, state and
#: param alone (each of these); a rule that reads across values (a factored second moment: a row's and a
#: column's) would be wrong on a tile, so a rule is run here only once it is listed, its leaves taking the
#: reference until then.
RULES = frozenset({"adam", "lion", "adagrad", "sgd"})


def implements(rule: Any) -> bool:
  """The rules in :data:`RULES` (elementwise rules, the tile's step being the reference's leaf step)."""
  return rule.name in RULES


def _is_quantized(leaf: contract.LeafOperands) -> bool:
  return any(isinstance(x, quantized.QuantizedMoment) for x in leaf.state)


def supports(leaf: contract.LeafOperands, fact: contract.LeafFacts, master: Any = masters.NO_MASTER) -> bool:
  """Whether a leaf can go through the kernel.

  Real, non-empty float16/bfloat16/float32 leaves whose state is stored in
  those dtypes, or whose every field is 8-bit block-wise
  (:class:`~optax_hybrid.kernels.quantized.QuantizedMoment`) with a last axis
  that is a whole number of quantization blocks (a multiple of
  ``quantized.BLOCK_SIZE`` = 256). An 8-bit leaf whose rows end in a shorter
  block takes the reference rule, in the same step, and so does an 8-bit leaf
  with a ``"kahan"`` or ``"stochastic"`` master (the 8-bit tiles share one
  body without master formats). ``master``: the step's master format
  (:attr:`contract.Step.master`).
  """
  if fact.moments is not None and "pallas" not in fact.moments.kernels:  # a format it does not implement
    return False
  dtypes = [leaf.grad.dtype, fact.out_dtype] + ([] if leaf.param is None else [leaf.param.dtype])
  if master.active:
    if _is_quantized(leaf):
      return False
    if master.keeps:  # what the format keeps (not a seed)
      dtypes.append(leaf.master.dtype)
  if _is_quantized(leaf):
    if not all(isinstance(m, quantized.QuantizedMoment) for m in leaf.state):
      return False
    if any(np.dtype(m.codes.dtype) != quantized.CODE_DTYPE or np.dtype(m.scales.dtype) != quantized.SCALE_DTYPE
           for m in leaf.state):
      return False
    if np.ndim(leaf.grad) == 0 or np.shape(leaf.grad)[-1] % quantized.BLOCK_SIZE:
      return False
  else:
    dtypes += [x.dtype for x in leaf.state]
  if any(np.dtype(d) not in contract.STORAGE_DTYPES for d in dtypes):
    return False
  return 0 < int(np.prod(np.shape(leaf.grad))) <= _MAX_ELEMENTS


def _parts(value) -> list:
  """A field's arrays: itself, or an 8-bit field's codes and scales."""
  return list(value) if isinstance(value, quantized.QuantizedMoment) else [value]


def _pointers(leaf: contract.LeafOperands) -> int:
  """Buffers a leaf passes to a launch: its inputs, and as many outputs less the param."""
  n_in = len(jax.tree.leaves(leaf))  # the gradient, each field's parts, the param and master operand if any
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
  state: list  # per field, one operand index per part (an array, or codes and scales)
  param: int | None
  first_out: int  # index of its first result; the fields' parts follow, then a kept master
  master: int | None = None  # the master format's operand: what it keeps, or a seed


class _Layout(NamedTuple):
  """A launch's operands and outputs: where each leaf's arrays are, and which programs are its."""

  operands: list  # the scalars vector, then each leaf's arrays
  slots: list  # one _Slots per leaf
  aliases: dict  # operand index -> output index, for in-place updates
  out_shapes: list
  starts: list  # leaf i owns programs starts[i] to starts[i + 1] - 1


def _layout(leaves, facts, scalars, step, block_size, rows_per_program) -> _Layout:
  operands, slots, aliases, out_shapes, starts = [scalars], [], {}, [], [0]
  for leaf, fact in zip(leaves, facts):
    per_program = rows_per_program if _is_quantized(leaf) else block_size
    starts.append(starts[-1] + -(-int(leaf.grad.shape[0]) // per_program))
    grad = len(operands)
    operands.append(leaf.grad)
    state = []
    for value in leaf.state:
      state.append(list(range(len(operands), len(operands) + len(_parts(value)))))
      operands += _parts(value)
    param = None
    if leaf.param is not None:
      param = len(operands)
      operands.append(leaf.param)
    master = None
    if step.master.active:  # its operand: what it keeps, or a seed
      master = len(operands)
      operands.append(leaf.master)
    slot = _Slots(grad, state, param, len(out_shapes), master)
    # The new param overwrites the old one (where it is read: a master format may stand in for it); an update,
    # or a new param not read, may overwrite its gradient.
    if step.write_params and param is not None:
      aliases[param] = slot.first_out
    elif np.dtype(leaf.grad.dtype) == np.dtype(fact.out_dtype):
      aliases[grad] = slot.first_out
    out_shapes.append(jax.ShapeDtypeStruct(leaf.grad.shape, fact.out_dtype))
    kept = [master] if step.master.keeps else []
    for index in [k for parts in state for k in parts] + kept:  # every state array is updated in place
      aliases[index] = len(out_shapes)
      out_shapes.append(jax.ShapeDtypeStruct(operands[index].shape, operands[index].dtype))
    slots.append(slot)
  return _Layout(operands, slots, aliases, out_shapes, starts)


def _launch(leaves, facts, s, step, *, interpret, block_size, rows_per_program, num_warps):
  """One ``pallas_call`` over leaves in their kernel views (:func:`_kernel_view`)."""
  names = [name for name in s._fields if name != "step_ok" and getattr(s, name) is not None]
  layout = _layout(leaves, facts, contract.pack_scalars(s, names), step, block_size, rows_per_program)
  n_in, skips = len(layout.operands), s.step_ok is not None
  eight_bit = [i for i, leaf in enumerate(leaves) if _is_quantized(leaf)]

  def kernel(*refs):
    s_ref, outs = refs[0], refs[n_in:]
    scalars = type(s)(**{**dict.fromkeys(s._fields), **{n: s_ref[k] for k, n in enumerate(names)}})
    ok = s_ref[len(names)] != 0

    def rule_step(g, state, p, scalars, *, decay, update_dtype, master=None, offset=0, shard=None, moments=None):
      """The rule on one tile: ``(first, state, master)``; a skipped step keeps every stored array."""
      if not step.master.active:
        first, new = reference.leaf_update(step, g, state, p, scalars, decay=decay, update_dtype=update_dtype,
                                           moments=moments)
        new_master = None
      else:  # the tile's elements start at flat position `offset` of the leaf
        first, new, new_master = reference.master_update(step, g, state, p, master, scalars, decay=decay,
                                                         update_dtype=update_dtype, offset=offset, shard=shard,
                                                         moments=moments)
      if skips:
        first = jnp.where(ok, first, p if step.write_params else jnp.zeros_like(first))
        new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, tuple(state))
        new_master = jnp.where(ok, new_master, master) if step.master.keeps else None
      return first, new, new_master

    program = pl.program_id(0)
    for i, leaf in enumerate(leaves):
      if i not in eight_bit:
        _float_body(i, leaf, facts[i], layout, refs, outs, program, rule_step, scalars, block_size, step.master)
    if eight_bit:
      _eight_bit_body(eight_bit, leaves, facts, layout, refs, outs, program, rule_step, scalars, step,
                      rows_per_program)

  call = pl.pallas_call(
      kernel,
      out_shape=layout.out_shapes,
      grid=(layout.starts[-1],),
      input_output_aliases=layout.aliases,
      interpret=interpret,
      compiler_params=pl_triton.CompilerParams(num_warps=num_warps),
      name=f"optax_hybrid_{step.rule.name}",
  )
  outs = call(*layout.operands)
  results = []
  for leaf, slot in zip(leaves, layout.slots):
    parts = iter(outs[slot.first_out + 1:])
    value = lambda like: (quantized.QuantizedMoment(next(parts), next(parts))
                          if isinstance(like, quantized.QuantizedMoment) else next(parts))
    first = outs[slot.first_out]
    state = tuple(value(x) for x in leaf.state)
    results.append(contract.LeafResult(first, state, next(parts) if step.master.keeps else None))
  return results


def _float_body(i, leaf, fact, layout, refs, outs, program, rule_step, scalars, block_size, master_format) -> None:
  """A float-state leaf's block: a body per leaf, each with its own static dtypes and decay."""
  slot, size, starts = layout.slots[i], int(leaf.grad.shape[0]), layout.starts

  @pl.when((program >= starts[i]) & (program < starts[i + 1]))
  def _():
    offset = (program - starts[i]) * block_size
    block = pl.ds(pl.multiple_of(offset, block_size), block_size)
    inside = offset + jnp.arange(block_size, dtype=jnp.int32) < size
    load = lambda k: pl_triton.load(refs[k].at[block], mask=inside, other=0)
    p = None if slot.param is None else load(slot.param)
    master = None  # what the format keeps, tiled like the leaf; or a seed, read whole
    if master_format.keeps:
      master = load(slot.master)
    elif master_format.random:
      master = refs[slot.master][...]
    first, new, new_master = rule_step(load(slot.grad), tuple(load(parts[0]) for parts in slot.state), p, scalars,
                                       decay=fact.decay, update_dtype=fact.out_dtype, master=master, offset=offset,
                                       shard=fact.shard, moments=fact.moments)
    for k, value in enumerate((first, *new) + ((new_master,) if master_format.keeps else ())):
      pl_triton.store(outs[slot.first_out + k].at[block], value, mask=inside)


def _eight_bit_body(eight_bit, leaves, facts, layout, refs, outs, program, rule_step, scalars, step,
                    rows_per_program) -> None:
  """The 8-bit leaves' tiles: one shared body, between a load and a store that switch on the leaf.

  The rule with the quantizer is large: a copy per leaf would multiply the
  kernel's compile time. Each leaf's tile is loaded as float32, its decay is a
  runtime factor on the weight decay, and the first result is rounded to the
  leaf's dtype at its store.
  """
  starts, slots = layout.starts, layout.slots
  rows_tile = (rows_per_program, quantized.BLOCK_SIZE)
  mine = functools.reduce(jnp.logical_or, [(program >= starts[i]) & (program < starts[i + 1]) for i in eight_bit])

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
    reads_param = step.write_params or any(facts[i].decay for i in eight_bit)

    def loader(slot):
      def load():
        p = jnp.zeros(rows_tile, jnp.float32) if slot.param is None else load_tile(slot.param).astype(jnp.float32)
        return (load_tile(slot.grad).astype(jnp.float32), p,
                tuple((load_tile(codes), load_scales(scales)) for codes, scales in slot.state))
      return load

    g, p, loaded = jax.lax.switch(leaf_index, [loader(slots[i]) for i in eight_bit])
    # Scales as a (rows, 1) column: the format's scales of a (rows, 256) tile.
    state = tuple(quantized.QuantizedMoment(codes, scales[:, None]) for codes, scales in loaded)
    decay, tile_scalars = any(facts[i].decay for i in eight_bit), scalars
    if decay:
      decays = pick([1.0 if facts[i].decay else 0.0 for i in eight_bit], jnp.float32)
      tile_scalars = scalars._replace(weight_decay=scalars.weight_decay * decays)
    # The 8-bit leaves share this body, so their format (the one that names this kernel) decodes every tile.
    first, new, _ = rule_step(g, state, p if reads_param else None, tile_scalars, decay=decay,
                              update_dtype=jnp.float32, moments=facts[eight_bit[0]].moments)

    def storer(slot, fact):
      def store():
        pl_triton.store(outs[slot.first_out].at[rows, :], first.astype(fact.out_dtype), mask=tile_inside)
        for k, value in enumerate(new):
          pl_triton.store(outs[slot.first_out + 1 + 2 * k].at[rows, :], value.codes, mask=tile_inside)
          pl_triton.store(outs[slot.first_out + 2 + 2 * k].at[rows], value.scales.reshape(rows_per_program),
                          mask=inside)
      return store

    jax.lax.switch(leaf_index, [storer(slots[i], facts[i]) for i in eight_bit])


def _kernel_view(leaf: contract.LeafOperands, kept: bool) -> contract.LeafOperands:
  """A leaf as the kernel indexes it: flat (1-D), or for 8-bit state rows of one quantization block.

  An 8-bit leaf of shape ``(..., L)`` (``L`` a multiple of 256) becomes
  ``(size / 256, 256)`` tiles (grad, param, codes) and ``(size / 256,)``
  scales: row ``r`` is block ``r`` in row-major order, whose scale is
  ``scales.reshape(-1)[r]``. What a master format keeps (``kept``) is
  flattened with the leaf; a random format's seed is passed as it is.
  """
  if not _is_quantized(leaf):
    flat = lambda x: None if x is None else x.reshape(-1)
    master = flat(leaf.master) if kept else leaf.master  # what a master keeps is tiled like the leaf; a seed is not
    return contract.LeafOperands(flat(leaf.grad), tuple(flat(x) for x in leaf.state), flat(leaf.param), master)
  rows = lambda x: None if x is None else x.reshape(-1, quantized.BLOCK_SIZE)
  value = lambda q: quantized.QuantizedMoment(rows(q.codes), q.scales.reshape(-1))
  return contract.LeafOperands(rows(leaf.grad), tuple(value(x) for x in leaf.state), rows(leaf.param))


def _run(leaves, facts, s, step, *, interpret, block_size, rows_per_program, num_warps):
  """Every leaf in its kernel view, one launch per group (:func:`_launch_groups`), results reshaped back."""
  views = [_kernel_view(leaf, step.master.keeps) for leaf in leaves]
  launch = functools.partial(_launch, s=s, step=step, interpret=interpret, block_size=block_size,
                             rows_per_program=rows_per_program, num_warps=num_warps)
  results = []
  for group in _launch_groups(views):
    results += launch(views[group], list(facts[group]))
  shaped = lambda x, like: x.reshape(like.shape)
  return [contract.LeafResult(result.first.reshape(leaf.grad.shape), jax.tree.map(shaped, result.state,
                                                                                  tuple(leaf.state)),
                              result.master.reshape(leaf.grad.shape) if step.master.keeps else None)
          for leaf, result in zip(leaves, results)]


def route(*, fused: bool, runs_on: str, split: str, rule: Any, packed: bool) -> dict[str, Any]:
  """``kernel="pallas"``'s table (:func:`optax_hybrid.kernels.kernels_for`): this kernel on every platform (Triton
  on CUDA and ROCm, interpret mode elsewhere) for leaves stepped on the device, on one device or per shard.

  The reference in host compute, where a Triton launch cannot go, and for a
  split the plan cannot see (``split="xla"``: GSPMD partitions the rule).
  A rule it does not implement is handed to the reference by
  :func:`update_leaves` itself.
  """
  del fused, rule, packed
  if runs_on == "host" or split == "xla":
    return {"default": reference.update_leaves}
  return {"default": update_leaves}


def update_leaves(
    leaves: Sequence[contract.LeafOperands],
    facts: Sequence[contract.LeafFacts],
    s: Any,
    step: contract.Step,
    *,
    block_size: int = BLOCK_SIZE,
    rows_per_program: int = ROWS_PER_PROGRAM,
    num_warps: int = NUM_WARPS,
) -> list[contract.LeafResult]:
  """The kernel contract (:mod:`optax_hybrid.kernels.contract`); one launch per 64 leaves (40 8-bit Adam ones).

  Leaves the kernel does not take (complex, float64, empty, 8-bit with a
  partial last block: :func:`supports`) go to the reference rule in the same
  step, and so do all the leaves of a rule the kernel does not list
  (:data:`RULES`). On CUDA and ROCm the kernel is compiled with Triton; elsewhere it runs
  in Pallas interpret mode. ``block_size`` (elements of a float-state leaf)
  and ``rows_per_program`` (256-value blocks of an 8-bit leaf) set what one
  program updates.

  Raises:
    ValueError: ``block_size`` or ``rows_per_program`` is not a positive power of two.
  """
  for name, value in (("block_size", block_size), ("rows_per_program", rows_per_program)):
    if value <= 0 or value & (value - 1):
      raise ValueError(f"pallas kernel: `{name}` must be a positive power of two, got {value}.")
  if not implements(step.rule):
    return reference.update_leaves(leaves, facts, s, step)
  if step.packed:  # a CPU layout: the state read from its pools
    leaves = [packed.read_operands(leaf) for leaf in leaves]
  if step.master.steps_as_param:  # a float32 copy: stepped as the param
    return reference.with_master_as_param(
        lambda l, f, plain: update_leaves(l, f, s, plain, block_size=block_size, rows_per_program=rows_per_program,
                                          num_warps=num_warps), leaves, facts, step)

  def run_pallas(leaves, facts):
    run = lambda interpret: functools.partial(_run, interpret=interpret, block_size=block_size,
                                              rows_per_program=rows_per_program, num_warps=num_warps)
    on_gpu = run(False)
    return contract.per_platform({"cuda": on_gpu, "rocm": on_gpu, "default": run(True)}, leaves, facts, s, step)

  return reference.with_reference_for_the_rest(lambda leaf, fact: supports(leaf, fact, step.master), run_pallas,
                                               leaves, facts, s, step)

