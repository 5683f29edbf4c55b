"""Checkpoints of optimizer state (and anything else) with Orbax, memory kinds kept.

A checkpoint is only useful if the state it restores is the state that was
saved: the same values, the same step count (hence the same position in the
learning-rate schedule), and every leaf back in its memory kind with its
sharding. Moments restored into device memory would silently undo the point of
host offloading; these helpers make that impossible.

Orbax writes each step into a temporary directory and renames it when done, so
a save interrupted midway (a killed process) leaves the previous checkpoint
restorable. Disk-tier moments are saved too: their files' contents are read
into the checkpoint, and restored into the files of the ``like`` state.
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

import os
from typing import Any

import jax

from optax_hybrid import _compat, disk

_is_disk = lambda x: isinstance(x, disk.DiskMoment)


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
  """An Orbax ``CheckpointManager`` for ``directory`` (created if missing).

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
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, save_interval_steps=save_interval_steps)
  return ocp.CheckpointManager(directory, options=options)


def save(checkpoint_manager, step: int, tree: Any, *, wait: bool = False) -> bool:
  """Saves ``tree`` as checkpoint ``step``; returns whether a save was started.

  Saving is asynchronous: training continues while Orbax writes. Pass
  ``wait=True`` (or call ``checkpoint_manager.wait_until_finished()``) before
  relying on the files.
  """
  ocp = _orbax()
  # A disk-tier moment is a file name in the state: save its contents.
  tree = jax.tree.map(lambda x: disk.read(x) if _is_disk(x) else x, tree, is_leaf=_is_disk)
  started = checkpoint_manager.save(int(step), args=ocp.args.StandardSave(tree))
  if wait:
    checkpoint_manager.wait_until_finished()
  return started


def restore(checkpoint_manager, like: Any, step: int | None = None) -> Any:
  """Restores checkpoint ``step`` (default: the latest) into the structure and placement of ``like``.

  Args:
    checkpoint_manager: from :func:`manager`.
    like: a tree of arrays or ``ShapeDtypeStruct``s (e.g. a freshly initialized
      state, or ``tx.init`` on abstract params); every restored leaf gets its
      shape, dtype, sharding and memory kind.
    step: which checkpoint; ``None`` for the latest complete one.

  Returns:
    The restored tree.

  Raises:
    FileNotFoundError: if there is no complete checkpoint (or not ``step``).
  """
  ocp = _orbax()
  if step is None:
    step = checkpoint_manager.latest_step()
    if step is None:
      raise FileNotFoundError(f"no complete checkpoint in {checkpoint_manager.directory}")
  elif step not in checkpoint_manager.all_steps():
    raise FileNotFoundError(
        f"no checkpoint for step {step} in {checkpoint_manager.directory}; "
        f"complete steps: {sorted(checkpoint_manager.all_steps())}"
    )
  target = jax.tree.map(lambda x: disk.read(x) if _is_disk(x) else x, abstract_like(like), is_leaf=_is_disk)
  restored = checkpoint_manager.restore(int(step), args=ocp.args.StandardRestore(target))

  def into_files(x, liked):
    # The values of ``like``'s disk-tier moments go into its files; the state keeps the file names.
    if _is_disk(liked):
      disk.write(liked, x)
      return liked
    return x

  restored = jax.tree.map(into_files, restored, like, is_leaf=_is_disk)

  def place(x, t):
    # Guard against a backend or Orbax version that ignores the memory kind.
    sharding = getattr(t, "sharding", None)
    if _is_disk(x):
      return x
    if isinstance(x, jax.Array) and sharding is not None and x.sharding != sharding:
      x = jax.device_put(x, sharding)
    return _compat.match_type_to_sharding(x)

  target = abstract_like(like)
  return jax.tree.map(place, restored, target, is_leaf=_is_disk)
