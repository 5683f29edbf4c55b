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
