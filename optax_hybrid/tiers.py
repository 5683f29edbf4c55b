"""Placement tiers: where each leaf's optimizer state lives and where its update runs.

A tier per parameter leaf, chosen once by ``init`` and carried in the state's
plan (:class:`optax_hybrid.plan.Plan`, static data, no arrays), so every later
``update`` places the work the same way without looking at the params again:

========== =================================== ==========================================
tier        moments (and fp32 master, if any)   update computed
========== =================================== ==========================================
device      device memory                       on the device (the fused kernel)
host_state  host memory (``pinned_host``)       on the device: state streamed in and out
host        host memory (``pinned_host``)       on the host CPU (XLA host compute): the
                                                gradient moves to the host and only the
                                                new parameter (or update) moves back
disk        moments in files (master in host    on the device, moments read from and
            memory)                             written to their files around the step
                                                (:mod:`optax_hybrid.disk`)
========== =================================== ==========================================

For bf16 params with an fp32 master, the ``host`` tier moves 2 bytes per
parameter to the host and 2 back per step (ZeRO-Offload's split), while
``host_state`` moves 12 each way (master and moments) but computes on the
device.

Parameters that themselves live in host memory are always updated on the
host; their tier is reported as ``host``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import jax
import numpy as np

from optax_hybrid import _compat, placement

#: The tier names, as ``tiers=`` takes them.
DEVICE_TIER, HOST_STATE_TIER, HOST_TIER, DISK_TIER = "device", "host_state", "host", "disk"
#: Every tier name.
TIERS = (DEVICE_TIER, HOST_STATE_TIER, HOST_TIER, DISK_TIER)
#: The memory kind of each tier's state in memory: the moments, or for the disk
#: tier (moments in files) the master copy.
STATE_KIND = {DEVICE_TIER: placement.DEVICE_KIND, HOST_STATE_TIER: placement.HOST_KIND,
              HOST_TIER: placement.HOST_KIND, DISK_TIER: placement.HOST_KIND}

TierSpec = Any  # None | str | Callable[[tuple, Any], str | None] | a pytree prefix of str


def check_tier_spec(spec: TierSpec, owner: str = "optax_hybrid") -> None:
  """Early validation of ``tiers`` when the optimizer is built (``owner`` names it in messages)."""
  if spec is None or callable(spec):
    return
  for leaf in jax.tree.leaves(spec):
    _check_tier(leaf, "tiers", owner)


def _check_tier(tier: Any, argument: str, owner: str) -> str:
  if not isinstance(tier, str) or tier not in TIERS:
    raise ValueError(
        f"{owner}: `{argument}`={tier!r} is not a tier; use one of "
        f"{', '.join(repr(t) for t in TIERS)} (or None for the default placement)."
    )
  return tier


def check_fraction(name: str, value: Any, owner: str = "optax_hybrid") -> float | None:
  """A fraction of params in [0, 1], or None (``owner`` names the function in messages)."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)) \
      or not 0.0 <= float(value) <= 1.0:
    raise ValueError(f"{owner}: `{name}` must be a number in [0, 1] (a fraction of the params, by "
                     f"size), got {value!r}.")
  return float(value)


def _spec_leaves(spec: TierSpec, params: Any, owner: str) -> list:
  """Per params leaf: the tier ``spec`` asks for, or None."""
  if spec is None:
    return [None] * len(jax.tree.leaves(params))
  if isinstance(spec, str):
    return [_check_tier(spec, "tiers", owner)] * len(jax.tree.leaves(params))
  if callable(spec):
    out = []
    for path, param in jax.tree_util.tree_leaves_with_path(params):
      tier = spec(path, param)
      out.append(None if tier is None else _check_tier(tier, f"tiers({jax.tree_util.keystr(path)})", owner))
    return out
  treedef = jax.tree.structure(params)
  try:
    # A prefix of the params tree: one tier for a whole subtree.
    leaves = treedef.flatten_up_to(jax.tree.map(
        lambda t, sub: jax.tree.map(lambda _: t, sub), spec, treedef.unflatten([0] * treedef.num_leaves),
        is_leaf=lambda x: x is None))
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"{owner}: `tiers` must be a tier name, a callable (path, param) -> tier, or a tree with "
        f"the structure of the params (or a prefix of it); params: {treedef}, tiers: "
        f"{jax.tree.structure(spec)}.") from e
  return [None if t is None else _check_tier(t, "tiers", owner) for t in leaves]


def pick_by_fraction(sizes: Sequence[int], fraction: float, eligible: Sequence[bool]) -> list[bool]:
  """Which leaves make up ``fraction`` of the params, by size: deterministic, in leaf order.

  Leaves are taken in the params' flattening order (``jax.tree.leaves``), and a
  leaf is taken when at least half of it falls below the target
  ``fraction * total``: the chosen size is the target rounded to the nearest
  leaf boundary, off by at most half a leaf.
  """
  total = sum(sizes)
  target = fraction * total
  taken, running = [False] * len(sizes), 0
  for i, (size, ok) in enumerate(zip(sizes, eligible)):
    if not ok:
      continue
    if running + size / 2 <= target and size > 0:
      taken[i] = True
      running += size
  return taken


def resolve(params: Any, *, tiers: TierSpec, state_memory_kind: placement.MemoryKindSpec,
            offload_fraction: float | None, nvme_offload_fraction: float | None = None,
            owner: str = "optax_hybrid") -> tuple[list[str], list[str]]:
  """Each leaf's tier and the memory kind of its in-memory state, in leaf order.

  ``tiers`` (if given) chooses the tier; otherwise ``state_memory_kind`` does
  (``"device"`` -> device, ``"pinned_host"`` -> host_state, ``None`` -> beside
  the param). ``nvme_offload_fraction`` then moves that fraction of the params
  (by size, :func:`pick_by_fraction`) to the disk tier, and ``offload_fraction``
  that fraction to the host tier, each taking leaves in order among those not
  already moved.
  """
  leaves = jax.tree.leaves(params)
  param_kinds = [placement.param_memory_kind(p) for p in leaves]
  wanted = _spec_leaves(tiers, params, owner)
  if tiers is None:
    kinds = jax.tree.leaves(placement.resolve_state_kinds(params, state_memory_kind))
  else:
    kinds = [STATE_KIND[t] if t is not None else k for t, k in zip(wanted, param_kinds)]
  names = []
  for path_leaf, want, kind, pkind in zip(jax.tree_util.tree_leaves_with_path(params), wanted, kinds, param_kinds):
    if pkind == placement.HOST_KIND and want == DISK_TIER:
      raise ValueError(
          f"{owner}: the param at {jax.tree_util.keystr(path_leaf[0])} lives in host memory, so it is "
          "updated on the host; give it the 'host' tier (its moments in pinned_host), not 'disk'.")
    if pkind == placement.HOST_KIND:
      # Computed on the host, wherever its state is; or, asked for, on the device a slice at a time.
      names.append(HOST_STATE_TIER if want == HOST_STATE_TIER else HOST_TIER)
    elif want is not None:
      names.append(want)
    else:
      names.append(DEVICE_TIER if kind == placement.DEVICE_KIND else HOST_STATE_TIER)
  sizes = [int(np.prod(np.shape(p))) for p in leaves]
  for fraction, tier in ((nvme_offload_fraction, DISK_TIER), (offload_fraction, HOST_TIER)):
    if fraction:
      movable = [n not in (HOST_TIER, DISK_TIER) and k != placement.HOST_KIND for n, k in zip(names, param_kinds)]
      for i, take in enumerate(pick_by_fraction(sizes, fraction, movable)):
        if take:
          names[i], kinds[i] = tier, STATE_KIND[tier]
  if any(n in (HOST_TIER, DISK_TIER) for n in names):
    first = next(i for i, n in enumerate(names) if n in (HOST_TIER, DISK_TIER))
    devices = placement.devices_of(leaves[first])
    placement.check_memory_kind(placement.HOST_KIND, devices[0], argument="tiers")
  return names, kinds


def zero1_sharding(param: Any, axis: str, owner: str = "optax_hybrid") -> Any:
  """The state sharding ZeRO-1 gives a leaf: the param's, split further over mesh ``axis``, or None.

  The first dimension that the param's spec leaves unsharded and whose size
  the axis divides is split over ``axis``; a leaf with no such dimension (a
  scalar, odd sizes) or already split over ``axis`` keeps the param's sharding
  (None is returned). The result is on the mesh's abstract form, as the plan
  keeps shardings (:func:`optax_hybrid.placement.sharding_of`).

  Raises:
    ValueError: if the param's placement is not a known ``NamedSharding`` on
      a mesh that has ``axis`` (arrays or ``ShapeDtypeStruct`` s placed so, or
      traced on a mesh whose axes are all ``Explicit``).
  """
  sharding = placement.sharding_of(param)
  own = _compat.typed_sharding(param) if _compat.is_tracer(param) else getattr(param, "sharding", None)
  if sharding is None and axis in getattr(getattr(own, "mesh", None), "axis_names", ()):
    return None  # a mesh of one device: nothing to split
  mesh = getattr(sharding, "mesh", None)
  if not isinstance(sharding, jax.sharding.NamedSharding) or axis not in mesh.axis_names:
    raise ValueError(
        f"{owner}: `shard_state_over`={axis!r} needs params placed with a NamedSharding on a mesh "
        f"that has that axis; got a param with sharding {getattr(param, 'sharding', None) or sharding}"
        + (" (traced: its type does not say how it is split; pass the placed params, or "
           "ShapeDtypeStructs with their shardings, to init)" if _compat.is_tracer(param) else "") + ".")
  spec = list(sharding.spec)
  used = {a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))}
  if axis in used:
    return None
  size = mesh.shape[axis]
  for d, (entry, n) in enumerate(zip(spec, np.shape(param))):
    if entry is None and n % size == 0 and n >= size:
      spec[d] = axis
      return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  return None


def whole_leading_axes(sharding: Any, ndim: int) -> int:
  """How many leading axes of a leaf placed with ``sharding`` every device holds whole (none split over the mesh).

  ``sharding`` is :func:`optax_hybrid.placement.sharding_of`'s answer: for
  None (one device) every axis is whole (``ndim``); for
  :data:`~optax_hybrid.placement.UNSEEN` none is known to be (0).
  """
  if sharding is None:
    return ndim
  if sharding is placement.UNSEEN:
    return 0
  spec = tuple(sharding.spec)
  split = [d for d, entry in enumerate(spec[:ndim])
           if entry is not None and np.prod([sharding.mesh.shape[a] for a in
                                             (entry if isinstance(entry, tuple) else (entry,))]) > 1]
  return split[0] if split else ndim


def master_needed(param_dtype: Any, master_dtype: Any) -> bool:
  """Does a leaf of ``param_dtype`` keep a master copy in ``master_dtype``? Only for lower-precision floats.

  (A master format of :mod:`optax_hybrid.masters` says it with ``applies_to``.)
  """
  if master_dtype is None:
    return False
  param_dtype = np.dtype(param_dtype)
  return (jax.numpy.issubdtype(param_dtype, jax.numpy.floating)
          and param_dtype.itemsize < np.dtype(master_dtype).itemsize)


__all__ = ["DEVICE_TIER", "DISK_TIER", "HOST_STATE_TIER", "HOST_TIER", "STATE_KIND", "TIERS", "TierSpec",
           "check_fraction", "check_tier_spec", "master_needed",
           "whole_leading_axes", "pick_by_fraction", "resolve", "zero1_sharding"]
