"""The stages of one optimizer step, in the order :func:`optax_hybrid.transform` runs them.

check and gather the leaves by plan -> load disk moments -> run each group of
leaves where the plan says -> gather ZeRO-1 updates -> store disk moments.

Every stage reads the static :class:`optax_hybrid.plan.Plan`; none of them
looks at the params' placement or re-resolves an option. Per-leaf data
travels as one :class:`LeafIn` / :class:`LeafOut` record per leaf.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_hybrid import _compat, disk, placement
from optax_hybrid._compat import DEVICE, HOST
from optax_hybrid.kernels import AdamScalars, LeafFacts, LeafOperands, Rule, kernels_for, quantized, reference
from optax_hybrid.kernels.contract import per_platform
from optax_hybrid.plan import STREAM_WAITS, LeafPlan, Plan, check_inexact_leaves


class LeafIn(NamedTuple):
  """One leaf's inputs to the step, each in the memory space the plan gives it."""

  grad: Any
  mu: Any  # an array, or a disk.DiskMoment until load_disk_moments
  nu: Any
  param: Any = None
  master: Any = None


class LeafOut(NamedTuple):
  """One leaf's results: the update (or new param) in the param's space, new state in the state's."""

  first: Any
  mu: Any
  nu: Any
  master: Any = None


def gather(grads: Any, state: Any, params: Any, plan: Plan, *, write_params: bool, disk_closed: bool
           ) -> tuple[Any, list[LeafIn]]:
  """Checks the step's inputs against the state and returns ``(treedef, one LeafIn per leaf)``.

  Each state leaf (and a host-resident param) is typed with the memory space
  its plan gives it: a ``jax.ShapeDtypeStruct`` placed in ``pinned_host`` is
  traced as a device value by JAX, and trusting that type would compile a
  different program for abstract inputs than for real arrays.

  Raises:
    ValueError, TypeError: for gradients, params or a state that do not fit
      each other, with the leaf named.
  """
  grad_leaves, treedef = jax.tree.flatten(grads)
  try:
    mu_leaves = treedef.flatten_up_to(state.mu)
    nu_leaves = treedef.flatten_up_to(state.nu)
    mu_scales, nu_scales = ([None] * len(grad_leaves) if scales is None else treedef.flatten_up_to(scales)
                            for scales in (state.mu_scales, state.nu_scales))
  except (ValueError, TypeError) as e:
    raise ValueError(
        "hybrid_adamw: the gradients' tree structure does not match the "
        f"optimizer state's; gradients: {treedef}, state.mu: "
        f"{jax.tree.structure(state.mu)}. Pass gradients for the same params "
        "tree the state was initialized with."
    ) from e
  check_inexact_leaves(grads, "gradient")
  if len(plan.leaves) != len(grad_leaves):
    raise ValueError(
        f"hybrid_adamw: the state's placement plan has {len(plan.leaves)} leaves but the gradients "
        f"have {len(grad_leaves)}; pass gradients for the params the state was initialized with.")
  for leaf, g, m in zip(plan.leaves, grad_leaves, mu_leaves):
    if isinstance(m, disk.DiskMoment):
      if disk_closed:
        raise ValueError(f"hybrid_adamw: the disk-tier files of {leaf.path} were removed by tx.close(); "
                         "initialize a new state.")
      m = jax.ShapeDtypeStruct(m.shape, np.dtype(m.dtype))
    if np.shape(g) != np.shape(m):
      raise ValueError(
          f"hybrid_adamw: the gradient at {leaf.path} has shape {np.shape(g)} but its "
          f"optimizer state has shape {np.shape(m)}."
      )
    if jnp.issubdtype(g.dtype, jnp.complexfloating) != jnp.issubdtype(m.dtype, jnp.complexfloating):
      raise TypeError(
          f"hybrid_adamw: the gradient at {leaf.path} has dtype {g.dtype} but its "
          f"first moment has dtype {m.dtype}: complex params need complex "
          "gradients and real params real ones."
      )

  param_leaves: list = [None] * len(grad_leaves)
  if params is not None:
    try:
      param_leaves = treedef.flatten_up_to(params)
    except (ValueError, TypeError) as e:
      raise ValueError(
          "hybrid_adamw: `params` must have the tree structure of the "
          f"gradients; gradients: {treedef}, params: {jax.tree.structure(params)}."
      ) from e
  elif write_params:
    raise ValueError("hybrid_adamw: tx.step(params, state, grads) needs `params`.")
  elif any(leaf.decay for leaf in plan.leaves):
    raise ValueError("hybrid_adamw: weight_decay is non-zero, so `params` is required: call "
                     "tx.update(grads, state, params).")

  master_leaves = [None] * len(grad_leaves)
  if state.master is not None:
    try:
      master_leaves = treedef.flatten_up_to(state.master)
    except (ValueError, TypeError) as e:
      raise ValueError(
          "hybrid_adamw: the state's master weights do not match the gradients' tree structure; "
          "pass gradients for the params the state was initialized with.") from e
    if params is None and any(w is not None for w in master_leaves):
      raise ValueError(
          "hybrid_adamw: with master weights, `params` is required: call tx.update(grads, state, "
          "params) (the update is new_param - param).")

  def typed(x, kind):
    if x is None or isinstance(x, disk.DiskMoment):
      return x
    return _compat.move(x, placement.space_of_kind(kind))

  def moment(leaf, codes, scales):
    if not leaf.quantized:
      return typed(codes, leaf.state_kind)
    if scales is None:
      raise ValueError(f"hybrid_adamw: the state keeps 8-bit moments for {leaf.path} but has no scales for "
                       "them (state.mu_scales / nu_scales); make the state with this optimizer's init.")
    return quantized.QuantizedMoment(typed(codes, leaf.state_kind), typed(scales, leaf.state_kind))

  return treedef, [
      LeafIn(grad=g, mu=moment(leaf, m, ms), nu=moment(leaf, v, vs),
             param=typed(p, leaf.param_kind), master=typed(w, leaf.state_kind))
      for leaf, g, m, v, p, w, ms, vs in zip(plan.leaves, grad_leaves, mu_leaves, nu_leaves, param_leaves,
                                             master_leaves, mu_scales, nu_scales)
  ]


def _files(moment: Any) -> list:
  """The :class:`disk.DiskMoment` s of one disk moment: one file, or codes and scales for 8-bit moments."""
  return list(moment) if isinstance(moment, quantized.QuantizedMoment) else [moment]


def _like(moment: Any, arrays: list) -> Any:
  """Arrays read for ``moment``'s files, in its format (the inverse of :func:`_files`)."""
  return quantized.QuantizedMoment(*arrays) if isinstance(moment, quantized.QuantizedMoment) else arrays[0]


def load_disk_moments(leaves: list[LeafIn], plan: Plan, after: jax.Array) -> tuple[list[LeafIn], list]:
  """Reads the disk tier's moments (one callback, ordered after ``after``). Returns the leaves and what was read."""
  stored = [(i, leaf.mu, leaf.nu) for i, leaf in enumerate(leaves) if plan.leaves[i].on_disk]
  if not stored:
    return leaves, []
  files = [_files(m) for _, m, v in stored for m in (m, v)]
  values = iter(disk.load_in_step([f for fs in files for f in fs], after=after))
  leaves = list(leaves)
  for i, m, v in stored:
    leaves[i] = leaves[i]._replace(mu=_like(m, [next(values) for _ in _files(m)]),
                                   nu=_like(v, [next(values) for _ in _files(v)]))
  return leaves, stored


def store_disk_moments(outs: list[LeafOut], stored: list) -> tuple[list[LeafOut], jax.Array | None]:
  """Writes the disk tier's new moments back (one callback); the state keeps the file handles.

  Returns the results with the disk leaves' moments replaced by their
  :class:`disk.DiskMoment` s, and the write's int32 zero (None without disk
  leaves), which the caller adds to the count so the next read waits for it.
  """
  if not stored:
    return outs, None
  files = [f for _, m, v in stored for f in _files(m) + _files(v)]
  values = [x for i, _, _ in stored for x in _files(outs[i].mu) + _files(outs[i].nu)]
  written = disk.store_in_step(files, values)
  outs = list(outs)
  for i, m, v in stored:
    outs[i] = outs[i]._replace(mu=m, nu=v)
  return outs, written


def run_groups(leaves: list[LeafIn], plan: Plan, s: AdamScalars, *, adamw_mode: bool, write_params: bool,
               fused: bool) -> list[LeafOut]:
  """Runs every group of leaves (:attr:`LeafPlan.group`) where its plan says; results in leaf order.

  Groups run in the order of their first leaf. A streamed stage's transfers
  wait (:func:`_after`) for the previous stage's arithmetic and for the stage
  before that to be stored back where its state lives, which bounds what is
  staged (:mod:`optax_hybrid.plan`). For the Optax contract, a mastered
  leaf's update is then ``new_param - param`` (:func:`_master_updates`).
  The groups share nothing but the step's scalars, so XLA may run the host's
  and the device's at the same time.
  """
  members: dict[tuple, list[int]] = {}
  for i, leaf in enumerate(plan.leaves):
    members.setdefault(leaf.group, []).append(i)
  at = lambda i, where, stage: (plan.leaves[i].streamed and plan.leaves[i].runs_on == where
                                and plan.leaves[i].stage == stage)
  computed: dict[int, tuple] = {}  # leaf -> its results where it ran, until stored back
  outs: list = [None] * len(leaves)

  def stored(i):
    if outs[i] is None:
      outs[i] = _store(plan.leaves[i], leaves[i], computed.pop(i))
    return outs[i]

  for (where, stage, _), idx in members.items():
    group_in = [leaves[i] for i in idx]
    if plan.leaves[idx[0]].streamed and stage > 0:
      computed_back, stored_back = STREAM_WAITS[where]
      previous = [i for i in computed if computed_back and at(i, where, stage - computed_back)]
      older = [i for i in range(len(leaves)) if at(i, where, stage - stored_back)]
      for i in older:
        stored(i)
      group_in = _after(group_in, previous, older, computed, outs)
    for i, result in zip(idx, _run_group([plan.leaves[i] for i in idx], group_in, plan, s, adamw_mode=adamw_mode,
                                          write_params=write_params, fused=fused)):
      computed[i] = result
  for i in list(computed):
    stored(i)
  if not write_params:
    outs = _master_updates(outs, leaves, plan)
  return outs


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
  (done, stored), group_in = lax.optimization_barrier(
      (([computed[i] for i in previous], [outs[i] for i in older]), group_in))
  for i, value in zip(previous, done):
    computed[i] = value
  for i, value in zip(older, stored):
    outs[i] = value
  return group_in


def _store(lp: LeafPlan, leaf: LeafIn, result: tuple) -> LeafOut:
  """One leaf's results moved from where they were computed to where they live."""
  first, mu, nu, master = result

  def back(x, like):
    return jax.tree.map(lambda a, b: _compat.move(a, _compat.memory_space_of(b)), x, like)

  return LeafOut(_compat.move(first, placement.space_of_kind(lp.param_kind)), back(mu, leaf.mu),
                 back(nu, leaf.nu), back(master, leaf.master))


def _run_group(plans: Sequence[LeafPlan], leaves: Sequence[LeafIn], plan: Plan, s: AdamScalars, *,
               adamw_mode: bool, write_params: bool, fused: bool) -> list[tuple]:
  """One group: operands moved to where it runs, the kernel; ``(first, mu, nu, master)`` per leaf, where it ran."""
  where = plans[0].runs_on
  space = HOST if where == "host" else DEVICE
  mastered = plans[0].master_dtype is not None
  # Parameters that are not read (no decay, no fused apply, or a master
  # stands in for them) are not moved either.
  if where == "host":  # the param's sharding: its gradient and (if on the device) the param cross with it
    to = lambda x, lp: jax.tree.map(lambda a: placement.to_host(a, lp.gather_to or lp.state_sharding), x)
  else:
    to = lambda x, lp: jax.tree.map(lambda a: _compat.move(a, space), x)
  operands = [
      LeafOperands(to(leaf.grad, lp), to(leaf.mu, lp), to(leaf.nu, lp),
                   to(leaf.master, lp) if mastered else to(leaf.param, lp) if (lp.decay or write_params) else None)
      for lp, leaf in zip(plans, leaves)]
  facts = [LeafFacts(lp.decay, lp.master_dtype if mastered else (
      jnp.asarray(leaf.param).dtype if write_params else jnp.result_type(leaf.grad.dtype, lp.mu_dtype, lp.nu_dtype)))
           for lp, leaf in zip(plans, leaves)]
  rule = Rule(adamw_mode, write_params=write_params or mastered)
  param_dtypes = [jnp.asarray(leaf.param).dtype if mastered else None for leaf in leaves]

  def compute(kernel, operands, s):
    results = kernel(operands, facts, s, rule)
    # A master's new param is rounded beside the master, so only the
    # low-precision value crosses to the param's memory.
    return [(r.first.astype(dt), r.mu, r.nu, r.first) if mastered else (r.first, r.mu, r.nu, None)
            for r, dt in zip(results, param_dtypes)]

  kernels = kernels_for(plan.kernel, fused=fused, runs_on=where, split=plan.split)
  if where == "host":
    s = AdamScalars(*(None if x is None else _compat.move(x, HOST) for x in s))
    branches = {p: _compat.host_compute(functools.partial(compute, k), out_memory_spaces=HOST)
                for p, k in kernels.items()}
  elif plan.split == "shard_map" and set(kernels.values()) != {reference.update_leaves}:
    branches = {p: _per_shard(functools.partial(compute, k), plans, plan.mesh, s, operands)
                for p, k in kernels.items()}
    operands = [jax.tree.map(lambda x, sharding=lp.state_sharding: placement.constrain(x, sharding), op)
                for lp, op in zip(plans, operands)]
  else:
    branches = {p: functools.partial(compute, k) for p, k in kernels.items()}
  return [tuple(r) for r in per_platform(branches, operands, s)]


def _per_shard(compute, plans: Sequence[LeafPlan], mesh: Any, s: AdamScalars, operands: Sequence[LeafOperands]):
  """``compute`` under ``shard_map``: every operand of a leaf split like its state, the scalars replicated."""
  specs = [lp.state_sharding.spec for lp in plans]
  in_specs = ([LeafOperands(*(None if x is None else sp for x in op)) for op, sp in zip(operands, specs)],
              AdamScalars(*(None if x is None else jax.sharding.PartitionSpec() for x in s)))
  out_specs = [(sp, sp, sp, sp if lp.master_dtype is not None else None) for lp, sp in zip(plans, specs)]
  # check_vma=False: lax.platform_dependent's branches inside the kernels
  # type their outputs' varying axes differently; the step is elementwise.
  return jax.shard_map(compute, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _master_updates(outs: list[LeafOut], leaves: Sequence[LeafIn], plan: Plan) -> list[LeafOut]:
  """For the Optax contract: a mastered leaf's update is ``new_param - param`` in the master's dtype.

  Computed where the param lives (host-resident params in one host-compute
  region): added back in that dtype it gives the new param exactly.
  """
  mastered = [i for i, lp in enumerate(plan.leaves) if lp.master_dtype is not None]
  diffs = placement.map_where_they_live(
      lambda new, old, dtype: new.astype(dtype) - old.astype(dtype),
      [outs[i].first for i in mastered], [leaves[i].param for i in mastered],
      static=[plan.leaves[i].master_dtype for i in mastered])
  outs = list(outs)
  for i, d in zip(mastered, diffs):
    outs[i] = outs[i]._replace(first=d)
  return outs


def gather_zero1(outs: list[LeafOut], plan: Plan) -> list[LeafOut]:
  """ZeRO-1: each device computed its shard of the update; gather it back to the param's sharding."""
  return [out._replace(first=placement.constrain(out.first, lp.gather_to)) if lp.gather_to is not None else out
          for lp, out in zip(plan.leaves, outs)]
