"""The largest char-GPT whose whole training step fits on one H200, per tier: compile-time figures.

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/gpu_memory.py [--width 4096] [--target h200]
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/gpu_memory.py --step-table [--scale 1.0]
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/gpu_memory.py --staging-table [--target h100]
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/gpu_memory.py --streaming-table [--stream-layers 16,32,1000]
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/gpu_memory.py --capacity-table [--host-memories "256 GB"]
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/gpu_memory.py --quick

Needs JAX's CUDA plugin (once: ``python -c "from optax_hybrid import gpu_compile;
gpu_compile.install_cuda_plugin()"``, docs/gpu_compile.md); no GPU. Everything is compiled with
``optax_hybrid.gpu_compile`` for a deviceless GPU target from abstract inputs
(``jax.eval_shape``: the big model is never allocated).

Default mode: the char-GPT of ``examples/char_gpt.py`` (token and position
embeddings, pre-LayerNorm blocks of causal attention and a 4x GELU MLP, tied
output layer), written functionally with the blocks' params stacked on a
leading layer axis and run by ``jax.lax.scan`` (rematerialized per layer), so
compile time does not grow with depth. A full train step (forward, backward,
optimizer; params and state donated) is compiled per setup: ``hybrid_adamw``
with bf16 params and an fp32 master and fp32 moments in each tier (``tx.step``),
and ``optax.adamw`` with fp32 params (the usual baseline) and with bf16 params
and fp32 ``mu``. For each, the depth is bisected for the largest model whose
``device_peak_bytes`` fits the target's device memory; prints a markdown table.

``--step-table``: the optimizer step alone on the GPT-2-small tree
(``benchmarks/step.py``), per tier: kernels, transfers, host calls and the
bytes its kernels read and write per parameter (the floor for an fp32 AdamW
step is 28 B: read p, g, m, v, write p, m, v), next to ``optax.adamw``.

``--streaming-table``: the Llama-style decoder of ``benchmarks/models.py`` at
full size, its layers run by ``jax.lax.scan`` on the device, by a scan that
moves each layer from ``pinned_host`` in its body, or by
``optax_hybrid.scan_layers`` (with and without ``offload_carries``), with
the ``host`` tier (and ``lax.scan`` with the ``host_state`` tier), at several depths: device and host peak, the
device's growth per layer, bus bytes per param and step.

``--capacity-table``: the largest Llama-style model per setup (``optax.adamw``
fp32, bf16 + fp32 ``mu``; bf16 + fp32 moments on the device; the host tier
with ``scan_layers``, fp32 or 8-bit moments) whose step fits both the device
and a host memory (128 GiB, 256 GB, 1 TB, 2 TB), each used up to 90%: the
depth is predicted from two compiles (memory is linear in depth for scanned
layers) and checked by compiling it and the next depth.

``--staging-table``: the streamed tiers (``host_state``, ``host``,
``offload_fraction=0.5``) x kernel x path on 8 leaves of 2048 x 2048: their
device and host temporaries per parameter (how many stages are staged).

Each setup compiles in its own subprocess. A compile error (or an XLA abort)
stops the run with its message: a failed compile is never counted as a model
that does not fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, os.pardir))
import optax_hybrid  # noqa: E402
from optax_hybrid import gpu_compile, plan  # noqa: E402

GB = 1e9
# The Llama-style decoder of the streaming and capacity tables (benchmarks/models.py), but for its depth.
LLAMA_SIZES = dict(width=4096, heads=32, ffn=11008, vocab=32000, seq=2048, batch=1)
F32 = dict(mu_dtype=jnp.float32, nu_dtype=jnp.float32, master_dtype=jnp.float32)

# The setup whose train step is optax_hybrid.step_in_backward (the others: value_and_grad, then the step).
CHAR_GPT_IN_BACKWARD = "host_state + optimizer in the backward pass"
# name -> (param dtype, optimizer factory)
SETUPS = {
    "optax.adamw fp32": (jnp.float32, lambda: optax.adamw(1e-4, weight_decay=0.1)),
    "optax.adamw bf16 + fp32 mu": (jnp.bfloat16, lambda: optax.adamw(1e-4, weight_decay=0.1, mu_dtype=jnp.float32)),
    "device": (jnp.bfloat16, lambda kernel="xla": optax_hybrid.hybrid_adamw(1e-4, weight_decay=0.1, tiers="device",
                                                                            kernel=kernel, **F32)),
    "host_state": (jnp.bfloat16, lambda kernel="xla": optax_hybrid.hybrid_adamw(
        1e-4, weight_decay=0.1, tiers="host_state", kernel=kernel, **F32)),
    "host": (jnp.bfloat16, lambda kernel="xla": optax_hybrid.hybrid_adamw(1e-4, weight_decay=0.1, tiers="host",
                                                                          kernel=kernel, **F32)),
    # The host_state tier, its train step optax_hybrid.step_in_backward: each block stepped in the backward pass.
    CHAR_GPT_IN_BACKWARD: (jnp.bfloat16, lambda kernel="xla": optax_hybrid.hybrid_adamw(
        1e-4, weight_decay=0.1, tiers="host_state", kernel=kernel, **F32)),
}
STEP_SETUPS = {
    "optax.adamw fp32": (jnp.float32, lambda: optax.adamw(1e-4, weight_decay=0.1)),
    "device fp32 xla": (jnp.float32, lambda: optax_hybrid.hybrid_adamw(1e-4, weight_decay=0.1, kernel="xla")),
    "device fp32 pallas": (jnp.float32, lambda: optax_hybrid.hybrid_adamw(1e-4, weight_decay=0.1, kernel="pallas")),
    "optax.adamw bf16 + fp32 mu": SETUPS["optax.adamw bf16 + fp32 mu"],
    "device bf16 xla": (jnp.bfloat16, SETUPS["device"][1]),
    "device bf16 pallas": (jnp.bfloat16, lambda: SETUPS["device"][1]("pallas")),
    "host_state bf16": (jnp.bfloat16, SETUPS["host_state"][1]),
    "host bf16": (jnp.bfloat16, SETUPS["host"][1]),
    "offload_fraction=0.5 bf16": (jnp.bfloat16, lambda: optax_hybrid.hybrid_adamw(
        1e-4, weight_decay=0.1, offload_fraction=0.5, kernel="xla", **F32)),
    # 8-bit block-wise moments (moment_format="8bit"), fp32 master.
    "device bf16 8bit xla": (jnp.bfloat16, lambda: optax_hybrid.hybrid_adamw(
        1e-4, weight_decay=0.1, tiers="device", kernel="xla", moment_format="8bit", master_dtype=jnp.float32)),
    "device bf16 8bit pallas": (jnp.bfloat16, lambda: optax_hybrid.hybrid_adamw(
        1e-4, weight_decay=0.1, tiers="device", kernel="pallas", moment_format="8bit", master_dtype=jnp.float32)),
    "host_state bf16 8bit": (jnp.bfloat16, lambda: optax_hybrid.hybrid_adamw(
        1e-4, weight_decay=0.1, tiers="host_state", kernel="xla", moment_format="8bit", master_dtype=jnp.float32)),
    "host bf16 8bit": (jnp.bfloat16, lambda: optax_hybrid.hybrid_adamw(
        1e-4, weight_decay=0.1, tiers="host", kernel="xla", moment_format="8bit", master_dtype=jnp.float32)),
}


# --- the model ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Config:
  layers: int
  width: int
  heads: int
  vocab: int = 128
  seq_len: int = 1024
  batch: int = 4


def init_params(cfg: Config, dtype, key):
  """char_gpt's CharGPT params, the blocks stacked on a leading layer axis."""
  d, L = cfg.width, cfg.layers
  k = iter(jax.random.split(key, 8))
  normal = lambda shape, std: (std * jax.random.normal(next(k), shape)).astype(dtype)
  zeros = lambda shape: jnp.zeros(shape, dtype)
  ones = lambda shape: jnp.ones(shape, dtype)
  return {
      "embed": {"embedding": normal((cfg.vocab, d), d ** -0.5)},
      "pos_embedding": normal((cfg.seq_len, d), 0.02),
      "blocks": {
          "ln1": {"scale": ones((L, d)), "bias": zeros((L, d))},
          "qkv": {"kernel": normal((L, d, 3 * d), d ** -0.5), "bias": zeros((L, 3 * d))},
          "out": {"kernel": normal((L, d, d), d ** -0.5), "bias": zeros((L, d))},
          "ln2": {"scale": ones((L, d)), "bias": zeros((L, d))},
          "fc": {"kernel": normal((L, d, 4 * d), d ** -0.5), "bias": zeros((L, 4 * d))},
          "proj": {"kernel": normal((L, 4 * d, d), (4 * d) ** -0.5), "bias": zeros((L, d))},
      },
      "ln_f": {"scale": ones((d,)), "bias": zeros((d,))},
  }


def layer_norm(x, p):
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
  return ((x32 - mean) * jax.lax.rsqrt(var + 1e-6) * p["scale"] + p["bias"]).astype(x.dtype)


def block(x, p, heads: int):
  b, t, d = x.shape
  h = layer_norm(x, p["ln1"])
  qkv = (h @ p["qkv"]["kernel"] + p["qkv"]["bias"]).reshape(b, t, 3, heads, d // heads)
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  scores = jnp.einsum("bqhc,bkhc->bhqk", q, k).astype(jnp.float32) / math.sqrt(d // heads)
  scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
  x = x + jnp.einsum("bhqk,bkhc->bqhc", weights, v).reshape(b, t, d) @ p["out"]["kernel"] + p["out"]["bias"]
  h = layer_norm(x, p["ln2"])
  return x + jax.nn.gelu(h @ p["fc"]["kernel"] + p["fc"]["bias"]) @ p["proj"]["kernel"] + p["proj"]["bias"]


def loss_fn(params, x, y, heads: int):
  h = params["embed"]["embedding"][x] + params["pos_embedding"][: x.shape[1]]
  body = jax.checkpoint(lambda h, p: (block(h, p, heads), None))
  h, _ = jax.lax.scan(body, h, params["blocks"])
  logits = (layer_norm(h, params["ln_f"]) @ params["embed"]["embedding"].T).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def char_gpt_parts(cfg: Config):
  """``loss_fn``'s model as ``optax_hybrid.step_in_backward`` takes it (the blocks under ``"blocks"``)."""
  def embed(rest, batch):
    x, _ = batch
    return rest["embed"]["embedding"][x] + rest["pos_embedding"][: x.shape[1]]

  def head(rest, h, batch):
    logits = (layer_norm(h, rest["ln_f"]) @ rest["embed"]["embedding"].T).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

  return embed, lambda h, p, rest, batch: block(h, p, cfg.heads), head


def num_params(tree) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def placed(tree):
  """ShapeDtypeStructs committed to the first device (as a real, placed model's would be)."""
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def abstract_state(tx, params):
  """The optimizer state of abstract params: hybrid_adamw's init takes them directly (keeping memory kinds and
  shardings); Optax's state is placed like the params (its params-shaped fields) or beside the first of them."""
  if isinstance(tx, optax_hybrid.HybridOptimizer):
    return tx.init(params)
  state = jax.eval_shape(tx.init, params)
  first = jax.tree.leaves(params)[0].sharding
  other = (jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
           if isinstance(first, jax.sharding.NamedSharding) else first)
  return optax.tree_utils.tree_map_params(
      tx, lambda x, p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=p.sharding.with_memory_kind("device")),
      state, params, transform_non_params=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=other))


def train_step_of(tx, loss):
  """``(params, state, *batch) -> (params, state, loss)``: hybrid_adamw's fused step, or Optax's update + apply."""
  def train_step(params, state, *batch):
    value, grads = jax.value_and_grad(loss)(params, *batch)
    if isinstance(tx, optax_hybrid.HybridOptimizer):
      params, state = tx.step(params, state, grads)
    else:
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    return params, state, value
  return train_step


def compile_train_step(setup: str, cfg: Config, target: str) -> dict:
  dtype, make_tx = SETUPS[setup]
  tx = make_tx()
  params = placed(jax.eval_shape(lambda: init_params(cfg, dtype, jax.random.key(0))))
  state = abstract_state(tx, params)
  tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq_len), jnp.int32, sharding=params["pos_embedding"].sharding)
  train_step = train_step_of(tx, lambda params, x, y: loss_fn(params, x, y, cfg.heads))
  if setup == CHAR_GPT_IN_BACKWARD:
    import models
    train_step = models.donation_ordered(optax_hybrid.step_in_backward(tx, *char_gpt_parts(cfg), layers="blocks"))
  report = gpu_compile.compile_for_gpu(train_step, params, state, tokens, tokens, target=target,
                                       donate_argnums=(0, 1))
  return dict(params=num_params(params), device=report.device_peak_bytes, host=report.host_peak_bytes,
              device_temp=report.device_temp_bytes, host_temp=report.host_temp_bytes,
              warnings=len(report.warnings))


# --- subprocess per setup ---------------------------------------------------------------------

class CompileFailed(SystemExit):
  """A setup's subprocess failed (a compile error, an XLA abort): the run stops with its message."""


def in_subprocess(args: list[str], timeout: float = 1800) -> dict:
  """Runs this script with ``args`` in a subprocess and returns its JSON line.

  Raises:
    CompileFailed: the subprocess failed; the message has its error (the
      last lines of its stderr), which a table must not turn into "does not fit".
  """
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if "--devices" in args and int(args[args.index("--devices") + 1]) > 1:  # traced on as many CPU devices
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args[args.index('--devices') + 1]}"
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True,
                        timeout=timeout, env=env)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if proc.returncode != 0 or not lines:
    tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
    raise CompileFailed(f"gpu_memory.py {' '.join(args)} failed (rc {proc.returncode}); the run stops "
                        f"rather than count a failed compile as a model that does not fit:\n{tail}")
  return json.loads(lines[-1])


def largest_fitting(setup: str, width: int, heads: int, target: str, max_layers: int, cfg_kw: dict) -> dict:
  """The largest depth whose step fits the target (``device_peak_bytes``); one compile per probe."""
  limit = gpu_compile.target_device_memory_bytes(target)
  probes = {}

  def fits(layers: int) -> bool:
    cfg = Config(layers=layers, width=width, heads=heads, **cfg_kw)
    # A compile error is not "does not fit": it propagates and stops the run.
    probes[layers] = r = compile_train_step(setup, cfg, target)
    return r["device"] <= limit

  # The step's device memory grows linearly with depth (scanned layers): two
  # probes estimate the answer, then a bisection brackets it from there.
  if not fits(1):
    lo, hi = 0, 1
  elif max_layers == 1 or not fits(2):
    lo, hi = 1, 2
  else:
    slope = max(1, probes[2]["device"] - probes[1]["device"])
    guess = min(max_layers, max(2, 1 + (limit - probes[1]["device"]) // slope))
    if fits(guess):
      lo, hi, step = guess, guess + 1, max(1, guess // 64)
      while hi <= max_layers and fits(hi):  # the guess was low: widen upwards until one fails
        lo, hi, step = hi, min(max_layers + 1, hi + step), step * 2
    else:
      lo, hi = 2, guess
  hi = min(hi, max_layers + 1)
  while hi - lo > 1:
    mid = (lo + hi) // 2
    if fits(mid):
      lo = mid
    else:
      hi = mid
  best = probes.get(lo) if lo else None
  return dict(setup=setup, layers=lo, best=best, probes=len(probes), limit=limit)


def step_figures(setup: str, scale: float, target: str, inputs: str) -> dict:
  from step import gpt2_small_shapes
  dtype, make_tx = STEP_SETUPS[setup]
  tx = make_tx()
  shapes = gpt2_small_shapes(scale)
  device = jax.devices()[0]
  if inputs == "real":
    params = jax.device_put({k: jnp.full(s, 0.5, dtype) for k, s in shapes.items()}, device)
    grads = jax.device_put({k: jnp.full(s, 1e-3, dtype) for k, s in shapes.items()}, device)
    state = tx.init(params)
  else:
    params = placed({k: jax.ShapeDtypeStruct(s, dtype) for k, s in shapes.items()})
    grads = placed({k: jax.ShapeDtypeStruct(s, dtype) for k, s in shapes.items()})
    state = abstract_state(tx, params)
  if isinstance(tx, optax_hybrid.HybridOptimizer):
    fn = tx.step
  else:
    fn = lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p))
  report = gpu_compile.compile_for_gpu(fn, params, state, grads, target=target, donate_argnums=(0, 1))
  n = num_params(params)
  return dict(setup=setup, params=n, kernels=report.kernels, triton=report.triton_launches,
              transfers=report.transfers, host_calls=report.host_calls, bytes_per_param=report.kernel_bytes / n,
              transfer_per_param=report.transfer_bytes / n,
              device_per_param=report.device_peak_bytes / n, host_per_param=report.host_peak_bytes / n,
              device_temp_per_param=report.device_temp_bytes / n, host_temp_per_param=report.host_temp_bytes / n,
              warnings=len(report.warnings))


STAGING_TREE = {**{f"w{i}": (2048, 2048) for i in range(8)}, **{f"b{i}": (2048,) for i in range(8)}}
STAGING_SETUPS = [f"{tier}:{kernel}:{path}" for tier in ("host_state", "host", "offload_fraction")
                  for kernel in ("xla", "pallas") for path in ("step", "update")]


def staging_figures(setup: str, dtype_name: str, target: str) -> dict:
  """Device and host temporaries of one streamed tier's step on :data:`STAGING_TREE` (8 leaves of 2048 x 2048)."""
  tier, kernel, path = setup.split(":")
  dtype = jnp.dtype(dtype_name)
  placement = dict(offload_fraction=0.5) if tier == "offload_fraction" else dict(tiers=tier)
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, kernel=kernel, moment_format="float32",
                                 master_dtype=jnp.float32 if dtype != jnp.float32 else None, **placement)
  params = placed({k: jax.ShapeDtypeStruct(s, dtype) for k, s in STAGING_TREE.items()})
  state = tx.init(params)
  if path == "step":
    fn = tx.step
  else:
    fn = lambda p, s, g: (lambda u, s: (optax_hybrid.apply_updates(p, u), s))(*tx.update(g, s, p))
  report = gpu_compile.compile_for_gpu(fn, params, state, params, target=target, donate_argnums=(0, 1))
  n = num_params(params)
  leaf_state = max(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves((state.mu, state.nu)))
  return dict(setup=setup, dtype=dtype_name, device_temp_per_param=report.device_temp_bytes / n,
              host_temp_per_param=report.host_temp_bytes / n, transfers=report.transfers,
              host_calls=report.host_calls, warnings=len(report.warnings),
              state_per_param=sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(
                  (state.mu, state.nu, state.master))) / n,
              largest_leaf_state_per_param=(leaf_state * 2 + (4 * 2048 * 2048 if dtype != jnp.float32 else 0)) / n)


# --- tables ----------------------------------------------------------------------------

def memory_table(args) -> list[dict]:
  heads = args.heads or max(1, args.width // 128)
  cfg_kw = dict(seq_len=args.seq_len, batch=args.batch)
  rows = []
  for setup in args.setups.split(","):
    t = time.perf_counter()
    row = in_subprocess(["--one-setup", setup, "--width", str(args.width), "--heads", str(heads),
                         "--target", args.target, "--max-layers", str(args.max_layers),
                         "--seq-len", str(args.seq_len), "--batch", str(args.batch)])
    row.setdefault("setup", setup)
    row["seconds"] = time.perf_counter() - t
    rows.append(row)
    print(f"  {setup}: {json.dumps(row)[:400]}", file=sys.stderr, flush=True)
  base = next((r for r in rows if r["setup"] == "optax.adamw fp32" and r.get("best")), None)
  print(f"\nLargest char-GPT (width {args.width}, {heads} heads, batch {args.batch} x {args.seq_len} tokens, "
        f"layers bisected up to {args.max_layers}) whose compiled train step fits one {args.target.upper()} "
        f"({gpu_compile.target_device_memory_bytes(args.target) / GB:.1f} GB); compile-time figures, "
        f"jax {jax.__version__}:\n")
  print("| setup | layers | largest params | device GB | host GB | x optax.adamw | note |")
  print("|---|---:|---:|---:|---:|---:|---|")
  for r in rows:
    best = r.get("best")
    if not best:
      print(f"| {r['setup']} | 0 | - | - | - | - | nothing fits |")
      continue
    ratio = f"{best['params'] / base['best']['params']:.2f}" if base else "-"
    note = ""
    if r["layers"] >= args.max_layers:
      note = f"fits at the cap (--max-layers {args.max_layers}) " + note
    if best.get("warnings"):
      note = f"{best['warnings']} host-offloader fallback warnings " + note
    print(f"| {r['setup']} | {r['layers']} | {best['params'] / 1e9:.2f} B | {best['device'] / GB:.1f} | "
          f"{best['host'] / GB:.1f} | {ratio} | {note.strip()} |")
  return rows


def step_table(args) -> list[dict]:
  rows = []
  for setup in args.step_setups.split(","):
    row = in_subprocess(["--one-step", setup, "--scale", str(args.scale), "--target", args.target,
                         "--inputs", args.inputs])
    row.setdefault("setup", setup)
    rows.append(row)
  n = next((r["params"] for r in rows if "params" in r), 0)
  print(f"\nThe optimizer step alone, GPT-2-small shapes x {args.scale} ({n / 1e6:.1f}M params), "
        f"{args.inputs} inputs, compiled for {args.target.upper()}; compile-time figures, jax {jax.__version__}. "
        "B/param: bytes the kernels read and write (floor for fp32 AdamW: 28), device and host peak, temps:\n")
  print("| setup | kernels | Triton | transfers | bus B/param | host calls | kernel B/param | device B/param "
        "| host B/param | device temp | host temp | fallback warnings |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['setup']} | {r['kernels']} | {r['triton']} | {r['transfers']} | {r['transfer_per_param']:.2f} | "
          f"{r['host_calls']} | "
          f"{r['bytes_per_param']:.1f} | {r['device_per_param']:.2f} | {r['host_per_param']:.2f} | "
          f"{r['device_temp_per_param']:.2f} | {r['host_temp_per_param']:.2f} | {r['warnings']} |")
  return rows


# name -> (how the layers run, where they live, offload_carries, tier); the
# layers' ShapeDtypeStructs carry a NamedSharding (typed as host values under
# jit) but in the one setup that shows what a SingleDeviceSharding compiles.
STREAM_SETUPS = {
    "lax.scan (layers on the device)": (False, "device", False, "host"),
    "lax.scan + device_put in the body (layers in pinned_host)": ("device_put", "pinned_host", False, "host"),
    "the same with layers typed as device values (SingleDeviceSharding)": (
        "device_put", "pinned_host/single", False, "host"),
    "scan_layers (layers in pinned_host)": (True, "pinned_host", False, "host"),
    "scan_layers + offload_carries": (True, "pinned_host", True, "host"),
    "lax.scan + host_state tier (layers on the device)": (False, "device", False, "host_state"),
}


assert not any("," in name for name in STREAM_SETUPS)  # --stream-setups splits on commas


def streaming_figures(setup: str, layers: int, target: str, moments: str) -> dict:
  """One whole train step of the Llama-style decoder (``benchmarks/models.py``), bf16 params + fp32 master."""
  import models
  stream, kind, offload, tier = STREAM_SETUPS[setup]
  kind, _, single = kind.partition("/")
  model = models.llama(jnp.bfloat16, stream=stream, offload_carries=offload, layers_memory_kind=kind,
                       named=not single, layers=layers, **LLAMA_SIZES)
  tx = optax_hybrid.hybrid_adamw(1e-4, weight_decay=0.1, tiers=tier, master_dtype=jnp.float32, moment_format=moments)
  state = tx.init(model.params)
  train_step = train_step_of(tx, model.loss)
  report = gpu_compile.compile_for_gpu(train_step, model.params, state, model.batch, target=target,
                                       donate_argnums=(0, 1))
  n = model.num_params
  figures = dict(setup=setup, layers=layers, params=n, device=report.device_peak_bytes, host=report.host_peak_bytes,
                 device_temp=report.device_temp_bytes, to_device_per_param=report.to_device_bytes / n,
                 to_host_per_param=report.to_host_bytes / n, warnings=len(report.warnings),
                 carry_bytes=2048 * 4096 * 2)
  if tier == "host_state":  # the step alone: what it stages on the device, against a layer's slice of state
    step = gpu_compile.compile_for_gpu(tx.step, model.params, state, model.params, target=target,
                                       donate_argnums=(0, 1))
    shapes = [x.shape for x in jax.tree.leaves(model.params)]
    figures.update(step_device_temp=step.device_temp_bytes, step_host_temp=step.host_temp_bytes,
                   largest_slice=max(plan.state_bytes(lp, (lp.slice_rows or shape[0], *shape[1:]))
                                     for lp, shape in zip(state.plan.leaves, shapes) if lp.streamed))
  return figures


def streaming_table(args) -> list[dict]:
  rows = []
  for setup in args.stream_setups.split(","):
    for layers in (int(x) for x in args.stream_layers.split(",")):
      rows.append(in_subprocess(["--one-streaming", setup, "--layers", str(layers), "--target", args.target,
                                 "--moments", args.moments]))
      print(f"  {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
  print(f"\nThe Llama-style decoder (width 4096, 32 heads, SwiGLU 11008, vocab 32000, batch 1 x 2048), bf16 params "
        f"with an fp32 master and {args.moments} moments, whole train step (value_and_grad + tx.step, donated, "
        f"abstract inputs), {args.target.upper()} target ({gpu_compile.target_device_memory_bytes(args.target) / GB:.1f}"
        f" GB); compile-time figures, jax {jax.__version__}. Bus bytes per param and step, counted from the "
        "optimized HLO:\n")
  print("| setup | layers | params | device GB | device growth per layer | host GB | bus in B/param | "
        "bus out B/param | fallback warnings |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  previous = {}
  for r in rows:
    growth = "-"
    if r["setup"] in previous:
      p = previous[r["setup"]]
      growth = f"{(r['device'] - p['device']) / (r['layers'] - p['layers']) / 1e6:.1f} MB"
    previous[r["setup"]] = r
    print(f"| {r['setup']} | {r['layers']} | {r['params'] / 1e9:.2f} B | {r['device'] / GB:.2f} | {growth} | "
          f"{r['host'] / GB:.0f} | {r['to_device_per_param']:.2f} | {r['to_host_per_param']:.2f} | {r['warnings']} |")
  print(f"\n(one saved carry, 1 x 2048 x 4096 bf16: {rows[0]['carry_bytes'] / 1e6:.1f} MB)")
  for r in rows:
    if "step_device_temp" in r:
      print(f"{r['setup']}, {r['layers']} layers, the step alone: device temporaries "
            f"{r['step_device_temp'] / 1e6:.1f} MB = {r['step_device_temp'] / r['largest_slice']:.2f} x the largest "
            f"slice of state ({r['largest_slice'] / 1e6:.1f} MB), host temporaries {r['step_host_temp'] / 1e6:.1f} MB")
  return rows


# --- the largest model per setup, bounded by device and host memory -----------------------------------

# The setups whose train step is optax_hybrid.step_in_backward (the others: value_and_grad, then the step).
IN_BACKWARD = {f"host_state tier + optimizer in the backward pass, {what}": master_and_moments
               for what, master_and_moments in (("stochastic rounding, 8-bit moments", ("stochastic", "8bit")),
                                                 ("Kahan master, 8-bit moments", ("kahan", "8bit")),
                                                 ("fp32 master, 8-bit moments", ("float32", "8bit")),
                                                 ("fp32 master and moments", ("float32", "float32")))}
# name -> (param dtype, optimizer factory, layers streamed from pinned_host by scan_layers)
CAPACITY_SETUPS = {
    "optax.adamw fp32": (jnp.float32, lambda: optax.adamw(1e-4, weight_decay=0.1), False),
    "optax.adamw bf16 + fp32 mu": (jnp.bfloat16, lambda: optax.adamw(1e-4, weight_decay=0.1, mu_dtype=jnp.float32),
                                   False),
    "bf16 + fp32 mu and nu (device tier)": (jnp.bfloat16, lambda: optax_hybrid.hybrid_adamw(
        1e-4, weight_decay=0.1, tiers="device", moment_format="float32"), False),
    "host tier, fp32 master and moments (params on the device)": (jnp.bfloat16, lambda: optax_hybrid.hybrid_adamw(
        1e-4, weight_decay=0.1, tiers="host", master_dtype=jnp.float32, moment_format="float32"), False),
    "host tier, fp32 master, 8-bit moments (params on the device)": (jnp.bfloat16, lambda: optax_hybrid.hybrid_adamw(
        1e-4, weight_decay=0.1, tiers="host", master_dtype=jnp.float32, moment_format="8bit"), False),
    "host tier + scan_layers, fp32 master and moments": (jnp.bfloat16, lambda: optax_hybrid.hybrid_adamw(
        1e-4, weight_decay=0.1, tiers="host", master_dtype=jnp.float32, moment_format="float32"), True),
    "host tier + scan_layers, fp32 master, 8-bit moments": (jnp.bfloat16, lambda: optax_hybrid.hybrid_adamw(
        1e-4, weight_decay=0.1, tiers="host", master_dtype=jnp.float32, moment_format="8bit"), True),
    "device tier, fp32 master, 8-bit moments": (jnp.bfloat16, lambda: optax_hybrid.hybrid_adamw(
        1e-4, weight_decay=0.1, tiers="device", master="float32", moment_format="8bit"), False),
    **{f"host_state tier, {what} (params on the device)": (jnp.bfloat16, lambda master=master, moments=moments: (
        optax_hybrid.hybrid_adamw(1e-4, weight_decay=0.1, tiers="host_state", master=master, moment_format=moments)),
        False) for what, (master, moments) in (("fp32 master and moments", ("float32", "float32")),
                                               ("stochastic rounding, fp32 moments", ("stochastic", "float32")),
                                               ("fp32 master, 8-bit moments", ("float32", "8bit")),
                                               ("stochastic rounding, 8-bit moments", ("stochastic", "8bit")))},
    "host tier, stochastic rounding, 8-bit moments (params on the device)": (jnp.bfloat16, lambda: (
        optax_hybrid.hybrid_adamw(1e-4, weight_decay=0.1, tiers="host", master="stochastic", moment_format="8bit")),
        False),
    "host tier + scan_layers, Kahan master, 8-bit moments": (jnp.bfloat16, lambda: optax_hybrid.hybrid_adamw(
        1e-4, weight_decay=0.1, tiers="host", master="kahan", moment_format="8bit"), True),
    "host tier + scan_layers, stochastic rounding, 8-bit moments": (jnp.bfloat16, lambda: optax_hybrid.hybrid_adamw(
        1e-4, weight_decay=0.1, tiers="host", master="stochastic", moment_format="8bit"), True),
    "host_state tier + scan_layers, stochastic rounding, 8-bit moments": (jnp.bfloat16, lambda: (
        optax_hybrid.hybrid_adamw(1e-4, weight_decay=0.1, tiers="host_state", master="stochastic",
                                  moment_format="8bit")), True),
    **{name: (jnp.bfloat16, lambda master=master, moments=moments: optax_hybrid.hybrid_adamw(
        1e-4, weight_decay=0.1, tiers="host_state", master=master, moment_format=moments), True)
       for name, (master, moments) in IN_BACKWARD.items()},
}
assert not any(";" in name for name in CAPACITY_SETUPS)  # --capacity-setups splits on semicolons
HOST_MEMORIES = {"128 GiB": 128 * 2**30, "256 GB": 256e9, "1 TB": 1e12, "2 TB": 2e12}
LIMIT = 0.9  # of each memory: room for the CUDA context, the allocator's fragmentation, the process itself


def capacity_figures(setup: str, layers: int, target: str, devices: int = 1) -> dict:
  """Device and host peak of the Llama-style decoder's whole train step at ``layers`` (one compile), per GPU.

  On ``devices`` GPUs (a node of 8, or two: 16) the model is split as FSDP
  code splits it (``models.fsdp_placed``: each matrix on its width axis, the
  batch of ``devices`` sequences on its first axis, the activations between
  layers constrained to it), and the step compiled for that topology.
  """
  import models
  dtype, make_tx, streamed = CAPACITY_SETUPS[setup]
  kind = "pinned_host" if streamed else "device"
  sizes = dict(LLAMA_SIZES, batch=devices) if devices > 1 else LLAMA_SIZES
  cfg = models.LlamaConfig(layers=layers, **sizes)
  model = models.llama(dtype, stream=streamed, layers_memory_kind=kind, layers=layers, **sizes)
  params, batch, activations = model.params, model.batch, None
  if devices > 1:
    mesh = jax.make_mesh((devices,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:devices])
    params, batch = models.fsdp_placed(model.params, model.batch, mesh, kind)
    activations = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  tx = make_tx()
  state = abstract_state(tx, params)
  train_step = train_step_of(tx, lambda p, b: models.llama_loss(cfg, p, b, streamed, activations=activations))
  if setup in IN_BACKWARD:  # the same model, by parts, stepped inside its backward pass
    train_step = models.donation_ordered(optax_hybrid.step_in_backward(tx, *models.llama_parts(cfg, activations)))
  report = gpu_compile.compile_for_gpu(train_step, params, state, batch, target=target, num_devices=devices,
                                       donate_argnums=(0, 1))
  n = model.num_params
  fields = host_bytes_by_field(params, state, streamed and setup not in IN_BACKWARD)
  hlo_file = None
  if os.environ.get("GPU_MEMORY_HLO_DIR"):  # the compiled program, for reading it again (collectives, time)
    import gzip
    hlo_file = os.path.join(os.environ["GPU_MEMORY_HLO_DIR"], f"{setup}-{layers}-{devices}.hlo.gz".replace(" ", "_"))
    with gzip.open(hlo_file, "wt") as f:
      f.write(report.hlo)
    with open(hlo_file + ".command_buffers.json", "w") as f:
      json.dump(_command_buffers_json(report.command_buffers), f)
  return dict(setup=setup, layers=layers, params=n, devices=devices, **fields, device=report.device_peak_bytes,
              host=report.host_peak_bytes, host_argument=report.host_argument_bytes, host_temp=report.host_temp_bytes,
              to_device=report.to_device_bytes, to_host=report.to_host_bytes, warnings=len(report.warnings),
              hlo_file=hlo_file, kept_shardings=report.kept_shardings((params, state)) if devices > 1 else True)


def host_bytes_by_field(params, state, gradient_buffer: bool) -> dict:
  """What one GPU's share of host memory holds, by what it is for: params, master, the rule's state and (layers
  streamed by scan_layers, then stepped) the gradient buffer scan_layers writes where the layers live, which has
  the layers' shapes, dtypes and shardings."""
  shard_bytes = lambda x: math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
  on_host = lambda tree: sum(shard_bytes(x) for x in jax.tree.leaves(tree)
                             if getattr(getattr(x, "sharding", None), "memory_kind", None) == "pinned_host")
  by_field = {"host_params": on_host(params), "host_master": 0, "host_moments": 0}
  if isinstance(state, tuple) and hasattr(state, "_fields"):
    for name in state._fields:
      if name != "plan":
        by_field["host_master" if name == "master" else "host_moments"] += on_host(getattr(state, name))
  by_field["host_gradient"] = by_field["host_params"] if gradient_buffer else 0
  return by_field


def _probe_file() -> str | None:
  folder = os.environ.get("GPU_MEMORY_HLO_DIR")
  return os.path.join(folder, "probes.jsonl") if folder else None


def kept_probe(args: list[str]) -> dict | None:
  """A probe of an earlier run with the same arguments, kept beside the HLO (``GPU_MEMORY_HLO_DIR``)."""
  path = _probe_file()
  if path and os.path.exists(path):
    with open(path) as f:
      for line in f:
        record = json.loads(line)
        if record["args"] == args:
          return record["figures"]
  return None


def keep_probe(args: list[str], figures: dict) -> dict:
  """Keeps a probe's figures for a rerun (a long table survives an interruption)."""
  path = _probe_file()
  if path:
    with open(path, "a") as f:
      f.write(json.dumps(dict(args=args, figures=figures)) + "\n")
  return figures


def largest_within(setup: str, target: str, host_limit: float, probes: dict, first: int, second: int,
                   devices: int = 1) -> dict:
  """The deepest model whose step fits both limits (per GPU): predicted from two depths (memory grows linearly with
  depth for scanned layers), then checked by compiling it and the next depth; a wrong prediction is refined by the
  line through the closest depths that fit and do not (three times, then by halves)."""
  device_limit = LIMIT * gpu_compile.target_device_memory_bytes(target)

  def probe(layers):
    if layers not in probes:
      args = ["--one-capacity", setup, "--layers", str(layers), "--target", target, "--devices", str(devices)]
      probes[layers] = kept_probe(args) or keep_probe(args, in_subprocess(args))
    return probes[layers]

  def fits(layers):
    r = probe(layers)
    return r["device"] <= device_limit and r["host"] <= host_limit

  def depth_between(lo, hi):
    """Where the binding limit is crossed, by the line through two compiled depths."""
    a, b = probe(lo), probe(hi)
    crossings = [lo + (limit - a[key]) * (hi - lo) / (b[key] - a[key])
                 for key, limit in (("device", device_limit), ("host", host_limit)) if b[key] > a[key]]
    return int(min(crossings)) if crossings else hi

  depth = max(1, depth_between(first, second))
  # The prediction is usually right within a layer; where XLA's plan is not linear in depth, the line through
  # the bracket's ends predicts again (a few compiles, where bisecting a wrong guess takes ten).
  if fits(depth):
    lo, hi, step = depth, depth + 1, 1
    while fits(hi):
      lo, hi, step = hi, hi + step, step * 2
  else:
    lo, hi = (second if fits(second) else 1), depth
  for tries in itertools.count():
    if hi - lo <= 1:
      break
    guess = min(max(depth_between(lo, hi), lo + 1), hi - 1) if tries < 3 else (lo + hi) // 2
    if not fits(guess):
      hi = guess
    elif guess + 1 < hi:  # the line is usually right: the next depth closes the bracket
      lo, hi = (guess + 1, hi) if fits(guess + 1) else (guess, guess + 1)
    else:
      lo = guess
  return dict(probe(lo), host_limit=host_limit, device_limit=device_limit, fits=fits(lo))


def by_field(row: dict) -> str:
  """Host bytes per weight: params / master / moments / gradient / the rest (the step's temporaries).

  On several GPUs, a GPU's bytes per weight of its share of the model.
  """
  parts = [row[k] for k in ("host_params", "host_master", "host_moments", "host_gradient")]
  share = row["params"] / row.get("devices", 1)
  return " / ".join(f"{x / share:.2f}" for x in (*parts, row["host"] - sum(parts)))


def _command_buffers_json(plan) -> dict | None:
  """A compile's command buffers (``GpuCompileReport.command_buffers``) as JSON: sets as sorted lists."""
  if plan is None:
    return None
  return {k: sorted(v) if isinstance(v, frozenset) else v for k, v in dataclasses.asdict(plan).items()}


def _kept_command_buffers(hlo_file: str):
  """The command buffers kept beside a probe's HLO; None for a probe kept before they were."""
  from optax_hybrid.gpu_compile.thunks import CommandBuffers
  path = hlo_file + ".command_buffers.json"
  if not os.path.exists(path):
    return None
  with open(path) as f:
    kept = json.load(f)
  return None if kept is None else CommandBuffers(**{k: frozenset(v) if isinstance(v, list) else v
                                                     for k, v in kept.items()})


def traffic(row: dict) -> dict:
  """Per GPU per step, from the compiled program kept on disk: collective bytes and the estimated step time.

  (``GPU_MEMORY_HLO_DIR`` keeps each probe's optimized HLO and command buffers; without it, nothing.)
  """
  if not row.get("hlo_file") or not os.path.exists(row["hlo_file"]):
    return {}
  import gzip
  from optax_hybrid.gpu_compile import step_time
  with gzip.open(row["hlo_file"], "rt") as f:
    hlo = f.read()
  estimate = step_time.estimate(hlo, step_time.H200_SXM, _kept_command_buffers(row["hlo_file"]))
  return dict(collectives=gpu_compile.count_hlo(hlo).collective_bytes, seconds=estimate.seconds,
              bound=estimate.lower_bound, nvlink=estimate.collectives, launches=estimate.launches,
              trips=estimate.loop_trips)


GPUS_PER_NODE = 8


def capacity_table(args) -> list[dict]:
  rows, probes = [], {setup: {} for setup in CAPACITY_SETUPS}
  per_gpu = min(args.devices, GPUS_PER_NODE)  # a host memory is a node's, shared by its GPUs
  for setup in args.capacity_setups.split(";"):
    for memory in args.host_memories.split(","):
      row = largest_within(setup, args.target, LIMIT * HOST_MEMORIES[memory] / per_gpu, probes[setup], 8, 16,
                           args.devices)
      rows.append(dict(row, host_memory=memory))
      print(f"  {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
  device_gb = gpu_compile.target_device_memory_bytes(args.target) / GB
  if args.devices == 1:
    where = f"one {args.target.upper()} ({device_gb:.1f} GB) and a host memory"
  else:
    nodes = -(-args.devices // GPUS_PER_NODE)
    where = (f"{args.devices} {args.target.upper()} ({device_gb:.1f} GB each) in {nodes} node(s), FSDP over all of "
             f"them (each matrix split on its width axis, batch {args.devices} x 2048 split on the batch axis), each "
             f"node's host memory shared by its {per_gpu} GPUs; figures per GPU")
  print(f"\nThe largest Llama-style decoder (width 4096, 32 heads, SwiGLU 11008, vocab 32000, "
        f"{'batch 1 x 2048; ' if args.devices == 1 else ''}layers scanned) whose whole compiled train step fits "
        f"{where}, both used up to {LIMIT:.0%}; compile-time figures, jax {jax.__version__}:\n")
  node = args.devices > 1
  print("| host memory | setup | layers | params | x optax.adamw bf16 + fp32 mu | device GB | host GB | "
        "host B/weight | params / master / moments / gradient / other | bus in / out B/weight |"
        + (" bus in / out GB | all-gather results / reduce-scatter operands / all-reduce GB | NVLink s | "
           "launches / loop trips | est. step s (bound) |" if node else ""))
  print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|" + ("---:|---:|---:|---:|---:|" if node else ""))
  for memory in args.host_memories.split(","):
    mine = [r for r in rows if r["host_memory"] == memory]
    base = next((r for r in mine if r["setup"] == "optax.adamw bf16 + fp32 mu"), None)
    for r in mine:
      ratio = f"{r['params'] / base['params']:.2f}" if base else "-"
      share = r["params"] / args.devices  # a GPU's weights
      line = (f"| {memory} | {r['setup']} | {r['layers']} | {r['params'] / 1e9:.2f} B | {ratio} | "
              f"{r['device'] / GB:.1f} | {r['host'] / GB:.1f} | {r['host'] / share:.2f} | {by_field(r)} | "
              f"{r['to_device'] / share:.2f} / {r['to_host'] / share:.2f} |")
      if node:
        t = traffic(r)
        c = t.get("collectives", {})
        line += (f" {r['to_device'] / GB:.1f} / {r['to_host'] / GB:.1f} | "
                 + " / ".join(f"{c.get(k, 0) / GB:.1f}" for k in ("all-gather", "reduce-scatter", "all-reduce"))
                 + (f" | {t['nvlink']:.2f} | {t['launches']:,} / {t['trips']:,} | {t['seconds']:.2f} ({t['bound']:.2f}) |"
                    if t else " | - | - | - |"))
      print(line)
  return rows


def staging_table(args) -> list[dict]:
  rows = []
  for dtype_name in ("bfloat16", "float32"):
    for setup in STAGING_SETUPS:
      rows.append(in_subprocess(["--one-staging", setup, "--dtype", dtype_name, "--target", args.target]))
  print(f"\nStreamed tiers' temporaries on 8 leaves of 2048 x 2048 (+ 8 biases), {args.target.upper()} target, "
        f"abstract inputs; bf16 params take an fp32 master; moments fp32; bytes per parameter (a leaf's state: "
        f"{rows[0]['largest_leaf_state_per_param']:.2f} bf16 + master, "
        f"{rows[len(STAGING_SETUPS)]['largest_leaf_state_per_param']:.2f} fp32); compile-time figures, "
        f"jax {jax.__version__}:\n")
  print("| params | tier:kernel:path | device temp | host temp | transfers | host calls | fallback warnings |")
  print("|---|---|---:|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['dtype']} | {r['setup']} | {r['device_temp_per_param']:.2f} | {r['host_temp_per_param']:.2f} | "
          f"{r['transfers']} | {r['host_calls']} | {r['warnings']} |")
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--target", default="h200", help="h100, h200 or a GpuTargetConfig file (default h200)")
  parser.add_argument("--width", type=int, default=4096, help="d_model (default 4096)")
  parser.add_argument("--heads", type=int, default=0, help="attention heads (default width / 128)")
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--max-layers", type=int, default=512, help="the bisection's cap on depth")
  parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated subset of: " + ", ".join(SETUPS))
  parser.add_argument("--step-table", action="store_true", help="the optimizer step alone, per tier")
  parser.add_argument("--step-setups", default=",".join(STEP_SETUPS))
  parser.add_argument("--scale", type=float, default=1.0, help="--step-table: shrink GPT-2-small's leaves")
  parser.add_argument("--inputs", choices=("real", "abstract"), default="real",
                      help="--step-table: real arrays (default) or ShapeDtypeStructs")
  parser.add_argument("--staging-table", action="store_true",
                      help="host_state / host / offload_fraction temporaries on 8 leaves of 2048 x 2048")
  parser.add_argument("--streaming-table", action="store_true",
                      help="the Llama-style decoder's layers streamed from host memory (scan_layers) vs lax.scan")
  parser.add_argument("--stream-setups", default=",".join(STREAM_SETUPS))
  parser.add_argument("--stream-layers", default="16,32", help="--streaming-table: depths (comma-separated)")
  parser.add_argument("--moments", default="float32", help="--streaming-table: moment_format")
  parser.add_argument("--capacity-table", action="store_true",
                      help="the largest Llama-style model per setup within device and host memory (limits 0.9)")
  parser.add_argument("--capacity-setups", default=";".join(CAPACITY_SETUPS),
                      help="semicolon-separated subset of: " + "; ".join(CAPACITY_SETUPS))
  parser.add_argument("--host-memories", default=",".join(HOST_MEMORIES),
                      help="comma-separated subset of: " + ", ".join(HOST_MEMORIES))
  parser.add_argument("--one-capacity", help=argparse.SUPPRESS)
  parser.add_argument("--devices", type=int, default=1,
                      help="--capacity-table: GPUs, FSDP over all of them (8: one node; 16: two); a host memory is "
                           "each node's")
  parser.add_argument("--quick", action="store_true", help="a small run of both tables (a test)")
  parser.add_argument("--one-streaming", help=argparse.SUPPRESS)
  parser.add_argument("--layers", type=int, default=2, help=argparse.SUPPRESS)
  parser.add_argument("--one-staging", help=argparse.SUPPRESS)
  parser.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
  parser.add_argument("--one-setup", help=argparse.SUPPRESS)
  parser.add_argument("--one-step", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.one_setup:
    print(json.dumps(largest_fitting(args.one_setup, args.width, args.heads, args.target, args.max_layers,
                                     dict(seq_len=args.seq_len, batch=args.batch))))
    return None
  if args.one_step:
    print(json.dumps(step_figures(args.one_step, args.scale, args.target, args.inputs)))
    return None
  if args.one_capacity:
    print(json.dumps(capacity_figures(args.one_capacity, args.layers, args.target, args.devices)))
    return None
  if args.capacity_table:
    return dict(capacity=capacity_table(args))
  if args.one_streaming:
    print(json.dumps(streaming_figures(args.one_streaming, args.layers, args.target, args.moments)))
    return None
  if args.streaming_table:
    return dict(streaming=streaming_table(args))
  if args.one_staging:
    print(json.dumps(staging_figures(args.one_staging, args.dtype, args.target)))
    return None
  if args.staging_table:
    return dict(staging=staging_table(args))
  if args.quick:
    args.width, args.heads, args.seq_len, args.batch, args.max_layers = 256, 2, 128, 2, 2
    args.setups = "host"
    args.step_setups = "host bf16"
    args.scale = 0.01
    return dict(memory=memory_table(args), step=step_table(args))
  if args.step_table:
    return dict(step=step_table(args))
  return dict(memory=memory_table(args))


if __name__ == "__main__":
  main()
