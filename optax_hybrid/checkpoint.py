"""Checkpoints of optimizer state (and anything else) with Orbax, memory kinds kept.

A checkpoint is only useful if the state it restores is the state that was
saved: the same values, the same step count (hence the same position in the
learning-rate schedule), and every leaf back in its memory kind with its
sharding. Moments restored into device memory would silently undo the point of
host offloading; these helpers make that impossible.

Orbax writes each step into a temporary directory and renames it when done, so
a save interrupted midway (a killed process) leaves the previous checkpoint
restorable. Disk-tier moments are saved too: their files' contents are read
into the checkpoint, and restored into the files of the ``like`` state. Empty
entries (:func:`optax_hybrid.placement.empty_entry`; Orbax cannot write arrays
with no elements) are saved as nothing and made again from ``like``.

The state restored into may be placed differently from the one saved: another
tier, memory kind or mesh (each leaf takes ``like``'s sharding), with or
without master weights. A master that ``like`` has and the checkpoint lacks is
built from the restored params (``masters_from``), as ``init`` builds it; one
the checkpoint has and ``like`` lacks is dropped.
A step that cannot be read raises :class:`UnreadableCheckpointError`, or is
skipped (``restore(..., skip_unreadable=True)``): that recovery is
:mod:`optax_hybrid.checkpoint_recovery`'s.
``orbax-checkpoint`` is an optional dependency
(``pip install "optax-hybrid[checkpoint]"``).

Example:
  >>> import tempfile
  >>> import jax, jax.numpy as jnp, optax_hybrid
  >>> params = jax.device_put({"w": jnp.ones(3)}, jax.devices()[0])
  >>> tx = optax_hybrid.hybrid_adamw(1e-3, state_memory_kind="pinned_host")
  >>> opt_state = tx.init(params)
  >>> manager = optax_hybrid.checkpoint.manager(tempfile.mkdtemp())
  >>> optax_hybrid.checkpoint.save(manager, 0, {"params": params, "opt": opt_state}, wait=True)
  True
  >>> restored = optax_hybrid.checkpoint.restore(manager, like={"params": params, "opt": opt_state})
  >>> restored["opt"].mu["w"].sharding.memory_kind
  'pinned_host'
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import weakref
from typing import Any, Callable

import jax
import numpy as np

from optax_hybrid import _compat, checkpoint_recovery as recovery, disk, masters as masters_lib, moments, placement
from optax_hybrid import checkpoint_stacks as stacks_layout, stacks
from optax_hybrid.base import STATE_TYPES, is_state as _is_state
from optax_hybrid.checkpoint_recovery import UnreadableCheckpointError
from optax_hybrid.plan import Plan
from optax_hybrid.transform import params_shaped_fields

# A state of any rule: HybridAdamState, HybridLionState, ...
HybridState = Any


def _orbax():
  try:
    import orbax.checkpoint as ocp
  except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "optax_hybrid.checkpoint needs orbax-checkpoint: pip install "
        '"optax-hybrid[checkpoint]" (or pip install orbax-checkpoint).'
    ) from e
  return ocp


def abstract_like(tree: Any) -> Any:
  """``jax.ShapeDtypeStruct`` leaves with the shape, dtype and sharding of ``tree``'s arrays.

  The sharding carries the memory kind, so restoring into this target puts each
  leaf back where it lived. ``ShapeDtypeStruct`` leaves pass through (for
  example the output of ``tx.init`` on abstract params), and so do leaves that
  are not arrays.
  """

  def to_abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return x
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x

  return jax.tree.map(to_abstract, tree)


def manager(directory: str | os.PathLike, *, max_to_keep: int | None = 3, save_interval_steps: int = 1):
  """An Orbax ``CheckpointManager`` for ``directory`` (created if missing), set up for jobs that crash.

  Besides ``max_to_keep`` and ``save_interval_steps``, it differs from
  Orbax's defaults in what happens when things go wrong:

  * a save whose directory cannot be written (read-only, full, removed)
    raises from :func:`save` itself: the step's directories are created in
    the calling thread (``create_directories_asynchronously=False``). With
    Orbax's default they are created in the background, and when that fails
    Orbax's other save threads wait minutes for them, and the process cannot
    exit meanwhile;
  * temporary directories of saves that a killed process left unfinished are
    removed when the next manager opens the directory
    (``cleanup_tmp_directories``);
  * a save still being written when the program ends is finished before the
    interpreter shuts down (without it, the save fails midway with
    ``cannot schedule new futures after shutdown`` and the step is lost): the
    manager is closed at exit unless it was closed before; an error of that
    save is logged there;
  * the checkpoint's item handler is registered, so that a new process's
    manager reads a step's tree metadata (and does not warn that it cannot).

  Use it as a context manager (``with checkpoint.manager(d) as m:``), or call
  ``close()``, to close it before exit.

  Raises:
    ValueError: if ``directory`` exists and is not a directory, or cannot be
      written.
  """
  ocp = _orbax()
  directory = os.path.abspath(os.fspath(directory))
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise ValueError(f"checkpoint `directory`={directory!r} exists and is not a directory.")
  os.makedirs(directory, exist_ok=True)
  if not os.access(directory, os.W_OK):
    raise ValueError(f"checkpoint `directory`={directory!r} is not writable.")
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, save_interval_steps=save_interval_steps, cleanup_tmp_directories=True,
      async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
  # The handler of the checkpoint's one item, named up front: a manager that
  # only learns it from its first save (a new process's does not) can neither
  # read a step's tree metadata nor keep from warning that it cannot.
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  registry.add("default", ocp.args.StandardSave)
  registry.add("default", ocp.args.StandardRestore)
  opened = ocp.CheckpointManager(directory, options=options, handler_registry=registry)
  _close_at_exit(opened)
  return opened


_open_managers: "weakref.WeakSet[Any]" = weakref.WeakSet()
_exit_hook: list = []  # [True] once registered


def _close_at_exit(checkpoint_manager) -> None:
  """Closes ``checkpoint_manager`` when the program ends, finishing a save still in flight."""
  if not _exit_hook:
    _exit_hook.append(True)
    # Python runs threading's exit hooks (LIFO) before it joins non-daemon
    # threads, and atexit's only after both; concurrent.futures' hook, which
    # stops every executor Orbax's background save still needs, is one of
    # threading's. Registered after it (Orbax is imported by now), ours runs
    # first. threading._register_atexit is private (Python 3.9+), hence the
    # fallback, which finishes what it can.
    getattr(threading, "_register_atexit", atexit.register)(_close_open_managers)
  _open_managers.add(checkpoint_manager)


def _close_open_managers() -> None:
  for checkpoint_manager in list(_open_managers):
    try:
      checkpoint_manager.close()  # waits for the save in flight; a no-op on a closed manager
    except Exception:  # pylint: disable=broad-exception-caught
      logging.getLogger(__name__).exception(
          "the last save to %s failed: its step was not saved.",
          checkpoint_manager.directory)
    _open_managers.discard(checkpoint_manager)


def _is_empty(x: Any) -> bool:
  """An array (or its description) with no elements: nothing for Orbax to write."""
  return isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray)) and x.size == 0


def _planned(state: Any) -> Plan | None:
  """The plan of a rule's state whose params-shaped fields fit it, else None."""
  plan = state.plan
  if not isinstance(plan, Plan):
    return None
  trees = [getattr(state, name) for name in params_shaped_fields(state) if getattr(state, name) is not None]
  if any(len(jax.tree.leaves(tree)) != len(plan.leaves) for tree in trees):
    return None
  return plan


def _unplaced(x: Any) -> bool:
  """A ``ShapeDtypeStruct`` with no devices or no memory kind (as ``jax.eval_shape(tx.init, params)`` makes them)."""
  sharding = getattr(x, "sharding", None)
  return isinstance(x, jax.ShapeDtypeStruct) and (
      sharding is None or sharding.memory_kind is None
      or isinstance(getattr(sharding, "mesh", None), jax.sharding.AbstractMesh))


def _placed_by_plan(state: HybridState, plan: Plan, meshes: dict, where: str) -> HybridState:
  """``state`` with each array that has no devices or memory kind placed where ``plan`` says ``init`` puts it.

  ``meshes`` maps abstract meshes to the concrete ones of ``like``'s placed
  arrays: a plan's shardings name a mesh's shape, not its devices. Other
  arrays (the count) are replicated over the state's mesh, or on the default
  device.

  Raises:
    ValueError: for a leaf whose plan does not say how it is split (traced on
      Auto mesh axes), or whose mesh no placed array of ``like`` is on.
  """
  device = jax.devices()[0]

  def on(spec_of, lp, kind):
    if lp.state_sharding is None:
      if not lp.on_one_device:
        raise ValueError(
            f"checkpoint.restore: {where}'s arrays have no shardings and its plan cannot say how {lp.path} is "
            "split (jax.eval_shape of params split over a mesh with Auto axes sees no split). Make `like`'s state "
            "with tx.init(checkpoint.abstract_like(params)), or give its arrays their shardings.")
      return jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
    mesh = meshes.get(lp.state_sharding.mesh)
    if mesh is None:
      raise ValueError(f"checkpoint.restore: {where}'s arrays have no devices and no placed array of `like` is on "
                       f"the mesh {lp.state_sharding.mesh} its plan names for {lp.path}; put the params, placed, "
                       "in `like` too, or give the state's arrays their shardings.")
    return jax.sharding.NamedSharding(mesh, spec_of(lp.state_sharding), memory_kind=kind)

  fill = lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) if _unplaced(x) else x
  fields = {}
  if not plan.layout.packed:
    for name, empty in plan.empty.items():
      tree = getattr(state, name, None)
      if tree is None:
        continue
      entries, treedef = jax.tree.flatten(tree)
      fields[name] = treedef.unflatten([
          fill(x, on(lambda s: jax.sharding.PartitionSpec() if i in empty else s.spec, lp, lp.state_kind))
          for i, (x, lp) in enumerate(zip(entries, plan.leaves))])
  split = [lp for lp in plan.leaves if lp.state_sharding is not None]
  others = on(lambda s: jax.sharding.PartitionSpec(), split[0], "device") if split else \
      jax.sharding.SingleDeviceSharding(device, memory_kind="device")
  rest = {name: jax.tree.map(lambda x: fill(x, others), getattr(state, name))
          for name in state._fields if name not in fields and name != "plan"}
  return state._replace(**fields, **rest)


def _with_placements(like: Any) -> Any:
  """``like`` with its optimizer states' unplaced arrays placed by their plans (:func:`_placed_by_plan`).

  ``jax.eval_shape(tx.init, params)`` describes a state with no memory kinds
  (and, on a mesh, no devices): restored as described, a host tier's state
  would land in device memory, and the step would compile for it.
  """
  entries, treedef = jax.tree_util.tree_flatten_with_path(like, is_leaf=_is_state)
  states = {j for j, (_, x) in enumerate(entries) if _is_state(x) and _planned(x) is not None
            and any(_unplaced(a) for a in jax.tree.leaves(x))}
  if not states:
    return like
  meshes = {}
  for x in jax.tree.leaves(like):
    mesh = getattr(getattr(x, "sharding", None), "mesh", None)
    if isinstance(mesh, jax.sharding.Mesh):
      meshes.setdefault(mesh.abstract_mesh, mesh)
  return treedef.unflatten([
      _placed_by_plan(x, x.plan, meshes, f"like{jax.tree_util.keystr(path)}") if j in states else x
      for j, (path, x) in enumerate(entries)])


def _replace_entries(state: HybridState, field: str, values: dict) -> HybridState:
  """``state`` with the entries ``{leaf index: value}`` of params-shaped ``field`` replaced."""
  leaves, treedef = jax.tree.flatten(getattr(state, field))
  return state._replace(**{field: treedef.unflatten([values.get(i, x) for i, x in enumerate(leaves)])})


def _files(plan: Plan, field: str) -> dict:
  """``{leaf index: disk.DiskMoment}`` of a params-shaped ``field``'s disk-tier files."""
  return {i: dict(leaf.files)[field] for i, leaf in enumerate(plan.leaves) if field in dict(leaf.files)}


def _with_file_values(state: Any) -> Any:
  """A rule's state with its disk-tier values in place of their empty entries."""
  plan = _planned(state) if _is_state(state) else None
  if plan is None:
    return state
  for field in params_shaped_fields(state):
    files = _files(plan, field)
    if files:
      state = _replace_entries(state, field, {i: disk.read(moment) for i, moment in files.items()})
  return state


# How to checkpoint a state whose disk-tier files its tree cannot name.
_KEEP_THE_PLAN = (
    "disk-tier moments, whose files only the optimizer state's plan names, and this tree leaves the plan out "
    "(nnx.state(optimizer) does). Checkpoint the optimizer state itself, plan included: with Flax NNX, "
    "{'model': nnx.state(model), 'opt_state': optimizer.opt_state, 'step': optimizer.step} (restore into "
    "the same structure, then set optimizer.opt_state and optimizer.step from it).")


def _in_moments(path: Any) -> bool:
  """Whether a key path runs through a field of a rule's state (``mu``, ``nu``..., before any ``master``)."""
  shaped = {name for names in STATE_TYPES.values() for name in names}  # of every rule defined so far
  fields = [name for name in _names(path) if name in shaped]
  return bool(fields) and fields[0] != "master" and not fields[0].endswith(moments.SUFFIXES)


def _first_names(names: list[str]) -> str:
  """The first three of ``names`` for a message, with ", ..." where there are more."""
  return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _unnamed_disk_moments(tree: Any) -> list[str]:
  """Empty field entries (``mu``, ``nu``...) outside a rule's state whose plan names their files."""
  return [jax.tree_util.keystr(path) for path, x in jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_state)
          if _is_empty(x) and all(d == 0 for d in x.shape) and _in_moments(path)]


def save(checkpoint_manager, step: int, tree: Any, *, wait: bool = False) -> bool:
  """Saves ``tree`` as checkpoint ``step``; returns whether a save was started.

  Saving is asynchronous: training continues while Orbax writes. Pass
  ``wait=True`` (or call ``checkpoint_manager.wait_until_finished()``) before
  relying on the files. Disk-tier moments are read from their files (named
  by the state's plan) into the checkpoint; other arrays with no elements
  (empty entries) are saved as nothing. A save that fails leaves the steps
  saved before it intact; with a manager from :func:`manager`, a directory
  that cannot be written raises here, and an error met while writing (as the
  storage layer raised it, e.g. TensorStore's ``ValueError``) raises from
  ``wait=True``, the next ``save`` or ``wait_until_finished()``, or is logged
  at exit.

  Raises:
    ValueError: if the tree holds disk-tier moments without the plan that
      names their files (``nnx.state(optimizer)``): the message says what to
      save instead.
    OSError: if the step's directory cannot be created (read-only, removed,
      full).
  """
  ocp = _orbax()
  tree = jax.tree.map(_with_file_values, tree, is_leaf=_is_state)
  unnamed = _unnamed_disk_moments(tree)
  if unnamed:
    raise ValueError(f"checkpoint.save: {_first_names(unnamed)} hold no "
                     f"values: they are {_KEEP_THE_PLAN}")
  tree = jax.tree.map(lambda x: None if _is_empty(x) else x, tree)
  started = checkpoint_manager.save(int(step), args=ocp.args.StandardSave(tree))
  if wait:
    checkpoint_manager.wait_until_finished()
  return started


def _key_name(key: Any) -> str:
  """One step of a key path as Orbax names it in a checkpoint's tree."""
  for attribute in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def _names(key_path: Any) -> tuple:
  return tuple(_key_name(k) for k in key_path)


class _Saved:
  """What checkpoint ``step`` holds: its arrays' shapes and dtypes by key path (tuples of Orbax's names)."""

  def __init__(self, checkpoint_manager, step: int):
    ocp = _orbax()
    metadata = checkpoint_manager.item_metadata(step)
    self.tree = getattr(metadata, "tree", metadata)
    # Without tree metadata (an Orbax that keeps none) the checkpoint is taken
    # to match like's masters, as before masters could change across a restore.
    self.known = self.tree is not None
    flat = {} if not self.known else {tuple(str(k) for k in key): value
                                      for key, value in ocp.tree.to_flat_dict(self.tree).items() if value is not None}
    self.keys = set(flat)
    self.arrays = {key: (tuple(value.shape), np.dtype(value.dtype))
                   for key, value in flat.items() if hasattr(value, "shape")}

  def node(self, names: tuple) -> Any:
    """The saved subtree at ``names``, or None where there is none."""
    node = self.tree
    for name in names:
      if isinstance(node, dict):
        node = node.get(name, node.get(int(name)) if name.isdigit() else None)
      elif isinstance(node, (list, tuple)) and name.isdigit() and int(name) < len(node):
        node = node[int(name)]
      else:
        return None
    return node


def _placed_like(value: Any, like: Any) -> Any:
  """``value`` (zeros for None) with ``like``'s shape, dtype and sharding (memory kind included)."""
  sharding = getattr(like, "sharding", None)
  if sharding is None:
    return jax.numpy.zeros(like.shape, like.dtype) if value is None else jax.numpy.asarray(value, like.dtype)
  return placement.placed_with(value, tuple(like.shape), like.dtype, sharding)


class _StateRestore:
  """How one rule's state of ``like`` is restored: what Orbax reads for it, and what is made after.

  Empty entries are read as nothing and made again from ``like``; a disk
  leaf's moments are read into host memory and written into ``like``'s files;
  a master that ``like`` keeps and the checkpoint lacks is built from its
  restored param (a float32 copy) or from nothing (a Kahan term starts at
  zero); a master saved in another format (:mod:`optax_hybrid.masters`: a
  float32 copy and a Kahan term differ in dtype) is read in its own dtype and
  converted through its float32 value; a master the checkpoint has and
  ``like`` does not keep is not read (its target is None).
  """

  def __init__(self, key_path: Any, like: HybridState, plan: Plan, saved: _Saved):
    self.where = f"like{jax.tree_util.keystr(key_path)}"
    self.like, self.plan = like, plan
    # A params-shaped tree of like's (SGD without momentum keeps none but a master).
    self.params_shaped = getattr(like, plan.field_names[0] if plan.fields else "master")
    self.paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(self.params_shaped)]
    prefix = _names(key_path)
    kept = set(range(len(plan.leaves))) - set(plan.empty_entries("master"))
    self.build_master, self.convert = [], {}
    if not saved.known:
      self.saved_master_tree = plan.master.keeps  # like has a master tree
      return
    # A state saved without masters has no master tree at all; Orbax
    # needs the target's tree to be the saved one, with None where it reads nothing.
    self.saved_master_tree = isinstance(saved.node(prefix + ("master",)), (dict, list, tuple))
    for i in sorted(kept):
      found = stacks_layout.saved_entry(prefix + ("master",) + _names(self.paths[i]), saved.arrays)
      if found is None:
        self.build_master.append(i)
      elif found[1] != np.dtype(plan.leaves[i].master_dtype):  # kept by another format: {leaf: saved dtype}
        self.convert[i] = found[1]

  def _saved_format(self, i: int) -> masters_lib.MasterFormat:
    lp = self.plan.leaves[i]
    return masters_lib.kept_format(self.convert[i], lp.param_dtype)

  def missing_masters(self) -> list[str]:
    """The masters to build that need their param (a copy; a Kahan term starts at zero)."""
    return [f"{self.where}.master{jax.tree_util.keystr(self.paths[i])}" for i in self.build_master
            if not self.plan.leaves[i].master.reads_param]

  def converted_masters(self) -> list[str]:
    """The masters to convert from another format that need their param (any conversion with a Kahan term)."""
    return [f"{self.where}.master{jax.tree_util.keystr(self.paths[i])}" for i in self.convert
            if self._saved_format(i).reads_param or self.plan.leaves[i].master.reads_param]

  def target(self) -> HybridState:
    """What Orbax restores into for this state."""
    state = self.like
    for field in params_shaped_fields(state):
      files = _files(self.plan, field)
      if files:  # read into host memory, then written into the files
        state = _replace_entries(state, field, {i: np.zeros(m.shape, np.dtype(m.dtype)) for i, m in files.items()})
    if not self.saved_master_tree:
      state = state._replace(master=None)
    elif not self.plan.master.keeps:  # masters saved, none kept: a tree that reads nothing
      state = state._replace(master=jax.tree.map(lambda _: None, self.params_shaped))
    else:  # none saved for some: they read nothing; others are read in the dtype they were saved in
      entries = jax.tree.leaves(state.master)
      read_as = {i: jax.ShapeDtypeStruct(entries[i].shape, dtype, sharding=getattr(entries[i], "sharding", None))
                 for i, dtype in self.convert.items()}
      state = _replace_entries(state, "master", {**{i: None for i in self.build_master}, **read_as})
    return jax.tree.map(lambda x: None if _is_empty(x) else x, state)  # empty entries read nothing

  def finish(self, restored: HybridState, masters: dict) -> HybridState:
    """The restored state in ``like``'s structure: files written, empty entries and ``masters`` in place."""
    fields = {}
    for field in params_shaped_fields(self.like):
      like_tree = getattr(self.like, field)
      if like_tree is None:
        fields[field] = None  # e.g. a master the checkpoint has and like does not keep
        continue
      like_leaves, treedef = jax.tree.flatten(like_tree)
      got = ([None] * len(like_leaves) if getattr(restored, field) is None
             else treedef.flatten_up_to(getattr(restored, field)))
      files, empty = _files(self.plan, field), set(self.plan.empty_entries(field))
      out = []
      for i, (like_entry, value) in enumerate(zip(like_leaves, got)):
        if i in files and value is not None:
          disk.write(files[i], np.asarray(value))
        if i in empty:
          value = _placed_like(None, like_entry)
        elif field == "master" and i in masters:
          value = masters[i]
        elif value is None:  # a zero-size param's moments: nothing was saved
          value = _placed_like(None, like_entry)
        out.append(value)
      fields[field] = treedef.unflatten(out)
    return restored._replace(**fields)

  def _param(self, params: dict, i: int, like_entry: Any) -> np.ndarray:
    """Leaf ``i``'s param from ``params`` (by path) on the host, or a ValueError naming it."""
    path = jax.tree_util.keystr(self.paths[i])
    param = params.get(path)
    if param is None or tuple(np.shape(param)) != tuple(like_entry.shape):
      found = "no param" if param is None else f"a param of shape {tuple(np.shape(param))}"
      raise ValueError(
          f"checkpoint.restore: `masters_from` returned {found} at {path} for the master "
          f"{self.where}.master{path} (shape {tuple(like_entry.shape)}); it must return the params tree the "
          "optimizer state was initialized with, e.g. masters_from=lambda restored: restored['params'].")
    if isinstance(param, jax.Array) and param.is_fully_addressable:
      param = np.asarray(jax.device_get(param))  # converted on the host, as init converts host masters
    return param

  def masters_from_params(self, params: dict, restored: HybridState) -> dict:
    """``{leaf index: master}`` built from ``params`` (by path) or converted from ``restored``'s other format.

    Raises a ValueError naming the first param that cannot be found.
    """
    masters = {}
    like_masters = jax.tree.leaves(self.like.master) if self.build_master or self.convert else []
    for i in self.build_master:
      fmt, like_entry = self.plan.leaves[i].master, like_masters[i]
      masters[i] = (_placed_like(None, like_entry) if fmt.reads_param  # a Kahan term: zero
                    else _placed_like(self._param(params, i, like_entry), like_entry))
    saved = jax.tree.structure(self.like.master).flatten_up_to(restored.master) if self.convert else []
    for i in self.convert:
      fmt, like_entry, before = self.plan.leaves[i].master, like_masters[i], self._saved_format(i)
      param = self._param(params, i, like_entry) if before.reads_param or fmt.reads_param else None
      value = np.asarray(before.value(param, np.asarray(jax.device_get(saved[i]))))
      masters[i] = _placed_like(fmt.from_value(value, param), like_entry)
    return masters


def restore(checkpoint_manager, like: Any, step: int | None = None, *,
            masters_from: Callable[[Any], Any] | None = None, skip_unreadable: bool = False) -> Any:
  """Restores checkpoint ``step`` (default: the latest) into the structure and placement of ``like``.

  ``like`` may be placed differently from what was saved: another tier or
  memory kind, another mesh or sharding (ZeRO-1 included), disk-tier moments
  (written into ``like``'s files). It may also differ in master weights
  (``hybrid_adamw(master=...)`` turned on or off, or changed, mid-run):

  * a master that ``like`` keeps and the checkpoint lacks is built from its
    restored param, converted to the master's dtype exactly as ``init`` does;
    pass ``masters_from``, a function of the restored tree that returns the
    params (``lambda restored: restored["params"]``). A Kahan term
    (``master="kahan"``) starts at zero, as ``init`` makes it, without;
  * a master kept in another format (a float32 copy restored into
    ``master="kahan"``, or the reverse) is converted through its float32
    value: ``param + term`` becomes the copy, the copy minus its param the
    term; pass ``masters_from``;
  * a master the checkpoint has and ``like`` does not keep is dropped (read
    into the leaf's state memory and discarded): the step continues from the
    params (``master="stochastic"`` keeps none).

  A step that cannot be read (a file cut short or missing, metadata that
  does not parse) raises :class:`UnreadableCheckpointError`, whose first line
  names the step, the array and the storage layer's reason. With
  ``skip_unreadable=True`` restore takes the newest step that reads
  completely instead, the way a training loop restarting on its own needs:
  each newer step that does not is moved to ``<directory>/unreadable/<step>``
  (kept for a person to look at, out of the manager's steps, so that the
  run saves those steps again) and reported with a ``RuntimeWarning`` naming
  the step, the array and the reason. ``checkpoint_manager.latest_step()`` is
  then the step restored. Steps are moved only once an older one has read
  completely into ``like``: a ``like`` that fits no step moves nothing.

  Args:
    checkpoint_manager: from :func:`manager`.
    like: a tree of arrays or ``ShapeDtypeStruct``s (e.g. a freshly initialized
      state, ``tx.init`` on abstract params, or ``jax.eval_shape(tx.init,
      params)``); every restored leaf gets its shape, dtype, sharding and
      memory kind. An optimizer state's arrays that have none (as
      ``jax.eval_shape`` makes them) are placed where the state's plan says
      ``init`` puts them: on the mesh of ``like``'s placed arrays (the params)
      or on the default device.
    step: which checkpoint; ``None`` for the latest complete one.
    masters_from: ``restored tree -> params``, used only for masters the
      checkpoint lacks or keeps in another format: each is built from (or
      converted with) the param at its path.
    skip_unreadable: restore the newest step that reads completely, moving
      newer unreadable ones aside (above); with ``step=None`` only, and one
      process (``jax.process_count() == 1``).

  Returns:
    The restored tree.

  Raises:
    FileNotFoundError: if there is no complete checkpoint (or not ``step``).
    UnreadableCheckpointError: if the step cannot be read (with
      ``skip_unreadable``: if no step can).
    ValueError: if ``like`` does not fit the checkpoint (a leaf of another
      shape, or one the checkpoint lacks, or the reverse); if
      ``skip_unreadable`` is combined with a ``step`` or several processes;
      if ``like`` keeps master weights the checkpoint lacks (or keeps in
      another format) and no ``masters_from`` is given, or ``masters_from`` does not return a param
      of the right shape for one of them; if ``like`` holds disk-tier
      moments without the plan that names their files (``nnx.state(optimizer)``);
      or if an optimizer state of ``like`` has arrays with no devices that its
      plan cannot place (a split it did not see; a mesh no placed array of
      ``like`` is on).
    TypeError: if ``masters_from`` is not callable.

  Example: turning master weights on mid-run.

    >>> import tempfile, jax.numpy as jnp, optax_hybrid
    >>> params = {"w": jnp.ones((2, 2), jnp.bfloat16)}
    >>> manager = optax_hybrid.checkpoint.manager(tempfile.mkdtemp())
    >>> tx = optax_hybrid.hybrid_adamw(1e-3)
    >>> saved = optax_hybrid.checkpoint.save(manager, 1, {"params": params, "opt": tx.init(params)}, wait=True)
    >>> tx_with_master = optax_hybrid.hybrid_adamw(1e-3, master="float32")
    >>> restored = optax_hybrid.checkpoint.restore(
    ...     manager, like={"params": params, "opt": tx_with_master.init(params)},
    ...     masters_from=lambda restored: restored["params"])
    >>> restored["opt"].master["w"].dtype
    dtype('float32')
  """
  if masters_from is not None and not callable(masters_from):
    raise TypeError("checkpoint.restore: `masters_from` must be a function of the restored tree that returns "
                    f"the params, e.g. lambda restored: restored['params']; got {masters_from!r}.")
  steps = sorted(checkpoint_manager.all_steps(), reverse=True)
  if skip_unreadable and step is not None:
    raise ValueError(f"checkpoint.restore: `skip_unreadable` chooses the step (the newest that reads completely), "
                     f"so it takes step=None, not step={step}.")
  if skip_unreadable and jax.process_count() > 1:
    raise ValueError("checkpoint.restore: `skip_unreadable` needs one process: with several, each would have to "
                     "agree on which steps read on every process. Restore a given step instead.")
  if step is None and not steps:
    raise FileNotFoundError(f"no complete checkpoint in {checkpoint_manager.directory}")
  if step is not None and step not in steps:
    raise FileNotFoundError(
        f"no checkpoint for step {step} in {checkpoint_manager.directory}; complete steps: {sorted(steps)}")
  if not skip_unreadable:
    return _restore_step(checkpoint_manager, like, steps[0] if step is None else int(step), masters_from)
  return recovery.restore_newest_readable(
      checkpoint_manager, steps, lambda step: _restore_step(checkpoint_manager, like, step, masters_from))


def _restore_step(checkpoint_manager, like: Any, step: int, masters_from: Any) -> Any:
  """Restores checkpoint ``step`` into ``like`` (see :func:`restore`); nothing is written before it has read."""
  ocp = _orbax()
  try:
    saved = _Saved(checkpoint_manager, step)
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise recovery.unreadable(checkpoint_manager, step, "its metadata", recovery.innermost(e)) from e
  like = _with_placements(abstract_like(like))
  entries, treedef = jax.tree_util.tree_flatten_with_path(like, is_leaf=_is_state)
  states = {}
  for j, (key_path, x) in enumerate(entries):
    plan = _planned(x) if _is_state(x) else None
    if plan is not None:
      states[j] = _StateRestore(key_path, x, plan, saved)
  missing = [name for r in states.values() for name in r.missing_masters()]
  if missing and masters_from is None:
    raise ValueError(
        f"checkpoint.restore: checkpoint step {step} has no master weights for {_first_names(missing)}"
        f" (saved without master weights, or those leaves kept none), but "
        "`like` keeps them. Pass masters_from=lambda restored: restored['params'] (a function of the restored "
        "tree that returns the params) to build each master from its restored param, as init does; or restore "
        "into a state made without master weights.")
  converted = [name for r in states.values() for name in r.converted_masters()]
  if converted and masters_from is None:
    raise ValueError(
        f"checkpoint.restore: checkpoint step {step} keeps {_first_names(converted)}"
        f" in another master format than `like` (a float32 copy and a "
        "Kahan term: master='float32' and master='kahan'). Pass masters_from=lambda restored: "
        "restored['params'] (a function of the restored tree that returns the params) to convert each through "
        "its param's value.")
  missing = missing + converted
  # An empty array where the checkpoint holds values would drop them: disk-tier
  # moments restored into a tree without their plan (nnx.state(optimizer)).
  # (An empty part of a split stack is no such case: its rows are read into the other part.)
  parts = stacks.stack_rows(like)
  dropped = [jax.tree_util.keystr(path) for j, (path, x) in enumerate(entries)
             if j not in states and _is_empty(x) and jax.tree_util.keystr(path) not in parts
             and math.prod(saved.arrays.get(_names(path), ((0,), None))[0])]
  if dropped:
    raise ValueError(f"checkpoint.restore: the checkpoint holds values for {_first_names(dropped)}"
                     f", where `like` has empty arrays: {_KEEP_THE_PLAN}")
  target = treedef.unflatten([states[j].target() if j in states else None if _is_empty(x) else x
                              for j, (_, x) in enumerate(entries)])
  # Split stacks held otherwise than saved (whole, or split at another row) are read as saved, then re-cut.
  target, relaid = stacks_layout.as_saved(target, saved.node, lambda names: saved.arrays.get(names, (None,))[0],
                                          _key_name)
  # A `like` that does not fit is the caller's error, never the step's (and
  # Orbax, finding it mid-read, leaves its other reads to complain at exit).
  _check_like_fits(saved, target, step)
  try:
    restored = relaid(checkpoint_manager.restore(step, args=ocp.args.StandardRestore(target)))
  except Exception as e:  # pylint: disable=broad-exception-caught
    read = lambda probe: checkpoint_manager.restore(step, args=ocp.args.StandardRestore(probe))
    array, reason = recovery.first_unreadable(read, target, e)
    what = "its arrays" if array is None else f"array {array}"
    raise recovery.unreadable(checkpoint_manager, step, what, reason, array) from e
  params = {}
  if missing:
    params = {jax.tree_util.keystr(path): x
              for path, x in jax.tree_util.tree_leaves_with_path(masters_from(restored))}
  # Every master is built (or refused) before any disk file is written.
  got = treedef.flatten_up_to(restored)
  masters = {j: r.masters_from_params(params, got[j]) for j, r in states.items()}
  restored = treedef.unflatten([
      states[j].finish(value, masters[j]) if j in states else _placed_like(None, x) if _is_empty(x) else value
      for j, ((_, x), value) in enumerate(zip(entries, got))])

  def place(x, t):
    # Guard against a backend or Orbax version that ignores the memory kind.
    sharding = getattr(t, "sharding", None)
    if isinstance(x, jax.Array) and sharding is not None and x.sharding != sharding:
      x = jax.device_put(x, sharding)
    return _compat.match_type_to_sharding(x)

  return jax.tree.map(place, restored, like)


def _check_like_fits(saved: _Saved, target: Any, step: int) -> None:
  """Raises a ValueError naming the first place where ``target`` and checkpoint ``step`` differ in tree or shape."""
  if not saved.known:
    return
  places = set()
  for path, x in jax.tree_util.tree_flatten_with_path(target, is_leaf=lambda x: x is None)[0]:
    names = _names(path)
    places.add(names)
    if x is None:
      continue
    if names not in saved.keys:
      raise ValueError(f"checkpoint.restore: checkpoint step {step} holds nothing at like"
                       f"{jax.tree_util.keystr(path)}; restore into the tree that was saved.")
    shape = saved.arrays.get(names, (None,))[0]
    if shape is not None and tuple(np.shape(x)) != shape:
      raise ValueError(f"checkpoint.restore: like{jax.tree_util.keystr(path)} has shape {tuple(np.shape(x))} but "
                       f"checkpoint step {step} holds shape {shape} there; restore into the tree that was saved.")
  extra = sorted(key for key in saved.keys if not any(key[:n] in places for n in range(len(key) + 1)))
  if extra:
    raise ValueError(f"checkpoint.restore: checkpoint step {step} holds {'.'.join(extra[0])}, which `like` lacks; "
                     "restore into the tree that was saved.")


__all__ = ["UnreadableCheckpointError", "abstract_like", "manager", "restore", "save"]
