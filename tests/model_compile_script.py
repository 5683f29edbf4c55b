"""Compiles whole train steps of real models for GPU targets, one JSON line per case (tests/test_model_compile.py).

    JAX_PLATFORMS=cpu python tests/model_compile_script.py [--model NAME] [--start K] [--list]

A case is a model of ``benchmarks/models.py`` (Flax Linen with a tied and an
untied head, a Flax NNX CNN, a Llama-style scanned decoder, transposed uses
and odd sizes) x a tier (``device``, ``host_state``, ``host``,
``offload_fraction=0.5``) x moments (float32, 8-bit) x kernel (``xla``,
``pallas``) x path (``tx.step``; ``tx.update`` + ``apply_updates``), or the
model's own step without optimizer state (plain SGD: the baseline its
temporaries are compared with). Every case is the whole train step
(``jax.value_and_grad`` of the loss, then the optimizer), params and state
donated, traced from abstract inputs (``jax.ShapeDtypeStruct`` s, the state's
with its shardings), lowered for CUDA and compiled for the H100 target (the
H200 too for the Llama-style model's host tier).

Before each case it prints ``{"start": i}``, after it ``{"index": i, "ok": ...,
"figures": ...}``, so that an XLA abort leaves the index of the case that
crashed as the last ``start`` and the caller can go on after it.
"""

from __future__ import annotations

import argparse
import json
import time
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

# model -> (param dtype, sizes). The Llama-style decoder is the issue's
# shape at width 1024 (vocab 32000): its state spans many 64 MiB stages.
MODELS = {
    "linen_tied": ("float32", {}),
    "linen_untied": ("bfloat16", {}),
    "nnx_cnn": ("float32", {}),
    "odd": ("bfloat16", {}),
    "llama": ("bfloat16", dict(width=1024, heads=8, ffn=2816, vocab=32000)),
}
TIERS = {"device": dict(tiers="device"), "host_state": dict(tiers="host_state"), "host": dict(tiers="host"),
         "offload_fraction": dict(offload_fraction=0.5)}
# (moments, kernel, path): one per model and tier, rotated so that each tier
# meets both moment formats, both kernels and both paths over the first four
# models (half of the eight combinations per tier, all eight over the tiers).
VARIANTS = [("float32", "xla", "step"), ("8bit", "pallas", "update"), ("float32", "pallas", "step"),
            ("8bit", "xla", "update"), ("float32", "xla", "update"), ("8bit", "pallas", "step"),
            ("float32", "pallas", "update"), ("8bit", "xla", "step")]
# The Llama-style decoder compiles slowest (about 2.5x the others): one variant
# per tier, its host tier as the issue found it (8-bit moments, tx.step), on
# the H200 target too.
LLAMA_VARIANTS = {"device": ("float32", "pallas", "update"), "host_state": ("float32", "xla", "step"),
                  "host": ("8bit", "xla", "step"), "offload_fraction": ("8bit", "pallas", "step")}


def cases(model: str) -> list[dict]:
  """The model's baseline, then its variants per tier (:data:`VARIANTS` rotated, or :data:`LLAMA_VARIANTS`)."""
  m = list(MODELS).index(model)
  out = [dict(model=model, tier="baseline", targets=["h100"])]
  for t, tier in enumerate(TIERS):
    if model == "llama":
      variants = [LLAMA_VARIANTS[tier]]
    else:
      variants = [VARIANTS[(3 * m + 2 * t) % len(VARIANTS)]]
    for moments, kernel, path in variants:
      targets = ["h100", "h200"] if (model, tier) == ("llama", "host") else ["h100"]
      out.append(dict(model=model, tier=tier, moments=moments, kernel=kernel, path=path, targets=targets))
  return out


def abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def nbytes(x) -> int:
  return math.prod(x.shape) * np.dtype(x.dtype).itemsize


def state_figures(state, params) -> dict:
  """Bytes of the optimizer state by memory kind, and per leaf (for the stages), read off the state's arrays."""
  hybrid = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax_hybrid.HybridAdamState))
            if isinstance(s, optax_hybrid.HybridAdamState)][0]
  by_kind = {"device": 0, "pinned_host": 0}
  stored = [0] * len(hybrid.plan.leaves)  # bytes as stored
  working = [0] * len(hybrid.plan.leaves)  # bytes as computed: 8-bit moments (uint8 codes) as float32
  treedef = jax.tree.structure(params)
  for field in ("mu", "nu", "master", "mu_scales", "nu_scales"):
    tree = getattr(hybrid, field)
    if tree is None:
      continue
    for i, x in enumerate(treedef.flatten_up_to(tree)):
      by_kind[x.sharding.memory_kind] += nbytes(x)
      stored[i] += nbytes(x)
      if not field.endswith("_scales"):
        working[i] += math.prod(x.shape) * (4 if x.dtype == np.uint8 else np.dtype(x.dtype).itemsize)

  def largest_stage(sizes):
    stages: dict = {}
    for leaf, size in zip(hybrid.plan.leaves, sizes):
      if leaf.streamed:
        stages[(leaf.runs_on, leaf.stage)] = stages.get((leaf.runs_on, leaf.stage), 0) + size
    return max(stages.values(), default=0), len(stages)

  (stage, stages), (working_stage, _) = largest_stage(stored), largest_stage(working)
  return dict(state_device=by_kind["device"], state_host=by_kind["pinned_host"], largest_stage=stage,
              largest_working_stage=working_stage, stages=stages, tiers=sorted(set(hybrid.plan.tiers)))


def run(case: dict) -> dict:
  dtype, sizes = MODELS[case["model"]]
  model = models.make(case["model"], jnp.dtype(dtype), **sizes)
  params = model.params
  param_bytes = sum(nbytes(x) for x in jax.tree.leaves(params))
  largest_leaf = max(nbytes(x) for x in jax.tree.leaves(params))
  figures = dict(num_params=model.num_params, param_bytes=param_bytes, largest_leaf_bytes=largest_leaf,
                 # what tx.update returns: one float32 (moments' or master's dtype) update per weight
                 update_bytes=4 * model.num_params)
  if case["tier"] == "baseline":
    def train_step(p, state, batch):
      loss, grads = jax.value_and_grad(model.loss)(p, batch)
      return jax.tree.map(lambda w, g: (w - 1e-3 * g).astype(w.dtype), p, grads), state, loss
    state = ()
  else:
    kw = dict(TIERS[case["tier"]], kernel=case["kernel"], weight_decay=0.1, moment_format=case["moments"])
    if jnp.dtype(dtype) != jnp.float32:
      kw["master_dtype"] = jnp.float32
    tx = optax_hybrid.hybrid_adamw(1e-3, **kw)
    state = abstract(tx.init(params))
    figures.update(state_figures(state, params))

    def train_step(p, state, batch):
      loss, grads = jax.value_and_grad(model.loss)(p, batch)
      if case["path"] == "step":
        p, state = tx.step(p, state, grads)
      else:
        updates, state = tx.update(grads, state, p)
        p = optax_hybrid.apply_updates(p, updates)
      return p, state, loss

  with lowering_for("cuda"):
    lowered = jax.jit(train_step, donate_argnums=(0, 1)).trace(params, state, model.batch).lower(
        lowering_platforms=("cuda",))
  reports = {target: gpu_compile.compile_lowered(lowered, target=target).as_dict() for target in case["targets"]}
  return dict(ok=True, figures=figures, reports=reports)


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--model", required=True, choices=sorted(MODELS))
  parser.add_argument("--start", type=int, default=0)
  parser.add_argument("--list", action="store_true", help="print the cases and exit")
  args = parser.parse_args(argv)
  all_cases = cases(args.model)
  if args.list:
    print(json.dumps(all_cases))
    return
  for i in range(args.start, len(all_cases)):
    print(json.dumps({"start": i}), flush=True)
    began = time.perf_counter()
    try:
      result = run(all_cases[i])
    except Exception as e:  # a compile error is a result: the test reports it
      result = dict(ok=False, error=f"{type(e).__name__}: {e}"[-4000:], traceback=traceback.format_exc()[-3000:])
    result["seconds"] = round(time.perf_counter() - began, 1)
    print(json.dumps(dict(index=i, case=all_cases[i], **result)), flush=True)


if __name__ == "__main__":
  main()
