r"""8-bit block-wise moments: the storage format, once, in plain ``jax.numpy``.

A quantized moment of a leaf with shape ``(..., L)`` is stored as

* ``codes``: ``uint8`` of the leaf's own shape, an index into a 256-value code
  map;
* ``scales``: ``float32`` of shape ``(..., ceil(L / BLOCK_SIZE))``, one per
  *block*: :data:`BLOCK_SIZE` consecutive values along the last axis (the last
  block of a row may be shorter).

A value is ``code_map[code] * scale``. Quantizing a block sets its scale to the
block's largest magnitude and each code to the map entry nearest to the
normalized value ``x / scale`` (ties to the lower entry); an all-zero block
has scale 0 and decodes to zeros. The normalized value is computed as
``x * (1 / scale)``, one division per block as bitsandbytes does
(:func:`normalize`). The first moment uses :data:`SIGNED_MAP`, the second
:data:`UNSIGNED_MAP`: the *dynamic* maps of Dettmers et al. (2021), "8-bit
Optimizers via Block-wise Quantization", which spend their codes on every
decade from 1 down to 1e-6 (signed) or 1e-7 (unsigned) instead of on a linear
grid, so small moments in a block of large ones keep a few significant bits.

Memory: 1 byte per value plus 4 bytes per block, 1.016 bytes per value for
blocks of 256 (2.03 for both moments, against 8 in float32).

The kernels dequantize, run the AdamW rule in float32 on the *unquantized*
new moments (the update uses them before they are rounded), and quantize the
new moments for storage, inside their one pass over the leaf.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_hybrid import _compat

# Values per block along the last axis (bitsandbytes' block size for 8-bit
# Adam is 2048; 256 costs 0.016 extra bytes per value and bounds the error of
# a block by its own largest value, not by one 8x larger).
BLOCK_SIZE = 256

# Leaves with fewer values keep float32 moments (bitsandbytes keeps tensors of
# under 4096 values in 32 bit): they are a small part of the memory, and
# biases and norms are where quantization error would cost the most.
MIN_QUANTIZED_SIZE = 4096

CODE_DTYPE = np.dtype(np.uint8)
SCALE_DTYPE = np.dtype(np.float32)


class QuantizedMoment(NamedTuple):
  """One leaf's moment in the 8-bit block-wise format (a pytree of two arrays)."""

  codes: jax.Array
  scales: jax.Array


def _dynamic_magnitudes(bits: int) -> np.ndarray:
  """The non-negative values of a dynamic map on ``bits`` bits, ascending, 0 included (``2**bits`` values).

  A code's leading zeros give its decade ``e`` (values ``10**-e`` down to
  ``10**-(e+1)``), the first one bit ends the exponent and the remaining
  ``bits - 1 - e`` bits split the decade linearly; the all-zero code is 0.
  """
  values = [0.0]
  for e in range(bits):
    fraction_bits = bits - 1 - e
    steps = 2**fraction_bits
    values += [10.0**-e * (0.1 + 0.9 * (i + 1) / steps) for i in range(steps)]
  return np.sort(np.asarray(values, np.float64))


def dynamic_map(signed: bool) -> np.ndarray:
  """The 256 values of the signed or unsigned dynamic code map, ascending, as float32.

  Unsigned: the 8-bit dynamic magnitudes, 0 to 1. Signed: a sign bit and the
  7-bit magnitudes, -1 to 1 (zero appears twice, as -0 and +0).
  """
  if signed:
    magnitudes = _dynamic_magnitudes(7)
    values = np.concatenate([-magnitudes[::-1], magnitudes])
  else:
    values = _dynamic_magnitudes(8)
  assert values.shape == (256,)
  return values.astype(np.float32)


def _thresholds(code_map: np.ndarray) -> np.ndarray:
  """Midpoints between neighbouring map values, padded with +inf to 256 entries.

  The code of ``x`` is the number of thresholds below it (a branchless binary
  search over these 256 entries finds it in 8 steps): what :func:`encode`
  computes without a table.
  """
  mids = (code_map[:-1].astype(np.float64) + code_map[1:].astype(np.float64)) / 2
  return np.concatenate([mids, [np.inf]]).astype(np.float32)


SIGNED_MAP = dynamic_map(signed=True)
UNSIGNED_MAP = dynamic_map(signed=False)
SIGNED_THRESHOLDS = _thresholds(SIGNED_MAP)
UNSIGNED_THRESHOLDS = _thresholds(UNSIGNED_MAP)


def scales_shape(shape: Sequence[int]) -> tuple[int, ...]:
  """The shape of the per-block scales of a leaf of ``shape`` (ndim >= 1)."""
  *lead, last = shape
  return (*lead, -(-last // BLOCK_SIZE))


def quantizable(shape: Sequence[int], dtype, last_axis_shards: int = 1) -> bool:
  """Whether a leaf's moments take the 8-bit format (else they stay float32).

  Real floating leaves of at least :data:`MIN_QUANTIZED_SIZE` values whose
  blocks never straddle two shards of the state: the last axis is unsharded
  or each shard holds whole blocks.
  """
  if len(shape) == 0 or not jnp.issubdtype(dtype, jnp.floating) or int(np.prod(shape)) < MIN_QUANTIZED_SIZE:
    return False
  return last_axis_shards == 1 or (shape[-1] % last_axis_shards == 0
                                    and (shape[-1] // last_axis_shards) % BLOCK_SIZE == 0)


def bytes_per_moment(shape: Sequence[int]) -> int:
  """Bytes of one quantized moment of a leaf of ``shape``: its codes and scales."""
  return int(np.prod(shape)) * CODE_DTYPE.itemsize + int(np.prod(scales_shape(shape))) * SCALE_DTYPE.itemsize


def _as_blocks(x: jax.Array) -> jax.Array:
  """``(..., L)`` -> ``(..., nb, BLOCK_SIZE)``, the last block padded with zeros."""
  last = x.shape[-1]
  nb = -(-last // BLOCK_SIZE)
  pad = nb * BLOCK_SIZE - last
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(*x.shape[:-1], nb, BLOCK_SIZE)


def _from_blocks(x: jax.Array, last: int) -> jax.Array:
  """The inverse of :func:`_as_blocks`: ``(..., nb, BLOCK_SIZE)`` -> ``(..., last)``."""
  return x.reshape(*x.shape[:-2], x.shape[-2] * BLOCK_SIZE)[..., :last]


def _full_like(x: jax.Array, value: float) -> jax.Array:
  """``value`` broadcast like ``x``, in ``x``'s memory space (host compute types a bare constant as device)."""
  return _compat.zeros_like(x) + np.float32(value)


def _power_of_two(k: jax.Array) -> jax.Array:
  """``2.0 ** k`` for int32 ``k`` in [0, 127], exactly (built from the exponent bits)."""
  return lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def _magnitude_values(c: jax.Array, bits: int) -> jax.Array:
  """The dynamic magnitude of int32 index ``c`` (0 .. 2**bits - 1), by arithmetic: no table, no gather.

  Index ``c >= 1`` lies in decade ``k = floor(log2 c)``:
  ``10**(k - bits + 1) * (0.1 + 0.9 * ((c + 1) / 2**k - 1))``; index 0 is 0.
  """
  cf = c.astype(jnp.float32)
  k = (lax.bitcast_convert_type(jnp.maximum(cf, 1.0), jnp.int32) >> 23) - 127  # floor(log2 c), exactly
  top = bits - 1
  decade = _full_like(cf, 10.0**-top)
  for d in range(1, top + 1):
    decade = jnp.where(k >= d, _full_like(cf, 10.0**(d - top)), decade)
  value = decade * (0.1 + 0.9 * ((cf + 1.0) / _power_of_two(k) - 1.0))
  return value * (c > 0).astype(jnp.float32)


def _magnitude_codes(y: jax.Array, bits: int) -> jax.Array:
  """The index of the dynamic magnitude nearest to ``y`` in [0, 1] (ties to the lower), by arithmetic.

  The decade ``k`` counts the powers of ten below ``y``; within it the values
  are evenly spaced, so the nearest is a rounding (``ceil(t - 1/2)`` rounds a
  tie down); its lowest point is the previous decade's top value.
  """
  top = bits - 1
  k = _compat.zeros_like(y).astype(jnp.int32)
  for d in range(1, top + 1):
    k = k + (y > np.float32(10.0**(d - top - 1))).astype(jnp.int32)
  up = _full_like(y, 1.0)  # 10**(top - k): y * up lies in (0.1, 1]
  for d in range(top):
    up = jnp.where(k == d, _full_like(y, 10.0**(top - d)), up)
  steps = _power_of_two(k)
  j = jnp.clip(jnp.ceil((y * up - 0.1) / 0.9 * steps - 0.5), 0.0, steps).astype(jnp.int32)
  in_decade = (1 << k) - 1 + j
  # Decade 0 holds 0 and 10**-top only.
  lowest = (y > np.float32(0.5 * 10.0**-top)).astype(jnp.int32)
  return jnp.where(k >= 1, in_decade, lowest)


def decode(codes: jax.Array, *, signed: bool) -> jax.Array:
  """The code map's value of each uint8 code (:data:`SIGNED_MAP` / :data:`UNSIGNED_MAP`, to float32 rounding)."""
  c = codes.astype(jnp.int32)
  if not signed:
    return _magnitude_values(c, 8)
  positive = c >= 128
  magnitude = _magnitude_values(jnp.where(positive, c - 128, 127 - c), 7)
  return jnp.where(positive, magnitude, -magnitude)


def encode(x: jax.Array, *, signed: bool) -> jax.Array:
  """The uint8 code of the map value nearest to each ``x`` in [-1, 1] (unsigned: [0, 1]); ties to the lower code."""
  if not signed:
    return _magnitude_codes(x, 8).astype(jnp.uint8)
  magnitude = _magnitude_codes(jnp.abs(x), 7)
  return jnp.where(x > 0, 128 + magnitude, 127 - magnitude).astype(jnp.uint8)


def dequantize(q: QuantizedMoment, *, signed: bool) -> jax.Array:
  """The float32 values a quantized moment stands for."""
  last = q.codes.shape[-1]
  return _from_blocks(_as_blocks(decode(q.codes, signed=signed)) * q.scales[..., None], last)


# Scales above this have a subnormal reciprocal, which XLA and the native
# kernel flush to zero: normalize shrinks such a block by SHRINK_HUGE first.
LARGEST_RECIPROCAL_SCALE = np.float32(2.0**126)
SHRINK_HUGE = np.float32(2.0**-64)
SMALLEST_NORMAL = np.finfo(np.float32).tiny


def normalize(blocks: jax.Array, scales: jax.Array) -> jax.Array:
  """``blocks / scales[..., None]`` as every kernel computes it: ``blocks * (1 / scale)``.

  A multiplication per value and one division per block (a division per value
  costs the CPU kernel more than the rest of its quantization). A block whose
  scale exceeds ``2**126`` is multiplied by ``2**-64`` first, values and scale
  alike (exactly: a power of two), so that the reciprocal stays normal; a
  block whose scale is zero or subnormal (values that float32 arithmetic
  flushes to zero) takes 1 for its scale. The result is within an ulp or two of the
  exact quotient and at most ``1 + 2**-23`` in magnitude, which :func:`encode`
  maps to the end codes.
  """
  one = _full_like(scales, 1.0)
  shrink = jnp.where(scales > LARGEST_RECIPROCAL_SCALE, _full_like(scales, SHRINK_HUGE), one)
  safe = jnp.where(scales < SMALLEST_NORMAL, one, scales)
  return (blocks * shrink[..., None]) * (1.0 / (safe * shrink))[..., None]


def quantize(x: jax.Array, *, signed: bool) -> QuantizedMoment:
  """Quantizes float32 ``x`` (shape ``(..., L)``) block by block: scale = the block's largest magnitude."""
  blocks = _as_blocks(x.astype(jnp.float32))
  scales = jnp.max(jnp.abs(blocks), axis=-1)
  codes = encode(normalize(blocks, scales), signed=signed)
  return QuantizedMoment(_from_blocks(codes, x.shape[-1]), scales)


def zeros(shape: Sequence[int]) -> QuantizedMoment:
  """A zero moment of a leaf of ``shape`` (host NumPy arrays; the caller places them)."""
  return QuantizedMoment(np.zeros(shape, CODE_DTYPE), np.zeros(scales_shape(shape), SCALE_DTYPE))
