"""Tests for optax_hybrid.kernels: selection, the reference rule, and the native CPU kernel against it."""

import importlib.machinery
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_hybrid import kernels
from optax_hybrid.kernels import native_cpu, pallas_gpu, reference
from loading import ROOT
from stepping import adam_scalars, call_kernel, isas_this_cpu_runs, kernel_and_reference
from optax_hybrid.rules.adamw import AdamW

needs_native = pytest.mark.skipif(not native_cpu.available(), reason=f"native kernel: {native_cpu.why_unavailable()}")


def test_native_kernel_is_built_where_a_compiler_exists():
  if shutil.which("c++") or shutil.which("g++"):
    assert native_cpu.available(), native_cpu.why_unavailable()


def test_kernel_choice_follows_the_platform_the_step_is_lowered_for():
  native = native_cpu.on_cpu if native_cpu.available() else reference.update_leaves
  pallas = pallas_gpu.update_leaves
  assert kernels.kernels_for("xla", fused=True) == {"default": reference.update_leaves}
  assert kernels.kernels_for("auto", fused=True) == {"cuda": pallas, "rocm": pallas, "cpu": native,
                                                     "default": reference.update_leaves}
  # update: XLA fuses the caller's p + u into the rule on a CPU (measured faster).
  assert kernels.kernels_for("auto", fused=False)["cpu"] is reference.update_leaves
  assert kernels.kernels_for("native", fused=False) == {"cpu": native, "default": reference.update_leaves}
  assert kernels.kernels_for("pallas", fused=False) == {"default": pallas}
  # Several devices with unknown placement: the rule, which GSPMD partitions.
  assert kernels.kernels_for("pallas", fused=True, split="xla") == {"default": reference.update_leaves}
  # Host compute: the native kernel only on a one-device CPU backend.
  host = kernels.kernels_for("auto", fused=True, runs_on="host")
  assert host["default"] is reference.update_leaves
  assert ("cpu" in host) == native_cpu.available()
  assert kernels.kernels_for("auto", fused=True, runs_on="host", split="shard_map") == {
      "default": reference.update_leaves}
  assert kernels.kernels_for("auto", fused=False, runs_on="host") == {"default": reference.update_leaves}
  with pytest.raises(ValueError, match="'auto', 'xla', 'native', 'pallas'"):
    kernels.kernels_for("triton", fused=True)


def test_a_rule_the_native_kernel_lacks_keeps_every_other_kernel_choice():
  # Lion: not in the C++ loops (native_cpu.implements). "native" falls back to the reference rule, "auto" to
  # Pallas on GPUs and the reference elsewhere; "xla" and "pallas" are kept as asked. mutmut:
  # kernels.kernels_for 9 (the fallback applied to every kernel but native and auto) survived.
  from optax_hybrid.rules.lion import Lion
  from optax_hybrid.rules.adamw import AdamW
  assert not native_cpu.implements(Lion()) and native_cpu.implements(AdamW())
  pallas, ref = pallas_gpu.update_leaves, reference.update_leaves
  for fused in (True, False):
    assert kernels.kernels_for("xla", fused=fused, rule=Lion()) == {"default": ref}
    assert kernels.kernels_for("pallas", fused=fused, rule=Lion()) == {"default": pallas}
    assert kernels.kernels_for("native", fused=fused, rule=Lion()) == {"default": ref}  # on every platform
    assert kernels.kernels_for("auto", fused=fused, rule=Lion()) == {"cuda": pallas, "rocm": pallas, "cpu": ref,
                                                                     "default": ref}
    # A packed state takes the native kernel for update as for step, where it implements the rule.
    assert kernels.kernels_for("auto", fused=fused, rule=Lion(), packed=True)["cpu"] is ref


def test_a_kernel_defined_in_a_test_alone_is_routed_and_steps(monkeypatch):
  # A new kernel is a value: its update_leaves and its route, named in kernels.ROUTES; no module is touched.
  import optax_hybrid
  seen = []

  def counting(leaves, facts, s, step):
    seen.append(len(leaves))
    return reference.update_leaves(leaves, facts, s, step)

  def route(*, fused, runs_on, split, rule, packed):
    return {"default": reference.update_leaves} if runs_on == "host" or split == "xla" else {"default": counting}

  monkeypatch.setitem(kernels.ROUTES, "counting", route)
  params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.ones(4)}
  grads = jax.tree.map(lambda p: jnp.sin(p) + 0.1, params)
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, kernel="counting",
                                  state_memory_kind={"w": "device", "b": "host"})
  params, state = optax_hybrid.commit((params, tx.init(params)))
  assert state.plan.kernels["device", True] == {"default": counting}
  new, _ = jax.jit(tx.step)(params, state, grads)
  assert seen == [1]  # "w" on the device; "b" in host compute, where the route gives the reference
  want, _ = jax.jit(optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, kernel="xla").step)(
      params, optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, kernel="xla").init(params), grads)
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
  with pytest.raises(ValueError, match="'counting'"):  # the names accepted include it
    optax_hybrid.hybrid_adamw(1e-2, kernel="counting2")
  # A route without a "default" is refused when the plan is made, naming it.
  monkeypatch.setitem(kernels.ROUTES, "counting", lambda **where: {"cpu": counting})
  with pytest.raises(TypeError, match=r"kernels.ROUTES\['counting'\] must return .*\"default\""):
    optax_hybrid.hybrid_adamw(1e-2, kernel="counting").init(params)


def test_the_plan_decides_the_kernel_route_once_and_the_steps_follow_it():
  # Plan.kernels: kernels_for of the plan's kernel, split and stepped rule, for each place its leaves run and for
  # update (False) and step (True); the traced steps read it and call no kernels_for of their own.
  import dataclasses
  import optax_hybrid
  params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
  state = optax_hybrid.hybrid_adamw(1e-3, tiers={"w": "device", "b": "host"}).init(params)
  assert set(state.plan.kernels) == {("device", False), ("device", True), ("host", False), ("host", True)}
  for (where, fused), table in state.plan.kernels.items():
    assert table == kernels.kernels_for("auto", fused=fused, runs_on=where, rule=AdamW())
  # A rule the native kernel lacks (Lion) is routed to the reference.
  lion = optax_hybrid.hybrid_lion(1e-3, kernel="native").init(params).plan.kernels
  assert lion == {("device", False): {"default": reference.update_leaves},
                  ("device", True): {"default": reference.update_leaves}}
  tx = optax_hybrid.hybrid_adamw(1e-3, kernel="xla")
  state = tx.init(params)
  assert set(state.plan.kernels) == {("device", False), ("device", True)}
  seen = []

  def recording(leaves, facts, s, step):
    seen.append((len(leaves), step.write_params))
    return reference.update_leaves(leaves, facts, s, step)

  routed = dataclasses.replace(state.plan, kernels={key: {"default": recording} for key in state.plan.kernels})
  state = state._replace(plan=routed)
  new, _ = tx.step(params, state, params)
  update, _ = tx.update(params, state, params)
  assert seen == [(2, True), (2, False)]
  want, _ = tx.step(params, tx.init(params), params)
  np.testing.assert_array_equal(new["w"], want["w"])
  np.testing.assert_allclose(np.asarray(update["w"]) + 1.0, want["w"], rtol=1e-6)


def test_lowering_platforms_are_the_declared_ones_else_the_backends(monkeypatch):
  # JAX's "gpu" backend lowers for "cuda" or "rocm" (the names lax.platform_dependent takes), so both
  # branches are kept there. mutmut: kernels.contract.lowering_platforms 8 (the "gpu" key misspelled) survived:
  # every test ran on the CPU backend.
  from optax_hybrid.kernels import contract
  assert contract.lowering_platforms() == ("cpu",)
  with kernels.lowering_for("cuda", "cpu"):
    assert contract.lowering_platforms() == ("cuda", "cpu")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert contract.lowering_platforms() == ("cuda", "rocm")
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert contract.lowering_platforms() == ("tpu",)


@pytest.mark.parametrize("adamw_mode,bias_correction,decay", list(itertools.product([True, False], repeat=3)))
def test_leaf_update_against_float64(adamw_mode, bias_correction, decay):
  rng = np.random.default_rng(3)
  p, g, m, v = (rng.normal(size=11) for _ in range(4))
  v = np.abs(v)
  count, lr, b1, b2, eps, wd = 6, 0.03, 0.8, 0.97, 1e-6, 0.2
  s = adam_scalars(jnp.int32(count), lr, b1, b2, eps, wd, bias_correction)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  u, (m_new, v_new) = reference.leaf_update(
      kernels.step_of(AdamW(adamw_mode=adamw_mode)), f32(g), (f32(m), f32(v)), f32(p), s, decay=decay,
      update_dtype=jnp.float32)
  # Float64, step t = count + 1, written out from the rule.
  t = count + 1
  g64 = g + wd * p if (decay and not adamw_mode) else g
  m64 = b1 * m + (1 - b1) * g64
  v64 = b2 * v + (1 - b2) * g64**2
  bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
  u64 = -lr / bc1 * m64 / (np.sqrt(v64) / np.sqrt(bc2) + eps)
  if decay and adamw_mode:
    u64 -= lr * wd * p
  np.testing.assert_allclose(np.asarray(m_new), m64, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(v_new), v64, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(u), u64, rtol=1e-5, atol=1e-8)


def test_negative_learning_rate_gives_the_raw_direction():
  s = adam_scalars(jnp.int32(0), -1.0, 0.9, 0.999, 0.0, 0.0, True)
  u, _ = reference.leaf_update(kernels.step_of(AdamW()), jnp.array([3.0, -2.0]), (jnp.zeros(2), jnp.zeros(2)), None,
                               s, decay=False, update_dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(u), [1.0, -1.0], rtol=1e-6)


# --- the native kernel against the reference ---------------------------------

# (param/grad dtype, moment dtype): every combination the C++ has a loop for.
COMBOS = [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32), (jnp.bfloat16, jnp.bfloat16),
          (jnp.float16, jnp.float32), (jnp.float16, jnp.float16)]
SIZES = [(), (0,), (1,), (7,), (3, 5, 7), (70_001,)]  # the last spans two work chunks


def ulps(dtype):
  return {np.dtype(jnp.float32): 2e-6, np.dtype(jnp.bfloat16): 2**-7, np.dtype(jnp.float16): 2**-10}[np.dtype(dtype)]


def run_both(pdtype, mdtype, **flags):
  return kernel_and_reference(native_cpu.update_leaves, SIZES, pdtype, mdtype, **flags)


@needs_native
@pytest.mark.parametrize("write_params", [False, True])
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("pdtype,mdtype", COMBOS)
def test_native_equals_reference(pdtype, mdtype, adamw_mode, write_params):
  native, ref, _ = run_both(pdtype, mdtype, adamw_mode=adamw_mode, write_params=write_params)
  for got, want in zip(jax.tree.leaves(native), jax.tree.leaves(ref)):
    assert got.dtype == want.dtype and got.shape == want.shape
    # Same float32 arithmetic; at most one rounding step apart in the stored dtype.
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=ulps(got.dtype), atol=1e-7)


@needs_native
@pytest.mark.parametrize("write_params", [False, True])
def test_native_skips_and_runs_without_bias_correction(write_params):
  native, ref, (g, m, v, p) = run_both(jnp.bfloat16, jnp.float32, adamw_mode=True, write_params=write_params,
                                       step_ok=False)
  for got, want in zip(jax.tree.leaves(native), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))
  # A skipped step: moments as they were, params unchanged (or a zero update).
  for got, before in zip(native[1], m):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(before))
  if write_params:
    for got, before in zip(native[0], p):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(before))
  native, ref, _ = run_both(jnp.float32, jnp.float32, adamw_mode=False, write_params=write_params,
                            bias_correction=False)
  for got, want in zip(jax.tree.leaves(native), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-7)


@needs_native
def test_one_custom_call_for_many_leaves_and_fallback_for_the_rest():
  rng = np.random.default_rng(1)
  n = 64
  g = [jnp.asarray(rng.normal(size=(i + 1,)), jnp.float32) for i in range(n)]
  # Leaves the C++ has no loop for: complex, and float64-free mixed dtypes.
  g += [jnp.asarray(rng.normal(size=3) + 1j, jnp.complex64), jnp.asarray(rng.normal(size=4), jnp.float16)]
  m = [jnp.zeros_like(x) for x in g[:-1]] + [jnp.zeros(4, jnp.bfloat16)]
  v = [jnp.zeros(x.shape, jnp.finfo(x.dtype).dtype) for x in g[:-1]] + [jnp.zeros(4, jnp.bfloat16)]
  p = [x + 1 for x in g]
  decays = [True] * len(g)
  dtypes = [jnp.result_type(a.dtype, b.dtype, c.dtype) for a, b, c in zip(g, m, v)]
  s = adam_scalars(jnp.int32(0), 1e-2, 0.9, 0.999, 1e-8, 0.1, True)
  fn = lambda kernel: (lambda g, m, v, p: call_kernel(kernel, g, m, v, p, decays, dtypes, s, adamw_mode=True))
  lowered = jax.jit(fn(native_cpu.update_leaves)).lower(g, m, v, p).as_text()
  assert lowered.count(f"custom_call @{native_cpu.TARGET}(") == 1  # not one call per leaf
  # Past MAX_LEAVES_PER_CALL the leaves are split over a few calls (compile time).
  # Distinct leaves, so that a leaf given another's result shows (mutmut: the chunk size 10 in
  # native_cpu.on_cpu, overlapping chunks [0:64], [0:128], [0:192], survived identical leaves).
  many = [jnp.full((2,), 0.5 + i, jnp.float32) for i in range(2 * native_cpu.MAX_LEAVES_PER_CALL + 1)]
  zeros = [jnp.zeros(2)] * len(many)
  fn_many = lambda kernel: jax.jit(lambda g, m, v, p: call_kernel(
      kernel, g, m, v, p, [False] * len(many), [jnp.float32] * len(many), s, adamw_mode=True))
  lowered_many = fn_many(native_cpu.update_leaves).lower(many, zeros, zeros, many).as_text()
  assert lowered_many.count(f"custom_call @{native_cpu.TARGET}(") == 3
  got_many = fn_many(native_cpu.update_leaves)(many, zeros, zeros, many)
  want_many = fn_many(reference.update_leaves)(many, zeros, zeros, many)
  assert len(jax.tree.leaves(got_many)) == len(jax.tree.leaves(want_many))
  for a, b in zip(jax.tree.leaves(got_many), jax.tree.leaves(want_many)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-8)
  got = jax.jit(fn(native_cpu.update_leaves))(g, m, v, p)
  want = jax.jit(fn(reference.update_leaves))(g, m, v, p)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-8)


def test_without_the_library_the_xla_path_is_used_with_one_warning(monkeypatch):
  monkeypatch.setattr(native_cpu, "_state", {"loaded": False, "error": None, "warned": False})
  monkeypatch.setattr(native_cpu, "_library_path", lambda: None)
  assert not native_cpu.available()
  assert "not built" in native_cpu.why_unavailable()
  with pytest.warns(RuntimeWarning, match="native CPU kernel unavailable"):
    assert kernels.kernels_for("native", fused=True) == {"cpu": reference.update_leaves,
                                                         "default": reference.update_leaves}
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # only once
    assert kernels.kernels_for("native", fused=True) == {"cpu": reference.update_leaves,
                                                         "default": reference.update_leaves}


# --- the instruction set the native kernel runs -------------------------------

# What each variant of native_cpu.cc needs, in /proc/cpuinfo's names.
AVX512_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}
ISA_FLAGS = {"avx512vbmi": AVX512_FLAGS | {"avx512vbmi"}, "avx512": AVX512_FLAGS, "avx2": {"avx2", "fma", "f16c"}}
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
ISAS_OF_THIS_BUILD = ("avx512vbmi", "avx512", "avx2", "baseline") if X86 else ("baseline",)


def isas_from_proc_cpuinfo():
  """The variants this CPU runs, widest first, from Linux's /proc/cpuinfo (None where there is no such file)."""
  if not X86:
    return ("baseline",)
  try:
    with open("/proc/cpuinfo") as f:
      flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
  except (OSError, StopIteration):
    return None
  return tuple(isa for isa, needs in ISA_FLAGS.items() if needs <= flags) + ("baseline",)


@needs_native
def test_native_runs_the_widest_instruction_set_this_cpu_has_unless_told():
  expected = isas_from_proc_cpuinfo()
  if expected is None:
    pytest.skip("no /proc/cpuinfo to tell what this CPU runs")
  assert isas_this_cpu_runs() == expected
  requested = os.environ.get(native_cpu.ISA_VARIABLE) or "auto"
  assert native_cpu.isa() == (expected[0] if requested == "auto" else requested)


@needs_native
@pytest.mark.parametrize("value", ["avx9", "AVX2", "native"])
def test_an_instruction_set_the_build_lacks_leaves_the_kernel_unavailable_naming_the_variable(
    value, monkeypatch, tmp_path):
  # The choice is made when the library loads, so this loads a second copy of it
  # (the loaded one is never loaded again); nothing is registered with XLA.
  here = os.path.dirname(native_cpu.__file__)
  built = next(p for s in importlib.machinery.EXTENSION_SUFFIXES if os.path.exists(p := f"{here}/_native_cpu{s}"))
  library = shutil.copy(built, tmp_path)
  monkeypatch.setenv(native_cpu.ISA_VARIABLE, value)
  monkeypatch.setattr(native_cpu, "_state", {"loaded": False, "error": None, "warned": False})
  monkeypatch.setattr(native_cpu, "_library_path", lambda: library)
  assert not native_cpu.available() and native_cpu.isa() is None
  assert native_cpu.why_unavailable() == (
      f"OPTAX_HYBRID_NATIVE_ISA={value} is not an instruction set of this build; accepted values: auto, "
      + ", ".join(ISAS_OF_THIS_BUILD))
  with pytest.warns(RuntimeWarning, match=f"OPTAX_HYBRID_NATIVE_ISA={value} is not"):
    assert kernels.kernels_for("native", fused=True) == {"cpu": reference.update_leaves,
                                                         "default": reference.update_leaves}


@needs_native
@pytest.mark.parametrize("isa", ["baseline"])
def test_native_with_a_forced_instruction_set_equals_reference(isa):
  # A process of its own: the instruction set is chosen when the library loads.
  env = dict(os.environ, JAX_PLATFORMS="cpu", OPTAX_HYBRID_NATIVE_ISA=isa,
             PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "native_kernel_script.py"), "--expect-isa", isa],
                          env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  ran = json.loads(result.stdout.splitlines()[-1])
  assert ran["isa"] == isa and ran["leaves_compared"] > 0
  assert os.path.samefile(ran["native_cpu"], native_cpu.__file__)  # this checkout's kernel, not an installed one


# --- the native kernel through hybrid_adamw, against the float64 model -------

@needs_native
@pytest.mark.parametrize("bias_correction,adamw_mode,weight_decay",
                         list(itertools.product([True, False], [True, False], [0.0, 0.1])))
def test_native_step_matches_float64_model(bias_correction, adamw_mode, weight_decay):
  import optax_hybrid
  from numpy_reference import adamw_steps, colossal_lr
  rng = np.random.default_rng(7)
  shapes = {"w": (33, 17), "b": (17,), "s": (), "e": (0, 4)}
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
  grads = [{k: (rng.normal(size=s) * 10.0 ** rng.integers(-3, 2)).astype(np.float32) for k, s in shapes.items()}
           for _ in range(12)]
  mask = {"w": True, "b": False, "s": True, "e": True}
  kw = dict(b1=0.9, b2=0.95, eps=1e-6, weight_decay=weight_decay, bias_correction=bias_correction,
            adamw_mode=adamw_mode)
  sched = optax_hybrid.warmup_cosine_schedule(1e-2, 10, 2, 1e-3)
  tx = optax_hybrid.hybrid_adamw(sched, mask=mask, kernel="native", **kw)
  step = jax.jit(tx.step)
  p, s = params, tx.init(params)
  history = []
  for g in grads:
    p, s = step(p, s, g)
    history.append(p)
  ref, _, _ = adamw_steps(params, grads, [colossal_lr(k, 1e-2, 10, 2, 1e-3) for k in range(12)],
                          decay_mask=mask, **kw)
  for ours, want in zip(history, ref):
    for k in shapes:
      np.testing.assert_allclose(np.asarray(ours[k]), want[k], rtol=2e-5, atol=2e-6)


@needs_native
def test_native_update_under_inject_hyperparams_matches_xla_without_recompiling():
  from stepping import run_with_injected_hyperparams
  rng = np.random.default_rng(8)
  params = {"w": jnp.asarray(rng.normal(size=(9, 5)), jnp.float32), "b": jnp.zeros(5)}
  grads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()} for _ in range(4)]
  vary = lambda i: {"learning_rate": 1e-2 / (i + 1), "b1": 0.9 - 0.1 * i}
  results = {}
  for kernel in ("native", "xla"):
    p, update, s = run_with_injected_hyperparams(kernel, params, grads, vary)
    assert update._cache_size() == 1
    if kernel == "native":
      assert "optax_hybrid_adamw_cpu" in update.lower(grads[0], s, p).as_text()
    results[kernel] = p
  for k in params:
    np.testing.assert_allclose(np.asarray(results["native"][k]), np.asarray(results["xla"][k]), rtol=2e-6, atol=1e-7)
