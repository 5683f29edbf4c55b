"""The stages of one optimizer step, in the order :func:`optax_hybrid.transform` runs them.

check and gather the leaves by plan -> load disk state -> run each group of
leaves where the plan says -> gather ZeRO-1 updates -> store disk state.

Every stage reads the static :class:`optax_hybrid.plan.Plan`; none of them
looks at the params' placement, re-resolves an option, or knows which rule
runs: the rule's state is a tuple of values, one per field of the plan
(:attr:`Plan.fields`). Per-leaf data travels as one :class:`LeafIn` /
:class:`LeafOut` record per leaf.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_hybrid import _compat, disk, masters, placement
from optax_hybrid._compat import DEVICE, HOST
from optax_hybrid.kernels import LeafFacts, LeafOperands, LeafResult, reference
from optax_hybrid.kernels.contract import Step, per_platform
from optax_hybrid.plan import STREAM_WAITS, LeafPlan, Plan, inexact_leaf_error


class LeafIn(NamedTuple):
  """One leaf's inputs to the step, each in the memory space the plan gives it.

  ``state`` holds one value per field of the rule: an array, an 8-bit
  :class:`~optax_hybrid.kernels.quantized.QuantizedMoment`, or for the disk
  tier its :class:`disk.DiskMoment` (codes and scales: two) until
  :func:`load_disk_state`. ``master`` is its master format's kernel operand
  (:meth:`optax_hybrid.masters.MasterFormat.operand`: what it keeps, or a
  seed), None without a master. Static, decided by :func:`gather` from the
  plan: ``reads_param``, whether the kernel reads the param (not without
  decay or a fused apply, nor where a master copy stands in for it: a param
  that is not read is not moved either), and ``facts``, what the kernel
  knows of the leaf (:class:`LeafFacts`).
  """

  grad: Any
  state: tuple
  param: Any = None
  master: Any = None
  reads_param: bool = False
  facts: LeafFacts | None = None


class LeafOut(NamedTuple):
  """One leaf's results: the update (or new param) in the param's space, the new state and master in theirs."""

  first: Any
  state: tuple
  master: Any = None


def gather(grads: Any, state: Any, params: Any, plan: Plan, write_params: bool, disk_stores: Sequence = ()
           ) -> tuple[Any, list[LeafIn]]:
  """Checks the step's inputs against the state and returns ``(treedef, one LeafIn per leaf)``.

  Each state leaf (and a host-resident param) is typed with the memory space
  its plan gives it: a ``jax.ShapeDtypeStruct`` placed in ``pinned_host`` is
  traced as a device value by JAX, and trusting that type would compile a
  different program for abstract inputs than for real arrays. Where a leaf
  keeps nothing in a field (disk-tier state, which are files; no master) the
  state's empty entry is replaced by what the step reads instead: the
  plan's files, or None. ``disk_stores``: the engine's disk store, if made
  (a disk leaf's files are gone once it is closed).

  Each stage runs over every leaf before the next (read, check, type, build),
  so the step calls into each module once, not once per leaf.

  Raises:
    ValueError, TypeError: for gradients, params or a state that do not fit
      each other, with the leaf named.
  """
  owner = plan.owner
  grad_leaves, treedef = jax.tree.flatten(grads)
  treedef, values, master_leaves = plan.layout.read(state, plan, treedef)
  if len(plan.leaves) != len(grad_leaves):
    raise ValueError(
        f"{owner}: the state's placement plan has {len(plan.leaves)} leaves but the gradients "
        f"have {len(grad_leaves)}; pass gradients for the params the state was initialized with.")
  if plan.on_disk and disk_stores and disk_stores[0].closed:
    path = next(lp.path for lp in plan.leaves if lp.on_disk)
    raise ValueError(f"{owner}: the disk-tier files of {path} were removed by tx.close(); initialize a new state.")
  if params is None:
    param_leaves = _without_params(plan, write_params, treedef.num_leaves)
  else:
    try:
      param_leaves = treedef.flatten_up_to(params)
    except (ValueError, TypeError) as e:
      raise ValueError(f"{owner}: `params` must have the tree structure of the gradients; gradients: "
                       f"{treedef}, params: {jax.tree.structure(params)}.") from e
  for lp, g, v, p in zip(plan.leaves, grad_leaves, values, param_leaves):
    _check_gradient(lp, plan, g, v, p, owner)
  kept = [None if lp.master_dtype is None else w for lp, w in zip(plan.leaves, master_leaves)]
  state_spaces, param_spaces = [lp.state_space for lp in plan.leaves], [lp.param_space for lp in plan.leaves]
  on_device = [i for i, lp in enumerate(plan.leaves) if lp.runs_on == "device" and not lp.slice_rows]
  device_grads = [grad_leaves[i] for i in on_device]
  # Where the gradients are (a warning, so after the errors above), then where each value goes.
  moved = [lp.path for lp, g in zip(plan.leaves, grad_leaves)
           if lp.on_one_device and placement.sharding_of(g) is not None]
  if moved:
    _warn_moved(plan, moved)
  # Typed with the state's space (files stay files; packed slices are on the device, where they stay); the
  # gradients of leaves stepped on the device moved there (a no-op for gradients computed there).
  if plan.leaves:
    values, kept = zip(*map(_compat.move, zip(values, kept), state_spaces))
  params_typed = list(map(_compat.move, param_leaves, param_spaces))
  for i, g in zip(on_device, _compat.move(device_grads, DEVICE)):
    grad_leaves[i] = g
  out = []
  for lp, g, v, w, p in zip(plan.leaves, grad_leaves, values, kept, params_typed):
    # What the master format keeps, or a random format's seed.
    master = lp.master.operand(w, state.count, lp.salt) if lp.master.active else None
    if lp.draw_offset and lp.master.random:  # a part of a split stack draws the whole stack's bits
      master = masters.seed_at(master, lp.draw_offset)
    writes = write_params or lp.master.active  # the first result is the new param
    reads = lp.master.reads_param if lp.master.active else (lp.decay or write_params)
    facts = LeafFacts(lp.decay, jnp.asarray(p).dtype if writes else jnp.result_type(g.dtype, *lp.dtypes),
                      lp.row_axes, moments=lp.moments)
    out.append(LeafIn(g, v, p, master, reads, facts))
  return treedef, out


def _warn_moved(plan: Plan, moved: list[str]) -> None:
  """Warns that the plan was made for one device and the gradients at ``moved`` are on several (placed after
  ``init``).

  The step still computes the same numbers, but what the plan chose for one
  device (a custom kernel, a layout constraint on the whole leaf) then runs
  on whole operands, gathered from their shards.
  """
  warnings.warn(
      f"{plan.owner}: the optimizer state was made for params on one device, but the gradients of {moved[0]}"
      f"{f' and {len(moved) - 1} more leaves' if len(moved) > 1 else ''} are on several devices: the step "
      "runs what it chose for one device on whole (gathered) operands. Make the state with init of the params "
      "as they are placed (arrays, or ShapeDtypeStructs with their shardings), or trace init under "
      "jax.set_mesh(mesh).", stacklevel=4)


def stored_values(state: Any, plan: Plan) -> tuple[Any, list[tuple]]:
  """``(the params' treedef, per leaf its fields' values as its moment format stores them)``
  (``MomentFormat.stored``: arrays, packed slices of the state's flat buffers, or a disk leaf's files): what the
  step reads, outside a step."""
  return plan.layout.read(state, plan, plan.layout.params_treedef(state, plan))[:2]


def _without_params(plan: Plan, write_params: bool, n: int) -> list:
  """``n`` Nones for a step without params, or a ValueError where the step needs them."""
  owner = plan.owner
  if write_params:
    raise ValueError(f"{owner}: tx.step(params, state, grads) needs `params`.")
  if any(leaf.decay for leaf in plan.leaves):
    raise ValueError(f"{owner}: weight_decay is non-zero, so `params` is required: call "
                     "tx.update(grads, state, params).")
  if any(leaf.master.active for leaf in plan.leaves):
    raise ValueError(f"{owner}: with master weights, `params` is required: call tx.update(grads, state, "
                     "params) (the update is new_param - param).")
  return [None] * n


def _check_gradient(lp: LeafPlan, plan: Plan, g: Any, values: tuple, param: Any, owner: str) -> None:
  """The gradient is floating or complex, has its state's shape and, like the param, is complex or real."""
  dtype = g.dtype if hasattr(g, "dtype") else jnp.result_type(g)
  if not jnp.issubdtype(dtype, jnp.inexact):
    raise inexact_leaf_error("gradient", lp.path, dtype, owner)
  shape = lp.shape
  if shape is None:  # a plan written by hand: the field's own array is shaped like the leaf
    like = lp.moments.arrays_of(values[0])[0] if values else param
    shape = None if like is None else tuple(like.shape)
  if shape is not None and np.shape(g) != shape:
    raise ValueError(f"{owner}: the gradient at {lp.path} has shape {np.shape(g)} but its optimizer state has "
                     f"shape {shape}.")
  signed = [(f.name, d) for f, d in zip(plan.fields, lp.dtypes) if not f.real]  # complex for a complex param
  if signed:
    wanted, what = np.dtype(signed[0][1]), f"state `{signed[0][0]}`"
  elif param is not None:
    wanted, what = np.dtype(param.dtype), "param"
  else:
    return
  if jnp.issubdtype(g.dtype, jnp.complexfloating) != jnp.issubdtype(wanted, jnp.complexfloating):
    raise TypeError(f"{owner}: the gradient at {lp.path} has dtype {g.dtype} but its {what} has dtype {wanted}: "
                    "complex params need complex gradients and real params real ones.")


def load_disk_state(leaves: list[LeafIn], plan: Plan, after: jax.Array) -> tuple[list[LeafIn], list]:
  """Reads the disk tier's state (one callback, ordered after ``after``). Returns the leaves and what was read:
  ``(leaf index, its fields' files in its moment format, the format)``."""
  stored = [(i, leaves[i].state, lp.moments) for i, lp in enumerate(plan.leaves) if lp.on_disk and leaves[i].state]
  if not stored:
    return leaves, []
  files = [f for _, state, form in stored for x in state for f in form.arrays_of(x)]
  values = iter(disk.load_in_step(files, after=after))
  leaves = list(leaves)
  for i, state, form in stored:
    leaves[i] = leaves[i]._replace(state=tuple(form.stored([next(values) for _ in form.arrays_of(x)])
                                               for x in state))
  return leaves, stored


def store_disk_state(outs: list[LeafOut], stored: list) -> jax.Array | None:
  """Writes the disk tier's new state back (one callback).

  Returns the write's int32 zero (None without disk leaves), which the
  caller adds to the count so the next read waits for it.
  """
  if not stored:
    return None
  files = [f for _, state, form in stored for x in state for f in form.arrays_of(x)]
  values = [a for i, _, form in stored for x in outs[i].state for a in form.arrays_of(x)]
  return disk.store_in_step(files, values)


def run(leaves: list[LeafIn], plan: Plan, rule: Any, s: Any, count: Any, *, write_params: bool
        ) -> tuple[list[LeafOut], Any]:
  """The stages after :func:`gather`: load disk state (ordered after ``count``) -> every group of leaves
  (:attr:`LeafPlan.group`) where its plan says -> gather ZeRO-1 updates -> store disk state.

  Returns the results in leaf order, and the disk write's zero (None without
  disk leaves: :func:`store_disk_state`).

  Groups run in the order of their first leaf. A streamed stage's transfers
  wait (:func:`_after`) for the previous stage's arithmetic and for the stage
  before that to be stored back where its state lives, which bounds what is
  staged (:mod:`optax_hybrid.plan`). For the Optax contract, a mastered
  leaf's update is then ``new_param - param`` (:func:`_master_updates`).
  The groups share nothing but the step's scalars, so XLA may run the host's
  and the device's at the same time.
  """
  on_disk = written = None
  if plan.on_disk:
    leaves, on_disk = load_disk_state(leaves, plan, after=count)
  members: dict[tuple, list[int]] = {}
  for i, leaf in enumerate(plan.leaves):
    members.setdefault(leaf.group, []).append(i)
  at = lambda i, where, stage: (plan.leaves[i].streamed and plan.leaves[i].runs_on == where
                                and plan.leaves[i].stage == stage)
  computed: dict[int, tuple] = {}  # leaf -> its results where it ran, until stored back
  outs: list = [None] * len(leaves)
  for (where, stage, _), idx in members.items():
    group_in = [leaves[i] for i in idx]
    if plan.leaves[idx[0]].streamed and stage > 0:
      computed_back, stored_back = STREAM_WAITS[where]
      previous = [i for i in computed if computed_back and at(i, where, stage - computed_back)]
      older = [i for i in range(len(leaves)) if at(i, where, stage - stored_back)]
      for i in older:
        if i in computed:
          outs[i] = _store(plan.leaves[i], computed.pop(i))
      group_in = _after(group_in, previous, older, computed, outs)
    step_group = _run_in_row_slices if plan.leaves[idx[0]].slice_rows else _run_group
    for i, result in zip(idx, step_group([plan.leaves[i] for i in idx], group_in, plan, rule, s,
                                         write_params=write_params)):
      computed[i] = result
  for i in list(computed):
    outs[i] = _store(plan.leaves[i], computed.pop(i))
  if plan.master.active:  # for the Optax contract: the update of a mastered leaf, or its param written over
    outs = _master_updates(outs, leaves, plan) if not write_params else _written_over_params(outs, leaves, plan)
  if plan.zero1:
    outs = gather_zero1(outs, plan)
  if plan.on_disk:
    written = store_disk_state(outs, on_disk)
  return outs, written


def _after(group_in: list, previous: list[int], older: list[int], computed: dict, outs: list) -> list:
  """``group_in`` ordered after the arithmetic of ``previous`` and the stored results of ``older``.

  A stage's copies in then start once the stage before it has computed (its
  results may still be crossing back: the link carries both directions at
  once) and the stage before that is stored back, so at most two stages'
  inputs and one stage's results are staged at a time, whatever order XLA
  schedules the rest in (``lax.optimization_barrier``: every output waits for
  every input). The waited-for values are replaced by the barrier's outputs,
  so the order stays in the program.
  """
  arrays = [(leaf.grad, leaf.state, leaf.param, leaf.master) for leaf in group_in]  # not the static facts
  (done, stored), arrays = lax.optimization_barrier(
      (([computed[i] for i in previous], [outs[i] for i in older]), arrays))
  for i, value in zip(previous, done):
    computed[i] = value
  for i, value in zip(older, stored):
    outs[i] = value
  return [leaf._replace(grad=g, state=st, param=p, master=m) for leaf, (g, st, p, m) in zip(group_in, arrays)]


# A value (a pytree of arrays) copied to memory ``space``, or as it is for None: what a plan's crossing names. A
# lambda, not a function: it runs per operand of every step, and the traced path stays short (benchmarks/callpath.py).
_copied = lambda x, space: x if space is None else jax.tree.map(lambda a: jax.device_put(a, space), x)  # noqa: E731


def _store(lp: LeafPlan, result: tuple) -> LeafOut:
  """One leaf's results moved from where they were computed to where they live (as typed by :func:`gather`):
  where its plan says (:attr:`LeafPlan.results_to`).
  """
  return LeafOut(*map(_copied, result, lp.results_to))


def _run_group(plans: Sequence[LeafPlan], leaves: Sequence[LeafIn], plan: Plan, rule: Any, s: Any, *,
               write_params: bool) -> list[tuple]:
  """One group: operands moved to where it runs, the kernel; ``(first, state, master)`` per leaf, where it ran.

  A mastered group's leaves (one master format: :attr:`LeafPlan.group`) are
  stepped through it (:attr:`Step.master`): the kernel reads their values
  from the param and the master's operand and writes the new param beside
  the master, so only the low-precision value crosses to the param's memory.
  """
  where = plans[0].runs_on
  master = plans[0].master
  operands = []
  for lp, leaf in zip(plans, leaves):
    grad = leaf.grad  # a device run's was moved there by gather
    param = leaf.param if leaf.reads_param else None
    if where == "host":  # the param's sharding: its gradient and (if on the device) the param cross with it
      to = lambda x: jax.tree.map(lambda a: placement.to_host(a, lp.gather_to or lp.state_sharding,
                                                              one_device=lp.on_one_device), x)
      seed = master.random  # a random format's operand is its seed: a replicated scalar
      operands.append(LeafOperands(to(grad), to(leaf.state), to(param),
                                   _compat.move(leaf.master, HOST) if seed else to(leaf.master)))
    else:  # what is elsewhere (the state of host_state, a disk leaf's master) is copied in, as its plan says
      operands.append(LeafOperands(grad, *map(_copied, (leaf.state, param, leaf.master), lp.operands_to)))
  # The kernels' Step (contract.step_of's) from what the plan read of the rule once; a master format writes params.
  facts = [leaf.facts for leaf in leaves]
  step = Step(rule, write_params or master.active, plan.fields, plan.decay_mode, master, plan.layout.packed)
  kernels = plan.kernels[where, write_params]
  if where == "host":
    s = type(s)(*(None if x is None else _compat.move(x, HOST) for x in s))
    kernels = {p: _on_host(k) for p, k in kernels.items()}
  elif plan.split == "shard_map":
    kernels, operands = _split_over_mesh(kernels, plans, plan, operands)
  return [tuple(r) for r in per_platform(kernels, operands, facts, s, step)]


def _on_host(kernel: Any) -> Any:
  """``kernel`` in XLA host compute, its results left in host memory (operands already there)."""
  return lambda ops, facts, s, step: _compat.host_compute(lambda ops, s: kernel(ops, facts, s, step),
                                                          out_memory_spaces=HOST)(ops, s)


def _split_over_mesh(kernels: dict, plans: Sequence[LeafPlan], plan: Plan, operands: list) -> tuple[dict, list]:
  """For a plan that splits the leaves over a mesh: the kernel table and the operands to give it.

  A custom kernel is single-device code: it runs per shard (:func:`_per_shard`),
  its operands constrained to their state's sharding; the XLA rule is
  partitioned by XLA, and returned as it is.
  """
  if set(kernels.values()) == {reference.update_leaves}:
    return kernels, operands
  return ({p: _per_shard(k, plans, plan.mesh) for p, k in kernels.items()},
          [_constrained(op, lp) for lp, op in zip(plans, operands)])


def _run_in_row_slices(plans: Sequence[LeafPlan], leaves: Sequence[LeafIn], plan: Plan, rule: Any, s: Any, *,
                       write_params: bool) -> list[tuple]:
  """A ``host_state`` leaf larger than a stage, ``slice_rows`` rows of its first axis at a time.

  A loop over the slices runs :func:`row_stepper`'s step on each slice of the
  gradient: a stacked layer's data crosses the device a slice at a time
  instead of whole (:attr:`LeafPlan.slice_rows`). Returns
  ``[(first, state, master)]`` with the state and master already in host memory.
  """
  (lp,), (leaf,) = plans, leaves
  buffers, step_rows = row_stepper(lp, leaf, plan, rule, s, write_params=write_params)
  rows = lp.slice_rows
  trip = lambda k, b: step_rows(b, lax.dynamic_slice_in_dim(leaf.grad, k * rows, rows, axis=0), k * rows)
  return [tuple(lax.fori_loop(0, leaf.grad.shape[0] // rows, trip, buffers))]


def row_stepper(lp: LeafPlan, leaf: LeafIn, plan: Plan, rule: Any, s: Any, *,
                write_params: bool) -> tuple[LeafOut, Any]:
  """Steps a leaf some rows of its first axis at a time, on the device, writing in place: ``(buffers, step_rows)``.

  ``buffers`` is the leaf's :class:`LeafOut` before any row is stepped: the
  first result's buffer where the param lives (the param itself when the
  step writes params, so that its rows not yet stepped are the old ones),
  the state and what the master keeps, where they live.
  ``step_rows(buffers, grad_rows, start, param_rows=None)`` brings rows
  ``start, start + n`` of the state (and master, and param) to the device with
  the gradient's ``n`` rows, runs the kernel on them and writes the results
  back into the buffers with ``dynamic_update_slice`` (in place: no copy of
  the leaf); ``start`` may be traced. ``param_rows``: those rows of the param
  as they are now, already on the device (a layer the backward pass brought
  in), read instead of fetching them again. A random master format's rows draw the bits the
  whole leaf would draw at their positions
  (:func:`optax_hybrid.masters.seed_at`), so stepping every row once equals
  the whole leaf's step. For a leaf that runs on the device (``device`` and
  ``host_state`` tiers), on one device or split over a mesh along any axis
  but its first (each device steps its shard of the rows).
  """
  master = lp.master
  facts = [leaf.facts]
  step = Step(rule, write_params or master.active, plan.fields, plan.decay_mode, master)
  kernels = plan.kernels["device", write_params]
  shape = leaf.grad.shape
  row_size = int(np.prod(shape[1:])) % 2**32
  param = leaf.param if leaf.reads_param else None
  in_place = write_params and leaf.param is not None  # the new param overwrites the param, row by row
  kept = master.keeps
  # The first result's buffer lives where the param does (host memory for layers streamed by scan_layers).
  first = (leaf.param.astype(facts[0].out_dtype) if in_place else
           _compat.move(lax.empty(shape, facts[0].out_dtype), lp.param_space))

  def step_rows(buffers: LeafOut, grad_rows: Any, start: Any, param_rows: Any = None) -> LeafOut:
    first, state, kept_master = buffers
    rows = grad_rows.shape[0]
    take = lambda a: lax.dynamic_slice_in_dim(a, start, rows, axis=0)
    # Constrained shard by shard on a mesh: a layout constraint on a split value would gather it whole.
    row_major = lambda a: _compat.row_major(a, lp.state_sharding)
    fetch = lambda x: jax.tree.map(lambda a: row_major(_compat.move(take(a), DEVICE)), x)
    read = None if param is None else first if in_place else param
    if read is not None and param_rows is not None and in_place:  # the current rows: already on the device
      read, fetch_read = None, row_major(_compat.move(param_rows, DEVICE))
    else:
      fetch_read = None if read is None else fetch(read)
    seed = masters.seed_at(leaf.master, jnp.asarray(start).astype(jnp.uint32) * jnp.uint32(row_size)) if (
        master.random) else None
    ops = LeafOperands(row_major(_compat.move(grad_rows, DEVICE)), fetch(state), fetch_read,
                       fetch(kept_master) if kept else seed)
    table, operands = _split_over_mesh(kernels, [lp], plan, [ops]) if plan.split == "shard_map" else (kernels, [ops])
    new_first, new_state, new_master = per_platform(table, operands, facts, s, step)[0]
    put = lambda buf, x: lax.dynamic_update_slice_in_dim(buf, _compat.move(x, _compat.memory_space_of(buf)),
                                                         start, axis=0)
    return LeafOut(put(first, new_first), jax.tree.map(put, state, new_state),
                   put(kept_master, new_master) if kept else None)

  return LeafOut(first, leaf.state, leaf.master if kept else None), step_rows


def _constrained(op: LeafOperands, lp: LeafPlan) -> LeafOperands:
  """A leaf's operands constrained to its state's sharding (a random master format's seed stays replicated)."""
  constrain = lambda x: jax.tree.map(lambda a: placement.constrain(a, lp.state_sharding), x)
  return LeafOperands(constrain(op.grad), constrain(op.state), constrain(op.param),
                      op.master if lp.master.random else constrain(op.master))


def _per_shard(kernel: Any, plans: Sequence[LeafPlan], mesh: Any) -> Any:
  """``kernel`` under ``shard_map``: every operand of a leaf split like its state, the scalars replicated.

  To the kernel a shard is a whole leaf (every leading axis may be cut into
  rows) but for a random master format's positions: a split leaf's facts
  say which shard of what it is, and its seed is moved to the shard's first
  element (:func:`optax_hybrid.masters.shard_origin`), so each element draws
  the bits the one-device step draws for it.
  """
  specs = [lp.state_sharding.spec for lp in plans]

  def sharded(operands: Sequence[LeafOperands], facts: Sequence[LeafFacts], s: Any, step: Any) -> list:
    shards = [(tuple(lp.state_sharding.shard_shape(op.grad.shape)), tuple(op.grad.shape))
              for lp, op in zip(plans, operands)]
    local_facts = [fact._replace(row_axes=None, shard=shard if shard[0] != shard[1] else None)
                   for fact, shard in zip(facts, shards)]

    def compute(ops, s):
      ops = [op._replace(master=masters.seed_at(op.master, masters.shard_origin(spec, mesh, *fact.shard)))
             if lp.master.random and fact.shard is not None else op
             for lp, op, spec, fact in zip(plans, ops, specs, local_facts)]
      return kernel(ops, local_facts, s, step)

    # A master that keeps values is split like the state; a random format's seed is replicated.
    in_specs = ([LeafOperands(sp, tuple(sp for _ in op.state), None if op.param is None else sp,
                              lp.master.operand_spec(sp))
                 for lp, op, sp in zip(plans, operands, specs)],
                type(s)(*(None if x is None else jax.sharding.PartitionSpec() for x in s)))
    out_specs = [LeafResult(sp, tuple(sp for _ in op.state), sp if lp.master_dtype is not None else None)
                 for lp, op, sp in zip(plans, operands, specs)]
    # check_vma=False: lax.platform_dependent's branches inside the kernels
    # type their outputs' varying axes differently; the step is elementwise.
    return jax.shard_map(compute, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(operands, s)

  return sharded


def _master_updates(outs: list[LeafOut], leaves: Sequence[LeafIn], plan: Plan) -> list[LeafOut]:
  """For the Optax contract: a mastered leaf's update is ``new_param - param`` in its format's ``update_dtype``.

  Computed where the param lives (host-resident params in one host-compute
  region): added back in that dtype it gives the new param exactly.
  """
  mastered = [i for i, lp in enumerate(plan.leaves) if lp.master.active]
  if not mastered:
    return outs
  diffs = placement.map_where_they_live(
      lambda new, old, dtype: new.astype(dtype) - old.astype(dtype),
      [outs[i].first for i in mastered], [leaves[i].param for i in mastered],
      static=[plan.leaves[i].master.update_dtype for i in mastered])
  outs = list(outs)
  for i, d in zip(mastered, diffs):
    outs[i] = outs[i]._replace(first=d)
  return outs


def _written_over_params(outs: list[LeafOut], leaves: Sequence[LeafIn], plan: Plan) -> list[LeafOut]:
  """The new params of leaves whose master stands in for the param, written over the old params' buffers.

  Such a param is not read, and ``jit`` drops an argument nothing reads;
  donated, its buffer would then be paired with the next result of its
  shape and dtype (``jit`` pairs donations with results by shape, not by
  memory kind, without ``out_shardings``): a bf16 moment in host memory, for
  the new bf16 param on the device, which the runtime refuses. Written over
  the old param (a whole-array ``dynamic_update_slice``, which XLA turns into
  the new value itself), the param stays an argument and is paired with its
  own result.
  """
  unread = [i for i, lp in enumerate(plan.leaves)
            if not lp.master.reads_param and leaves[i].param is not None]
  if not unread:
    return outs
  outs = list(outs)
  for i in unread:
    param, new = leaves[i].param, outs[i].first
    outs[i] = outs[i]._replace(first=lax.dynamic_update_slice(param, new.astype(param.dtype), (0,) * param.ndim))
  return outs


def gather_zero1(outs: list[LeafOut], plan: Plan) -> list[LeafOut]:
  """ZeRO-1: each device computed its shard of the update; gather it back to the param's sharding."""
  return [out._replace(first=placement.constrain(out.first, lp.gather_to)) if lp.gather_to is not None else out
          for lp, out in zip(plan.leaves, outs)]
