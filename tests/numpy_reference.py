"""Independent float64 NumPy models, written from the published update rules.

Nothing here imports optax_hybrid: these are the references the tests compare
the library against. The AdamW rule follows torch.optim.AdamW / Adam and
ColossalAI's CPUAdam (reference.md, section 1); the schedule follows ColossalAI's
CosineAnnealingWarmupLR with a floor after total_steps.
"""

import math

import numpy as np


def colossal_lr(k, peak, total, warmup, eta_min):
  if k < warmup:
    return (k + 1) / warmup * peak
  if k >= total:
    return eta_min
  return eta_min + (peak - eta_min) * (1 + math.cos(math.pi * (k - warmup) / (total - warmup))) / 2


def adamw_steps(params, grads_per_step, lrs, *, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
                bias_correction=True, adamw_mode=True, decay_mask=None):
  """Runs the torch-style rule in float64 over a dict of arrays.

  Returns (params after each step, final m, final v), all float64.
  """
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  history = []
  for t, (grads, lr) in enumerate(zip(grads_per_step, lrs), start=1):
    for k in p:
      wd = weight_decay if (decay_mask is None or decay_mask[k]) else 0.0
      g = np.asarray(grads[k], np.float64)
      if not adamw_mode:
        g = g + wd * p[k]
      m[k] = b1 * m[k] + (1 - b1) * g
      v[k] = b2 * v[k] + (1 - b2) * g * g
      bc1 = 1 - b1**t if bias_correction else 1.0
      bc2 = 1 - b2**t if bias_correction else 1.0
      denom = np.sqrt(v[k]) / math.sqrt(bc2) + eps
      if adamw_mode:
        p[k] = p[k] * (1 - lr * wd)
      p[k] = p[k] - lr / bc1 * m[k] / denom
    history.append({k: x.copy() for k, x in p.items()})
  return history, m, v


def adamw_steps_stored_as(params, grads_per_step, lr, store_dtype, *, b1=0.9, b2=0.999, eps=1e-8,
                          weight_decay=0.0):
  """AdamW (decoupled decay) in float64 with the params rounded to ``store_dtype`` after each step.

  Models low-precision params with exact moments: returns (params after each
  step, final m), float64.
  """
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  history = []
  for t, grads in enumerate(grads_per_step, start=1):
    for k in p:
      g = np.asarray(grads[k], np.float64)
      m[k] = b1 * m[k] + (1 - b1) * g
      v[k] = b2 * v[k] + (1 - b2) * g * g
      u = -lr * weight_decay * p[k] - lr / (1 - b1**t) * m[k] / (np.sqrt(v[k]) / math.sqrt(1 - b2**t) + eps)
      p[k] = np.asarray((p[k] + u).astype(store_dtype), np.float64)
    history.append({k: x.copy() for k, x in p.items()})
  return history, m


# ---------------------------------------------------------------------------
# 8-bit block-wise moments (Dettmers et al. 2021, "8-bit Optimizers via
# Block-wise Quantization"), modelled from the paper's description: dynamic
# tree maps, block absmax scales along the last axis, nearest code.

QUANT_BLOCK = 256


def dynamic_tree_map(signed):
  """The paper's dynamic data type as a sorted float64 array of 256 values.

  A code is [sign bit] then E zero bits (the value's decade, 10**-E), a one
  bit, then linear fraction bits dividing (0.1, 1] of that decade; all
  zeros is 0. Built by enumerating every bit pattern.
  """
  values = []
  magnitude_bits = 7 if signed else 8
  for code in range(2**magnitude_bits):
    bits = format(code, f"0{magnitude_bits}b")
    if "1" not in bits:
      values.append(0.0)
      continue
    e = bits.index("1")
    fraction_bits = bits[e + 1:]
    steps = 2**len(fraction_bits)
    i = int(fraction_bits, 2) if fraction_bits else 0
    values.append(10.0**-e * (0.1 + 0.9 * (i + 1) / steps))
  values = np.asarray(values)
  if signed:
    values = np.concatenate([values, -values])
  return np.sort(values)


def quantize_blockwise(x, signed):
  """float64 ``x`` (..., L) -> (codes as indices into the sorted map, scales (..., ceil(L/256))).

  The nearest map value to x/scale (lowest index on a tie), scale = the
  block's max |x| (0 for an all-zero block, whose codes are those of 0).
  """
  table = dynamic_tree_map(signed)
  x = np.asarray(x, np.float64)
  last = x.shape[-1]
  nb = -(-last // QUANT_BLOCK)
  padded = np.zeros(x.shape[:-1] + (nb * QUANT_BLOCK,))
  padded[..., :last] = x
  blocks = padded.reshape(x.shape[:-1] + (nb, QUANT_BLOCK))
  scales = np.abs(blocks).max(axis=-1)
  normalized = blocks / np.where(scales > 0, scales, 1.0)[..., None]
  codes = np.abs(normalized[..., None] - table).argmin(axis=-1)
  return codes.reshape(x.shape[:-1] + (nb * QUANT_BLOCK,))[..., :last], scales


def dequantize_blockwise(codes, scales, signed):
  """The float64 values of (codes, scales)."""
  table = dynamic_tree_map(signed)
  per_value = np.repeat(np.asarray(scales, np.float64), QUANT_BLOCK, axis=-1)[..., :codes.shape[-1]]
  return table[np.asarray(codes, np.int64)] * per_value


def adamw_step_8bit(g, p, m_codes, m_scales, v_codes, v_scales, *, lr, t, b1=0.9, b2=0.999, eps=1e-8,
                    weight_decay=0.0, adamw_mode=True, bias_correction=True):
  """One AdamW step with 8-bit moments, float64: dequantize, step, quantize.

  The update uses the new moments before quantization (as bitsandbytes'
  8-bit Adam does). Returns (new param, (m codes, m scales), (v codes, v scales)).
  """
  g = np.asarray(g, np.float64)
  p = np.asarray(p, np.float64)
  if not adamw_mode:
    g = g + weight_decay * p
  m = b1 * dequantize_blockwise(m_codes, m_scales, True) + (1 - b1) * g
  v = b2 * dequantize_blockwise(v_codes, v_scales, False) + (1 - b2) * g * g
  bc1 = 1 - b1**t if bias_correction else 1.0
  bc2 = 1 - b2**t if bias_correction else 1.0
  new_p = p - lr / bc1 * m / (np.sqrt(v) / math.sqrt(bc2) + eps)
  if adamw_mode:
    new_p = new_p - lr * weight_decay * p
  return new_p, quantize_blockwise(m, True), quantize_blockwise(v, False)


# --- the other rules, float64, from their papers / Optax's documented formulas -------------------------

def lion_step64(g, p, m, *, lr, b1, b2, weight_decay):
  """One Lion step (Chen et al. 2023): (new param, new momentum)."""
  g, p, m = (np.asarray(x, np.float64) for x in (g, p, m))
  new_p = p - lr * (np.sign((1 - b1) * g + b1 * m) + weight_decay * p)
  return new_p, (1 - b2) * g + b2 * m


def adagrad_step64(g, p, s, *, lr, eps):
  """One Adagrad step as optax.adagrad writes it (no update where the sum is 0): (new param, new sum)."""
  g, p, s = (np.asarray(x, np.float64) for x in (g, p, s))
  s = s + g * g
  safe = np.where(s > 0, s, 1.0)
  return p - lr * np.where(s > 0, g / np.sqrt(safe + eps), 0.0), s


def sgd_step64(g, p, b, *, lr, momentum, nesterov):
  """One SGD step with momentum (PyTorch's and optax.sgd's form): (new param, new momentum buffer)."""
  g, p, b = (np.asarray(x, np.float64) for x in (g, p, b))
  b = g + momentum * b
  return p - lr * (g + momentum * b if nesterov else b), b
