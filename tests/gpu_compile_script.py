"""Compiles the optimizer step for GPU targets, one JSON line per combination (tests/test_gpu_compile.py).

    JAX_PLATFORMS=cpu python tests/gpu_compile_script.py --tier host [--start K] [--devices 8]

Runs the combinations of one tier (:func:`combinations`) from index ``--start``
on. Before each it prints ``{"start": i}``, after it ``{"index": i, "ok": ...,
figures}``; an XLA abort therefore leaves the index of the combination that
crashed as the last ``start``, and the caller restarts after it.

Every combination is traced once (on the CPU backend, lowered for CUDA) and
compiled for each of its targets.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
import optax_hybrid  # noqa: E402
from optax_hybrid import gpu_compile
from optax_hybrid.kernels import lowering_for  # noqa: E402

MiB = 2**20
# The host_state tier's staging budget, if the library names one.
STAGE_BYTES = optax_hybrid.plan.STREAM_STAGE_BYTES
N_LEAVES = 8
# Each big leaf holds half a stage of f32 moments (8 B per param), so the
# whole state is 4 stages (f32 params) or 6 (bf16 params with an f32 master):
# more than the 3 stages a bounded host_state step may hold.
COLS = 1024
ROWS = max(8, STAGE_BYTES // 2 // 8 // COLS)
SHAPES = {**{f"layer{i}": {"kernel": (ROWS, COLS)} for i in range(N_LEAVES)}, "bias": {"b": (COLS,)}}

TIERS = {
    "device": dict(tiers="device"),
    "host_state": dict(tiers="host_state"),
    "host": dict(tiers="host"),
    "offload_fraction": dict(offload_fraction=0.5),
    "disk": dict(tiers="disk"),
}
DTYPES = {"f32": (jnp.float32, {}),
          "bf16": (jnp.bfloat16, dict(mu_dtype=jnp.float32, nu_dtype=jnp.float32, master_dtype=jnp.float32)),
          # 8-bit block-wise moments (codes and per-256-value scales), device tier only.
          "f32_8bit": (jnp.float32, dict(moment_format="8bit")),
          "bf16_8bit": (jnp.bfloat16, dict(moment_format="8bit", master_dtype=jnp.float32))}
# The device tier's 8-bit combinations: the Pallas kernel, and "auto" (which is Pallas on CUDA).
MOMENTS_8BIT = [("pallas", "f32_8bit"), ("auto", "bf16_8bit")]


# Real inputs next to abstract ones for one combination per kernel (the other
# six compile from abstract inputs only: the real/abstract question is one of
# how the inputs are typed, which these two pairs settle per tier).
REAL_TOO = {("xla", "step", "bf16"), ("pallas", "update", "f32")}


def combinations(tier: str, devices: int) -> list[dict]:
  """The combinations of one tier: kernel x path x dtype (abstract inputs; real ones too for :data:`REAL_TOO`).

  H100 gets every combination; H200 (the same sm_90 chip with more memory:
  identical programs) the xla/step/bf16 ones, real and abstract. The disk
  tier, whose step makes ``io_callback`` s, has only xla/step/bf16: a host
  callback cannot be lowered for CUDA from a CPU-traced program (see
  docs/gpu_compile.md), so every disk combination stops at the same point.
  The device tier adds the fused step with 8-bit moments (:data:`MOMENTS_8BIT`,
  real inputs, H100), after the others.
  """
  if devices > 1:  # ZeRO-1 over the 8 GPUs for the host tiers
    return [dict(tier=tier, kernel="xla", path=path, dtype="bf16", inputs=inputs, targets=["h100"], devices=devices)
            for path, inputs in itertools.product(("step", "update"), ("real", "abstract", "abstract_init"))]
  out = []
  for kernel, path, dtype, inputs in itertools.product(("xla", "pallas"), ("step", "update"), ("f32", "bf16"),
                                                       ("real", "abstract")):
    if tier == "disk" and (kernel, path, dtype) != ("xla", "step", "bf16"):
      continue
    if inputs == "real" and (kernel, path, dtype) not in REAL_TOO:
      continue
    targets = ["h100", "h200"] if (kernel, path, dtype) == ("xla", "step", "bf16") else ["h100"]
    out.append(dict(tier=tier, kernel=kernel, path=path, dtype=dtype, inputs=inputs, targets=targets,
                    devices=devices))
  if tier == "device":
    out += [dict(tier=tier, kernel=kernel, path="step", dtype=dtype, inputs="real", targets=["h100"], devices=devices)
            for kernel, dtype in MOMENTS_8BIT]
  return out


def make_params(dtype, devices: int, fill: float, real: bool = True):
  """Params (or gradients: another call, other buffers) shaped as :data:`SHAPES`; ShapeDtypeStructs if not ``real``."""
  if devices > 1:
    mesh = jax.make_mesh((devices,), ("data",))
    sharding = lambda shape: jax.NamedSharding(mesh, jax.P("data") if shape[0] % devices == 0 else jax.P())
  else:
    sharding = lambda shape: jax.sharding.SingleDeviceSharding(jax.devices()[0])
  if not real:
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype, sharding=sharding(s)), SHAPES,
                        is_leaf=lambda x: isinstance(x, tuple))
  return jax.tree.map(lambda s: jax.device_put(np.full(s, fill, dtype), sharding(s)), SHAPES,
                      is_leaf=lambda x: isinstance(x, tuple))


# Real params and gradients, made once per dtype: the steps are compiled, never
# run, so donation consumes nothing.
_REAL = {}


def real_params_and_grads(dtype, devices: int):
  key = (np.dtype(dtype).name, devices)
  if key not in _REAL:
    _REAL[key] = (make_params(dtype, devices, 0.5), make_params(dtype, devices, 1e-3))
  return _REAL[key]


def leaf_figures(combo: dict, params, plan) -> dict:
  """Bytes the assertions compare against: params, grads, state per tier, the largest leaves."""
  dtype, _ = DTYPES[combo["dtype"]]
  itemsize = np.dtype(dtype).itemsize
  master = 4 if itemsize < 4 else 0  # an f32 master for bf16 params
  state_per_param = 8 + master  # f32 mu, nu (and master)
  sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(params)]
  devices = combo["devices"]

  def state_of(n):
    if combo["dtype"].endswith("8bit") and n >= 4096:  # uint8 codes + one f32 scale per 256 values, twice
      return 2 * (n + 4 * n // 256) + master * n
    return state_per_param * n

  figures = {"param_bytes": sum(sizes) * itemsize // devices, "stage_bytes": STAGE_BYTES,
             "num_params": sum(sizes), "state_per_param": state_per_param}
  for key in ("state_bytes", "largest_state_bytes", "largest_param_bytes"):
    figures[key] = {}
  plan_tiers = plan.tiers
  # The largest stage's state, per tier: the leaves the plan streams together.
  stages: dict = {}
  for n, leaf in zip(sizes, plan.leaves):
    if leaf.streamed:
      stages[(leaf.tier, leaf.stage)] = stages.get((leaf.tier, leaf.stage), 0) + state_of(n) // devices
  figures["largest_stage_bytes"] = {tier: max((b for (t, _), b in stages.items() if t == tier), default=0)
                                    for tier in ("host_state", "host")}
  for tier in ("device", "host_state", "host", "disk"):
    mine = [n for n, t in zip(sizes, plan_tiers) if t == tier]
    figures["state_bytes"][tier] = sum(state_of(n) for n in mine) // devices
    figures["largest_state_bytes"][tier] = max((state_of(n) for n in mine), default=0) // devices
    figures["largest_param_bytes"][tier] = max(mine, default=0) * itemsize // devices
  figures["tiers"] = list(plan_tiers)
  figures["grad_bytes"] = figures["param_bytes"]
  # The update tree of the Optax contract: fp32 (the moments' dtype, or the master's).
  figures["update_bytes"] = sum(sizes) * 4 // devices
  return figures


def run(combo: dict, disk_dir: str) -> dict:
  dtype, dtype_kw = DTYPES[combo["dtype"]]
  kw = dict(TIERS[combo["tier"]], **dtype_kw, kernel=combo["kernel"])
  if combo["tier"] == "disk":
    kw["nvme_offload_dir"] = disk_dir
  if combo["devices"] > 1 and combo["tier"] != "device":
    kw["shard_state_over"] = "data"
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, **kw)
  try:
    if combo["inputs"] == "real":
      params, grads = real_params_and_grads(dtype, combo["devices"])  # separate buffers
      state = tx.init(params)
    else:  # what jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) of the real ones gives
      params = make_params(dtype, combo["devices"], 0.5, real=False)
      grads = make_params(dtype, combo["devices"], 1e-3, real=False)
      # "abstract_init": tx.init called on the ShapeDtypeStructs themselves;
      # "abstract": ShapeDtypeStructs of a state, with its shardings (memory
      # kinds included). (jax.eval_shape(tx.init, ...) drops every sharding in
      # JAX 0.10, memory kinds with them: its state would be compiled as device
      # arguments; docs/gpu_compile.md.)
      state = tx.init(params)
      if combo["inputs"] == "abstract":
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    figures = leaf_figures(combo, params, state.plan)
    if combo["path"] == "step":
      fn = jax.jit(tx.step, donate_argnums=(0, 1))
    else:
      def train_step(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax_hybrid.apply_updates(p, updates), s
      fn = jax.jit(train_step, donate_argnums=(0, 1))
    with lowering_for("cuda"):
      lowered = fn.trace(params, state, grads).lower(lowering_platforms=("cuda",))
    reports = {}
    for target in combo["targets"]:
      report = gpu_compile.compile_lowered(lowered, target=target, num_devices=combo["devices"])
      reports[target] = report.as_dict()
    return dict(ok=True, figures=figures, reports=reports)
  finally:
    tx.close()


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--tier", required=True, choices=sorted(TIERS))
  parser.add_argument("--start", type=int, default=0)
  parser.add_argument("--devices", type=int, default=1)
  parser.add_argument("--list", action="store_true", help="print the combinations and exit")
  args = parser.parse_args(argv)
  combos = combinations(args.tier, args.devices)
  if args.list:
    print(json.dumps(combos))
    return
  with tempfile.TemporaryDirectory() as disk_dir:
    for i in range(args.start, len(combos)):
      print(json.dumps({"start": i}), flush=True)
      try:
        result = run(combos[i], disk_dir)
      except Exception as e:  # a compile error is a result: the test reports it
        result = dict(ok=False, error=f"{type(e).__name__}: {e}"[-4000:],
                      traceback=traceback.format_exc()[-3000:])
      print(json.dumps(dict(index=i, combo=combos[i], **result)), flush=True)


if __name__ == "__main__":
  main()
