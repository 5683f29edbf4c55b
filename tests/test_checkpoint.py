"""Tests for optax_hybrid.checkpoint: memory kinds, exact resume, interrupted saves."""

import logging
import os
import re
import subprocess
import sys
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")

import optax_hybrid  # noqa: E402
from checkpoint_script import cut_largest_array_file  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "checkpoint_script.py")


def run_script(*args, expect_rc=0, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=timeout)
  assert result.returncode == expect_rc, result.stdout + result.stderr
  return result.stdout


def load(path):
  with np.load(path) as f:
    return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


def test_resume_in_a_new_process_is_bit_identical(tmp_path):
  ckpt = str(tmp_path / "ckpt")
  full = run_script("train", "--dir", ckpt, "--steps", "8", "--save-at", "4", "--out", str(tmp_path / "full.npz"))
  resumed = run_script("train", "--dir", ckpt, "--steps", "8", "--resume", "--out", str(tmp_path / "resumed.npz"))
  # Step 2 had a NaN and was skipped: 4 steps run, count 3, one skipped.
  assert "RESTORED step=4 count=3 skipped=1" in resumed
  assert "DONE count=7 skipped=1" in full and "DONE count=7 skipped=1" in resumed
  a, b = load(tmp_path / "full.npz"), load(tmp_path / "resumed.npz")
  assert len(a) == len(b) > 0
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
  ckpt = str(tmp_path / "ckpt")
  # The script kills itself once the temporary directory of step 2's save
  # exists (it waits for it: the save is asynchronous), never before.
  out = run_script("kill", "--dir", ckpt, expect_rc=-9)
  assert "KILLING during" in out, out
  leftovers = [name for name in os.listdir(ckpt) if name.startswith("2") and "tmp" in name]
  assert leftovers, os.listdir(ckpt)  # the kill really hit the save of step 2 midway
  manager = optax_hybrid.checkpoint.manager(ckpt)
  assert manager.latest_step() == 1
  restored = optax_hybrid.checkpoint.restore(manager, like={"x": jnp.zeros(10)})
  np.testing.assert_array_equal(np.asarray(restored["x"]), np.arange(10.0))
  with pytest.raises(FileNotFoundError, match="step 2"):
    optax_hybrid.checkpoint.restore(manager, like={"x": jnp.zeros(10)}, step=2)


@pytest.mark.parametrize("how", ["not-a-directory", "read-only"])
def test_a_failed_save_ends_the_process_with_its_error(how, tmp_path):
  # Orbax's default (directories made in the background) left threads waiting
  # minutes for them, and the interpreter waited for those threads at exit.
  if how == "read-only" and os.geteuid() == 0:
    pytest.skip("root writes into a read-only (0555) directory; not-a-directory covers root")
  ckpt = str(tmp_path / "ckpt")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  try:
    result = subprocess.run([sys.executable, SCRIPT, "fail-save", "--dir", ckpt, "--how", how], env=env,
                            capture_output=True, text=True, timeout=90)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"the process did not end within 90 s of its failed save: {e.stdout}")
  finally:
    if os.path.isdir(ckpt):
      os.chmod(ckpt, 0o700)
  assert "SAVING into an unwritable directory" in result.stdout and "SAVED" not in result.stdout.replace("SAVING", "")
  assert result.returncode == 1, result.stderr
  last_line = result.stderr.strip().splitlines()[-1]
  assert last_line.startswith(("NotADirectoryError", "PermissionError", "OSError")), result.stderr[-3000:]
  manager = optax_hybrid.checkpoint.manager(ckpt if how == "read-only" else ckpt + ".moved")
  assert manager.all_steps() == [1]  # the step saved before is intact
  np.testing.assert_array_equal(
      np.asarray(optax_hybrid.checkpoint.restore(manager, like={"x": jnp.zeros(10)})["x"]), np.arange(10.0))


def test_a_save_still_writing_when_the_program_ends_is_finished(tmp_path):
  ckpt = str(tmp_path / "ckpt")
  out = run_script("exit-while-saving", "--dir", ckpt, timeout=120)
  assert "EXITING saving=True" in out, out  # the program really ended mid-save
  manager = optax_hybrid.checkpoint.manager(ckpt)
  assert manager.all_steps() == [1] and not [n for n in os.listdir(ckpt) if "tmp" in n], os.listdir(ckpt)
  restored = optax_hybrid.checkpoint.restore(manager, like={"x": jnp.zeros((32, 1024, 1024))})
  assert float(jnp.min(restored["x"])) == float(jnp.max(restored["x"])) == 3.0


def test_round_trip_keeps_memory_kinds_in_process(tmp_path):
  params = jax.device_put({"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4)}, jax.devices()[0])
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.0, state_memory_kind=lambda path, p: "pinned_host" if p.ndim == 2 else "device")
  state = tx.init(params)
  _, state = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)
  manager = optax_hybrid.checkpoint.manager(tmp_path / "c")
  optax_hybrid.checkpoint.save(manager, 1, state, wait=True)
  # Restore into an abstract target built without allocating: tx.init on shapes.
  abstract = tx.init(optax_hybrid.checkpoint.abstract_like(params))
  restored = optax_hybrid.checkpoint.restore(manager, like=abstract)
  assert restored.mu["w"].sharding.memory_kind == "pinned_host"
  # The array's type agrees, so jit traces it as a host value (Orbax alone
  # returns host-sharded arrays typed as device memory).
  assert "<host>" in str(jax.typeof(restored.mu["w"]))
  assert restored.mu["b"].sharding.memory_kind == "device"
  assert restored.count.committed and int(restored.count) == 1
  chex.assert_trees_all_equal(jax.device_get(restored.nu), jax.device_get(state.nu))
  # A donated step on the restored state keeps the moments on the host.
  step = jax.jit(lambda g, s, p: tx.update(g, s, p)[1], donate_argnums=(1,),
                 out_shardings=jax.tree.map(lambda x: x.sharding, restored))
  stepped = step(jax.tree.map(jnp.ones_like, params), restored, params)
  assert stepped.mu["w"].sharding.memory_kind == "pinned_host"
  with pytest.raises(FileNotFoundError):
    optax_hybrid.checkpoint.restore(optax_hybrid.checkpoint.manager(tmp_path / "empty"), like=state)
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match="not a directory"):
    optax_hybrid.checkpoint.manager(tmp_path / "file")


# --- Restoring into another placement, with master weights turned on or off ---

TIERS = ["device", "host_state", "host", "disk"]
needs_host = pytest.mark.skipif("pinned_host" not in optax_hybrid.available_memory_kinds(),
                                reason="no pinned_host memory on this backend")
# bf16 leaves keep an fp32 master with master_dtype; "b" (float32) keeps none.
SHAPES = {"w": (16, 8), "b": (8,), "s": ()}
F32 = dict(mu_dtype=jnp.float32, nu_dtype=jnp.float32, weight_decay=0.1, kernel="xla")


def mixed_params():
  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32 if k == "b" else jnp.bfloat16) for k, s in SHAPES.items()}
  return jax.device_put(params, jax.devices()[0])


def mixed_grads(n):
  rng = np.random.default_rng(1)
  return [{k: jnp.asarray(rng.normal(size=s), jnp.float32 if k == "b" else jnp.bfloat16) for k, s in SHAPES.items()}
          for _ in range(n)]


def steps(tx, params, state, grads):
  step = jax.jit(tx.step)
  for g in grads:
    params, state = step(params, state, g)
  return params, state


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
  """One device-tier run, saved twice: without masters at step 2, with masters at step 3.

  Masters are added by hand between the two (made from the params as init
  makes them, the moments kept), not through a checkpoint: the reference for
  what restoring into a state with masters must give.
  """
  params, grads = mixed_params(), mixed_grads(3)
  plain, mastered = (optax_hybrid.hybrid_adamw(1e-2, **F32),
                     optax_hybrid.hybrid_adamw(1e-2, master_dtype=jnp.float32, **F32))
  p2, s2 = steps(plain, params, plain.init(params), grads[:2])
  with_master = mastered.init(p2)._replace(mu=s2.mu, nu=s2.nu, count=s2.count, skipped=s2.skipped)
  p3, s3 = steps(mastered, p2, with_master, grads[2:])
  manager = optax_hybrid.checkpoint.manager(tmp_path_factory.mktemp("runs"))
  optax_hybrid.checkpoint.save(manager, 2, {"params": p2, "opt": s2}, wait=True)
  optax_hybrid.checkpoint.save(manager, 3, {"params": p3, "opt": s3}, wait=True)
  return dict(manager=manager, grad=grads[2], p2=p2, s2=s2, p3=p3, s3=s3)


def assert_close(got, want, what, rtol=2**-7):
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(got[k], np.float32), np.asarray(want[k], np.float32), rtol=rtol,
                               atol=1e-6 if rtol else 0, err_msg=f"{what}[{k!r}]")


@needs_host
@pytest.mark.parametrize("tier", TIERS)
def test_master_weights_turned_on_and_off_across_a_checkpoint_into_every_tier(tier, saved_runs, tmp_path):
  run, kind = saved_runs, "device" if tier == "device" else "pinned_host"
  plain = optax_hybrid.hybrid_adamw(1e-2, tiers=tier, nvme_offload_dir=tmp_path, **F32)
  mastered = optax_hybrid.hybrid_adamw(1e-2, tiers=tier, nvme_offload_dir=tmp_path, master_dtype=jnp.float32, **F32)
  abstract = optax_hybrid.checkpoint.abstract_like(mixed_params())

  # On: step 2 was saved without masters; this state keeps them for "w" and "s".
  like = {"params": abstract, "opt": mastered.init(abstract)}
  with pytest.raises(ValueError, match=r"has no master weights for like\['opt'\]\.master\['s'\].*"
                                       r"masters_from=lambda restored: restored\['params'\]"):
    optax_hybrid.checkpoint.restore(run["manager"], like, step=2)
  on = optax_hybrid.checkpoint.restore(run["manager"], like, step=2, masters_from=lambda restored: restored["params"])
  for k in ("w", "s"):  # each master is its restored param, exactly as init makes it
    np.testing.assert_array_equal(np.asarray(on["opt"].master[k]), np.asarray(run["p2"][k], np.float32))
    assert on["opt"].master[k].dtype == jnp.float32 and on["opt"].master[k].sharding.memory_kind == kind
  assert on["opt"].master["b"].shape == (0,)  # float32: no master, an empty entry
  assert int(on["opt"].count) == 2 and on["opt"].plan == like["opt"].plan
  for field in ("mu", "nu"):
    assert_close(moment_values(on["opt"], field), getattr(run["s2"], field), f"restored {field}", rtol=0)
  # The next step lands where the run with masters added by hand did.
  p3, s3 = steps(mastered, on["params"], on["opt"], [run["grad"]])
  assert_close(p3, run["p3"], "params after the step with masters")
  assert_close({**s3.master, "b": p3["b"]}, {**run["s3"].master, "b": run["p3"]["b"]}, "masters")

  # Off: step 3 was saved with masters; this state keeps none, and reads none.
  off = optax_hybrid.checkpoint.restore(run["manager"], {"params": abstract, "opt": plain.init(abstract)}, step=3)
  assert off["opt"].master is None and int(off["opt"].count) == 3
  for field in ("mu", "nu"):
    assert_close(moment_values(off["opt"], field), getattr(run["s3"], field), f"restored {field}", rtol=0)
    assert all(x.sharding.memory_kind == kind for x in jax.tree.leaves(getattr(off["opt"], field)))
  assert_close(off["params"], run["p3"], "restored params", rtol=0)
  plain.close()
  mastered.close()


def moment_values(state, field):
  """A state's moments by param name, read from the files for disk-tier leaves."""
  files = optax_hybrid.disk.files_of(state, field)
  return {k: getattr(state, field)[k] if files[k] is None else optax_hybrid.disk.read(files[k]) for k in SHAPES}


def test_leaves_that_change_dtype_gain_or_lose_their_master(tmp_path):
  # Saved with master_dtype while "s" was float32 (no master); restored with
  # "s" in bf16, which now keeps one: built from its restored param, between
  # "b" (an empty entry) and "w" (restored).
  params = mixed_params()
  saved = {**params, "s": params["s"].astype(jnp.float32)}
  tx = optax_hybrid.hybrid_adamw(1e-2, master_dtype=jnp.float32, **F32)
  manager = optax_hybrid.checkpoint.manager(tmp_path / "ckpt")
  _, state = steps(tx, saved, tx.init(saved), mixed_grads(1))
  optax_hybrid.checkpoint.save(manager, 1, {"params": saved, "opt": state}, wait=True)
  like = {"params": params, "opt": tx.init(params)}
  with pytest.raises(ValueError, match=r"no master weights for like\['opt'\]\.master\['s'\]"):
    optax_hybrid.checkpoint.restore(manager, like)
  restored = optax_hybrid.checkpoint.restore(manager, like, masters_from=lambda r: r["params"])
  want_s = np.asarray(saved["s"]).astype(jnp.bfloat16).astype(np.float32)  # the bf16 param, as init converts it
  np.testing.assert_array_equal(np.asarray(restored["opt"].master["s"]), want_s)
  np.testing.assert_array_equal(np.asarray(restored["opt"].master["w"]), np.asarray(state.master["w"]))
  assert restored["opt"].master["b"].shape == (0,)
  # Restored with "w" in float32, which keeps no master now: its saved master is not read.
  f32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  again = optax_hybrid.checkpoint.restore(manager, {"params": f32, "opt": tx.init(f32)})
  assert [again["opt"].master[k].shape for k in ("b", "s", "w")] == [(0,), (0,), (0, 0)]
  np.testing.assert_array_equal(np.asarray(again["opt"].nu["w"]), np.asarray(state.nu["w"]))


def test_a_new_manager_reads_the_saved_tree_and_restores_without_warnings(tmp_path, caplog):
  # A restarted process opens the directory with a new manager, which has not
  # saved anything: it must still read the step's tree (here: that it has no
  # masters) and say nothing about items it cannot restore.
  params = mixed_params()
  tx = optax_hybrid.hybrid_adamw(1e-2, **F32)
  optax_hybrid.checkpoint.save(optax_hybrid.checkpoint.manager(tmp_path), 1, {"params": params, "opt": tx.init(params)},
                               wait=True)
  fresh = optax_hybrid.checkpoint.manager(tmp_path)
  like = {"params": params, "opt": optax_hybrid.hybrid_adamw(1e-2, master_dtype=jnp.float32, **F32).init(params)}
  with caplog.at_level(logging.WARNING), warnings.catch_warnings():
    warnings.simplefilter("error")
    with pytest.raises(ValueError, match="has no master weights"):
      optax_hybrid.checkpoint.restore(fresh, like)
    restored = optax_hybrid.checkpoint.restore(fresh, like, masters_from=lambda restored: restored["params"])
  assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
  np.testing.assert_array_equal(np.asarray(restored["opt"].master["w"]), np.asarray(params["w"], np.float32))


def test_an_unreadable_step_is_named_and_skip_unreadable_restores_the_newest_readable(tmp_path):
  ckpt = tmp_path / "ckpt"
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(64, 33)), jnp.float32), "b": jnp.zeros(33)}  # w: the largest array
  tx = optax_hybrid.hybrid_adamw(1e-2, **F32)
  manager = optax_hybrid.checkpoint.manager(ckpt, max_to_keep=None)
  saved = {}
  for step in (1, 2, 3, 4):
    saved[step] = {"params": jax.tree.map(lambda x: x + step, params), "opt": tx.init(params)}
    optax_hybrid.checkpoint.save(manager, step, saved[step], wait=True)
  like = {"params": params, "opt": tx.init(params)}
  for step in (3, 4):
    cut_largest_array_file(ckpt / str(step))
  restart = optax_hybrid.checkpoint.manager(ckpt, max_to_keep=None)  # a new process's manager

  with pytest.raises(optax_hybrid.checkpoint.UnreadableCheckpointError) as info:
    optax_hybrid.checkpoint.restore(restart, like)
  first_line = str(info.value).splitlines()[0]
  assert re.fullmatch(r"checkpoint step 4 in .* is unreadable: array \['params'\]\['w'\] cannot be read: "
                      r"ValueError: OUT_OF_RANGE: .*Requested byte range .* is not valid .*", first_line), first_line
  assert (info.value.step, info.value.array) == (4, "['params']['w']") and "skip_unreadable=True" in str(info.value)
  # A like that fits no step is the caller's error: nothing is skipped or moved.
  other = {"params": {"w": jnp.zeros((64, 34)), "b": jnp.zeros(33)}, "opt": tx.init({"w": jnp.zeros((64, 34)),
                                                                                      "b": jnp.zeros(33)})}
  with pytest.raises(ValueError, match=r"has shape \(64, 34\) but checkpoint step 4 holds shape \(64, 33\)"):
    optax_hybrid.checkpoint.restore(restart, other, skip_unreadable=True)
  assert sorted(os.listdir(ckpt)) == ["1", "2", "3", "4"]

  with pytest.warns(RuntimeWarning) as records:
    restored = optax_hybrid.checkpoint.restore(restart, like, skip_unreadable=True)
  messages = [str(r.message) for r in records if "skipped step" in str(r.message)]
  assert [m.split(":")[1].strip() for m in messages] == ["skipped step 4, restored step 2", "skipped step 3, restored step 2"]
  assert all("array ['params']['w'] cannot be read" in m and "OUT_OF_RANGE" in m for m in messages), messages
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored["params"]), jax.device_get(saved[2]["params"]))
  # The unreadable steps are kept aside, out of the manager's steps: the run saves those steps again.
  assert restart.latest_step() == 2 and sorted(os.listdir(ckpt / "unreadable")) == ["3", "4"]
  assert optax_hybrid.checkpoint.save(restart, 3, saved[3], wait=True)
  again = optax_hybrid.checkpoint.restore(optax_hybrid.checkpoint.manager(ckpt), like)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(again["params"]), jax.device_get(saved[3]["params"]))


def test_skip_unreadable_with_no_readable_step_moves_nothing(tmp_path, monkeypatch):
  manager = optax_hybrid.checkpoint.manager(tmp_path)
  optax_hybrid.checkpoint.save(manager, 5, {"x": jnp.arange(2000.0)}, wait=True)
  optax_hybrid.checkpoint.save(manager, 6, {"x": jnp.arange(2000.0) * 2}, wait=True)
  for step in ("5", "6"):
    cut_largest_array_file(tmp_path / step)
  with pytest.raises(optax_hybrid.checkpoint.UnreadableCheckpointError,
                     match=r"(?s)checkpoint step 6 .* array \['x'\] .*No step reads completely.*step 5 .*array \['x'\]"):
    optax_hybrid.checkpoint.restore(manager, {"x": jnp.zeros(2000)}, skip_unreadable=True)
  assert sorted(os.listdir(tmp_path)) == ["5", "6"]
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ValueError, match="`skip_unreadable` needs one process"):
    optax_hybrid.checkpoint.restore(manager, {"x": jnp.zeros(2000)}, skip_unreadable=True)


def test_a_checkpoint_without_tree_metadata_is_taken_to_hold_likes_masters(tmp_path, monkeypatch):
  # An Orbax that keeps no tree metadata (item_metadata None): the checkpoint is taken to match like's
  # masters (checkpoint._Saved.known). mutmut: checkpoint._StateRestore.__init__ 31 (that branch's
  # "like has masters" replaced by None: the masters not read) survived, no test reached the branch.
  params = mixed_params()
  tx = optax_hybrid.hybrid_adamw(1e-2, master_dtype=jnp.float32, **F32)
  params, state = steps(tx, params, tx.init(params), mixed_grads(2))
  optax_hybrid.checkpoint.save(optax_hybrid.checkpoint.manager(tmp_path), 2, {"params": params, "opt": state},
                               wait=True)
  fresh = optax_hybrid.checkpoint.manager(tmp_path)
  monkeypatch.setattr(fresh, "item_metadata", lambda step: None)
  restored = optax_hybrid.checkpoint.restore(fresh, {"params": params, "opt": tx.init(params)})
  for field in ("mu", "nu", "master"):
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(getattr(restored["opt"], field)),
                 jax.device_get(getattr(state, field)))
