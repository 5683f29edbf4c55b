"""Compiles small programs of known step time for the H200 target and estimates them (tests/test_step_time_compile.py).

    JAX_PLATFORMS=cpu python tests/step_time_compile_script.py

Prints one JSON line per program: ``{"program": name, "estimate":
StepTime.as_dict(), "loops": [LoopTransfers...]}``. The programs
(:data:`PROGRAMS`) and their sizes are what the test works its expected times
out from:

* ``copy_loop``: a loop over ``LAYERS`` slices of a ``(LAYERS, N, N)`` bf16
  stack in ``pinned_host``, each brought to the device and one element of it
  added up: the link's time alone;
* ``matmul_chain``: ``CHAIN`` products of ``N x N`` bf16 matrices, on the device;
* ``fetch_then_compute``: the loop brings slice ``i`` to the device, then
  multiplies the carry ``(ROWS, N)`` by it ``DOTS`` times;
* ``fetch_ahead``: the same, with slice ``i + 1`` fetched in trip ``i`` (the
  loop carries it), as ``optax_hybrid.scan_layers`` does.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from optax_hybrid import gpu_compile  # noqa: E402
from optax_hybrid.gpu_compile import step_time  # noqa: E402

LAYERS, N, ROWS, DOTS, CHAIN = 8, 4096, 4096, 8, 3
TARGET = "h200"


def _fetch(stack, i):
  return jax.device_put(lax.dynamic_index_in_dim(stack, i, 0, keepdims=False), jax.memory.Space.Device)


def copy_loop(stack):
  return lax.fori_loop(0, LAYERS, lambda i, acc: acc + _fetch(stack, i)[0, 0].astype(jnp.float32), jnp.float32(0))


def matmul_chain(a, b):
  for _ in range(CHAIN):
    a = a @ b
  return a


def _layer(x, w):
  for _ in range(DOTS):
    x = x @ w
  return x


def fetch_then_compute(stack, x):
  return lax.fori_loop(0, LAYERS, lambda i, x: _layer(x, _fetch(stack, i)), x)


def fetch_ahead(stack, x):
  def body(i, carry):
    x, w = carry
    following = _fetch(stack, jnp.minimum(i + 1, LAYERS - 1))
    return _layer(x, w), following
  return lax.fori_loop(0, LAYERS, body, (x, _fetch(stack, 0)))[0]


def main():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
  on = lambda kind: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=kind)
  stack = jax.ShapeDtypeStruct((LAYERS, N, N), jnp.bfloat16, sharding=on("pinned_host"))
  square = jax.ShapeDtypeStruct((N, N), jnp.bfloat16, sharding=on("device"))
  rows = jax.ShapeDtypeStruct((ROWS, N), jnp.bfloat16, sharding=on("device"))
  programs = {"copy_loop": (copy_loop, stack), "matmul_chain": (matmul_chain, square, square),
              "fetch_then_compute": (fetch_then_compute, stack, rows), "fetch_ahead": (fetch_ahead, stack, rows)}
  for name, (fn, *args) in programs.items():
    report = gpu_compile.compile_for_gpu(fn, *args, target=TARGET)
    estimate = report.step_time()
    assert estimate.hardware is step_time.HARDWARE[TARGET]
    print(json.dumps(dict(program=name, estimate=estimate.as_dict(), warnings=list(report.warnings),
                          loops=[vars(x) for x in gpu_compile.loop_transfers(report.hlo)])), flush=True)


if __name__ == "__main__":
  main()
