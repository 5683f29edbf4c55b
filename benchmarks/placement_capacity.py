"""The largest Llama-style decoder whose placement `optax_hybrid.choose_placement` finds, per host memory.

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/placement_capacity.py [--host-memories "256 GB,device alone"]
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/placement_capacity.py --speed-table [--sizes 7,13,...]
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/placement_capacity.py --quick      # small widths (a test)
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/placement_capacity.py --devices 8 --host-memories "2 TB"
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/placement_capacity.py --breakdown 271 --layers 280 --batch 4

Compile-time figures (XLA:GPU's plan for an H200, compiled on a CPU machine, as
``benchmarks/gpu_memory.py --capacity-table``): the decoder of that table
(width 4096, 32 heads, SwiGLU 11008, vocab 32000, batch 1 x 2048, RoPE, an
untied ``(D, V)`` head), stepped inside the backward pass
(``step_in_backward``, 8-bit moments, ``master="stochastic"``), with the
stack's placement left to ``choose_placement`` (budgets: 0.9 of the H200's
150.8 GB and of the host memory). For each host memory, the depth is searched
for the largest model the planner places: the planner's compiles at small
depths are made once and reused at every depth (``probes=``), a depth it
predicts cannot fit costs no compile, one it predicts can fit is confirmed by
compiling it whole. Beside it, the baseline a user would pick, ``optax.adamw``
with bf16 params and an fp32 ``mu`` on the device alone, found by
``benchmarks/gpu_memory.py``'s own search in the same run.

``--speed-table``: for models of the given sizes (billions of params), at
batches 1 and 4 x 2048, the placement the planner chooses with 256 GB of host
memory and the step time estimated from its compiled program
(``optax_hybrid.gpu_compile.step_time``, launches and loop trips included):
resident share, device and host GB, bus bytes per weight each way, the
estimate and its lower bound, tokens/s and MFU (6 N flops per token at 989
TFLOP/s); ``optax.adamw`` (bf16 params, fp32 ``mu``) where it fits.

``--check-split MEMORY --layers N``: the placement the planner chooses for N
layers and that host memory, against the best split found by searching it at
full depth, each candidate compiled whole: for each way of holding the resident layers (their state on
the device or in host memory), the most resident layers that fit both budgets
(each resident layer moves fewer bytes than a streamed one, so the most that fit
is that way's fewest bus bytes), found by bisection; printed with the chosen
placement's bus bytes over the best's.

``--devices 8``: one DGX H200 node, the model split over its 8 GPUs as FSDP
code splits it (``models.fsdp_placed``: each matrix on its width axis, the
batch of 8 x 2048 on its first, the activations between layers constrained to
it), the host memory shared by the 8; figures per GPU. The baseline,
``optax.adamw`` on the devices alone, is given its best split of the down
projection ``(F, D)`` (on ``D`` as the other matrices, or on ``F``), each
searched here.

``--breakdown K --layers N [--batch B]``: where the step-time estimate of one
placement goes (``K`` resident layers with their state in host memory, the
rest streamed; compiled whole): the estimate, its parts (compute, each
direction of the bus, the bus hidden behind kernels, launches), the flops
against 6 N per token, and the slowest loops.

Prints a markdown table: per host memory, layers, params, the ratio to the
baseline, the placement (resident layers and their state, streamed layers),
device and host GB as compiled, bus bytes per weight each way per step, and the
step-time estimate with its lower bound.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

if "--devices" in sys.argv:  # traced on as many CPU devices: set before JAX starts
  _devices = int(sys.argv[sys.argv.index("--devices") + 1])
  if _devices > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_devices}").strip()

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models  # noqa: E402

import optax_hybrid  # noqa: E402

GB = 1e9
HOST_MEMORIES = {"128 GiB": 128 * 2**30, "256 GB": 256e9, "1 TB": 1e12, "2 TB": 2e12, "device alone": 1.0}
LLAMA = dict(width=4096, heads=32, ffn=11008, vocab=32000, seq=2048, batch=1)
QUICK = dict(width=256, heads=4, ffn=688, vocab=1000, seq=64, batch=1)


def optimizer(kinds):
  return optax_hybrid.hybrid_adamw(1e-4, weight_decay=0.1, state_memory_kind=kinds, master="stochastic",
                                   moment_format="8bit")


def fsdp_mesh(devices: int):
  return jax.make_mesh((devices,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:devices])


def model_at(layers: int, sizes: dict, devices: int = 1):
  """The decoder's params, batch and ``optimizer -> train step``; on ``devices`` > 1 split over them (FSDP)."""
  cfg = models.LlamaConfig(layers=layers, **dict(sizes, batch=sizes["batch"] * devices))
  params = models.llama_params(cfg, jnp.bfloat16, "device")
  batch = models._tokens(cfg.batch, cfg.seq)
  activations = None
  if devices > 1:
    mesh = fsdp_mesh(devices)
    params, batch = models.fsdp_placed(params, batch, mesh)
    activations = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  step = lambda tx: models.donation_ordered(optax_hybrid.step_in_backward(tx, *models.llama_parts(cfg, activations)))
  return params, batch, step


def num_params(tree) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def choose(layers: int, sizes: dict, host_bytes: float, target: str, probes: dict, device_bytes=None,
           devices: int = 1):
  params, batch, step = model_at(layers, sizes, devices)
  try:
    chosen = optax_hybrid.choose_placement(optimizer, step, params, batch, target=target, host_bytes=host_bytes,
                                           device_bytes=device_bytes, probes=probes)
  except ValueError as e:
    print(f"    {layers} layers: no placement ({str(e)[:160]}...)", file=sys.stderr, flush=True)
    return None
  probes.update(chosen.probes)
  print(f"    {layers} layers: {chosen.resident_layers} resident ({chosen.resident_state}), "
        f"{chosen.streamed_layers} streamed", file=sys.stderr, flush=True)
  return dict(layers=layers, params=num_params(params), chosen=chosen)


def largest(sizes: dict, host_bytes: float, target: str, probes: dict, first: int, device_bytes=None,
            devices: int = 1) -> dict:
  """The deepest model the planner places: doubling from ``first``, then bisecting."""
  best = choose(first, sizes, host_bytes, target, probes, device_bytes, devices)
  if best is None:
    raise SystemExit(f"{first} layers do not fit: start lower (--first)")
  lo, hi = first, None
  while hi is None:
    r = choose(lo * 2, sizes, host_bytes, target, probes, device_bytes, devices)
    if r is None:
      hi = lo * 2
    else:
      lo, best = lo * 2, r
  while hi - lo > 1:
    mid = (lo + hi) // 2
    r = choose(mid, sizes, host_bytes, target, probes, device_bytes, devices)
    if r is None:
      hi = mid
    else:
      lo, best = mid, r
  return best


def baseline(target: str, quick: bool) -> int | None:
  """``optax.adamw`` (bf16 params, fp32 mu), device alone: benchmarks/gpu_memory.py's capacity search."""
  if quick:
    return None
  import gpu_memory
  row = gpu_memory.largest_within("optax.adamw bf16 + fp32 mu", target, gpu_memory.LIMIT * 256e9, {}, 8, 16)
  return row["params"]


def node_baseline(target: str, devices: int) -> dict:
  """``optax.adamw`` (bf16 params, fp32 mu) on ``devices`` GPUs alone, FSDP, with the down projection ``(F, D)``
  split on ``D`` or on ``F``: per split, the deepest model whose step fits 0.9 of each GPU's memory (the line
  through 8 and 16 layers, then checked a layer at a time). Returns the better split's ``{"split", "layers",
  "params"}``."""
  import optax
  from optax_hybrid import gpu_compile
  import gpu_memory
  limit = 0.9 * gpu_compile.target_device_memory_bytes(target)
  best = None
  for split, spec in (("D", jax.sharding.PartitionSpec(None, None, "fsdp")),
                      ("F", jax.sharding.PartitionSpec(None, "fsdp", None))):
    peaks = {}

    def peak(layers):
      if layers not in peaks:
        cfg = models.LlamaConfig(layers=layers, **dict(LLAMA, batch=devices))
        mesh = fsdp_mesh(devices)
        params, batch = models.fsdp_placed(models.llama_params(cfg, jnp.bfloat16, "device"),
                                           models._tokens(cfg.batch, cfg.seq), mesh, specs={"w_down": spec})
        activations = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
        tx = optax.adamw(1e-4, weight_decay=0.1, mu_dtype=jnp.float32)
        step = gpu_memory.train_step_of(tx, lambda p, b: models.llama_loss(cfg, p, b, activations=activations))
        peaks[layers] = gpu_compile.compile_for_gpu(step, params, gpu_memory.abstract_state(tx, params), batch,
                                                    target=target, num_devices=devices,
                                                    donate_argnums=(0, 1)).device_peak_bytes
        print(f"    optax.adamw, w_down split on {split}, {layers} layers: {peaks[layers] / GB:.1f} GB",
              file=sys.stderr, flush=True)
      return peaks[layers]

    depth = int(8 + (limit - peak(8)) * 8 / (peak(16) - peak(8)))
    while peak(depth) > limit:
      depth -= 1
    while peak(depth + 1) <= limit:
      depth += 1
    params = num_params(model_at(depth, LLAMA)[0])
    print(f"    optax.adamw, w_down split on {split}: {depth} layers, {params / 1e9:.2f} B", file=sys.stderr,
          flush=True)
    if best is None or params > best["params"]:
      best = dict(split=split, layers=depth, params=params)
  return best


PEAK_FLOPS = 989e12  # H200 SXM, dense bf16


def adamw_row(layers: int, sizes: dict, target: str) -> dict | None:
  """``optax.adamw`` (bf16 params, fp32 mu) on the device alone at ``layers``: its compiled peak and step estimate."""
  import optax
  from optax_hybrid import gpu_compile
  import gpu_memory
  cfg = models.LlamaConfig(layers=layers, **sizes)
  params = models.llama_params(cfg, jnp.bfloat16, "device")
  tx = optax.adamw(1e-4, weight_decay=0.1, mu_dtype=jnp.float32)
  step = gpu_memory.train_step_of(tx, lambda p, b: models.llama_loss(cfg, p, b))
  report = gpu_compile.compile_for_gpu(step, params, gpu_memory.abstract_state(tx, params),
                                       models._tokens(cfg.batch, cfg.seq), target=target, donate_argnums=(0, 1))
  if report.device_peak_bytes > 0.9 * gpu_compile.target_device_memory_bytes(target):
    return None
  estimate = report.step_time()
  return dict(device=report.device_peak_bytes, seconds=estimate.seconds, bound=estimate.lower_bound)


def speed_table(args) -> None:
  sizes_b = [float(x) for x in args.sizes.split(",")]
  for batch in (1, 4):
    sizes = dict(QUICK if args.quick else LLAMA, batch=batch)
    one, two = (num_params(model_at(n, sizes)[0]) for n in (1, 2))
    per_layer, rest = two - one, 2 * one - two
    probes = {}
    print(f"\nBatch {batch} x {sizes['seq']}, one {args.target.upper()} + 256 GB (0.9 of each), the placement "
          f"choose_placement finds; step_in_backward, 8-bit moments, master='stochastic'; compile-time estimates, "
          f"jax {jax.__version__}:\n")
    print("| params | layers | resident (state) / streamed | device GB | host GB | bus in / out B/weight | "
          "est. step s | bound s | step / bound | tokens/s | MFU (6N) | flops per weight per token | "
          "optax.adamw step s (tokens/s) |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for size in sizes_b:
      layers = max(1, round((size * 1e9 - rest) / per_layer))
      r = choose(layers, sizes, 2e8 if args.quick else 256e9, args.target, probes, 64e6 if args.quick else None)
      if r is None:
        print(f"| {size:g} B | {layers} | does not fit | | | | | | | | | | |", flush=True)
        continue
      c, n = r["chosen"], r["params"]
      tokens = batch * sizes["seq"]
      base = None if args.quick else adamw_row(layers, sizes, args.target)
      adamw = "does not fit" if base is None else f"{base['seconds']:.3f} ({tokens / base['seconds']:,.0f})"
      print(f"| {n / 1e9:.2f} B | {layers} | {c.resident_layers} ({c.resident_state}) / {c.streamed_layers} | "
            f"{c.compiled.device / GB:.1f} | {c.compiled.host / GB:.1f} | {c.compiled.bus_in / n:.2f} / "
            f"{c.compiled.bus_out / n:.2f} | {c.step_seconds:.3f} | {c.step_lower_bound:.3f} | "
            f"{c.step_seconds / c.step_lower_bound:.2f} | {tokens / c.step_seconds:,.0f} | "
            f"{6 * n * tokens / c.step_seconds / PEAK_FLOPS:.1%} | {c.compiled.flops / n / tokens:.1f}"
            f"{' (XLA recomputes to fit)' if c.recomputes else ''} | {adamw} |", flush=True)


def compile_placement(layers: int, resident: int, resident_state: str, sizes: dict, target: str,
                      devices: int = 1):
  """``resident`` layers on the device (their state in ``resident_state``), the rest streamed with their state in
  host memory: a placement named here (not the planner's choice), placed by ``StackPlacement``; the step compiled
  whole. Returns its report and the model's params."""
  from optax_hybrid import gpu_compile
  params, batch, step = model_at(layers, sizes, devices)
  rest_state = resident_state if resident else "host_state"
  placement = optax_hybrid.StackPlacement("layers", layers, resident, resident_state, rest_state, target,
                                          0.0, 0.0, None, None, 0.0, 0.0, num_devices=devices)
  placed, tx = placement.place(params), optimizer(placement.state_memory_kind)
  report = gpu_compile.compile_for_gpu(step(tx), placed, tx.init(placed), batch, target=target,
                                       num_devices=devices, donate_argnums=(0, 1))
  return report, params


def compile_split(layers: int, resident: int, resident_state: str, sizes: dict, target: str,
                  devices: int = 1) -> dict:
  """:func:`compile_placement`'s figures."""
  report, _ = compile_placement(layers, resident, resident_state, sizes, target, devices)
  return dict(resident=resident, state=resident_state, device=report.device_peak_bytes, host=report.host_peak_bytes,
              bus_in=report.to_device_bytes, bus_out=report.to_host_bytes)


def check_split(args) -> None:
  """The planner's choice at ``--layers`` against the best split found by bisection at full depth, per way."""
  from optax_hybrid import gpu_compile
  sizes, layers = QUICK if args.quick else LLAMA, args.layers
  host_bytes = 2e8 if args.quick else HOST_MEMORIES[args.check_split]
  device_bytes = 64e6 if args.quick else gpu_compile.target_device_memory_bytes(args.target)
  device_budget, host_budget = 0.9 * device_bytes, 0.9 * host_bytes / args.devices  # a host shared by the GPUs
  started = time.time()
  chosen = choose(layers, sizes, host_bytes, args.target, {}, device_bytes, args.devices)
  if chosen is None:
    raise SystemExit(f"{layers} layers: the planner finds no placement with {args.check_split}")
  c, n = chosen["chosen"], chosen["params"]
  fits = lambda r: r["device"] <= device_budget and r["host"] <= host_budget
  best = []
  for way in ("device", "host_state"):
    known = c.resident_state == way
    lo = (dict(resident=c.resident_layers, state=way, device=c.compiled.device, host=c.compiled.host,
               bus_in=c.compiled.bus_in, bus_out=c.compiled.bus_out) if known else None)
    lo_k, hi_k = (c.resident_layers, layers + 1) if known else (-1, layers + 1)
    while hi_k - lo_k > 1:
      k = lo_k + 1 if known and lo_k == c.resident_layers and hi_k == layers + 1 else (lo_k + hi_k) // 2
      r = compile_split(layers, k, way, sizes, args.target, args.devices)
      print(f"    {way}: {k} resident: device {r['device'] / GB:.1f} GB, host {r['host'] / GB:.1f} GB, "
            f"{'fits' if fits(r) else 'does not fit'}", file=sys.stderr, flush=True)
      if fits(r):
        lo_k, lo = k, r
      else:
        hi_k = k
    if lo is not None:
      best.append(lo)
  where = "" if args.devices == 1 else f" on a node of {args.devices} (FSDP, batch {args.devices} x 2048, per GPU)"
  print(f"\nThe planner's placement for {layers} layers ({n / 1e9:.2f} B params) with {args.check_split} of host "
        f"memory{where}, against the best split found by bisection at full depth (each candidate placed by hand with "
        f"StackPlacement and compiled whole for the {args.target.upper()}; budgets 0.9 of each memory); "
        f"jax {jax.__version__}, {time.time() - started:.0f} s:\n")
  share = n / args.devices  # the weights of one GPU's share: its bus bytes per weight
  print("| placement | resident (state) / streamed | device GB | host GB | bus in / out B/weight |")
  print("|---|---|---:|---:|---:|")
  print(f"| chosen by choose_placement | {c.resident_layers} ({c.resident_state}) / {c.streamed_layers} | "
        f"{c.compiled.device / GB:.1f} | {c.compiled.host / GB:.1f} | {c.compiled.bus_in / share:.2f} / "
        f"{c.compiled.bus_out / share:.2f} |")
  for r in best:
    print(f"| the most resident layers that fit, state on {r['state']} | {r['resident']} ({r['state']}) / "
          f"{layers - r['resident']} | {r['device'] / GB:.1f} | {r['host'] / GB:.1f} | {r['bus_in'] / share:.2f} / "
          f"{r['bus_out'] / share:.2f} |")
  fewest = min(r["bus_in"] + r["bus_out"] for r in best)
  print(f"\nThe chosen placement's bus bytes per step are {(c.compiled.bus_in + c.compiled.bus_out) / fewest:.3f}x "
        f"the fewest found.")


def breakdown(args) -> None:
  """The step-time estimate of ``--breakdown K`` resident layers (state in host memory) of ``--layers``, by part."""
  sizes = dict(QUICK if args.quick else LLAMA, batch=args.batch)
  k = args.breakdown
  report, params = compile_placement(args.layers, k, "host_state", sizes, args.target)
  t, n = report.step_time(), num_params(params)
  tokens = args.batch * sizes["seq"]
  print(f"\n{args.layers} layers ({n / 1e9:.2f} B params), {k} resident (state in host memory) / "
        f"{args.layers - k} streamed, batch {args.batch} x {sizes['seq']}, compiled for the {args.target.upper()} "
        f"(jax {jax.__version__}): device {report.device_peak_bytes / GB:.1f} GB, host "
        f"{report.host_peak_bytes / GB:.1f} GB\n")
  print("| estimate s | bound s | compute s | bus in s | bus out s | bus busy s | of it hidden s | launches s | "
        "flops per weight per token | at peak s | tokens/s |")
  print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  print(f"| {t.seconds:.3f} | {t.lower_bound:.3f} | {t.compute:.3f} | {t.bus_in:.3f} | {t.bus_out:.3f} | "
        f"{t.bus_busy:.3f} | {t.bus_hidden:.3f} | {t.launch_time:.3f} | {t.flops / tokens / n:.1f} | "
        f"{t.flops / PEAK_FLOPS:.3f} | {tokens / t.seconds:,.0f} |")
  print("\nSlowest loops (body, trips, seconds, compute, bus in, bus out, kernels):\n")
  for loop in t.loops[:4]:
    print(f"- {loop.body}: {loop.trips} trips, {loop.seconds:.3f} s, compute {loop.compute:.3f} s, bus in "
          f"{loop.bus_in:.3f} s, out {loop.bus_out:.3f} s, {loop.kernels} kernels")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--target", default="h200")
  parser.add_argument("--host-memories", default="256 GB,device alone",
                      help="comma-separated subset of: " + ", ".join(HOST_MEMORIES))
  parser.add_argument("--first", type=int, default=64, help="the first depth tried (then doubled, then bisected)")
  parser.add_argument("--no-baseline", action="store_true", help="leave optax.adamw's search out")
  parser.add_argument("--quick", action="store_true", help="small widths and a tiny device: a test of the script")
  parser.add_argument("--speed-table", action="store_true", help="step times of the chosen placement by model size")
  parser.add_argument("--sizes", default="7,13,20,33,45,57,64,85", help="--speed-table: billions of params")
  parser.add_argument("--check-split", metavar="MEMORY", help="the choice against a search of the split, at --layers")
  parser.add_argument("--layers", type=int, default=435, help="--check-split: the model's depth")
  parser.add_argument("--devices", type=int, default=1, help="GPUs of one node the model is split over (FSDP)")
  parser.add_argument("--breakdown", type=int, metavar="K", help="the estimate of K resident layers, by part")
  parser.add_argument("--batch", type=int, default=1, help="--breakdown: sequences per step")
  args = parser.parse_args(argv)
  if args.breakdown is not None:
    return breakdown(args)
  if args.check_split:
    return check_split(args)
  if args.speed_table:
    return speed_table(args)
  sizes = QUICK if args.quick else LLAMA
  device_bytes = 64e6 if args.quick else None
  started = time.time()
  probes, rows = {}, []
  for memory in args.host_memories.split(","):
    host = 2e8 if args.quick and memory != "device alone" else HOST_MEMORIES[memory]
    print(f"  {memory}:", file=sys.stderr, flush=True)
    rows.append((memory, largest(sizes, host, args.target, probes, 4 if args.quick else args.first, device_bytes,
                                 args.devices)))
  node = None
  if args.no_baseline:
    base = None
  elif args.devices > 1:
    node = node_baseline(args.target, args.devices)
    base = node["params"]
  else:
    base = baseline(args.target, args.quick)
  where = (f"one {args.target.upper()} ({'64 MB' if args.quick else 'its memory'}; batch 1 x {sizes['seq']}) and "
           f"each host memory" if
           args.devices == 1 else
           f"one node of {args.devices} {args.target.upper()} (FSDP over the {args.devices}, batch "
           f"{args.devices} x {sizes['seq']}; figures per GPU) and each host memory, shared by the {args.devices}")
  print(f"\nThe largest Llama-style decoder ({', '.join(f'{k} {v}' for k, v in sizes.items() if k != 'batch')}) "
        f"whose placement optax_hybrid.choose_placement finds for {where}, both used up to 90%; "
        f"step_in_backward, 8-bit moments, master='stochastic'; compile-time figures, jax {jax.__version__}, "
        f"{time.time() - started:.0f} s:\n")
  print("| host memory | layers | params | x optax.adamw bf16 + fp32 mu | resident (state) / streamed layers | "
        "device GB | host GB | bus in / out B/weight | est. step s (bound) |")
  print("|---|---:|---:|---:|---|---:|---:|---:|---:|")
  for memory, r in rows:
    c = r["chosen"]
    ratio = f"{r['params'] / base:.2f}" if base else "-"
    print(f"| {memory} | {r['layers']} | {r['params'] / 1e9:.2f} B | {ratio} | {c.resident_layers} "
          f"({c.resident_state}) / {c.streamed_layers} | {c.compiled.device / GB:.1f} | {c.compiled.host / GB:.1f} | "
          f"{c.compiled.bus_in * args.devices / r['params']:.2f} / "
          f"{c.compiled.bus_out * args.devices / r['params']:.2f} | {c.step_seconds:.3f} ({c.step_lower_bound:.3f}) |")
  if node:
    print(f"\noptax.adamw bf16 + fp32 mu on the {args.devices} GPUs alone, FSDP, the down projection split on "
          f"{node['split']} (its better split): {node['layers']} layers, {base / 1e9:.2f} B params (this run).")
  elif base:
    print(f"\noptax.adamw bf16 + fp32 mu, device alone: {base / 1e9:.2f} B params "
          f"(benchmarks/gpu_memory.py's search, this run).")
  return rows


if __name__ == "__main__":
  main()
