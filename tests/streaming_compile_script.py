"""Compiles a streamed Llama-style train step for the H200 target, one JSON line per case (tests/test_streaming_compile.py).

    JAX_PLATFORMS=cpu python tests/streaming_compile_script.py [--start K] [--list]

A case: the whole train step (``jax.value_and_grad`` of the loss, then
``tx.step`` of ``hybrid_adamw(tiers="host")`` with bf16 params and an fp32
master; params and state donated) of ``benchmarks/models.py``'s Llama-style
decoder whose layers live in ``pinned_host`` and run by
``optax_hybrid.scan_layers``, at a depth, with or without the saved carries
offloaded, from abstract inputs (``ShapeDtypeStruct`` s placed with a
``NamedSharding``) or real arrays; with ``tiers="host"`` or, for two cases,
``tiers="host_state"`` (the layers stepped on the device a slice at a time),
for two more the same stepped inside the backward pass
(``optax_hybrid.step_in_backward``: no gradient buffer).
A ``step_only`` case compiles the
optimizer step alone (``tx.step(params, state, grads)``) of the same model's
params, layers stacked on the device, with ``tiers="host_state"`` and a stage
budget of :data:`SLICE_BUDGET`, so that every stacked leaf crosses a layer at a
time (``LeafPlan.slice_rows``). Before each case it prints ``{"start": i}``,
after it ``{"index": i, ...}`` (an XLA abort leaves the crashed index as the
last ``start``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import models  # noqa: E402
import optax_hybrid  # noqa: E402
from optax_hybrid import gpu_compile  # noqa: E402
from optax_hybrid.kernels import lowering_for  # noqa: E402

# Small enough to compile in seconds, big enough that a layer's params (6.3 MB
# in bf16) are several times its saved carry (1 MB): a stacked gradient kept
# on the device would show.
SIZES = dict(width=512, heads=4, ffn=1376, vocab=1000, seq=512, batch=2)
TARGET = "h200"
# The host_state cases' stage budget: under one layer's state of the largest
# stacked leaf (512 x 1376 values, 12 bytes each with an fp32 master and
# moments: 8.5 MB), so that its slices are one layer.
SLICE_BUDGET = 4 * 2**20


def cases() -> list[dict]:
  out = [dict(layers=n, offload=False, inputs="abstract") for n in (2, 4)]
  out += [dict(layers=n, offload=True, inputs="abstract") for n in (2, 4)]
  out += [dict(layers=4, offload=False, inputs="real")]
  out = [dict(c, tier="host", step_only=False) for c in out]
  # The layers in pinned_host stepped on the device a slice at a time (tiers="host_state").
  out += [dict(layers=n, offload=False, inputs="abstract", tier="host_state", step_only=False) for n in (2, 4)]
  out += [dict(layers=n, offload=False, inputs="abstract", tier="host_state", step_only=True) for n in (2, 4)]
  out = [dict(c, in_backward=False) for c in out]
  # The same layers stepped inside the backward pass (optax_hybrid.step_in_backward): no gradient buffer.
  out += [dict(layers=n, offload=False, inputs="abstract", tier="host_state", step_only=False, in_backward=True)
          for n in (2, 4)]
  out = [dict(c, master="float32") for c in out]
  # With stochastic rounding (no master: the step reads the bf16 param rows, the ones the backward pass brought in).
  out += [dict(layers=n, offload=False, inputs="abstract", tier="host_state", step_only=False, in_backward=True,
               master="stochastic") for n in (2, 4)]
  return out


def nbytes(tree) -> int:
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def realize(tree):
  """Real zeros placed like each ShapeDtypeStruct, host memory by a SingleDeviceSharding (as users place arrays)."""
  device = jax.devices()[0]
  def one(x):
    kind = getattr(x.sharding, "memory_kind", None) or "device"
    return jax.device_put(np.zeros(x.shape, x.dtype), jax.sharding.SingleDeviceSharding(device, memory_kind=kind))
  return jax.tree.map(one, tree)


def run(case: dict) -> dict:
  if case["step_only"]:
    return run_host_state_step(case)
  model = models.llama(jnp.bfloat16, stream=True, offload_carries=case["offload"], layers_memory_kind="pinned_host",
                       layers=case["layers"], **SIZES)
  params = model.params if case["inputs"] == "abstract" else realize(model.params)
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, tiers=case["tier"], master=case["master"],
                                 moment_format="float32")
  state = tx.init(params)
  if case["inputs"] == "abstract":
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)

  def train_step(p, s, batch):
    loss, grads = jax.value_and_grad(model.loss)(p, batch)
    p, s = tx.step(p, s, grads)
    return p, s, loss

  if case["in_backward"]:
    train_step = models.donation_ordered(optax_hybrid.step_in_backward(
        tx, *models.llama_parts(models.LlamaConfig(layers=case["layers"], **SIZES))))

  with lowering_for("cuda"):
    lowered = jax.jit(train_step, donate_argnums=(0, 1)).trace(params, state, model.batch).lower(
        lowering_platforms=("cuda",))
  report = gpu_compile.compile_lowered(lowered, target=TARGET)
  layers = model.params["layers"]
  figures = dict(num_params=model.num_params, layer_bytes=nbytes(layers) // case["layers"],
                 layer_leaves=len(jax.tree.leaves(layers)),
                 other_param_bytes=nbytes({k: v for k, v in model.params.items() if k != "layers"}),
                 carry_bytes=SIZES["batch"] * SIZES["seq"] * SIZES["width"] * 2)
  loops = [dict(trips=t.trips, fetches=t.fetches, overlapped=t.overlapped, carried=t.carried)
           for t in gpu_compile.loop_transfers(report.hlo)]
  return dict(ok=True, figures=figures, report=report.as_dict(), loops=loops)


def run_host_state_step(case: dict) -> dict:
  """The host_state tier's step alone on the stacked model's params: what it stages on the device."""
  optax_hybrid.plan.STREAM_STAGE_BYTES = SLICE_BUDGET
  model = models.llama(jnp.bfloat16, stream=False, layers=case["layers"], **SIZES)
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, tiers="host_state", master_dtype=jnp.float32,
                                 moment_format="float32")
  state = tx.init(model.params)
  with lowering_for("cuda"):
    lowered = jax.jit(tx.step, donate_argnums=(0, 1)).trace(model.params, state, model.params).lower(
        lowering_platforms=("cuda",))
  report = gpu_compile.compile_lowered(lowered, target=TARGET)
  shapes = dict(zip((lp.path for lp in state.plan.leaves), (x.shape for x in jax.tree.leaves(model.params))))
  slices = [optax_hybrid.plan.state_bytes(lp, (lp.slice_rows or shapes[lp.path][0], *shapes[lp.path][1:]))
            for lp in state.plan.leaves if lp.streamed]
  figures = dict(largest_slice_bytes=max(slices), sliced=sum(lp.slice_rows > 0 for lp in state.plan.leaves),
                 stacked=len(jax.tree.leaves(model.params["layers"])),
                 state_bytes=sum(optax_hybrid.plan.state_bytes(lp, shapes[lp.path]) for lp in state.plan.leaves))
  return dict(ok=True, figures=figures, report=report.as_dict(), loops=[])


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--start", type=int, default=0)
  parser.add_argument("--list", action="store_true")
  args = parser.parse_args(argv)
  all_cases = cases()
  if args.list:
    print(json.dumps(all_cases))
    return
  for i in range(args.start, len(all_cases)):
    print(json.dumps({"start": i}), flush=True)
    try:
      result = run(all_cases[i])
    except Exception as e:  # a compile error is a result: the test reports it
      result = dict(ok=False, error=f"{type(e).__name__}: {e}"[-4000:], traceback=traceback.format_exc()[-3000:])
    print(json.dumps(dict(index=i, case=all_cases[i], **result)), flush=True)


if __name__ == "__main__":
  main()
