"""optax_hybrid.choose_placement on a small decoder-like stack, checked by compiling every placement (tests/test_choose_placement.py).

    JAX_PLATFORMS=cpu python tests/choose_placement_script.py
    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/choose_placement_script.py --fsdp 8

With ``--fsdp N`` the params are split over a mesh of ``N`` devices as FSDP
code splits them (each matrix on its width axis, the batch on its first) and
every placement is compiled for ``N`` H200; only the choice is printed.

With ``--recompute`` a deeper, wider stack is compiled for an H200 of 65 MB
(its ``GpuTargetConfig`` with a smaller ``device_memory_size``), where XLA
recomputes to fit some placements that fit the budget: prints
``{"case": "recompute", ...}``, every placement compiled here with its flops,
the flops of the stack as written, and the choice.

Prints JSON lines: ``{"case": "choice", ...}`` (the budgets, the choice, and
every placement of the stack compiled here, independently of the planner,
with its figures) and ``{"case": "numbers", ...}`` (the chosen placement and
its device-state variant run for real on the CPU against the stack held
whole in host memory: bit for bit).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import optax_hybrid
from optax_hybrid import gpu_compile

FSDP = int(sys.argv[sys.argv.index("--fsdp") + 1]) if "--fsdp" in sys.argv else 1
RECOMPUTE = "--recompute" in sys.argv
# Split over a mesh, a width whose layer shards outweigh what each device holds besides them (the collectives').
L, D, V, B = 4, 128 if FSDP == 1 else 1024, 256, 32
if RECOMPUTE:  # layers whose params weigh as much as the activations: XLA's limit moves with the layers resident
  L, D, B = 8, 1024, 512
SMALL_MEMORY = 65e6
S = jax.ShapeDtypeStruct


def embed(rest, b):
  return rest["embed"][b]


def layer(x, p, rest, b):
  return x + jnp.tanh(x @ p["w"] + p["b"]) * rest["gain"]


def head(rest, x, b):
  return jnp.mean((x @ rest["head"]).astype(jnp.float32) ** 2)


def tx_for(kinds):
  return optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, state_memory_kind=kinds, master="stochastic",
                                   moment_format="8bit")


def step_for(tx):
  return optax_hybrid.step_in_backward(tx, embed, layer, head)


PARAMS = {"embed": S((V, D), jnp.bfloat16), "gain": S((D,), jnp.bfloat16), "head": S((D, V), jnp.bfloat16),
          "layers": {"w": S((L, D, D), jnp.bfloat16), "b": S((L, D), jnp.bfloat16)}}
BATCH = S((B,), jnp.int32)
ONE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
MESH = jax.make_mesh((1,), ("one",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
P = jax.sharding.PartitionSpec
# Each matrix split on its width axis, as FSDP code splits it (the stacked layers keep axis 0 whole).
FSDP_SPECS = {"embed": P(None, "fsdp"), "gain": P("fsdp"), "head": P("fsdp", None), "w": P(None, "fsdp", None),
              "b": P(None, "fsdp")}
if FSDP > 1:
  MESH = jax.make_mesh((FSDP,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:FSDP])
  on_mesh = lambda path, x: S(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(MESH, FSDP_SPECS[path[-1].key]))
  PARAMS = jax.tree_util.tree_map_with_path(on_mesh, PARAMS)
  BATCH = S(BATCH.shape, BATCH.dtype, sharding=jax.sharding.NamedSharding(MESH, P("fsdp")))


def placed_by_hand(resident: int, resident_state: str):
  """The params and state_memory_kind of ``resident`` layers on the device (their state in ``resident_state``), the
  rest in pinned_host: written here from split_stack, not from the planner."""
  on = lambda key, kind: jax.sharding.NamedSharding(MESH, FSDP_SPECS[key] if FSDP > 1 else P(), memory_kind=kind)
  rest = {k: S(v.shape, v.dtype, sharding=on(k, "device") if FSDP > 1 else ONE)
          for k, v in PARAMS.items() if k != "layers"}
  stack = {k: S(v.shape, v.dtype, sharding=on(k, "device")) for k, v in PARAMS["layers"].items()}
  split = optax_hybrid.split_stack(stack, resident)
  layers = split.resident if resident == L else split.streamed if resident == 0 else split
  state = resident_state if resident else "host_state"
  kinds = {**{k: state for k in rest}, "layers": (
      state if resident in (0, L) else optax_hybrid.SplitStack(resident=resident_state, streamed="host_state"))}
  return {**rest, "layers": layers}, kinds


def compile_by_hand(resident: int, resident_state: str, target: str = "h200", recompute: bool = True) -> dict:
  params, kinds = placed_by_hand(resident, resident_state)
  tx = tx_for(kinds)
  batch = BATCH if FSDP > 1 else S(BATCH.shape, BATCH.dtype, sharding=ONE)
  state = tx.init(params)
  report = gpu_compile.compile_for_gpu(step_for(tx), params, state, batch, target=target, num_devices=FSDP,
                                       donate_argnums=(0, 1), recompute=recompute)
  # On a mesh: each param and state leaf comes out of the step split and placed as it went in.
  kept = FSDP == 1 or report.kept_shardings((params, state))
  return dict(resident=resident, state=resident_state, device=report.device_peak_bytes, host=report.host_peak_bytes,
              bus=report.to_device_bytes + report.to_host_bytes, stack_copies=stack_copies(report.hlo, resident),
              kept_shardings=kept, flops=gpu_compile.step_time.estimate(report).flops)


def stack_copies(hlo: str, resident: int) -> int:
  """Copies, in device memory, of a whole array shaped like a leaf of the resident part of the stack.

  Counted where that part has two layers or more (a part of one layer is
  shaped like the layer, whose device copies each trip makes anyway).
  """
  shapes = {f"bf16[{resident},{','.join(map(str, v.shape[1:]))}]" for v in PARAMS["layers"].values()}
  copies = re.findall(r"= (bf16\[[\d,]*\])(\{[^}]*\})? copy\(", hlo)
  return sum(shape in shapes and "S(5)" not in (layout or "") for shape, layout in copies) if resident > 1 else 0


def choice() -> dict:
  every = [compile_by_hand(k, r) for r in ("device", "host_state") for k in range(L + 1) if (k, r) != (0, "device")]
  # A device memory between every layer streamed and every layer resident with its state in host memory, so that
  # the best placement is a split; the host memory holds anything.
  streamed = next(p for p in every if p["resident"] == 0)
  resident = next(p for p in every if p["resident"] == L and p["state"] == "host_state")
  device_budget = (streamed["device"] + resident["device"]) / 2
  if FSDP > 1:  # per device the peaks are not ordered so: a budget just over the split of 2 resident (state in
    # host memory) + 2 streamed, under every placement that moves fewer bytes
    split = next(p for p in every if (p["resident"], p["state"]) == (2, "host_state"))
    device_budget = (split["device"] + min(p["device"] for p in every if p["bus"] < split["bus"])) / 2
  chosen = optax_hybrid.choose_placement(tx_for, step_for, PARAMS, BATCH, target="h200",
                                         device_bytes=device_budget / 0.9, host_bytes=1e9)
  return chosen, dict(case="choice", device_budget=device_budget, every=every, resident=chosen.resident_layers,
              state=chosen.resident_state, rest_state=chosen.rest_state, device=chosen.compiled.device,
              host=chosen.compiled.host, bus=chosen.compiled.bus_in + chosen.compiled.bus_out,
              probes=[[list(map(str, key)), dataclasses.asdict(cost)] for key, cost in chosen.probes.items()],
              step_seconds=chosen.step_seconds, step_lower_bound=chosen.step_lower_bound, table=chosen.table(),
              kinds={jax.tree_util.keystr(p): chosen.state_memory_kind(p, x)
                     for p, x in jax.tree_util.tree_leaves_with_path(chosen.place(PARAMS))},
              placed={jax.tree_util.keystr(p): x.sharding.memory_kind
                      for p, x in jax.tree_util.tree_leaves_with_path(chosen.place(PARAMS))
                      if getattr(x, "sharding", None) is not None},
              specs={jax.tree_util.keystr(p): str(getattr(x.sharding, "spec", None))
                     for p, x in jax.tree_util.tree_leaves_with_path(chosen.place(PARAMS))},
              host_budget=chosen.host_budget, num_devices=chosen.num_devices)


def recompute_case() -> dict:
  """A device of 65 MB: the choice against every placement compiled here as XLA compiles it (recomputing where it
  needs to) and the stack's flops as written."""
  text = re.sub(r"device_memory_size:\s*\d+", f"device_memory_size: {int(SMALL_MEMORY)}",
                gpu_compile.load_target("h200"))
  with tempfile.TemporaryDirectory() as directory:
    target = os.path.join(directory, "h200_65mb.txtpb")
    with open(target, "w") as f:
      f.write(text)
    every = [compile_by_hand(k, r, target) for r in ("device", "host_state") for k in range(L + 1)
             if (k, r) != (0, "device")]
    written = compile_by_hand(0, "host_state", target, recompute=False)["flops"]
    chosen = optax_hybrid.choose_placement(tx_for, step_for, PARAMS, BATCH, target=target, device_bytes=SMALL_MEMORY,
                                           host_bytes=1e9)
  c = chosen.compiled
  return dict(case="recompute", every=every, written_flops=written, device_budget=chosen.device_budget,
              host_budget=chosen.host_budget, resident=chosen.resident_layers, state=chosen.resident_state,
              device=c.device, host=c.host, bus=c.bus_in + c.bus_out, flops=c.flops, recomputes=chosen.recomputes,
              flops_as_written=chosen.flops_as_written, table=chosen.table())


def run(params, tx, steps: int = 3):
  """``steps`` steps of the chosen step on the CPU for real: the losses and the params, the stack joined."""
  params, state = optax_hybrid.commit((params, tx.init(params)))
  step = jax.jit(step_for(tx), donate_argnums=(0, 1))
  rng, losses = np.random.default_rng(1), []
  for _ in range(steps):
    params, state, loss = step(params, state, jnp.asarray(rng.integers(0, V, size=(B,)), jnp.int32))
    losses.append(float(loss))
  if isinstance(params["layers"], optax_hybrid.SplitStack):
    params = {**params, "layers": optax_hybrid.join_stack(params["layers"])}
  return losses, {k: np.asarray(v, np.float32) for k, v in jax.tree_util.tree_leaves_with_path(params)}


def numbers(chosen) -> dict:
  """The chosen placement (and the same split with its resident layers' state on the device) against the stack
  held whole in host memory with its state there: the same losses and params, bit for bit."""
  start = jax.tree.map(lambda x: np.random.default_rng(0).normal(size=x.shape) * 0.2, PARAMS)
  values = lambda: jax.tree.map(lambda v, x: jnp.asarray(v, x.dtype), start, PARAMS)  # fresh: steps donate them
  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  want = run({**values(), "layers": jax.device_put(values()["layers"], host)}, tx_for("host_state"))
  out = {}
  for name, placement in (("chosen", chosen), ("device_state", dataclasses.replace(
      chosen, resident_state="device", rest_state="device"))):
    got = run(placement.place(values()), tx_for(placement.state_memory_kind))
    out[name] = dict(losses_equal=got[0] == want[0], params_equal=all(
        np.array_equal(got[1][k], want[1][k]) for k in want[1]), split=placement.resident_layers)
  return dict(case="numbers", **out)


def errors() -> dict:
  out = {}
  for name, kwargs in (("device", dict(device_bytes=1e5, host_bytes=1e9)),
                       ("stack", dict(stack="blocks", device_bytes=1e9, host_bytes=1e9)),
                       ("host_bytes", dict(device_bytes=1e9, host_bytes=-1))):
    try:
      optax_hybrid.choose_placement(tx_for, step_for, PARAMS, BATCH, target="h200", **kwargs)
      out[name] = None
    except ValueError as e:
      out[name] = str(e)
  return dict(case="errors", **out)


if __name__ == "__main__":
  if RECOMPUTE:
    print(json.dumps(recompute_case()), flush=True)
    sys.exit()
  chosen, record = choice()
  print(json.dumps(record), flush=True)
  if FSDP > 1:
    half = jax.make_mesh((FSDP // 2,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:FSDP // 2])
    try:  # the batch on another mesh than the params
      optax_hybrid.choose_placement(tx_for, step_for, PARAMS, S(BATCH.shape, BATCH.dtype, sharding=(
          jax.sharding.NamedSharding(half, P("fsdp")))), target="h200", device_bytes=1e9, host_bytes=1e9)
      message = None
    except ValueError as e:
      message = str(e)
    print(json.dumps(dict(case="errors", meshes=message)), flush=True)
    sys.exit()
  print(json.dumps(numbers(chosen)), flush=True)
  print(json.dumps(errors()), flush=True)
