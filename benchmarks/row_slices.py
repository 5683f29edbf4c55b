"""Launches, loop trips and the step estimate of the decoder's train step per size of the 8-bit row slices.

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/row_slices.py [SLICE_VALUES ...]

The Llama-style decoder of ``benchmarks/gpu_memory.py --capacity-table`` at 4
layers (width 4096, batch 1 x 2048), 8-bit moments, ``master="stochastic"``,
compiled for the H200 without a GPU, once per value of
``optax_hybrid.kernels.reference.SLICE_VALUES`` given (default: the package's,
then 2^23), three ways: stepped inside the backward pass (``step_in_backward``)
with its layers on the device (state too), the same streamed from
``pinned_host`` (state in host memory), and ``scan_layers`` from
``pinned_host`` then ``tx.step`` (``host_state``). Per step: device and host
peak, kernels, launches and loop trips; per layer: the kernels and inner loop
trips of the backward trip (the slowest loop over the layers) and of every
loop over the layers together; the estimated step with its lower bound.
"""

import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, "benchmarks")
import models  # noqa: E402

import optax_hybrid  # noqa: E402
from optax_hybrid import gpu_compile  # noqa: E402
from optax_hybrid.kernels import reference  # noqa: E402

LAYERS = 4


def setups(cfg):
  """(name, params, optimizer, train step) of the three ways the decoder is stepped."""
  for name, kind, state in (("in backward, device", "device", "device"),
                            ("in backward, pinned_host", "pinned_host", "host_state"),
                            ("scan_layers + tx.step, pinned_host", "pinned_host", "host_state")):
    params = models.llama_params(cfg, jnp.bfloat16, kind)
    tx = optax_hybrid.hybrid_adamw(1e-4, weight_decay=0.1, state_memory_kind=state, master="stochastic",
                                   moment_format="8bit")
    if name.startswith("in backward"):
      step = optax_hybrid.step_in_backward(tx, *models.llama_parts(cfg))
    else:
      def step(p, s, b, tx=tx):
        loss, g = jax.value_and_grad(lambda p: models.llama_loss(cfg, p, b, stream=True))(p)
        p, s = tx.step(p, s, g)
        return p, s, loss
    yield name, params, tx, step


def per_layer(loops) -> tuple[str, str]:
  """``kernels / inner trips`` per layer: of the slowest loop over the layers, and of every loop over them."""
  layer_loops = [l for l in loops if l.trips == LAYERS]
  slowest = max(layer_loops, key=lambda l: l.seconds)
  figures = lambda ls: f"{sum(l.kernels for l in ls) / LAYERS:.0f} / {sum(l.inner_trips for l in ls) / LAYERS:.0f}"
  return figures([slowest]), figures(layer_loops)


def main(argv=None):
  values = [int(v) for v in (sys.argv[1:] if argv is None else argv)] or [reference.SLICE_VALUES, 2**23]
  cfg = models.LlamaConfig(layers=LAYERS, width=4096, heads=32, ffn=11008, vocab=32000, seq=2048, batch=1)
  print("| SLICE_VALUES | step | device GB | host GB | kernels | launches | loop trips | per layer: backward trip "
        "| per layer: every layer loop | est. step s | bound s |")
  print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for value in values:
    reference.SLICE_VALUES = value  # read when the step is traced
    for name, params, tx, step in setups(cfg):
      started = time.time()
      r = gpu_compile.compile_for_gpu(step, params, tx.init(params), models._tokens(1, 2048), target="h200",
                                      donate_argnums=(0, 1))
      e = r.step_time()
      backward, every = per_layer(e.loops)
      print(f"| 2^{value.bit_length() - 1} | {name} | {r.device_peak_bytes / 1e9:.2f} | {r.host_peak_bytes / 1e9:.2f} | "
            f"{e.kernels:,} | {e.launches:,} | {e.loop_trips:,} | {backward} | {every} | {e.seconds:.3f} | "
            f"{e.lower_bound:.3f} |", flush=True)
      print(f"  ({time.time() - started:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
  main()
