"""Hashes of the StableHLO that hybrid_adamw's steps lower to, for comparing two checkouts of the package.

    PYTHONPATH=<checkout> JAX_PLATFORMS=cpu python benchmarks/same_program.py

One line per combination (tier, kernel, dtype, path, moment format): the
SHA-256 of the lowered program's text with its source locations removed (they
name files and lines, which a refactoring moves) and its line count. Equal
hashes from two checkouts mean the same program, so the same compile and step;
run each checkout's own copy of this file or the same one. GPT-2-small shapes
x0.05 (3.1M params, 148 leaves), ``weight_decay=0.1``, ``skip_nonfinite=True``;
bf16 params with an fp32 master and moments.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import optax_hybrid  # noqa: E402
from optax_hybrid.kernels import lowering_for  # noqa: E402
from step import gpt2_small_shapes  # noqa: E402

COMBINATIONS = [  # (tier, kernel, dtype, path, moment_format, lowered for)
    ("device", "native", "float32", "step", None, "cpu"),
    ("device", "xla", "float32", "update", None, "cpu"),
    ("device", "xla", "bfloat16", "step", None, "cpu"),
    ("host_state", "native", "float32", "step", "8bit", "cpu"),
    ("host_state", "xla", "bfloat16", "step", None, "cpu"),
    ("host", "native", "float32", "step", None, "cpu"),
    ("host", "xla", "bfloat16", "update", None, "cpu"),
    ("device", "pallas", "float32", "step", "8bit", "cuda"),
    ("host_state", "auto", "bfloat16", "step", None, "cuda"),
]


def lowered_text(tier, kernel, dtype, path, moment_format, platform) -> str:
  params = jax.device_put({k: jnp.full(s, 0.5, dtype) for k, s in gpt2_small_shapes(0.05).items()}, jax.devices()[0])
  kw = dict(master_dtype=jnp.float32) if dtype == "bfloat16" else {}
  kw.update(moment_format=moment_format) if moment_format else kw.update(
      mu_dtype=jnp.float32, nu_dtype=jnp.float32)
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, tiers=tier, kernel=kernel, skip_nonfinite=True, **kw)
  state = tx.init(params)
  with lowering_for(platform):
    lowered = jax.jit(tx.step if path == "step" else tx.update).trace(params, state, params).lower(
        lowering_platforms=(platform,))
  return re.sub(r"#loc\d*|loc\([^)]*\)", "", lowered.as_text())


def main():
  for combo in COMBINATIONS:
    text = lowered_text(*combo)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    print(f"{' '.join(str(x) for x in combo):50s} {digest} {len(text.splitlines()):7d} lines", flush=True)


if __name__ == "__main__":
  main()
