"""Throughput of the Llama-style decoder per setup and batch, estimated from the programs XLA:GPU compiles for an H200.

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/step_time.py [--setups A;B] [--batches 1,4,16]
        [--check-depth 16] [--cache compiles.jsonl]
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/step_time.py --overlap-probe
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/step_time.py --one SETUP --layers 4 --batch 4 [--flat-layers]
        [--variants]
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/step_time.py --quick   # a small model, every setup

Needs JAX's CUDA plugin (docs/gpu_compile.md); no GPU. For each setup
(:data:`SETUPS`) and batch (sequences of 2048 tokens), the whole train step
of ``benchmarks/models.py``'s Llama-style decoder (width 4096, 32 heads,
SwiGLU 11008, vocab 32000; loss, gradient, optimizer; params and state
donated; abstract inputs) is compiled for the H200 target at two depths
(``--depths``, default 4 and 8 layers) and its step time estimated by
``optax_hybrid.gpu_compile.step_time`` on the H200 SXM / PCIe 5 x16 figures.

The layers are scanned (``lax.scan``, ``scan_layers`` or ``step_in_backward``'s
loops): a deeper model runs the same loop body more times, so every estimated
time and byte count is linear in depth. The figures at a model's depth are
extrapolated from the two compiles (``a + (L - 4) (b - a) / 4``), as
``benchmarks/gpu_memory.py`` extrapolates memory; ``--check-depth`` compiles
one more depth and prints the extrapolation's error there.

Model sizes: a 7B-class model (32 layers, 6.74 B params) for every setup, and
each setup at its capacity on one H200 with 256 GB of host memory (the depths
of docs/records/benchmarks.md's "Largest trainable model per host memory", batch
1 x 2048; ``host_state`` with its params on the device has no row there: its
depth is the host tier's). Columns: estimated step time, tokens/s, MFU
(``6 N T`` model flops over the time at 989 TFLOP/s), the bus time hidden
behind kernels, and whether the step fits the device (0.9 of 150.8 GB) and,
for the streamed setups, 0.9 of 256 GB of host memory, both extrapolated the
same way. Then, per setup and size, the smallest batch whose arithmetic
covers the bus (compute >= bus in and >= bus out, compute being linear in the
batch), compiled and estimated at that batch.

``--overlap-probe``: a loop of 8 trips of 40 matmuls that brings 6 slices in
per trip, as 6 copies or as one packed copy, fetched in the trip or a trip
ahead: how much of the bus XLA's schedule hides in each case
(docs/records/streaming_programs.md). ``--one``: one compile's figures as a JSON line
(``XLA_FLAGS`` apply; ``--variants``: the step again with each figure of the model moved, docs/step_time.md).

Each compile runs in its own subprocess; a failed compile stops the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
from typing import Any, Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, os.pardir))
import gpu_memory  # noqa: E402
import models  # noqa: E402
import optax_hybrid  # noqa: E402
from optax_hybrid import gpu_compile  # noqa: E402
from optax_hybrid.gpu_compile import step_time  # noqa: E402

GB = 1e9
SIZES = dict(width=4096, heads=32, ffn=11008, vocab=32000, seq=2048)
LIMIT = 0.9  # of each memory, as benchmarks/gpu_memory.py's capacity table
HOST_MEMORY = 256e9
SEVEN_B = 32  # layers: 6.74 B params, Llama-2-7B's shape


@dataclasses.dataclass(frozen=True)
class Setup:
  """A train step: param dtype, optimizer, where the layers live and run, and its capacity depth at 256 GB."""

  dtype: Any
  make_tx: Callable[[], Any]
  streamed: bool  # layers in pinned_host, run by scan_layers
  in_backward: bool  # step_in_backward
  capacity_layers: int


def _hybrid(**kw):
  return lambda: optax_hybrid.hybrid_adamw(1e-4, weight_decay=0.1, **kw)


SETUPS = {
    "optax.adamw, bf16 params + fp32 mu": Setup(
        jnp.bfloat16, lambda: optax.adamw(1e-4, weight_decay=0.1, mu_dtype=jnp.float32), False, False, 64),
    "host tier, fp32 master, 8-bit moments": Setup(
        jnp.bfloat16, _hybrid(tiers="host", master_dtype=jnp.float32, moment_format="8bit"), False, False, 144),
    "host_state tier, fp32 master, 8-bit moments": Setup(
        jnp.bfloat16, _hybrid(tiers="host_state", master_dtype=jnp.float32, moment_format="8bit"), False, False, 144),
    "scan_layers + host_state, stochastic, 8-bit moments": Setup(
        jnp.bfloat16, _hybrid(tiers="host_state", master="stochastic", moment_format="8bit"), True, False, 188),
    "step_in_backward, host_state, stochastic, 8-bit moments": Setup(
        jnp.bfloat16, _hybrid(tiers="host_state", master="stochastic", moment_format="8bit"), True, True, 281),
}
assert not any(";" in name for name in SETUPS)  # --setups splits on semicolons


def train_step(setup: Setup, model: models.Model, cfg: models.LlamaConfig, tx: Any) -> Callable:
  """``(params, state, batch) -> (params, state, loss)`` of a setup."""
  if setup.in_backward:
    return models.donation_ordered(optax_hybrid.step_in_backward(tx, *models.llama_parts(cfg)))
  return gpu_memory.train_step_of(tx, model.loss)


def flat_layers(params: dict, layer: Callable) -> tuple[dict, Callable]:
  """``params`` with its stacked layers as flat params (``optax_hybrid.flatten_params(stacked=True)``: one
  ``(L, N)`` array, a layer's weights one after another in a row) and ``layer`` reading its weights through
  ``as_tree``: the copy of params a streamed trip makes is then one."""
  stack = params["layers"]
  sharding = jax.tree.leaves(stack)[0].sharding  # abstract: eval_shape keeps no memory kind
  flat = jax.eval_shape(lambda tree: optax_hybrid.flatten_params(tree, stacked=True), stack)
  flat = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), flat)
  return dict(params, layers=flat), lambda x, p, rest, batch: layer(x, p.as_tree(), rest, batch)


def write_latency_profile(hlo: str, path: str) -> None:
  """A profile for XLA's scheduler (``--xla_gpu_pgle_profile_file_or_directory_path``) from the estimate's costs:
  each kernel at its roofline, each copy between memories at its bytes over the PCIe bandwidth."""
  bandwidth = step_time.H200_SXM.pcie_bandwidth
  costs = dict(step_time.kernel_seconds(hlo))
  for instructions in gpu_compile.parse_hlo(hlo)[0].values():
    shapes = {i.name: i.shape for i in instructions}
    for ins in instructions:
      moved = gpu_compile.transfer_of(ins, shapes) if ins.opcode in ("fusion-start", "copy-start") else None
      if moved and any(moved):
        costs[ins.name] = sum(moved) / bandwidth
  with open(path, "w") as f:
    f.writelines(f'costs {{ name: "{name}" cost_us: {seconds * 1e6:.3f} }}\n' for name, seconds in costs.items())


def all_in_command_buffers(hlo: str) -> gpu_compile.CommandBuffers:
  """A plan in which every instruction runs from one command buffer and every loop on the device: what the
  estimate would be if XLA captured everything (one launch per step)."""
  computations, entry = gpu_compile.parse_hlo(hlo)
  names = frozenset(i.name for instructions in computations.values() for i in instructions)
  loops = frozenset(i.name for instructions in computations.values() for i in instructions if i.opcode == "while")
  first = next((i.name for i in computations[entry] if i.opcode not in gpu_compile.BOOKKEEPING_OPS), None)
  return gpu_compile.CommandBuffers(names, frozenset({first}), loops, 1)


def variants(report) -> dict:
  """The step estimated with each of the model's figures moved one way: how much each part of the model weighs."""
  h = step_time.HARDWARE[report.target]
  change = lambda **kw: step_time.estimate(report, dataclasses.replace(h, **kw)).seconds
  return {"as estimated": report.step_time().seconds,
          "no launch or loop cost": change(launch_seconds=0, while_trip_seconds=0),
          "launches at 2 us": change(launch_seconds=2e-6), "launches at 5 us": change(launch_seconds=5e-6),
          "no copy latency": change(copy_latency_seconds=0),
          "host memory at 0.75 of its peak": change(host_memory_bandwidth=0.75 * h.host_memory_bandwidth),
          "kernels at 0.7 of the peak flops": change(peak_flops=0.7 * h.peak_flops),
          "everything in one command buffer": step_time.estimate(report.hlo, h, all_in_command_buffers(report.hlo)).seconds}


def compile_one(name: str, layers: int, batch: int, target: str, flat: bool = False, profile: str = "",
                with_variants: bool = False) -> dict:
  """One compile: params, device and host peak, and the step-time estimate (``flat``: :func:`flat_layers`;
  ``profile``: a path to write :func:`write_latency_profile` to; ``with_variants``: :func:`variants` too)."""
  setup = SETUPS[name]
  cfg = models.LlamaConfig(layers=layers, batch=batch, **SIZES)
  model = models.llama(setup.dtype, stream=setup.streamed, layers=layers, batch=batch,
                       layers_memory_kind="pinned_host" if setup.streamed else "device", **SIZES)
  tx = setup.make_tx()
  params, step = model.params, train_step(setup, model, cfg, tx)
  if flat:
    if not setup.in_backward:
      raise SystemExit("--flat-layers: only the step_in_backward setup")
    embed, layer, head = models.llama_parts(cfg)
    params, layer = flat_layers(params, layer)
    step = models.donation_ordered(optax_hybrid.step_in_backward(tx, embed, layer, head))
  state = gpu_memory.abstract_state(tx, params)
  report = gpu_compile.compile_for_gpu(step, params, state, model.batch, target=target, donate_argnums=(0, 1))
  if profile:
    write_latency_profile(report.hlo, profile)
  estimate = report.step_time()
  return dict(setup=name, layers=layers, batch=batch, params=model.num_params, device_bytes=report.device_peak_bytes,
              host_bytes=report.host_peak_bytes, warnings=len(report.warnings), to_device=report.to_device_bytes,
              to_host=report.to_host_bytes,
              overlap=[(x.fetches, x.overlapped, x.carried) for x in gpu_compile.loop_transfers(report.hlo)],
              **{k: v for k, v in estimate.as_dict().items() if k not in ("hardware", "loops")},
              **({"variants": variants(report)} if with_variants else {}))


def in_subprocess(args: list[str], xla_flags: str = "") -> dict:
  """Runs this script with ``args`` in a subprocess; returns its last JSON line (a failure stops the run)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + xla_flags).strip())
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True,
                        timeout=3600, env=env)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if proc.returncode != 0 or not lines:
    tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
    raise SystemExit(f"step_time.py {' '.join(args)} failed (rc {proc.returncode}):\n{tail}")
  return json.loads(lines[-1])


LINEAR = ("params", "device_bytes", "host_bytes", "to_device", "to_host", "seconds", "compute", "bus_in", "bus_out",
          "host", "host_memory", "collectives", "launch_time", "launch_wait", "launches", "loop_trips", "bus_busy",
          "bus_hidden", "flops")
BOUNDS = ("compute", "bus_in", "bus_out", "host_memory", "collectives", "launch_time")  # StepTime.lower_bound's


def at_depth(a: dict, b: dict, layers: int) -> dict:
  """The figures at ``layers``, extrapolated from compiles ``a`` and ``b`` at two depths (linear in depth)."""
  slope = lambda key: (b[key] - a[key]) / (b["layers"] - a["layers"])
  out = dict(a, layers=layers, **{k: a[k] + (layers - a["layers"]) * slope(k) for k in LINEAR})
  out["lower_bound"] = max(out[k] for k in BOUNDS)
  return out


class Runner:
  """Compiles (in subprocesses, each once) and extrapolates."""

  def __init__(self, target: str, depths: tuple[int, int], quick: bool, cache: str | None = None):
    self.target, self.depths, self.cache, self.cache_file = target, depths, {}, cache
    self.options = ["--target", target] + (["--quick"] if quick else [])
    if cache and os.path.exists(cache):  # compiles of an earlier run of the same command
      for line in open(cache):
        r = json.loads(line)
        self.cache[(r["setup"], r["layers"], r["batch"])] = r

  def compiled(self, name: str, layers: int, batch: int) -> dict:
    key = (name, layers, batch)
    if key not in self.cache:
      self.cache[key] = in_subprocess(["--one", name, "--layers", str(layers), "--batch", str(batch),
                                       *self.options])
      print(f"  {json.dumps(self.cache[key])}", file=sys.stderr, flush=True)
      if self.cache_file:
        with open(self.cache_file, "a") as f:
          f.write(json.dumps(self.cache[key]) + "\n")
    return self.cache[key]

  def figures(self, name: str, layers: int, batch: int) -> dict:
    a, b = (self.compiled(name, d, batch) for d in self.depths)
    return at_depth(a, b, layers)


def row(r: dict, streamed: bool) -> str:
  tokens = r["batch"] * SIZES["seq"]
  model_flops = 6 * r["params"] * tokens
  fits = r["device_bytes"] <= LIMIT * gpu_compile.target_device_memory_bytes("h200") and (
      not streamed or r["host_bytes"] <= LIMIT * HOST_MEMORY)
  hidden = f"{r['bus_hidden'] / r['bus_busy']:.0%}" if r["bus_busy"] else "-"
  memory = f"{r['device_bytes'] / GB:.0f}" + (f" / {r['host_bytes'] / GB:.0f}" if streamed else "")
  return (f"| {r['setup']} | {r['layers']} | {r['params'] / 1e9:.2f} B | {r['batch']} | {r['seconds']:.3f} | "
          f"{r['lower_bound']:.3f} | {r['compute']:.3f} | {r['bus_in']:.3f} / {r['bus_out']:.3f} | {r['host']:.3f} | "
          f"{tokens / r['seconds']:,.0f} | {model_flops / (r['seconds'] * step_time.H200_SXM.peak_flops):.1%} | "
          f"{hidden} | {memory} {'yes' if fits else 'no'} |")


HEADER = ("| setup | layers | params | batch x 2048 | step s | lower bound s | compute s | bus in / out s | host s | "
          "tokens/s | MFU | bus hidden | device (/ host) GB, fits |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def covering_batch(runner: Runner, name: str, layers: int, batches: list[int]) -> dict | None:
  """The smallest batch whose compute covers both bus directions (compute linear in the batch), estimated there."""
  lo, hi = (runner.figures(name, layers, b) for b in (min(batches), max(batches)))
  bus = max(lo["bus_in"], lo["bus_out"], hi["bus_in"], hi["bus_out"])
  if bus == 0:
    return None
  per_sequence = (hi["compute"] - lo["compute"]) / (hi["batch"] - lo["batch"])
  batch = max(1, math.ceil(lo["batch"] + (bus - lo["compute"]) / per_sequence))
  r = runner.figures(name, layers, batch)
  while r["compute"] < max(r["bus_in"], r["bus_out"]):  # the linear guess fell short: one more sequence
    batch += 1
    r = runner.figures(name, layers, batch)
  return r


def table(args) -> list[dict]:
  runner = Runner(args.target, tuple(int(d) for d in args.depths.split(",")), args.quick, args.cache)
  batches = [int(b) for b in args.batches.split(",")]
  names = args.setups.split(";")
  rows = []
  for name in names:
    setup = SETUPS[name]
    for layers in sorted({args.seven_b, setup.capacity_layers if not args.quick else args.seven_b}):
      for batch in batches:
        rows.append(runner.figures(name, layers, batch))
  print(f"\nThe Llama-style decoder's train step (width 4096, 32 heads, SwiGLU 11008, vocab 32000, sequences of "
        f"{SIZES['seq']}), compiled by XLA:GPU for the {args.target.upper()} at {runner.depths[0]} and {runner.depths[1]} "
        f"layers and extrapolated to the depth; times estimated by optax_hybrid.gpu_compile.step_time on the "
        f"{step_time.H200_SXM.name} figures (not measured); jax {jax.__version__}:\n")
  print(HEADER)
  for r in rows:
    print(row(r, SETUPS[r["setup"]].streamed))
  print("\nThe smallest batch whose arithmetic covers the bus (compute >= bus in, bus out), estimated there:\n")
  print(HEADER)
  for name in names:
    for layers in sorted({args.seven_b, SETUPS[name].capacity_layers if not args.quick else args.seven_b}):
      r = covering_batch(runner, name, layers, batches)
      if r is not None:
        rows.append(dict(r, covering=True))
        print(row(r, SETUPS[name].streamed) + f" step / lower bound {r['seconds'] / r['lower_bound']:.2f}")
  if args.check_depth:
    name = names[-1]
    exact = runner.compiled(name, args.check_depth, batches[0])
    guess = runner.figures(name, args.check_depth, batches[0])
    print(f"\nExtrapolation check, {name}, {args.check_depth} layers, batch {batches[0]}: estimated step "
          f"{exact['seconds']:.4f} s compiled at that depth, {guess['seconds']:.4f} s extrapolated "
          f"({guess['seconds'] / exact['seconds'] - 1:+.2%}); device {exact['device_bytes'] / GB:.2f} GB vs "
          f"{guess['device_bytes'] / GB:.2f} GB")
  return rows


# --- why the copies do not hide: probes ------------------------------------------------------

PROBE = dict(layers=8, n=4096, dots=40, stacks=6)


def probe_program(packed: bool, ahead: bool) -> tuple[Callable, list]:
  """A loop over ``layers`` trips of ``dots`` matmuls (4096 x 4096 bf16) that brings ``stacks`` slices of
  4096 x 4096 bf16 in per trip from ``pinned_host``: from ``stacks`` stacks (one copy each) or from one stack
  whose layer holds them all (``packed``: one copy), fetched in the trip that uses them or a trip ahead."""
  from jax import lax
  L, n, dots, stacks = (PROBE[k] for k in ("layers", "n", "dots", "stacks"))
  mesh = jax.make_mesh((1,), ("one",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
  on = lambda kind: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=kind)
  shape = (L, stacks * n, n) if packed else (L, n, n)
  args = [[jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=on("pinned_host"))] * (1 if packed else stacks),
          jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=on("device"))]
  fetch = lambda host, i: [jax.device_put(lax.dynamic_index_in_dim(h, i, 0, keepdims=False), jax.memory.Space.Device)
                           for h in host]

  def layer(x, slices):
    blocks = [w[j * n:(j + 1) * n] for w in slices for j in range(w.shape[0] // n)]  # every slice is used
    for j in range(dots):
      x = x @ blocks[j % len(blocks)]
    return x

  def run(host, x):
    if ahead:
      body = lambda i, c: (layer(c[0], c[1]), fetch(host, jnp.minimum(i + 1, L - 1)))
      return lax.fori_loop(0, L, body, (x, fetch(host, 0)))[0]
    return lax.fori_loop(0, L, lambda i, x: layer(x, fetch(host, i)), x)

  return run, args


def probe_one(packed: bool, ahead: bool, target: str) -> dict:
  fn, args = probe_program(packed, ahead)
  report = gpu_compile.compile_for_gpu(fn, *args, target=target)
  return dict(report.step_time().as_dict(), overlap=[(x.fetches, x.overlapped) for x in
                                                   gpu_compile.loop_transfers(report.hlo)])


def overlap_probe(args) -> list[dict]:
  rows = [dict(in_subprocess(["--one-probe", f"{packed},{ahead}", "--target", args.target]), packed=packed, ahead=ahead)
          for packed in (False, True) for ahead in (False, True)]
  print(f"\nA loop of {PROBE['layers']} trips, each {PROBE['dots']} matmuls 4096 x 4096 bf16 and {PROBE['stacks']} "
        f"slices of 4096 x 4096 bf16 brought in from pinned_host; estimated for the {args.target.upper()}:\n")
  print("| slices come as | fetched | copies per trip (with a kernel beside) | step ms | lower bound ms | "
        "step / bound | bus hidden |")
  print("|---|---|---:|---:|---:|---:|---:|")
  for r in rows:
    source = "one packed copy" if r["packed"] else f"{PROBE['stacks']} copies"
    when = "a trip ahead" if r["ahead"] else "in the trip that uses them"
    print(f"| {source} | {when} | {r['overlap'][0][0]} ({r['overlap'][0][1]}) | {r['seconds'] * 1e3:.2f} | "
          f"{r['lower_bound'] * 1e3:.2f} | {r['seconds'] / r['lower_bound']:.2f} | {r['bus_hidden_fraction']:.0%} |")
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--target", default="h200")
  parser.add_argument("--setups", default=";".join(SETUPS), help="semicolon-separated subset of: " + "; ".join(SETUPS))
  parser.add_argument("--batches", default="1,4,16", help="sequences of 2048 tokens per step (comma-separated)")
  parser.add_argument("--depths", default="4,8", help="the two compiled depths")
  parser.add_argument("--seven-b", type=int, default=SEVEN_B, help="the 7B-class model's layers (default 32)")
  parser.add_argument("--check-depth", type=int, default=0, help="compile the last setup at this depth too")
  parser.add_argument("--quick", action="store_true", help="a small model (width 256, sequences of 128): a test")
  parser.add_argument("--cache", help="a file of compiles (JSON lines): read if it exists, each new compile appended")
  parser.add_argument("--overlap-probe", action="store_true",
                      help="how many copies per trip XLA's schedule hides: several small ones or one packed")
  parser.add_argument("--one", help="one compile of this setup (with --layers, --batch): a JSON line")
  parser.add_argument("--one-probe", help=argparse.SUPPRESS)
  parser.add_argument("--layers", type=int, default=4, help="--one: layers")
  parser.add_argument("--batch", type=int, default=1, help="--one: sequences of 2048")
  parser.add_argument("--write-latency-profile", default="", metavar="PATH",
                      help="--one: write a profile for XLA's scheduler from the estimate's costs (docs/records/streaming_programs.md)")
  parser.add_argument("--variants", action="store_true",
                      help="--one: the step estimated with each figure of the model moved (docs/step_time.md)")
  parser.add_argument("--flat-layers", action="store_true",
                      help="--one: the stacked layers as one (L, N) array, each weight a slice of a layer's row")
  args = parser.parse_args(argv)
  if args.quick:
    SIZES.update(width=256, heads=2, ffn=688, vocab=1000, seq=128)
  if args.one:
    print(json.dumps(compile_one(args.one, args.layers, args.batch, args.target, args.flat_layers,
                                  args.write_latency_profile, args.variants)))
    return None
  if args.one_probe:
    packed, ahead = (x == "True" for x in args.one_probe.split(","))
    print(json.dumps(probe_one(packed, ahead, args.target)))
    return None
  if args.overlap_probe:
    return overlap_probe(args)
  if args.quick:
    args.seven_b, args.depths, args.batches = 4, "2,3", "1,2"
  return table(args)


if __name__ == "__main__":
  main()
