"""Trace, compile and step time of ``tx.step`` per tier, for comparing two versions of the package.

    PYTHONPATH=. python benchmarks/trace_and_step.py [--scale 0.25] [--reps 5]

Prints one JSON line per setup (GPT-2-small shapes, bf16 params, fp32 master and
moments, a donated jitted ``tx.step``): the seconds to trace and lower, to
compile, and the median step in ms (``--trace-only N``: the minimum and median
of N traces alone). Run it alternately against two checkouts
(``PYTHONPATH=<old>`` / ``PYTHONPATH=<new>``) to get same-run ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import optax_hybrid  # noqa: E402
from step import gpt2_small_shapes  # noqa: E402

SETUPS = {"device native": dict(tiers="device", kernel="native"),
          "device xla": dict(tiers="device", kernel="xla"),
          "host_state native": dict(tiers="host_state", kernel="native"),
          "host native": dict(tiers="host", kernel="native")}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--scale", type=float, default=0.25)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated subset of: " + ", ".join(SETUPS))
  parser.add_argument("--trace-only", type=int, default=0, metavar="N",
                      help="only trace (no lowering, compile or step), N times per setup: min and median seconds")
  args = parser.parse_args(argv)
  shapes = gpt2_small_shapes(args.scale)
  device = jax.devices()[0]
  for name in args.setups.split(","):
    kwargs = SETUPS[name]
    params = jax.device_put({k: jnp.full(s, 0.5, jnp.bfloat16) for k, s in shapes.items()}, device)
    grads = jax.device_put({k: jnp.full(s, 1e-3, jnp.bfloat16) for k, s in shapes.items()}, device)
    tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, mu_dtype=jnp.float32, nu_dtype=jnp.float32,
                                   master_dtype=jnp.float32, **kwargs)
    state = tx.init(params)
    if args.trace_only:
      traces = []
      for _ in range(args.trace_only):  # a new jit each time: no trace cache
        start = time.perf_counter()
        jax.jit(tx.step, donate_argnums=(0, 1)).trace(params, state, grads)
        traces.append(time.perf_counter() - start)
      print(json.dumps({"setup": name, "trace_min_s": round(min(traces), 3),
                        "trace_median_s": round(statistics.median(traces), 3),
                        "version": os.path.dirname(os.path.dirname(optax_hybrid.__file__))}), flush=True)
      continue
    step = jax.jit(tx.step, donate_argnums=(0, 1))
    t0 = time.perf_counter()
    lowered = step.trace(params, state, grads).lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    times = []
    for _ in range(args.reps + 1):
      start = time.perf_counter()
      params, state = compiled(params, state, grads)
      jax.block_until_ready(params)
      times.append(time.perf_counter() - start)
    print(json.dumps({"setup": name, "trace_s": round(t1 - t0, 3), "compile_s": round(t2 - t1, 3),
                      "step_ms": round(1e3 * statistics.median(times[1:]), 2),
                      "version": os.path.dirname(os.path.dirname(optax_hybrid.__file__))}), flush=True)


if __name__ == "__main__":
  main()
