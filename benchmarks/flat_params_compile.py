"""The first training step's time (trace, compile, run) with flat params against the tree, on a Flax NNX model.

A model of ``--depth`` residual blocks (``nnx.LayerNorm`` then ``nnx.Linear``
of width ``--width``: 4 leaves a block, 120 at depth 30), one jitted step of
``hybrid_adamw``'s ``tx.step`` under ``jax.value_and_grad``, in four layouts:

* ``tree``: the ``nnx.State`` of the params, as ``nnx.split`` gives it;
* ``flat``: the same state through ``optax_hybrid.flatten_params``, the model
  merged from ``flat.as_tree()`` in the loss;
* ``stacked tree``: the blocks made by ``nnx.vmap`` (each leaf stacked on a
  leading axis of ``depth``), run by ``optax_hybrid.scan_layers``;
* ``stacked flat``: those stacked params through
  ``flatten_params(..., stacked=True)``, one row per block.

Each layout runs ``--repeats`` times, each in a fresh process (nothing
cached), and prints the range of each phase. ``--cause`` instead compiles
``leaf * 2`` over 120 leaves of 4096 floats three ways: a tree of equal
shapes, a tree of 120 distinct shapes, and flat params (one buffer, 120
views): what a program of many distinct kernels costs XLA:CPU to compile. Run::

  PYTHONPATH=. python benchmarks/flat_params_compile.py --depth 30 --width 256 --repeats 3
  PYTHONPATH=. python benchmarks/flat_params_compile.py --cause
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

LAYOUTS = ("tree", "flat", "stacked tree", "stacked flat")


def measure(layout: str, depth: int, width: int) -> dict:
  """One process's first step in ``layout``: seconds to trace and lower, to compile, to run; and the leaf count."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import optax_hybrid

  class Block(nnx.Module):

    def __init__(self, d, rngs):
      self.norm = nnx.LayerNorm(d, rngs=rngs)
      self.linear = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
      return x + jnp.tanh(self.linear(self.norm(x)))

  stacked = layout.startswith("stacked")
  if stacked:
    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Block(width, rngs)

    graphdef, params = nnx.split(make(nnx.Rngs(0)), nnx.Param)
  else:
    graphdef, params = nnx.split(nnx.List([Block(width, nnx.Rngs(i)) for i in range(depth)]), nnx.Param)
  leaves = len(jax.tree.leaves(params))
  flat = layout.endswith("flat")
  if flat:
    params = optax_hybrid.flatten_params(params, stacked=stacked)
  tree_of = (lambda p: p.as_tree()) if flat else (lambda p: p)

  def loss_fn(p, x):
    if stacked:
      x = optax_hybrid.scan_layers(lambda c, layer: nnx.merge(graphdef, tree_of(layer))(c), x, p)
    else:
      for block in nnx.merge(graphdef, tree_of(p)):
        x = block(x)
    return jnp.mean(x ** 2)

  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1)

  def train_step(p, state, x):
    loss, grads = jax.value_and_grad(loss_fn)(p, x)
    p, state = tx.step(p, state, grads)
    return p, state, loss

  params = optax_hybrid.commit(params)
  state = optax_hybrid.commit(tx.init(params))
  x = jnp.ones((8, width))
  t0 = time.perf_counter()
  lowered = jax.jit(train_step, donate_argnums=(0, 1)).lower(params, state, x)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  jax.block_until_ready(compiled(params, state, x))
  t3 = time.perf_counter()
  return {"layout": layout, "leaves": leaves, "lower": t1 - t0, "compile": t2 - t1, "run": t3 - t2,
          "first_step": t3 - t0}


def cause(n: int = 120, size: int = 4096) -> None:
  """Compile seconds of ``leaf * 2`` over ``n`` leaves: equal shapes, distinct shapes, flat views."""
  import jax
  import jax.numpy as jnp

  import optax_hybrid

  double = lambda tree: jax.tree.map(lambda leaf: leaf * 2, tree)
  flat = optax_hybrid.flatten_params([jnp.ones(size) for _ in range(n)])
  cases = {"tree, equal shapes": ([jnp.ones(size) for _ in range(n)], double),
           "tree, distinct shapes": ([jnp.ones(size + i) for i in range(n)], double),
           "flat (views at distinct offsets)": (flat, lambda f: double(f.as_tree()))}
  for name, (tree, fn) in cases.items():
    start = time.perf_counter()
    jax.jit(fn).lower(tree).compile()
    print(f"{name:<34} compile {time.perf_counter() - start:.2f} s", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--depth", type=int, default=30)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of: " + ", ".join(LAYOUTS))
  parser.add_argument("--cause", action="store_true", help="time the compile of many distinct kernels instead")
  parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: measure this layout once
  args = parser.parse_args()
  if args.cause:
    cause()
    return
  if args.one:
    print(json.dumps(measure(args.one, args.depth, args.width)))
    return
  print(f"jax {__import__('jax').__version__}, {os.cpu_count()} CPUs, depth {args.depth}, width {args.width}")
  print(f"{'layout':<14}{'leaves':>7}  {'trace+lower s':>14}  {'compile s':>11}  {'first run s':>12}  {'first step s':>13}")
  for layout in args.layouts.split(","):
    runs = []
    for _ in range(args.repeats):
      out = subprocess.run([sys.executable, __file__, "--depth", str(args.depth), "--width", str(args.width),
                            "--one", layout], capture_output=True, text=True, check=True)
      runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    span = lambda key: f"{min(r[key] for r in runs):.2f}-{max(r[key] for r in runs):.2f}"
    print(f"{layout:<14}{runs[0]['leaves']:>7}  {span('lower'):>14}  {span('compile'):>11}  {span('run'):>12}  "
          f"{span('first_step'):>13}", flush=True)


if __name__ == "__main__":
  main()
