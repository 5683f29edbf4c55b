"""Tests for the disk tier (optax_hybrid.disk): moments in files, read and written around each step."""

import os
import signal
import stat
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_hybrid
from stepping import grads_like, placed_params, run_steps as run
from optax_hybrid import disk, placement

needs_host = pytest.mark.skipif("pinned_host" not in placement.available_memory_kinds(),
                                reason="no pinned_host memory on this backend")


def make_params(dtype=jnp.float32):
  return placed_params({"emb": (40, 8), "w": (8, 4), "b": (4,), "s": ()}, dtype)


@needs_host
@pytest.mark.parametrize("fused", [True, False])
def test_disk_tier_equals_the_device_step_and_keeps_no_moment_arrays(fused, tmp_path):
  params, grads = make_params(), grads_like(make_params(), 4)
  kw = dict(weight_decay=0.1, skip_nonfinite=True, kernel="xla")
  want, want_state = run(optax_hybrid.hybrid_adamw(1e-2, **kw), params, grads, fused)
  tx = optax_hybrid.hybrid_adamw(1e-2, state_memory_kind={"emb": "disk", "w": "host", "b": "disk", "s": "device"},
                                 nvme_offload_dir=tmp_path, **kw)
  got, state = run(tx, params, grads, fused)
  mu_files, nu_files = disk.files_of(state, "mu"), disk.files_of(state, "nu")
  assert isinstance(mu_files["emb"], disk.DiskMoment) and isinstance(nu_files["b"], disk.DiskMoment)
  assert mu_files["w"] is None and nu_files["s"] is None
  # Disk leaves hold empty entries: one array per param, no bytes.
  assert state.mu["emb"].shape == (0, 0) and state.nu["b"].shape == (0,)
  assert sum(x.size for x in jax.tree.leaves(state.mu)) == 8 * 4 + 1  # only w and s hold moments
  for k in params:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6, atol=1e-7)
  for k in ("emb", "b"):
    np.testing.assert_allclose(disk.read(mu_files[k]), np.asarray(want_state.mu[k]), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(disk.read(nu_files[k]), np.asarray(want_state.nu[k]), rtol=1e-6, atol=1e-10)
  # A skipped step leaves the files as they were.
  before = disk.read(mu_files["emb"]).copy()
  bad = jax.tree.map(lambda g: g * jnp.nan, grads[0])
  _, state = run(tx, got, [bad], fused, state=state)
  np.testing.assert_array_equal(disk.read(disk.files_of(state)["emb"]), before)
  tx.close()


def nameless_files(directory):
  """This process's open files in ``directory`` that have no name there, by descriptor: the kernel's view."""
  found = {}
  for fd in os.listdir("/proc/self/fd"):
    try:
      target = os.readlink(f"/proc/self/fd/{fd}")
      if os.path.dirname(target) == os.path.realpath(directory) and target.endswith(" (deleted)"):
        found[int(fd)] = os.stat(f"/proc/self/fd/{fd}")
    except FileNotFoundError:  # a descriptor closed meanwhile (listdir's own, another thread's)
      pass
  return found


@pytest.mark.parametrize("given", [True, False], ids=["nvme_offload_dir", "temporary_directory"])
def test_moments_live_in_one_private_nameless_file_freed_on_close(given, tmp_path):
  params = make_params()
  directory = str(tmp_path) if given else tempfile.gettempdir()
  before = set(nameless_files(directory))
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.0, state_memory_kind="disk", nvme_offload_dir=tmp_path if given else None)
  state = tx.init(params)
  moments = [m for field in ("mu", "nu")
             for m in jax.tree.leaves(disk.files_of(state, field), is_leaf=lambda x: isinstance(x, disk.DiskMoment))]
  assert len(moments) == 8 and len({m.store for m in moments}) == 1
  if given:
    assert os.listdir(tmp_path) == []  # nothing has a name: nothing to follow, plant, or leave behind
  files = {fd: st for fd, st in nameless_files(directory).items() if fd not in before}
  assert len(files) == 1, files
  (st,) = files.values()
  assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
  # Each moment has its own bytes, all inside the file.
  spans = sorted((m.offset, m.offset + m.nbytes) for m in moments)
  assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])) and spans[-1][1] <= st.st_size
  assert sorted(m.nbytes for m in moments) == sorted(p.size * 4 for p in params.values() for _ in range(2))
  np.testing.assert_array_equal(disk.read(disk.files_of(state)["emb"]), np.zeros((40, 8), np.float32))
  tx.close()
  assert set(nameless_files(directory)) <= before  # closed: its space is freed
  with pytest.raises(ValueError, match="removed by tx.close"):
    tx.step(params, state, params)
  with pytest.raises(ValueError, match="removed by tx.close"):
    disk.read(disk.files_of(state)["emb"])


KILLED_AFTER_A_STEP = """
import os, signal, sys
import jax, jax.numpy as jnp, optax_hybrid
params = {"w": jnp.ones((64, 64)), "b": jnp.ones(64)}
alive = []  # both optimizers and states stay alive until the kill
for directory, options in ((sys.argv[1], {}), (None, {"moment_format": "8bit"})):
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.0, state_memory_kind="disk", nvme_offload_dir=directory, **options)
  state = tx.init(params)
  alive.append((tx, jax.block_until_ready(jax.jit(tx.step)(params, state, params))))
print("STEPPED", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_process_leaves_no_disk_tier_file(tmp_path):
  nvme, tmp = tmp_path / "nvme", tmp_path / "tmp"
  nvme.mkdir()
  tmp.mkdir()
  env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp))  # the default directory, None, is under TMPDIR
  result = subprocess.run([sys.executable, "-c", KILLED_AFTER_A_STEP, str(nvme)], env=env, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == -signal.SIGKILL and "STEPPED" in result.stdout, result.stdout + result.stderr
  assert os.listdir(nvme) == [] and os.listdir(tmp) == []


def test_bad_directories_are_refused_before_any_step(tmp_path):
  with pytest.raises(ValueError, match="`nvme_offload_dir`=.* does not exist"):
    optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0, state_memory_kind=optax_hybrid.by_fraction(disk=0.5),
                              nvme_offload_dir=tmp_path / "missing")
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match="is not a directory"):
    optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0, state_memory_kind=optax_hybrid.by_fraction(disk=0.5),
                              nvme_offload_dir=tmp_path / "file")


def unwritable_directories(tmp_path):
  """Directories this process cannot create a file in, whoever it runs as (root included)."""
  found = []
  if os.geteuid() != 0:  # root writes through directory permissions
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    found.append(ro)
  # Kernel filesystems take no regular files, not even from root.
  found += [d for d in ("/sys", "/proc") if os.path.isdir(d)]
  return found


def test_read_only_directory_is_refused(tmp_path):
  directories = unwritable_directories(tmp_path)
  assert directories, "no unwritable directory found to test with"
  try:
    for d in directories:
      with pytest.raises(ValueError, match="is not writable"):
        optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0, state_memory_kind=optax_hybrid.by_fraction(disk=0.5),
                                  nvme_offload_dir=d)
  finally:
    if (tmp_path / "ro").exists():
      (tmp_path / "ro").chmod(0o700)


def test_nvme_offload_fraction_picks_leaves_by_size(tmp_path):
  params = make_params()
  # Leaves in order: b (4), emb (320), s (1), w (32): 357 params; 50% = 178.5:
  # b (2 <= 178.5) and emb (4 + 160 <= 178.5) go to disk, then s (324.5) and w do not.
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0, state_memory_kind=optax_hybrid.by_fraction(disk=0.5),
                                 nvme_offload_dir=tmp_path)
  state = tx.init(params)
  assert state.plan.tiers == ("disk", "disk", "device", "device")
  tx.close()


@needs_host
def test_disk_tier_with_a_master_and_bf16_params(tmp_path):
  params = make_params(jnp.bfloat16)
  grads = grads_like(params, 3)
  kw = dict(weight_decay=0.1, master="float32", moment_format="float32")
  want, want_state = run(optax_hybrid.hybrid_adamw(1e-2, **kw), params, grads)
  tx = optax_hybrid.hybrid_adamw(1e-2, state_memory_kind="disk", nvme_offload_dir=tmp_path, **kw)
  got, state = run(tx, params, grads)
  assert state.master["emb"].sharding.memory_kind == "pinned_host"
  for k in params:
    np.testing.assert_array_equal(np.asarray(got[k], np.float32), np.asarray(want[k], np.float32))
    np.testing.assert_allclose(np.asarray(state.master[k]), np.asarray(want_state.master[k]), rtol=1e-6)
  tx.close()


@needs_host
def test_checkpoint_saves_and_restores_the_files(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  params, grads = make_params(), grads_like(make_params(), 4)
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.0, state_memory_kind={"emb": "disk", "w": "host", "b": "disk", "s": "device"},
                                 nvme_offload_dir=tmp_path)
  params, state = run(tx, params, grads[:2])
  manager = optax_hybrid.checkpoint.manager(tmp_path / "ckpt")
  optax_hybrid.checkpoint.save(manager, 2, {"params": params, "opt_state": state}, wait=True)
  straight = run(tx, params, grads[2:], state=state)
  # A new run (new files, zeros) restored from the checkpoint continues identically.
  tx2 = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.0, state_memory_kind={"emb": "disk", "w": "host", "b": "disk", "s": "device"},
                                  nvme_offload_dir=tmp_path)
  fresh = {"params": make_params(), "opt_state": tx2.init(make_params())}
  restored = optax_hybrid.checkpoint.restore(manager, fresh)
  assert restored["opt_state"].plan == fresh["opt_state"].plan  # the new run's files, now holding the values
  resumed = run(tx2, restored["params"], grads[2:], state=restored["opt_state"])
  for a, b in zip(jax.tree.leaves(straight[0]), jax.tree.leaves(resumed[0])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(disk.read(disk.files_of(resumed[1])["emb"]),
                                disk.read(disk.files_of(straight[1])["emb"]))
  assert disk.files_of(resumed[1])["emb"] != disk.files_of(straight[1])["emb"]
  tx.close()
  tx2.close()


def test_nnx_checkpoint_of_disk_moments_keeps_the_plan_or_is_refused(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  nnx = pytest.importorskip("flax.nnx")

  def make():
    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.0, state_memory_kind="disk", nvme_offload_dir=tmp_path),
                                wrt=nnx.Param)

  model, optimizer = make()
  grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
  step = nnx.jit(lambda model, optimizer, grads: optimizer.update(model, grads))
  step(model, optimizer, grads)
  manager = optax_hybrid.checkpoint.manager(tmp_path / "ckpt")
  # nnx.state(optimizer) leaves out the plan that names the files: refused, not saved without the moments.
  with pytest.raises(ValueError, match=r"hold no values: they are disk-tier moments.*'opt_state': optimizer\.opt_state"):
    optax_hybrid.checkpoint.save(manager, 1, {"model": nnx.state(model), "optimizer": nnx.state(optimizer)})
  checkpointed = lambda model, optimizer: {"model": nnx.state(model), "opt_state": optimizer.opt_state,
                                           "step": optimizer.step}
  optax_hybrid.checkpoint.save(manager, 1, checkpointed(model, optimizer), wait=True)
  model2, optimizer2 = make()
  restored = optax_hybrid.checkpoint.restore(manager, like=checkpointed(model2, optimizer2))
  nnx.update(model2, restored["model"])
  optimizer2.opt_state, optimizer2.step = restored["opt_state"], restored["step"]
  step(model, optimizer, grads)
  step(model2, optimizer2, grads)
  np.testing.assert_array_equal(np.asarray(model2.kernel[...]), np.asarray(model.kernel[...]))
  assert int(optimizer2.step[...]) == 2
