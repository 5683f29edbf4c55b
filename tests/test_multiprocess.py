"""Two JAX processes on loopback train together and match a single-device Optax run.

``multiprocess_script.py`` is started twice, as a multi-host job would start it
on two hosts: each process joins through ``jax.distributed.initialize`` (CPU
collectives over Gloo), owns 2 of the 4 devices of a global mesh and trains a
small MLP with ``hybrid_adamw(state_memory_kind="pinned_host")``, data
parallel with half of the first layer sharded; the script itself checks where
every state shard lives and, with Orbax installed, a checkpoint round trip.
The final params and moments are compared here with a reference computed
on one device with ``jax.grad`` and plain ``optax.adamw`` driven by the
ColossalAI learning rates from the float64 formula in ``numpy_reference``, so
neither optax_hybrid's transform nor its schedule enters it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import multiprocess_script as problem_def
from numpy_reference import colossal_lr

SCRIPT = os.path.join(os.path.dirname(__file__), "multiprocess_script.py")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_PROCESSES = 2
# The checkpoint round trip is an optional extra of the run; training is
# tested without it.
HAVE_ORBAX = importlib.util.find_spec("orbax") is not None and importlib.util.find_spec("orbax.checkpoint") is not None
# A guard against a hung collective, not a performance bound: a passing run
# takes about 15 s here, but two JAX processes compiling on a loaded 2-core CI
# machine can take several times that. A failing process ends the run at once.
TIMEOUT_S = 300
# Attempts when the coordinator's port was taken between choosing it and
# binding it (only possible when the port could not be held, see reserve_port).
PORT_ATTEMPTS = 3


class PortTaken(AssertionError):
  """The coordinator could not bind its port."""


@contextlib.contextmanager
def reserve_port():
  """Yields a loopback port that stays bound here until the block ends.

  The socket is bound with ``SO_REUSEPORT`` and never listens: the
  coordinator's gRPC server (which binds with ``SO_REUSEPORT`` too) can bind
  the same port while this holds it, and no other program can take it in
  between. Where that option is missing, the port is released at once and a
  bind failure is retried (:class:`PortTaken`).
  """
  s = bound_socket()
  port = s.getsockname()[1]
  if not hasattr(socket, "SO_REUSEPORT"):
    s.close()
  try:
    yield port
  finally:
    s.close()


def bound_socket() -> socket.socket:
  """A TCP socket bound to an ephemeral port on every address (IPv6 dual stack) or on IPv4 loopback."""
  for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "127.0.0.1")):
    try:
      s = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
      continue
    try:
      if hasattr(socket, "SO_REUSEPORT"):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
      s.bind((host, 0))
      return s
    except OSError:
      s.close()
  raise RuntimeError("no TCP socket could be bound")


def child_env() -> dict[str, str]:
  """The environment of each process: CPU only, this checkout importable."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
  # The script asks for its own local device count; an inherited forced count
  # (other tests use 8) would contradict it.
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags)
  return env


def run_processes(out_dir: str) -> list[str]:
  """Starts every process, waits for all of them, and returns their stdouts.

  Retries with another port when the coordinator could not bind its own
  (:class:`PortTaken`), at most ``PORT_ATTEMPTS`` times.
  """
  for attempt in range(PORT_ATTEMPTS):
    with reserve_port() as port:
      try:
        return run_processes_once(out_dir, f"127.0.0.1:{port}")
      except PortTaken:
        if attempt == PORT_ATTEMPTS - 1:
          raise


def run_processes_once(out_dir: str, coordinator: str) -> list[str]:
  """One run of every process against ``coordinator``.

  A process that fails leaves its peers blocked in a collective until their
  own timeouts, so on the first failure (or at ``TIMEOUT_S``) all are killed
  and every process's output goes into the assertion message.
  """
  procs, logs = [], []
  try:
    for i in range(NUM_PROCESSES):
      out = open(os.path.join(out_dir, f"stdout_{i}.txt"), "w+")
      err = open(os.path.join(out_dir, f"stderr_{i}.txt"), "w+")
      for f in (out, err):
        f.truncate(0)  # a retry reuses the files
      logs.append((out, err))
      cmd = [sys.executable, SCRIPT, "--coordinator", coordinator, "--num-processes", str(NUM_PROCESSES),
             "--process-id", str(i), "--local-devices", "2", "--memory-kind", "pinned_host", "--out-dir", out_dir]
      if HAVE_ORBAX:
        cmd.append("--checkpoint")
      procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=child_env(), cwd=REPO))
    deadline = time.monotonic() + TIMEOUT_S
    failure = None
    while failure is None:
      codes = [p.poll() for p in procs]
      if all(c == 0 for c in codes):
        break
      if any(c not in (None, 0) for c in codes):
        failure = f"exit codes {codes}"
      elif time.monotonic() > deadline:
        failure = f"timed out after {TIMEOUT_S} s (exit codes {codes})"
      else:
        time.sleep(0.1)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()

  def read(f) -> str:
    """Everything the process wrote to ``f``, which is then closed."""
    f.seek(0)
    text = f.read()
    f.close()
    return text

  texts = [(read(out), read(err)) for out, err in logs]
  if failure is not None:
    report = "\n".join(f"--- process {i} stdout:\n{o}\n--- process {i} stderr:\n{e}" for i, (o, e) in enumerate(texts))
    port_taken = any(m in texts[0][1] for m in ("Failed to start RPC server", "Failed to add port"))
    raise (PortTaken if port_taken else AssertionError)(f"multi-process run failed: {failure}\n{report}")
  return [o for o, _ in texts]


def single_device_reference() -> tuple[dict, dict, dict]:
  """The same training on one device with jax.grad and optax.adamw: (params, mu, nu)."""
  init, batches = problem_def.problem()
  lrs = jnp.asarray([
      colossal_lr(k, problem_def.PEAK_LR, problem_def.TOTAL, problem_def.WARMUP, problem_def.ETA_MIN)
      for k in range(problem_def.STEPS)
  ], jnp.float32)
  tx = optax.adamw(lambda count: lrs[count], b1=problem_def.B1, b2=problem_def.B2, eps=problem_def.EPS,
                   weight_decay=problem_def.WEIGHT_DECAY, mask=problem_def.DECAY)

  def loss_fn(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

  @jax.jit
  def step(p, s, x, y):
    updates, s = tx.update(jax.grad(loss_fn)(p, x, y), s, p)
    return optax.apply_updates(p, updates), s

  device = jax.devices("cpu")[0]
  params = jax.device_put({k: jnp.asarray(v) for k, v in init.items()}, device)
  state = tx.init(params)
  for x, y in batches:
    params, state = step(params, state, jax.device_put(x, device), jax.device_put(y, device))
  get = lambda tree: {k: np.asarray(v) for k, v in jax.device_get(tree).items()}
  return get(params), get(optax.tree_utils.tree_get(state, "mu")), get(optax.tree_utils.tree_get(state, "nu"))


def test_two_processes_match_single_device_optax(tmp_path):
  stdouts = run_processes(str(tmp_path))
  for i, out in enumerate(stdouts):
    assert f"MULTIPROCESS OK process {i}/{NUM_PROCESSES} devices=4 memory_kind=pinned_host" in out, out
    assert ("checkpoint=restored" in out) == HAVE_ORBAX, out

  results = []
  for i in range(NUM_PROCESSES):
    with np.load(tmp_path / f"process_{i}.npz") as f:
      results.append({k: f[k] for k in f.files})
  # Each process gathered the global arrays itself: they must agree exactly.
  assert results[0].keys() == results[1].keys()
  for k in results[0]:
    np.testing.assert_array_equal(results[0][k], results[1][k], err_msg=k)

  ref_params, ref_mu, ref_nu = single_device_reference()
  init, _ = problem_def.problem()
  for k in init:
    # Training moved every leaf far beyond the tolerance, so agreement is not
    # just agreement with the starting point.
    assert np.max(np.abs(ref_params[k] - init[k])) > 1e-2, k
  for path in ("update", "step"):
    for group, ref in (("params", ref_params), ("mu", ref_mu), ("nu", ref_nu)):
      for k, expected in ref.items():
        got = results[0][f"{path}/{group}/{k}"]
        assert got.shape == expected.shape, (path, group, k, got.shape)
        # The sharded gradient sums its batch in another order, so float32
        # results differ in the last bits. A param or a moment can pass near
        # zero, where a relative tolerance alone would ask for more than
        # float32 holds (a param of 0.0016 was seen 1.8e-8 apart).
        atol = 1e-7
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=atol, err_msg=f"{path}/{group}/{k}")


def test_a_reserved_port_is_held_for_the_coordinator_only():
  """While reserved, a plain bind of the port fails and a SO_REUSEPORT listener (gRPC's way) succeeds."""
  if not hasattr(socket, "SO_REUSEPORT"):
    pytest.skip("no SO_REUSEPORT here: the run retries on a taken port instead")
  with reserve_port() as port:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
      with pytest.raises(OSError):
        other.bind(("127.0.0.1", port))
    family, host = (socket.AF_INET6, "::") if socket.has_ipv6 else (socket.AF_INET, "127.0.0.1")
    with socket.socket(family, socket.SOCK_STREAM) as coordinator:
      coordinator.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
      coordinator.bind((host, port))
      coordinator.listen()
