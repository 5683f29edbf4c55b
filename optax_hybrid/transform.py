"""The Optax-facing AdamW transform: ``hybrid_adamw`` and its building block."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax._src import numerics

from optax_hybrid import _compat, disk, pipeline, placement, tiers as tiers_lib
from optax_hybrid.kernels import quantized, step_scalars
from optax_hybrid.options import MaskOrFn, Options, ScalarOrSchedule, check_learning_rate, make_options
from optax_hybrid.plan import LeafPlan, Plan, make_plan


class HybridAdamState(NamedTuple):
  """State of :func:`hybrid_adamw` and :func:`scale_by_hybrid_adam`.

  Attributes:
    count: int32 scalar, the number of updates taken (on device).
    mu: first moments, shaped like the params, in ``mu_dtype`` and their
      state memory kind.
    nu: second moments, likewise in ``nu_dtype`` (real for complex params).
    skipped: int32 scalar, the number of steps skipped for non-finite
      gradients (``skip_nonfinite=True``); they do not advance ``count``.
    master: with ``master_dtype``, the master copy of each lower-precision
      param (a tree shaped like the params, an empty entry where a param
      keeps no master), placed with the leaf's moments; ``None`` otherwise.
    mu_scales, nu_scales: with ``moment_format="8bit"``, the float32 per-block
      scales of each 8-bit moment (trees shaped like the params, an empty
      entry where a leaf keeps float32 moments); ``mu`` and ``nu`` then hold
      the uint8 codes of those leaves. ``None`` otherwise. Read the values
      with :func:`moment_values`.
    plan: every per-leaf decision made by ``init`` (:class:`optax_hybrid.plan.Plan`:
      tier, memory kinds, dtypes, decay, shardings, streaming stage, the disk
      tier's files), static data that holds no arrays.

  Every params-shaped field (``mu``, ``nu``, ``master``, the scales) holds exactly one
  array per param leaf: where a leaf keeps nothing in it (no master for a
  float32 param; disk-tier moments, which are files) it holds an *empty
  entry*, an array of shape ``(0,) * max(ndim, 1)``
  (:func:`optax_hybrid.placement.empty_entry`). So
  ``optax.tree_utils.tree_map_params`` maps partition specs (or anything
  shaped like the params) over every such field, for every tier.
  """

  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  skipped: jax.Array
  master: Any = None
  mu_scales: Any = None
  nu_scales: Any = None
  plan: Any = None


class HybridAdamW(optax.GradientTransformationExtraArgs):
  """An Optax gradient transformation with one more method: ``step``, the fused one-pass step.

  ``init`` and ``update`` follow the Optax contract. ``step`` returns the new
  params directly: each leaf's parameter is read once and written once (in
  place when the buffers are donated), instead of returning an update that a
  second pass adds.
  """

  __slots__ = ()

  def step(self, params: optax.Params, state: "HybridAdamState",
           grads: optax.Updates) -> tuple[optax.Params, "HybridAdamState"]:
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
    return self.update.fused_step(params, state, grads)

  def close(self) -> None:
    """Closes the disk tier's file, which frees its space. A no-op without disk leaves.

    Also done when the process ends. The state's disk leaves cannot be stepped
    afterwards.
    """
    self.update.close()


# ---------------------------------------------------------------------------
# The transform
# ---------------------------------------------------------------------------


def _state_arrays(param: Any, leaf: LeafPlan, with_master: bool) -> tuple:
  """``(mu, nu, master, no_scales)`` for one leaf, placed where its plan says.

  ``no_scales`` is the pair of empty entries the scales fields hold for a
  leaf without 8-bit moments (None for a leaf with them).

  A moment is an array, or for 8-bit moments a
  :class:`~optax_hybrid.kernels.quantized.QuantizedMoment` of zero codes and
  scales. Where the leaf keeps nothing in a field (disk moments, which are
  files; no master) it gets an empty entry (:func:`placement.empty_entry`);
  the master field is ``None`` only when the state has no masters at all.
  """
  abstract = isinstance(param, jax.ShapeDtypeStruct)
  # ZeRO-1 splits the state further than the param: place it with its own sharding.
  split = None if leaf.gather_to is None else leaf.state_sharding.with_memory_kind(leaf.state_kind)

  def zeros(shape, dtype):
    if leaf.on_disk:  # the moments are the plan's files
      return placement.empty_entry(param, dtype, leaf.state_kind)
    if split is not None:
      return placement.placed_with(None, shape, dtype, split, abstract=abstract)
    return placement.zeros_placed(param, dtype, leaf.state_kind, shape=shape)

  def moment(dtype):
    if leaf.quantized:  # zero codes with zero scales: zeros
      return quantized.QuantizedMoment(zeros(np.shape(param), quantized.CODE_DTYPE),
                                       zeros(quantized.scales_shape(np.shape(param)), quantized.SCALE_DTYPE))
    return zeros(np.shape(param), dtype)

  master = None
  if leaf.master_dtype is not None:
    master = (placement.copy_placed(param, leaf.master_dtype, leaf.state_kind) if split is None
              else placement.placed_with(param, np.shape(param), leaf.master_dtype, split, abstract=abstract))
  elif with_master:
    master = placement.empty_entry(param, param.dtype, leaf.state_kind, split)
  # One empty entry per scales field: a donated step must not get one buffer twice.
  no_scales = None if leaf.quantized else tuple(
      placement.empty_entry(param, quantized.SCALE_DTYPE, leaf.state_kind, split) for _ in range(2))
  return moment(leaf.mu_dtype), moment(leaf.nu_dtype), master, no_scales


def _with_disk_files(plan: Plan, params: list, store: disk.DiskStore) -> Plan:
  """``plan`` with a new zero-filled file for each moment of each disk-tier leaf."""
  def files(p, leaf):
    shape = np.shape(p)
    if leaf.quantized:  # codes and scales, each in its own file
      codes, scales = (shape, quantized.CODE_DTYPE), (quantized.scales_shape(shape), quantized.SCALE_DTYPE)
      specs = {"mu": codes, "mu_scales": scales, "nu": codes, "nu_scales": scales}
    else:
      specs = {"mu": (shape, leaf.mu_dtype), "nu": (shape, leaf.nu_dtype)}
    return tuple((field, store.create(*spec)) for field, spec in specs.items())

  return dataclasses.replace(plan, leaves=tuple(
      dataclasses.replace(leaf, files=files(p, leaf)) if leaf.on_disk else leaf
      for p, leaf in zip(params, plan.leaves)))


class _NoPlan:
  """The ``plan`` of the state ``init`` returns for Optax's params placeholder: no plan is made without params.

  A pytree leaf, so that ``optax.tree_utils.tree_map_params`` hands the real
  state's plan to its ``transform_non_params`` (or keeps it as it is).
  """

  __slots__ = ()

  def __repr__(self) -> str:
    return "<no plan: init was given optax.tree_utils.tree_map_params' params placeholder>"


_NO_PLAN = _NoPlan()


def _state_of_placeholder(placeholder: Any, o: Options) -> HybridAdamState:
  """``init``'s state for the params placeholder of ``optax.tree_utils.tree_map_params``.

  ``tree_map_params`` maps its function over every field where this state
  holds the placeholder, and ``transform_non_params`` over the others: here
  ``mu``, ``nu``, (with ``master_dtype``) ``master`` and (with 8-bit moments)
  the scales are the params-shaped fields; ``count``, ``skipped`` and the
  static ``plan`` are not.
  """
  count = jnp.zeros([], jnp.int32)
  scales = placeholder if o.quantize_moments else None
  return HybridAdamState(count=count, mu=placeholder, nu=placeholder, skipped=count,
                         master=None if o.master_dtype is None else placeholder, mu_scales=scales,
                         nu_scales=scales, plan=_NO_PLAN)


# The state's fields shaped like the params: one array per param leaf each
# (an empty entry where a leaf keeps nothing: Plan.empty_entries).
PARAMS_SHAPED_FIELDS = ("mu", "nu", "master", "mu_scales", "nu_scales")

# The pipeline reads a disk leaf's moments from its files and knows no master
# where a leaf keeps none: it sees those fields' empty entries replaced by the
# plan's files and by None, and the step puts the entries back afterwards.

def _replaced_for_pipeline(plan: Plan) -> dict:
  """``{field: {leaf index: what the pipeline reads there instead of the empty entry}}``."""
  return {field: {i: dict(plan.leaves[i].files).get(field) for i in plan.empty_entries(field)}
          for field in PARAMS_SHAPED_FIELDS}


def _pipeline_view(state: HybridAdamState) -> HybridAdamState:
  """``state`` as the pipeline reads it: files for disk moments, None where a leaf keeps no master."""
  fields = {}
  for field, by_leaf in _replaced_for_pipeline(state.plan).items():
    tree = getattr(state, field)
    if tree is None:
      continue
    leaves, treedef = jax.tree.flatten(tree)
    if len(leaves) != len(state.plan.leaves):
      return state  # not this plan's state: pipeline.gather says what does not fit
    fields[field] = treedef.unflatten([by_leaf.get(i, x) for i, x in enumerate(leaves)])
  return state._replace(**fields)


def _with_empty_entries(new: HybridAdamState, old: HybridAdamState) -> HybridAdamState:
  """The pipeline's next state ``new`` with ``old``'s empty entries back in place (typed like their state)."""
  fields = {}
  for field, by_leaf in _replaced_for_pipeline(old.plan).items():
    if getattr(old, field) is None:
      continue
    old_leaves, treedef = jax.tree.flatten(getattr(old, field))
    new_leaves = treedef.flatten_up_to(getattr(new, field))
    kind = lambda i: placement.space_of_kind(old.plan.leaves[i].state_kind)
    fields[field] = treedef.unflatten([_compat.move(old_leaves[i], kind(i)) if i in by_leaf else x
                                       for i, x in enumerate(new_leaves)])
  return new._replace(**fields)


def _hybrid_adam(options: Options) -> HybridAdamW:
  """The transform for checked ``options``: ``init`` makes the plan, ``update`` and ``step`` follow it."""
  o = options
  disk_store: list = []  # the DiskStore, made by the first init that places a leaf on disk

  def init_fn(params):
    if _compat.is_optax_params_placeholder(params):
      return _state_of_placeholder(params, o)
    plan = make_plan(params, o)
    param_leaves, treedef = jax.tree.flatten(params)
    if any(leaf.on_disk for leaf in plan.leaves):
      if not disk_store or disk_store[0].closed:
        disk_store[:] = [disk.DiskStore(o.nvme_offload_dir)]
      plan = _with_disk_files(plan, param_leaves, disk_store[0])
    has_master = o.master_dtype is not None
    arrays = [_state_arrays(p, leaf, has_master) for p, leaf in zip(param_leaves, plan.leaves)]
    mu, nu, master, no_scales = ([a[k] for a in arrays] for k in range(4))
    counter = lambda: placement.step_counter_like(jax.tree.leaves(mu + nu))
    return HybridAdamState(count=counter(), skipped=counter(), plan=plan,
                           master=treedef.unflatten(master) if has_master else None,
                           **_moment_fields(mu, nu, treedef, no_scales if o.quantize_moments else None))

  def step(grads, state, params, *, write_params):
    if not isinstance(state, HybridAdamState):
      raise TypeError(
          "hybrid_adamw: `state` must be the HybridAdamState made by this "
          f"optimizer's init, got {type(state).__name__}."
      )
    plan = state.plan
    if not isinstance(plan, Plan):
      raise TypeError(f"hybrid_adamw: the state has no placement plan (plan={plan!r}); make the state with "
                      "this optimizer's init.")
    stepped, state = state, _pipeline_view(state)
    treedef, leaves = pipeline.gather(grads, state, params, plan, write_params=write_params,
                                      disk_closed=bool(disk_store) and disk_store[0].closed)
    leaves, on_disk = pipeline.load_disk_moments(leaves, plan, after=state.count)
    step_ok = placement.all_finite([leaf.grad for leaf in leaves]) if o.skip_nonfinite else None
    lr = o.learning_rate(state.count) if callable(o.learning_rate) else o.learning_rate
    scalars = step_scalars(state.count, lr, o.b1, o.b2, o.eps, o.weight_decay, o.bias_correction, step_ok)
    outs = pipeline.run_groups(leaves, plan, scalars, adamw_mode=o.adamw_mode, write_params=write_params,
                               fused=write_params)
    outs = pipeline.gather_zero1(outs, plan)
    outs, written = pipeline.store_disk_moments(outs, on_disk)
    new_state = _with_empty_entries(_next_state(state, outs, treedef, step_ok, written), stepped)
    return treedef.unflatten([out.first for out in outs]), new_state

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    return step(updates, state, params, write_params=False)

  def fused_step(params, state, grads):
    return step(grads, state, params, write_params=True)

  def close():
    for store in disk_store:
      store.close()

  update_fn.fused_step = fused_step
  update_fn.close = close
  return HybridAdamW(init_fn, update_fn)


def _next_state(state: HybridAdamState, outs: list, treedef: Any, step_ok: Any, written: Any) -> HybridAdamState:
  """The state after a step: new moments and master, the count advanced unless the step was skipped."""
  count, skipped = numerics.safe_increment(state.count), state.skipped
  if step_ok is not None:
    count = jnp.where(step_ok, count, state.count)
    skipped = jnp.where(step_ok, skipped, numerics.safe_increment(skipped))
  if written is not None:
    count = count + written  # the next step's read of disk moments waits for this write
  return HybridAdamState(
      count=count,
      skipped=skipped,
      master=None if state.master is None else treedef.unflatten([out.master for out in outs]),
      plan=state.plan,
      **_moment_fields([out.mu for out in outs], [out.nu for out in outs], treedef,
                       None if state.mu_scales is None else [None] * len(outs)),
  )


def _moment_fields(mu: list, nu: list, treedef: Any, no_scales: list | None) -> dict:
  """The state's moment fields from one moment per leaf: 8-bit ones split into codes and scales.

  ``no_scales``: per leaf, what the two scales fields hold where a leaf has
  no 8-bit moments (its pair of empty entries at init; None after a step,
  which :func:`_with_empty_entries` then replaces); ``None``: no scales
  fields.
  """
  codes = lambda m: m.codes if isinstance(m, quantized.QuantizedMoment) else m
  fields = {"mu": treedef.unflatten([codes(m) for m in mu]), "nu": treedef.unflatten([codes(v) for v in nu])}
  if no_scales is not None:
    for field, moments in (("mu_scales", mu), ("nu_scales", nu)):
      fields[field] = treedef.unflatten([m.scales if isinstance(m, quantized.QuantizedMoment)
                                         else None if absent is None else absent[field == "nu_scales"]
                                         for m, absent in zip(moments, no_scales)])
  return fields


def moment_values(opt_state: Any) -> tuple[Any, Any]:
  """The Adam moments of the :class:`HybridAdamState` in ``opt_state``, as float trees shaped like the params.

  8-bit moments (``moment_format="8bit"``) are dequantized (code map value
  times block scale), disk-tier moments are read from their files, and the
  others are returned as stored. The values are copies on the default
  device, for inspection (logging, debugging, converting a run); the step
  never needs them.

  Args:
    opt_state: a ``HybridAdamState``, or any optimizer state holding exactly
      one (inside ``optax.chain``, ``MultiSteps``, ``standard_optimizer``, ...).

  Returns:
    ``(mu, nu)``: two trees shaped like the params.

  Raises:
    ValueError: if ``opt_state`` holds no ``HybridAdamState``, or several.

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
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, HybridAdamState))
           if isinstance(x, HybridAdamState)]
  if len(found) != 1:
    raise ValueError(f"moment_values: `opt_state` must hold exactly one HybridAdamState, found {len(found)}"
                     + ("; pass the HybridAdamState itself (for example from optax.tree_utils.tree_get_all_with_path"
                        "(opt_state, 'mu'))." if found else " (no HybridAdamState: is this a hybrid_adamw state?)."))
  state = _pipeline_view(found[0])
  read = lambda x: disk.read(x) if isinstance(x, disk.DiskMoment) else jax.device_get(x)

  def values(codes, scales, signed):
    if scales is None:
      return jnp.asarray(read(codes))
    return quantized.dequantize(quantized.QuantizedMoment(jnp.asarray(read(codes)), jnp.asarray(read(scales))),
                                signed=signed)

  treedef = jax.tree.structure(state.mu, is_leaf=lambda x: isinstance(x, disk.DiskMoment))
  out = []
  for field, signed in (("mu", True), ("nu", False)):
    codes = treedef.flatten_up_to(getattr(state, field))
    scales_tree = getattr(state, field + "_scales")
    scales = [None] * len(codes) if scales_tree is None else treedef.flatten_up_to(scales_tree)
    out.append(treedef.unflatten([values(c, sc, signed) for c, sc in zip(codes, scales)]))
  return out[0], out[1]


def scale_by_hybrid_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    bias_correction: bool = True,
    adamw_mode: bool = True,
    mask: MaskOrFn = None,
    mu_dtype: Any = None,
    nu_dtype: Any = None,
    state_memory_kind: placement.MemoryKindSpec = None,
    kernel: str = "auto",
    skip_nonfinite: bool = False,
    tiers: tiers_lib.TierSpec = None,
    offload_fraction: float | None = None,
    nvme_offload_fraction: float | None = None,
    nvme_offload_dir: Any = None,
    shard_state_over: str | None = None,
    moment_format: str | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""The Adam direction, without the learning rate, for users who compose their own chain.

  Returns :math:`\hat m / (\sqrt{\hat v} + \epsilon)` plus, in AdamW mode,
  :math:`\lambda p` on masked leaves; so that
  ``optax.chain(scale_by_hybrid_adam(...), optax.scale_by_learning_rate(lr))``
  equals ``hybrid_adamw(lr, ...)``. Arguments are those of
  :func:`hybrid_adamw` (master weights need the learning rate inside the
  step, so ``master_dtype`` is only offered there).

  Example:
    >>> import optax, optax_hybrid
    >>> tx = optax.chain(
    ...     optax.clip_by_global_norm(1.0),
    ...     optax_hybrid.scale_by_hybrid_adam(b2=0.95),
    ...     optax.scale_by_learning_rate(3e-4))
  """
  # The building block is the step with a learning rate of -1 (the raw direction).
  tx = _hybrid_adam(make_options(learning_rate=-1.0, **locals()))
  # A plain Optax transformation: the fused ``step`` applies a learning rate,
  # which this building block leaves to the chain (its internal rate is -1).
  return optax.GradientTransformationExtraArgs(tx.init, tx.update)


def hybrid_adamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    bias_correction: bool = True,
    adamw_mode: bool = True,
    mask: MaskOrFn = None,
    mu_dtype: Any = None,
    nu_dtype: Any = None,
    state_memory_kind: placement.MemoryKindSpec = None,
    kernel: str = "auto",
    skip_nonfinite: bool = False,
    weight_decay_mask: MaskOrFn = None,
    tiers: tiers_lib.TierSpec = None,
    offload_fraction: float | None = None,
    master_dtype: Any = None,
    nvme_offload_fraction: float | None = None,
    nvme_offload_dir: Any = None,
    shard_state_over: str | None = None,
    moment_format: str | None = None,
) -> HybridAdamW:
  r"""AdamW as ColossalAI's HybridAdam and ``torch.optim.AdamW`` compute it, with placeable state.

  With :math:`t` the 1-based step, :math:`\eta_t` the learning rate and
  :math:`\lambda` the weight decay, each leaf's update is (float32 math
  whatever the parameter dtype):

  .. math::

    g_t &\leftarrow g_t + \lambda p_{t-1} \quad\text{(only if adamw\_mode=False)} \\
    m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t, \qquad
    v_t = \beta_2 v_{t-1} + (1 - \beta_2) g_t^2 \\
    u_t &= -\eta_t \left( \frac{m_t / (1 - \beta_1^t)}{\sqrt{v_t / (1 - \beta_2^t)} + \epsilon}
          + \lambda p_{t-1} \,\text{(only if adamw\_mode)} \right)

  ``adamw_mode=True`` is ``torch.optim.AdamW`` (decay decoupled and scaled by
  the current learning rate); ``adamw_mode=False`` is
  ``torch.optim.Adam(weight_decay=...)`` (L2 decay added to the gradient);
  ``bias_correction=False`` drops both :math:`1 - \beta^t` factors.

  The moments can live in host memory (``state_memory_kind="pinned_host"``):
  inside ``update`` they are moved to the device, updated by the fused step
  and moved back, so a jitted train step keeps them in host memory between
  steps. Parameters that live in host memory are updated on the host (XLA host
  compute); use :func:`optax_hybrid.apply_updates` to apply the updates.

  Args:
    learning_rate: a float ``>= 0`` or an Optax schedule of the step count.
    b1: decay of the first moment, in ``[0, 1)``.
    b2: decay of the second moment, in ``[0, 1)``.
    eps: added to the denominator, outside the square root; ``>= 0``.
    weight_decay: decay coefficient :math:`\lambda`; ``>= 0``.
    bias_correction: divide the moments by :math:`1 - \beta^t`.
    adamw_mode: decoupled decay (True) or L2 decay through the gradient (False).
    mask: which leaves take weight decay: a tree of bools with the structure
      of the params (or a prefix of it), or a callable ``params -> tree``.
      ``None``: every leaf.
    mu_dtype: dtype of the first moments; ``None``: the param's dtype.
    nu_dtype: dtype of the second moments; ``None``: the param's dtype (its
      real counterpart for complex params, whose second moment is real).
    state_memory_kind: where the moments live: ``None`` (beside each param),
      ``"device"``, ``"pinned_host"``, or a callable ``(path, param) -> kind``
      choosing per leaf (returning ``None`` for "beside the param").
    kernel: ``"auto"`` (the fastest measured: on a GPU the Pallas kernel; on a
      CPU the native kernel for ``tx.step`` and XLA for ``update``), ``"xla"``
      (one fused XLA loop per leaf), ``"native"`` (the compiled CPU kernel: one
      custom call for all CPU-resident leaves), ``"pallas"`` (the fused Pallas
      GPU kernel: one launch per 64 device-resident leaves; interpret mode off
      the GPU, for tests).
    skip_nonfinite: skip a step whose gradients hold a NaN or an infinity:
      zero updates, moments and ``count`` unchanged, ``state.skipped``
      incremented. Costs one reduction over the gradients, no extra pass over
      the moments (the choice is made inside the fused step).
    weight_decay_mask: alias of ``mask``, as ``optax.adamw`` names it.
    tiers: where each leaf's state lives and where its update runs, instead
      of ``state_memory_kind``: ``"device"``, ``"host_state"`` (moments in
      ``pinned_host``, updated on the device), ``"host"`` (moments and
      master in ``pinned_host``, updated on the host CPU: the gradient moves
      to the host, only the new param moves back) or ``"disk"`` (moments in
      files under ``nvme_offload_dir``, read and written around each step).
      A tier name, a callable ``(path, param) -> tier or None``, or a tree of
      tier names shaped like the params (or a prefix of it). See
      :mod:`optax_hybrid.tiers`.
    offload_fraction: move this fraction of the params, by size, to the
      ``"host"`` tier, the rest updating on the device at the same time (like
      Twin-Flow's ratio). Leaves are taken in ``jax.tree.leaves`` order, each
      one when at least half of it falls within the fraction
      (:func:`optax_hybrid.tiers.pick_by_fraction`).
    nvme_offload_fraction: move this fraction of the params, by size, to the
      ``"disk"`` tier (chosen first, the same way), as HybridAdam's
      ``nvme_offload_fraction``. Single-device params only.
    nvme_offload_dir: the directory for the disk tier's file (it must exist
      and be writable: checked here); ``None``: the temporary directory.
      The file is owner-only and has no name: ``tx.close()`` or the end of
      the process, however it ends, frees it. See :mod:`optax_hybrid.disk`.
    shard_state_over: ZeRO-1: a mesh axis name (e.g. ``"data"``) over which
      the optimizer state (moments and master) is split even where the params
      are replicated: each leaf's first dimension that its param leaves
      unsharded and that the axis divides is split over it
      (:func:`optax_hybrid.tiers.zero1_sharding`). Each device then updates
      its shard and the update is gathered back to the param's sharding.
      Params must be placed with a ``NamedSharding`` on a mesh with that axis.
    moment_format: how both moments are stored, instead of ``mu_dtype`` /
      ``nu_dtype``: ``"float32"``, ``"bfloat16"``, ``"float16"``, or ``"8bit"``:
      block-wise 8-bit (Dettmers et al. 2021), uint8 codes into a dynamic
      code map plus one float32 scale per block of 256 values along the last
      axis, 2.03 bytes per weight for both moments instead of 8 (leaves of
      fewer than 4096 values, non-float leaves, and leaves whose state shards
      would split a block keep float32 moments). Every tier and kernel takes
      it; the update uses the new moments before they are quantized. See
      :mod:`optax_hybrid.kernels.quantized`.
    master_dtype: keep a master copy in this dtype (e.g. ``jnp.float32``) for
      each lower-precision param (bf16, fp16), placed with its moments. The
      step is computed against the master; the new param is the new master
      rounded to the param's dtype (``tx.step``), and ``update`` returns, in
      the master's dtype, the difference that makes ``apply_updates`` land
      exactly on it. Small steps then accumulate instead of rounding away.

  All numeric hyperparameters may be traced, so
  ``optax.inject_hyperparams(hybrid_adamw)(...)`` works, and changing an
  injected value does not recompile when the new value has the old one's
  shape, dtype, weak type and committedness (``jnp.full_like(old, value)``;
  a Python float is weakly typed and compiles the step once more). Pass
  ``hyperparam_dtype=jnp.float32`` there for low-precision params: Optax
  otherwise casts the injected betas to the params' dtype.

  Returns:
    A :class:`HybridAdamW`: an ``optax.GradientTransformationExtraArgs`` whose
    state is a :class:`HybridAdamState`, with the fused ``step`` method.

  Raises:
    ValueError: for a hyperparameter out of range, an unknown memory kind or
      kernel, or a memory kind the backend does not have.
    TypeError: for arguments of the wrong type.

  Example:
    >>> import jax, jax.numpy as jnp, optax_hybrid
    >>> params = {"w": jnp.ones((3,))}
    >>> tx = optax_hybrid.hybrid_adamw(
    ...     optax_hybrid.warmup_cosine_schedule(1e-3, total_steps=1000, warmup_steps=30),
    ...     weight_decay=0.1, state_memory_kind="pinned_host")
    >>> state = tx.init(params)
    >>> state.mu["w"].sharding.memory_kind
    'pinned_host'
    >>> updates, state = tx.update({"w": jnp.ones((3,))}, state, params)
    >>> params = optax_hybrid.apply_updates(params, updates)
  """
  if weight_decay_mask is not None:
    if mask is not None:
      raise ValueError(
          "hybrid_adamw: pass either `mask` or its alias `weight_decay_mask`, not both."
      )
    mask = weight_decay_mask
  del weight_decay_mask  # folded into `mask` above
  check_learning_rate(learning_rate)
  return _hybrid_adam(make_options(**locals()))
