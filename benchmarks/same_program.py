"""Hashes of the StableHLO that the package's steps lower to, for comparing two checkouts of the package.

    PYTHONPATH=<checkout> JAX_PLATFORMS=cpu python benchmarks/same_program.py [--ops] [K ...]

One line per combination (tier, kernel, dtype, path, moment format, lowered
for, master, rule): the SHA-256 of the lowered program's text with its source
locations removed (they name files and lines, which a refactoring moves) and
its line count (the module's name, the jitted function's, is left out too).
Equal hashes from two checkouts mean the same program, so the
same compile and step; run each checkout's own copy of this file or the same
one. ``--ops`` hashes the program's lines with every value named alike, sorted:
equal for the same operations in another order (independent operations of a
loop body traced in another order); ``K``: only those combinations. Locations are also left out of the Pallas kernels' Triton IR
(``JAX_TRACEBACK_IN_LOCATIONS_LIMIT=0``), so the programs lowered for CUDA
compare too. The optimizer steps: GPT-2-small shapes x0.05 (3.1M params, 148 leaves),
``weight_decay=0.1``, ``skip_nonfinite=True`` (but for ``backward``); bf16
params with the master format named (``float32``: ``master_dtype=float32``)
and float32 moments unless a moment format is named. ``backward``:
``step_in_backward``'s train step of a small stacked model (4 layers in host
memory, ``tiers="host_state"``, a weight every layer reads, per-layer
inputs); ``scan``: ``jax.value_and_grad`` of the same model run by
``scan_layers`` (per-layer inputs and shared weights taking gradients).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No source locations in the programs: a Pallas kernel's Triton IR, a serialized blob the regex below cannot reach,
# names each file and line it was traced from, which differ between two checkouts (their paths) and a refactoring.
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import optax_hybrid  # noqa: E402
from optax_hybrid.kernels import lowering_for  # noqa: E402
from step import gpt2_small_shapes  # noqa: E402

# (tier, kernel, dtype, path, moment_format, lowered for, master, rule)
COMBINATIONS = [
    ("device", "native", "float32", "step", None, "cpu", None, "adamw"),
    ("device", "xla", "float32", "update", None, "cpu", None, "adamw"),
    ("device", "xla", "bfloat16", "step", None, "cpu", "float32", "adamw"),
    ("host_state", "native", "float32", "step", "8bit", "cpu", None, "adamw"),
    ("host_state", "xla", "bfloat16", "step", None, "cpu", "float32", "adamw"),
    ("host", "native", "float32", "step", None, "cpu", None, "adamw"),
    ("host", "xla", "bfloat16", "update", None, "cpu", "float32", "adamw"),
    ("device", "pallas", "float32", "step", "8bit", "cuda", None, "adamw"),
    ("host_state", "auto", "bfloat16", "step", None, "cuda", "float32", "adamw"),
    # master formats, moment dtypes, the disk tier, the other rules
    ("device", "xla", "bfloat16", "step", None, "cpu", "kahan", "adamw"),
    ("device", "native", "bfloat16", "update", None, "cpu", "stochastic", "adamw"),
    ("host_state", "native", "bfloat16", "step", "bfloat16", "cpu", "kahan", "adamw"),
    ("host", "auto", "bfloat16", "step", "8bit", "cpu", "stochastic", "adamw"),
    ("device", "pallas", "bfloat16", "step", None, "cuda", "kahan", "adamw"),
    ("host_state", "pallas", "bfloat16", "update", None, "cuda", "stochastic", "adamw"),
    ("disk", "auto", "float32", "step", None, "cpu", None, "adamw"),
    ("device", "xla", "bfloat16", "update", "bfloat16", "cpu", None, "lion"),
    ("host_state", "pallas", "float32", "step", "8bit", "cuda", None, "adagrad"),
    ("host", "auto", "bfloat16", "step", None, "cpu", "float32", "sgd"),
    # streamed layers
    ("host_state", "auto", "float32", "backward", None, "cpu", None, "adamw"),
    ("host_state", "auto", "bfloat16", "backward", "8bit", "cpu", "stochastic", "adamw"),
    ("host_state", "pallas", "bfloat16", "backward", None, "cuda", "kahan", "adamw"),
    ("device", "auto", "float32", "scan", None, "cpu", None, None),
]


def optimizer(tier, kernel, dtype, moment_format, master, rule, **extra):
  kw = dict(extra)
  if master == "float32":
    kw.update(master_dtype=jnp.float32)
  elif master is not None:
    kw.update(master=master)
  if moment_format:
    kw.update(moment_format=moment_format)
  elif rule in ("adamw",):
    kw.update(mu_dtype=jnp.float32, nu_dtype=jnp.float32)
  if rule == "adamw":
    return optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, tiers=tier, kernel=kernel, **kw)
  if rule == "lion":
    return optax_hybrid.hybrid_lion(1e-4, weight_decay=0.1, tiers=tier, kernel=kernel, **kw)
  if rule == "adagrad":
    return optax_hybrid.hybrid_adagrad(1e-2, tiers=tier, kernel=kernel, **kw)
  return optax_hybrid.hybrid_sgd(1e-2, momentum=0.9, nesterov=True, tiers=tier, kernel=kernel, **kw)


L, D, V, B = 4, 256, 11, 6


def stacked_model(dtype):
  """A small stacked model: its params (layers in host memory), batch and functions."""
  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  k = jax.random.split(jax.random.key(0), 4)
  stack = {"w": jax.random.normal(k[0], (L, D, D)) * 0.1, "b": jax.random.normal(k[1], (L, D)) * 0.1}
  params = {"embed": jax.random.normal(k[2], (V, D)), "head": jax.random.normal(k[3], (D, V)) * 0.1,
            "layers": jax.device_put(jax.tree.map(lambda a: a.astype(dtype), stack), host),
            "scale": jnp.linspace(0.8, 1.2, D)}
  params = {k: jax.tree.map(lambda a: a.astype(dtype), v) for k, v in params.items()}
  batch = {"inputs": jnp.arange(B) % V, "targets": (jnp.arange(B) + 1) % V, "noise": jnp.ones((L, D), dtype)}
  embed = lambda rest, b: rest["embed"][b["inputs"]]
  layer = lambda x, p, n, rest, b: x + jnp.tanh((x @ p["w"] + p["b"]) * rest["scale"] * n).astype(x.dtype)
  head = lambda rest, x, b: jnp.mean(((x @ rest["head"]).astype(jnp.float32)) ** 2)
  return params, batch, embed, layer, head


def lowered_text(tier, kernel, dtype, path, moment_format, platform, master, rule) -> str:
  if path in ("backward", "scan"):
    params, batch, embed, layer, head = stacked_model(getattr(jnp, dtype))
    if path == "scan":
      def loss(params, batch):
        rest = {k: v for k, v in params.items() if k != "layers"}
        x = optax_hybrid.scan_layers(layer, embed(rest, batch), params["layers"], batch["noise"], args=(rest, batch))
        return head(rest, x, batch)
      fn, args = jax.value_and_grad(loss), (params, batch)
    else:
      tx = optimizer(tier, kernel, dtype, moment_format, master, rule)
      fn = optax_hybrid.step_in_backward(tx, embed, layer, head, xs=lambda rest, b: b["noise"])
      args = (params, tx.init(params), batch)
  else:
    params = jax.device_put({k: jnp.full(s, 0.5, dtype) for k, s in gpt2_small_shapes(0.05).items()},
                            jax.devices()[0])
    tx = optimizer(tier, kernel, dtype, moment_format, master, rule, skip_nonfinite=True)
    fn, args = (tx.step if path == "step" else tx.update), (params, tx.init(params), params)
  with lowering_for(platform):
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
  # The module's name is the jitted Python function's (jit_update_fn for a closure, jit_update for a method):
  # a name a refactoring may change, as it moves source locations, with the program the same.
  text = re.sub(r"^module @jit_\w+", "module @jit_fn", lowered.as_text(), count=1)
  return re.sub(r"#loc\d*|loc\([^)]*\)", "", text)


def operations(text: str) -> str:
  """The program's lines with every value named alike and sorted: equal for the same operations in another order."""
  return "\n".join(sorted(re.sub(r"%[\w#.:]+", "%", line).strip() for line in text.splitlines()))


def main():
  args = sys.argv[1:]
  ops = "--ops" in args  # compare the operations, not their order (a loop body's independent ops reordered)
  only = [a for a in args if a != "--ops"]
  for k, combo in enumerate(COMBINATIONS):
    if only and str(k) not in only:
      continue
    text = lowered_text(*combo)
    digest = hashlib.sha256((operations(text) if ops else text).encode()).hexdigest()[:16]
    print(f"{k:2d} {' '.join(str(x) for x in combo):68s} {digest} {len(text.splitlines()):7d} lines", flush=True)


if __name__ == "__main__":
  main()
