"""Where training memory went: params, gradients and optimizer state, device against host.

Serving a model takes its weights (2 bytes each in bf16); training it with AdamW
takes about 16 per weight. :func:`memory_report` accounts for those bytes leaf
by leaf, in the memory each array actually lives in (device memory, host
memory, or the disk tier's files), so that the effect of
``state_memory_kind="pinned_host"`` (or of host-resident params) can be read off
as numbers rather than estimated.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import jax
import numpy as np

from optax_hybrid import _compat, moments, tiers as tiers_lib
from optax_hybrid.base import is_state
from optax_hybrid.disk import DiskMoment
from optax_hybrid.paths import path_name, path_names
from optax_hybrid.plan import Plan
from optax_hybrid.transform import params_shaped_fields

DEVICE, HOST, DISK = "device", "host", "disk"
MEMORIES = (DEVICE, HOST, DISK)
OTHER_STATE = "other_state"
COMPONENTS = ("params", "gradients", "moments", "master_weights", "other_state")
# A rule's state fields shaped like the params are the state attached to each
# param: the rule's fields (Adam's mu and nu...) count as "moments", "master"
# (an fp32 copy of low-precision params, or their Kahan terms, where the optimizer keeps one) as
# "master_weights"; an empty entry stands where a leaf keeps nothing, as for
# the fields of disk-tier leaves, whose values are the plan's files. 8-bit
# fields keep their codes in the field and their per-block scales, shaped
# otherwise, in "<field>_scales".
def _component(field: str) -> str:
  return "master_weights" if field == "master" else "moments"


@dataclasses.dataclass(frozen=True)
class LeafMemory:
  """One parameter leaf's share of training memory.

  Attributes:
    path: the leaf's ``'/'``-joined path (:func:`optax_hybrid.recipe.path_name`).
    tier: ``"device"``, ``"host_state"``, ``"host"`` or ``"disk"`` (see
      :func:`memory_report`).
    shape: the param's shape.
    dtype: the param's dtype name.
    param_memory: ``"device"`` or ``"host"``: where the param (and so, by the
      report's convention, its gradient) lives.
    param_bytes: bytes of the param (global, over all shards).
    state: ``{"device": bytes, "host": bytes, "disk": bytes}`` of the
      optimizer state attached to this param (the rule's moments, and a master
      copy where the optimizer keeps one), from every ``hybrid_*`` state in the
      state.
  """

  path: str
  tier: str
  shape: tuple
  dtype: str
  param_memory: str
  param_bytes: int
  state: dict


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Bytes of params, gradients and optimizer state, by tier and by memory. Made by :func:`memory_report`.

  Every byte count is global (a sharded array counts once, whatever its
  number of shards) and every ``{"device": ..., "host": ..., "disk": ...}``
  dict splits bytes by where they live: device memory, host memory, or the
  files of the disk tier. ``str(report)`` prints a table.

  Attributes:
    num_params: the number of weights (elements of all param leaves).
    num_leaves: the number of param leaves.
    num_leaves_without_state: param leaves no ``hybrid_*`` state holds state
      for (frozen, or optimized by another transform).
    weights_by_tier: tier -> number of weights.
    by_tier: ``"device"``, ``"host_state"``, ``"host"``, ``"disk"`` (every
      tier of :data:`optax_hybrid.tiers.BY_NAME`) and ``"other_state"`` ->
      bytes by memory; a tier counts its params, their
      gradients and their attached state; the rows add up to the totals.
    by_component: ``"params"``, ``"gradients"``, ``"moments"`` (Adam's ``mu``
      and ``nu``), ``"master_weights"`` (master copies kept by the optimizer),
      ``"other_state"`` -> bytes by memory.
    device_bytes: all bytes in device memory.
    host_bytes: all bytes in host memory (``pinned_host``/``unpinned_host``).
    disk_bytes: all bytes in the disk tier's files.
    bytes_per_weight_device: ``device_bytes / num_params``.
    bytes_per_weight_host: ``host_bytes / num_params``.
    bytes_per_weight_disk: ``disk_bytes / num_params``.
    saved_device_bytes: device bytes if everything were in device memory,
      minus the actual ones: the bytes offloading moved off the device (every
      byte in host memory or on disk would otherwise be on it, so this is
      ``host_bytes + disk_bytes``).
    serving_bytes: the params alone, what serving the model takes.
    serving_bytes_per_weight: ``serving_bytes / num_params``.
    device_bytes_per_device: device id -> bytes in that device's memory
      (the shards it holds; replicated arrays count on every device holding
      a copy), what decides whether a device runs out of memory.
    leaves: one :class:`LeafMemory` per param leaf, in tree order.
  """

  num_params: int
  num_leaves: int
  num_leaves_without_state: int
  weights_by_tier: dict
  by_tier: dict
  by_component: dict
  device_bytes: int
  host_bytes: int
  disk_bytes: int
  bytes_per_weight_device: float
  bytes_per_weight_host: float
  bytes_per_weight_disk: float
  saved_device_bytes: int
  serving_bytes: int
  serving_bytes_per_weight: float
  device_bytes_per_device: dict
  leaves: tuple

  @property
  def total_bytes(self) -> int:
    """All bytes, wherever they live."""
    return self.device_bytes + self.host_bytes + self.disk_bytes

  def __str__(self) -> str:
    # The disk column and tier only when the disk tier is in use.
    memories = MEMORIES if self.disk_bytes or self.weights_by_tier[DISK] else (DEVICE, HOST)
    row = lambda label, split: (label, *(_human(split[m]) for m in memories))
    table = [("", *(f"{m} memory" if m != DISK else "disk" for m in memories))]
    for tier in (t for t in tiers_lib.BY_NAME if DISK in memories or t != tiers_lib.DISK_TIER):
      table.append(row(f"{tier} tier ({self.weights_by_tier[tier]:,} weights)", self.by_tier[tier]))
    table += [row("other state", self.by_tier[OTHER_STATE]), None]
    names = {"params": "params", "gradients": "gradients (1 per param)", "moments": "optimizer moments",
             "master_weights": "master weights", "other_state": "other state"}
    for component in COMPONENTS:
      table.append(row(names[component], self.by_component[component]))
    totals = {DEVICE: self.device_bytes, HOST: self.host_bytes, DISK: self.disk_bytes}
    table.append(row("total", totals))
    per_weight = {DEVICE: self.bytes_per_weight_device, HOST: self.bytes_per_weight_host,
                  DISK: self.bytes_per_weight_disk}
    table.append(("bytes per weight", *(f"{per_weight[m]:.2f}" for m in memories)))
    if len(self.device_bytes_per_device) > 1:
      device, most = max(self.device_bytes_per_device.items(), key=lambda kv: kv[1])
      table.append((f"largest on one device (id {device})", _human(most), *("-" for _ in memories[1:])))
    width = max(len(r[0]) for r in table if r) + 2
    leaves = "leaf" if self.num_leaves == 1 else "leaves"
    lines = [f"Training memory: {self.num_params:,} weights in {self.num_leaves} param {leaves} "
             f"({self.num_leaves_without_state} without optimizer state)", ""]
    lines += ["" if r is None else f"  {r[0]:<{width}}" + "".join(f"{c:>14}" for c in r[1:]) for r in table]
    lines.append("")
    if self.saved_device_bytes:
      share = self.saved_device_bytes / self.total_bytes
      lines.append(
          f"Offloading saved {_human(self.saved_device_bytes)} of device memory "
          f"({share:.0%} of the {_human(self.total_bytes)} it would take on the device alone).")
    else:
      lines.append("Nothing is offloaded: everything is in device memory.")
    lines.append(
        f"Serving takes the params alone: {_human(self.serving_bytes)}, "
        f"{self.serving_bytes_per_weight:.2f} bytes per weight.")
    return "\n".join(lines)


def _human(n: int) -> str:
  value = float(n)
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(value) < 1024 or unit == "TiB":
      return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
    value /= 1024
  raise AssertionError("unreachable")


def _split() -> dict:
  return dict.fromkeys(MEMORIES, 0)


class _Placed:
  """Global bytes, memory and per-device shard bytes of one array or ShapeDtypeStruct."""

  def __init__(self, x: Any, what: str, *, numpy_ok: bool):
    if isinstance(x, _compat.Tracer):
      raise TypeError(
          f"memory_report: {what} is a traced value; call memory_report outside jit, "
          "on concrete arrays (or jax.ShapeDtypeStructs with shardings): it reads "
          "where each array lives from its sharding."
      )
    if isinstance(x, DiskMoment):
      self.shape, self.dtype, self.sharding, self.memory = tuple(x.shape), np.dtype(x.dtype), None, DISK
    elif isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
      self.shape, self.dtype = tuple(x.shape), np.dtype(x.dtype)
      self.sharding = getattr(x, "sharding", None)
      kind = getattr(self.sharding, "memory_kind", None)
      # A sharding without a memory kind is in the backend's default memory.
      self.memory = HOST if _compat.is_host_kind(kind) else DEVICE
    elif numpy_ok and isinstance(x, (np.ndarray, np.generic, int, float, complex)):
      # NumPy arrays and Python numbers in a state live in process memory.
      x = np.asarray(x)
      self.shape, self.dtype, self.sharding, self.memory = x.shape, x.dtype, None, HOST
    else:
      raise TypeError(
          f"memory_report: {what} is a {type(x).__name__}, not a jax.Array; pass "
          "arrays placed where they train (jax.device_put) or jax.ShapeDtypeStructs "
          "with shardings."
      )
    self.size = math.prod(self.shape)
    self.nbytes = self.size * self.dtype.itemsize

  def per_device(self) -> dict:
    """Device id -> bytes of the shards that device holds (device memory only)."""
    if self.memory != DEVICE:
      return {}
    if self.sharding is None:
      return {jax.devices()[0].id: self.nbytes}
    out = {}
    for device, index in self.sharding.addressable_devices_indices_map(self.shape).items():
      size = math.prod(len(range(*s.indices(d))) for s, d in zip(index, self.shape))
      out[device.id] = out.get(device.id, 0) + size * self.dtype.itemsize
    return out


def _packed_slices(key_path: Any, node: Any, plan: Plan):
  """A packed state's (``state_layout="packed"``) arrays, one per leaf and field: each a slice of a flat buffer.

  Yields ``(where, param path, _Placed of the slice, field)``; the slices of
  a buffer add up to it (its bytes, its memory, its device).
  """
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(
      plan.layout.treedef.unflatten([0] * plan.layout.treedef.num_leaves))[0]]
  for field in plan.layout.attributes:
    pools = getattr(node, field)
    for sub_path, slot in zip(paths, plan.layout.slots_of(field)):
      if slot is None:
        continue
      where = f"opt_state{jax.tree_util.keystr(key_path)}.{field}[{slot.buffer!r}] slice of {path_name(sub_path)!r}"
      placed = copy.copy(_Placed(pools[slot.buffer], where, numpy_ok=True))
      placed.shape, placed.size = slot.shape, slot.size
      placed.nbytes = slot.size * placed.dtype.itemsize
      if placed.sharding is not None and len(placed.sharding.device_set) != 1:
        raise ValueError(f"memory_report: {where}: a packed state lives on one device.")
      yield where, sub_path, placed, field


class _Tally:
  """The bytes :func:`memory_report` counts, as it walks the params and then every state in ``opt_state``.

  Per param leaf: its placement, the bytes of state attached to it by memory
  (``attached``), whether any state is (``has_state``), and the tier a plan
  names for it (``planned``); over all leaves: bytes by component and by
  memory, and device bytes per device.
  """

  def __init__(self, params: Any):
    self.param_entries = jax.tree_util.tree_leaves_with_path(params)
    # A NumPy param has no placement yet: where it trains is not known.
    self.placed_params = [_Placed(leaf, f"params leaf {path_name(key_path)!r}", numpy_ok=False)
                          for key_path, leaf in self.param_entries]
    self.index = {path_names(key_path): i for i, (key_path, _) in enumerate(self.param_entries)}
    self.attached = [_split() for _ in self.param_entries]
    self.has_state = [False] * len(self.param_entries)
    self.planned = [None] * len(self.param_entries)
    self.by_component = {c: _split() for c in COMPONENTS}
    self.per_device: dict = {}

  def add_device_shards(self, placed: _Placed) -> None:
    for device, nbytes in placed.per_device().items():
      self.per_device[device] = self.per_device.get(device, 0) + nbytes

  def add_other(self, key_path: Any, leaf: Any) -> None:
    placed = _Placed(leaf, f"opt_state{jax.tree_util.keystr(key_path)}", numpy_ok=True)
    self.by_component[OTHER_STATE][placed.memory] += placed.nbytes
    self.add_device_shards(placed)

  def param_index(self, where: str, sub_path: Any, placed: _Placed, params_shaped: bool = True) -> int:
    i = self.index.get(path_names(sub_path))
    if i is None:
      raise ValueError(
          f"memory_report: {where} matches no params leaf; pass the params tree "
          "the optimizer state was initialized with."
      )
    if params_shaped and placed.shape != self.placed_params[i].shape:
      raise ValueError(
          f"memory_report: {where} has shape {placed.shape} but its param has "
          f"shape {self.placed_params[i].shape}; pass the params the optimizer state "
          "was initialized with."
      )
    return i

  def attach(self, where: str, sub_path: Any, placed: _Placed, field: str) -> None:
    i = self.param_index(where, sub_path, placed, params_shaped=not field.endswith(moments.SUFFIXES))
    self.attached[i][placed.memory] += placed.nbytes
    self.has_state[i] = True
    self.by_component[_component(field)][placed.memory] += placed.nbytes
    self.add_device_shards(placed)

  def add_state(self, key_path: Any, node: Any) -> None:
    """One ``hybrid_*`` optimizer's state: its params-shaped fields, its other fields, its plan's files."""
    # A state that carries its placement plan (one LeafPlan per leaf, in the
    # order of its fields) names each leaf's tier, its files, and the empty
    # entries that stand where a leaf keeps nothing.
    plan = node.plan if isinstance(node.plan, Plan) else None
    shaped = params_shaped_fields(node)
    packed = plan is not None and plan.layout.packed
    for where, sub_path, placed, field in _packed_slices(key_path, node, plan) if packed else ():
      self.attach(where, sub_path, placed, field)
    trees = [getattr(node, name) for name in shaped if getattr(node, name) is not None]
    leaf_paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(trees[0])] if trees else []
    if plan is not None and len(plan.leaves) != len(leaf_paths):
      plan = None
    for field in node._fields:
      entries = jax.tree_util.tree_leaves_with_path(getattr(node, field))
      if field not in shaped or packed:
        for sub_path, leaf in entries if field not in shaped else ():
          self.add_other(key_path + sub_path, leaf)
        continue
      self.attach_field(key_path, field, entries, plan)
    if plan is not None:
      self.attach_plan_files(key_path, leaf_paths, plan)

  def attach_field(self, key_path: Any, field: str, entries: list, plan: Plan | None) -> None:
    """A params-shaped field's leaves, each to its param; an empty entry holds no bytes."""
    empty = set(plan.empty_entries(field)) if plan is not None and len(entries) == len(plan.leaves) else set()
    for j, (sub_path, leaf) in enumerate(entries):
      if j not in empty:
        where = f"opt_state{jax.tree_util.keystr(key_path)}.{field} leaf {path_name(sub_path)!r}"
        self.attach(where, sub_path, _Placed(leaf, where, numpy_ok=True), field)

  def attach_plan_files(self, key_path: Any, leaf_paths: list, plan: Plan) -> None:
    """The disk tier's files of a plan, each to its param, and the tier the plan names for each param."""
    for sub_path, leaf in zip(leaf_paths, plan.leaves):
      for field, moment in leaf.files:
        where = f"opt_state{jax.tree_util.keystr(key_path)}.plan's {field} file of {path_name(sub_path)!r}"
        self.attach(where, sub_path, _Placed(moment, where, numpy_ok=False), field)
      if leaf.tier in tiers_lib.BY_NAME:
        self.planned[self.index[path_names(sub_path)]] = leaf.tier

  def add_params_and_gradients(self) -> tuple[dict, dict, list]:
    """Each param and its gradient in its tier: returns bytes by tier, weights by tier, the leaves' rows."""
    leaves = []
    by_tier = {tier: _split() for tier in (*tiers_lib.BY_NAME, OTHER_STATE)}
    weights_by_tier = {tier: 0 for tier in tiers_lib.BY_NAME}
    for (key_path, _), placed, state, plan_tier in zip(self.param_entries, self.placed_params, self.attached,
                                                        self.planned):
      tier = _tier_of(placed, state, plan_tier)
      # The gradient is the param's twin: same bytes, same memory, same shards.
      for component in ("params", "gradients"):
        self.by_component[component][placed.memory] += placed.nbytes
        self.add_device_shards(placed)
      by_tier[tier][placed.memory] += 2 * placed.nbytes
      for memory in MEMORIES:
        by_tier[tier][memory] += state[memory]
      weights_by_tier[tier] += placed.size
      leaves.append(LeafMemory(path_name(key_path), tier, placed.shape, placed.dtype.name,
                               placed.memory, placed.nbytes, state))
    by_tier[OTHER_STATE] = dict(self.by_component[OTHER_STATE])
    return by_tier, weights_by_tier, leaves

  def report(self) -> MemoryReport:
    by_tier, weights_by_tier, leaves = self.add_params_and_gradients()
    totals = {m: sum(split[m] for split in self.by_component.values()) for m in MEMORIES}
    num_params = sum(p.size for p in self.placed_params)
    per_weight = lambda n: n / num_params if num_params else 0.0
    serving = sum(self.by_component["params"].values())
    return MemoryReport(
        num_params=num_params,
        num_leaves=len(self.placed_params),
        num_leaves_without_state=self.has_state.count(False),
        weights_by_tier=weights_by_tier,
        by_tier=by_tier,
        by_component=self.by_component,
        device_bytes=totals[DEVICE],
        host_bytes=totals[HOST],
        disk_bytes=totals[DISK],
        bytes_per_weight_device=per_weight(totals[DEVICE]),
        bytes_per_weight_host=per_weight(totals[HOST]),
        bytes_per_weight_disk=per_weight(totals[DISK]),
        saved_device_bytes=totals[HOST] + totals[DISK],
        serving_bytes=serving,
        serving_bytes_per_weight=per_weight(serving),
        device_bytes_per_device=dict(sorted(self.per_device.items())),
        leaves=tuple(leaves),
    )


def _tier_of(placed: _Placed, state: dict, plan_tier: str | None) -> str:
  """A param's tier: where it lives, else what its plan names, else where its state lives."""
  if placed.memory == HOST:
    return "host"
  if plan_tier is not None:
    return plan_tier
  if state[DISK]:
    return "disk"
  if state[HOST]:
    return "host_state"
  return "device"


def memory_report(params: Any, opt_state: Any) -> MemoryReport:
  """Accounts for the memory of training: params, gradients and optimizer state, device against host.

  Each param leaf is put in one tier:

  * ``"device"``: the param and its optimizer state (Adam's moments, Lion's
    momentum...) in device memory (or no state: a frozen param);
  * ``"host_state"``: the param in device memory, its moments in host memory
    (``state_memory_kind="pinned_host"``);
  * ``"host"``: the param itself in host memory;
  * ``"disk"``: the moments in the disk tier's files.

  A state that carries its placement plan (``hybrid_adamw(state_memory_kind=...)``, one
  tier per leaf) names the tiers of the device-resident params it covers; its
  ``"host"`` tier also covers device params updated on the host.

  Each param is counted with its gradient and its attached optimizer state.
  Gradients are not part of
  the state, so the report assumes what a training step holds: **one
  gradient per param leaf, in the param's dtype and in the param's memory**
  (frozen params included, as ``jax.grad`` over the whole tree gives them
  one). The attached state is the rule's fields (``mu`` and ``nu`` for
  :func:`optax_hybrid.hybrid_adamw`; ``mu`` for ``hybrid_lion``...) and the
  ``master`` copy, where kept, of every ``hybrid_*`` optimizer's state found anywhere
  in ``opt_state`` (inside ``optax.chain``, ``optax.MultiSteps``,
  ``optax.masked``, ``optax.multi_transform``,
  :func:`optax_hybrid.recipe.standard_optimizer`, ``nnx.Optimizer.opt_state``),
  matched to params by tree path. All other state arrays (step counts,
  ``MultiSteps`` gradient accumulators, other transforms' state, the state of
  optimizers other than ``optax_hybrid``'s) form the ``"other_state"`` row.

  Each array's memory is read from its ``sharding.memory_kind``:
  ``pinned_host`` and ``unpinned_host`` are host memory; anything else,
  including ``None`` (the backend's default), is device memory; disk-tier
  moments count in ``"disk"``. Sharded arrays count their global bytes;
  ``device_bytes_per_device`` has what each device holds.

  Args:
    params: the params the optimizer state was initialized with: concrete
      ``jax.Array`` leaves (or ``jax.ShapeDtypeStruct`` with shardings, to plan
      before allocating), any pytree (``nnx.state(model, nnx.Param)`` too).
    opt_state: the optimizer state, e.g. ``tx.init(params)`` or
      ``nnx.Optimizer.opt_state``.

  Returns:
    A :class:`MemoryReport`; ``print(report)`` shows a table.

  Raises:
    TypeError: if a leaf is traced (call it outside ``jit``) or a param leaf
      is not an array.
    ValueError: if a moment's tree path matches no param, or its shape differs
      from the param's (the state belongs to other params).

  Example:
    >>> import jax, jax.numpy as jnp, optax_hybrid
    >>> from optax_hybrid.report import memory_report
    >>> params = jax.device_put({"w": jnp.ones((10, 100))}, jax.devices()[0])
    >>> tx = optax_hybrid.hybrid_adamw(1e-3, state_memory_kind="pinned_host")
    >>> report = memory_report(params, tx.init(params))
    >>> report.by_tier["host_state"]  # 4000 param + 4000 grad; 8000 of moments
    {'device': 8000, 'host': 8000, 'disk': 0}
    >>> report.bytes_per_weight_device, report.bytes_per_weight_host
    (8.008, 8.0)
  """
  tally = _Tally(params)
  for key_path, node in jax.tree_util.tree_leaves_with_path(opt_state, is_leaf=is_state):
    if is_state(node):
      tally.add_state(key_path, node)
    else:
      tally.add_other(key_path, node)
  return tally.report()
