"""Tests for optax_hybrid.kernels.pallas_gpu: the fused Pallas step against the reference rule.

Off the GPU the kernel runs in Pallas interpret mode, so these tests check the
kernel's own indexing (offsets table, masks, aliases) on the CPU; the CUDA
lowering tests check what a GPU would be given.

The kernel's body is :func:`reference.leaf_update` itself, so comparing the
kernel with the reference compares the rule with itself: those tests are
indexing tests (which element of which leaf each program reads and writes,
dtypes, masks) and are named so. The arithmetic is tested against the float64
model in test_kernels.py, test_transform.py and test_properties.py.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_hybrid
from optax_hybrid import gpu_compile, kernels, placement
from optax_hybrid.kernels import pallas_gpu, reference
from stepping import adam_scalars, call_kernel, kernel_and_reference, run_with_injected_hyperparams

B = pallas_gpu.BLOCK_SIZE
# A scalar, a single element, odd sizes, an empty leaf, and leaves spanning
# one block exactly, a block plus one, and several blocks.
SIZES = [(), (1,), (7,), (3, 5, 7), (0,), (B,), (B + 1,), (2, B + 3)]
COMBOS = [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32), (jnp.bfloat16, jnp.bfloat16),
          (jnp.float16, jnp.float32)]


def run_both(pdtype, mdtype, **flags):
  return kernel_and_reference(pallas_gpu.update_leaves, SIZES, pdtype, mdtype, **flags)


def tolerance(dtype):
  # The same float32 arithmetic, fused differently: fp32 results agree to a
  # few ulps, stored low-precision results to one rounding step.
  return {np.dtype(jnp.float32): 1e-5, np.dtype(jnp.bfloat16): 2**-7, np.dtype(jnp.float16): 2**-10}[np.dtype(dtype)]


# Each dtype combination with both outputs (update, new param); the decay modes
# alternate (each mode meets each output across the combinations).
@pytest.mark.parametrize("pdtype,mdtype,adamw_mode,write_params",
                         [(p, m, (i + w) % 2 == 0, w) for i, (p, m) in enumerate(COMBOS) for w in (False, True)])
def test_indexing_every_element_of_every_leaf_matches_the_reference_it_wraps(pdtype, mdtype, adamw_mode, write_params):
  got, want, _ = run_both(pdtype, mdtype, adamw_mode=adamw_mode, write_params=write_params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tolerance(a.dtype),
                               atol=1e-7)


@pytest.mark.parametrize("write_params", [False, True])
def test_skipped_step_changes_nothing_and_bias_correction_off(write_params):
  got, want, (g, m, v, p) = run_both(jnp.bfloat16, jnp.float32, adamw_mode=True, write_params=write_params,
                                     step_ok=False)
  for new, before in zip(got[1], m):
    np.testing.assert_array_equal(np.asarray(new), np.asarray(before))
  for new, before in zip(got[2], v):
    np.testing.assert_array_equal(np.asarray(new), np.asarray(before))
  for new, before in zip(got[0], p):
    expected = np.asarray(before) if write_params else np.zeros(before.shape)
    np.testing.assert_array_equal(np.asarray(new, np.float64), np.asarray(expected, np.float64))
  got, want, _ = run_both(jnp.float32, jnp.float32, adamw_mode=False, write_params=write_params,
                          bias_correction=False, step_ok=True)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_leaves_the_kernel_does_not_take_use_the_reference_in_the_same_step():
  g = [jnp.asarray([1.0 + 2j, -0.5j], jnp.complex64), jnp.arange(5.0, dtype=jnp.float32), jnp.zeros((0, 3))]
  m = [jnp.zeros_like(x) for x in g]
  v = [jnp.zeros(x.shape, jnp.finfo(x.dtype).dtype) for x in g]
  p = [x + 1 for x in g]
  s = adam_scalars(jnp.int32(0), 1e-2, 0.9, 0.999, 1e-8, 0.1, True)
  args = ([True] * 3, [x.dtype for x in g], s)
  fn = lambda k: jax.jit(lambda g, m, v, p: call_kernel(k, g, m, v, p, *args, adamw_mode=True, write_params=True))
  with kernels.lowering_for("cuda"):
    lowered = fn(pallas_gpu.update_leaves).trace(g, m, v, p).lower(lowering_platforms=("cuda",)).as_text()
  assert gpu_compile.gpu_launches(lowered) == 1  # only the float32 leaf
  for a, b in zip(jax.tree.leaves(fn(pallas_gpu.update_leaves)(g, m, v, p)),
                  jax.tree.leaves(fn(reference.update_leaves)(g, m, v, p))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_block_size_must_be_a_power_of_two():
  s = adam_scalars(jnp.int32(0), 1e-2, 0.9, 0.999, 1e-8, 0.0, True)
  with pytest.raises(ValueError, match="`block_size` must be a positive power of two"):
    call_kernel(pallas_gpu.update_leaves, [jnp.ones(3)], [jnp.zeros(3)], [jnp.zeros(3)], [None], [False], [jnp.float32], s,
                             adamw_mode=True, block_size=1000)


# --- what a GPU would be given -----------------------------------------------

def lower_for_cuda(tx, n_leaves, dtype=jnp.bfloat16, fused=True):
  params = {f"w{i:04d}": jax.ShapeDtypeStruct((100 + i,), dtype) for i in range(n_leaves)}
  state = jax.eval_shape(tx.init, params)
  if fused:
    fn = jax.jit(tx.step, donate_argnums=(0, 1))
  else:
    fn = jax.jit(lambda g, s, p: tx.update(g, s, p))
  with kernels.lowering_for("cuda"):  # the kernels choose for CUDA while traced on the CPU
    return fn.trace(params, state, params).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("fused", [True, False])
def test_cuda_lowering_has_a_few_triton_launches_whatever_the_number_of_leaves(fused):
  tx = optax_hybrid.hybrid_adamw(optax_hybrid.warmup_cosine_schedule(1e-3, 100, 10), weight_decay=0.1,
                                 kernel="pallas", skip_nonfinite=True)
  per_launch = pallas_gpu.MAX_LEAVES_PER_LAUNCH
  for n in ((1, 64, 65) if fused else (65,)):
    text = lower_for_cuda(tx, n, fused=fused)
    assert gpu_compile.gpu_launches(text) == -(-n // per_launch), n
    # No per-leaf XLA arithmetic besides the launches: the update rule is
    # inside the kernel (only the step's scalars are computed outside).
    assert not re.search(r"stablehlo\.sqrt %\S+ : tensor<\d", text)
  assert pallas_gpu.MAX_LEAVES_PER_LAUNCH == 64  # 64 leaves in one launch


def test_cuda_lowering_aliases_params_and_moments_in_place():
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, kernel="pallas")
  text = lower_for_cuda(tx, 3, dtype=jnp.float32)
  call = next(line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line)
  # 3 leaves: the new param, mu and nu of each overwrite their inputs.
  assert call.count("#stablehlo.output_operand_alias<") == 9


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_lowered_for_either_gpu_platform_the_kernel_is_compiled_not_interpreted(platform):
  # Triton serves CUDA and ROCm (the Pallas kernel's docstring). mutmut: kernels.pallas_gpu.update_leaves 82
  # (the "rocm" branch misnamed: ROCm got the interpret-mode kernel) survived, no test lowered for ROCm.
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, kernel="pallas")
  params = {"w": jax.ShapeDtypeStruct((100,), jnp.bfloat16)}
  state = jax.eval_shape(tx.init, params)
  with kernels.lowering_for(platform):
    text = jax.jit(tx.step).trace(params, state, params).lower(lowering_platforms=(platform,)).as_text()
  assert gpu_compile.gpu_launches(text) == 1


@pytest.mark.parametrize("master", [None, "float32"])
def test_cuda_launches_use_the_kernels_warps_with_and_without_a_float32_master(master):
  # Triton's num_warps (pallas_gpu.NUM_WARPS, 8, what the kernel was tuned with) reaches every launch, also
  # where a float32 master is stepped as the param. mutmut: kernels.pallas_gpu.update_leaves 53 (the
  # master path's num_warps dropped to Triton's default) survived: no test lowered a master for CUDA.
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, kernel="pallas", master=master)
  text = lower_for_cuda(tx, 3)
  assert gpu_compile.gpu_launches(text) == 1
  assert re.findall(r"num_warps = (\d+) : i32", text) == ["8"]


@pytest.mark.parametrize("fused", [True, False])
def test_auto_lowered_for_cuda_is_the_pallas_kernel_even_when_traced_on_a_cpu(fused):
  # The kernel choice follows the lowering platform, not the process's backend.
  assert jax.default_backend() == "cpu"
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, kernel="auto")
  assert gpu_compile.gpu_launches(lower_for_cuda(tx, 3, fused=fused)) == 1
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, kernel="xla")
  assert gpu_compile.gpu_launches(lower_for_cuda(tx, 3, fused=fused)) == 0


def test_only_the_branches_of_the_lowering_platform_are_traced():
  # A plain jit on the CPU traces the CPU's kernel alone: the Pallas kernel
  # (costly to trace) is not in the program at all.
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, kernel="auto")
  params = {"w": jnp.ones((8, 8))}
  jaxpr = str(jax.make_jaxpr(tx.step)(params, tx.init(params), params))
  assert "pallas_call" not in jaxpr and "platform_index" not in jaxpr
  with kernels.lowering_for("cuda", "cpu"):  # two platforms: both kernels, chosen at lowering
    jaxpr = str(jax.make_jaxpr(tx.step)(params, tx.init(params), params))
  assert "pallas_call" in jaxpr and "platform_index" in jaxpr


def test_a_step_traced_for_cuda_is_not_reused_for_a_cpu_call():
  # jit's trace cache is keyed on the declaration: the same jitted step lowered
  # for CUDA inside it, then called on the CPU outside it, runs the CPU's kernel.
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, kernel="auto")
  params = {"w": jnp.ones((8, 8))}
  state = tx.init(params)
  step = jax.jit(tx.step)
  with kernels.lowering_for("cuda"):
    text = step.trace(params, state, params).lower(lowering_platforms=("cuda",)).as_text()
  assert gpu_compile.gpu_launches(text) == 1
  new_params, _ = step(params, state, params)
  want, _ = jax.jit(optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, kernel="xla").step)(params, state, params)
  np.testing.assert_allclose(np.asarray(new_params["w"]), np.asarray(want["w"]), rtol=1e-6)


# --- through hybrid_adamw ----------------------------------------------------

def tree(dtype, seed):
  rng = np.random.default_rng(seed)
  shapes = {"w": (37, 129), "b": (129,), "s": (), "e": (0, 4), "odd": (B + 5,)}
  return {k: jnp.asarray(rng.normal(size=s), dtype) for k, s in shapes.items()}


@pytest.mark.parametrize("memory_kind", [None, "pinned_host"])
@pytest.mark.parametrize("pdtype", [jnp.float32, jnp.bfloat16])
def test_indexing_through_hybrid_adamw_matches_the_xla_path(pdtype, memory_kind):
  if memory_kind is not None and memory_kind not in placement.available_memory_kinds():
    pytest.skip(f"no {memory_kind} memory here")
  params = tree(pdtype, 0)
  grads = [tree(pdtype, 1 + i) for i in range(4)]
  sched = optax_hybrid.warmup_cosine_schedule(1e-2, 6, 2, 1e-3)
  mask = {"w": True, "b": False, "s": True, "e": True, "odd": True}
  results = {}
  for kernel in ("pallas", "xla"):
    tx = optax_hybrid.hybrid_adamw(sched, weight_decay=0.1, mask=mask, mu_dtype=jnp.float32,
                                   state_memory_kind=memory_kind, kernel=kernel)
    step = jax.jit(tx.step)
    update = jax.jit(lambda g, s, p: tx.update(g, s, p))
    p, s = params, tx.init(params)
    p2, s2 = params, tx.init(params)
    for g in grads:
      p, s = step(p, s, g)
      u, s2 = update(g, s2, p2)
      p2 = optax_hybrid.apply_updates(p2, u)
    results[kernel] = (p, s, p2, s2)
    # The state stays shaped like the params, in its memory kind.
    mu = optax.tree_utils.tree_get(s, "mu")
    assert jax.tree.map(jnp.shape, mu) == jax.tree.map(jnp.shape, params)
    if memory_kind:
      assert all(x.sharding.memory_kind == memory_kind for x in jax.tree.leaves(mu))
  for got, want in zip(jax.tree.leaves(results["pallas"]), jax.tree.leaves(results["xla"])):
    assert got.dtype == want.dtype
    tol = 1e-5 if got.dtype == jnp.float32 else 2 * 2**-8  # two bf16 rounding steps
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=tol, atol=1e-6)


def test_changing_hyperparameters_do_not_recompile():
  params = tree(jnp.float32, 3)
  grads = [tree(jnp.float32, 4 + i) for i in range(3)]
  vary = lambda i: {"learning_rate": 1e-2 / (i + 1), "b2": 0.999 - 0.01 * i}
  results = {}
  for kernel in ("pallas", "xla"):
    p, update, _ = run_with_injected_hyperparams(kernel, params, grads, vary)
    assert update._cache_size() == 1
    results[kernel] = p
  for k in params:
    np.testing.assert_allclose(np.asarray(results["pallas"][k]), np.asarray(results["xla"][k]), rtol=1e-5,
                               atol=1e-7)
