"""Memory and step time per placement tier, on the GPT-2-small shapes with bf16 params.

    PYTHONPATH=. python benchmarks/tiers.py [--scale 1.0] [--reps 5]

bf16 params and gradients with an fp32 master and fp32 moments: the "16 bytes
per weight to train, 2 to serve" setting. For each tier (all leaves in it, then
half the params on the host by ``offload_fraction``, then a quarter on disk by
``nvme_offload_fraction``), prints ``memory_report``'s bytes per weight on the
device, in host memory and on disk, and the median time of a donated, jitted
``tx.step``. On a CPU-only machine "device" memory is host RAM too: the
figures show where JAX places each array and what each tier costs in copies,
not a saving of physical memory.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, os.pardir))
import optax_hybrid  # noqa: E402
from step import gpt2_small_shapes  # noqa: E402


SETUPS = {
    "device": dict(tiers="device"),
    "host_state": dict(tiers="host_state"),
    "host": dict(tiers="host"),
    "disk": dict(tiers="disk"),
    "offload_fraction=0.5": dict(offload_fraction=0.5),
    "nvme 0.25 + host 0.25": dict(nvme_offload_fraction=0.25, offload_fraction=0.25),
}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--scale", type=float, default=1.0, help="shrink every leaf by this factor")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated subset of: " + ", ".join(SETUPS))
  args = parser.parse_args(argv)
  shapes = gpt2_small_shapes(args.scale)
  n = sum(math.prod(s) for s in shapes.values())
  device = jax.devices()[0]
  print(f"{device.platform} ({device.device_kind}), jax {jax.__version__}; GPT-2-small shapes x {args.scale}: "
        f"{n / 1e6:.1f}M bf16 params in {len(shapes)} leaves; fp32 master and moments")
  print(f"| {'setup':<22} | {'device B/w':>10} | {'host B/w':>8} | {'disk B/w':>8} | {'step ms':>8} |")
  print(f"|{'-' * 24}|{'-' * 12}|{'-' * 10}|{'-' * 10}|{'-' * 10}|")
  results = {}
  for name in args.setups.split(","):
    params = jax.device_put({k: jnp.full(s, 0.5, jnp.bfloat16) for k, s in shapes.items()}, device)
    grads = jax.device_put({k: jnp.full(s, 1e-3, jnp.bfloat16) for k, s in shapes.items()}, device)
    tx = optax_hybrid.hybrid_adamw(1e-4, weight_decay=0.1, master_dtype=jnp.float32, mu_dtype=jnp.float32,
                                   nu_dtype=jnp.float32, **SETUPS[name])
    state = tx.init(params)
    report = optax_hybrid.memory_report(params, state)
    step = jax.jit(tx.step, donate_argnums=(0, 1))
    for _ in range(2):  # compile; the second call sees committed outputs
      params, state = step(params, state, grads)
    jax.block_until_ready(params)
    times = []
    for _ in range(args.reps):
      t = time.perf_counter()
      params, state = step(params, state, grads)
      jax.block_until_ready(params)
      times.append(time.perf_counter() - t)
    ms = statistics.median(times) * 1e3
    results[name] = (report, ms)
    print(f"| {name:<22} | {report.bytes_per_weight_device:10.2f} | {report.bytes_per_weight_host:8.2f} | "
          f"{report.bytes_per_weight_disk:8.2f} | {ms:8.1f} |", flush=True)
    tx.close()
    del params, grads, state
  print(f"\nServing: {next(iter(results.values()))[0].serving_bytes_per_weight:.2f} bytes per weight.")
  for name, (report, _) in results.items():
    if name == "offload_fraction=0.5":
      print(f"\nmemory_report for {name}:\n{report}")
  return results


if __name__ == "__main__":
  main()
