"""The engine: an Optax transformation that runs any update rule with placeable state.

:func:`optimizer` turns a rule (:class:`optax_hybrid.base.UpdateRule`) and the
engine's options (:mod:`optax_hybrid.options`) into a :class:`HybridOptimizer`:
``init`` makes the plan (:mod:`optax_hybrid.plan`) and the state, ``update``
and ``step`` run the pipeline (:mod:`optax_hybrid.pipeline`). Nothing here
knows which rule it runs: the state's params-shaped fields are the rule's
fields, their 8-bit scales and the master copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax._src import numerics

from optax_hybrid import _commit_check, _compat, disk, layouts, moments as moments_lib, packing, pipeline, placement
from optax_hybrid.base import STATE_TYPES, UpdateRule, is_state
from optax_hybrid.kernels import packed
from optax_hybrid.options import OPTION_NAMES, Options, check_learning_rate, make_options, placement_words
from optax_hybrid.plan import LeafPlan, Plan, make_plan


class HybridOptimizer(optax.GradientTransformationExtraArgs):
  """An Optax gradient transformation with one more method: ``step``, the fused one-pass step.

  ``init`` and ``update`` follow the Optax contract. ``step`` returns the new
  params directly: each leaf's parameter is read once and written once (in
  place when the buffers are donated), instead of returning an update that a
  second pass adds.

  Its ``update`` is an engine's (:func:`optimizer` makes it so): ``step``,
  ``begin_step`` and ``close`` are that engine's, reached through
  ``update.__self__``.

  Raises:
    TypeError: when made with an ``update`` that is not an engine's.
  """

  __slots__ = ()

  def __new__(cls, init: Callable, update: Callable) -> "HybridOptimizer":
    if not isinstance(getattr(update, "__self__", None), _Engine):
      raise TypeError(f"HybridOptimizer: `update` must be the engine's (made by optax_hybrid.transform.optimizer), "
                      f"got {update!r}; build the optimizer with optax_hybrid.transform.optimizer or a hybrid_* "
                      "function.")
    return super().__new__(cls, init, update)

  def step(self, params: optax.Params, state: Any, grads: optax.Updates) -> tuple[optax.Params, Any]:
    r"""One fused optimizer step: ``(params, state, grads) -> (new_params, new_state)``.

    Equal to ``u, s = tx.update(grads, state, params); optax_hybrid.apply_updates(params, u)``
    except that :math:`p + u` is added in float32 and rounded once to the
    param's dtype. Params in host memory are updated on the host. Arguments
    come in the order of the results, so ``jax.jit(tx.step,
    donate_argnums=(0, 1))`` pairs every donated buffer with its own result
    (JAX pairs donations with outputs by shape, in order).

    Example:
      >>> import jax, jax.numpy as jnp, optax_hybrid
      >>> tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1)
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> step = jax.jit(tx.step, donate_argnums=(0, 1))
      >>> params, state = step(params, state, {"w": jnp.ones(3)})
    """
    engine: _Engine = self.update.__self__  # checked when made (__new__)
    return engine.step(params, state, grads)

  def begin_step(self, params: optax.Params, state: Any, by_rows: Any) -> "StepInParts":
    r"""A fused step taken in parts: the leaves marked in ``by_rows`` a few rows at a time, then the others.

    For an optimizer inside a backward pass (:func:`optax_hybrid.step_in_backward`):
    each layer of stacked layers is stepped as soon as its gradient exists,
    so no gradient of the whole stack is ever kept. The step's scalars (the
    count's learning rate and bias corrections) are those of ``state``; every
    row of every marked leaf must be stepped exactly once, then ``finish``
    steps the other leaves and advances the count. The result equals
    ``tx.step(params, state, grads)`` (bit for bit with a random master
    format: each row draws the bits the whole leaf would).

    Args:
      params: the params, as for :meth:`step` (donated by the caller's jit,
        a marked leaf is updated in place).
      state: this optimizer's state.
      by_rows: a tree of bools shaped like ``params`` or a prefix of it
        (``{"layers": True, "embed": False, ...}``): the leaves stepped by
        rows of their first axis. Each must run on the device
        (``state_memory_kind`` ``"device"`` or ``"host_state"``, or
        ``"pinned_host"`` for a param in device memory), with that axis whole
        on every device (on a mesh, split the other axes:
        ``P(None, "fsdp", ...)``).

    Returns:
      A :class:`StepInParts`.

    Raises:
      ValueError: for a marked leaf updated on the host or on disk (the
        message names the ``state_memory_kind`` given), with its first axis
        split over devices, or a scalar; for ``skip_nonfinite=True``.

    Example:
      >>> import jax, jax.numpy as jnp, optax_hybrid
      >>> tx = optax_hybrid.hybrid_adamw(1e-3)
      >>> params = {"layers": jnp.ones((3, 4)), "head": jnp.ones(4)}
      >>> grads = {"layers": jnp.full((3, 4), 0.5), "head": jnp.ones(4)}
      >>> state = tx.init(params)
      >>> parts = tx.begin_step(params, state, {"layers": True, "head": False})
      >>> buffers = parts.buffers
      >>> for i in reversed(range(3)):  # as a backward pass makes them
      ...   buffers = parts.step_rows(buffers, {"layers": grads["layers"][i:i + 1]}, i)
      >>> new_params, new_state = parts.finish(buffers, {"layers": None, "head": grads["head"]})
      >>> expected, _ = tx.step(params, state, grads)
      >>> bool(jnp.all(new_params["layers"] == expected["layers"]))
      True
    """
    engine: _Engine = self.update.__self__
    return engine.begin_step(params, state, by_rows)

  def close(self) -> None:
    """Closes the disk tier's file, which frees its space. A no-op without disk leaves.

    Also done when the process ends. The state's disk leaves cannot be stepped
    afterwards.
    """
    engine: _Engine = self.update.__self__
    engine.close()


class StepInParts(NamedTuple):
  """A step taken in parts (:meth:`HybridOptimizer.begin_step`).

  Attributes:
    buffers: what a loop carries from one row step to the next (the marked
      leaves' new params and their state, where they live); opaque: read the
      params with ``current``.
    current: ``(buffers) -> tree``: the marked params as they are now (rows
      not yet stepped hold the old values: read a layer from here), in a
      tree like the params with None at the leaves not marked.
    step_rows: ``(buffers, grads, start, params=None) -> buffers``: steps
      rows ``start`` to ``start + n`` of every marked leaf (``start`` may be
      traced). ``grads`` is a pytree whose leaves are ``n`` rows of each
      marked leaf's gradient in the params' leaf order: one layer's gradient
      tree with a leading axis of ``n``, or a tree like the params with None
      at the other leaves (and at marked leaves not stepped by this call:
      one part of a :class:`~optax_hybrid.stacks.SplitStack`). ``params``, if given, holds those rows of the
      params as they are in ``buffers`` (a tree like ``grads``), already on
      the device (the layer a backward pass brought in): the step reads them
      instead of fetching the rows again.
    finish: ``(buffers, grads) -> (new_params, new_state)``: steps the other
      leaves with ``grads``, a tree like the params whose marked leaves are
      None (or anything: not read), and advances the count.
  """

  buffers: tuple
  current: Callable
  step_rows: Callable
  finish: Callable


def optimizer(rule: UpdateRule, learning_rate: Any, *, mask: Any = None, **options: Any) -> HybridOptimizer:
  """The optimizer that runs ``rule`` with the engine's ``options``: how each ``hybrid_*`` function is built.

  Args:
    rule: the update rule, with its hyperparameters.
    learning_rate: a float ``>= 0`` or an Optax schedule of the step count.
    mask: which leaves take weight decay (for a rule with decay): a tree of
      bools shaped like the params (or a prefix of it), a callable
      ``params -> tree``, or None (every leaf).
    **options: the keyword-only options of :mod:`optax_hybrid.options`
      (:class:`~optax_hybrid.options.Placement`,
      :class:`~optax_hybrid.options.Storage`,
      :class:`~optax_hybrid.options.Execution`).

  Returns:
    A :class:`HybridOptimizer` whose state is ``rule.state_type``.

  Raises:
    ValueError, TypeError: for a bad hyperparameter or option, naming it.
  """
  rule.check()
  check_learning_rate(rule.owner, learning_rate)
  return _engine(rule, learning_rate, make_options(rule.owner, rule, mask=mask, **options))


def building_block(rule: UpdateRule, *, mask: Any = None, **options: Any) -> optax.GradientTransformationExtraArgs:
  """``rule``'s direction without the learning rate (run at -1), for users who compose their own chain.

  Master weights need the learning rate inside the step, so ``master`` and
  its older spelling ``master_dtype`` are not options here; nor is the fused ``step``.
  """
  rule.check()
  accepted = tuple(name for name in OPTION_NAMES if name not in ("master", "master_dtype"))
  tx = _engine(rule, -1.0, make_options(rule.owner, rule, mask=mask, accepted=accepted, **options))
  return optax.GradientTransformationExtraArgs(tx.init, tx.update)


# ---------------------------------------------------------------------------
# The state
# ---------------------------------------------------------------------------


def params_shaped_fields(state: Any) -> tuple[str, ...]:
  """The attributes of a rule's state that hold one array per param leaf (fields, their scales, master)."""
  return STATE_TYPES[type(state)]


class _NoPlan:
  """The ``plan`` of the state ``init`` returns for Optax's params placeholder: no plan is made without params.

  A pytree leaf, so that ``optax.tree_utils.tree_map_params`` hands the real
  state's plan to its ``transform_non_params`` (or keeps it as it is).
  """

  __slots__ = ()

  def __repr__(self) -> str:
    return "<no plan: init was given optax.tree_utils.tree_map_params' params placeholder>"


_NO_PLAN = _NoPlan()


class _Packed:
  """A packed field (``state_layout="packed"``) in the state ``init`` returns for Optax's params placeholder.

  A pytree leaf: ``optax.tree_utils.tree_map_params`` hands the real state's
  dict of flat buffers to its ``transform_non_params`` (the packed state is
  not params-shaped).
  """

  __slots__ = ()

  def __repr__(self) -> str:
    return "<packed state: not params-shaped>"


_PACKED = _Packed()

#: The layouts by ``state_layout=`` name (:mod:`optax_hybrid.layouts`): ``init`` lays the chosen one out.
_LAYOUTS = {"leaves": layouts.LEAVES, "packed": packing.PACKED}


def _state_of_placeholder(placeholder: Any, rule: UpdateRule, o: Options) -> Any:
  """``init``'s state for the params placeholder of ``optax.tree_utils.tree_map_params``.

  ``tree_map_params`` maps its function over every field where this state
  holds the placeholder, and ``transform_non_params`` over the others: the
  rule's fields, (with a master format that keeps something) ``master`` and (with 8-bit storage)
  the scales are the params-shaped fields; ``count``, ``skipped`` and the
  static ``plan`` are not.
  """
  count = jnp.zeros([], jnp.int32)
  if _LAYOUTS[o.storage.state_layout].packed:
    placeholder = _PACKED
  fields = {f.name + suffix: placeholder for suffix in o.storage.moments.attribute_suffixes for f in rule.fields}
  return _make_state(rule, count=count, skipped=count, plan=_NO_PLAN,
                     master=placeholder if _keeps_masters(o) else None, **fields)


def _keeps_masters(o: Options) -> bool:
  """Whether the state has a ``master`` tree: a master format that keeps something (not ``"stochastic"``)."""
  return o.storage.master_format.keeps


# The dtype of the empty entry a leaf has where its moment format keeps no array (a state attribute another format
# keeps, such as 8-bit scales).
_UNKEPT_DTYPE = np.dtype(np.float32)


def _leaf_state(param: Any, lp: LeafPlan, plan: Plan, initial: tuple, with_master: bool) -> dict:
  """``{attribute: array}`` of one leaf's state, placed where its plan says (empty entries where it keeps none).

  A field is an array, or for 8-bit storage codes (in the field) and scales
  (in ``<field>_scales``). Where the leaf keeps nothing in a field (disk-tier
  state, which are files; no master) it gets an empty entry
  (:func:`placement.empty_entry`); ``master`` is None only when the state has
  no masters at all.
  """
  abstract = isinstance(param, jax.ShapeDtypeStruct)
  # ZeRO-1 splits the state further than the param: place it with its own sharding.
  split = None if lp.gather_to is None else placement.on_devices(lp.state_sharding, param).with_memory_kind(
      lp.state_kind)
  shape = np.shape(param)

  def placed(dtype, fill=None, shape=shape):
    if split is not None:
      value = None if fill is None else np.broadcast_to(np.asarray(fill), shape)
      return placement.placed_with(value, shape, dtype, split, abstract=abstract)
    return placement.filled_placed(param, dtype, lp.state_kind, fill, shape=shape)

  empty = lambda dtype: placement.empty_entry(param, dtype, lp.state_kind, split)
  out = {}
  for field, dtype, value in zip(plan.fields, lp.dtypes, initial):
    fill = None if not isinstance(value, _compat.Tracer) and np.all(np.asarray(value) == 0) else value
    arrays = lp.moments.arrays(shape, dtype)
    contents = [None] * len(arrays) if lp.on_disk else lp.moments.initial(shape, dtype, fill, signed=field.signed)
    for (suffix, array_shape, array_dtype), content in zip(arrays, contents):
      # The disk tier's values are the plan's files: an empty entry in the state.
      out[field.name + suffix] = (empty(array_dtype) if lp.on_disk else
                                  placed(array_dtype, content, shape=array_shape))
    # A donated step must not get one buffer twice: an empty entry for each attribute the format does not keep.
    for suffix in moments_lib.SUFFIXES:
      if field.name + suffix not in out:
        out[field.name + suffix] = empty(_UNKEPT_DTYPE)
  if lp.master_dtype is not None:  # what the master format keeps: a copy of the param, or zeros
    start = lp.master.initial(param)  # None: zeros
    if start is None:
      out["master"] = placed(lp.master_dtype)
    else:
      out["master"] = (placement.copy_placed(start, lp.master_dtype, lp.state_kind) if split is None
                       else placement.placed_with(start, shape, lp.master_dtype, split, abstract=abstract))
  elif with_master:
    out["master"] = empty(param.dtype)
  return out


def _with_disk_files(plan: Plan, params: list, store: disk.DiskStore, initial: tuple) -> Plan:
  """``plan`` with a new file for each field of each disk-tier leaf, holding the field's initial value."""
  def files(p, leaf):
    made, shape = [], np.shape(p)
    for field, dtype, value in zip(plan.fields, leaf.dtypes, initial):
      zero = not np.any(np.asarray(value))  # new files are zeros: nothing to write
      contents = leaf.moments.initial(shape, dtype, None if zero else value, signed=field.signed)
      for (suffix, file_shape, file_dtype), content in zip(leaf.moments.arrays(shape, dtype), contents):
        moment = store.create(file_shape, file_dtype)  # each array in its own file
        if content is not None:
          disk.write(moment, np.broadcast_to(np.asarray(content, file_dtype), file_shape))
        made.append((field.name + suffix, moment))
    return tuple(made)

  return dataclasses.replace(plan, leaves=tuple(
      dataclasses.replace(leaf, files=files(p, leaf)) if leaf.on_disk else leaf
      for p, leaf in zip(params, plan.leaves)))


def _init(params: Any, rule: UpdateRule, o: Options, disk_store: list, stepped_rules: dict) -> Any:
  """``init``: the plan, then every leaf's state placed where it says.

  ``stepped_rules`` (a :class:`_SteppedRules`) makes the rule the plan's steps run now, not in a step.
  """
  if _compat.is_optax_params_placeholder(params):
    return _state_of_placeholder(params, rule, o)
  plan = make_plan(params, rule, o)
  stepped_rules[plan.static_zeros]  # noqa: B018 - asked now, so the rule the steps run is made here, not in a trace
  param_leaves, treedef = jax.tree.flatten(params)
  initial = rule.initial_values()
  with_master = _keeps_masters(o)
  names = [f.name + suffix for suffix in o.storage.moments.attribute_suffixes for f in rule.fields]
  names += ["master"] * with_master
  # The layout of these params, checked before any state is made (or file written).
  plan = dataclasses.replace(plan, layout=_LAYOUTS[o.storage.state_layout].laid_out(plan, params, names))
  if any(leaf.on_disk for leaf in plan.leaves):
    if not disk_store or disk_store[0].closed:
      disk_store[:] = [disk.DiskStore(o.placement.nvme_offload_dir)]
    plan = _with_disk_files(plan, param_leaves, disk_store[0], initial)
  per_leaf = [_leaf_state(p, lp, plan, initial, with_master) for p, lp in zip(param_leaves, plan.leaves)]
  fields = plan.layout.state_fields(plan, treedef, {n: [leaf[n] for leaf in per_leaf] for n in names})
  counter = lambda: placement.step_counter_like(jax.tree.leaves(fields))
  _commit_check.watch(params, plan, rule.owner, placement_words(o))
  return _make_state(rule, count=counter(), skipped=counter(), plan=plan, **fields)


def _make_state(rule: UpdateRule, **values: Any) -> Any:
  """``rule``'s state type with ``values``, None in the params-shaped fields it does not keep."""
  return rule.state_type(**{**dict.fromkeys(STATE_TYPES[rule.state_type]), **values})


# ---------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------


class _SteppedRules(dict):
  """``plan.static_zeros`` -> the rule without those hyperparameters (:meth:`UpdateRule.without`), each made once."""

  def __init__(self, rule: UpdateRule):
    super().__init__()
    self.rule = rule

  def __missing__(self, static_zeros: frozenset) -> UpdateRule:
    return self.setdefault(static_zeros, self.rule.without(static_zeros))


class _Engine:
  """The engine of one optimizer: a checked ``rule`` and options ``o``; ``init`` makes the plan, the steps follow it.

  :class:`HybridOptimizer` holds its bound :meth:`init` and :meth:`update`
  (Optax's pair) and calls its :meth:`step`, :meth:`begin_step` and
  :meth:`close` through ``update``. What init makes and the steps share:
  ``disk_store`` (the DiskStore, made by the first init that places a leaf on
  disk) and ``stepped_rules`` (``plan.static_zeros`` -> the rule without them).
  ``learning_rate_at``: the step count -> the learning rate (a constant's is
  a function too, decided once).
  """

  def __init__(self, rule: UpdateRule, learning_rate: Any, o: Options):
    self.rule, self.options = rule, o
    self.learning_rate_at = learning_rate if callable(learning_rate) else lambda count: learning_rate
    self.disk_store: list = []
    self.stepped_rules = _SteppedRules(rule)

  def init(self, params: Any) -> Any:
    return _init(params, self.rule, self.options, self.disk_store, self.stepped_rules)

  def update(self, updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
    del extra_args
    return self._step(updates, state, params, write_params=False)

  def step(self, params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
    return self._step(grads, state, params, write_params=True)

  def close(self) -> None:
    for store in self.disk_store:
      store.close()

  def _state_error(self, state: Any) -> TypeError:
    """Why ``state`` is not a state this optimizer's init made (raised by the steps, which check in two lines)."""
    rule = self.rule
    if type(state) is not rule.state_type:
      return TypeError(f"{rule.owner}: `state` must be the {rule.state_type.__name__} made by this optimizer's "
                       f"init, got {type(state).__name__}.")
    return TypeError(f"{rule.owner}: the state has no placement plan (plan={state.plan!r}); make the state with "
                     "this optimizer's init.")

  def _step(self, grads, state, params, *, write_params):
    plan = getattr(state, "plan", None)
    if type(state) is not self.rule.state_type or not isinstance(plan, Plan):
      raise self._state_error(state)
    if _commit_check.PENDING:  # some init noted uncommitted params: warn as this step is traced, if it is
      _commit_check.check_first_step(plan, state.count)
    lr = self.learning_rate_at(state.count)
    treedef, leaves = pipeline.gather(grads, state, params, plan, write_params, self.disk_store)
    step_ok = placement.all_finite([leaf.grad for leaf in leaves]) if self.options.execution.skip_nonfinite else None
    stepped = self.stepped_rules[plan.static_zeros]  # the hyperparameters that were zero at init left out
    s = stepped.scalars(state.count, lr, step_ok)
    outs, written = pipeline.run(leaves, plan, stepped, s, state.count, write_params=write_params)
    return treedef.unflatten([out.first for out in outs]), _next_state(state, outs, treedef, step_ok, written)

  def begin_step(self, params: Any, state: Any, by_rows: Any) -> "StepInParts":
    plan = getattr(state, "plan", None)
    if type(state) is not self.rule.state_type or not isinstance(plan, Plan):
      raise self._state_error(state)
    if self.options.execution.skip_nonfinite:
      raise ValueError(f"{self.rule.owner}: skip_nonfinite=True cannot skip a step taken in parts (the optimizer "
                       "in the backward pass): a layer is stepped before the gradients of the layers under it "
                       "exist. Build the optimizer with skip_nonfinite=False.")
    if _commit_check.PENDING:
      _commit_check.check_first_step(plan, state.count)
    if plan.layout.in_parts_why:
      raise ValueError(f"{self.rule.owner}: a step in parts (begin_step, step_in_backward) steps each leaf's "
                       f"state in place, one array per leaf; {plan.layout.in_parts_why}. Build the optimizer with "
                       "state_layout='leaves' (the default).")
    rows = _rows_stepped(by_rows, params, plan, placement_words(self.options))
    shaped = lambda tree: jax.tree.map(lambda p: jax.ShapeDtypeStruct(np.shape(p), jnp.asarray(p).dtype), tree)
    treedef, leaves = pipeline.gather(shaped(params), state, params, plan, True, self.disk_store)
    stepped = self.stepped_rules[plan.static_zeros]
    s = stepped.scalars(state.count, self.learning_rate_at(state.count), None)
    steppers = [pipeline.row_stepper(plan.leaves[i], leaves[i], plan, stepped, s, write_params=True) for i in rows]

    def current(buffers):
      now = [None] * len(leaves)
      for i, b in zip(rows, buffers):
        now[i] = b.first
      return treedef.unflatten(now)

    def step_rows(buffers, grads, start, params=None):
      grads = _rows_of(grads, "grads", rows, leaves, plan)
      n = np.shape(next(g for g in grads if g is not None))[0]
      params = [None] * len(rows) if params is None else _rows_of(params, "params", rows, leaves, plan, n)
      return tuple(b if g is None else step(b, g, start, p)
                   for (_, step), b, g, p in zip(steppers, buffers, grads, params))

    def finish(buffers, grads):
      grad_leaves, grads_def = jax.tree.flatten(grads, is_leaf=lambda x: x is None)
      if grads_def != treedef:
        raise ValueError(f"{self.rule.owner}: StepInParts.finish: `grads` must be a tree like the params (None at "
                         f"the leaves stepped by rows); got {grads_def} for params {treedef}.")
      for i in rows:  # not read: typed like the param so that gather's checks hold
        grad_leaves[i] = jax.ShapeDtypeStruct(np.shape(leaves[i].param), leaves[i].grad.dtype)
      _, now = pipeline.gather(treedef.unflatten(grad_leaves), state, params, plan, True, self.disk_store)
      others = [i for i in range(len(leaves)) if i not in rows]
      sub_plan = dataclasses.replace(plan, leaves=tuple(plan.leaves[i] for i in others))
      sub_outs, written = pipeline.run([now[i] for i in others], sub_plan, stepped, s, state.count, write_params=True)
      outs = dict(zip(rows, buffers)) | dict(zip(others, sub_outs))
      outs = [outs[i] for i in range(len(leaves))]
      return treedef.unflatten([out.first for out in outs]), _next_state(state, outs, treedef, None, written)

    return StepInParts(tuple(b for b, _ in steppers), current, step_rows, finish)


def _engine(rule: UpdateRule, learning_rate: Any, o: Options) -> HybridOptimizer:
  """The transform for a checked ``rule`` and ``o``: an :class:`_Engine`'s ``init`` and ``update``."""
  engine = _Engine(rule, learning_rate, o)
  return HybridOptimizer(engine.init, engine.update)


def _rows_stepped(by_rows: Any, params: Any, plan: Plan, words: str) -> list[int]:
  """The indices of the leaves ``by_rows`` marks, each checked: run on the device, with rows every device holds.

  ``words``: the placement as the user wrote it (:func:`optax_hybrid.options.placement_words`), for messages.
  """
  owner = plan.owner
  try:
    marks = jax.tree.leaves(jax.tree.map(lambda m, sub: jax.tree.map(lambda _: bool(m), sub), by_rows, params))
  except (ValueError, TypeError) as e:
    raise ValueError(f"{owner}: `by_rows` must be a tree of bools shaped like the params or a prefix of it "
                     f"({{'layers': True, ...}}); got {jax.tree.structure(by_rows)} for params "
                     f"{jax.tree.structure(params)}.") from e
  rows = [i for i, marked in enumerate(marks) if marked]
  param_leaves = jax.tree.leaves(params)
  for i in rows:
    lp = plan.leaves[i]
    if not np.shape(param_leaves[i]):
      raise ValueError(f"{owner}: {lp.path} is a scalar: only a leaf with rows (stacked layers) is stepped "
                       "by rows; mark it False in `by_rows`.")
    if lp.runs_on != "device" or lp.on_disk:
      raise _not_stepped_on_the_device(lp, owner, words)
    if lp.row_axes == 0:
      raise ValueError(f"{owner}: {lp.path} is stepped a few rows of its first axis (the layers) at a time, and "
                       f"its sharding {lp.state_sharding.spec if lp.state_sharding is not None else '(unknown)'} "
                       "splits that axis over devices (or init saw it traced on several devices). Split the "
                       "layers' other axes (FSDP: PartitionSpec(None, 'fsdp', ...)) and pass placed params "
                       "to init.")
  return rows


def _not_stepped_on_the_device(lp: LeafPlan, owner: str, words: str) -> ValueError:
  """Why a stacked leaf cannot be stepped by rows, in the words the user chose its placement with."""
  if lp.on_disk:
    why = f"with {words} its moments live in files (the 'disk' placement), read and written whole"
  elif lp.param_kind == placement.HOST_KIND:
    why = (f"it lives in host memory, and with {words} a param in host memory is updated on the host "
           "('pinned_host' and None say where its state lives; the update then runs where the param is)")
  else:
    why = f"with {words} it is updated on the host CPU (the 'host' placement)"
  return ValueError(
      f"{owner}: {lp.path} is one of the stacked layers, which step_in_backward (begin_step) steps a few rows at "
      f"a time on the device, in place; {why}. Pass state_memory_kind='host_state' (the state in host memory, "
      "stepped on the device, wherever the param lives), or 'device', for the stacked layers: for every leaf, "
      "or per leaf as a tree or callable ({'layers': 'host_state', ...}).")


def _rows_of(tree: Any, name: str, rows: list[int], leaves: list, plan: Plan, n: int | None = None) -> list:
  """Per leaf ``rows`` marks, in that order, its rows in ``tree`` (``n`` of them if given), or None where a tree
  like the params holds None at it (not stepped now); checked against the params."""
  flat = jax.tree.leaves(tree, is_leaf=lambda x: x is None)
  # A tree like the params (None at other leaves) has one entry per param; one layer's tree, one per marked leaf.
  if len(flat) == len(leaves) and (None in flat or len(flat) != len(rows)):
    values = [flat[i] for i in rows]
  else:
    values = [v for v in flat if v is not None]
  params = [leaves[i].param for i, v in zip(rows, values)]
  given = [(v, p) for v, p in zip(values, params) if v is not None]
  counts = {np.shape(v)[0] if np.ndim(v) else None for v, _ in given}
  if len(values) != len(rows) or len(counts) != 1 or (n is not None and counts != {n}) or any(
      np.shape(v)[1:] != np.shape(p)[1:] for v, p in given):
    expected = ", ".join(f"{plan.leaves[i].path} (n, {', '.join(map(str, np.shape(p)[1:]))})"
                         for i, p in zip(rows, [leaves[i].param for i in rows]))
    got = ", ".join(str(np.shape(v)) for v in values)
    raise ValueError(f"{plan.owner}: StepInParts.step_rows: `{name}` must hold n rows of each leaf stepped by "
                     f"rows, in the params' leaf order: {expected}; got {len(values)} leaves shaped {got}. Pass "
                     "one layer's tree with a leading axis of n (g[None] for one layer), or a tree like the "
                     "params with None at the leaves not stepped now.")
  return values


def _next_state(state: Any, outs: list, treedef: Any, step_ok: Any, written: Any) -> Any:
  """The state after a step: new fields and master, the count advanced unless the step was skipped.

  Where a leaf keeps nothing in a field, the old empty entry is passed
  through, typed with the state's memory space.
  """
  count, skipped = numerics.safe_increment(state.count), state.skipped
  if step_ok is not None:
    count = jnp.where(step_ok, count, state.count)
    skipped = jnp.where(step_ok, skipped, numerics.safe_increment(skipped))
  if written is not None:
    count = count + written  # the next step's read of disk state waits for this write
  plan = state.plan
  new = {name: [] for name in plan.empty}  # the params-shaped attributes, one value per leaf
  suffixes = ("",) + moments_lib.SUFFIXES
  for lp, out in zip(plan.leaves, outs):
    form = lp.moments
    for name, value in zip(plan.field_names, out.state):  # the arrays of the value its format stores, by suffix
      arrays = dict(zip(form.attribute_suffixes, form.arrays_of(value) if form.encodes else [value]))
      for suffix in suffixes:
        new[name + suffix].append(arrays.get(suffix))
    new["master"].append(out.master)
  return state._replace(count=count, skipped=skipped, **plan.layout.written(state, plan, treedef, new))


def moment_values(opt_state: Any) -> tuple[Any, ...]:
  """The rule's state of the optimizer state in ``opt_state``, as float trees shaped like the params.

  One tree per field the rule keeps, in the state's order: ``(mu, nu)`` for
  :func:`~optax_hybrid.hybrid_adamw`, ``(mu,)`` for
  :func:`~optax_hybrid.hybrid_lion`, ``(sum_of_squares,)`` for
  :func:`~optax_hybrid.hybrid_adagrad`, ``(trace,)`` or ``()`` for
  :func:`~optax_hybrid.hybrid_sgd`. 8-bit values (``moment_format="8bit"``)
  are dequantized (code map value times block scale), disk-tier values are
  read from their files, and the others are returned as stored. The values
  are copies on the default device, for inspection (logging, debugging,
  converting a run); the step never needs them.

  Args:
    opt_state: a ``hybrid_*`` optimizer's state, or any optimizer state
      holding exactly one (inside ``optax.chain``, ``MultiSteps``,
      ``standard_optimizer``, ...).

  Returns:
    A tuple of trees shaped like the params.

  Raises:
    ValueError: if ``opt_state`` holds no such state, or several.

  Example:
    >>> import jax.numpy as jnp, optax_hybrid
    >>> params = {"w": jnp.ones((16, 512))}
    >>> tx = optax_hybrid.hybrid_adamw(1e-3, moment_format="8bit")
    >>> state = tx.init(params)
    >>> params, state = tx.step(params, state, {"w": jnp.full((16, 512), 0.5)})
    >>> state.mu["w"].dtype, state.mu_scales["w"].shape
    (dtype('uint8'), (16, 2))
    >>> mu, nu = optax_hybrid.moment_values(state)
    >>> round(float(mu["w"][0, 0]), 5), round(float(nu["w"][0, 0]), 7)  # (1 - b1) g, (1 - b2) g^2, to 8 bits
    (0.05, 0.00025)
  """
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]
  if len(found) != 1:
    raise ValueError(f"moment_values: `opt_state` must hold exactly one optimizer state of optax_hybrid, found "
                     f"{len(found)}" + ("; pass that state itself (for example from "
                                         "optax.tree_utils.tree_get_all_with_path(opt_state, 'mu'))." if found
                                         else " (no HybridAdamState or other hybrid_* optimizer state in it)."))
  state = found[0]
  plan = state.plan
  read = lambda x: jnp.asarray(disk.read(x) if isinstance(x, disk.DiskMoment) else jax.device_get(x))
  # A stored value read into host arrays, whatever holds it: the state's arrays, packed slices, files on disk.
  on_host = lambda lp, stored: lp.moments.stored([read(a) for a in lp.moments.arrays_of(packed.read(stored))])
  treedef, values = pipeline.stored_values(state, plan)
  return tuple(treedef.unflatten([lp.moments.decode(on_host(lp, v[k]), signed=field.signed)
                                  for lp, v in zip(plan.leaves, values)]) for k, field in enumerate(plan.fields))


__all__ = ["HybridOptimizer", "StepInParts", "building_block", "moment_values", "optimizer", "params_shaped_fields"]
