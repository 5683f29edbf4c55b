"""The disk tier: Adam moments kept in files, read and written around each step.

Like DeepSpeed's ZeRO-Infinity NVMe offload and the ``nvme_offload_fraction``
of ColossalAI's HybridAdam, a leaf in the ``"disk"`` tier holds no moment
arrays between steps: its plan holds a :class:`DiskMoment` per moment (static
data: a file name, a shape and a dtype; :func:`files_of` lists them), the
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

Files live in one directory per optimizer (``nvme_offload_dir``, or a new
temporary directory), are created with owner-only permissions (0600) and
``O_EXCL``, are always opened with ``O_NOFOLLOW`` (a symlink planted in their
place is refused, never followed), and are removed by :meth:`DiskStore.close`,
by ``tx.close()``, or at interpreter exit.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import itertools
import os
import stat
import tempfile
import threading
import weakref
from typing import Any

import jax
import numpy as np
from jax.experimental import io_callback

_OPEN_FLAGS = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_names = itertools.count()
# File reads and writes release the GIL: a few threads keep several files in flight.
_io_pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                                 thread_name_prefix="optax_hybrid_disk")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DiskMoment:
  """A moment stored in a file: what the state holds for a disk-tier leaf (no arrays).

  Attributes:
    path: the file.
    shape: the moment's shape.
    dtype: the moment's dtype name.
  """

  path: str
  shape: tuple[int, ...]
  dtype: str

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def files_of(state: Any, field: str = "mu") -> Any:
  """The files of a ``HybridAdamState``'s disk-tier moments, shaped like the params.

  Args:
    state: a state made by ``hybrid_adamw(...).init``.
    field: ``"mu"`` or ``"nu"`` (with 8-bit moments, their codes), or
      ``"mu_scales"`` / ``"nu_scales"`` (their scales).

  Returns:
    A tree like ``state.mu``: the :class:`DiskMoment` of each disk-tier leaf,
    None for the others. Read one with :func:`read`.

  Example:
    >>> import jax.numpy as jnp, optax_hybrid
    >>> tx = optax_hybrid.hybrid_adamw(1e-3, tiers="disk")
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


class DiskStore:
  """The files of one optimizer's disk-tier moments."""

  def __init__(self, directory: str | os.PathLike | None):
    self._own_directory = directory is None
    if directory is None:
      directory = tempfile.mkdtemp(prefix="optax_hybrid_nvme_")  # mode 0700
    self.directory = os.path.realpath(check_directory(directory))
    self._files: list[str] = []
    self._lock = threading.Lock()
    self._finalizer = weakref.finalize(self, _remove, self._files, self.directory, self._own_directory)
    atexit.register(self._finalizer)

  def create(self, shape: tuple[int, ...], dtype: Any) -> DiskMoment:
    """A new zero-filled file for one moment."""
    dtype = np.dtype(dtype)
    name = f"moment_{os.getpid()}_{next(_names)}.bin"
    path = os.path.join(self.directory, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | _OPEN_FLAGS, 0o600)
    try:
      os.ftruncate(fd, int(np.prod(shape)) * dtype.itemsize)  # reads back as zeros
    finally:
      os.close(fd)
    with self._lock:
      self._files.append(path)
    return DiskMoment(path, tuple(int(d) for d in shape), dtype.name)

  def close(self) -> None:
    """Removes every file (and the directory, if this store created it)."""
    self._finalizer()

  @property
  def closed(self) -> bool:
    return not self._finalizer.alive


def _remove(files: list[str], directory: str, own_directory: bool) -> None:
  for path in files:
    try:
      os.unlink(path)
    except FileNotFoundError:
      pass
  files.clear()
  if own_directory:
    try:
      os.rmdir(directory)
    except OSError:
      pass


def _open_regular(path: str, flags: int) -> int:
  fd = os.open(path, flags | _OPEN_FLAGS)
  if not stat.S_ISREG(os.fstat(fd).st_mode):
    os.close(fd)
    raise OSError(f"optax_hybrid disk tier: {path} is not a regular file")
  return fd


def read(moment: DiskMoment) -> np.ndarray:
  """The moment's current value."""
  out = np.empty(moment.shape, np.dtype(moment.dtype))
  fd = _open_regular(moment.path, os.O_RDONLY)
  try:
    view = memoryview(out.reshape(-1).view(np.uint8))
    done = 0
    while done < len(view):
      n = os.readv(fd, [view[done:]])
      if n == 0:
        raise OSError(f"optax_hybrid disk tier: {moment.path} is shorter than {moment.nbytes} bytes")
      done += n
  finally:
    os.close(fd)
  return out


def write(moment: DiskMoment, value: np.ndarray) -> None:
  """Overwrites the moment's file with ``value``."""
  data = memoryview(np.ascontiguousarray(value, np.dtype(moment.dtype)).reshape(-1).view(np.uint8))
  fd = _open_regular(moment.path, os.O_WRONLY)
  try:
    done = 0
    while done < len(data):
      done += os.write(fd, data[done:])
  finally:
    os.close(fd)


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
