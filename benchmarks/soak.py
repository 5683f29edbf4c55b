"""Crash-loop soak: a checkpointed training run killed with SIGKILL, restarted until it finishes.

    python benchmarks/soak.py                      # 3 setups, 12 kills each, 200 steps, a save every 10
    python benchmarks/soak.py --quick              # CI's version (tests/test_soak.py): 1 setup, 2 kills, 30 steps
    python benchmarks/soak.py --setups bf16-every-tier-8bit --kills 20 --seed 3

A small MLP (32 -> 256 -> 256 -> 16, real gradients of a regression loss) is
trained by ``hybrid_adamw`` with ``skip_nonfinite=True``, NaN batches at four
steps, and asynchronous ``optax_hybrid.checkpoint`` saves. Each restart
resumes from the latest checkpoint (``restore(..., skip_unreadable=True)``).
Each kill has a step drawn uniformly over the run (sorted, so the run moves
on between kills). Half the kills are random: one in four at a time drawn
within the uninterrupted run's start-up (imports, compilation, restore), the
others when the worker reports that step (or the one after its resume). The
other half are aimed at saves: the driver watches the checkpoint directory
and kills the worker when the temporary directory of its save of the first
checkpoint step at or after that step appears (up to
``--save-kill-delay-ms`` later), while the save still writes its 32 MB of
incompressible ballast. Whether each kill caught a save of its run
unfinished is checked (its temporary directory is still there after the
kill) and counted.

Checked, per setup: the final state (params, moments with 8-bit codes and
scales, masters, count, skipped; disk-tier moments read from their files) is
bit-identical to one uninterrupted run's; after every kill and at the end,
the disk tier's directory and the workers' ``TMPDIR`` hold nothing; at the
end the checkpoint directory holds no temporary or set-aside directory.
Exits 1 if any check fails. Figures: docs/records/testing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

TIER_TREE = {"w1": "host_state", "b1": "device", "w2": "disk", "b2": "disk", "w3": "host", "b3": "host"}
SETUPS = {
    "fp32-host_state": dict(dtype="float32", options=dict(tiers="host_state")),
    # Every tier, 8-bit moments on the three weights (>= 4096 values), bf16 params with fp32 masters.
    "bf16-every-tier-8bit": dict(dtype="bfloat16", options=dict(tiers=TIER_TREE, master_dtype="float32",
                                                                 moment_format="8bit")),
    "fp32-nvme-0.5": dict(dtype="float32", options=dict(nvme_offload_fraction=0.5)),
}
SHAPES = {"w1": (32, 256), "b1": (256,), "w2": (256, 256), "b2": (256,), "w3": (256, 16), "b3": (16,)}
TMP_MARK = ".orbax-checkpoint-tmp"


# --- the worker: trains from the latest checkpoint to --steps ---

def worker(args) -> None:
  sys.path.insert(0, ROOT)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax_hybrid

  setup = SETUPS[args.setup]
  dtype = jnp.dtype(setup["dtype"])
  rng = np.random.default_rng(0)
  params = jax.device_put({k: jnp.asarray(rng.normal(size=s) / np.sqrt(s[0] if len(s) == 2 else 1) * 0.5, dtype)
                           for k, s in SHAPES.items()}, jax.devices()[0])
  teacher = rng.normal(size=(32, 16)).astype(np.float32)
  nan_steps = {args.steps * k // 8 + 1 for k in (1, 3, 5, 7)}  # four skipped steps
  ballast = jnp.asarray(rng.integers(0, 2**32, size=args.ballast_mb << 18, dtype=np.uint32))
  options = {k: (jnp.dtype(v) if k == "master_dtype" else v) for k, v in setup["options"].items()}
  tx = optax_hybrid.hybrid_adamw(1e-2, b2=0.95, weight_decay=0.1, skip_nonfinite=True,
                                 nvme_offload_dir=args.nvme, **options)

  def batch(step):
    r = np.random.default_rng(1000 + step)
    x = r.normal(size=(64, 32)).astype(np.float32)
    y = np.tanh(x @ teacher)
    if step in nan_steps:
      x[0, 0] = np.nan
    return jnp.asarray(x, dtype), jnp.asarray(y, dtype)

  def loss(p, x, y):
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])
    h = jax.nn.gelu(h @ p["w2"] + p["b2"])
    return jnp.mean(((h @ p["w3"] + p["b3"]).astype(jnp.float32) - y.astype(jnp.float32)) ** 2)

  step_fn = jax.jit(lambda p, s, x, y: tx.step(p, s, jax.grad(loss)(p, x, y)), donate_argnums=(0, 1))
  state = tx.init(params)
  with optax_hybrid.checkpoint.manager(args.dir) as manager:
    start = 0
    if manager.latest_step() is not None:
      like = {"params": params, "opt": state, "ballast": ballast}
      restored = optax_hybrid.checkpoint.restore(manager, like, skip_unreadable=True)
      params, state, start = restored["params"], restored["opt"], manager.latest_step()
    print(f"RESUMED {start}", flush=True)
    for step in range(start, args.steps):
      params, state = step_fn(params, state, *batch(step))
      print(f"STEP {step + 1}", flush=True)
      if (step + 1) % args.every == 0:
        optax_hybrid.checkpoint.save(manager, step + 1, {"params": params, "opt": state, "ballast": ballast},
                                     wait=step + 1 == args.steps)
  final = {f"params/{k}": v for k, v in params.items()}
  for field in ("mu", "nu", "mu_scales", "nu_scales", "master"):
    if getattr(state, field) is None:
      continue
    files = optax_hybrid.disk.files_of(state, field) if field != "master" else {k: None for k in SHAPES}
    for k, value in getattr(state, field).items():
      final[f"{field}/{k}"] = optax_hybrid.disk.read(files[k]) if files[k] is not None else value
  final.update(count=state.count, skipped=state.skipped)
  np.savez(args.out, **{k: np.asarray(jax.device_get(v)) for k, v in final.items()})
  print(f"DONE count={int(state.count)} skipped={int(state.skipped)}", flush=True)
  tx.close()


# --- the driver ---

class Worker:
  """A worker process; its output lines are read as they come (a thread), so a kill can be aimed at a step."""

  def __init__(self, setup: str, run_dir: str, args, out: str, log: str):
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=os.path.join(run_dir, "tmp"))
    command = [sys.executable, os.path.abspath(__file__), "worker", "--setup", setup, "--dir",
               os.path.join(run_dir, "ckpt"), "--nvme", os.path.join(run_dir, "nvme"), "--out", out,
               "--steps", str(args.steps), "--every", str(args.every), "--ballast-mb", str(args.ballast_mb)]
    self.started = time.monotonic()
    self.log = log
    with open(log, "w") as stderr:
      self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    self.lines: list = []
    self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
    self._reader.start()

  def alive(self) -> bool:
    return self.proc.poll() is None

  def resumed(self) -> int | None:
    found = [int(line.split()[1]) for line in list(self.lines) if line.startswith("RESUMED ")]
    return found[0] if found else None

  def steps_done(self) -> int:
    found = [int(line.split()[1]) for line in list(self.lines) if line.startswith("STEP ")]
    return found[-1] if found else -1

  def kill(self) -> None:
    self.proc.send_signal(signal.SIGKILL)

  def finish(self) -> int:
    self.proc.wait()
    self._reader.join()
    return self.proc.returncode

  def errors(self) -> str:
    with open(self.log) as f:
      return f.read()[-2000:]


def saves_in_progress(ckpt: str) -> set:
  """The temporary directories of unfinished saves, as (name, inode): a step saved again is a new directory."""
  found = set()
  for name in os.listdir(ckpt):
    if TMP_MARK in name:
      try:
        found.add((name, os.stat(os.path.join(ckpt, name)).st_ino))
      except FileNotFoundError:  # finished (renamed) or removed meanwhile
        pass
  return found


def wait_for_resume(worker: Worker) -> int | None:
  """The step ``worker`` resumed from, once it says; None if it ended first."""
  while worker.alive() and worker.resumed() is None:
    time.sleep(0.001)
  return worker.resumed()


def kill_at_a_save(worker: Worker, ckpt: str, args, planned: int, delay_s: float) -> str | None:
  """Kills ``worker`` ``delay_s`` after the temporary directory of its save of the first step >= ``planned`` appears.

  Returns where it was killed, or None if it ended first.
  """
  resumed = wait_for_resume(worker)
  if resumed is None:
    return None
  step = min(max(-(-planned // args.every), resumed // args.every + 1) * args.every, args.steps)
  while worker.alive():
    if any(name.split(".")[0] == str(step) for name, _ in saves_in_progress(ckpt)):
      time.sleep(delay_s)
      worker.kill()
      return f"save of step {step}"
    time.sleep(0.0005)
  return None


def kill_at_random(worker: Worker, args, rng: random.Random, planned: int, startup_s: float) -> str | None:
  """Kills ``worker`` in one case of four at a time drawn within the reference's start-up, else at step ``planned``.

  (At the step after the one it resumed from, if that is later.) Returns where, or None if it ended first.
  """
  if rng.random() < 0.25:
    deadline = worker.started + rng.uniform(0, startup_s)
    while worker.alive() and time.monotonic() < deadline:
      time.sleep(0.001)
    where = "start-up" if worker.resumed() is None else f"step {worker.steps_done() + 1}"
  else:
    resumed = wait_for_resume(worker)
    if resumed is None:
      return None
    target = max(planned, resumed + 1)
    while worker.alive() and worker.steps_done() < target:
      time.sleep(0.0005)
    where = f"step {target}"
  if not worker.alive():
    return None
  worker.kill()
  return where


def leftovers(run_dir: str) -> list:
  return [os.path.join(d, n) for d in ("nvme", "tmp") for n in os.listdir(os.path.join(run_dir, d))]


def soak(setup: str, args, root: str, rng: random.Random) -> dict:
  """One setup: the uninterrupted reference, ``args.kills`` killed runs, the final run; its figures and checks."""
  result = dict(setup=setup, kills=0, kills_at_saves=0, saves_caught_unfinished=0, killed_at=[], resumed_from=[],
                leftovers_after_kills=[], failures=[])
  runs = {}
  for name in ("reference", "soak"):
    runs[name] = os.path.join(root, setup, name)
    for d in ("ckpt", "nvme", "tmp"):
      os.makedirs(os.path.join(runs[name], d))
  logs = iter(os.path.join(root, setup, f"worker_{i}.log") for i in range(10**6))
  reference = Worker(setup, runs["reference"], args, os.path.join(root, setup, "reference.npz"), next(logs))
  while reference.alive() and reference.resumed() is None:
    time.sleep(0.001)
  startup_s = time.monotonic() - reference.started
  if reference.finish() != 0:
    result["failures"].append(f"the uninterrupted run failed: {reference.errors()}")
    return result
  result["reference_s"] = round(time.monotonic() - reference.started, 1)
  # The kills, in run order: each at a step drawn over the run (sorted), half of them at the save after it.
  modes = ["save", "random"] * (args.kills // 2) + ["random"] * (args.kills % 2)
  if not args.quick:
    rng.shuffle(modes)
  planned = sorted(rng.randint(1, args.steps - 1) for _ in modes)
  final_out = os.path.join(root, setup, "soak.npz")
  ckpt = os.path.join(runs["soak"], "ckpt")
  began = time.monotonic()
  for mode, step in zip(modes + ["none"], planned + [args.steps]):
    before = saves_in_progress(ckpt)
    worker = Worker(setup, runs["soak"], args, final_out, next(logs))
    if mode == "save":
      where = kill_at_a_save(worker, ckpt, args, step, delay_s=rng.uniform(0, args.save_kill_delay_ms / 1e3))
    elif mode == "random":
      where = kill_at_random(worker, args, rng, step, startup_s)
    else:
      where = None
    rc = worker.finish()
    if worker.resumed() is not None:
      result["resumed_from"].append(worker.resumed())
    if where is None:  # it ran to the end
      if rc != 0:
        result["failures"].append(f"a run to the end failed: {worker.errors()}")
      break
    result["kills"] += 1
    result["kills_at_saves"] += mode == "save"
    caught = bool(saves_in_progress(ckpt) - before)  # a save of this run, unfinished
    result["saves_caught_unfinished"] += caught
    result["killed_at"].append(where + (" (a save unfinished)" if caught and mode != "save" else ""))
    left = leftovers(runs["soak"])
    result["leftovers_after_kills"].append(len(left))
    if left:
      result["failures"].append(f"after a kill at {where}: {left}")
  result["soak_s"] = round(time.monotonic() - began, 1)
  result.update(compare(os.path.join(root, setup, "reference.npz"), final_out))
  result["failures"] += result.pop("differences")
  stray = [n for n in os.listdir(ckpt) if not n.isdigit()]
  result["checkpoint_dir_strays"] = stray
  if stray or leftovers(runs["soak"]):
    result["failures"].append(f"left at the end: {stray + leftovers(runs['soak'])}")
  return result


def compare(reference: str, final: str) -> dict:
  import numpy as np
  if not os.path.exists(final):
    return dict(arrays_compared=0, bit_exact=False, differences=["no final state"])
  with np.load(reference) as a, np.load(final) as b:
    differences = [k for k in sorted(set(a.files) | set(b.files))
                   if k not in a.files or k not in b.files or a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
                   or a[k].tobytes() != b[k].tobytes()]
    return dict(arrays_compared=len(a.files), bit_exact=not differences,
                differences=[f"differs from the uninterrupted run: {k}" for k in differences])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("mode", nargs="?", default="soak", choices=["soak", "worker"])
  parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated subset of: " + ", ".join(SETUPS))
  parser.add_argument("--kills", type=int, default=12, help="kills per setup, half of them at saves")
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--every", type=int, default=10, help="save every this many steps")
  parser.add_argument("--ballast-mb", type=int, default=32, help="incompressible bytes saved with each checkpoint")
  parser.add_argument("--save-kill-delay-ms", type=float, default=20,
                      help="a kill aimed at a save lands up to this long after its temporary directory appears")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quick", action="store_true",
                      help="1 setup (every tier, 8-bit), 30 steps: a kill at a save, then a random one")
  parser.add_argument("--json", help="also write the figures here")
  # worker arguments
  parser.add_argument("--setup", choices=list(SETUPS))
  parser.add_argument("--dir")
  parser.add_argument("--nvme")
  parser.add_argument("--out")
  args = parser.parse_args(argv)
  if args.mode == "worker":
    worker(args)
    return 0
  if args.quick:
    args.setups, args.kills, args.steps, args.every, args.ballast_mb = "bf16-every-tier-8bit", 2, 30, 5, 16
    args.save_kill_delay_ms = 0
  rng = random.Random(args.seed)
  results = []
  with tempfile.TemporaryDirectory(prefix="optax_hybrid_soak_") as root:
    for setup in args.setups.split(","):
      results.append(soak(setup, args, root, rng))
      r = results[-1]
      print(f"{setup}: {r['kills']} kills ({r['kills_at_saves']} aimed at saves, {r['saves_caught_unfinished']} "
            f"caught a save unfinished), resumed from steps {r['resumed_from']}; {r.get('arrays_compared', 0)} "
            f"arrays {'bit-identical' if r.get('bit_exact') else 'DIFFERENT'} to the uninterrupted run; "
            f"killed at {r['killed_at']}; "
            f"leftovers after each kill {r['leftovers_after_kills']}, strays at the end "
            f"{r.get('checkpoint_dir_strays')}; {r.get('soak_s')} s (uninterrupted run {r.get('reference_s')} s)",
            flush=True)
      for failure in r["failures"]:
        print(f"  FAIL {failure}", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return 1 if any(r["failures"] for r in results) else 0


if __name__ == "__main__":
  sys.exit(main())
