"""One spelling per choice (docs/optimizer.md): each older spelling warns once, names its replacement and the
release that removes it, and gives the same state and numbers as the kept spelling.

The kept spelling's numbers are checked against an independent reference too
(the float64 NumPy AdamW of ``numpy_reference``, or ``optax.adamw``), so that
"the same as the kept one" cannot hold for two equally wrong results.
"""

import dataclasses
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_hybrid
from optax_hybrid import _deprecations, placement
from numpy_reference import adamw_steps
from stepping import grads_like, placed_params, run_steps

needs_host = pytest.mark.skipif("pinned_host" not in placement.available_memory_kinds(),
                                reason="backend has no pinned_host memory")

SHAPES = {"emb": (16, 8), "w": (8, 8), "b": (8,)}
LR, WD = 1e-2, 0.1


@pytest.fixture(autouse=True)
def fresh_warnings():
  """Each spelling warns once per process: start every test as a fresh process would."""
  _deprecations._told.clear()
  yield
  _deprecations._told.clear()


def built_with(make, **kwargs):
  """``make(**kwargs)`` and the FutureWarnings it gave."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tx = make(**kwargs)
  return tx, [w for w in caught if issubclass(w.category, FutureWarning)]


def assert_same_run(old_tx, new_tx, params, fused=True):
  """The two optimizers place, store and step alike: equal plans, equal bits after 3 steps."""
  grads = grads_like(params, 3)
  old_state, new_state = old_tx.init(params), new_tx.init(params)
  # Equal plans, but for the disk tier's files: each state has its own.
  without_files = lambda plan: [dataclasses.replace(lp, files=()) for lp in plan.leaves]
  assert without_files(old_state.plan) == without_files(new_state.plan)
  kinds = lambda s: [x.sharding.memory_kind for x in jax.tree.leaves(s)]
  assert kinds(old_state) == kinds(new_state)
  old = run_steps(old_tx, params, grads, fused, old_state)
  new = run_steps(new_tx, params, grads, fused, new_state)
  for a, b in zip(jax.tree.leaves(jax.device_get(old)), jax.tree.leaves(jax.device_get(new))):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  return new


def assert_matches_float64_adamw(params, new_params, steps=3):
  grads = grads_like(params, steps)
  history, _, _ = adamw_steps(jax.device_get(params), [jax.device_get(g) for g in grads], [LR] * steps,
                              weight_decay=WD)
  for k in params:
    np.testing.assert_allclose(np.asarray(new_params[k], np.float64), history[-1][k], rtol=2e-5, atol=2e-6)


def check_warning(caught, old, replacement_words):
  assert len(caught) == 1, [str(w.message) for w in caught]
  text = str(caught[0].message)
  assert f"`{old}` is deprecated and will be removed in optax_hybrid 0.3" in text, text
  assert replacement_words in text, text
  assert caught[0].filename == __file__, caught[0].filename  # attributed to the line that passed it


PLACEMENT_CASES = [
    # (older spelling, kept spelling, words of the replacement)
    ({"tiers": "host"}, {"state_memory_kind": "host"}, "use state_memory_kind"),
    ({"tiers": "host_state"}, {"state_memory_kind": "host_state"}, "use state_memory_kind"),
    ({"tiers": {"emb": "host", "w": "host_state", "b": "device"}},
     {"state_memory_kind": {"emb": "host", "w": "host_state", "b": "device"}}, "use state_memory_kind"),
    ({"offload_fraction": 0.5}, {"state_memory_kind": optax_hybrid.by_fraction(host=0.5)},
     "state_memory_kind=optax_hybrid.by_fraction(host=...)"),
    ({"offload_fraction": 0.5, "state_memory_kind": "pinned_host"},
     {"state_memory_kind": optax_hybrid.by_fraction(host=0.5, rest="pinned_host")},
     "state_memory_kind=optax_hybrid.by_fraction(host=...)"),
]


@needs_host
@pytest.mark.parametrize("old, new, words", PLACEMENT_CASES, ids=lambda x: str(x)[:40])
def test_an_older_placement_spelling_warns_once_and_places_and_steps_alike(old, new, words):
  params = placed_params(SHAPES)
  old_tx, caught = built_with(optax_hybrid.hybrid_adamw, learning_rate=LR, weight_decay=WD, **old)
  check_warning(caught, next(k for k in old if k != "state_memory_kind"), words)
  assert built_with(optax_hybrid.hybrid_adamw, learning_rate=LR, weight_decay=WD, **old)[1] == []  # once
  new_tx, none = built_with(optax_hybrid.hybrid_adamw, learning_rate=LR, weight_decay=WD, **new)
  assert none == []
  new_params, _ = assert_same_run(old_tx, new_tx, params, fused=False)
  assert_matches_float64_adamw(params, new_params)


@needs_host
def test_nvme_offload_fraction_is_by_fraction_disk(tmp_path):
  params = placed_params(SHAPES)
  old_tx, caught = built_with(optax_hybrid.hybrid_adamw, learning_rate=LR, weight_decay=WD,
                              nvme_offload_fraction=0.5, nvme_offload_dir=tmp_path)
  check_warning(caught, "nvme_offload_fraction", "state_memory_kind=optax_hybrid.by_fraction(disk=...)")
  new_tx = optax_hybrid.hybrid_adamw(LR, weight_decay=WD, state_memory_kind=optax_hybrid.by_fraction(disk=0.5),
                                     nvme_offload_dir=tmp_path)
  assert "disk" in new_tx.init(params).plan.tiers
  new_params, _ = assert_same_run(old_tx, new_tx, params)
  assert_matches_float64_adamw(params, new_params)
  old_tx.close()
  new_tx.close()


def test_master_dtype_is_master():
  params = placed_params(SHAPES, jnp.bfloat16)
  old_tx, caught = built_with(optax_hybrid.hybrid_adamw, learning_rate=LR, weight_decay=WD, moment_format="float32",
                              master_dtype=jnp.float32)
  check_warning(caught, "master_dtype", "use master (master=jnp.float32 or master='float32')")
  new_tx = optax_hybrid.hybrid_adamw(LR, weight_decay=WD, moment_format="float32", master="float32")
  _, state = assert_same_run(old_tx, new_tx, params)
  # The master is the float32 AdamW trajectory from the bf16 start: the float64 reference's, to float32 rounding.
  history, _, _ = adamw_steps(jax.device_get(params), [jax.device_get(g) for g in grads_like(params, 3)], [LR] * 3,
                              weight_decay=WD)
  for k in params:
    np.testing.assert_allclose(np.asarray(state.master[k], np.float64), history[-1][k], rtol=1e-4, atol=1e-5)


def test_nu_dtype_with_mu_dtype_is_moment_format():
  params = placed_params(SHAPES)
  old_tx, caught = built_with(optax_hybrid.hybrid_adamw, learning_rate=LR, weight_decay=WD,
                              mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)
  check_warning(caught, "nu_dtype", "moment_format='bfloat16' stores both moments in bfloat16")
  new_tx = optax_hybrid.hybrid_adamw(LR, weight_decay=WD, moment_format="bfloat16")
  _, state = assert_same_run(old_tx, new_tx, params)
  assert state.mu["w"].dtype == state.nu["w"].dtype == jnp.bfloat16


def test_nu_dtype_of_the_building_block_warns_too():
  _, caught = built_with(optax_hybrid.scale_by_hybrid_adam, nu_dtype=jnp.bfloat16)
  check_warning(caught, "nu_dtype", "use moment_format")


def test_weight_decay_mask_is_mask():
  params = placed_params(SHAPES)
  mask = {"emb": False, "w": True, "b": False}
  old_tx, caught = built_with(optax_hybrid.hybrid_adamw, learning_rate=LR, weight_decay=WD, weight_decay_mask=mask)
  check_warning(caught, "weight_decay_mask", "use mask (optax.adamw's name)")
  new_tx = optax_hybrid.hybrid_adamw(LR, weight_decay=WD, mask=mask)
  new_params, _ = assert_same_run(old_tx, new_tx, params, fused=False)
  grads = grads_like(params, 3)
  want = optax.adamw(LR, weight_decay=WD, mask=mask)
  p, s = params, want.init(params)
  for g in grads:
    u, s = want.update(g, s, p)
    p = optax.apply_updates(p, u)
  for k in params:
    np.testing.assert_allclose(np.asarray(new_params[k]), np.asarray(p[k]), rtol=1e-5, atol=1e-6)


def test_min_lr_ratio_is_min_lr():
  params = placed_params(SHAPES)
  old_tx, caught = built_with(optax_hybrid.standard_optimizer, learning_rate=3e-3, total_steps=10, warmup=2,
                              min_lr_ratio=0.2)
  check_warning(caught, "min_lr_ratio", "use min_lr (min_lr_ratio times learning_rate)")
  new_tx = optax_hybrid.standard_optimizer(3e-3, 10, warmup=2, min_lr=0.2 * 3e-3)
  grads = grads_like(params, 10)
  rates = []
  for tx in (old_tx, new_tx):
    p, s = params, tx.init(params)
    step = jax.jit(tx.update)
    for g in grads:
      u, s = step(g, s, p)
      p = optax.apply_updates(p, u)
    rates.append(float(optax_hybrid.last_learning_rate(s)))
  # The last update's rate is the floor: step 9 of a cosine over 8 decay steps from 3e-3 down to 6e-4.
  assert rates[0] == rates[1] == pytest.approx(6e-4 + 0.5 * (3e-3 - 6e-4) * (1 + np.cos(np.pi * 7 / 8)), rel=1e-6)


def test_both_spellings_at_once_are_refused_naming_both():
  with pytest.raises(ValueError, match="pass either `tiers` or `state_memory_kind`, not both"):
    optax_hybrid.hybrid_adamw(LR, tiers="host", state_memory_kind="pinned_host")
  with pytest.raises(ValueError, match="pass either `master` or `master_dtype`, not both"):
    optax_hybrid.hybrid_adamw(LR, master="kahan", master_dtype=jnp.float32)
  with pytest.raises(ValueError, match="already places by size"):
    optax_hybrid.hybrid_adamw(LR, offload_fraction=0.2, state_memory_kind=optax_hybrid.by_fraction(host=0.1))


def test_older_spellings_are_out_of_the_signatures_but_still_bind():
  """The docs and ``help`` show the kept arguments; ``optax.inject_hyperparams`` still binds the older ones."""
  kept = set(inspect.signature(optax_hybrid.hybrid_adamw).parameters)
  assert not kept & set(_deprecations.SPELLINGS), kept & set(_deprecations.SPELLINGS)
  assert {"state_memory_kind", "master", "moment_format", "mask", "mu_dtype"} <= kept
  assert "min_lr_ratio" not in inspect.signature(optax_hybrid.standard_optimizer).parameters
  tx = optax.inject_hyperparams(optax_hybrid.hybrid_adamw)(learning_rate=LR, tiers="device")
  assert tx.init({"w": jnp.ones(3)}).inner_state.plan.tiers == ("device",)


def test_the_exported_names_are_what_users_call():
  """``__all__`` lists functions, classes and the checkpoint module: no engine module (plan, tiers, ...)."""
  import types
  modules = [n for n in optax_hybrid.__all__ if isinstance(getattr(optax_hybrid, n), types.ModuleType)]
  assert modules == ["checkpoint"], modules
  assert "by_fraction" in optax_hybrid.__all__ and len(optax_hybrid.__all__) <= 32, len(optax_hybrid.__all__)
  # The engine's modules stay importable where the docs and tests reach them.
  for name in ("plan", "tiers", "masters", "options", "base", "rules", "disk", "recipe", "report", "flat_params"):
    assert isinstance(getattr(optax_hybrid, name), types.ModuleType), name


def test_importing_the_package_does_not_load_the_gpu_compile_toolkit():
  """``gpu_compile`` (its CUDA plugin, its HLO readers) is imported on use; its one exported check still resolves."""
  import os
  import subprocess
  import sys
  code = ("import sys, optax_hybrid\n"
          "loaded = sorted(m for m in sys.modules if m.startswith('optax_hybrid.gpu_compile'))\n"
          "assert not loaded, loaded\n"
          "from optax_hybrid import *\n"
          "assert host_arithmetic_outside_host_compute.__module__ == 'optax_hybrid.gpu_compile.jaxpr_check'\n"
          "print('OK')\n")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.stdout.strip() == "OK", result.stderr[-3000:]
