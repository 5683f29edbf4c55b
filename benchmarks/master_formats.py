"""Master weight formats on bf16 training: no master, float32, kahan, stochastic, side by side.

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/master_formats.py                 # both tasks
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/master_formats.py --task regression --seeds 3
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/master_formats.py --memory-table

Two tasks, every parameter in bfloat16, trained with ``hybrid_adamw`` once per
``master=`` (None, "float32", "kahan", "stochastic"), the same data and initial
weights for each:

* ``regression``: a linear map 64 -> 16 fitting a teacher ``W*`` (entries
  N(0, 0.5)) plus noise of standard deviation 0.5, started at ``W*`` plus
  N(0, 0.2). AdamW at 1e-3 on a cosine decay to 0 over 1500 steps, batches of
  64: each step is below half a bf16 unit in the last place of most weights
  (2**-9 for weights in [0.25, 0.5)), so without a master most updates round
  away and the run stalls. Validation: the mean squared error on 4096 held-out
  examples (the noise floor is 0.25).
* ``char_gpt``: examples/char_gpt.py's model (2 blocks, d_model 64, 4 heads,
  context 64) with its params cast to bfloat16, trained by the example's
  recipe (``standard_optimizer``: clipping, warmup-cosine AdamW, peak 3e-3)
  for 300 steps of 16 windows. Validation: the example's cross entropy on
  its held-out text (nats per character).

Prints each format's final validation loss and its ratio to float32's, and the
optimizer state's host bytes per weight (the master's share included).
``--seeds N`` repeats the regression with N seeds (data, teacher and start).

``--memory-table`` prints, instead, the bytes per weight in device, host and
disk memory (``memory_report``: params, gradients, moments, master) of bf16
params with float32 moments, for every tier and master format, and for params
that themselves live in host memory (streamed layers: ``scan_layers``).
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_hybrid

MASTERS = (None, "float32", "kahan", "stochastic")


def regression(master, steps: int = 1500, seed: int = 0) -> tuple[float, object]:
  rng = np.random.default_rng(seed)
  d_in, d_out, batch = 64, 16, 64
  w_true = rng.normal(0, 0.5, (d_in, d_out))
  x_val = rng.normal(size=(4096, d_in))
  y_val = x_val @ w_true + rng.normal(0, 0.5, (4096, d_out))
  xs = rng.normal(size=(steps, batch, d_in))
  ys = xs @ w_true + rng.normal(0, 0.5, (steps, batch, d_out))
  params = {"w": jnp.asarray(w_true + rng.normal(0, 0.2, (d_in, d_out)), jnp.bfloat16)}
  schedule = optax.cosine_decay_schedule(1e-3, steps)
  tx = optax_hybrid.hybrid_adamw(schedule, master=master, state_memory_kind="pinned_host")
  state = tx.init(params)

  def mse(p, x, y):
    return jnp.mean(((x.astype(jnp.bfloat16) @ p["w"]).astype(jnp.float32) - y) ** 2)

  @jax.jit
  def step(p, s, x, y):
    g = jax.grad(mse)(p, x, y)
    return tx.step(p, s, g)

  for k in range(steps):
    params, state = step(params, state, jnp.asarray(xs[k], jnp.float32), jnp.asarray(ys[k], jnp.float32))
  return float(mse(params, jnp.asarray(x_val, jnp.float32), jnp.asarray(y_val, jnp.float32))), (params, state)


def char_gpt(master, steps: int = 300) -> tuple[float, object]:
  from flax import nnx

  from examples import char_gpt as example

  seq_len, batch = 64, 16
  corpus = example.load_corpus()
  vocab = example.Vocab(corpus.train_text + corpus.val_text)
  train_ids, val_ids = vocab.encode(corpus.train_text), vocab.encode(corpus.val_text)
  model = nnx.jit(lambda: example.CharGPT(len(vocab), seq_len, 2, 64, 4, nnx.Rngs(0)))()
  nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model, nnx.Param)))
  tx = optax_hybrid.standard_optimizer(3e-3, steps, master=master, state_memory_kind="pinned_host")
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  nnx.update((model, optimizer), optax_hybrid.commit(nnx.state((model, optimizer))))

  @nnx.jit(donate_argnums=(0, 1))
  def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(example.cross_entropy)(model, x, y)
    optimizer.update(model, grads)
    return loss

  for k in range(1, steps + 1):
    x, y = example.train_batch(train_ids, k, batch, seq_len, 0)
    train_step(model, optimizer, x, y)
  eval_step = nnx.jit(example.cross_entropy)
  eval_x, eval_y = example.eval_windows(val_ids, seq_len, batch)
  val = float(np.mean([eval_step(model, x, y) for x, y in zip(eval_x, eval_y)]))
  return val, (nnx.state(model, nnx.Param), optimizer.opt_state)


TASKS = {"regression": regression, "char_gpt": char_gpt}


def memory_table() -> None:
  """Bytes per weight by memory for bf16 params, float32 moments: every tier and master format."""
  device = jax.devices()[0]
  kinds = {"device": "device", "host": "pinned_host"}
  setups = [(tier, "device") for tier in ("device", "host_state", "host", "disk")] + [("host", "host")]
  print("| tier | params live in | " + " | ".join(f"master={m}" for m in MASTERS) + " |")
  print("|---|---|" + "---|" * len(MASTERS))
  for tier, where in setups:
    sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=kinds[where])
    params = jax.device_put({"w": jnp.zeros((1024, 1024), jnp.bfloat16)}, sharding)
    cells = []
    for master in MASTERS:
      tx = optax_hybrid.hybrid_adamw(1e-3, mu_dtype=jnp.float32, nu_dtype=jnp.float32, master=master, tiers=tier)
      r = optax_hybrid.memory_report(params, tx.init(params))
      cells.append(f"{r.bytes_per_weight_device:.2f} / {r.bytes_per_weight_host:.2f} / {r.bytes_per_weight_disk:.2f}")
      tx.close()
    print(f"| {tier} | {where} memory | " + " | ".join(cells) + " |")
  print("(device / host / disk bytes per weight: bf16 param and gradient, float32 moments, the master's share)")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--task", choices=(*TASKS, "all"), default="all")
  parser.add_argument("--seeds", type=int, default=1, help="regression: repeat with this many seeds (default 1)")
  parser.add_argument("--memory-table", action="store_true", help="print bytes per weight instead of training")
  args = parser.parse_args()
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} device(s)")
  if args.memory_table:
    memory_table()
    return
  for name in TASKS if args.task == "all" else (args.task,):
    for seed in range(args.seeds if name == "regression" else 1):
      run = TASKS[name] if name != "regression" else lambda m, seed=seed: regression(m, seed=seed)
      results = {}
      for master in MASTERS:
        started = time.perf_counter()
        loss, (params, state) = run(master)
        report = optax_hybrid.memory_report(params, state)
        results[master] = loss
        print(f"{name:10s} seed {seed} master={str(master):10s} validation loss {loss:.5f}  "
              f"({time.perf_counter() - started:.0f} s; state host {report.bytes_per_weight_host:.2f} B/weight, "
              f"of which master {report.by_component['master_weights']['host'] / report.num_params:.2f})", flush=True)
      base = results["float32"]
      print(f"{name} seed {seed}: validation loss / float32's: " + ", ".join(
          f"{m}: {results[m] / base:.4f}" for m in MASTERS) + "\n", flush=True)
      if not all(math.isfinite(v) for v in results.values()):
        raise SystemExit(f"{name}: a run diverged")


if __name__ == "__main__":
  main()
