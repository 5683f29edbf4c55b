r"""Moment formats: how the fields a rule keeps per weight (Adam's ``mu`` and ``nu``) are stored.

A rule's field is a value per weight, computed in float32 (or the field's
dtype); a *moment format* says which arrays hold it in the state and how the
value is encoded into them and decoded from them:

================== =========================================== ==========================
``moment_format=`` arrays per field                            bytes per weight per field
================== =========================================== ==========================
None, a dtype name the value itself, in the field's dtype      its itemsize (4, 2)
``"8bit"``         ``uint8`` codes shaped like the weight and  1 + 4 per block of 256
                   ``float32`` scales per block of 256 along
                   the last axis (``<field>_scales``)
================== =========================================== ==========================

One value per format, chosen once by ``init`` for each leaf (into
:attr:`optax_hybrid.plan.LeafPlan.moments`: a leaf the format does not apply
to, such as a bias too small to quantize, keeps :data:`AS_STORED`). The
engine asks the leaf's format what to make, place, pack, write to disk and
hand the kernels, instead of testing for a storage flag; the kernels that
implement a format read its stored values directly (the 8-bit ones:
:mod:`optax_hybrid.kernels.quantized`).

Example:
  >>> import jax.numpy as jnp
  >>> from optax_hybrid import moments
  >>> [a[:2] for a in moments.BLOCKWISE_8BIT.arrays((4, 512), jnp.float32)]
  [('', (4, 512)), ('_scales', (4, 2))]
  >>> stored = moments.BLOCKWISE_8BIT.encode(jnp.full((4, 512), 0.5), like=None, signed=True)
  >>> float(moments.BLOCKWISE_8BIT.decode(stored, signed=True)[0, 0])
  0.5
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from optax_hybrid.kernels import quantized


@dataclasses.dataclass(frozen=True)
class MomentFormat:
  """How one field of a rule is stored: the values themselves, in the field's dtype.

  The base format is :data:`AS_STORED`; a format that encodes the values
  (:data:`BLOCKWISE_8BIT`) overrides every method.

  Attributes:
    name: the ``moment_format=`` name.
    value_dtype: the dtype the fields' values are computed in when this
      format stores them (8-bit: float32); None: the field's own dtype.
    suffixes: the state's attributes per field besides the field's own
      (``"_scales"``: ``mu_scales`` beside ``mu``).
    kernels: the custom kernels that read and write it themselves
      (``"native"``, ``"pallas"``); a leaf in a format a kernel does not name
      is stepped by the reference rule, which asks the format to
      :meth:`decode` and :meth:`encode`.
    in_row_slices: the reference rule steps a leaf larger than
      :data:`optax_hybrid.kernels.reference.SLICE_VALUES` in slices of rows
      (its decoded values are float32 temporaries XLA keeps whole).
  """

  name: str = "as stored"
  value_dtype: Any = None
  suffixes: tuple[str, ...] = ()
  kernels: tuple[str, ...] = ()
  in_row_slices: bool = False

  # Derived once (read in the traced step, where a property would be a call per leaf): the suffix of each array a
  # field keeps, in the order of ``arrays``: "" (the field's own attribute), then ``suffixes``; and whether the
  # format encodes its values (overrides :meth:`decode`, :meth:`encode`, :meth:`stored` or :meth:`arrays_of`; else
  # its stored value is the array of values itself): the engine reads and writes a format that stores the values
  # themselves without a call per field.
  attribute_suffixes: tuple[str, ...] = dataclasses.field(init=False, repr=False, compare=False)
  encodes: bool = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    object.__setattr__(self, "attribute_suffixes", ("",) + self.suffixes)
    object.__setattr__(self, "encodes", any(getattr(type(self), method) is not getattr(MomentFormat, method)
                                            for method in ("decode", "encode", "stored", "arrays_of")))

  def applies_to(self, shape: Sequence[int], dtype: Any, last_axis_shards: int = 1) -> bool:
    """Whether a leaf of ``shape`` and ``dtype``, its state's last axis split in ``last_axis_shards``, takes it."""
    del shape, dtype, last_axis_shards
    return True

  def arrays(self, shape: Sequence[int], dtype: Any) -> tuple[tuple[str, tuple, np.dtype], ...]:
    """``(suffix, shape, dtype)`` of each array kept for one field of a leaf of ``shape`` (``dtype``: the field's
    value dtype): the field's own attribute (suffix ``""``) first, then one per :attr:`suffixes`, in order."""
    return (("", tuple(shape), np.dtype(dtype)),)

  def initial(self, shape: Sequence[int], dtype: Any, fill: Any, *, signed: bool) -> list:
    """The arrays' contents for a field filled with ``fill`` (None: zeros): one per :meth:`arrays`, each None
    (zeros), a scalar to broadcast, or an array."""
    del shape, dtype, signed
    return [fill]

  def encode(self, values: Any, *, like: Any, signed: bool) -> Any:
    """The stored form of ``values`` (what :meth:`stored` makes of the arrays), as ``like`` (the value stored
    before) is stored."""
    del signed
    return values.astype(like.dtype)

  def decode(self, stored: Any, *, signed: bool) -> Any:
    """The values of a stored field (the inverse of :meth:`encode`, up to its rounding)."""
    del signed
    return stored

  def stored(self, arrays: Sequence[Any]) -> Any:
    """One field's stored value from its arrays, in the order of :meth:`arrays`."""
    return arrays[0]

  def arrays_of(self, stored: Any) -> list:
    """The arrays of one field's stored value (the inverse of :meth:`stored`)."""
    return [stored]

  def stored_fields(self, arrays: Sequence[Sequence[Any]]) -> tuple:
    """:meth:`stored` of each field's arrays, at once."""
    return tuple(self.stored(a) for a in arrays)

  def nbytes(self, shape: Sequence[int], dtype: Any) -> int:
    """Bytes of one field of a leaf of ``shape``."""
    return sum(int(np.prod(s)) * np.dtype(d).itemsize for _, s, d in self.arrays(shape, dtype))


@dataclasses.dataclass(frozen=True)
class Blockwise8bit(MomentFormat):
  """8-bit block-wise codes and per-block scales (:mod:`optax_hybrid.kernels.quantized`).

  Applies to real floating leaves of at least
  :data:`~optax_hybrid.kernels.quantized.MIN_QUANTIZED_SIZE` values whose
  blocks never straddle two shards; the others keep their values as stored.
  """

  name: str = "8bit"
  value_dtype: Any = np.dtype(np.float32)
  suffixes: tuple[str, ...] = ("_scales",)
  kernels: tuple[str, ...] = ("native", "pallas")
  in_row_slices: bool = True

  def applies_to(self, shape, dtype, last_axis_shards=1):
    return quantized.quantizable(shape, dtype, last_axis_shards)

  def arrays(self, shape, dtype):
    del dtype
    return (("", tuple(shape), quantized.CODE_DTYPE),
            ("_scales", quantized.scales_shape(shape), quantized.SCALE_DTYPE))

  def initial(self, shape, dtype, fill, *, signed):
    del dtype
    if fill is None:  # zero codes with zero scales are zeros
      return [None, None]
    return self.arrays_of(quantized.quantize(jnp.full(shape, fill, jnp.float32), signed=signed))

  def encode(self, values, *, like, signed):
    del like
    return quantized.quantize(values, signed=signed)

  def decode(self, stored, *, signed):
    return quantized.dequantize(stored, signed=signed)

  def stored(self, arrays):
    return quantized.QuantizedMoment(*arrays)

  def arrays_of(self, stored):
    return list(stored)

  def nbytes(self, shape, dtype):
    return quantized.bytes_per_moment(shape)


#: The values themselves, in each field's dtype (``moment_format`` None or a dtype name).
AS_STORED = MomentFormat(kernels=("native", "pallas"))
#: ``moment_format="8bit"``.
BLOCKWISE_8BIT = Blockwise8bit()
#: The formats by ``moment_format=`` name (a dtype name stores the values as they are, in that dtype).
BY_NAME = {BLOCKWISE_8BIT.name: BLOCKWISE_8BIT}
#: The suffixes of the state's attributes that the formats keep beside a field.
SUFFIXES = tuple(dict.fromkeys(s for f in BY_NAME.values() for s in f.suffixes))


def resolve(moment_format: Any) -> MomentFormat:
  """The format a ``moment_format=`` argument asks for: a format value, a name of :data:`BY_NAME`, or (None, a
  dtype name) :data:`AS_STORED`."""
  if isinstance(moment_format, MomentFormat):
    return moment_format
  return BY_NAME.get(moment_format, AS_STORED) if isinstance(moment_format, str) else AS_STORED


__all__ = ["AS_STORED", "BLOCKWISE_8BIT", "Blockwise8bit", "MomentFormat", "resolve"]
