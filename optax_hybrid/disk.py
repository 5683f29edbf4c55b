"""The disk tier: Adam moments kept in files, read and written around each step.

Like DeepSpeed's ZeRO-Infinity NVMe offload and the ``nvme_offload_fraction``
of ColossalAI's HybridAdam, a leaf in the ``"disk"`` tier holds no moment
arrays between steps: its plan holds a :class:`DiskMoment` per moment (static
data: its place in a file, a shape and a dtype; :func:`files_of` lists them), the
state's ``mu`` and ``nu`` hold an empty entry for it (an array of no bytes,
so that every params-shaped field has one array per param:
:func:`optax_hybrid.placement.empty_entry`), and the jitted step reads the
moments with an ``io_callback`` before the update and writes them back after it. Steps see
each other's writes in order through data flow: the write returns a zero that
is added to the step count, and the next step's read takes that count as its
operand. (JAX's ``ordered=True`` callbacks would say the same, but JAX 0.10
fails to compile them beside host-memory arguments.)

JAX callbacks hand values to the computation in device memory (a host-memory
operand is rejected by JAX 0.10), so a disk leaf's moments pass through device
memory during the step, and the step runs there, as for ``host_state``; between
steps they use no memory at all. The callbacks run once per computation, not
per device: the disk tier is for single-device params.

Each optimizer keeps its disk-tier moments in one file, at their own offsets,
in ``nvme_offload_dir`` (or the system's temporary directory). The file never
has a name: it is made with ``O_TMPFILE`` where the file system supports it
(``tempfile.TemporaryFile``; elsewhere it is unlinked the moment it is made),
owner-only (0600), and read and written through its descriptor alone. So no
name leads to it, no symlink can be planted in its place, and its
space is freed when :meth:`DiskStore.close` or ``tx.close()`` closes it, or when
the process ends however it ends (a ``SIGKILL`` included): a crashed run leaves
no file behind to reclaim, and one run never touches another's moments.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import os
import tempfile
import threading
import weakref
from typing import Any, Iterator

import jax
import numpy as np
from jax.experimental import io_callback

# Moments start on page boundaries, so each one's I/O is page-aligned.
_ALIGNMENT = 4096
_store_numbers = itertools.count()
_open_stores: dict[int, "_OpenFile"] = {}  # DiskStore number -> its open file, until closed
# File reads and writes release the GIL: a few threads keep several moments in flight.
_io_pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                                 thread_name_prefix="optax_hybrid_disk")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DiskMoment:
  """A moment stored on disk: what the state holds for a disk-tier leaf (no arrays).

  Attributes:
    store: the number of the :class:`DiskStore` whose file holds it.
    offset: where the moment starts in that file, in bytes.
    shape: the moment's shape.
    dtype: the moment's dtype name.
  """

  store: int
  offset: int
  shape: tuple[int, ...]
  dtype: str

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def files_of(state: Any, field: str = "mu") -> Any:
  """The :class:`DiskMoment` of a ``HybridAdamState``'s disk-tier moments, shaped like the params.

  Args:
    state: a state made by ``hybrid_adamw(...).init``.
    field: ``"mu"`` or ``"nu"`` (with 8-bit moments, their codes), or
      ``"mu_scales"`` / ``"nu_scales"`` (their scales).

  Returns:
    A tree like ``state.mu``: the :class:`DiskMoment` of each disk-tier leaf,
    None for the others. Read one with :func:`read`.

  Example:
    >>> import jax.numpy as jnp, optax_hybrid
    >>> tx = optax_hybrid.hybrid_adamw(1e-3, state_memory_kind="disk")
    >>> state = tx.init({"w": jnp.ones(3)})
    >>> optax_hybrid.disk.read(optax_hybrid.disk.files_of(state)["w"])
    array([0., 0., 0.], dtype=float32)
    >>> tx.close()
  """
  _, treedef = jax.tree.flatten(getattr(state, field))
  return treedef.unflatten([dict(leaf.files).get(field) for leaf in state.plan.leaves])


def check_directory(directory: str | os.PathLike) -> str:
  """Validates a user-given ``nvme_offload_dir`` before anything is written.

  Raises:
    ValueError: if it does not exist, is not a directory, or is not writable.
  """
  path = os.fspath(directory)
  if not os.path.exists(path):
    raise ValueError(f"hybrid_adamw: `nvme_offload_dir`={path!r} does not exist; create it (or pass None "
                     "for a temporary directory).")
  if not os.path.isdir(path):
    raise ValueError(f"hybrid_adamw: `nvme_offload_dir`={path!r} is not a directory.")
  try:  # a real write: permissions, read-only mounts and full quotas all show here
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as e:
    raise ValueError(f"hybrid_adamw: `nvme_offload_dir`={path!r} is not writable ({e.strerror}); choose a "
                     "directory this process can write (or pass None for a temporary directory).") from e
  return path


class _OpenFile:
  """A store's file, closed only once no read or write is using its descriptor.

  A descriptor number closed mid-read could be reused by another file at once:
  the wait keeps a late read or write from ever reaching that file.
  """

  def __init__(self, file: Any):
    self._file, self._users, self._closed = file, 0, False
    self._changed = threading.Condition()

  @contextlib.contextmanager
  def descriptor(self) -> Iterator[int]:
    with self._changed:
      if self._closed:
        raise ValueError("optax_hybrid disk tier: these moments were removed by tx.close().")
      self._users += 1
    try:
      yield self._file.fileno()
    finally:
      with self._changed:
        self._users -= 1
        self._changed.notify_all()

  def close(self) -> None:
    with self._changed:
      self._closed = True
      self._changed.wait_for(lambda: self._users == 0)
      self._file.close()


class DiskStore:
  """The file of one optimizer's disk-tier moments: nameless, so it ends with its process.

  Args:
    directory: where the file's blocks live (``nvme_offload_dir``); None for
      the system's temporary directory (``tempfile.gettempdir()``).
  """

  def __init__(self, directory: str | os.PathLike | None):
    self.directory = os.path.realpath(tempfile.gettempdir() if directory is None else check_directory(directory))
    self.number = next(_store_numbers)
    self._size = 0
    self._lock = threading.Lock()
    _open_stores[self.number] = _OpenFile(tempfile.TemporaryFile(dir=self.directory))
    self._finalizer = weakref.finalize(self, _close, self.number)  # also run at interpreter exit

  def create(self, shape: tuple[int, ...], dtype: Any) -> DiskMoment:
    """Room for one more moment in the file, reading as zeros."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in shape)
    with self._lock:
      offset = -(-self._size // _ALIGNMENT) * _ALIGNMENT
      self._size = offset + int(np.prod(shape)) * dtype.itemsize
      with _open_file(self.number).descriptor() as fd:
        os.ftruncate(fd, self._size)  # the new bytes read back as zeros
    return DiskMoment(self.number, offset, shape, dtype.name)

  def close(self) -> None:
    """Closes the file, which frees its space."""
    self._finalizer()

  @property
  def closed(self) -> bool:
    return not self._finalizer.alive


def _close(number: int) -> None:
  _open_stores.pop(number).close()


def _open_file(number: int) -> _OpenFile:
  try:
    return _open_stores[number]
  except KeyError:
    raise ValueError("optax_hybrid disk tier: these moments were removed by tx.close().") from None


def read(moment: DiskMoment) -> np.ndarray:
  """The moment's current value.

  Raises:
    ValueError: if its optimizer was closed (``tx.close()``).
  """
  out = np.empty(moment.shape, np.dtype(moment.dtype))
  view = memoryview(out.reshape(-1).view(np.uint8))
  with _open_file(moment.store).descriptor() as fd:
    done = 0
    while done < len(view):
      n = os.preadv(fd, [view[done:]], moment.offset + done)
      if n == 0:
        raise OSError(f"optax_hybrid disk tier: the file ends before the {moment.nbytes} bytes of {moment}")
      done += n
  return out


def write(moment: DiskMoment, value: np.ndarray) -> None:
  """Overwrites the moment with ``value``.

  Raises:
    ValueError: if its optimizer was closed (``tx.close()``).
  """
  data = memoryview(np.ascontiguousarray(value, np.dtype(moment.dtype)).reshape(-1).view(np.uint8))
  with _open_file(moment.store).descriptor() as fd:
    done = 0
    while done < len(data):
      done += os.pwrite(fd, data[done:], moment.offset + done)


def load_in_step(moments: list[DiskMoment], after: jax.Array) -> list[jax.Array]:
  """Inside a jitted step: the moments' values, read by one callback once ``after`` is computed.

  ``after`` is the step count, which the previous step's :func:`store_in_step`
  token fed into: the read cannot start before that write finished.
  """
  shapes = tuple(jax.ShapeDtypeStruct(m.shape, np.dtype(m.dtype)) for m in moments)
  return list(io_callback(lambda _: tuple(_io_pool.map(read, moments)), shapes, after))


def store_in_step(moments: list[DiskMoment], values: list[jax.Array]) -> jax.Array:
  """Inside a jitted step: writes the new values by one callback. Returns an int32 zero to add to the count."""

  def write_all(*arrays):
    for done in _io_pool.map(write, moments, [np.asarray(a) for a in arrays]):
      del done  # map re-raises the first error here
    return np.zeros((), np.int32)

  return io_callback(write_all, jax.ShapeDtypeStruct((), np.int32), *values)
