"""Print how far hybrid_adamw is from a float64 reference, optax.adamw and (if installed) torch.

    python benchmarks/parity.py [--steps 50]

For every flag combination, runs the same gradients through hybrid_adamw with
a warmup-cosine schedule and prints the max absolute and max relative
difference of the params against a float64 NumPy model of torch.optim.AdamW /
Adam, against optax.adamw (AdamW mode), and against torch.optim.AdamW / Adam
run in float32 when torch is importable. Figures, not a test.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))
import optax_hybrid  # noqa: E402
from numpy_reference import adamw_steps, colossal_lr  # noqa: E402

SHAPES = {"w": (256, 129), "b": (129,), "s": ()}


def errors(ours, ref):
  abs_err = max(float(np.max(np.abs(np.asarray(ours[k], np.float64) - ref[k]), initial=0.0)) for k in ref)
  rel_err = max(float(np.max(np.abs(np.asarray(ours[k], np.float64) - ref[k]) / np.maximum(np.abs(ref[k]), 1e-3), initial=0.0)) for k in ref)
  return abs_err, rel_err


def torch_run(params, grads, lrs, *, adamw_mode, bias_correction, **kw):
  import torch
  if not bias_correction:
    return None
  tensors = {k: torch.tensor(np.asarray(v), dtype=torch.float32, requires_grad=True) for k, v in params.items()}
  cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
  opt = cls(list(tensors.values()), lr=lrs[0], betas=(kw["b1"], kw["b2"]), eps=kw["eps"], weight_decay=kw["weight_decay"])
  for g, lr in zip(grads, lrs):
    for group in opt.param_groups:
      group["lr"] = lr
    for k, t in tensors.items():
      t.grad = torch.tensor(g[k])
    opt.step()
  return {k: t.detach().numpy() for k, t in tensors.items()}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--steps", type=int, default=50)
  args = parser.parse_args(argv)
  try:
    import torch  # noqa: F401
    have_torch = True
  except ImportError:
    have_torch = False
  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}
  grads = [{k: (rng.normal(size=s) * 10.0 ** rng.integers(-3, 2)).astype(np.float32) for k, s in SHAPES.items()}
           for _ in range(args.steps)]
  peak, total, warmup, eta_min = 1e-2, args.steps, max(1, args.steps // 10), 1e-3
  sched = optax_hybrid.warmup_cosine_schedule(peak, total, warmup, eta_min)
  lrs = [colossal_lr(k, peak, total, warmup, eta_min) for k in range(args.steps)]
  print(f"jax {jax.__version__}, optax {optax.__version__}, {jax.devices()[0].platform}; "
        f"{sum(math.prod(s) for s in SHAPES.values())} params, {args.steps} steps, warmup-cosine lr")
  header = f"{'adamw_mode':>10} {'bias_corr':>9} {'wd':>4} | {'vs float64 abs':>14} {'rel':>9} | {'vs optax abs':>12} {'rel':>9} | {'vs torch abs':>12} {'rel':>9}"
  print(header)
  for adamw_mode, bias_correction, wd in itertools.product([True, False], [True, False], [0.0, 0.1]):
    kw = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=wd)
    tx = optax_hybrid.hybrid_adamw(sched, bias_correction=bias_correction, adamw_mode=adamw_mode, **kw)
    step = jax.jit(lambda p, s, g, tx=tx: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
    p, s = params, tx.init(params)
    for g in grads:
      p, s = step(p, s, g)
    hist, _, _ = adamw_steps(params, grads, lrs, bias_correction=bias_correction, adamw_mode=adamw_mode, **kw)
    ref_err = errors(p, hist[-1])
    optax_cell = " " * 12 + " " + " " * 9
    if adamw_mode and bias_correction:
      otx = optax.adamw(sched, **kw)
      ostep = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*otx.update(g, s, p)))
      op, os_ = params, otx.init(params)
      for g in grads:
        op, os_ = ostep(op, os_, g)
      oe = errors(p, {k: np.asarray(v, np.float64) for k, v in op.items()})
      optax_cell = f"{oe[0]:12.2e} {oe[1]:9.2e}"
    torch_cell = "not installed" if not have_torch else " " * 12 + " " + " " * 9
    if have_torch:
      tp = torch_run(params, grads, lrs, adamw_mode=adamw_mode, bias_correction=bias_correction, **kw)
      if tp is not None:
        te = errors(p, {k: np.asarray(v, np.float64) for k, v in tp.items()})
        torch_cell = f"{te[0]:12.2e} {te[1]:9.2e}"
    print(f"{adamw_mode!s:>10} {bias_correction!s:>9} {wd:>4} | {ref_err[0]:14.2e} {ref_err[1]:9.2e} | {optax_cell} | {torch_cell}")


if __name__ == "__main__":
  main()
