"""Host memory traffic of the host tier's step, compiled for a GPU without one (H200 target).

The host tier (``tiers="host"``) updates its state in XLA host compute: one
``HostExecute`` call per stage reads the state and the gradient in host memory
and writes the new state into new buffers. With the state donated, XLA then
copies each new buffer into the donated one (``copy`` between two host
buffers). This script compiles for the H200 target (``optax_hybrid.gpu_compile``)
and prints, in bytes per weight (B/w):

* the optimizer's ``tx.step``, state donated and not: host->host copies, host
  temporaries, the host memory XLA plans at once (``host_peak_bytes``), device
  temporaries, and the host memory traffic of one step counted from the
  optimized HLO: what the host calls read (their operands) and write (their
  results), plus each host->host copy (read and written once);
* ``--experiments``: ways to write the state in place, tried on a minimal
  update (``m <- 0.9 m + g``, four 1024 x 1024 float32 leaves of ``m`` in
  ``pinned_host``, bfloat16 gradients on the device), each compiled in its
  own process (an XLA abort is reported, not fatal).

Usage::

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/host_inplace.py [--formats float32,8bit]
      [--leaves 4 --shape 1024x1024] [--experiments]

Figures are what XLA:GPU plans, not a measured run; see docs/records/gpu_compile.md,
section "The host tier's state is copied once per step".
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import compute_on as _compute_on

import optax_hybrid
from optax_hybrid import gpu_compile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402  (benchmarks/models.py)

_ARRAY = re.compile(r"\b(pred|s8|u8|s32|u32|bf16|f16|f32)\[([\d,]*)\](\{[^}]*\})?")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "f32": 4}


def _arrays(text: str) -> list[tuple[int, bool]]:
  """``(bytes, in host memory)`` of every array shape in ``text``."""
  out = []
  for dtype, dims, layout in _ARRAY.findall(text):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    out.append((n * _BYTES[dtype], "S(5)" in (layout or "")))
  return out


def _top_level(shape: str) -> list[str]:
  """The elements of a tuple shape ``(a, (b, c), d)``."""
  depth, parts, start = 0, [], 1
  for i, c in enumerate(shape):
    depth += (c == "(") - (c == ")")
    if (c == "," and depth == 1) or (c == ")" and depth == 0):
      parts.append(shape[start:i])
      start = i + 1
  return parts


def host_traffic(hlo: str) -> dict:
  """Host-call reads and writes, and host->host copies (count, bytes), in an optimized HLO module's entry."""
  entry = hlo[hlo.index("\nENTRY"):]
  read = written = copies = copy_bytes = 0
  for line in entry.splitlines():
    m = re.match(r"\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.*?)\s(custom-call-start|copy)\(", line)
    if not m:
      continue
    shape, opcode = m.groups()
    if opcode == "custom-call-start" and 'custom_call_target="HostExecute"' in line:
      operands, results = _top_level(shape)[:2]  # ((operands...), (results...), context)
      read += sum(b for b, _ in _arrays(operands))
      written += sum(b for b, _ in _arrays(results))
    elif opcode == "copy" and _arrays(shape) and all(h for _, h in _arrays(shape)):
      copies += 1
      copy_bytes += sum(b for b, _ in _arrays(shape))
  return dict(read=read, written=written, copies=copies, copy_bytes=copy_bytes)


def optimizer_table(formats: list[str], leaves: int, shape: tuple[int, int]) -> None:
  params = models.placed({f"w{i}": jax.ShapeDtypeStruct(shape, jnp.bfloat16) for i in range(leaves)})
  weights = leaves * shape[0] * shape[1]
  print(f"jax {jax.__version__}; tx.step, {leaves} bf16 leaves of {shape[0]}x{shape[1]} ({weights} weights), fp32 "
        "master, tiers='host', target h200, abstract inputs; B/w = bytes per weight")
  print("| moments | state donated | host->host copies | host temp | host peak | device temp | call reads "
        "| call writes | copies r+w | host traffic |")
  print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  per = lambda b: f"{b / weights:.2f}"
  for fmt in formats:
    tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, tiers="host", master_dtype=jnp.float32,
                                   moment_format=fmt)
    state = tx.init(params)
    for donate in ((0, 1), (0,)):
      r = gpu_compile.compile_for_gpu(tx.step, params, state, params, target="h200", donate_argnums=donate)
      t = host_traffic(r.hlo)
      traffic = t["read"] + t["written"] + 2 * t["copy_bytes"]
      print(f"| {fmt} | {'yes' if 1 in donate else 'no'} | {t['copies']} | {per(r.host_temp_bytes)} "
            f"| {per(r.host_peak_bytes)} | {per(r.device_temp_bytes)} | {per(t['read'])} | {per(t['written'])} "
            f"| {per(2 * t['copy_bytes'])} | {per(traffic)} |", flush=True)


# --- experiments on a minimal update --------------------------------------------------------------

N, LEAVES, ROWS = 1024, 4, 256


def _update(m, g):
  return 0.9 * m + g.astype(jnp.float32)


HOST = jax.memory.Space.Host
_host_compute_decorator = getattr(_compute_on, "compute_on2", _compute_on.compute_on)  # JAX 0.10 / 0.11


def _on_host(f):
  return _host_compute_decorator(f, compute_type="device_host", out_memory_spaces=HOST)


def _to_host(g):
  return jax.device_put(g, HOST)


def _host_compute(ms, gs):
  return _on_host(lambda ms, gs: [_update(m, g) for m, g in zip(ms, gs)])(ms, [_to_host(g) for g in gs])


def _per_leaf(ms, gs):
  return [_on_host(_update)(m, _to_host(g)) for m, g in zip(ms, gs)]


def _dus_inside(ms, gs):
  def f(ms, gs):
    return [lax.dynamic_update_slice(m, _update(m, g), (0, 0)) for m, g in zip(ms, gs)]
  return _on_host(f)(ms, [_to_host(g) for g in gs])


def _row_blocks_inside(ms, gs):
  def one(m, g):
    def body(i, m):
      rows = lambda x: lax.dynamic_slice(x, (i * ROWS, 0), (ROWS, N))
      return lax.dynamic_update_slice(m, _update(rows(m), rows(g)), (i * ROWS, 0))
    return lax.fori_loop(0, N // ROWS, body, m)
  return _on_host(lambda ms, gs: [one(m, g) for m, g in zip(ms, gs)])(ms, [_to_host(g) for g in gs])


def _dus_after(ms, gs):
  return [lax.dynamic_update_slice(m, new, (0, 0)) for m, new in zip(ms, _host_compute(ms, gs))]


def _nested_jit_donating(ms, gs):
  inner = jax.jit(lambda ms, gs: [_update(m, g) for m, g in zip(ms, gs)], donate_argnums=(0,))
  return _on_host(inner)(ms, [_to_host(g) for g in gs])


def _ffi_aliased_inside(ms, gs):
  from optax_hybrid.kernels import native_cpu
  native_cpu.available()  # loads and registers the native kernel (for the CPU platform of jaxlib)
  def f(ms, gs):
    call = lambda m, new: jax.ffi.ffi_call(native_cpu.TARGET, jax.ShapeDtypeStruct(m.shape, m.dtype),
                                           input_output_aliases={0: 0})(m, new)
    return [call(m, _update(m, g)) for m, g in zip(ms, gs)]
  return _on_host(f)(ms, [_to_host(g) for g in gs])


def _row_block_calls_written_back(ms, gs):
  out = []
  for m, g in zip(ms, gs):
    g = _to_host(g)
    for i in range(0, N, ROWS):
      rows = lambda x, i=i: lax.dynamic_slice(x, (i, 0), (ROWS, N))
      block = _on_host(lambda m, g: _update(rows(m), rows(g)))(m, g)
      m = lax.dynamic_update_slice(m, block, (i, 0))
    out.append(m)
  return out


def _triton_update(m, g):
  """The update as a Triton (Pallas) kernel on ``m`` where it lives, aliased to its result."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as pl_triton
  block = 4096

  def kernel(m_ref, g_ref, out_ref):
    idx = pl.program_id(0) * block + jnp.arange(block)
    out_ref[idx] = _update(m_ref[idx], g_ref[idx])

  out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((m.size,), m.dtype), grid=(m.size // block,),
                       input_output_aliases={0: 0}, compiler_params=pl_triton.CompilerParams(num_warps=8))(
                           m.reshape(-1), g.reshape(-1))
  return out.reshape(m.shape)


def _triton_on_host_memory(ms, gs):
  return [jax.device_put(_triton_update(m, g), HOST) for m, g in zip(ms, gs)]


def _triton_then_device(ms, gs):
  # The new m also rounded to bf16 on the device, as the pipeline rounds a new master to the bf16 param.
  new = [_triton_update(m, g) for m, g in zip(ms, gs)]
  return [jax.device_put(x, HOST) for x in new], [x.astype(jnp.bfloat16) for x in new]


# name: (what it is, function, state donated, extra XLA_FLAGS)
EXPERIMENTS = {
    "host_compute": ("host compute (today's host tier)", _host_compute, True, ""),
    "not_donated": ("host compute, state not donated", _host_compute, False, ""),
    "per_leaf": ("one host call per leaf", _per_leaf, True, ""),
    "dus_inside": ("dynamic_update_slice of the result into the input, inside the host call", _dus_inside, True, ""),
    "row_blocks_inside": ("fori_loop of row-block dynamic_update_slices into the input, inside the host call",
                          _row_blocks_inside, True, ""),
    "dus_after": ("dynamic_update_slice of the host call's result into the donated input", _dus_after, True, ""),
    "nested_jit": ("jax.jit(donate_argnums=0) nested inside compute_on", _nested_jit_donating, True, ""),
    "ffi_inside": ("FFI custom call with input_output_aliases inside the host call", _ffi_aliased_inside, True, ""),
    "row_block_calls": ("a host call per 256-row block, each written back by dynamic_update_slice",
                        _row_block_calls_written_back, True, ""),
    "flag_region_analysis": ("host compute, --xla_gpu_copy_insertion_use_region_analysis=true", _host_compute,
                             True, "--xla_gpu_copy_insertion_use_region_analysis=true"),
    "flag_no_auto_offload": ("host compute, --xla_disable_automatic_host_compute_offload=true", _host_compute,
                             True, "--xla_disable_automatic_host_compute_offload=true"),
    "flag_no_copy_insertion": ("host compute, --xla_disable_hlo_passes=copy-insertion", _host_compute, True,
                               "--xla_disable_hlo_passes=copy-insertion"),
    "triton_on_host": ("a Triton (Pallas) kernel on the state in host memory, aliased (no host compute)",
                       _triton_on_host_memory, True, ""),
    "triton_then_device": ("the same, its result also rounded to bf16 on the device",
                           _triton_then_device, True, ""),
}


def run_experiment(name: str) -> None:
  """Compiles one experiment and prints its figures as one table row."""
  _, fn, donated, _ = EXPERIMENTS[name]
  cpu = jax.devices()[0]
  ms = [jax.device_put(jnp.zeros((N, N), jnp.float32), jax.sharding.SingleDeviceSharding(cpu, memory_kind="pinned_host"))
        for _ in range(LEAVES)]
  gs = [jax.device_put(jnp.zeros((N, N), jnp.bfloat16), cpu) for _ in range(LEAVES)]
  weights = LEAVES * N * N
  per = lambda b: f"{b / weights:.2f}"
  try:
    r = gpu_compile.compile_for_gpu(fn, ms, gs, target="h200", donate_argnums=(0,) if donated else ())
  except Exception as e:  # XLA rejected the program: its first line
    print(f"| {name} | error: {str(e).splitlines()[0][:160]} |||||||", flush=True)
    return
  copies = r.kernel_ops.get("copy (host->host)", 0)
  print(f"| {name} | {copies} | {per(r.host_temp_bytes)} | {per(r.device_temp_bytes)} | {per(r.host_alias_bytes)} "
        f"| {per(r.to_device_bytes)} | {per(r.to_host_bytes)} | {r.host_calls} | {len(r.warnings)} |", flush=True)


def experiments_table() -> None:
  print(f"\nExperiments: m <- 0.9 m + g, {LEAVES} float32 leaves of {N}x{N} of m in pinned_host (4 B/w of state), "
        "bfloat16 g on the device, target h200, real arrays; B/w = bytes per weight")
  print("| experiment | host->host copies | host temp | device temp | host aliased | to device | to host "
        "| host calls | fallback warnings |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  for name, (what, _, _, flags) in EXPERIMENTS.items():
    with tempfile.TemporaryDirectory() as tmp:
      env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=tmp,
                 XLA_FLAGS=" ".join(filter(None, (os.environ.get("XLA_FLAGS", ""), flags))))
      proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name], env=env,
                            capture_output=True, text=True, timeout=600)
      rows = [l for l in proc.stdout.splitlines() if l.startswith("|")]
      if rows:
        print(rows[-1], flush=True)
        continue
      # XLA aborted the process: gpu_compile leaves its log (with the abort message) in TMPDIR.
      abort = [l for path in glob.glob(os.path.join(tmp, "optax_hybrid_gpu_compile_*.log"))
               for l in open(path, errors="replace") if "Check failed" in l]
      print(f"| {name} | abort (rc {proc.returncode}): {abort[0].split('] ', 1)[-1].strip()[:200] if abort else '?'} "
            "|||||||", flush=True)
  print()
  for name, (what, *_rest) in EXPERIMENTS.items():
    print(f"- {name}: {what}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--formats", default="float32,8bit", help="moment formats, comma-separated")
  parser.add_argument("--leaves", type=int, default=4)
  parser.add_argument("--shape", default="1024x1024", help="each leaf's shape (bf16), ROWSxCOLS")
  parser.add_argument("--experiments", action="store_true", help="also the experiments on a minimal update")
  parser.add_argument("--one", help=argparse.SUPPRESS)  # one experiment, in a child process
  args = parser.parse_args()
  if args.one:
    run_experiment(args.one)
    return
  optimizer_table(args.formats.split(","), args.leaves, tuple(int(d) for d in args.shape.split("x")))
  if args.experiments:
    experiments_table()


if __name__ == "__main__":
  main()
