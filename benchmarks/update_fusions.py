"""The loops XLA:CPU compiles an AdamW update + ``apply_updates`` into, and the bytes per param they move.

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/update_fusions.py

For ``optax.adamw`` and ``hybrid_adamw`` (XLA rule) on one float32 leaf of 16M
(what flat params give a many-leaf model), jitted with the params and state
donated: each fusion over the whole leaf, its operands and result, and the
streams of 4 bytes per param they read and write in all. A one-pass step
(the native kernel's ``tx.step``, torch's fused AdamW) moves 7: read p, g,
m, v; write m, v, p (docs/records/benchmarks.md).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax

import optax_hybrid

N = 1 << 24


def main():
  params, grads = {"w": jnp.ones((N,), jnp.float32)}, {"w": jnp.full((N,), 0.5, jnp.float32)}
  for name, tx in (("optax.adamw", optax.adamw(1e-3, weight_decay=0.1)),
                   ("hybrid_adamw, kernel='xla'", optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, kernel="xla"))):
    def update_and_apply(p, s, g, tx=tx):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s
    text = jax.jit(update_and_apply, donate_argnums=(0, 1)).lower(params, tx.init(params), grads).compile().as_text()
    shapes = dict(re.findall(r"%(\S+) = (\S+\[[\d,]*\])", text))
    streams = 0
    print(f"{name}:")
    for line in text.splitlines():
      match = re.match(rf"\s*%(\S+) = f32\[{N}\]\S* fusion\((.*?)\), kind", line)
      if match:
        whole = [o for o in match.group(2).split(", ") if shapes.get(o.lstrip("%")) == f"f32[{N}]"]
        streams += len(whole) + 1
        print(f"  {match.group(1)}: reads {len(whole)} leaf-sized operands, writes 1")
    print(f"  streams: {streams} ({4 * streams} bytes per param)")


if __name__ == "__main__":
  main()
