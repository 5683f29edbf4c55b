"""Run by test_checkpoint.py in fresh processes: train / resume / a save killed midway / how a process ends."""

import argparse
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import optax_hybrid

SHAPES = {"w": (64, 33), "b": (33,), "s": ()}


def setup():
  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}
  params = jax.device_put(params, jax.devices()[0])
  sched = optax_hybrid.warmup_cosine_schedule(1e-2, total_steps=8, warmup_steps=2, eta_min=1e-3)
  tx = optax_hybrid.hybrid_adamw(sched, b2=0.95, weight_decay=0.1, state_memory_kind="pinned_host",
                                 skip_nonfinite=True)
  return params, tx


def grads_for(step):
  rng = np.random.default_rng(1000 + step)
  g = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
  if step == 2:
    g["w"][0, 0] = np.nan  # a skipped step inside the run: count and skipped must round-trip
  return g


def train(args):
  params, tx = setup()
  state = tx.init(params)

  def step_fn(p, s, g):
    u, s = tx.update(g, s, p)
    return optax_hybrid.apply_updates(p, u), s

  step_fn = jax.jit(step_fn, donate_argnums=(0, 1))
  manager = optax_hybrid.checkpoint.manager(args.dir)
  start = 0
  if args.resume:
    start = manager.latest_step()
    restored = optax_hybrid.checkpoint.restore(manager, like={"params": params, "opt": state})
    params, state = restored["params"], restored["opt"]
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves((state.mu, state.nu))}
    assert kinds == {"pinned_host"}, kinds
    assert state.count.sharding.memory_kind == "device"
    print(f"RESTORED step={start} count={int(state.count)} skipped={int(state.skipped)}")
  for step in range(start, args.steps):
    params, state = step_fn(params, state, grads_for(step))
    if step + 1 == args.save_at:
      optax_hybrid.checkpoint.save(manager, step + 1, {"params": params, "opt": state}, wait=True)
  leaves = jax.tree.leaves(jax.device_get({"params": params, "opt": state}))
  np.savez(args.out, *leaves)
  print(f"DONE count={int(state.count)} skipped={int(state.skipped)}")


def save_in_progress(directory, step):
  """Orbax's temporary directory of ``step``'s save, while that save has not finished."""
  return [n for n in os.listdir(directory) if n.startswith(str(step)) and "tmp" in n]


def kill_during_save(args):
  manager = optax_hybrid.checkpoint.manager(args.dir)
  small = {"x": jnp.arange(10.0)}
  optax_hybrid.checkpoint.save(manager, 1, small, wait=True)
  # Large enough that writing takes far longer than noticing it has started.
  big = {"x": jnp.ones((128, 1024, 1024), jnp.float32), "y": jnp.ones((64, 1024, 1024), jnp.float32)}
  optax_hybrid.checkpoint.save(manager, 2, big)
  # The save is asynchronous: its temporary directory appears a moment later.
  # Kill only once it exists, the state this run means to interrupt.
  deadline = time.monotonic() + 120
  while not save_in_progress(args.dir, 2):
    if time.monotonic() > deadline or os.path.isdir(os.path.join(args.dir, "2")):
      print(f"NO SAVE IN PROGRESS to kill: {sorted(os.listdir(args.dir))}", flush=True)
      sys.exit(3)
    time.sleep(0.001)
  print(f"KILLING during {save_in_progress(args.dir, 2)}", flush=True)
  os.kill(os.getpid(), signal.SIGKILL)


def cut_largest_array_file(step_dir):
  """Truncates to half its size the largest data file of a saved step (the array with most bytes); returns it.

  Orbax (OCDBT) keeps array chunks in files under directories named ``d``;
  values under 1 KiB are kept inline, so the array cut must be larger.
  """
  data = [os.path.join(root, name) for root, _, names in os.walk(step_dir) if os.path.basename(root) == "d"
          for name in names]
  path = max(data, key=os.path.getsize)
  os.truncate(path, os.path.getsize(path) // 2)
  return path


def fail_a_save(args):
  """A save into a directory that can no longer be written, not caught: the process must end with its error."""
  manager = optax_hybrid.checkpoint.manager(args.dir)
  optax_hybrid.checkpoint.save(manager, 1, {"x": jnp.arange(10.0)}, wait=True)
  if args.how == "read-only":
    os.chmod(args.dir, 0o555)
  else:  # not a directory any more, which stops root too
    os.rename(args.dir, args.dir + ".moved")
    open(args.dir, "w").close()
  print("SAVING into an unwritable directory", flush=True)
  optax_hybrid.checkpoint.save(manager, 2, {"x": jnp.ones(1000)}, wait=True)
  print("SAVED (unexpected)", flush=True)


def exit_while_saving(args):
  """Ends the program while an asynchronous save is still writing, without waiting for it or closing the manager."""
  manager = optax_hybrid.checkpoint.manager(args.dir)
  optax_hybrid.checkpoint.save(manager, 1, {"x": jnp.full((32, 1024, 1024), 3.0, jnp.float32)})
  print(f"EXITING saving={manager.is_saving_in_progress()}", flush=True)


if __name__ == "__main__":
  parser = argparse.ArgumentParser()
  parser.add_argument("mode", choices=["train", "kill", "fail-save", "exit-while-saving"])
  parser.add_argument("--how", choices=["read-only", "not-a-directory"], default="not-a-directory")
  parser.add_argument("--dir", required=True)
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--save-at", type=int, default=-1)
  parser.add_argument("--resume", action="store_true")
  parser.add_argument("--out", default=os.devnull)
  args = parser.parse_args()
  {"train": train, "kill": kill_during_save, "fail-save": fail_a_save, "exit-while-saving": exit_while_saving}[
      args.mode](args)
