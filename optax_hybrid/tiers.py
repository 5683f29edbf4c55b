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

import dataclasses
import math
import numbers
from typing import Any, Sequence

import jax
import numpy as np

from optax_hybrid import _compat, placement

#: The tier names, the values of ``state_memory_kind`` that say where the update runs.
DEVICE_TIER, HOST_STATE_TIER, HOST_TIER, DISK_TIER = "device", "host_state", "host", "disk"
#: The built-in tiers' names (:data:`BY_NAME` holds every tier, one added there included).
TIERS = (DEVICE_TIER, HOST_STATE_TIER, HOST_TIER, DISK_TIER)
#: What ``state_memory_kind`` takes per leaf: the memory kinds (the state there, the update where the param
#: lives) and the built-in tier names (the update where the tier says), ``"device"`` being both; and the name
#: of any tier added to :data:`BY_NAME`.
PLACEMENTS = (placement.DEVICE_KIND, placement.HOST_KIND, HOST_STATE_TIER, HOST_TIER, DISK_TIER)


@dataclasses.dataclass(frozen=True)
class Tier:
  """What a tier is, once: where a leaf's state lives, where its update runs, how its data crosses.

  The plan reads a leaf's tier here (:attr:`optax_hybrid.plan.LeafPlan.tier`
  names it) instead of comparing names; a placement a tier cannot serve is
  refused by it at ``init``.

  Attributes:
    name: the ``state_memory_kind`` value.
    state_kind: the memory kind of the state in memory (the moments; for the
      disk tier, whose moments are files, the master copy).
    runs_on: ``"device"`` or ``"host"`` (host compute): where the update runs.
    streamed: the leaf's data crosses the bus each step, in stages.
    files: the rule's fields are files (the disk tier's).
    crosses_in_slices: a leaf larger than a stage crosses in slices of rows of
      its state (the state goes to the device, is stepped there and comes
      back).
    single_device_why: why the tier serves only params on one device (None:
      it serves params split over several, ZeRO-1 included).
    packable: ``state_layout="packed"`` can hold its state (one device's
      memory).
  """

  name: str
  state_kind: str
  runs_on: str = "device"
  streamed: bool = False
  files: bool = False
  crosses_in_slices: bool = False
  single_device_why: str | None = None
  packable: bool = False

  def crossing(self, state_space: Any, param_space: Any, in_row_slices: bool) -> tuple[tuple, tuple]:
    """How a leaf's data crosses to where its update runs and back: ``(operands_to, results_to)``.

    The plan keeps both (:attr:`optax_hybrid.plan.LeafPlan.operands_to`,
    ``results_to``), so the traced step copies what they name and asks
    nothing else of the tier. ``operands_to``: the memory space the leaf's
    state, param and master operands are copied to before the kernel (None:
    already there); a device run's gradient is there already. A run in host
    compute copies every operand, its gradient too, in the layout host
    compute needs (:func:`optax_hybrid.placement.to_host`, which leaves
    those in host memory alone). ``results_to``: the memory space each of
    the kernel's results (first, state, master) is copied to after it
    (None: it stays).

    A tier whose fields are files finds its state on the device (loaded there
    before the kernels run) and leaves it there to be written back. A run in
    host compute leaves its results in host memory; a leaf stepped in slices
    of rows writes them where they live.

    Args:
      state_space, param_space: the memory spaces the step types the leaf's
        state (and master) and its param with.
      in_row_slices: the leaf is stepped in slices of rows
        (:attr:`optax_hybrid.plan.LeafPlan.slice_rows`).
    """
    state_at = _compat.DEVICE if self.files else state_space
    homes = (param_space, state_at, state_space)
    run_space = _compat.HOST if self.runs_on == "host" else _compat.DEVICE
    results_at = homes if in_row_slices else (run_space,) * len(homes)
    return (tuple(None if at == run_space else run_space for at in (state_at, param_space, state_space)),
            tuple(None if at == home else home for at, home in zip(results_at, homes)))


#: The tiers, by name.
BY_NAME = {t.name: t for t in (
    Tier(DEVICE_TIER, placement.DEVICE_KIND, packable=True),
    Tier(HOST_STATE_TIER, placement.HOST_KIND, streamed=True, crosses_in_slices=True),
    Tier(HOST_TIER, placement.HOST_KIND, runs_on="host", streamed=True),
    Tier(DISK_TIER, placement.HOST_KIND, files=True,
         single_device_why="its ordered file callbacks cannot run in a multi-device computation"),
)}
#: The memory kind of each tier's state in memory: the moments, or for the disk
#: tier (moments in files) the master copy.
STATE_KIND = {name: tier.state_kind for name, tier in BY_NAME.items()}

PlacementSpec = Any  # None | str | Callable[[tuple, Any], str | None] | a pytree prefix of str | Fractions
TierSpec = PlacementSpec  # its name when ``tiers=`` took it


@dataclasses.dataclass(frozen=True)
class Fractions:
  """A placement by size: :func:`by_fraction`'s result, a value of ``state_memory_kind``."""

  host: float = 0.0
  disk: float = 0.0
  rest: PlacementSpec = None

  def __repr__(self) -> str:
    given = [f"{name}={getattr(self, name)!r}" for name in ("host", "disk") if getattr(self, name)]
    if self.rest is not None:
      given.append(f"rest={self.rest!r}")
    return f"by_fraction({', '.join(given)})"


def by_fraction(host: float = 0.0, disk: float = 0.0, rest: PlacementSpec = None) -> Fractions:
  """A placement by size, for ``state_memory_kind``: this fraction of the params to the host, that one to disk.

  ``disk`` of the params, by size, get the ``"disk"`` placement (moments in
  files, as HybridAdam's ``nvme_offload_fraction``), then ``host`` of them the
  ``"host"`` one (state in host memory, updated on the host CPU at the same
  time as the device updates the rest, as Twin-Flow's ratio); every other leaf
  is placed by ``rest`` (any other ``state_memory_kind`` value; None: beside
  its param). Leaves are taken in ``jax.tree.leaves`` order, each one when at
  least half of it falls within the fraction (:func:`pick_by_fraction`);
  params that live in host memory are not moved.

  Args:
    host: the fraction of the params, by size, updated on the host, in [0, 1].
    disk: the fraction of the params, by size, whose moments live in files
      (single-device params), in [0, 1]; ``host + disk <= 1``.
    rest: where the other leaves' state lives: a ``state_memory_kind`` value
      other than a fraction.

  Raises:
    ValueError: for a fraction outside [0, 1], fractions that add up to more
      than 1, or a ``rest`` that is not a placement.
    TypeError: for a ``rest`` that is itself a ``by_fraction``.

  Example:
    >>> import jax.numpy as jnp, optax_hybrid
    >>> params = {"a": jnp.ones((3, 4)), "b": jnp.ones((3, 4))}
    >>> tx = optax_hybrid.hybrid_adamw(1e-3, state_memory_kind=optax_hybrid.by_fraction(host=0.5))
    >>> tx.init(params).plan.tiers
    ('host', 'device')
  """
  fractions = {name: check_fraction(name, value, "by_fraction") for name, value in (("host", host), ("disk", disk))}
  if sum(fractions.values()) > 1.0 + 1e-12:
    raise ValueError(f"by_fraction: `host` + `disk` is {sum(fractions.values())}; together they can place at "
                     "most all of the params (sum <= 1).")
  if isinstance(rest, Fractions):
    raise TypeError(f"by_fraction: `rest` places the leaves no fraction takes; it cannot be another by_fraction, "
                    f"got {rest!r}.")
  check_placement_spec(rest, "by_fraction", argument="rest")
  return Fractions(fractions["host"], fractions["disk"], rest)


def check_placement_spec(spec: PlacementSpec, owner: str = "optax_hybrid", argument: str = "state_memory_kind") -> None:
  """Early validation of ``state_memory_kind`` when the optimizer is built (``owner`` names it in messages).

  The names are always checked. Whether the devices offer a memory kind
  named alone is checked here only if a backend is already running: asking
  would start one, and ``jax.distributed.initialize`` must precede that.
  ``init`` checks every leaf against its own devices.
  """
  if spec is None or isinstance(spec, Fractions) or callable(spec):
    return
  for leaf in jax.tree.leaves(spec):
    _check_placement(leaf, argument, owner)
  if isinstance(spec, str) and spec != DEVICE_TIER and _compat.backends_are_initialized():
    _check_available(f"`{argument}`={spec!r}", _state_kind(spec), jax.devices()[0], owner)


def _state_kind(value: str) -> str:
  """The memory kind of the state a placement value (a memory kind or a tier's name) keeps in memory."""
  return BY_NAME[value].state_kind if value in BY_NAME else value


def _check_placement(value: Any, argument: str, owner: str) -> str:
  # The memory kinds and every tier's name, a tier added to BY_NAME included.
  placements = tuple(dict.fromkeys((placement.DEVICE_KIND, placement.HOST_KIND, *BY_NAME)))
  if not isinstance(value, str) or value not in placements:
    raise ValueError(
        f"{owner}: `{argument}`={value!r} is not a placement; use one of "
        f"{', '.join(repr(t) for t in placements)} (docs/tiers.md), None (the state beside each param), "
        "a callable (path, param) -> one of those, a tree of them shaped like the params (or a prefix of it), "
        "or optax_hybrid.by_fraction(...).")
  return value


def _check_available(asked: str, kind: str, device: Any, owner: str) -> None:
  """Raises where ``device`` lacks memory ``kind``, which the placement ``asked`` (as the user wrote it) needs."""
  kinds = placement.available_memory_kinds(device)
  if kind not in kinds:
    raise ValueError(
        f"{owner}: {asked} keeps the state in {kind!r}, which {device.platform} device {device.id} does not "
        f"have: it has memory kinds {', '.join(map(repr, kinds))}. Use one of those, or "
        "state_memory_kind=None to keep the state beside the params.")


def check_fraction(name: str, value: Any, owner: str = "optax_hybrid") -> float | None:
  """A fraction of params in [0, 1], or None (``owner`` names the function in messages)."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)) \
      or not 0.0 <= float(value) <= 1.0:
    raise ValueError(f"{owner}: `{name}` must be a number in [0, 1] (a fraction of the params, by "
                     f"size), got {value!r}.")
  return float(value)


def _spec_leaves(spec: PlacementSpec, params: Any, owner: str) -> list[tuple[Any, str]]:
  """Per params leaf: the placement ``spec`` asks for (or None) and how to name it in a message."""
  n = len(jax.tree.leaves(params))
  if spec is None:
    return [(None, "state_memory_kind")] * n
  if isinstance(spec, str):
    return [(_check_placement(spec, "state_memory_kind", owner), "state_memory_kind")] * n
  if callable(spec):
    out = []
    for path, param in jax.tree_util.tree_leaves_with_path(params):
      argument = f"state_memory_kind({jax.tree_util.keystr(path)})"
      value = spec(path, param)
      out.append((None if value is None else _check_placement(value, argument, owner), argument))
    return out
  treedef = jax.tree.structure(params)
  try:
    # A prefix of the params tree: one placement for a whole subtree.
    leaves = treedef.flatten_up_to(jax.tree.map(
        lambda t, sub: jax.tree.map(lambda _: t, sub), spec, treedef.unflatten([0] * treedef.num_leaves),
        is_leaf=lambda x: x is None))
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"{owner}: `state_memory_kind` must be a placement name, a callable (path, param) -> placement, or a "
        f"tree with the structure of the params (or a prefix of it); params: {treedef}, state_memory_kind: "
        f"{jax.tree.structure(spec)}.") from e
  return [(None if t is None else _check_placement(t, "state_memory_kind", owner), "state_memory_kind")
          for t in leaves]


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


def resolve(params: Any, *, tiers: TierSpec, state_memory_kind: PlacementSpec,
            offload_fraction: float | None, nvme_offload_fraction: float | None = None,
            owner: str = "optax_hybrid") -> tuple[list[str], list[str]]:
  """Each leaf's tier and the memory kind of its in-memory state, in leaf order.

  ``state_memory_kind`` (or ``tiers``, its older spelling) places each leaf:
  None beside its param; a memory kind (``"device"``, ``"pinned_host"``)
  keeps the state there and updates the leaf where its param lives (on the
  host for a param in host memory); a tier name (``"host_state"``,
  ``"host"``, ``"disk"``) says where the update runs too. A
  :func:`by_fraction` placement (or the older ``nvme_offload_fraction`` and
  ``offload_fraction``) then moves that fraction of the params (by size,
  :func:`pick_by_fraction`) to the disk tier, then to the host tier, each
  taking leaves in order among those not already moved.
  """
  spec = state_memory_kind if tiers is None else tiers
  fractions = {DISK_TIER: nvme_offload_fraction, HOST_TIER: offload_fraction}
  if isinstance(spec, Fractions):
    spec, fractions = spec.rest, {DISK_TIER: spec.disk, HOST_TIER: spec.host}
  leaves = jax.tree.leaves(params)
  param_kinds = [placement.param_memory_kind(p) for p in leaves]
  names, kinds, asked = [], [], []
  for (path, param), pkind, (value, argument) in zip(jax.tree_util.tree_leaves_with_path(params), param_kinds,
                                                     _spec_leaves(spec, params, owner)):
    tier, kind = _leaf_placement(value, pkind, jax.tree_util.keystr(path), owner)
    names.append(tier)
    kinds.append(kind)
    asked.append(None if value in (None, DEVICE_TIER) else f"`{argument}`={value!r}")
  sizes = [int(np.prod(np.shape(p))) for p in leaves]
  for tier, fraction in fractions.items():  # disk first, then host
    if fraction:
      movable = [n not in (HOST_TIER, DISK_TIER) and k != placement.HOST_KIND for n, k in zip(names, param_kinds)]
      for i, take in enumerate(pick_by_fraction(sizes, fraction, movable)):
        if take:
          names[i], kinds[i] = tier, STATE_KIND[tier]
          asked[i] = f"`state_memory_kind`={state_memory_kind if tiers is None else tiers!r}"
  checked = set()
  for leaf, kind, words in zip(leaves, kinds, asked):
    device = placement.devices_of(leaf)[0]
    if words is not None and (device.platform, device.id, kind) not in checked:
      _check_available(words, kind, device, owner)
      checked.add((device.platform, device.id, kind))
  return names, kinds


def _leaf_placement(value: str | None, param_kind: str, path: str, owner: str) -> tuple[str, str]:
  """One leaf's ``(tier, state memory kind)`` for the placement asked for (None: beside the param)."""
  on_host = param_kind == placement.HOST_KIND
  if on_host and value == DISK_TIER:
    raise ValueError(
        f"{owner}: the param at {path} lives in host memory, so it is updated on the host; give it "
        "state_memory_kind='host' or 'pinned_host' (its moments in host memory), not 'disk'.")
  kind = param_kind if value is None else _state_kind(value)
  if on_host:  # computed on the host, wherever its state is; or, asked for, on the device a slice at a time
    return (HOST_STATE_TIER if value == HOST_STATE_TIER else HOST_TIER), kind
  if value in BY_NAME and value != DEVICE_TIER:  # a tier named; "device" is a memory kind as well
    return value, kind
  return (DEVICE_TIER if kind == placement.DEVICE_KIND else HOST_STATE_TIER), kind


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
  own = _compat.typed_sharding(param) if isinstance(param, _compat.Tracer) else getattr(param, "sharding", None)
  if sharding is None and axis in getattr(getattr(own, "mesh", None), "axis_names", ()):
    return None  # a mesh of one device: nothing to split
  mesh = getattr(sharding, "mesh", None)
  if not isinstance(sharding, jax.sharding.NamedSharding) or axis not in mesh.axis_names:
    raise ValueError(
        f"{owner}: `shard_state_over`={axis!r} needs params placed with a NamedSharding on a mesh "
        f"that has that axis; got a param with sharding {getattr(param, 'sharding', None) or sharding}"
        + (" (traced: its type does not say how it is split; pass the placed params, or "
           "ShapeDtypeStructs with their shardings, to init)" if isinstance(param, _compat.Tracer) else "") + ".")
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


__all__ = ["DEVICE_TIER", "DISK_TIER", "Fractions", "HOST_STATE_TIER", "HOST_TIER", "PLACEMENTS", "PlacementSpec",
           "STATE_KIND", "TIERS", "BY_NAME", "Tier", "TierSpec", "by_fraction", "check_fraction", "check_placement_spec",
           "whole_leading_axes", "pick_by_fraction", "resolve", "zero1_sharding"]
