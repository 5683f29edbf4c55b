"""Two small training tasks, float32 against 8-bit Adam moments, in JAX (ours) or PyTorch (torchao).

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/small_tasks_8bit.py            # optax_hybrid
    python benchmarks/small_tasks_8bit.py --framework torch   # torch.optim.AdamW vs torchao AdamW8bit

The tasks (the same ones tests/test_quantized.py checks) are defined with
NumPy, so both frameworks see the same data and initial weights:

* ``quadratic``: ``0.5 * sum(c * x**2)`` over a 64 x 256 matrix, curvatures
  ``c`` spread over four decades;
* ``regression``: a two-layer tanh network (64 -> 128 -> 64) fitting a fixed
  random teacher on 300 batches of 32.

AdamW without weight decay, learning rate 3e-2 on a cosine decay to 0 over
300 steps, defaults otherwise. Prints, per task and moment format, the mean
loss over the last 20 steps (on the last 20 batches for the regression) and
the 8-bit run's relative difference from float32.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

STEPS = 300
PEAK_LR = 3e-2


def task(name: str):
  """``(params as float32 NumPy arrays, batches)``; the loss is written per framework."""
  rng = np.random.default_rng(0)
  if name == "quadratic":
    curvature = np.exp(rng.uniform(-3, 1, size=(64, 256))).astype(np.float32)
    return {"x": rng.normal(size=(64, 256)).astype(np.float32)}, [curvature] * STEPS
  w_true = rng.normal(size=(64, 128)) / 8
  params = {"w1": (rng.normal(size=(64, 128)) / 8).astype(np.float32),
            "w2": (rng.normal(size=(128, 64)) / 11).astype(np.float32)}
  xs = rng.normal(size=(STEPS, 32, 64)).astype(np.float32)
  return params, [(x, (np.tanh(x @ w_true) @ (w_true.T / 2)).astype(np.float32)) for x in xs]


def lr_at(step: int) -> float:
  return PEAK_LR * 0.5 * (1 + math.cos(math.pi * min(step, STEPS) / STEPS))


def run_jax(name: str, moment_format: str) -> float:
  import jax
  import jax.numpy as jnp
  import optax
  import optax_hybrid

  params, batches = task(name)
  params = jax.tree.map(jnp.asarray, params)

  def loss(p, batch):
    if name == "quadratic":
      return 0.5 * jnp.sum(batch * p["x"] ** 2)
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

  tx = optax_hybrid.hybrid_adamw(optax.cosine_decay_schedule(PEAK_LR, STEPS), weight_decay=0.0, moment_format=moment_format)
  state = tx.init(params)

  @jax.jit
  def step(p, s, batch):
    return tx.step(p, s, jax.grad(loss)(p, batch))

  for batch in batches:
    params, state = step(params, state, batch)
  return float(np.mean([loss(params, b) for b in batches[-20:]]))


def run_torch(name: str, moment_format: str) -> float:
  import torch
  from torchao.optim import AdamW8bit

  params, batches = task(name)
  weights = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in params.items()}

  def loss(batch):
    if name == "quadratic":
      return 0.5 * torch.sum(torch.from_numpy(batch) * weights["x"] ** 2)
    x, y = (torch.from_numpy(a) for a in batch)
    return torch.mean((torch.tanh(x @ weights["w1"]) @ weights["w2"] - y) ** 2)

  kind = torch.optim.AdamW if moment_format == "float32" else AdamW8bit
  opt = kind(list(weights.values()), lr=PEAK_LR, weight_decay=0.0)
  for i, batch in enumerate(batches):
    for group in opt.param_groups:
      if torch.is_tensor(group["lr"]):  # torchao keeps the rate as a tensor
        group["lr"].fill_(lr_at(i))
      else:
        group["lr"] = lr_at(i)
    opt.zero_grad()
    loss(batch).backward()
    opt.step()
  with torch.no_grad():
    return float(np.mean([float(loss(b)) for b in batches[-20:]]))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--framework", choices=("jax", "torch"), default="jax")
  args = parser.parse_args(argv)
  run = run_jax if args.framework == "jax" else run_torch
  who = "optax_hybrid.hybrid_adamw" if args.framework == "jax" else "torch.optim.AdamW / torchao AdamW8bit"
  print("| task | optimizer | float32 moments | 8-bit moments | 8-bit vs float32 |")
  print("|---|---|---:|---:|---:|")
  for name in ("quadratic", "regression"):
    full, eight = run(name, "float32"), run(name, "8bit")
    print(f"| {name} | {who} | {full:.4g} | {eight:.4g} | {100 * (eight - full) / full:+.2f}% |")


if __name__ == "__main__":
  main()
