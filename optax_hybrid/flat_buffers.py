"""Leaves laid out in flat buffers, once: where each leaf is, and its view.

The packed optimizer state (:mod:`optax_hybrid.packing`: each attribute's
leaves in a few pools) and flat params (:mod:`optax_hybrid.flat_params`: the
params in a few buffers) lay leaves out the same way: leaf after leaf, each
in its buffer's next free elements. A buffer is one-dimensional, or a
``(rows, N)`` array whose every row holds one row of each of its leaves
(stacked layers).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Hashable, Sequence

import jax


@dataclasses.dataclass(frozen=True)
class Slot:
  """Where one leaf is: buffer ``buffer``, elements ``[offset, offset + size)`` (of each row), shaped ``shape``.

  Attributes:
    path: the leaf's path, for messages.
    buffer: the buffer's key (an index, or a name).
    offset: the leaf's first element in the buffer (in each row).
    shape: the leaf's shape (one row's, for stacked buffers).
  """

  path: str
  buffer: Hashable
  offset: int
  shape: tuple

  @property
  def size(self) -> int:
    return math.prod(self.shape)


def lay_out(paths: Sequence[str], buffers: Sequence[Hashable | None],
            shapes: Sequence[Sequence[int]]) -> tuple[tuple, dict]:
  """Leaf after leaf, each in its buffer's next elements (a buffer of None: the leaf has no slot).

  Returns:
    ``(slots, sizes)``: one :class:`Slot` (or None) per leaf, and each
    buffer's size in elements (of a row), in the order buffers are first used.
  """
  slots, sizes = [], {}
  for path, buffer, shape in zip(paths, buffers, shapes):
    if buffer is None:
      slots.append(None)
      continue
    slots.append(Slot(path, buffer, sizes.get(buffer, 0), tuple(shape)))
    sizes[buffer] = sizes.get(buffer, 0) + math.prod(shape)
  return tuple(slots), sizes


def view(buffer: Any, slot: Slot) -> Any:
  """The leaf at ``slot`` of ``buffer``: sliced and reshaped (each row's, for a ``(rows, N)`` buffer)."""
  if buffer.ndim == 1:
    return jax.lax.slice_in_dim(buffer, slot.offset, slot.offset + slot.size).reshape(slot.shape)
  rows = jax.lax.slice_in_dim(buffer, slot.offset, slot.offset + slot.size, axis=1)
  return rows.reshape((buffer.shape[0], *slot.shape))


__all__ = ["Slot", "lay_out", "view"]
