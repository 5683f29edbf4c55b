"""The plan: every decision about a leaf that never changes between steps, made once by ``init``.

For each parameter leaf, :func:`make_plan` records its tier, where its update
runs, where its state lives (memory kind and sharding), its moment and master
dtypes, whether it takes weight decay, and in which *stage* its state crosses
the bus. The plan rides in the optimizer state as static data (part of the
tree structure, no arrays), so the traced step only reads it: it never looks
at the params' placement or re-resolves an option.

What crosses the bus, and when, is decided here:

* ``host_state`` leaves stream their moments (and master) host -> device ->
  host; ``host`` leaves send their gradient down and their new param up. Both
  are cut into stages of about :data:`STREAM_STAGE_BYTES` of state (a leaf
  larger than that is a stage of its own), in leaf order.
* The step orders each stage's transfers after the previous stage's
  arithmetic and the stored results of the stage before that (after the
  previous stage's stored results for the ``host`` tier: :data:`STREAM_WAITS`)
  with ``lax.optimization_barrier``, so at most two stages' inputs and one
  stage's results are on the device at once for ``host_state`` (a few stages
  in host temporaries for the ``host`` tier), while one stage's copies in
  still overlap the previous stage's copies out. Without that order XLA starts
  every copy as early as it can and holds the whole model's state on the
  device in temporaries (``docs/gpu_compile.md``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from optax_hybrid import layouts, masters, moments as moments_lib, placement, stacks, tiers as tiers_lib
from optax_hybrid.kernels import kernels_for
from optax_hybrid.options import Options

# The state bytes a stage of streamed leaves gathers before the next stage
# starts. Large enough that a stage's copies are long transfers (a PCIe 5 x16
# link moves 64 MiB in about 1.3 ms), small enough that three stages are a
# small part of an accelerator's memory.
STREAM_STAGE_BYTES = 64 * 2**20

# What a stage's transfers wait for, per place the update runs: (how many
# stages back its arithmetic must be done, how many stages back its results
# must be stored where the state lives); 0 for "nothing". On the device, the
# previous stage computed and the one before stored: a stage's copies in then
# overlap the previous stage's copies out (the link carries both directions),
# and at most two stages' inputs and one stage's results are staged, whatever
# order XLA picks for the rest. Host computations run one after another
# anyway, and with two stages independent of each other XLA merges their host
# calls (whose temporaries then hold the whole state); waiting for the previous
# stage's stored results keeps one call per stage.
STREAM_WAITS = {"device": (1, 2), "host": (0, 1)}


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  """Everything the step needs to know about one parameter leaf, fixed at ``init``.

  Attributes:
    path: the leaf's key path as ``jax.tree_util.keystr`` writes it, for messages.
    tier: ``"device"``, ``"host_state"``, ``"host"`` or ``"disk"``
      (:mod:`optax_hybrid.tiers`).
    param_kind: the memory kind the param lives in.
    param_dtype: the param's dtype (what a master format's kept values are
      read against when a checkpoint is restored across formats).
    shape: the param's shape, which its gradient and each field's values
      have (None: not recorded, in a plan written by hand).
    state_kind: the memory kind of the in-memory state: the rule's fields,
      and the master copy (for the disk tier, whose fields are files, the master).
    dtypes: the dtype of each field's values (:attr:`Plan.fields`): the
      storage dtype, or what ``moments`` encodes (float32 for 8-bit).
    moments: how the fields are stored (:class:`optax_hybrid.moments.MomentFormat`):
      :data:`~optax_hybrid.moments.AS_STORED` (the values, in ``dtypes``) or
      the format asked for, where it applies to the leaf.
    master: the leaf's master format (:class:`optax_hybrid.masters.MasterFormat`):
      :data:`~optax_hybrid.masters.NO_MASTER` when it has none (no ``master=``,
      or a param the format does not apply to).
    master_dtype: the dtype of what the master format keeps in the state's
      ``master`` entry (a float32 copy, a Kahan term in the param's dtype), or
      None when it keeps nothing there (no master, or ``"stochastic"``).
    decay: does the leaf take weight decay (the mask, resolved once)?
    state_sharding: how the state is split over several devices: a
      ``NamedSharding`` on the mesh's abstract form, no memory kind
      (:func:`optax_hybrid.placement.sharding_of`), the param's or ZeRO-1's;
      None on one device, or where the param's split is unseen (traced on a
      mesh with ``Auto`` axes).
    gather_to: ZeRO-1: the param's sharding (as ``state_sharding``), where the
      state is split further than the param (the update is gathered back to
      it); else None.
    stage: the streaming stage of a ``host_state`` or ``host`` leaf; 0 for
      others.
    slice_rows: for a ``host_state`` leaf larger than a stage (a stacked
      layer's weights), how many rows of its first axis cross the bus at a
      time: the step brings that slice of its state to the device, updates
      it and writes it back before the next (:func:`assign_slices`); 0: the
      leaf crosses whole.
    row_axes: how many leading axes of the leaf every device holds whole
      (:func:`optax_hybrid.tiers.whole_leading_axes` of ``state_sharding``):
      a kernel that cuts the leaf into slices of rows cuts only along those,
      so that a leaf split over devices stays split
      (:attr:`optax_hybrid.kernels.LeafFacts.row_axes`). None: one device,
      every axis; 0 where the param is on several devices split in a way
      ``init`` could not see (:data:`optax_hybrid.placement.UNSEEN`).
    draws_as: for a leaf of a :class:`~optax_hybrid.stacks.SplitStack`'s
      part, ``(the leaf's path in the whole stack, the flat index of its
      first element there)``: a random master format draws the bits the
      whole stack's leaf draws at those elements; ``()`` for others.
    files: the disk tier's files, made by ``init``: ``(field, disk.DiskMoment)``
      pairs, ``(("mu", ...), ("nu", ...))`` for Adam (with 8-bit storage the codes there
      and the scales under ``"mu_scales"`` and ``"nu_scales"``); the state's fields hold an
      empty entry there (:func:`optax_hybrid.placement.empty_entry`). ``()`` for
      other tiers.
    runs_on: ``"host"`` where the update is computed in host compute (the
      host tier), else ``"device"`` (derived from the tier).
    on_disk: the rule's fields are files (the disk tier).
    streamed: the leaf's data crosses the bus each step, in stages
      (``host_state`` and ``host``).
    group: the key of the leaves that run together: ``(runs_on, stage,
      master format)``.
    state_space, param_space: the memory spaces (:data:`optax_hybrid._compat.DEVICE`
      or ``HOST``) that the step types the state and the param with.
    salt, draw_offset: what a random master format seeds the leaf's bits
      with (:func:`optax_hybrid.masters.salt_of` of its path, or of
      ``draws_as``' path) and where its first element's bits are drawn.
    on_one_device: the leaf is on one device, as init saw it
      (:func:`optax_hybrid.placement.sharding_of`).
    operands_to, results_to: how the leaf's data crosses, from its tier
      (:meth:`optax_hybrid.tiers.Tier.crossing`): the memory space a run copies
      its state, param and master operands to, and each of its results to;
      None where a value stays.
  """

  path: str
  tier: str
  param_kind: str
  state_kind: str
  dtypes: tuple = ()
  master_dtype: Any = None
  master: Any = masters.NO_MASTER
  param_dtype: Any = None
  shape: tuple | None = None
  decay: bool = False
  state_sharding: Any = None
  gather_to: Any = None
  stage: int = 0
  slice_rows: int = 0
  moments: Any = moments_lib.AS_STORED
  row_axes: int | None = None
  draws_as: tuple = ()
  files: tuple = ()

  # Derived once from the tier (see __post_init__), read by every step.
  runs_on: str = dataclasses.field(init=False)
  on_disk: bool = dataclasses.field(init=False)
  streamed: bool = dataclasses.field(init=False)
  group: tuple = dataclasses.field(init=False)
  state_space: Any = dataclasses.field(init=False)
  param_space: Any = dataclasses.field(init=False)
  salt: int = dataclasses.field(init=False)
  draw_offset: int = dataclasses.field(init=False)
  on_one_device: bool = dataclasses.field(init=False)
  operands_to: tuple = dataclasses.field(init=False)
  results_to: tuple = dataclasses.field(init=False)

  def __post_init__(self):
    tier = tiers_lib.BY_NAME[self.tier]
    derived = {
        "state_space": placement.space_of_kind(self.state_kind),
        "param_space": placement.space_of_kind(self.param_kind),
        # "host": computed in host compute (the host tier); else on the device.
        "runs_on": tier.runs_on,
        "on_disk": tier.files,
        # Its data crosses the bus each step, in stages.
        "streamed": tier.streamed,
        "salt": masters.salt_of(self.draws_as[0] if self.draws_as else self.path),
        "draw_offset": self.draws_as[1] if self.draws_as else 0,
        "on_one_device": self.state_sharding is None and self.row_axes is None,
    }
    # The leaves that run together: same place, same stage, same master format (or none).
    derived["group"] = (derived["runs_on"], self.stage, self.master)
    derived["operands_to"], derived["results_to"] = tier.crossing(
        derived["state_space"], derived["param_space"], bool(self.slice_rows))
    for name, value in derived.items():
      object.__setattr__(self, name, value)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """The plan of every leaf, in the order of the params' leaves. Static: part of the tree structure.

  Attributes:
    leaves: one :class:`LeafPlan` per parameter leaf.
    kernel: the ``kernel=`` name asked for (chosen per platform at lowering:
      :func:`optax_hybrid.kernels.kernels_for`).
    split: how a custom kernel runs over the device-computed leaves:
      ``"direct"`` (every such leaf on one device), ``"shard_map"`` (every
      such leaf's state has a multi-device ``NamedSharding`` on ``mesh``: the
      kernel runs per shard) or ``"xla"`` (a split unseen, or placements
      mixed: the XLA rule, which GSPMD partitions itself).
    mesh: the (abstract) mesh for ``"shard_map"``, else None.
    fields: the rule's fields (:class:`optax_hybrid.base.Field`): the arrays
      each leaf keeps (``mu`` and ``nu`` for Adam), in the state's order.
    decay_mode: the rule's decay mode (:data:`optax_hybrid.base.DECOUPLED`,
      ``L2`` or None), read once for every step's
      :class:`~optax_hybrid.kernels.Step`.
    owner: the optimizer's public function, for messages (``"hybrid_adamw"``;
      ``make_plan`` records the rule's: the default names only the package).
    static_zeros: the rule's hyperparameters that were a concrete zero at
      ``init`` and are left out of every step (a zero weight decay, Adam's
      zero ``eps_root``): :attr:`optax_hybrid.base.UpdateRule.zero_skippable`.
      Not compared (nor hashed): ``optax.inject_hyperparams``' ``init`` sees
      them traced under ``jit`` (so records none) where the plain optimizer's
      sees Python zeros, and the two states must compare equal (Optax's
      ``AliasTest``). Steps traced for either compute the same numbers while
      the injected values stay zero.
    master: the master format asked for (``master=``;
      :data:`~optax_hybrid.masters.NO_MASTER` for none): the state has a
      ``master`` tree where it keeps something (:attr:`~optax_hybrid.masters.MasterFormat.keeps`),
      an entry per leaf (empty for a leaf it does not apply to).
    layout: where the state keeps its params-shaped values
      (:mod:`optax_hybrid.layouts`): :data:`~optax_hybrid.layouts.LEAVES`,
      one array per leaf, or with ``state_layout="packed"`` each leaf's
      slices of the state's flat buffers (:class:`optax_hybrid.packing.Layout`,
      laid out by ``init``).
    kernels: the kernel route, ``{(runs_on, writes_params): {platform:
      kernel}}`` for each place the leaves run (``"device"``, ``"host"``) and
      for ``update`` (False) and ``step`` (True):
      :func:`optax_hybrid.kernels.kernels_for` of ``kernel``, ``split``, the
      rule the steps run and the layout, decided here once; the platform is
      picked when the step is lowered
      (:func:`optax_hybrid.kernels.contract.per_platform`). Not compared: it
      follows from the fields that are (and the rule).
    field_names: the names of ``fields`` (derived, as the rest below).
    empty: ``{params-shaped attribute: indices of the leaves that keep an
      empty entry there}`` for every field, its ``_scales`` and ``master``
      (:meth:`empty_entries`).
    on_disk: some leaf is in the disk tier.
    zero1: some leaf's update is gathered back to its param's sharding (ZeRO-1).
  """

  leaves: tuple[LeafPlan, ...]
  kernel: str = "auto"
  split: str = "direct"
  mesh: Any = None
  fields: tuple = ()
  owner: str = "optax_hybrid"
  static_zeros: frozenset = frozenset()
  layout: Any = layouts.LEAVES
  master: Any = masters.NO_MASTER
  decay_mode: str | None = None
  kernels: dict = dataclasses.field(default_factory=dict, repr=False)

  field_names: tuple = dataclasses.field(init=False, repr=False)
  empty: dict = dataclasses.field(init=False, repr=False)
  on_disk: bool = dataclasses.field(init=False, repr=False)
  zero1: bool = dataclasses.field(init=False, repr=False)

  def __post_init__(self):
    # A jitted step hashes its arguments' tree structure on every call, and
    # the plan is part of it: hash once.
    object.__setattr__(self, "_key", (self.leaves, self.kernel, self.split, self.mesh, self.fields,
                                      self.decay_mode, self.owner, self.layout, self.master))
    object.__setattr__(self, "_hash", hash(self._key))
    # What every step reads, derived once.
    names = tuple(f.name for f in self.fields)
    shaped = names + tuple(n + suffix for suffix in moments_lib.SUFFIXES for n in names) + ("master",)
    object.__setattr__(self, "field_names", names)
    object.__setattr__(self, "empty", {field: frozenset(i for i, leaf in enumerate(self.leaves)
                                                        if not keeps(leaf, field)) for field in shaped})
    object.__setattr__(self, "on_disk", any(leaf.on_disk for leaf in self.leaves))
    object.__setattr__(self, "zero1", any(leaf.gather_to is not None for leaf in self.leaves))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: Any) -> bool:
    if self is other:
      return True
    return isinstance(other, Plan) and self._hash == other._hash and self._key == other._key

  @property
  def tiers(self) -> tuple[str, ...]:
    """Each leaf's tier."""
    return tuple(leaf.tier for leaf in self.leaves)

  def empty_entries(self, field: str) -> tuple[int, ...]:
    """The leaves (indices) that keep nothing in the state's params-shaped ``field``.

    Their entry there is an empty array (:func:`optax_hybrid.placement.empty_entry`):
    ``"master"`` for a leaf without a master copy, ``"<field>_scales"`` for a
    leaf without 8-bit storage, and every field of a disk-tier leaf (its
    values are the files in :attr:`LeafPlan.files`).
    """
    return tuple(sorted(self.empty[field]))


def keeps(leaf: LeafPlan, field: str) -> bool:
  """Whether ``leaf`` keeps an array in the state's params-shaped ``field`` (else an empty entry)."""
  if field == "master":
    return leaf.master_dtype is not None  # a master format that keeps something
  if leaf.on_disk:
    return False
  suffix = next((s for s in moments_lib.SUFFIXES if field.endswith(s)), None)
  return suffix is None or suffix in leaf.moments.suffixes


def make_plan(params: Any, rule: Any, options: Options) -> Plan:
  """Decides, once, everything about each leaf (see :class:`LeafPlan`) for ``rule`` and ``options``.

  ``params`` may be arrays, ``jax.ShapeDtypeStruct`` s or tracers
  (``jax.eval_shape(tx.init, params)``). What depends on where a leaf lives
  is read from its sharding by :func:`optax_hybrid.placement.sharding_of`
  alone, never from the process's device count: the same placed params give
  the same plan in any process, and ``jax.eval_shape(tx.init, params)`` gives
  ``tx.init(params)``'s plan wherever the trace sees the placement (params on
  one device; split over a mesh whose axes are ``Explicit``). Params traced
  on a mesh with ``Auto`` axes have a split the trace cannot see: their plan
  cuts nothing a device may not hold whole, and runs the XLA rule.

  Raises:
    TypeError: for integer or boolean params, or a mask that is not bools.
    ValueError: for a memory kind the params' devices lack, field dtypes that
      cannot hold a complex param, a mask that does not fit the params, the
      disk tier for multi-device params, or a ZeRO-1 axis the params' mesh
      lacks.
  """
  owner, where, storage = options.owner, options.placement, options.storage
  check_inexact_leaves(params, "params", owner)
  tiers, kinds = tiers_lib.resolve(params, tiers=where.tiers, state_memory_kind=where.state_memory_kind,
                                   offload_fraction=where.offload_fraction,
                                   nvme_offload_fraction=where.nvme_offload_fraction, owner=owner)
  with_paths = jax.tree_util.tree_leaves_with_path(params)
  static_zeros = rule.static_zeros()
  decays = ([False] * len(with_paths) if rule.decay is None or "weight_decay" in static_zeros
            else mask_leaves(options.mask, params, jax.tree.structure(params), owner))
  master, asked_moments = storage.master_format, storage.moments
  in_stacks = stacks.stack_rows(params)  # the leaves of split stacks' parts: their rows in the whole stack
  leaves = []
  for (key_path, p), tier, kind, decay in zip(with_paths, tiers, kinds, decays):
    path = jax.tree_util.keystr(key_path) or "<root>"
    whole_path, first_row, rows = in_stacks.get(path, (None, 0, None))
    # A split stack's part is stored as its rows of the whole stack are (8-bit or not, by the whole's size).
    stored_shape = np.shape(p) if rows is None else (rows, *np.shape(p)[1:])
    placed = placement.sharding_of(p)  # None (one device), a NamedSharding, or UNSEEN
    why = tiers_lib.BY_NAME[tier].single_device_why
    if why is not None and placed is not None:
      raise ValueError(f"{owner}: the {tier!r} tier needs single-device params ({why}); keep sharded params in "
                       f"{' or '.join(repr(t.name) for t in tiers_lib.BY_NAME.values() if t.streamed)}.")
    zero1 = None
    if where.shard_state_over is not None and why is None:
      zero1 = tiers_lib.zero1_sharding(p, where.shard_state_over, owner)
    # The state is split like the param (ZeRO-1: further); None on one device or where the split is unseen.
    state_sharding = zero1 or (None if placed is placement.UNSEEN else placed)
    leaf_master = master if master.applies_to(p.dtype) else masters.NO_MASTER
    row_axes = None if placed is None else tiers_lib.whole_leading_axes(state_sharding or placed, np.ndim(p))
    stored_as = asked_moments if bool(rule.fields) and asked_moments.applies_to(
        stored_shape, p.dtype, _last_axis_shards(state_sharding, np.ndim(p))) else moments_lib.AS_STORED
    leaves.append(LeafPlan(
        path=path, tier=tier, param_kind=placement.param_memory_kind(p),
        state_kind=kind, dtypes=field_dtypes(p.dtype, rule, storage, key_path, owner),
        master=leaf_master, master_dtype=leaf_master.stored_dtype(p.dtype),
        param_dtype=np.dtype(p.dtype), shape=tuple(np.shape(p)),
        decay=decay, state_sharding=state_sharding, gather_to=None if zero1 is None else placed,
        moments=stored_as, row_axes=row_axes,
        draws_as=() if whole_path is None else (whole_path, first_row * int(np.prod(np.shape(p)[1:])))))
  shapes = [np.shape(p) for _, p in with_paths]
  leaves = assign_slices(assign_stages(leaves, shapes, STREAM_STAGE_BYTES), shapes, STREAM_STAGE_BYTES)
  split, mesh = _split(leaves)
  # The rule the steps run (its static zeros left out) decides which kernels implement it.
  stepped, kernel = rule.without(static_zeros), options.execution.kernel
  routes = {(where, fused): kernels_for(kernel, fused=fused, runs_on=where, split=split, rule=stepped,
                                        packed=storage.state_layout == "packed")
            for where in dict.fromkeys(leaf.runs_on for leaf in leaves) for fused in (False, True)}
  return Plan(tuple(leaves), fields=tuple(rule.fields), owner=owner, static_zeros=static_zeros,
              kernel=kernel, split=split, mesh=mesh, master=master, decay_mode=rule.decay, kernels=routes)


def state_bytes(leaf: LeafPlan, shape: Sequence[int]) -> int:
  """Bytes of a leaf's state that a step moves: every field of the rule, and what its master keeps, if any."""
  n = int(np.prod(shape))
  master = 0 if leaf.master_dtype is None else n * np.dtype(leaf.master_dtype).itemsize
  return sum(leaf.moments.nbytes(shape, d) for d in leaf.dtypes) + master


def field_dtypes(param_dtype: Any, rule: Any, storage: Any, path: Any, owner: str) -> tuple:
  """The storage dtype of each of ``rule``'s fields for a param of ``param_dtype`` (8-bit: their values' dtype).

  ``moment_format`` sets every field; else each field's own dtype argument,
  else the param's dtype (its real counterpart for a real field).

  Raises:
    ValueError: for a real dtype asked for a complex param's field, or a complex one for a real field.
  """
  complex_param = jnp.issubdtype(param_dtype, jnp.complexfloating)
  real_param_dtype = jnp.finfo(param_dtype).dtype if complex_param else param_dtype
  out = []
  for field, asked in zip(rule.fields, rule.field_dtypes):
    if storage.moment_format is not None:
      form = storage.moments  # a format that encodes the values names their dtype; else a dtype name
      asked = np.dtype(form.value_dtype if form.value_dtype is not None else
                       storage.moment_format if isinstance(storage.moment_format, str) else jnp.float32)
      if complex_param and not field.real:
        asked = jnp.result_type(asked, jnp.complex64)
    dtype = np.dtype((real_param_dtype if field.real else param_dtype) if asked is None else asked)
    argument = field.dtype_argument or "moment_format"
    if complex_param and not field.real and not jnp.issubdtype(dtype, jnp.complexfloating):
      raise ValueError(f"{owner}: `{argument}`={dtype} cannot hold `{field.name}` of the complex param "
                       f"{jax.tree_util.keystr(path) or '<root>'} ({np.dtype(param_dtype)}): stored there it would "
                       f"lose its imaginary part (Optax casts it so); use a complex {argument} or None.")
    if field.real and jnp.issubdtype(dtype, jnp.complexfloating):
      raise ValueError(f"{owner}: `{argument}`={dtype} must be real: `{field.name}` holds real values "
                       "(sums of |g|^2) even for complex params.")
    out.append(dtype)
  return tuple(out)


def _last_axis_shards(sharding: Any, ndim: int) -> int:
  """Into how many shards a state sharding splits a leaf's last axis (1: unsharded or single-device)."""
  spec = () if sharding is None else tuple(sharding.spec)
  if ndim == 0 or len(spec) < ndim or spec[ndim - 1] is None:
    return 1
  entry = spec[ndim - 1]
  axes = entry if isinstance(entry, tuple) else (entry,)
  return int(np.prod([sharding.mesh.shape[a] for a in axes]))


def assign_stages(leaves: Sequence[LeafPlan], shapes: Sequence[Sequence[int]],
                  budget: int = STREAM_STAGE_BYTES) -> list[LeafPlan]:
  """Numbers the streamed leaves' stages: consecutive leaves (per place) up to ``budget`` state bytes each."""
  out, filled, stage = list(leaves), {}, {}
  for i, (leaf, shape) in enumerate(zip(leaves, shapes)):
    if not leaf.streamed:
      continue
    size, where = state_bytes(leaf, shape), leaf.runs_on
    if where not in stage:
      stage[where], filled[where] = 0, 0
    elif filled[where] and filled[where] + size > budget:
      stage[where], filled[where] = stage[where] + 1, 0
    filled[where] += size
    out[i] = dataclasses.replace(leaf, stage=stage[where])
  return out


def assign_slices(leaves: Sequence[LeafPlan], shapes: Sequence[Sequence[int]],
                  budget: int = STREAM_STAGE_BYTES) -> list[LeafPlan]:
  """Sets :attr:`LeafPlan.slice_rows` for the ``host_state`` leaves whose state is larger than ``budget``.

  Such a leaf (a stacked layer's weights, a large embedding) is a stage of
  its own (:func:`assign_stages`), and crossing whole it would be staged
  whole on the device. Its rows along the first axis cross instead, the
  largest number that divides the axis (every slice the same shape: one loop
  body) and holds at most ``budget`` bytes of state, at least one row. Only a
  leaf of two or more axes is cut (its 8-bit blocks lie along the last axis,
  so a slice of rows is whole blocks), and a leaf split over a mesh only if
  every device holds its first axis whole (each device then stages its
  share of the rows; the budget counts that share).
  """
  out = list(leaves)
  for i, (leaf, shape) in enumerate(zip(leaves, shapes)):
    sharding = leaf.state_sharding
    if (not tiers_lib.BY_NAME[leaf.tier].crosses_in_slices or len(shape) < 2 or shape[0] < 2
        or tiers_lib.whole_leading_axes(sharding, len(shape)) < 1):
      continue
    share = lambda rows: tuple(sharding.shard_shape((rows, *shape[1:]))) if sharding else (rows, *shape[1:])
    if state_bytes(leaf, share(shape[0])) <= budget:
      continue
    fits = [d for d in range(1, shape[0] + 1)
            if shape[0] % d == 0 and state_bytes(leaf, share(d)) <= budget]
    out[i] = dataclasses.replace(leaf, slice_rows=max(fits, default=1))
  return out


def _split(leaves: Sequence[LeafPlan]) -> tuple[str, Any]:
  """How a single-device custom kernel runs over these leaves (see :class:`Plan`), on the device or the host.

  Read from the leaves' placements alone (never the process's device count):
  the same placed params get the same split in any process.
  """
  if all(leaf.on_one_device for leaf in leaves):
    return "direct", None
  if any(leaf.state_sharding is None for leaf in leaves):  # unseen, or mixed with one-device leaves
    return "xla", None
  meshes = {leaf.state_sharding.mesh for leaf in leaves}
  return ("shard_map", meshes.pop()) if len(meshes) == 1 else ("xla", None)


def check_inexact_leaves(tree: Any, what: str, owner: str) -> None:
  """Raises a TypeError naming the first integer or boolean leaf of ``tree``."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    dtype = jnp.result_type(leaf) if not hasattr(leaf, "dtype") else leaf.dtype
    if not jnp.issubdtype(dtype, jnp.inexact):  # floating or complex
      raise inexact_leaf_error(what, jax.tree_util.keystr(path) or "<root>", dtype, owner)


def inexact_leaf_error(what: str, path: str, dtype: Any, owner: str) -> TypeError:
  """The error for an integer or boolean leaf at ``path`` of the ``what`` (``"params"``, ``"gradient"``)."""
  return TypeError(
      f"{owner}: {what} leaf {path} has "
      f"dtype {dtype}; only floating-point and complex leaves can be "
      "optimized. Keep integer and boolean leaves out of the optimized tree "
      "(for example with optax.masked or nnx.Optimizer(..., wrt=nnx.Param))."
  )


def mask_leaves(mask: Any, params: Any, treedef: Any, owner: str) -> list[bool]:
  """One bool per params leaf: does the leaf take weight decay?"""
  if mask is None:
    return [True] * treedef.num_leaves
  if callable(mask):
    mask = mask(params)
  try:
    # A mask may be a prefix of the params tree: one bool for a whole subtree.
    leaves = treedef.flatten_up_to(
        jax.tree.map(
            lambda m, sub: jax.tree.map(lambda _: m, sub),
            mask,
            treedef.unflatten([0] * treedef.num_leaves),
        )
    )
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"{owner}: `mask` must have the tree structure of the params (or "
        f"be a prefix of it) with bool leaves; params: {treedef}, mask: "
        f"{jax.tree.structure(mask)}."
    ) from e
  out = []
  for leaf in leaves:
    if isinstance(leaf, jax.Array):  # traced, or computed from the values init saw
      raise TypeError(
          f"{owner}: `mask` leaves must be concrete bools, not arrays computed "
          "from the params; compute the mask from the params' structure, not their "
          "values (it is resolved once, by init)."
      )
    if np.ndim(leaf) != 0 or np.asarray(leaf).dtype != np.bool_:
      raise TypeError(
          f"{owner}: `mask` leaves must be bools, got {leaf!r}."
      )
    out.append(bool(leaf))
  return out
