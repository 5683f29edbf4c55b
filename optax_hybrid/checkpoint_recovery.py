"""Checkpoint steps that cannot be read: the error that names them, and restoring past them.

A step whose metadata does not parse, or one of whose array files is cut short
or missing, raises :class:`UnreadableCheckpointError` (re-exported as
``optax_hybrid.checkpoint.UnreadableCheckpointError``), naming the step, the
array and the storage layer's reason: :func:`unreadable` builds it,
:func:`first_unreadable` singles out the array. With
``checkpoint.restore(..., skip_unreadable=True)``, :func:`restore_newest_readable`
restores the newest step that reads completely and moves each newer one aside
(:func:`move_aside`), reporting it with a ``RuntimeWarning``.

The reading itself is the caller's (:mod:`optax_hybrid.checkpoint`): these
functions take it as a function (``restore_step(step)``, ``read(target)``), so
that this module knows nothing of Orbax or of the optimizer's state.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import jax


class UnreadableCheckpointError(Exception):
  """A checkpoint step that cannot be read: its metadata, or one of its arrays.

  Its message's first line names the step, the array and the reason.

  Attributes:
    step: the step.
    array: where the unreadable array is in ``like`` (e.g. ``"['params']['w']"``);
      None when the step's metadata cannot be read (or, with several
      processes, when the array was not singled out).
    reason: why, as the storage layer said it (the innermost error's first line).
  """

  def __init__(self, message: str, *, step: int, array: str | None, reason: str):
    super().__init__(message)
    self.step, self.array, self.reason = step, array, reason


def innermost(error: BaseException) -> str:
  """The first line of the error that started ``error``'s chain, with its type: the storage layer's reason."""
  for _ in range(32):  # chains are short; a cycle must not loop forever
    below = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    if below is None:
      break
    error = below
  lines = str(error).strip().splitlines()
  return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def restore_newest_readable(checkpoint_manager, steps: list, restore_step: Callable[[int], Any]) -> Any:
  """The newest of ``steps`` (newest first) that ``restore_step`` reads; newer unreadable ones moved aside, reported.

  Raises:
    UnreadableCheckpointError: no step reads (nothing is moved).
  """
  unreadable = []
  for step in steps:
    try:
      restored = restore_step(step)
    except UnreadableCheckpointError as e:
      unreadable.append(e)
      continue
    for e in unreadable:
      moved_to = move_aside(checkpoint_manager, e.step)
      warnings.warn(f"checkpoint.restore: skipped step {e.step}, restored step {step}: "
                    f"{str(e).splitlines()[0]} Step {e.step} was moved to {moved_to}.", RuntimeWarning, stacklevel=3)
    if unreadable:
      checkpoint_manager.reload()  # its list of steps, without those moved
    return restored
  newest = unreadable[0]
  raise UnreadableCheckpointError(
      "\n".join([str(newest).splitlines()[0], "No step reads completely; the others:"] +
                 [f"  {str(e).splitlines()[0]}" for e in unreadable[1:]]),
      step=newest.step, array=newest.array, reason=newest.reason) from newest


def move_aside(checkpoint_manager, step: int) -> str:
  """Moves checkpoint ``step`` to ``<directory>/unreadable/<step>`` (``<step>.<n>`` if taken); returns where."""
  directory = checkpoint_manager.directory
  aside = directory / "unreadable"  # not a step name: the manager no longer lists it
  aside.mkdir(parents=True, exist_ok=True)
  moved_to, n = aside / str(step), 0
  while moved_to.exists():
    n += 1
    moved_to = aside / f"{step}.{n}"
  (directory / str(step)).rename(moved_to)
  return os.fspath(moved_to)


def unreadable(checkpoint_manager, step: int, what: str, reason: str, array: str | None = None
               ) -> UnreadableCheckpointError:
  """The error for an unreadable ``step``: the step, ``what`` failed and why on its first line, then the way on."""
  older = sorted(s for s in checkpoint_manager.all_steps() if s < step)
  way_on = (f"Older steps: {older}. To restore the newest step that reads completely instead, pass "
            "skip_unreadable=True (unreadable steps are then moved to "
            f"{checkpoint_manager.directory / 'unreadable'} and reported)." if older else "No older step to restore.")
  return UnreadableCheckpointError(
      f"checkpoint step {step} in {checkpoint_manager.directory} is unreadable: {what} cannot be read: {reason}\n"
      f"{way_on}", step=step, array=array, reason=reason)


def first_unreadable(read: Callable[[Any], Any], target: Any, error: Exception) -> tuple[str | None, str]:
  """The first array of ``target`` that fails to ``read`` on its own, as ``(its path, why)``.

  ``read(tree)`` reads the step into ``tree`` (``target`` with None where
  nothing is read). Found by halving the set read (about log2(n) + 1 reads,
  each array read about once), so it holds whatever the storage layer's
  messages say. With several processes each would probe on its own while the
  others wait in Orbax's barriers: the error is reported as it came,
  ``(None, why)``, as when no single array fails alone.
  """
  if jax.process_count() > 1:
    return None, innermost(error)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(target)

  def read_fails(indices: list) -> Exception | None:
    chosen = set(indices)
    try:
      read(treedef.unflatten([x if i in chosen else None for i, (_, x) in enumerate(leaves)]))
    except Exception as e:  # pylint: disable=broad-exception-caught
      return e
    return None

  candidates = list(range(len(leaves)))
  while len(candidates) > 1:
    half = candidates[:len(candidates) // 2]
    candidates = half if read_fails(half) is not None else candidates[len(half):]
  failed = read_fails(candidates) if candidates else None
  if failed is None:
    return None, innermost(error)
  return jax.tree_util.keystr(leaves[candidates[0]][0]), innermost(failed)


__all__ = ["UnreadableCheckpointError", "first_unreadable", "innermost", "move_aside", "restore_newest_readable",
           "unreadable"]
