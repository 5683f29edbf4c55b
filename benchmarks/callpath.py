"""Counts the optax_hybrid functions entered while one jitted step is traced.

How: ``sys.setprofile`` over one ``jax.jit(fn).trace(...)`` of a fresh
optimizer (``weight_decay=0.1``, ``state_memory_kind="pinned_host"``); every
"call" event whose code lives in the package counts. Printed: distinct
functions (named code objects: comprehensions and lambdas left out), distinct
code objects (all of them), the modules they are in, module switches
(consecutive package calls in different modules, lambdas and comprehensions
included), all package calls, and the deepest frame. ``--all`` runs the four
cases in one process in this order (the native library loads during the
second): the counts include what runs once per process. ``--climbs`` lists
the calls up the package's import graph (a module calling into one that
imports it, directly or not): a stage calling a value it was handed (a
kernel, a rule) shows there, and so would one climbing back for data.

  python benchmarks/callpath.py                       # tx.step, native kernel, one leaf
  python benchmarks/callpath.py --path update --kernel xla --leaves 2 --list
  python benchmarks/callpath.py --all                 # step and update, xla and native, two leaves;
                                                      # then optax.adamw's update (optax's own functions)
  python benchmarks/callpath.py --all --climbs        # and each case's calls up the import graph
"""
import argparse
import ast
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
import jax.numpy as jnp

import optax_hybrid


def count(path: str, kernel: str, leaves: int) -> dict:
  tree = {"w": jnp.ones((8, 8)), "b": jnp.zeros((8,))} if leaves == 2 else {"w": jnp.ones((8, 8))}
  params = jax.device_put(tree, jax.devices()[0])
  package = optax_hybrid
  if kernel == "optax":  # optax.adamw's update, counted in the optax package
    import optax
    package, tx = optax, optax.adamw(1e-3, weight_decay=0.1)
  else:
    tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, kernel=kernel, state_memory_kind="pinned_host")
  state = tx.init(params)
  fn, args = (tx.step, (params, state, params)) if path == "step" else (tx.update, (params, state, params))
  calls, edges = [], set()
  root = os.path.dirname(package.__file__)
  depth = [0]

  def prof(frame, event, arg):
    f = frame.f_code.co_filename
    if not f.startswith(root):
      return
    if event == "call":
      depth[0] += 1
      calls.append((os.path.relpath(f, root), frame.f_code.co_name, depth[0], frame.f_code.co_firstlineno))
      caller = frame.f_back  # the nearest package frame below this call
      while caller is not None and not caller.f_code.co_filename.startswith(root):
        caller = caller.f_back
      if caller is not None and caller.f_code.co_filename != f:
        edges.add((os.path.relpath(caller.f_code.co_filename, root), caller.f_code.co_name,
                   os.path.relpath(f, root), frame.f_code.co_name))
    elif event == "return":
      depth[0] -= 1

  sys.setprofile(prof)
  jax.jit(fn).trace(*args)
  sys.setprofile(None)
  seen = list(dict.fromkeys((m, f) for m, f, *_ in calls if not f.startswith("<")))
  code_objects = {(m, f, line) for m, f, _, line in calls}
  switches = sum(1 for a, b in zip(calls, calls[1:]) if a[0] != b[0])
  above = imported_by(root)  # read once: each module file's imports, parsed
  return {"functions": len(seen), "modules": len({m for m, _ in seen}), "switches": switches,
          "calls": len(calls), "depth": max(c[2] for c in calls), "code_objects": len(code_objects), "seen": seen,
          "climbs": sorted(e for e in edges if e[0] in above.get(e[2], ()))}


def imported_by(root: str) -> dict:
  """For each module file under ``root`` (its path there), the package's module files it imports, directly or not."""
  files = {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs if f.endswith(".py")}
  package = os.path.basename(root)
  as_file = lambda name: next((c for c in (name.replace(".", "/") + ".py", name.replace(".", "/") + "/__init__.py")
                               if c in files), None)
  direct = {}
  for rel in files:
    names = set()
    for node in ast.walk(ast.parse(open(os.path.join(root, rel)).read())):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
        names.update([node.module] + [f"{node.module}.{a.name}" for a in node.names])
      elif isinstance(node, ast.Import):
        names.update(a.name for a in node.names if a.name.split(".")[0] == package)
    direct[rel] = {f for f in (as_file(n.split(".", 1)[1]) for n in names if "." in n) if f and f != rel}
  closure = {}
  for rel in files:
    seen, todo = set(), list(direct[rel])
    while todo:
      f = todo.pop()
      if f not in seen:
        seen.add(f)
        todo.extend(direct.get(f, ()))
    closure[rel] = seen
  return closure


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--path", choices=("step", "update"), default="step")
  ap.add_argument("--kernel", choices=("xla", "native", "optax"), default="native",
                  help="optax: optax.adamw's update instead, counting the optax package's functions")
  ap.add_argument("--leaves", type=int, choices=(1, 2), default=1)
  ap.add_argument("--all", action="store_true", help="step and update, xla and native, 2 leaves: one table")
  ap.add_argument("--list", action="store_true", help="list the functions entered")
  ap.add_argument("--climbs", action="store_true", help="list the calls up the package's import graph")
  args = ap.parse_args()
  runs = ([(p, k, 2) for p in ("step", "update") for k in ("xla", "native")] + [("update", "optax", 2)] if args.all
          else [(args.path, args.kernel, args.leaves)])
  print("| path | kernel | leaves | functions | code objects | modules | module switches | calls | deepest frame |")
  print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
  for p, k, n in runs:
    r = count(p, k, n)
    print(f"| tx.{p} | {k} | {n} | {r['functions']} | {r['code_objects']} | {r['modules']} | {r['switches']} | {r['calls']} | {r['depth']} |")
    if args.list:
      for m, f in r["seen"]:
        print(f"  {m}:{f}")
    if args.climbs:
      print("  calls up the import graph: " + ("; ".join(f"{a}:{fa} -> {b}:{fb}" for a, fa, b, fb in r["climbs"])
                                               or "none"))


if __name__ == "__main__":
  main()
