"""Memory kinds: validating them, placing state in them, and computing where values live.

Two memory kinds are used for state: ``"device"`` (accelerator memory) and
``"pinned_host"`` (page-locked host memory the accelerator reads by DMA). This
module creates placed zeros and copies for ``init`` (and the empty entry a
params-shaped field holds for a leaf that keeps nothing in it:
:func:`empty_entry`), and holds the helpers that
keep arithmetic where its values live: :func:`map_where_they_live` (host
values inside one host-compute region), :func:`apply_updates`,
and :func:`all_finite` (the jaxpr check that finds arithmetic outside them is
:func:`optax_hybrid.gpu_compile.host_arithmetic_outside_host_compute`). Which leaf runs where is decided
by the plan (:mod:`optax_hybrid.plan`) and carried out by
:mod:`optax_hybrid.pipeline`.

Under ``jit`` the memory space is part of an array's type, so all of this is
decided at trace time and costs nothing per step beyond the copies themselves.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from optax_hybrid import _commit_check, _compat
from optax_hybrid._compat import DEVICE, HOST

DEVICE_KIND = "device"
HOST_KIND = "pinned_host"
STATE_MEMORY_KINDS = (DEVICE_KIND, HOST_KIND)

_SPACE_OF_KIND = {DEVICE_KIND: DEVICE, HOST_KIND: HOST}
_KIND_OF_SPACE = {DEVICE: DEVICE_KIND, HOST: HOST_KIND}


# ---------------------------------------------------------------------------
# Memory kinds: validation and resolution
# ---------------------------------------------------------------------------


def available_memory_kinds(device: jax.Device | None = None) -> tuple[str, ...]:
  """The memory kinds a device can address (default: the first default device)."""
  device = jax.devices()[0] if device is None else device
  return tuple(sorted({m.kind for m in device.addressable_memories()}))


def check_memory_kind(kind: Any, device: jax.Device | None = None, *, argument: str = "state_memory_kind") -> str:
  """Validates a memory kind name for state, against what ``device`` offers.

  Raises:
    ValueError: if ``kind`` is not one of ``STATE_MEMORY_KINDS`` or the device
      does not have it (the message lists the kinds it has).
  """
  if not isinstance(kind, str) or kind not in STATE_MEMORY_KINDS:
    raise ValueError(
        f"`{argument}`={kind!r} is not a supported memory kind for optimizer "
        f"state; use None (beside each parameter), 'device' or 'pinned_host', "
        "or a callable (path, param) -> one of those."
    )
  device = jax.devices()[0] if device is None else device
  kinds = available_memory_kinds(device)
  if kind not in kinds:
    raise ValueError(
        f"`{argument}`={kind!r} is not available on {device.platform} device "
        f"{device.id}: it has memory kinds {', '.join(map(repr, kinds))}. Use "
        "one of those, or state_memory_kind=None to keep state beside the params."
    )
  return kind


def space_of_kind(kind: str) -> Any:
  """The memory space (``DEVICE`` or ``HOST``) that values in memory ``kind`` are typed with under ``jit``."""
  return _SPACE_OF_KIND[kind]


def memory_kind_of(x: Any) -> str:
  """``"device"`` or ``"pinned_host"``: the memory an array or tracer lives in."""
  return _KIND_OF_SPACE[_compat.memory_space_of(x)]


def param_memory_kind(param: Any) -> str:
  """``"device"`` or ``"pinned_host"``: where a param (array, tracer or ``ShapeDtypeStruct``) lives."""
  if isinstance(param, jax.ShapeDtypeStruct):
    sharding = getattr(param, "sharding", None)
    kind = getattr(sharding, "memory_kind", None)
    return HOST_KIND if _compat.is_host_kind(kind) else DEVICE_KIND
  if isinstance(param, jax.Array):
    return memory_kind_of(param)
  return DEVICE_KIND


class _Unseen:
  """:data:`UNSEEN`'s type: a singleton, equal to itself only (plans holding it compare and hash alike)."""

  __slots__ = ()

  def __repr__(self) -> str:
    return "UNSEEN"

  def __reduce__(self):
    return "UNSEEN"


#: :func:`sharding_of` for a value on several devices whose split its type does
#: not say (traced on a mesh with ``Auto`` axes, or a sharding other than a
#: ``NamedSharding``): the step may cut nothing that a device does not hold whole.
UNSEEN = _Unseen()


def sharding_of(x: Any) -> Any:
  """Where a param or state value is placed, as the plan reads it: the one answer to "one device or several?".

  Read from ``x``'s own sharding, never from the process's device count, so
  the same placed params get the same plan in any process, and ``init`` on
  arrays, on ``jax.ShapeDtypeStruct`` s and under ``jax.eval_shape`` agree:

  * None: on one device. An array or ``ShapeDtypeStruct`` with a one-device
    sharding (or none), or a traced value whose type names no mesh of
    several devices (``jax.eval_shape`` of single-device arrays).
  * a ``NamedSharding`` on the mesh's abstract form (``mesh.abstract_mesh``:
    axis names and sizes, no devices; the same object in every process with
    that mesh shape), its spec one entry per axis of ``x``, no memory kind:
    on several devices, split as it says. From an array's or a
    ``ShapeDtypeStruct``'s ``NamedSharding``, or from a traced value's type
    where every axis of its mesh is ``Explicit`` (the spec is then in the
    type).
  * :data:`UNSEEN`: on several devices, split in a way its type does not
    say (traced on a mesh with ``Auto`` axes: ``jax.eval_shape`` or ``jit``
    of arrays split over such a mesh; a multi-device sharding that is not a
    ``NamedSharding``).

  A value traced with no mesh in its type is taken to be on one device, even
  where a ``jit``'s ``in_shardings`` or ``out_shardings`` will split it: the
  trace cannot see that (trace under ``jax.set_mesh(mesh)``, or pass placed
  params, to say it).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_hybrid import placement
    >>> placement.sharding_of(jnp.ones(3)) is None
    True
  """
  if isinstance(x, _compat.Tracer):
    sharding = _compat.typed_sharding(x)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.size <= 1:
      return None
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    if any(t != explicit and n > 1 for t, n in zip(mesh.axis_types, mesh.axis_sizes)):
      return UNSEEN
    return _normalized(mesh, sharding.spec, np.ndim(x))
  sharding = getattr(x, "sharding", None)
  if sharding is None or len(sharding.device_set) <= 1:
    return None
  if not isinstance(sharding, NamedSharding):
    return UNSEEN
  return _normalized(sharding.mesh, sharding.spec, np.ndim(x))


def _normalized(mesh: Any, spec: Any, ndim: int) -> NamedSharding:
  """``NamedSharding(mesh's abstract form, spec with one entry per axis)``: equal for equal placements."""
  entries = tuple(spec)[:ndim]
  return NamedSharding(getattr(mesh, "abstract_mesh", mesh), PartitionSpec(*entries, *[None] * (ndim - len(entries))))


def on_devices(sharding: NamedSharding, like: Any) -> NamedSharding:
  """``sharding`` (a plan's: on an abstract mesh) on the devices of ``like``'s mesh, to place arrays with.

  ``like`` is a param placed on that mesh (an array or a
  ``jax.ShapeDtypeStruct``); traced, it has no devices, and the abstract
  sharding is what a trace places with.
  """
  mesh = getattr(getattr(like, "sharding", None), "mesh", None)
  return sharding if mesh is None else NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def devices_of(param: Any) -> Sequence[jax.Device]:
  """The devices a param is placed on (the first default device when unknown, e.g. traced)."""
  sharding = getattr(param, "sharding", None)
  if sharding is not None and not isinstance(param, _compat.Tracer):
    return list(sharding.device_set)
  return [jax.devices()[0]]


# ---------------------------------------------------------------------------
# State creation
# ---------------------------------------------------------------------------


def placed_with(value: Any, shape: tuple, dtype: Any, sharding: Any, *, abstract: bool = False) -> Any:
  """``value`` (an array, or None for zeros) in ``dtype``, placed with ``sharding`` (memory kind included).

  Host-memory values are filled on the host when ``value`` is fully
  addressable (or zeros), so they never pass through the device. With
  ``abstract`` a ``jax.ShapeDtypeStruct`` describes the result instead.
  """
  if abstract:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  if value is None:
    if _compat.is_host_kind(sharding.memory_kind):
      # A lazily zeroed NumPy buffer: state for a model larger than device
      # memory never passes through the device.
      return jax.device_put(np.zeros(shape, dtype), sharding)
    return jnp.zeros(shape, dtype, device=sharding)
  if _compat.is_host_kind(sharding.memory_kind) and getattr(value, "is_fully_addressable", True):
    return jax.device_put(np.asarray(value).astype(dtype), sharding)
  return jax.jit(lambda v: v.astype(dtype), out_shardings=sharding)(value)


def zeros_placed(param: Any, dtype: Any, kind: str, shape: tuple | None = None) -> Any:
  """Zeros shaped like ``param`` (or ``shape``, placed like it) in ``dtype``, placed in memory ``kind``.

  A concrete array keeps its sharding (mesh and spec) with the memory kind
  changed; a ``jax.ShapeDtypeStruct`` gives a ``ShapeDtypeStruct`` (so that
  ``init`` can describe the state of a model that is not materialized); under
  tracing the zeros are moved to the memory space and the compiler places them.
  """
  return filled_placed(param, dtype, kind, None, shape=shape)


def filled_placed(param: Any, dtype: Any, kind: str, fill: Any, shape: tuple | None = None) -> Any:
  """:func:`zeros_placed` with every element ``fill`` (a number, or an array of ``shape``; None: zeros)."""
  shape = np.shape(param) if shape is None else tuple(shape)
  made = lambda: (jnp.zeros(shape, dtype) if fill is None
                  else jnp.broadcast_to(jnp.asarray(fill).astype(dtype), shape))
  if isinstance(param, jax.ShapeDtypeStruct):
    sharding = param.sharding
    if sharding is not None:
      sharding = sharding.with_memory_kind(kind)
    elif kind != DEVICE_KIND:
      sharding = SingleDeviceSharding(jax.devices()[0], memory_kind=kind)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  if isinstance(param, _compat.Tracer) or isinstance(fill, _compat.Tracer):
    return _compat.move(made(), space_of_kind(kind))
  sharding = getattr(param, "sharding", None)
  committed = getattr(param, "committed", False)  # NumPy arrays are not committed
  if kind == DEVICE_KIND and not committed:
    # Mirror an uncommitted param: a committed state would make the first
    # jitted step's outputs committed and the second call compile again.
    return made()
  if sharding is None:
    sharding = SingleDeviceSharding(jax.devices()[0])
  value = None if fill is None else np.broadcast_to(np.asarray(fill), shape)
  return placed_with(value, shape, dtype, sharding.with_memory_kind(kind))


def copy_placed(param: Any, dtype: Any, kind: str) -> Any:
  """``param`` converted to ``dtype`` and placed in memory ``kind``, keeping its sharding.

  The copy for host memory is converted on the host when the param is fully
  addressable (a master copy for a model larger than device memory never
  passes through the device).
  """
  if isinstance(param, jax.ShapeDtypeStruct):
    return zeros_placed(param, dtype, kind)
  if isinstance(param, _compat.Tracer):
    return _compat.move(param.astype(dtype), space_of_kind(kind))
  sharding = getattr(param, "sharding", None)
  if sharding is None:
    sharding = SingleDeviceSharding(jax.devices()[0])
  if kind == DEVICE_KIND and not getattr(param, "committed", False):
    return jnp.asarray(param).astype(dtype)  # uncommitted like the param (see zeros_placed)
  return placed_with(param, np.shape(param), dtype, sharding.with_memory_kind(kind))


def empty_entry(param: Any, dtype: Any, kind: str, sharding: Any = None) -> Any:
  """What a params-shaped state field holds for a leaf that keeps no value in it: an empty array.

  Every params-shaped field of a state (``mu``, ``nu``, ``master``) holds
  exactly one array per param leaf, so that Optax's
  ``optax.tree_utils.tree_map_params`` can map a function over it together
  with trees shaped like the params (``jax.tree.map(f, state.master,
  param_specs)``), and ``jit`` and Orbax see arrays only. A leaf that keeps
  nothing there (no master copy for a float32 param; moments kept in files
  by the disk tier) holds an array of shape ``(0,) * max(param.ndim, 1)``:
  no bytes, the param's number of dimensions (at least one, so that even a
  scalar's entry is empty), so any partition spec valid for the param is valid
  for it, placed in memory ``kind`` with the param's sharding (or
  ``sharding``, memory kind included); on a mesh of several devices,
  replicated over it, as a step returns it. The step knows from the plan
  which leaves keep a value and passes these through untouched.

  Args:
    param: the param (array, tracer or ``jax.ShapeDtypeStruct``).
    dtype: the dtype the entry would have (the field's, for readability).
    kind: the memory kind of the leaf's state.
    sharding: a sharding to use instead of the param's (ZeRO-1 states).

  Returns:
    A placed empty array (a ``jax.ShapeDtypeStruct`` for an abstract param).

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_hybrid import placement
    >>> placement.empty_entry(jnp.ones((4, 3)), jnp.float32, "device").shape
    (0, 0)
  """
  shape = (0,) * max(np.ndim(param), 1)
  target = sharding if sharding is not None else getattr(param, "sharding", None)
  if isinstance(target, NamedSharding) and len(target.device_set) > 1:
    # XLA folds a zero-element result into a constant, which a step then returns replicated over the mesh
    # whatever the input's spec: made replicated, the entry has the same sharding before and after a step,
    # and a jitted step compiles once.
    return placed_with(None, shape, dtype, NamedSharding(target.mesh, PartitionSpec(), memory_kind=kind),
                       abstract=isinstance(param, jax.ShapeDtypeStruct))
  if sharding is not None:
    return placed_with(None, shape, dtype, sharding, abstract=isinstance(param, jax.ShapeDtypeStruct))
  return zeros_placed(param, dtype, kind, shape=shape)


def _replicated_like(sharding: Any) -> Any:
  """A device-memory sharding that replicates a scalar over ``sharding``'s devices."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  if len(sharding.device_set) == 1:
    return SingleDeviceSharding(next(iter(sharding.device_set)))
  return None


def step_counter_like(state_leaves: Sequence[Any]) -> Any:
  """An int32 zero for a step counter, placed to match the state's arrays.

  If the moments are committed to devices (always so in host memory) the
  counter is committed too, replicated over the same devices: a jitted step
  then sees the same argument signature on its first call and on every later
  one, and a checkpoint restored into the abstract state lands there too.
  """
  abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in state_leaves)
  replicated = None
  for x in state_leaves:
    if abstract:
      sharding = getattr(x, "sharding", None)
    elif isinstance(x, _compat.Tracer) or not getattr(x, "committed", False):
      continue
    else:
      sharding = x.sharding
    if sharding is not None:
      replicated = _replicated_like(sharding)
      if replicated is not None:
        break
  if abstract:
    return jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
  if replicated is None:
    return jnp.zeros([], jnp.int32)
  return jnp.zeros([], jnp.int32, device=replicated)


def commit(tree: Any) -> Any:
  """``tree`` with every uncommitted value committed to a device, so that a jitted step compiles once.

  JAX compiles a jitted function again when an argument that was uncommitted
  (free to move: what ``jnp``, ``jax.random``, Flax's ``init``, Optax's
  counters and ``nnx.Optimizer``'s step make) comes back committed. A step
  whose program moves values between memory kinds (state in host memory:
  every tier but ``"device"``) returns only committed arrays, whatever its
  inputs, so such inputs make its second call compile the whole step again.
  Commit what the step takes before its first call: params, optimizer state,
  a ``TrainState``, or an NNX model and optimizer together (see the example).

  Committed arrays are kept as they are (host state stays in host memory),
  but for a split spec on a mesh of one device, which a jitted step returns
  as ``P()`` (nothing to split): it is given ``P()`` now, on the same device
  and memory kind, so that code written for a mesh runs on one device and
  compiles once. Uncommitted arrays, Python numbers and NumPy arrays become arrays committed,
  in device memory, replicated over the devices of the first committed array
  of ``tree`` that has a replicable sharding (one device, or a mesh), else
  to the device they are on (the default device for numbers). Other leaves
  (``None``, ``ShapeDtypeStruct`` s, tracers) are kept.

  Args:
    tree: a pytree.

  Returns:
    The same tree, committed.

  Example:
    >>> import jax, jax.numpy as jnp, optax_hybrid
    >>> params = {"w": jnp.ones((4, 3))}
    >>> tx = optax_hybrid.hybrid_adamw(1e-3, state_memory_kind="pinned_host")
    >>> params, state = optax_hybrid.commit((params, tx.init(params)))
    >>> params["w"].committed, state.mu["w"].sharding.memory_kind
    (True, 'pinned_host')

    With Flax NNX, commit the model and its optimizer in place:
    ``nnx.update((model, optimizer), optax_hybrid.commit(nnx.state((model,
    optimizer))))``.
  """
  _commit_check.forget(tree)  # its optimizer states' first step will not be told to commit them
  leaves, treedef = jax.tree.flatten(tree)
  arrays = [x for x in leaves if isinstance(x, jax.Array) and not isinstance(x, _compat.Tracer)]
  target = None
  for x in arrays:
    if x.committed:
      target = _replicated_like(x.sharding)
      if target is not None:
        break

  def committed(x):
    if isinstance(x, jax.Array):
      if isinstance(x, _compat.Tracer):
        return x
      if x.committed:
        one = isinstance(x.sharding, NamedSharding) and x.sharding.mesh.size == 1
        unsplit = NamedSharding(x.sharding.mesh, PartitionSpec(), memory_kind=x.sharding.memory_kind) if one else None
        return jax.device_put(x, unsplit) if one and x.sharding != unsplit else x
      return jax.device_put(x, target or x.sharding)
    if isinstance(x, (int, float, complex, np.ndarray, np.generic)):
      return jax.device_put(x, target or jax.devices()[0])
    return x

  return jax.tree.unflatten(treedef, [committed(x) for x in leaves])


# ---------------------------------------------------------------------------
# Running a step where each leaf belongs
# ---------------------------------------------------------------------------


def constrain(x: Any, sharding: Any) -> Any:
  """Constrains a traced value to ``sharding``: ``reshard`` on Explicit mesh axes, a constraint on Auto ones.

  Used for ZeRO-1's gather of an update back to its param's sharding, and to
  split an operand like its state before a per-shard kernel.
  """
  sharding = jax.sharding.NamedSharding(sharding.mesh, sharding.spec)
  explicit = getattr(jax.sharding.AxisType, "Explicit", None)
  if explicit is not None and explicit in tuple(getattr(sharding.mesh, "axis_types", ())):
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def to_host(x: Any, sharding: Any = None, *, one_device: bool | None = None) -> Any:
  """``x`` moved to host memory for host compute, in the row-major layout (a no-op if it is there).

  XLA:GPU gives a host computation's parameters the default (row-major)
  layout but lets layout assignment pick the layout of a device value that
  crosses into one, and does not reconcile the two: a gradient that a matmul
  writes column-major (the gradient of a ``(D, V)`` kernel used as
  ``x @ w``) then fails the compile at ``end-of-post-layout_assignment``
  ("The async-start expects the async shape ... to match"). Constrained to
  row-major before the copy, the layout propagates back to its producer
  (the matmul writes row-major: no extra copy; docs/gpu_compile.md).

  Args:
    x: an array or tracer.
    sharding: its ``NamedSharding`` when it is split over several devices
      (each shard is constrained), else None.
    one_device: without ``sharding``, whether ``x`` is known to be on one
      device (constrained whole); None: as :func:`sharding_of` reads ``x``.
      A value whose placement is not known may be sharded in ways the trace
      cannot see, and it is moved unconstrained (a whole-value constraint
      would gather it).
  """
  if _compat.memory_space_of(x) == HOST:
    return x
  if one_device is None:
    one_device = sharding_of(x) is None
  if sharding is not None or one_device:
    x = _compat.row_major(x, sharding)
  return _compat.move(x, HOST)


def map_where_they_live(fn: Callable, *columns: Sequence[Any], static: Sequence[Any] | None = None) -> list:
  """``fn(*args, static)`` per leaf, computed where the leaf's first argument lives.

  Leaves whose first argument is in device memory run as ordinary device
  code; the others run together in one host-compute region (their other
  arguments moved to the host first), so no device arithmetic ever reads host
  memory: on a GPU that would silently run as slow host compute. ``static``
  holds one trace-time value per leaf (a dtype, say). Results keep the
  memory space they are computed in.
  """
  n = len(columns[0])
  static = [None] * n if static is None else list(static)
  rows = list(zip(*columns))
  on_host = [_compat.memory_space_of(row[0]) == HOST for row in rows]
  out = [None if h else fn(*row, st) for row, h, st in zip(rows, on_host, static)]
  host = [i for i in range(n) if on_host[i]]
  if host:
    run = _compat.host_compute(lambda rows: [fn(*row, static[i]) for i, row in zip(host, rows)],
                               out_memory_spaces=HOST)
    for i, r in zip(host, run([tuple(to_host(x) for x in rows[i]) for i in host])):
      out[i] = r
  return out


def all_finite(leaves: Sequence[jax.Array]) -> jax.Array:
  """A device bool scalar: are all elements of all ``leaves`` finite?

  One fused reduction per leaf, computed where the leaf lives (host-resident
  leaves inside host compute), so no device arithmetic reads host memory.
  """
  flags = []
  host_leaves = [x for x in leaves if _compat.memory_space_of(x) == HOST]
  for x in leaves:
    if _compat.memory_space_of(x) != HOST:
      flags.append(jnp.all(jnp.isfinite(x)))
  if host_leaves:
    host_check = _compat.host_compute(
        lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])),
        out_memory_spaces=HOST,
    )
    flags.append(_compat.move(host_check(host_leaves), DEVICE))
  if not flags:
    return jnp.asarray(True)
  return jnp.all(jnp.stack(flags))


def apply_updates(params: Any, updates: Any) -> Any:
  """``optax.apply_updates`` that is correct whatever memory each param lives in.

  Parameters in device memory are updated as ``optax.apply_updates`` does.
  Parameters in host memory are updated on the host with XLA host compute
  (their update is moved to the host first), so no device arithmetic ever
  reads host memory: on a GPU that would silently run as slow host compute.
  Each result keeps its parameter's dtype and memory kind.

  Args:
    params: a tree of parameters (leaves may be ``None``).
    updates: a tree of updates with the structure of ``params``.

  Returns:
    The updated parameters.
  """
  p_leaves, treedef = jax.tree.flatten(params, is_leaf=lambda x: x is None)
  try:
    u_leaves = treedef.flatten_up_to(updates)
  except (ValueError, TypeError) as e:
    raise ValueError(
        "apply_updates: `updates` must have the tree structure of `params`; "
        f"params: {treedef}, updates: {jax.tree.structure(updates)}."
    ) from e

  def add(p, u, _):
    return jnp.asarray(p + u).astype(jnp.asarray(p).dtype)

  present = [i for i, p in enumerate(p_leaves) if p is not None]
  sums = map_where_they_live(add, [p_leaves[i] for i in present],
                             [_compat.move(u_leaves[i], _compat.memory_space_of(p_leaves[i])) for i in present])
  out = [None] * len(p_leaves)
  for i, r in zip(present, sums):
    out[i] = r
  return jax.tree.unflatten(treedef, out)
