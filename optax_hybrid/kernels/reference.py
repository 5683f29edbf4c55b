r"""Any update rule, applied to a list of leaves in plain ``jax.numpy``: the reference every kernel is tested against.

For one leaf, all in float32 (or wider, if the leaf is), around the rule's own
update of its state values (:meth:`optax_hybrid.base.UpdateRule.update`):

.. math::

  g &\leftarrow g + \lambda p \quad \text{(L2 decay only)} \\
  u, s' &= \text{rule}(g, s) \\
  u &\leftarrow u - \eta \lambda p \quad \text{(decoupled decay only)}

where :math:`s` are the rule's fields decoded from their storage (8-bit
block-wise codes are dequantized) and :math:`s'` is stored back in the same
format; the new parameter is :math:`p + u`, added in float32 and rounded once
(``write_params``); a skipped step (``step_ok`` False) keeps every stored value
and gives a zero update. With a master format (:mod:`optax_hybrid.masters`),
:math:`p` is the float32 value the format reads from the param and what it
keeps, and the format writes :math:`p + u` back to both
(:func:`master_update`). ``kernel="xla"`` is this module.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from optax_hybrid import _compat, masters
from optax_hybrid.base import DECOUPLED, L2
from optax_hybrid.kernels import packed
from optax_hybrid.kernels.contract import LeafFacts, LeafOperands, LeafResult, Step


# A field's value in its storage format: an array, or what its moment format stores (8-bit: codes and scales).
Stored = Any


def leaf_update(step: Step, grad: jax.Array, state: Sequence[Stored], param: jax.Array | None, s: Any, *,
                decay: bool, update_dtype: Any, moments: Any = None) -> tuple[jax.Array, tuple]:
  """One leaf's step by ``step.rule``. Returns ``(update, new state)``, the state in its storage formats.

  ``decay`` says whether this leaf takes weight decay (the mask); ``param`` may
  be ``None`` only when it does not and ``step.write_params`` is False. The
  update is computed from the new state values *before* they are stored (8-bit
  storage quantizes them). With ``step.write_params`` the first result is the
  new parameter ``p + update``, added in float32 and rounded once to the
  param's dtype (``update_dtype`` is then the param's dtype): the fused apply.
  ``moments``: the fields' moment format (:attr:`LeafFacts.moments`), which
  decodes and encodes them; None: the fields are the values themselves.
  """
  coded = moments is not None and moments.encodes  # else the stored values are the values, in their dtype
  dtype = jnp.promote_types(grad.dtype, jnp.float32)  # float32, or wider (complex: its complex type)
  g = grad.astype(dtype)
  decay = decay and step.decay is not None
  if decay or step.write_params:
    p = param.astype(dtype)
  if decay and step.decay == L2:
    g = g + s.weight_decay * p
  real, values = jnp.finfo(dtype).dtype, []
  for f, x in zip(step.fields, state):  # decoded to the compute dtype (8-bit codes dequantized)
    values.append((moments.decode(x, signed=f.signed) if coded else x).astype(real if f.real else dtype))
  update, new_values = step.rule.update(g, tuple(values), s)
  if decay and step.decay == DECOUPLED:
    update = update - (s.learning_rate * s.weight_decay) * p
  if step.write_params:
    first, unchanged = (p + update).astype(update_dtype), param
  else:
    first, unchanged = update.astype(update_dtype), None
  new = []
  for f, x, old in zip(step.fields, new_values, state):  # encoded in the old value's storage format
    new.append(moments.encode(x, like=old, signed=f.signed) if coded else x.astype(old.dtype))
  new = tuple(new)
  if s.step_ok is not None:
    # A scalar predicate selects without broadcasting, which host compute needs.
    if unchanged is None:
      unchanged = _compat.zeros_like(first)
    keep = lambda old, new: lax.select_n(s.step_ok, old, new)
    first, new = keep(unchanged, first), jax.tree.map(keep, tuple(state), new)
  return first, new


def master_update(step: Step, grad: jax.Array, state: Sequence[Stored], param: jax.Array | None, master: Any,
                  s: Any, *, decay: bool, update_dtype: Any, offset: Any = 0, shard: tuple | None = None,
                  moments: Any = None) -> tuple[jax.Array, tuple, Any]:
  """One leaf's step through its master format ``step.master``: ``(new param, new state, new master)``.

  The format reads the float32 value ``w`` from ``param`` and ``master`` (its
  kernel operand), :func:`leaf_update` steps ``w`` (the fused apply, in
  float32), and the format writes the new value back: the new param in
  ``update_dtype`` (the param's dtype) and what it keeps (None if nothing).
  A random format draws its bits at the elements' flat positions in the leaf,
  ``offset`` being the first one's (a kernel's tile passes its own), so every
  kernel gets the same bits (``shard``: :attr:`LeafFacts.shard`, for a
  kernel run on one shard of a split leaf). A skipped step keeps the param
  and the master. ``moments``: as for :func:`leaf_update`.
  """
  fmt = step.master
  value = fmt.value(param, master)
  plain = step._replace(write_params=True, master=masters.NO_MASTER)
  new_value, new_state = leaf_update(plain, grad, state, value, s, decay=decay, update_dtype=value.dtype,
                                     moments=moments)
  where = masters.positions(grad, offset, shard) if fmt.random else None
  first, new_master = fmt.write(new_value, update_dtype, master, where)
  if s.step_ok is not None:
    keep = lambda old, new: lax.select_n(s.step_ok, old, new)
    first = keep(value.astype(update_dtype) if param is None else param, first)
    new_master = keep(master, new_master) if fmt.keeps else None
  return first, new_state, new_master


def with_master_as_param(run: Callable[[list, list, Step], list], leaves: Sequence[LeafOperands],
                         facts: Sequence[LeafFacts], step: Step) -> list[LeafResult]:
  """A master format that keeps the whole value (``steps_as_param``: a float32 copy) on a kernel without formats.

  ``run(leaves, facts, step)`` steps each leaf's copy as its param (the fused
  apply, in the copy's dtype); the format then writes the new param beside it
  (rounded to the param's dtype): the bits of :func:`master_update`.
  """
  fmt = step.master
  copies = [LeafOperands(leaf.grad, leaf.state, leaf.master) for leaf in leaves]
  results = run(copies, [fact._replace(out_dtype=leaf.master.dtype) for leaf, fact in zip(leaves, facts)],
                step._replace(master=masters.NO_MASTER, write_params=True))
  out = []
  for leaf, fact, r in zip(leaves, facts, results):
    param, master = fmt.write(r.first, fact.out_dtype, leaf.master, None)
    out.append(LeafResult(param, r.state, master))
  return out


def with_reference_for_the_rest(
    takes: Callable[[LeafOperands, LeafFacts], bool],
    run_taken: Callable[[list, list], list],
    leaves: Sequence[LeafOperands],
    facts: Sequence[LeafFacts],
    s: Any,
    step: Step,
) -> list[LeafResult]:
  """Runs a kernel on the leaves it takes and the reference on the others, in the same step.

  ``run_taken(leaves, facts)`` gets the leaves for which ``takes(leaf,
  facts)`` holds and returns their :class:`LeafResult` s; the results are
  merged back in the original order. The contract every custom kernel follows
  (module docstring of :mod:`optax_hybrid.kernels`): a kernel that does not
  implement ``step.rule`` takes no leaf.
  """
  taken = [takes(leaf, fact) for leaf, fact in zip(leaves, facts)]
  if all(taken):
    return run_taken(list(leaves), list(facts))
  if not any(taken):
    return update_leaves(leaves, facts, s, step)
  pick = lambda xs, want: [x for x, t in zip(xs, taken) if t == want]
  kernel_out = iter(run_taken(pick(leaves, True), pick(facts, True)))
  rule_out = iter(update_leaves(pick(leaves, False), pick(facts, False), s, step))
  return [next(kernel_out) if t else next(rule_out) for t in taken]


def route(*, fused: bool, runs_on: str, split: str, rule: Any, packed: bool) -> dict[str, Callable]:
  """``kernel="xla"``'s table (:func:`optax_hybrid.kernels.kernels_for`): this rule on every platform, wherever
  the leaves run; XLA fuses each leaf's step and partitions it over any mesh."""
  del fused, runs_on, split, rule, packed
  return {"default": update_leaves}


def update_leaves(
    leaves: Sequence[LeafOperands],
    facts: Sequence[LeafFacts],
    s: Any,
    step: Step,
) -> list[LeafResult]:
  """Applies :func:`leaf_update` leaf by leaf; XLA fuses each leaf's step.

  Returns one :class:`LeafResult` per leaf: ``(update, new state)``, or
  ``(new_param, new state)`` with ``step.write_params``. Large leaves with
  8-bit storage are updated in slices of rows (:func:`_in_row_slices`).
  Packed state (:mod:`packed`) is read from its pools; its new values are arrays.
  """
  if step.packed:
    leaves = [packed.read_operands(leaf) for leaf in leaves]
  return [_leaf_result(leaf, fact, s, step) for leaf, fact in zip(leaves, facts)]


def _leaf_result(leaf: LeafOperands, fact: LeafFacts, s: Any, step: Step, offset: Any = 0) -> LeafResult:
  """One leaf's step, through its master format if it has one.

  A leaf with 8-bit storage (every field or none) of more than one slice of
  rows is stepped in slices (:func:`_in_row_slices`, whose slices come back
  here to be stepped whole, at their ``offset`` in the leaf).
  """
  # A format that decodes to float32 temporaries (8-bit) is stepped in slices of rows when large.
  sliced = bool(leaf.state) and fact.moments is not None and fact.moments.in_row_slices
  if sliced and leaf.grad.size > SLICE_VALUES:
    lead = _row_axes(leaf, fact)
    row = math.prod(leaf.grad.shape[lead:])
    if lead > 0 and leaf.grad.size // row > max(1, SLICE_VALUES // row):
      return _in_row_slices(leaf, fact, s, step)
  if not step.master.active:
    return LeafResult(*leaf_update(step, leaf.grad, leaf.state, leaf.param, s, decay=fact.decay,
                                   update_dtype=fact.out_dtype, moments=fact.moments))
  return LeafResult(*master_update(step, leaf.grad, leaf.state, leaf.param, leaf.master, s, decay=fact.decay,
                                   update_dtype=fact.out_dtype, offset=offset, shard=fact.shard,
                                   moments=fact.moments))


# Values of a leaf with 8-bit storage that the rule updates at once. XLA keeps
# the new values of what it updates at once in float32 temporaries (they
# feed both the block maxima and the codes), so a larger leaf is updated in
# slices of whole rows, one after another in a loop, which bounds them (4
# bytes per value of a slice, per field: 512 MiB for two moments, a small
# part of an accelerator that trains such leaves) instead of 4 bytes per
# value of the leaf per field. A slice is that large because each trip of
# the loop launches its kernels again: every matrix of a width-4096 decoder
# is stepped in one pass, a layer in about a hundred kernels
# (docs/records/benchmarks.md#2026-12-06-every-matrix-of-a-layer-in-one-pass).
SLICE_VALUES = 2**26


def _row_axes(leaf: LeafOperands, fact: LeafFacts) -> int:
  """How many leading axes :func:`_in_row_slices` merges into rows: those whole on every device."""
  lead = leaf.grad.ndim - 1
  return lead if fact.row_axes is None else min(fact.row_axes, lead)


def _in_row_slices(leaf: LeafOperands, fact: LeafFacts, s: Any, step: Step) -> LeafResult:
  """:func:`leaf_update` over slices of rows (blocks never cross a row), written in place.

  A row is the leaf's trailing axes after its :func:`_row_axes` leading
  ones, which are merged into one: a leaf split over devices is cut only
  along axes every device holds whole, so each device steps its own shard
  of each slice. The loop carries the results, initialized with the buffers
  they replace (the state, the param when it is overwritten, what a master
  keeps), and reads those operands from the carry so that XLA updates them
  in place instead of copying them.
  """
  shape = leaf.grad.shape
  lead = _row_axes(leaf, fact)
  rows_total, row_size = math.prod(shape[:lead]), math.prod(shape[lead:])
  rows = max(1, SLICE_VALUES // row_size)
  as_rows = lambda x: None if x is None else jax.tree.map(lambda a: a.reshape(rows_total, *a.shape[lead:]), x)
  kept = step.master.keeps  # else the master operand is None or a seed
  ops = LeafOperands(as_rows(leaf.grad), as_rows(tuple(leaf.state)), as_rows(leaf.param),
                     as_rows(leaf.master) if kept else leaf.master)
  if step.write_params and ops.param is not None:
    first = ops.param.astype(fact.out_dtype)
  else:
    first = _compat.zeros_like(ops.grad).astype(fact.out_dtype)
  out = LeafResult(first, ops.state, ops.master if kept else None)
  whole = fact._replace(row_axes=0)  # a slice is stepped whole: no leading axis to cut it along

  def update_rows(start, size, out):
    take = lambda x: lax.dynamic_slice_in_dim(x, start, size, axis=0)
    param = out.first if step.write_params and ops.param is not None else ops.param
    part = LeafOperands(take(ops.grad), jax.tree.map(take, out.state), None if param is None else take(param),
                        take(out.master) if kept else ops.master)
    new = _leaf_result(part, whole, s, step, offset=start * row_size)
    return jax.tree.map(lambda buf, x: lax.dynamic_update_slice_in_dim(buf, x, start, axis=0), out, new)

  full = rows_total // rows
  out = lax.fori_loop(0, full, lambda i, out: update_rows(i * rows, rows, out), out)
  if rows_total % rows:
    out = update_rows(full * rows, rows_total % rows, out)
  return LeafResult(out.first.reshape(shape), jax.tree.map(lambda x, like: x.reshape(like.shape), out.state,
                                                           tuple(leaf.state)),
                    out.master.reshape(shape) if kept else None)
