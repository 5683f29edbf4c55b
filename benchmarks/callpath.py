"""Counts the optax_hybrid functions a leaf passes through while tx.step is traced (native kernel, host_state)."""
import os, sys
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, jax.numpy as jnp
import optax_hybrid
params = jax.device_put({"w": jnp.ones((8, 8))}, jax.devices()[0])
tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, kernel="native", state_memory_kind="pinned_host")
state = tx.init(params)
calls = []
root = os.path.dirname(optax_hybrid.__file__)
depth = [0]
def prof(frame, event, arg):
  f = frame.f_code.co_filename
  if not f.startswith(root):
    return
  if event == "call":
    depth[0] += 1
    calls.append((os.path.relpath(f, root), frame.f_code.co_name, depth[0]))
  elif event == "return":
    depth[0] -= 1
sys.setprofile(prof)
jax.jit(tx.step).trace(params, state, params)
sys.setprofile(None)
seen = []
for mod, fn, d in calls:
  if (mod, fn) not in seen and not fn.startswith("<"):
    seen.append((mod, fn))
mods = [m for m, _, _ in calls if True]
switches = sum(1 for a, b in zip(calls, calls[1:]) if a[0] != b[0])
print(f"functions {len(seen)}, modules {len({m for m, _ in seen})}, module switches {switches}, max depth {max(d for *_, d in calls)}")
for m, f in seen:
  print(f"  {m}:{f}")
