"""Launches, loop trips and the step estimate of the step-in-backward decoder per size of the 8-bit row slices.

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/row_slices.py [SLICE_VALUES ...]

The Llama-style decoder of ``benchmarks/gpu_memory.py --capacity-table`` at 4
layers (width 4096, batch 1 x 2048), stepped inside the backward pass
(``step_in_backward``, 8-bit moments, ``master="stochastic"``), compiled for the
H200 without a GPU, with its layers on the device (state too) and streamed
from ``pinned_host`` (state in host memory), once per value of
``optax_hybrid.kernels.reference.SLICE_VALUES`` given (default: the package's,
then 2^18): device and host peak, kernels, launches and loop trips per step,
and the estimated step with its lower bound.
"""

import sys
import time

import jax.numpy as jnp

sys.path.insert(0, "benchmarks")
import models  # noqa: E402

import optax_hybrid  # noqa: E402
from optax_hybrid import gpu_compile  # noqa: E402
from optax_hybrid.kernels import reference  # noqa: E402

LAYERS = 4


def main(argv=None):
  values = [int(v) for v in (sys.argv[1:] if argv is None else argv)] or [reference.SLICE_VALUES, 2**18]
  cfg = models.LlamaConfig(layers=LAYERS, width=4096, heads=32, ffn=11008, vocab=32000, seq=2048, batch=1)
  print("| SLICE_VALUES | layers in | device GB | host GB | kernels | launches | loop trips | est. step s | bound s |")
  print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
  for value in values:
    reference.SLICE_VALUES = value  # read when the step is traced
    for kind, state in (("device", "device"), ("pinned_host", "host_state")):
      params = models.llama_params(cfg, jnp.bfloat16, kind)
      tx = optax_hybrid.hybrid_adamw(1e-4, weight_decay=0.1, state_memory_kind=state, master="stochastic",
                                     moment_format="8bit")
      step = optax_hybrid.step_in_backward(tx, *models.llama_parts(cfg))
      started = time.time()
      r = gpu_compile.compile_for_gpu(step, params, tx.init(params), models._tokens(1, 2048), target="h200",
                                      donate_argnums=(0, 1))
      e = r.step_time()
      print(f"| 2^{value.bit_length() - 1} | {kind} | {r.device_peak_bytes / 1e9:.2f} | {r.host_peak_bytes / 1e9:.2f} | "
            f"{e.kernels:,} | {e.launches:,} | {e.loop_trips:,} | {e.seconds:.3f} | {e.lower_bound:.3f} |", flush=True)
      print(f"  ({time.time() - started:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
  main()
