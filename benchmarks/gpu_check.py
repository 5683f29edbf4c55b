"""Everything the GPU must show, in one call: correctness first, then every figure.

    PYTHONPATH=. python benchmarks/gpu_check.py            # on a GPU machine, < 8 min
    PYTHONPATH=. python benchmarks/gpu_check.py --smoke    # tiny sizes, any machine (the test runs this)

1. Correctness: ``kernel="pallas"`` against ``kernel="xla"`` and against a
   float64 NumPy model of AdamW, over several steps with a schedule, on a tree
   with odd sizes, a scalar, an empty leaf, fp32 and bf16 params (fp32 moments),
   both memory kinds; the compiled step's Triton launches and its in-place
   aliasing. With 8-bit moments (``moment_format="8bit"``), step by step from
   the same state: Pallas against the XLA rule and against the float64 model
   (codes may differ by one at near ties: at most 0.1% of them), one launch,
   no float32 copy of the moments among the temporaries.
2. Copy bandwidth: a jitted device-to-device copy of 1 GiB (8 B per element).
3. A sweep of the kernel's block size and warps on one 256M-param leaf.
4. Step time on 1 leaf of 256M params, 1024 leaves of 64K and the GPT-2-small
   shapes: ours (Pallas and XLA; fused ``tx.step`` and the Optax
   update + apply), ``optax.adamw``, and ``torch.optim.AdamW(fused=True)`` when
   torch sees the GPU. JAX steps run ``--steps`` at a time inside one jitted
   ``fori_loop`` (device time, no Python dispatch); torch's are launched
   back to back and synchronized once. Medians of ``--reps`` rounds,
   interleaved. GB/s counts the bytes per param a step must move: 28 for
   fp32 moments, 16.06 for 8-bit ones (the ``8-bit moments`` rows, against
   the fp32 rows above them); "of copy" divides it by section 2's bandwidth.
5. Placement tiers on ~1B bf16 params (fp32 master and moments): device
   memory by tier from ``compiled.memory_analysis()`` (device and ``host_*``
   fields), step time per tier, the device<->host copy bandwidth measured in
   the same run, and whether host and device work overlapped (a half/half
   ``offload_fraction`` step against its two halves run alone).
6. Layers streamed from host memory: the Llama-style decoder of
   ``benchmarks/models.py`` (width 2048, 8 layers, batch 4 x 2048) trained 3
   steps all on the device (``lax.scan``, device tier), streamed
   (``scan_layers`` from ``pinned_host``, host tier) and streamed with the
   layers stepped inside the backward pass (``step_in_backward``,
   ``host_state`` tier): same losses, step time of each, device and host memory; then the deepest streamed model that the
   machine's host memory holds (about 70% of it), one step.

Beside each measured step time (sections 4, 5 and 6) the script prints the time
``optax_hybrid.gpu_compile.step_time`` estimates from the same compiled program's HLO
(``compiled.as_text()``) on the spec figures of the GPU it runs on (H100 or
H200 SXM, PCIe 5 x16): the estimate's check on hardware (docs/step_time.md).
Section 6 also prints, beside the kernels, launches and loop trips the
estimate counts, the kernels and launches of one profiled step (a JAX
profiler trace: the GPU streams' kernel records, the host's kernel and graph
launch calls); the text of a compiled program shows no command buffers, so
the estimate counts every kernel as launched alone there.
With ``--smoke`` on a CPU the estimate reads the CPU program: the column then
only shows that the path runs.

Exits non-zero if a correctness check failed (after printing every figure).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, os.pardir))
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))  # the float64 model
import optax_hybrid  # noqa: E402
from optax_hybrid import placement  # noqa: E402
from optax_hybrid.gpu_compile import gpu_launches, step_time  # noqa: E402
from optax_hybrid.kernels import LeafFacts, LeafOperands, pallas_gpu, reference, step_of  # noqa: E402
from optax_hybrid.rules.adamw import AdamW  # noqa: E402
from stepping import adam_scalars  # noqa: E402  (tests/stepping.py)
from numpy_reference import adamw_step_8bit, adamw_steps, colossal_lr  # noqa: E402
from step import gpt2_small_shapes  # noqa: E402  (benchmarks/step.py)

BYTES_PER_PARAM = 28
# An fp32 step with 8-bit moments: p read and written, g read, 1-byte codes of m and v read and
# written, and a 4-byte scale per 256 values of each, read and written.
BYTES_PER_PARAM_8BIT = 4 + 4 + 4 + 2 * 2 * (1 + 4 / 256)
LR, WD = 1e-3, 0.1
FAILURES: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
  print(f"  {'PASS' if ok else 'FAIL'}  {name}{': ' + detail if detail else ''}", flush=True)
  if not ok:
    FAILURES.append(name)


def guarded(section, name: str):
  """Runs one section; an exception is printed and counted as a failure instead of ending the run."""
  try:
    return section()
  except Exception:  # noqa: BLE001 - report and go on: every later figure is still wanted
    import traceback
    traceback.print_exc()
    check(f"{name} raised", False)
    return None


def excess(a, b, rtol, atol) -> float:
  """The largest |a - b| / (atol + rtol |b|): <= 1 is within tolerance, as in np.allclose."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.size == 0:
    return 0.0
  return float(np.max(np.abs(a - b) / (atol + rtol * np.abs(b))))


# --- 1. correctness ------------------------------------------------------------

def correctness(block: int, smoke: bool = False) -> None:
  print("\n## 1. correctness", flush=True)
  rng = np.random.default_rng(0)
  shapes = {"w": (257, 129), "b": (129,), "s": (), "e": (0, 3), "odd": (3 * block + 7,)}
  sched = optax_hybrid.warmup_cosine_schedule(1e-2, 8, 2, 1e-3)
  steps = 6
  grads_np = [{k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()} for _ in range(steps)]
  params_np = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
  kinds = [None] + (["pinned_host"] if "pinned_host" in placement.available_memory_kinds() else [])
  # --smoke (interpret mode, slow) keeps one combination per dtype.
  combos = [(d, k) for d in (jnp.float32, jnp.bfloat16) for k in kinds]
  if smoke:
    combos = [(jnp.float32, kinds[0]), (jnp.bfloat16, kinds[-1])]
  for dtype, kind in combos:
    finals = {}
    for kernel in ("pallas", "xla"):
      tx = optax_hybrid.hybrid_adamw(sched, weight_decay=WD, mu_dtype=jnp.float32, nu_dtype=jnp.float32,
                                     state_memory_kind=kind, kernel=kernel, skip_nonfinite=True)
      p = jax.device_put({k: jnp.asarray(v, dtype) for k, v in params_np.items()}, jax.devices()[0])
      s = tx.init(p)
      step = jax.jit(tx.step, donate_argnums=(0, 1))
      for g in grads_np:
        p, s = step(p, s, {k: jnp.asarray(v, dtype) for k, v in g.items()})
      finals[kernel] = jax.tree.map(np.asarray, (p, s.mu, s.nu))
    rtol = 1e-5 if dtype == jnp.float32 else 2 * 2**-8  # bf16: two rounding steps
    worst = max(excess(a, b, rtol, 1e-6)
                for a, b in zip(jax.tree.leaves(finals["pallas"]), jax.tree.leaves(finals["xla"])))
    check(f"pallas == xla, {jnp.dtype(dtype).name} params, {kind or 'device'} moments, {steps} steps",
          worst <= 1, f"error / tolerance {worst:.2f} (rtol {rtol:.0e}, atol 1e-6)")
    if dtype == jnp.float32:
      lrs = [colossal_lr(k, 1e-2, 8, 2, 1e-3) for k in range(steps)]
      want, _, _ = adamw_steps(params_np, grads_np, lrs, weight_decay=WD)
      worst = max(excess(finals["pallas"][0][k], want[-1][k], 2e-5, 2e-6) for k in shapes)
      check(f"pallas == float64 model, {kind or 'device'} moments", worst <= 1,
            f"error / tolerance {worst:.2f} (rtol 2e-5, atol 2e-6)")

  # What XLA was given: one Triton launch per 64 leaves, every buffer updated in place.
  n_leaves = 65 if smoke else 130
  params = {f"l{i:03d}": jnp.zeros((1000 + i,), jnp.float32) for i in range(n_leaves)}
  tx = optax_hybrid.hybrid_adamw(LR, weight_decay=WD, kernel="pallas")
  lowered = jax.jit(tx.step, donate_argnums=(0, 1)).lower(params, tx.init(params), params)
  launches = gpu_launches(lowered.as_text())
  on_gpu = jax.default_backend() == "gpu"
  want = -(-n_leaves // pallas_gpu.MAX_LEAVES_PER_LAUNCH) if on_gpu else 0  # interpret mode: no launch
  check(f"{n_leaves} leaves -> {want} Triton launches", launches == want, f"{launches} launches")
  # Interpret mode copies; only the GPU kernel is in place.
  memory = lowered.compile().memory_analysis() if on_gpu else None
  if memory is not None:
    state_bytes = 3 * 4 * sum(x.size for x in params.values())
    temp = memory.temp_size_in_bytes
    check("in place: temporaries are a small fraction of p, m, v", temp < 0.1 * state_bytes,
          f"temp {temp / 2**20:.2f} MiB vs {state_bytes / 2**20:.2f} MiB of p, m, v")


def code_differences(got, want) -> tuple[int, int]:
  """How many 8-bit codes differ, and by how much at most."""
  diff = np.abs(np.asarray(got, np.int64) - np.asarray(want, np.int64))
  return int(np.count_nonzero(diff)), int(diff.max(initial=0))


def correctness_8bit(smoke: bool = False) -> None:
  """8-bit moments: Pallas against the XLA rule and the float64 model, one step at a time from the same state.

  Codes may differ by one where the value lies at a threshold between two codes (float32
  rounding, and Triton's division, may fall either way): at most 0.1% of them, by one.
  """
  rng = np.random.default_rng(1)
  # "w": whole 256-value blocks (the kernel's); "odd": rows ending in a shorter block (the
  # reference rule's, in the same step); "b": too small to quantize (float32 moments).
  shapes = {"w": (16, 512) if smoke else (1000, 768), "odd": (40, 300), "b": (129,)}
  steps = 2 if smoke else 6
  sched = optax_hybrid.warmup_cosine_schedule(1e-2, 8, 2, 1e-3)
  params = jax.device_put({k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()},
                          jax.devices()[0])
  grads = [{k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()} for _ in range(steps)]
  txs = {k: optax_hybrid.hybrid_adamw(sched, weight_decay=WD, moment_format="8bit", kernel=k, skip_nonfinite=True)
         for k in ("pallas", "xla")}
  # The state's plan names the kernel: each optimizer gets the same arrays in its own state.
  structures = {k: jax.tree.structure(tx.init(params)) for k, tx in txs.items()}
  state_of = lambda k, state: jax.tree.unflatten(structures[k], jax.tree.leaves(state))
  jitted = {k: jax.jit(tx.step) for k, tx in txs.items()}
  # The model takes the hyperparameters as the step holds them: float32.
  f32 = lambda x: float(np.float32(x))
  f64 = lambda x: np.asarray(x, np.float64)
  p, s = params, txs["xla"].init(params)
  worst = {"xla": 0.0, "model": 0.0}
  differing = {"xla": 0, "model": 0}
  largest = {"xla": 0, "model": 0}
  codes = {"xla": 0, "model": 0}
  for t, g in enumerate(grads, start=1):
    (p_pal, s_pal), (p_xla, s_xla) = jitted["pallas"](p, state_of("pallas", s), g), jitted["xla"](p, s, g)
    want_p, (m_codes, m_scales), (v_codes, v_scales) = adamw_step_8bit(
        f64(g["w"]), f64(p["w"]), f64(s.mu["w"]), f64(s.mu_scales["w"]), f64(s.nu["w"]), f64(s.nu_scales["w"]),
        lr=f32(sched(t - 1)), t=t, b1=f32(0.9), b2=f32(0.999), eps=f32(1e-8), weight_decay=f32(WD))
    pairs = {"xla": [(p_pal[k], p_xla[k], 1e-5, 1e-6) for k in shapes]
                    + [(getattr(s_pal, f)[k], getattr(s_xla, f)[k], 1e-5, 1e-12)
                       for f in ("mu_scales", "nu_scales") for k in ("w", "odd")],
             "model": [(p_pal["w"], want_p, 2e-5, 2e-6), (s_pal.mu_scales["w"], m_scales, 1e-5, 1e-12),
                       (s_pal.nu_scales["w"], v_scales, 1e-5, 1e-12)]}
    code_pairs = {"xla": [(getattr(s_pal, f)[k], getattr(s_xla, f)[k]) for f in ("mu", "nu") for k in ("w", "odd")],
                  "model": [(s_pal.mu["w"], m_codes), (s_pal.nu["w"], v_codes)]}
    for against in pairs:
      worst[against] = max([worst[against]] + [excess(*pair) for pair in pairs[against]])
      for got, want in code_pairs[against]:
        n, most = code_differences(got, want)
        differing[against] += n
        largest[against] = max(largest[against], most)
        codes[against] += int(np.size(want))
    p, s = p_xla, s_xla
  for against, name in (("xla", "the XLA rule"), ("model", "the float64 model")):
    ok = worst[against] <= 1 and largest[against] <= 1 and differing[against] <= 1e-3 * codes[against]
    check(f"8-bit moments: pallas == {name}, {steps} steps", ok,
          f"params and scales error / tolerance {worst[against]:.2f}; codes differing {differing[against]} of "
          f"{codes[against]}, by at most {largest[against]}")
  # What XLA was given: one launch for the kernel's leaves, and no float32 copy of the moments.
  lowered = jitted["pallas"].lower(p, state_of("pallas", s), grads[0])
  on_gpu = jax.default_backend() == "gpu"
  launches = gpu_launches(lowered.as_text())
  check("8-bit moments: one Triton launch", launches == (1 if on_gpu else 0), f"{launches} launches")
  if on_gpu:
    temp = lowered.compile().memory_analysis().temp_size_in_bytes
    n = sum(int(np.prod(x)) for x in shapes.values())
    check("8-bit moments: temporaries well under the 4 B/param of one float32 moment", temp < 0.5 * n,
          f"temp {temp / n:.3f} B/param")


# --- 2. copy bandwidth ---------------------------------------------------------

def timed(fn, reps):
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def copy_bandwidth(n: int, reps: int) -> float:
  x = jnp.ones((n,), jnp.float32)
  copy = jax.jit(lambda x: x + 0.0)
  y = copy(x).block_until_ready()
  seconds = timed(lambda: copy(x).block_until_ready(), reps)
  del y
  return n * 8 / seconds / 1e9


def spec_hardware() -> step_time.Hardware:
  """The spec figures of the GPU this runs on (an H100's HBM if it is one, else the H200's)."""
  return step_time.H100_SXM if "H100" in jax.devices()[0].device_kind else step_time.H200_SXM


def estimated(compiled, per: int = 1) -> float:
  """Seconds ``optax_hybrid.gpu_compile.step_time`` estimates for a compiled program (divided by ``per`` steps it runs)."""
  return step_time.estimate(compiled.as_text(), spec_hardware()).seconds / per


def profiled_counts(run) -> tuple[int, int] | None:
  """``(kernels, launches)`` of one call of ``run``, from a JAX profiler trace (:func:`trace_counts`)."""
  import glob
  import gzip
  import json
  import tempfile
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder, create_perfetto_trace=True):
      run()
    files = glob.glob(os.path.join(folder, "**", "*trace.json.gz"), recursive=True)
    if not files:
      return None
    with gzip.open(files[0]) as f:
      trace = json.load(f)
  return trace_counts(trace.get("traceEvents", []) if isinstance(trace, dict) else trace)


def trace_counts(events: list) -> tuple[int, int] | None:
  """``(kernels, launches)`` in trace events (Chrome trace format); None where they show no GPU stream.

  Kernels: the spans on a GPU process's ``Stream ...`` threads (CUPTI's activity records) other than copies
  and memsets. Launches: the host's CUDA calls that start a kernel or a CUDA graph.
  """
  import re
  names = lambda kind: {(e.get("pid"), e.get("tid")) if kind == "thread_name" else e.get("pid"): str(
      e.get("args", {}).get("name", "")) for e in events if e.get("ph") == "M" and e.get("name") == kind}
  gpus = {pid for pid, name in names("process_name").items() if "GPU" in name}
  streams = {key for key, name in names("thread_name").items() if key[0] in gpus and name.startswith("Stream")}
  spans = [e for e in events if e.get("ph") == "X"]
  kernels = sum((e.get("pid"), e.get("tid")) in streams and not re.match(r"(?i)mem(cpy|set)", e.get("name", ""))
                for e in spans)
  launches = sum(e.get("pid") not in gpus and bool(re.search(r"cu(da)?(LaunchKernel|GraphLaunch)", e.get("name", "")))
                 for e in spans)
  return (kernels, launches) if streams else None


# --- 3. block sweep ------------------------------------------------------------

def block_sweep(n: int, reps: int, bandwidth: float, configs) -> None:
  print(f"\n## 3. Pallas block size / warps, one leaf of {n / 2**20:.0f}M fp32 params (tx.step arithmetic)",
        flush=True)
  s = adam_scalars(jnp.int32(3), LR, 0.9, 0.999, 1e-8, WD, True)
  arrays = [jnp.full((n,), 0.5, jnp.float32), jnp.full((n,), 1e-3, jnp.float32), jnp.zeros((n,)), jnp.zeros((n,))]
  print(f"| {'block':>6} | {'warps':>5} | {'ms':>7} | {'GB/s @28B':>9} | {'of copy':>7} |")
  print(f"|{'-' * 8}|{'-' * 7}|{'-' * 9}|{'-' * 11}|{'-' * 9}|")
  for block, warps in configs:
    def one(p, g, m, v, block=block, warps=warps):
      (out,) = pallas_gpu.update_leaves([LeafOperands(g, (m, v), p)], [LeafFacts(True, jnp.float32)], s,
                                        step_of(AdamW(), write_params=True), block_size=block, num_warps=warps)
      return (out.first, *out.state)
    fn = jax.jit(one, donate_argnums=(0, 2, 3))
    p, g, m, v = arrays
    p, m, v = fn(p, g, m, v)
    jax.block_until_ready(p)

    def run():
      nonlocal p, m, v
      p, m, v = fn(p, g, m, v)
      jax.block_until_ready(p)

    t = timed(run, reps)
    arrays = [p, g, m, v]
    gbs = n * BYTES_PER_PARAM / t / 1e9
    print(f"| {block:>6} | {warps:>5} | {t * 1e3:7.3f} | {gbs:9.1f} | {gbs / bandwidth:7.2f} |", flush=True)


# --- 4. step time --------------------------------------------------------------

class JaxLoop:
  """``steps`` donated steps inside one jitted fori_loop."""

  def __init__(self, name, shapes, step_fn, init_fn, steps, bytes_per_param=BYTES_PER_PARAM):
    self.name = name
    self.bytes_per_param = bytes_per_param
    device = jax.devices()[0]
    self.params = jax.device_put({k: jnp.full(s, 0.5, jnp.float32) for k, s in shapes.items()}, device)
    self.grads = jax.device_put({k: jnp.full(s, 1e-3, jnp.float32) for k, s in shapes.items()}, device)
    self.state = init_fn(self.params)
    self.steps = steps

    def loop(p, s, g):
      return jax.lax.fori_loop(0, steps, lambda i, c: step_fn(c[0], c[1], g), (p, s))

    # Compiled once, here: the executable runs the steps and its HLO gives the estimate.
    self.loop = jax.jit(loop, donate_argnums=(0, 1)).lower(self.params, self.state, self.grads).compile()
    self.estimate = estimated(self.loop, steps)

  def run(self):
    self.params, self.state = self.loop(self.params, self.state, self.grads)
    jax.block_until_ready(self.params)

  def close(self):
    del self.params, self.state, self.grads


class TorchLoop:

  def __init__(self, shapes, steps):
    import torch
    self.torch = torch
    self.name = "torch AdamW(fused=True)"
    self.bytes_per_param = BYTES_PER_PARAM
    self.params = [torch.full(s, 0.5, device="cuda", requires_grad=True) for s in shapes.values()]
    for p in self.params:
      p.grad = torch.full(p.shape, 1e-3, device="cuda")
    self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WD, fused=True)
    self.steps = steps

  def run(self):
    for _ in range(self.steps):
      self.opt.step()
    self.torch.cuda.synchronize()

  def close(self):
    del self.opt, self.params
    self.torch.cuda.empty_cache()


def step_variants(shapes, steps, torch_ok, host_moments):
  out = []
  adamw = optax.adamw(LR, weight_decay=WD)

  def optax_step(p, s, g):
    u, s = adamw.update(g, s, p)
    return optax.apply_updates(p, u), s

  out.append(lambda: JaxLoop("optax.adamw", shapes, optax_step, adamw.init, steps))
  for kernel in ("pallas", "xla"):
    ours = optax_hybrid.hybrid_adamw(LR, weight_decay=WD, kernel=kernel)

    def contract(p, s, g, ours=ours):
      u, s = ours.update(g, s, p)
      return optax_hybrid.apply_updates(p, u), s

    out.append(lambda ours=ours, kernel=kernel: JaxLoop(f"ours {kernel}, tx.step", shapes, ours.step, ours.init,
                                                        steps))
    out.append(lambda kernel=kernel, contract=contract, ours=ours: JaxLoop(
        f"ours {kernel}, update+apply", shapes, contract, ours.init, steps))
  for kernel in ("pallas", "xla"):
    ours = optax_hybrid.hybrid_adamw(LR, weight_decay=WD, kernel=kernel, moment_format="8bit")
    out.append(lambda ours=ours, kernel=kernel: JaxLoop(f"ours {kernel}, 8-bit moments, tx.step", shapes, ours.step,
                                                        ours.init, steps, BYTES_PER_PARAM_8BIT))
  if host_moments:
    ours = optax_hybrid.hybrid_adamw(LR, weight_decay=WD, kernel="pallas", state_memory_kind="pinned_host")
    out.append(lambda ours=ours: JaxLoop("ours pallas, pinned_host moments, tx.step", shapes, ours.step, ours.init,
                                         steps))
  if torch_ok:
    out.append(lambda: TorchLoop(shapes, steps))
  return out


def step_table(tree_name, shapes, reps, steps, bandwidth, torch_ok, host_moments):
  n_params = sum(math.prod(s) for s in shapes.values())
  print(f"\n{tree_name}: {n_params / 1e6:.1f}M params, {len(shapes)} leaves", flush=True)
  built = [make() for make in step_variants(shapes, steps, torch_ok, host_moments)]
  for v in built:  # compile; the second call sees committed outputs; touch every buffer
    v.run()
    v.run()
  times = {v.name: [] for v in built}
  for _ in range(reps):
    for v in built:
      t = time.perf_counter()
      v.run()
      times[v.name].append((time.perf_counter() - t) / steps)
  for v in built:
    v.close()
  med = {k: statistics.median(t) for k, t in times.items()}
  floor = {v.name: v.bytes_per_param for v in built}
  estimate = {v.name: getattr(v, "estimate", None) for v in built}
  torch_name = "torch AdamW(fused=True)"
  print(f"| {'variant':<42} | {'ms':>8} | {'est. ms':>8} | {'GB/s':>9} | {'of copy':>7} | {'optax/ours':>10} | "
        f"{'torch/ours':>10} |")
  print(f"|{'-' * 44}|{'-' * 10}|{'-' * 10}|{'-' * 11}|{'-' * 9}|{'-' * 12}|{'-' * 12}|")
  for name, t in med.items():
    gbs = n_params * floor[name] / t / 1e9
    vs_torch = f"{med[torch_name] / t:10.2f}" if torch_name in med else f"{'-':>10}"
    est = f"{estimate[name] * 1e3:8.3f}" if estimate[name] is not None else f"{'-':>8}"
    print(f"| {name:<42} | {t * 1e3:8.3f} | {est} | {gbs:9.1f} | {gbs / bandwidth:7.2f} | {med['optax.adamw'] / t:10.2f} | "
          f"{vs_torch} |", flush=True)


# --- 5. placement tiers -------------------------------------------------------

def host_bandwidth(n: int, reps: int) -> tuple[float, float]:
  """GB/s of device->host and host->device copies of ``n`` fp32 elements, inside jit."""
  device = jax.devices()[0]
  on_device = jax.device_put(jnp.ones((n,), jnp.float32), device)
  on_host = jax.device_put(np.ones((n,), np.float32), device.sharding.with_memory_kind("pinned_host")
                           if hasattr(device, "sharding") else
                           jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host"))
  to_host = jax.jit(lambda x: jax.device_put(x, jax.memory.Space.Host))
  to_device = jax.jit(lambda x: jax.device_put(x, jax.memory.Space.Device))
  to_host(on_device).block_until_ready()
  to_device(on_host).block_until_ready()
  down = timed(lambda: to_host(on_device).block_until_ready(), reps)
  up = timed(lambda: to_device(on_host).block_until_ready(), reps)
  return n * 4 / down / 1e9, n * 4 / up / 1e9


def tier_report(n_leaves: int, leaf: int, reps: int) -> None:
  if "pinned_host" not in placement.available_memory_kinds():
    print("no pinned_host memory here: tiers not measured", flush=True)
    return
  n = n_leaves * leaf
  print(f"\n## 5. placement tiers: {n_leaves} bf16 leaves x {leaf / 2**20:.1f}M = {n / 1e9:.2f}B params, "
        "fp32 master and moments", flush=True)
  down, up = host_bandwidth(min(n, 2**28), reps)
  print(f"device->host {down:.1f} GB/s, host->device {up:.1f} GB/s (jitted device_put of up to 1 GiB)", flush=True)
  names = [f"l{i:03d}" for i in range(n_leaves)]
  half = {k: ("host" if i < n_leaves // 2 else "device") for i, k in enumerate(names)}
  setups = {
      "device": dict(tiers="device"), "host_state": dict(tiers="host_state"), "host": dict(tiers="host"),
      "half host / half device": dict(tiers=half),
      "only the device half": dict(tiers="device", subset=[k for k in names if half[k] == "device"]),
      "only the host half": dict(tiers="host", subset=[k for k in names if half[k] == "host"]),
  }
  device = jax.devices()[0]
  times = {}
  print(f"| {'tier':<24} | {'ms':>9} | {'est. ms':>9} | {'device GiB (args+out+temp)':>26} | "
        f"{'host GiB (args+out+temp)':>24} | {'bus GB/step':>11} |")
  print(f"|{'-' * 26}|{'-' * 11}|{'-' * 11}|{'-' * 28}|{'-' * 26}|{'-' * 13}|")
  bus_bytes = {"device": 0, "host_state": 24 * n, "host": 4 * n, "half host / half device": 2 * n,
               "only the device half": 0, "only the host half": 2 * n}
  for name, setup in setups.items():
    keys = setup.get("subset", names)
    params = {k: jax.device_put(jnp.full((leaf,), 0.5, jnp.bfloat16), device) for k in keys}
    grads = {k: jnp.full((leaf,), 1e-3, jnp.bfloat16) for k in keys}
    tx = optax_hybrid.hybrid_adamw(LR, weight_decay=WD, tiers=setup["tiers"], master_dtype=jnp.float32,
                                   mu_dtype=jnp.float32, nu_dtype=jnp.float32)
    state = tx.init(params)
    step = jax.jit(tx.step, donate_argnums=(0, 1))
    compiled = step.lower(params, state, grads).compile()
    mem = compiled.memory_analysis()
    gib = lambda *xs: sum(xs) / 2**30
    dev = gib(mem.argument_size_in_bytes, mem.output_size_in_bytes - mem.alias_size_in_bytes, mem.temp_size_in_bytes)
    host = gib(getattr(mem, "host_argument_size_in_bytes", 0),
               getattr(mem, "host_output_size_in_bytes", 0) - getattr(mem, "host_alias_size_in_bytes", 0),
               getattr(mem, "host_temp_size_in_bytes", 0))
    params, state = step(params, state, grads)
    jax.block_until_ready(params)

    def run():
      nonlocal params, state
      params, state = step(params, state, grads)
      jax.block_until_ready(params)

    times[name] = timed(run, reps)
    print(f"| {name:<24} | {times[name] * 1e3:9.1f} | {estimated(compiled) * 1e3:9.1f} | {dev:26.2f} | {host:24.2f} | "
          f"{bus_bytes[name] / 1e9:11.2f} |", flush=True)
    params = state = grads = None  # free this setup before the next one allocates
  alone = times["only the device half"] + times["only the host half"]
  both = times["half host / half device"]
  print(f"overlap: the halves alone take {alone * 1e3:.1f} ms in sequence, together {both * 1e3:.1f} ms "
        f"({'overlapped' if both < 0.9 * alone else 'not overlapped'}: {alone / both:.2f}x)", flush=True)


# --- 6. layers streamed from host memory --------------------------------------------------

def _llama_run(cfg_kw: dict, streamed: bool, steps: int, reps: int, in_backward: bool = False, pgle: bool = False):
  """Builds the Llama-style decoder (benchmarks/models.py) for real and times its donated train step.

  ``streamed``: layers in ``pinned_host``, run by ``scan_layers``, the host
  tier (fp32 master and moments on the host); else everything on the device
  (``lax.scan``, the device tier). ``in_backward``: the streamed layers
  stepped inside the backward pass (``optax_hybrid.step_in_backward``, the
  ``host_state`` tier). bf16 params. ``pgle``: the step jitted with JAX's
  profile-guided scheduling (``jax_enable_pgle``: its first runs are timed
  on the device and the step recompiled with XLA's scheduler told what
  each copy and kernel took; docs/records/streaming_programs.md), the estimate still that
  of the program compiled without it. Returns (losses, seconds per step,
  params, device GiB, host GiB, the step's estimate (a ``StepTime``), and
  the kernels and launches a profiled step ran (None without a GPU trace)).
  """
  import models
  model = models.llama(jnp.bfloat16, stream=streamed, layers_memory_kind="pinned_host" if streamed else "device",
                       **cfg_kw)
  device = jax.devices()[0]
  key = iter(jax.random.split(jax.random.key(0), 64))

  def real(x):
    kind = getattr(x.sharding, "memory_kind", None) or "device"
    value = np.asarray(0.02 * jax.random.normal(next(key), x.shape, jnp.float32)).astype(x.dtype)
    return jax.device_put(value, jax.sharding.SingleDeviceSharding(device, memory_kind=kind))

  params = jax.tree.map(real, model.params)
  tokens = jax.random.randint(jax.random.key(1), model.batch["inputs"].shape, 0, cfg_kw["vocab"])
  batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
  tier = "host_state" if in_backward else "host" if streamed else "device"
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=WD, tiers=tier, master_dtype=jnp.float32,
                                 moment_format="float32")
  params = optax_hybrid.commit(params)
  state = optax_hybrid.commit(tx.init(params))

  def train_step(p, s, b):
    loss, grads = jax.value_and_grad(model.loss)(p, b)
    p, s = tx.step(p, s, grads)
    return p, s, loss

  if in_backward:
    train_step = models.donation_ordered(
        optax_hybrid.step_in_backward(tx, *models.llama_parts(models.LlamaConfig(**cfg_kw))))

  compiled = jax.jit(train_step, donate_argnums=(0, 1)).lower(params, state, batch).compile()
  # With pgle, the jitted call (not the compiled one): JAX profiles its first runs and recompiles.
  step = jax.jit(train_step, donate_argnums=(0, 1)) if pgle else compiled
  mem = compiled.memory_analysis()
  gib = lambda *xs: sum(xs) / 2**30
  dev = gib(mem.argument_size_in_bytes, mem.output_size_in_bytes - mem.alias_size_in_bytes, mem.temp_size_in_bytes)
  host = gib(getattr(mem, "host_argument_size_in_bytes", 0),
             getattr(mem, "host_output_size_in_bytes", 0) - getattr(mem, "host_alias_size_in_bytes", 0),
             getattr(mem, "host_temp_size_in_bytes", 0))
  def run():
    nonlocal params, state
    params, state, loss = step(params, state, batch)
    jax.block_until_ready(params)
    return loss

  enabled = jax.config.jax_enable_pgle
  jax.config.update("jax_enable_pgle", pgle)
  try:
    losses = [float(run()) for _ in range(steps)]
    for _ in range(jax.config.jax_pgle_profiling_runs + 1 - steps if pgle else 0):
      run()  # the profiled runs left, then the recompile: not timed
    seconds = timed(run, reps)
    counts = profiled_counts(run)
  finally:
    jax.config.update("jax_enable_pgle", enabled)
  return losses, seconds, model.num_params, dev, host, step_time.estimate(compiled.as_text(), spec_hardware()), counts


def streaming_report(smoke: bool, reps: int) -> None:
  """Streamed (scan_layers + host tier) against all on the device, then the deepest streamed model that runs."""
  if "pinned_host" not in placement.available_memory_kinds():
    print("no pinned_host memory here: streaming not measured", flush=True)
    return
  size = (dict(width=64, heads=2, ffn=172, vocab=256, seq=32, batch=2) if smoke
          else dict(width=2048, heads=16, ffn=5504, vocab=32000, seq=2048, batch=4))
  layers = 2 if smoke else 8
  print(f"\n## 6. layers streamed from host memory: Llama-style, width {size['width']}, {layers} layers, "
        f"batch {size['batch']} x {size['seq']}, bf16 params, fp32 master and moments", flush=True)
  down, up = host_bandwidth(2**12 if smoke else 2**28, reps)
  print(f"device->host {down:.1f} GB/s, host->device {up:.1f} GB/s", flush=True)
  rows = {}
  for name, streamed, in_backward, pgle in (
      ("all on the device (lax.scan, device tier)", False, False, False),
      ("streamed (scan_layers from pinned_host, host tier)", True, False, False),
      ("streamed, stepped in the backward pass (host_state)", True, True, False),
      ("the same, JAX's profile-guided scheduling", True, True, True)):
    rows[name] = _llama_run(dict(layers=layers, **size), streamed, steps=3, reps=reps, in_backward=in_backward,
                            pgle=pgle)
  # Beside the time: what the estimate says the host launches and the GPU runs, against a profiled step.
  print(f"| {'setup':<52} | {'ms/step':>8} | {'est. ms':>8} | kernels est. / run | launches est. / run | "
        f"est. loop trips | {'device GiB':>10} | {'host GiB':>8} | losses (3 steps) |")
  print(f"|{'-' * 54}|{'-' * 10}|{'-' * 10}|{'-' * 20}|{'-' * 21}|{'-' * 17}|{'-' * 12}|{'-' * 10}|{'-' * 18}|")
  for name, (losses, seconds, n, dev, host, estimate, counts) in rows.items():
    run_kernels, run_launches = counts or ("-", "-")
    print(f"| {name:<52} | {seconds * 1e3:8.1f} | {estimate.seconds * 1e3:8.1f} | "
          f"{f'{estimate.kernels} / {run_kernels}':>18} | {f'{estimate.launches} / {run_launches}':>19} | "
          f"{estimate.loop_trips:>15} | {dev:10.2f} | {host:8.2f} | {', '.join(f'{l:.4f}' for l in losses)} |",
          flush=True)
  (l_dev, t_dev, *_), (l_str, t_str, *_), (l_back, t_back, *_), (l_pgle, t_pgle, *_) = rows.values()
  check("streamed losses == all-on-device losses (3 steps)", excess(l_str, l_dev, 2e-2, 1e-3) <= 1,
        f"{l_str} vs {l_dev}")
  check("stepped-in-backward losses == all-on-device losses (3 steps)", excess(l_back, l_dev, 2e-2, 1e-3) <= 1,
        f"{l_back} vs {l_dev}")
  check("stepped-in-backward losses with profile-guided scheduling == without (3 steps)",
        excess(l_pgle, l_back, 1e-3, 1e-4) <= 1, f"{l_pgle} vs {l_back}")
  print(f"streamed / all on the device: {t_str / t_dev:.2f}x the step time; stepped in the backward pass: "
        f"{t_back / t_dev:.2f}x ({t_pgle / t_dev:.2f}x with profile-guided scheduling)", flush=True)
  # The deepest streamed model: host memory bounds it (the layers, their gradient and the host
  # tier's state live there). Probe depths upwards from the small run until a step fails.
  total_host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
  best, per_layer = None, rows[list(rows)[1]][4] / layers  # host GiB per layer, the small run's
  depth = max(layers, int(0.7 * total_host / max(per_layer, 1e-9))) if not smoke else layers + 1
  try:
    losses, seconds, n, dev, host, estimate, _ = _llama_run(dict(layers=depth, **size), True, steps=1, reps=1)
    best = (depth, n, seconds, dev, host, losses[-1], estimate.seconds)
  except Exception as e:  # noqa: BLE001 - out of memory is a finding, reported
    print(f"{depth} layers did not run: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
  if best:
    depth, n, seconds, dev, host, loss, estimate = best
    print(f"deepest streamed run: {depth} layers = {n / 1e9:.2f}B params, {seconds:.2f} s/step (estimated "
          f"{estimate:.2f}), device "
          f"{dev:.1f} GiB, host {host:.1f} GiB of {total_host:.0f} GiB, loss {loss:.4f}", flush=True)
    check("the deepest streamed model ran a finite step", math.isfinite(loss))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script anywhere")
  parser.add_argument("--reps", type=int, default=None, help="timed rounds (default 7; 2 with --smoke)")
  parser.add_argument("--steps", type=int, default=None, help="steps per timed round (default 10; 1 with --smoke)")
  parser.add_argument("--trees", default="one,many,gpt2", help="comma-separated subset of one,many,gpt2")
  args = parser.parse_args(argv)
  smoke = args.smoke
  reps = args.reps or (2 if smoke else 7)
  steps = args.steps or (1 if smoke else 10)
  try:
    import torch
    torch_ok = torch.cuda.is_available()
    torch_note = f"torch {torch.__version__} ({'CUDA' if torch_ok else 'no CUDA: not timed'})"
  except ImportError:
    torch_ok, torch_note = False, "torch not installed"
  device = jax.devices()[0]
  print(f"# gpu_check: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"optax {optax.__version__}, {torch_note}; {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
  if jax.default_backend() != "gpu" and not smoke:
    print("no GPU here: the Pallas kernel would run in interpret mode; use --smoke to check the script", flush=True)
    return 2
  start = time.perf_counter()
  # GPU time is scarce: a section that raises is reported as a failure and the
  # next one still runs, so one call yields every figure it can.
  guarded(lambda: correctness(pallas_gpu.BLOCK_SIZE if not smoke else 64, smoke), "correctness")
  guarded(lambda: correctness_8bit(smoke), "8-bit correctness")

  print("\n## 2. copy bandwidth", flush=True)
  bandwidth = guarded(lambda: copy_bandwidth(2**14 if smoke else 2**28, reps), "copy bandwidth") or float("nan")
  print(f"device-to-device copy (x + 0 into a new buffer, 8 B/element): {bandwidth:.1f} GB/s", flush=True)

  if smoke:
    guarded(lambda: block_sweep(2**12, reps, bandwidth, [(1024, 4)]), "block sweep")
  else:
    guarded(lambda: block_sweep(2**28, reps, bandwidth, [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 8),
                                                         (8192, 16)]), "block sweep")

  print("\n## 4. step time (per step)", flush=True)
  scale = 2**-14 if smoke else 1.0
  tree_defs = {
      "one": ("1 leaf x 256M", {"w": (max(1, int(2**28 * scale)),)}),
      "many": ("1024 leaves x 64K", {f"l{i:04d}": (max(1, int(2**16 * scale)),) for i in range(1024 if not smoke
                                                                                                 else 70)}),
      "gpt2": ("GPT-2 small shapes", gpt2_small_shapes(1e-4 if smoke else 1.0)),
  }
  for key in args.trees.split(","):
    name, shapes = tree_defs[key]
    guarded(lambda: step_table(name, shapes, reps, steps, bandwidth, torch_ok, host_moments=(key == "one")),
            f"step table {name}")
  if smoke:
    guarded(lambda: tier_report(4, 2**10, reps), "tiers")
  else:
    guarded(lambda: tier_report(16, 2**26, min(reps, 5)), "tiers")  # 16 x 64M = 1.07B bf16 params
  guarded(lambda: streaming_report(smoke, min(reps, 5)), "streaming")
  print(f"\n{time.perf_counter() - start:.0f} s; {'all checks passed' if not FAILURES else 'FAILED: ' + ', '.join(FAILURES)}")
  return 1 if FAILURES else 0


if __name__ == "__main__":
  sys.exit(main())
