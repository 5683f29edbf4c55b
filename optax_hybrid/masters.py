r"""Master weight formats: how a low-precision param keeps the precision its small steps need.

A bfloat16 param rounds away every step smaller than half its unit in the last
place (``2**-8`` relative): with a small learning rate most of training's
updates vanish. A *master format* says what the optimizer keeps beside such a
param, and how the step reads the param's float32 value from it and writes
the new value back. One value per format, chosen once by ``init`` (into the
plan, :attr:`optax_hybrid.plan.LeafPlan.master`) and run by every kernel
through :func:`optax_hybrid.kernels.reference.master_update`:

==================== ============================ ============ ===================================
``master=``          kept beside a bf16/fp16      bytes/weight the step's float32 value ``w`` ...
                     param
==================== ============================ ============ ===================================
``"float32"``        a float32 copy               4            is the copy; param = round(w)
``"kahan"``          an error term in the         2            is param + term; param = round(w),
                     param's dtype (compensated                term = round(w - param)
                     summation)
``"stochastic"``     nothing                      0            is the param; param = w rounded up
                                                               or down at random, unbiased
==================== ============================ ============ ===================================

(``master=jnp.float32`` is ``master="float32"``; any other real floating
dtype wider than the param is a :class:`DtypeMaster`.)
No master weights (``master=None``, or a param a format does not apply to,
such as a float32 one) is a format too, :data:`NO_MASTER`: it keeps nothing,
gives the kernel no operand and is not ``active``. The engine asks a leaf's
format what it needs (its operand and seed, whether it keeps something and how
that is split over a mesh, whether the step writes the param through it)
instead of testing for its absence, so a new format is a value here and its
tests.

The Kahan term (Kahan 1965; optimi's Kahan summation for bf16 training) holds
what rounding to the param's dtype dropped, so the param plus its term carries
about 16 significant bits: a step far below the param's last place
accumulates in the term until it moves the param. Stochastic rounding
(torchao's ``bf16_stochastic_round`` for its low-bit AdamW) rounds ``w`` to
one of its two neighbours in the param's dtype with probabilities that make
the expected result ``w``: small steps move the param on average, with no
memory at all. Its random bits are a function of the step count, the leaf's
path and the element's position (:func:`random_bits`, an integer hash), the
same in XLA, host compute and the Pallas kernel, so a kernel can be compared
with the reference bit for bit and a step is reproducible.

Example:
  >>> import jax.numpy as jnp, optax_hybrid
  >>> params = {"w": jnp.ones(4, jnp.bfloat16)}
  >>> tx = optax_hybrid.hybrid_adamw(1e-4, master="kahan")
  >>> state = tx.init(params)
  >>> state.master["w"].dtype, float(state.master["w"][0])  # the error term: param dtype, zero at init
  (dtype(bfloat16), 0.0)
  >>> for _ in range(10):
  ...   params, state = tx.step(params, state, {"w": jnp.ones(4, jnp.bfloat16)})
  >>> float(params["w"][0]), round(float(params["w"][0]) + float(state.master["w"][0]), 5)
  (1.0, 0.999)
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_hybrid import _compat

#: The ``master=`` names, each.
FLOAT32, KAHAN, STOCHASTIC = "float32", "kahan", "stochastic"
#: Every ``master=`` name, in the order messages list them.
MASTER_NAMES = (FLOAT32, KAHAN, STOCHASTIC)


@dataclasses.dataclass(frozen=True)
class MasterFormat:
  """What a low-precision param keeps beside it, and how a step reads and writes its float32 value.

  A format is static (part of the plan). Subclasses define:

  * :meth:`stored_dtype`: the dtype of the state's ``master`` entry for a
    param of a dtype (None: nothing is kept);
  * :meth:`value`: the float32 value the step starts from, from the param
    and what is kept;
  * :meth:`write`: the new float32 value back to ``(new param, new kept
    value)``;
  * ``reads_param``: whether :meth:`value` reads the param (a float32 copy
    stands in for it, so the param is not moved to the step);
  * ``random``: whether :meth:`write` takes random bits (its kernel operand
    is then a seed: :meth:`operand`);
  * ``keeps``: whether it keeps anything in the state (the state then has a
    ``master`` tree);
  * ``steps_as_param``: what it keeps is the whole value (a copy in a wider
    dtype), so a kernel without master formats may step it as the param and
    the new param be rounded beside it
    (:func:`optax_hybrid.kernels.reference.with_master_as_param`);
  * ``active``: a step goes through it (True for every format; False only
    for :data:`NO_MASTER`, the absence of one).

  What the engine asks of a leaf's format, it asks the format: its kernel
  operand (:meth:`operand`: what it keeps, a seed, or nothing), whether the
  step writes the param through it, which dtype the state keeps
  (:meth:`stored_dtype`), how the operand is split over a mesh
  (:meth:`operand_spec`).
  """

  name: str = ""
  reads_param: bool = True
  random: bool = False
  keeps: bool = True
  steps_as_param: bool = False
  active: bool = True

  def applies_to(self, param_dtype: Any) -> bool:
    """Whether a param of ``param_dtype`` keeps this master: real floats narrower than float32."""
    dtype = np.dtype(param_dtype)
    return bool(jnp.issubdtype(dtype, jnp.floating)) and dtype.itemsize < 4

  def stored_dtype(self, param_dtype: Any) -> np.dtype | None:
    """The dtype of the state's ``master`` entry for a param of ``param_dtype`` (None: nothing kept)."""
    raise NotImplementedError

  @property
  def update_dtype(self) -> np.dtype:
    """The dtype of ``update``'s result for a mastered leaf: ``new_param - param``, exactly."""
    return np.dtype(np.float32)

  def initial(self, param: Any) -> Any:
    """What is kept for ``param`` at ``init`` (an array in :meth:`stored_dtype`, or None for zeros)."""
    raise NotImplementedError

  def from_value(self, value: Any, param: Any) -> Any:
    """What is kept for ``param`` whose full-precision value is ``value`` (NumPy; for restoring across formats)."""
    raise NotImplementedError

  def operand(self, stored: Any, count: jax.Array, salt: int) -> Any:
    """What a kernel gets for this leaf's master: what is kept, or (random formats) the step's seed."""
    del count, salt
    return stored

  def operand_spec(self, state_spec: Any) -> Any:
    """The ``PartitionSpec`` of the kernel operand under ``shard_map``: what is kept is split like the state;
    a seed is replicated."""
    return state_spec if self.keeps else jax.sharding.PartitionSpec()

  def value(self, param: Any, operand: Any) -> jax.Array:
    """The float32 value the step starts from."""
    raise NotImplementedError

  def write(self, value: jax.Array, param_dtype: Any, operand: Any, positions: Any) -> tuple[jax.Array, Any]:
    """``(new param, new kept value or None)`` for the new float32 ``value``.

    ``positions`` (uint32, shaped like ``value``) are the elements' flat
    indices in the leaf, for random formats; ``operand`` is what the kernel
    got (:meth:`operand`).
    """
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class DtypeMaster(MasterFormat):
  """A full copy in a wider dtype (``master="float32"``, or ``master=`` a dtype): 4 bytes per weight in float32."""

  dtype: Any = np.dtype(np.float32)
  reads_param: bool = False
  steps_as_param: bool = True

  def applies_to(self, param_dtype: Any) -> bool:
    dtype = np.dtype(param_dtype)
    return bool(jnp.issubdtype(dtype, jnp.floating)) and dtype.itemsize < np.dtype(self.dtype).itemsize

  def stored_dtype(self, param_dtype: Any) -> np.dtype:
    del param_dtype
    return np.dtype(self.dtype)

  @property
  def update_dtype(self) -> np.dtype:
    return np.dtype(self.dtype)

  def initial(self, param: Any) -> Any:
    return param

  def from_value(self, value: Any, param: Any) -> Any:
    del param
    return np.asarray(value, self.dtype)

  def value(self, param: Any, operand: Any) -> jax.Array:
    del param
    return operand.astype(jnp.promote_types(operand.dtype, jnp.float32))

  def write(self, value, param_dtype, operand, positions):
    del positions
    return value.astype(param_dtype), value.astype(operand.dtype)


@dataclasses.dataclass(frozen=True)
class KahanMaster(MasterFormat):
  """The param plus an error term in its own dtype: 2 bytes per weight for bf16 and fp16 params."""

  name: str = KAHAN

  def stored_dtype(self, param_dtype: Any) -> np.dtype:
    return np.dtype(param_dtype)

  def initial(self, param: Any) -> Any:
    return None  # zeros: the param is exact

  def from_value(self, value: Any, param: Any) -> Any:
    param = np.asarray(param)
    return (np.asarray(value, np.float32) - param.astype(np.float32)).astype(param.dtype)

  def value(self, param, operand):
    return param.astype(jnp.float32) + operand.astype(jnp.float32)

  def write(self, value, param_dtype, operand, positions):
    del positions
    param = value.astype(param_dtype)
    # value - param is exact in float32 (param is value's nearest neighbour); the term keeps its leading bits.
    return param, (value - param.astype(jnp.float32)).astype(operand.dtype)


@dataclasses.dataclass(frozen=True)
class _KeepsNothing(MasterFormat):
  """A format with nothing in the state: the step's value is the param's."""

  keeps: bool = False

  def stored_dtype(self, param_dtype: Any) -> None:
    del param_dtype
    return None

  def initial(self, param: Any) -> Any:
    return None

  def from_value(self, value: Any, param: Any) -> Any:
    return None

  def value(self, param, operand):
    del operand
    return param.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class StochasticMaster(_KeepsNothing):
  """No memory: the new value rounded up or down at random, unbiased (:func:`stochastic_round`)."""

  name: str = STOCHASTIC
  random: bool = True

  def operand(self, stored: Any, count: jax.Array, salt: int) -> jax.Array:
    del stored
    return step_seed(count, salt)

  def write(self, value, param_dtype, operand, positions):
    return stochastic_round(value, param_dtype, random_bits(operand[0], positions)), None


@dataclasses.dataclass(frozen=True)
class NoMaster(_KeepsNothing):
  """No master format (``master=None``; a param no format applies to, such as a float32 one): :data:`NO_MASTER`.

  Nothing is kept and the kernel gets no operand; the step reads the param
  only where decay or the fused apply needs it, and computes the update (or
  the new param ``p + u``, rounded once) itself.
  """

  name: str = "none"
  active: bool = False

  def applies_to(self, param_dtype: Any) -> bool:
    del param_dtype
    return False

  def operand(self, stored: Any, count: jax.Array, salt: int) -> None:
    del stored, count, salt
    return None

  def operand_spec(self, state_spec: Any) -> None:
    del state_spec
    return None

  def write(self, value, param_dtype, operand, positions):
    del operand, positions
    return value.astype(param_dtype), None


#: The absence of a master format: the plan's, a step's and ``resolve``'s value for "no master weights".
NO_MASTER = NoMaster()

#: The formats by ``master=`` name.
FORMATS = {FLOAT32: DtypeMaster(name=FLOAT32), KAHAN: KahanMaster(), STOCHASTIC: StochasticMaster()}


def resolve(master: Any, master_dtype: Any, owner: str) -> MasterFormat:
  """The format ``master=`` names, or :data:`NO_MASTER` for None.

  ``master`` is a format name (:data:`MASTER_NAMES`) or a real floating dtype
  (a copy in it: ``jnp.float32`` is ``"float32"``). ``master_dtype``, its older
  spelling, takes a dtype (options translate it into ``master`` first).

  Raises:
    ValueError: both given, or neither a format name nor a real floating dtype.
  """
  if master is not None and master_dtype is not None:
    raise ValueError(f"{owner}: pass either `master` or `master_dtype`, not both: `master_dtype` is the older "
                     "spelling of `master` (master=jnp.float32 is master='float32').")
  argument = "master" if master_dtype is None else "master_dtype"
  value = master if master_dtype is None else master_dtype
  if value is None:
    return NO_MASTER
  if isinstance(value, str) and value in FORMATS:
    return FORMATS[value]
  try:
    dtype = np.dtype(jnp.dtype(value))
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    got = f"{value!r}" if dtype is None else f"{value!r} (dtype {dtype})"
    raise ValueError(f"{owner}: unknown `{argument}`={got}; accepted values are "
                     f"{', '.join(repr(n) for n in MASTER_NAMES)}, a real floating dtype such as jnp.float32 "
                     "(a copy in it), or None: no master weights.")
  return _copy_in(dtype)


def _copy_in(dtype: np.dtype) -> MasterFormat:
  """The format that keeps a copy in ``dtype``: the ``"float32"`` one for float32 (``master=jnp.float32``)."""
  return FORMATS[FLOAT32] if dtype == np.float32 else DtypeMaster(name=str(dtype), dtype=dtype)


def kept_format(kept_dtype: Any, param_dtype: Any) -> MasterFormat:
  """The format that kept values of ``kept_dtype`` for a ``param_dtype`` param: a Kahan term in the param's
  dtype, else a copy in a wider one (how a checkpoint's master entries are read)."""
  kept_dtype = np.dtype(kept_dtype)
  return FORMATS[KAHAN] if kept_dtype == np.dtype(param_dtype) else _copy_in(kept_dtype)


# ---------------------------------------------------------------------------
# Random bits and stochastic rounding
# ---------------------------------------------------------------------------

_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: consecutive positions land far apart before the mix


def _mix(h: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finalizer: every input bit flips each output bit with probability about 1/2."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def salt_of(path: str) -> int:
  """A leaf's fixed 32-bit salt, from its path: leaves of one shape draw different bits."""
  return zlib.crc32(path.encode())


def step_seed(count: jax.Array, salt: int) -> jax.Array:
  """The seed of one leaf's step, shape ``(1,)`` uint32: a hash of the step count and the leaf's salt."""
  count = jnp.asarray(count).astype(jnp.uint32)
  return _mix(count * jnp.uint32(_GOLDEN) ^ jnp.uint32(salt)).reshape(1)


def positions(like: Any, offset: Any = 0, shard: tuple | None = None) -> jax.Array:
  """The flat (row-major) index of every element of the block ``like`` (from ``offset`` on), as uint32.

  ``like`` is an array (in whose memory space the indices are made: host
  compute needs its values typed as host memory) or a shape. Indices are
  taken modulo ``2**32`` (a stacked leaf may hold more elements than uint32
  counts: each axis's index times its stride, in wrapping uint32 arithmetic).
  With ``shard`` (``(shard's shape, whole leaf's shape)``: the block is part
  of one shard of a leaf split over devices, ``offset`` counting in the
  shard) each index is the element's in the whole leaf relative to the
  shard's first element, whose own index the caller adds (:func:`seed_at`).
  """
  shape = tuple(like) if isinstance(like, (tuple, list)) else tuple(like.shape)
  strides = [int(np.prod(shape[d + 1:])) % 2**32 for d in range(len(shape))]
  flat = sum((lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride)
              for d, stride in enumerate(strides) if shape[d] > 1), jnp.zeros(shape, jnp.uint32))
  if not isinstance(like, (tuple, list)):
    flat = _compat.move(flat, _compat.memory_space_of(like))
  if isinstance(offset, (int, np.integer)):  # a static offset (a slice of rows) may pass 2**32 as well
    offset = np.uint32(int(offset) % 2**32)
  flat = flat + jnp.asarray(offset).astype(jnp.uint32)
  return flat if shard is None else _in_whole(flat, *shard)


def _in_whole(flat: jax.Array, shard_shape: tuple, whole_shape: tuple) -> jax.Array:
  """Flat indices in a shard of ``shard_shape`` as the same elements' in a leaf of ``whole_shape``.

  Relative to the shard's first element: each axis's index in the shard
  times the whole leaf's stride of that axis (a shard of fewer than
  ``2**32`` elements).
  """
  out = jnp.zeros_like(flat)
  for d, n in enumerate(shard_shape):
    if n > 1:
      index = (flat // jnp.uint32(int(np.prod(shard_shape[d + 1:])))) % jnp.uint32(n)
      out = out + index * jnp.uint32(int(np.prod(whole_shape[d + 1:])) % 2**32)
  return out


def shard_origin(spec: Any, mesh: Any, shard_shape: tuple, whole_shape: tuple) -> jax.Array:
  """Inside ``shard_map``: the flat index in the whole leaf of this device's shard's first element (uint32).

  ``spec`` is the leaf's ``PartitionSpec`` on ``mesh``; the index of a
  split axis is the device's position along the mesh axes that split it
  (major to minor) times the shard's length there.
  """
  origin = jnp.zeros([], jnp.uint32)
  for d, entry in enumerate(tuple(spec)[:len(whole_shape)]):
    if entry is None:
      continue
    position = jnp.zeros([], jnp.uint32)
    for axis in (entry if isinstance(entry, tuple) else (entry,)):
      position = position * jnp.uint32(mesh.shape[axis]) + lax.axis_index(axis).astype(jnp.uint32)
    stride = int(np.prod(whole_shape[d + 1:])) % 2**32
    origin = origin + position * jnp.uint32(shard_shape[d]) * jnp.uint32(stride)
  return origin


def seed_at(seed: jax.Array, offset: Any) -> jax.Array:
  """The seed whose bits at position ``p`` (:func:`random_bits`) are ``seed``'s at ``p + offset``.

  A slice of a leaf that starts at flat position ``offset`` (a traced or
  static count, taken modulo ``2**32`` as positions are) then draws with the
  slice's own positions exactly the bits the whole leaf would draw there.
  """
  if isinstance(offset, (int, np.integer)):
    offset = np.uint32(int(offset) % 2**32)
  return seed + jnp.asarray(offset).astype(jnp.uint32) * jnp.uint32(_GOLDEN)


def random_bits(seed: jax.Array, where: jax.Array) -> jax.Array:
  """32 random bits per element: a hash of ``seed`` (uint32 scalar) and each element's position ``where``."""
  return _mix(where * jnp.uint32(_GOLDEN) + seed)


def stochastic_round(x: jax.Array, dtype: Any, bits: jax.Array) -> jax.Array:
  r"""``x`` (float32) rounded to ``dtype`` up or down at random: up with probability ``(x - lo) / (hi - lo)``.

  ``lo`` and ``hi`` are ``x``'s neighbours in ``dtype``, so the expected
  result is ``x``; a value ``dtype`` holds exactly is kept. The spacing is
  computed from ``x``'s exponent (``dtype``'s unit in the last place, at least
  its smallest subnormal), so one formula serves bfloat16 and float16
  (below float32's smallest normal, ``2**-126``, which XLA flushes, bfloat16
  values round to 0 or ``2**-126``). The
  uniform draw is the top 24 of ``bits`` (:func:`random_bits`). Infinities and
  NaNs pass through; values beyond ``dtype``'s range become infinities, as
  rounding to nearest makes them.
  """
  info = jnp.finfo(dtype)
  exponent = lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0x7F800000),
                                      jnp.float32)  # 2**floor(log2|x|); 0 for zeros and subnormals
  # At least the dtype's smallest subnormal, and a normal float32 (XLA flushes float32 subnormals to zero).
  floor = max(float(info.smallest_subnormal), float(np.finfo(np.float32).tiny))
  ulp = jnp.maximum(exponent * np.float32(2.0 ** -info.nmant), np.float32(floor))
  scaled = x / ulp  # exact: ulp is a power of two
  low = jnp.floor(scaled)
  uniform = (bits >> 8).astype(jnp.float32) * np.float32(2.0 ** -24)
  rounded = (low + (uniform < scaled - low).astype(jnp.float32)) * ulp
  return jnp.where(jnp.isfinite(x), rounded, x).astype(dtype)


__all__ = ["DtypeMaster", "FLOAT32", "FORMATS", "KAHAN", "KahanMaster", "MASTER_NAMES", "MasterFormat", "kept_format",
           "NO_MASTER", "NoMaster",
           "STOCHASTIC", "StochasticMaster", "positions", "random_bits", "resolve", "salt_of", "shard_origin", "step_seed",
           "stochastic_round"]
