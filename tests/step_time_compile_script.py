"""Compiles small programs of known step time for the H200 target and estimates them (tests/test_step_time_compile.py).

    JAX_PLATFORMS=cpu python tests/step_time_compile_script.py [--only NAME]
    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/step_time_compile_script.py --node

Prints one JSON line per program: ``{"program": name, "estimate":
StepTime.as_dict(), "loops": [LoopTransfers...], "replica_groups": [...]}``.
The programs and their sizes are what the test works its expected times out
from. On one GPU:

* ``copy_loop``: a loop over ``LAYERS`` slices of a ``(LAYERS, N, N)`` bf16
  stack in ``pinned_host``, each brought to the device and one element of it
  added up: the link's time alone;
* ``matmul_chain``: ``CHAIN`` products of ``N x N`` bf16 matrices, on the device;
* ``fetch_then_compute``: the loop brings slice ``i`` to the device, then
  multiplies the carry ``(ROWS, N)`` by it ``DOTS`` times;
* ``fetch_ahead``: the same, with slice ``i + 1`` fetched in trip ``i`` (the
  loop carries it), as ``optax_hybrid.scan_layers`` does;
* ``tiny_loop``: ``TRIPS`` trips of ``TINY_KERNELS`` kernels on 256 floats
  each: launches, not arithmetic.

On a node of 8 (``--node``), each split as the SPMD partitioner splits it:

* ``all_gather``: ``(8 ROWS, N)`` f32 split on rows, doubled, returned whole;
* ``fsdp_matmul``: a batch ``(8 ROWS, N)`` bf16 split on rows times ``(N, N)``
  bf16 split on rows (FSDP: each GPU gathers the weight);
* ``reduce_scatter``: ``(8 SUM_ROWS, 8 SUM_COLUMNS)`` f32 split on rows, summed over
  them, the result split: each GPU reduces its rows, then the sums are
  reduce-scattered;
* ``two_axis_gather``: ``(ROWS, 4 N)`` f32 on a ``(2, 4)`` mesh, split over
  the second axis only, returned whole: groups of 4;
* ``shard_map_gather``: the first program's gather written with ``shard_map``.
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
TRIPS, TINY_KERNELS = 1000, 8
SUM_ROWS, SUM_COLUMNS = 8, 256 * N
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


def tiny_loop(x):
  def body(i, x):
    for _ in range(TINY_KERNELS):  # a cumulative sum between two maps: no fusion joins them
      x = jnp.cumsum(jnp.sin(x) + i)
    return x
  return lax.fori_loop(0, TRIPS, body, x)


def one_gpu_programs() -> dict:
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
  on = lambda kind: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=kind)
  stack = jax.ShapeDtypeStruct((LAYERS, N, N), jnp.bfloat16, sharding=on("pinned_host"))
  square = jax.ShapeDtypeStruct((N, N), jnp.bfloat16, sharding=on("device"))
  rows = jax.ShapeDtypeStruct((ROWS, N), jnp.bfloat16, sharding=on("device"))
  return {"copy_loop": (copy_loop, stack), "matmul_chain": (matmul_chain, square, square),
          "fetch_then_compute": (fetch_then_compute, stack, rows), "fetch_ahead": (fetch_ahead, stack, rows),
          "tiny_loop": (tiny_loop, jax.ShapeDtypeStruct((256,), jnp.float32, sharding=on("device")))}


def node_programs() -> dict:
  """Programs over 8 devices whose collectives XLA's SPMD partitioner inserts (and one written with shard_map)."""
  P = jax.sharding.PartitionSpec
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  grid = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  on = lambda m, *spec: jax.sharding.NamedSharding(m, P(*spec))
  split = lambda shape, dtype, m=mesh, spec=("fsdp", None): jax.ShapeDtypeStruct(shape, dtype, sharding=on(m, *spec))
  gather = lambda a: jax.shard_map(lambda b: lax.all_gather(b, "fsdp", tiled=True), mesh=mesh, in_specs=P("fsdp"),
                                   out_specs=P(), check_vma=False)(a)
  return {
      "all_gather": (jax.jit(lambda a: a * 2, out_shardings=on(mesh)), split((8 * ROWS, N), jnp.float32)),
      "fsdp_matmul": (jax.jit(lambda b, w: b @ w, out_shardings=on(mesh, "fsdp", None)),
                      split((8 * ROWS, N), jnp.bfloat16), split((N, N), jnp.bfloat16)),
      "reduce_scatter": (jax.jit(lambda g: g.sum(0), out_shardings=on(mesh, "fsdp")),
                         split((8 * SUM_ROWS, 8 * SUM_COLUMNS), jnp.float32)),
      "two_axis_gather": (jax.jit(lambda a: a * 2, out_shardings=on(grid)),
                          split((ROWS, 4 * N), jnp.float32, grid, (None, "b"))),
      "shard_map_gather": (jax.jit(gather), split((8 * ROWS, N), jnp.float32)),
  }


def main():
  node = "--node" in sys.argv
  programs = node_programs() if node else one_gpu_programs()
  if "--only" in sys.argv:
    programs = {k: v for k, v in programs.items() if k == sys.argv[sys.argv.index("--only") + 1]}
  for name, (fn, *args) in programs.items():
    report = gpu_compile.compile_for_gpu(fn, *args, target=TARGET, num_devices=8 if node else 1)
    estimate = report.step_time()
    assert estimate.hardware is step_time.HARDWARE[TARGET]
    groups = [i.rest[i.rest.index("replica_groups="):].split(", dimensions")[0].split(", channel_id")[0]
              for c in gpu_compile.parse_hlo(report.hlo)[0].values() for i in c if "replica_groups=" in i.rest]
    print(json.dumps(dict(program=name, estimate=estimate.as_dict(), warnings=list(report.warnings),
                          loops=[vars(x) for x in gpu_compile.loop_transfers(report.hlo)], replica_groups=groups,
                          command_buffers=report.command_buffers.buffers if report.command_buffers else None)),
          flush=True)


if __name__ == "__main__":
  main()
