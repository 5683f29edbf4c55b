"""The packed state layout (``state_layout="packed"``): every leaf's state in a few flat buffers.

With the default layout, ``"leaves"``, each params-shaped attribute of the
state (the rule's fields, their 8-bit scales, ``master``) holds one array per
param leaf: the Optax contract. A jitted step takes and returns each of them
as a buffer of its own, and the runtime's cost per buffer (argument checks,
donation, a result array per output: a few microseconds each on a CPU) adds up
on trees of many small leaves: Adam on 1024 leaves takes 4,098 buffers in and
returns 3,074. With ``"packed"`` each such attribute holds a dict of a few
1-D arrays, *pools*, one per storage dtype (and per master format of the
leaves stepped together), and every leaf's array is a static slice of one of
them (:class:`Layout`, made once by ``init``): Adam on the same tree then
takes 2,052 buffers in and returns 1,028, the params' and gradients' and four
of its own.

``state.mu == {"float32": Array(16777216,)}``: the pools are keyed by dtype
name (``"float32 with float32 master"`` for the leaves stepped through a
master format, which run as a group of their own). The native CPU kernel steps
the leaves in place inside the pools (:mod:`optax_hybrid.kernels.packed`);
the XLA rule reads slices and its new values are concatenated back.

What it gives up (the default keeps all of it):

* The state is not params-shaped: ``optax.tree_utils.tree_map_params`` sees
  the pools as non-params state (``transform_non_params`` maps them), and a
  sharding per leaf cannot be expressed: one CPU device only, the ``device``
  tier only (no host, disk or ZeRO-1 placement, no fractions).
* :func:`optax_hybrid.moment_values` still returns params-shaped trees; a
  checkpoint restores into a state of the same layout (not across layouts);
  ``tx.begin_step`` (a step in parts) needs the leaves layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from optax_hybrid import flat_buffers, placement, tiers as tiers_lib
from optax_hybrid.kernels.packed import PackedSlice, is_packed
from optax_hybrid.plan import Plan, keeps


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where every leaf's state is in the pools: static, made once by :func:`make_layout`.

  Attributes:
    treedef: the params' tree structure (the state no longer shows it).
    pools: per params-shaped attribute (in the state's order), its pools as
      ``(key, dtype name, size)``.
    slots: per attribute, one :class:`optax_hybrid.flat_buffers.Slot` per
      leaf, its buffer the pool's key (None where the leaf keeps nothing
      there: no master, no 8-bit scales).
  """

  treedef: Any = None
  pools: tuple = ()
  slots: tuple = ()

  # What the engine asks of a layout (optax_hybrid.layouts): its name, its values are slices of flat buffers, and
  # why a step in parts (each leaf's arrays stepped in place) cannot step them.
  name = "packed"
  packed = True
  in_parts_why = "this state is packed"

  def laid_out(self, plan: Plan, params: Any, attributes: Sequence[str]) -> "Layout":
    """The layout of ``params``' state: :func:`make_layout`."""
    return make_layout(plan, params, attributes)

  def state_fields(self, plan: Plan, treedef: Any, arrays: dict[str, list]) -> dict[str, Any]:
    """``init``: each attribute's pools from one array per leaf (:func:`pack`)."""
    del treedef
    return {name: pack(plan, name, values) for name, values in arrays.items()}

  def params_treedef(self, state: Any, plan: Plan) -> Any:
    del state, plan
    return self.treedef

  def read(self, state: Any, plan: Plan, treedef: Any) -> tuple[Any, list[tuple], list]:
    """``(treedef, each leaf's field values as slices of the pools, each leaf's master slice or None)``.

    Raises:
      ValueError: where the gradients' ``treedef`` is not the params' at init, or the state's pools are not
        this layout's.
    """
    if treedef != self.treedef:
      raise ValueError(f"{plan.owner}: the gradients' tree structure does not match the optimizer state's; "
                       f"gradients: {treedef}, params at init: {self.treedef}. Pass gradients for the same "
                       "params tree the state was initialized with.")
    return (treedef, *leaf_state(state, plan))

  def written(self, state: Any, plan: Plan, treedef: Any, new: dict[str, list]) -> dict[str, Any]:
    """A step's new pools from each leaf's new arrays (:func:`repacked`)."""
    del state, treedef
    return {name: repacked(plan, name, new[name]) for name in self.attributes}

  def pools_of(self, attribute: str) -> tuple:
    return dict(self.pools)[attribute]

  def slots_of(self, attribute: str) -> tuple:
    return dict(self.slots)[attribute]

  @property
  def attributes(self) -> tuple[str, ...]:
    return tuple(name for name, _ in self.pools)


def _array(plan: Plan, i: int, attribute: str, shape: tuple) -> tuple[tuple, np.dtype]:
  """The shape and dtype of what leaf ``i`` (of ``shape``) keeps in ``attribute``: an array of a field in its
  moment format (8-bit codes or scales), or its master."""
  lp = plan.leaves[i]
  if attribute == "master":
    return shape, np.dtype(lp.master_dtype)
  for k, name in enumerate(plan.field_names):
    for suffix, array_shape, dtype in lp.moments.arrays(shape, lp.dtypes[k]):
      if name + suffix == attribute:
        return tuple(array_shape), np.dtype(dtype)
  raise ValueError(f"{plan.owner}: {lp.path} keeps no {attribute!r}")  # keeps() says which it keeps


def _pool_key(dtype: np.dtype, lp: Any) -> str:
  """The pool of a leaf's array of ``dtype``: per dtype, master format, and complex params apart.

  The leaves of a master format run as a group of their own (one chain of
  kernel calls per pool), and a complex param's real fields (Adam's ``nu``)
  are stepped by the XLA rule, not the native kernel, so they do not share a
  pool that the kernel updates in place (XLA would copy it for their reads).
  """
  key = dtype.name
  if lp.master.active:
    key += f" with {lp.master.name} master"
  if jnp.issubdtype(lp.param_dtype, jnp.complexfloating) and not jnp.issubdtype(dtype, jnp.complexfloating):
    key += f" of {np.dtype(lp.param_dtype).name} params"
  return key


def make_layout(plan: Plan, params: Any, attributes: Sequence[str]) -> Layout:
  """Checks that every leaf can be packed and lays out ``attributes`` of the state, leaf after leaf.

  Raises:
    ValueError: for a leaf outside the device tier, on several devices or on
      a device that is not a CPU, naming it and the fix; for the Pallas kernel.
  """
  if plan.kernel == "pallas":
    raise ValueError(f"{plan.owner}: state_layout='packed' is a CPU layout; kernel='pallas' is the GPU kernel. Use "
                     "kernel='auto', 'native' or 'xla', or keep state_layout='leaves' (the default).")
  params, treedef = jax.tree.flatten(params)
  for lp, p in zip(plan.leaves, params):
    _check_packable(plan, lp, p)
  pools, slots = [], []
  for attribute in attributes:
    arrays = [_array(plan, i, attribute, tuple(np.shape(p))) if keeps(lp, attribute) else None
              for i, (lp, p) in enumerate(zip(plan.leaves, params))]
    keys = [None if a is None else _pool_key(a[1], lp) for a, lp in zip(arrays, plan.leaves)]
    leaf_slots, sizes = flat_buffers.lay_out([lp.path for lp in plan.leaves], keys,
                                             [() if a is None else a[0] for a in arrays])
    dtypes = {k: a[1].name for k, a in zip(keys, arrays) if k is not None}
    pools.append((attribute, tuple((k, dtypes[k], n) for k, n in sizes.items())))
    slots.append((attribute, leaf_slots))
  return Layout(treedef, tuple(pools), tuple(slots))


def _check_packable(plan: Plan, lp: Any, param: Any) -> None:
  owner, fix = plan.owner, "or keep state_layout='leaves' (the default)"
  if not tiers_lib.BY_NAME[lp.tier].packable or lp.state_space != placement.space_of_kind(placement.DEVICE_KIND):
    raise ValueError(f"{owner}: state_layout='packed' keeps the state in device memory; {lp.path} is in the "
                     f"{lp.tier!r} tier with its state in {lp.state_kind!r}. Use the device tier, {fix}.")
  devices = placement.devices_of(param)
  if plan.split != "direct" or not lp.on_one_device or len(devices) != 1:
    raise ValueError(f"{owner}: state_layout='packed' packs the state of one device; {lp.path} is placed on "
                     f"{len(devices)} devices (or its placement is unseen: traced on a mesh). Step sharded params {fix}.")
  if devices[0].platform != "cpu":
    raise ValueError(f"{owner}: state_layout='packed' is a CPU layout (its kernel is the native CPU kernel); "
                     f"{lp.path} is on a {devices[0].platform} device. On a GPU {fix}: one Pallas launch "
                     "steps 64 leaves there.")


def pack(plan: Plan, attribute: str, arrays: Sequence[Any]) -> dict[str, Any]:
  """``{key: pool}`` of ``attribute`` from one array per leaf (``init``'s values; ignored where it keeps none)."""
  slots = plan.layout.slots_of(attribute)
  out = {}
  for key, dtype, size in plan.layout.pools_of(attribute):
    members = [x for x, slot in zip(arrays, slots) if slot is not None and slot.buffer == key]
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in members):
      out[key] = jax.ShapeDtypeStruct((size,), np.dtype(dtype), sharding=getattr(members[0], "sharding", None))
    else:
      out[key] = jnp.concatenate([jnp.ravel(x) for x in members]) if members else jnp.zeros((0,), dtype)
  return out


def _pools(state: Any, plan: Plan, attribute: str) -> dict[str, Any]:
  """The state's pools of ``attribute``, checked against the layout."""
  got = getattr(state, attribute)
  wanted = plan.layout.pools_of(attribute)
  if not isinstance(got, dict) or set(got) != {k for k, _, _ in wanted} or any(
      tuple(got[k].shape) != (n,) or np.dtype(got[k].dtype) != np.dtype(d) for k, d, n in wanted):
    described = {k: f"{d}[{n}]" for k, d, n in wanted}
    raise ValueError(f"{plan.owner}: state.{attribute} does not hold the packed layout its plan describes "
                     f"({described}); make the state with this optimizer's init (state_layout='packed').")
  return got


def leaf_state(state: Any, plan: Plan) -> tuple[list[tuple], list[Any]]:
  """Each leaf's field values as slices of the pools (8-bit: codes and scales), and its master's (or None)."""
  names = plan.field_names
  values = {}
  for attribute in plan.layout.attributes:
    pools = _pools(state, plan, attribute)
    values[attribute] = [None if slot is None else
                         PackedSlice(pools[slot.buffer], (attribute, slot.buffer), slot.offset, slot.shape)
                         for slot in plan.layout.slots_of(attribute)]
  fields = [lp.moments.stored_fields([[values[n + suffix][i] for suffix in lp.moments.attribute_suffixes]
                                      for n in names]) for i, lp in enumerate(plan.leaves)]
  return fields, values.get("master", [None] * len(plan.leaves))


def repacked(plan: Plan, attribute: str, values: Sequence[Any]) -> dict[str, Any]:
  """``attribute``'s new pools from each leaf's new value (a slice of a new pool, or an array; None: keeps none).

  A kernel that stepped leaves in their pools returns slices of its last
  pools: those are the new pools, with the values that another kernel
  returned as arrays written into them (in place). A pool whose leaves were
  all stepped by a kernel without pools is their values concatenated.
  """
  slots = plan.layout.slots_of(attribute)
  out = {}
  for key, _, _ in plan.layout.pools_of(attribute):
    members = [(slot, x) for slot, x in zip(slots, values) if slot is not None and slot.buffer == key]
    stepped = [x.pool for _, x in members if is_packed(x)]
    if not stepped:
      out[key] = jnp.concatenate([jnp.ravel(x) for _, x in members])
      continue
    pool = stepped[-1]
    for slot, x in members:
      if not is_packed(x):
        pool = jax.lax.dynamic_update_slice(pool, jnp.ravel(x).astype(pool.dtype), (slot.offset,))
    out[key] = pool
  return out


#: ``state_layout="packed"``, before ``init`` lays out the params (:meth:`Layout.laid_out`).
PACKED = Layout()

__all__ = ["Layout", "PACKED", "leaf_state", "make_layout", "pack", "repacked"]
