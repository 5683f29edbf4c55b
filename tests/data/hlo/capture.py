"""Writes the optimized HLO fixtures of tests/test_hlo_summary.py: four small programs compiled for the H100.

    JAX_PLATFORMS=cpu python tests/data/hlo/capture.py   # needs JAX's CUDA plugin (docs/gpu_compile.md)

Captured once (jax 0.10.2, 2026-12-02) and kept: the test reads the texts and
checks ``gpu_compile.count_hlo`` and ``loop_transfers`` against counts worked
out by hand from them (the test's comments say how), so it needs no compiler.
Recapturing with another XLA may change the programs; the expectations must
then be worked out again from the new texts.

* ``host_device_copies.hlo``: a host array copied to the device, computed on,
  and copied back (``copy-start``/``copy-done`` with memory space ``S(5)``),
  beside a device-only bfloat16 computation.
* ``scan_host_stack.hlo``: ``lax.scan`` over 4 layers stacked in host memory,
  each fetched by an asynchronous slice copy (a ``while`` of known trip count).
* ``host_compute.hlo``: ``compute_on("device_host")``: a host computation
  (``custom-call-start`` to ``HostExecute``) reading a device and a host input.
* ``streamed_layers.hlo``: the gradient of ``optax_hybrid.scan_layers`` over 3
  layers in host memory: slices prefetched a trip ahead, the gradient written
  to host memory slice by slice (``dynamic-update-slice``).
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.compute_on import compute_on  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, os.pardir))
import optax_hybrid  # noqa: E402
from optax_hybrid import gpu_compile  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
HOST = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind="pinned_host")
DEVICE = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind="device")
# compute_on's inputs placed with a SingleDeviceSharding: JAX 0.10 traces such abstract inputs as device
# values (the host function then adds two of them), while the compiled parameter stays in host memory.
SINGLE_HOST = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
SINGLE_DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")


def host_device_copies(a, b):
  c = jax.device_put(a, DEVICE) * 2 + 1
  return jax.device_put(c, HOST), (b * 3).astype(jnp.float32)


def scan_host_stack(w, x):
  def body(y, wi):
    return jnp.tanh(jax.device_put(wi, DEVICE) @ y), None
  return jax.lax.scan(body, x, w)[0]


@compute_on("device_host")
@jax.jit
def _host_update(a, g):
  return a * 0.9 + g


def streamed_layers(w, x):
  loss = lambda w, x: optax_hybrid.scan_layers(lambda c, wi: jnp.tanh(wi @ c), x, w).sum()
  return jax.grad(loss)(w, x)


PROGRAMS = {
    "host_device_copies": (host_device_copies, [((256,), jnp.float32, HOST), ((128,), jnp.bfloat16, DEVICE)], {}),
    "scan_host_stack": (scan_host_stack, [((4, 64, 64), jnp.float32, HOST), ((64,), jnp.float32, DEVICE)], {}),
    "host_compute": (lambda a, g: _host_update(a, g), [((256,), jnp.float32, SINGLE_HOST), ((256,), jnp.float32, SINGLE_DEVICE)],
                     dict(out_shardings=SINGLE_HOST)),
    "streamed_layers": (streamed_layers, [((3, 32, 32), jnp.float32, HOST), ((32,), jnp.float32, DEVICE)], {}),
}

if __name__ == "__main__":
  for name, (fn, args, jit_kwargs) in PROGRAMS.items():
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype, sharding in args]
    report = gpu_compile.compile_for_gpu(fn, *args, target="h100", **jit_kwargs)
    with open(os.path.join(HERE, name + ".hlo"), "w") as f:
      f.write(report.hlo)
    print(name, len(report.hlo.splitlines()), "lines")
