"""The Pallas kernel with 8-bit block-wise moments, in interpret mode: against the float64 model and the reference rule.

The kernel's body is :func:`reference.leaf_update` applied to tiles of
whole 256-value blocks, one copy shared by a launch's 8-bit leaves, so these
tests check what the kernel adds: the tiling (rows of one block, a partial last
tile), the switch between leaves (their dtypes and decay), the scales' layout,
masks, in-place results, the skip, launches that mix 8-bit and float leaves,
and which leaves go to the reference rule instead. The arithmetic is checked against the float64 model
(``numpy_reference.adamw_step_8bit``), written without the library.

Codes are compared exactly, except where the float64 value before
quantization lies within a few float32 ulps (of the terms it is computed from)
of the threshold between two codes: there float32 may round either way, and
the code may differ by one. Scales are compared to float32 rounding.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_hybrid
from optax_hybrid import gpu_compile, kernels
from optax_hybrid.kernels import pallas_gpu, quantized, reference
from numpy_reference import QUANT_BLOCK, adamw_step_8bit, dequantize_blockwise, dynamic_tree_map, quantize_blockwise
from stepping import adam_scalars, call_kernel

EPS32 = 2.0**-23
ULPS = 8  # "a few float32 ulps"
# The hyperparameters as the step holds them (float32), so that the model starts from the same numbers.
LR, B1, B2, EPS, WD = (float(np.float32(x)) for x in (3e-2, 0.9, 0.99, 1e-6, 0.1))
COUNT = 4
ROWS = 4  # quantization blocks per program in the kernel-level tests: several programs, a partial last tile
# Interpret mode's programs are large and run once: compiling them without LLVM's costly passes
# halves the file's time (the arithmetic is the same IEEE float32 either way).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def scalars(step_ok=None, bias_correction=True):
  ok = None if step_ok is None else jnp.asarray(step_ok)
  return adam_scalars(jnp.int32(COUNT), LR, B1, B2, EPS, WD, bias_correction, ok)


def random_8bit_leaf(shape, pdtype, seed, zero_block=False):
  """(g, QuantizedMoment mu, QuantizedMoment nu, p): random codes and scales, params and gradients.

  With ``zero_block`` the first block of the first row is all zeros (g, p,
  both moments), so its new moments are all zero: scale 0.
  """
  rng = np.random.default_rng(seed)
  nb = shape[-1] // QUANT_BLOCK
  g = rng.normal(size=shape)
  p = rng.normal(size=shape)
  m_codes = rng.integers(0, 256, size=shape)
  v_codes = rng.integers(0, 256, size=shape)
  m_scales = np.abs(rng.normal(size=shape[:-1] + (nb,))) * 0.1
  v_scales = np.abs(rng.normal(size=shape[:-1] + (nb,))) * 0.01
  if zero_block:
    first = (0,) * (len(shape) - 1)
    for x in (g, p):
      x[first][:QUANT_BLOCK] = 0
    m_codes[first][:QUANT_BLOCK] = 127  # -0 in the signed map, 0 in the unsigned one
    v_codes[first][:QUANT_BLOCK] = 0
    m_scales[first][0] = v_scales[first][0] = 0
  moment = lambda codes, scales: quantized.QuantizedMoment(jnp.asarray(codes, jnp.uint8),
                                                           jnp.asarray(scales, jnp.float32))
  return (jnp.asarray(g, pdtype), moment(m_codes, m_scales), moment(v_codes, v_scales), jnp.asarray(p, pdtype))


# --- the float64 model, and what "equal up to near ties" means ----------------

def model(g, mu, nu, p, *, decay, adamw_mode=True, bias_correction=True):
  """The float64 model's step from the same inputs, and the float64 moments before quantization with their error scale.

  Returns ``(new_param, [(m, m_terms), (v, v_terms)])``: ``*_terms`` bounds
  the magnitudes float32 adds to get each moment, so ``ULPS * EPS32 * terms``
  bounds the float32 rounding of the value.
  """
  f64 = lambda x: np.asarray(x, np.float64)
  g, p = f64(g), f64(p)
  wd = WD if decay else 0.0
  new_p, _, _ = adamw_step_8bit(g, p, f64(mu.codes), f64(mu.scales), f64(nu.codes), f64(nu.scales), lr=LR,
                                t=COUNT + 1, b1=B1, b2=B2, eps=EPS, weight_decay=wd, adamw_mode=adamw_mode,
                                bias_correction=bias_correction)
  g_terms = np.abs(g) if adamw_mode else np.abs(g) + wd * np.abs(p)
  g = g if adamw_mode else g + wd * p
  m_old = B1 * dequantize_blockwise(f64(mu.codes), f64(mu.scales), True)
  v_old = B2 * dequantize_blockwise(f64(nu.codes), f64(nu.scales), False)
  m = m_old + (1 - B1) * g
  v = v_old + (1 - B2) * g * g
  return new_p, [(m, np.abs(m_old) + (1 - B1) * g_terms), (v, v)]


def per_value(block_values, last):
  """Per-block values ``(..., nb)`` repeated over their blocks' values ``(..., last)``."""
  return np.repeat(block_values, QUANT_BLOCK, axis=-1)[..., :last]


def block_max(x):
  """The largest value of each block of ``x`` (..., L) -> (..., nb), the last block possibly shorter."""
  nb = -(-x.shape[-1] // QUANT_BLOCK)
  padded = np.zeros(x.shape[:-1] + (nb * QUANT_BLOCK,))
  padded[..., :x.shape[-1]] = x
  return padded.reshape(x.shape[:-1] + (nb, QUANT_BLOCK)).max(axis=-1)


def assert_quantized_like_model(got, values, terms, signed):
  """Codes and scales of ``got`` are those of float64 ``values``, up to float32 rounding and near ties.

  Returns the number of codes that differ by one at a near tie.
  """
  assert got.codes.dtype == jnp.uint8 and got.scales.dtype == jnp.float32
  assert got.codes.shape == values.shape and got.scales.shape == quantized.scales_shape(values.shape)
  want_codes, want_scales = quantize_blockwise(values, signed)
  got_codes, got_scales = np.asarray(got.codes, np.int64), np.asarray(got.scales, np.float64)
  # Scales: the block's largest float32 magnitude.
  np.testing.assert_array_less(np.abs(got_scales - want_scales), ULPS * EPS32 * block_max(terms) + 1e-300)
  # Codes: equal, or neighbours where the value is within the rounding band of the threshold between them.
  table = dynamic_tree_map(signed)
  scale = per_value(np.where(want_scales > 0, want_scales, 1.0), values.shape[-1])
  x = values / scale
  band = ULPS * EPS32 * (terms / scale + np.abs(x))
  differ = got_codes != want_codes
  lower = np.minimum(got_codes, want_codes)
  threshold = (table[lower] + table[np.minimum(lower + 1, 255)]) / 2
  near_tie = (np.abs(got_codes - want_codes) == 1) & (np.abs(x - threshold) <= band)
  bad = differ & ~near_tie
  assert not bad.any(), (f"{bad.sum()} of {bad.size} codes differ beyond a near tie, e.g. got "
                         f"{got_codes[bad][:5]} want {want_codes[bad][:5]} at x/scale {x[bad][:5]}")
  return int(differ.sum())


def param_tolerance(dtype):
  # The float32 step rounded once to the param's dtype (one rounding step), plus float32 noise.
  return {np.dtype(jnp.float32): 2e-6, np.dtype(jnp.bfloat16): 2**-8, np.dtype(jnp.float16): 2**-10}[np.dtype(dtype)]


# --- one launch of mixed leaves: the float64 model, the reference rule, the skip, the CUDA lowering ------

def mixed_leaves():
  """Leaves of every kind, each param dtype among the 8-bit ones: ``[(g, mu, nu, p, decay)]``.

  Three 8-bit leaves the kernel takes (float32 params: 6 blocks, a partial
  last tile of 4, an all-zero block; bfloat16: 4 blocks; float16: 1 block),
  an 8-bit leaf whose rows end in a 44-value block (the reference rule's) and
  a leaf with float32 moments (bfloat16 params).
  """
  rng = np.random.default_rng(7)
  leaves = [random_8bit_leaf((3, 2 * QUANT_BLOCK), jnp.float32, 0, zero_block=True) + (True,),
            random_8bit_leaf((2, 2, QUANT_BLOCK), jnp.bfloat16, 1) + (False,),
            random_8bit_leaf((QUANT_BLOCK,), jnp.float16, 2) + (True,)]
  codes = lambda: jnp.asarray(rng.integers(0, 256, size=(2, 300)), jnp.uint8)
  scales = lambda: jnp.asarray(np.abs(rng.normal(size=(2, 2))) * 0.1, jnp.float32)
  leaves.append((jnp.asarray(rng.normal(size=(2, 300)), jnp.float32), quantized.QuantizedMoment(codes(), scales()),
                 quantized.QuantizedMoment(codes(), scales()), jnp.asarray(rng.normal(size=(2, 300)), jnp.float32),
                 True))
  leaves.append((jnp.asarray(rng.normal(size=(77,)), jnp.bfloat16),
                 jnp.asarray(rng.normal(size=(77,)) * 0.1, jnp.float32),
                 jnp.asarray(np.abs(rng.normal(size=(77,))) * 0.01, jnp.float32),
                 jnp.asarray(rng.normal(size=(77,)), jnp.bfloat16), False))
  return leaves


N_KERNEL_LEAVES = 4  # the three whole-block 8-bit leaves and the float leaf


def mixed_step(kernel, leaves, *, adamw_mode, write_params, **kwargs):
  """``kernel`` over ``leaves`` as one jitted function of (g, m, v, p, step_ok); ``step_ok`` is traced."""
  g, m, v, p, decays = (list(x) for x in zip(*leaves))
  out_dtypes = [pi.dtype if write_params else jnp.float32 for pi in p]
  fn = lambda g, m, v, p, ok: call_kernel(kernel, g, m, v, p, decays, out_dtypes, scalars(ok), adamw_mode=adamw_mode,
                                          write_params=write_params, **kwargs)
  return jax.jit(fn, compiler_options=FAST_COMPILE), (g, m, v, p)


@pytest.mark.parametrize("adamw_mode,write_params", [(True, True), (False, False)])
def test_a_launch_of_8bit_and_float_leaves_matches_the_model_and_the_reference_and_skips(adamw_mode, write_params):
  leaves = mixed_leaves()
  step, args = mixed_step(pallas_gpu.update_leaves, leaves, adamw_mode=adamw_mode, write_params=write_params,
                          rows_per_program=ROWS)
  firsts, mus, nus = step(*args, jnp.asarray(True))
  reference_step, _ = mixed_step(reference.update_leaves, leaves, adamw_mode=adamw_mode, write_params=write_params)
  want_firsts, want_mus, want_nus = reference_step(*args, jnp.asarray(True))
  for i, (g, m, v, p, decay) in enumerate(leaves):
    assert firsts[i].dtype == want_firsts[i].dtype and firsts[i].shape == g.shape
    np.testing.assert_allclose(np.asarray(firsts[i], np.float64), np.asarray(want_firsts[i], np.float64),
                               rtol=param_tolerance(firsts[i].dtype), atol=1e-7)
    if not isinstance(m, quantized.QuantizedMoment):
      np.testing.assert_allclose(np.asarray(mus[i]), np.asarray(want_mus[i]), rtol=1e-6, atol=1e-9)
      np.testing.assert_allclose(np.asarray(nus[i]), np.asarray(want_nus[i]), rtol=1e-6, atol=1e-9)
      continue
    new_p, [(m64, m_terms), (v64, v_terms)] = model(g, m, v, p, decay=decay, adamw_mode=adamw_mode)
    want = new_p if write_params else new_p - np.asarray(p, np.float64)
    np.testing.assert_allclose(np.asarray(firsts[i], np.float64), want, rtol=param_tolerance(firsts[i].dtype),
                               atol=1e-7)
    ties = 0
    for got in (mus[i], want_mus[i]):  # the kernel, and the reference rule, quantize like the model
      ties += assert_quantized_like_model(got, m64, m_terms, signed=True)
    for got in (nus[i], want_nus[i]):
      ties += assert_quantized_like_model(got, v64, v_terms, signed=False)
    assert ties <= 0.01 * m64.size  # near ties are rare: the comparison is exact almost everywhere
  # The all-zero block stays exactly zero: scale 0, the codes of 0.
  assert float(mus[0].scales[0, 0]) == 0 and float(nus[0].scales[0, 0]) == 0
  np.testing.assert_array_equal(np.asarray(mus[0].codes[0, :QUANT_BLOCK]), 127)
  np.testing.assert_array_equal(np.asarray(nus[0].codes[0, :QUANT_BLOCK]), 0)

  # A skipped step (the same compiled step): codes and scales kept, zero update or the old param.
  firsts, mus, nus = step(*args, jnp.asarray(False))
  g, m, v, p = args
  for i in range(len(leaves)):
    for new, old in zip(jax.tree.leaves((mus[i], nus[i])), jax.tree.leaves((m[i], v[i]))):
      assert new.dtype == old.dtype
      np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
    expected = np.asarray(p[i], np.float64) if write_params else np.zeros(p[i].shape)
    np.testing.assert_array_equal(np.asarray(firsts[i], np.float64), expected)

  # On CUDA: one launch for the kernel's four leaves, each array updated in place: the first
  # result overwrites the param (write_params) or a gradient of its own dtype (float32), and
  # every moment array (two codes and two scales per 8-bit leaf); the partial-block leaf is the
  # reference rule's.
  with kernels.lowering_for("cuda"):
    text = step.trace(*args, jnp.asarray(True)).lower(lowering_platforms=("cuda",)).as_text()
  assert gpu_compile.gpu_launches(text) == 1
  call = next(line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line)
  firsts_aliased = N_KERNEL_LEAVES if write_params else 1  # only the float32 leaf's gradient takes an f32 update
  assert call.count("#stablehlo.output_operand_alias<") == 3 * 4 + 2 + firsts_aliased


def test_which_leaves_the_kernel_takes():
  leaf = random_8bit_leaf((QUANT_BLOCK,), jnp.float32, 3)
  fact = kernels.LeafFacts(True, jnp.float32)
  leaf_operands = lambda g, m, v, p: kernels.LeafOperands(g, (m, v), p)
  assert pallas_gpu.supports(leaf_operands(*leaf), fact)
  # Rows ending in a shorter block go to the reference rule.
  partial = quantized.QuantizedMoment(*(jnp.asarray(x) for x in quantized.zeros((2, 300))))
  assert not pallas_gpu.supports(leaf_operands(jnp.ones((2, 300)), partial, partial, jnp.ones((2, 300))), fact)
  # One 8-bit moment and one float moment is not a format the kernel knows.
  assert not pallas_gpu.supports(leaf_operands(leaf[0], leaf[1], jnp.zeros(QUANT_BLOCK), leaf[3]), fact)


def test_a_launch_holds_at_most_40_8bit_leaves():
  # 11 buffers per 8-bit leaf (7 per float leaf): the parameter budget of 64 float leaves.
  # 41 leaves of one block each: a launch of 40 programs (one per leaf), then one of 1.
  n = 41
  g, m, v, p = (list(x) for x in zip(*[random_8bit_leaf((QUANT_BLOCK,), jnp.float32, 0)] * n))
  fn = lambda g, m, v, p: call_kernel(pallas_gpu.update_leaves, g, m, v, p, [True] * n, [jnp.float32] * n,
                                      scalars(), adamw_mode=True, write_params=True)
  jaxpr = str(jax.make_jaxpr(fn)(g, m, v, p))
  assert re.findall(r"pallas_call\[.*?grid=\((\d+),\)", jaxpr, flags=re.S) == ["40", "1"]


def test_rows_per_program_must_be_a_power_of_two():
  g, m, v, p = random_8bit_leaf((QUANT_BLOCK,), jnp.float32, 0)
  with pytest.raises(ValueError, match="`rows_per_program` must be a positive power of two"):
    call_kernel(pallas_gpu.update_leaves, [g], [m], [v], [p], [True], [jnp.float32], scalars(), adamw_mode=True,
                rows_per_program=3)


# --- through hybrid_adamw ------------------------------------------------------

def test_hybrid_adamw_8bit_with_the_pallas_kernel_steps_like_the_xla_rule():
  # Default tiles (16 blocks of 256: one program for "w"), a 6,000-value leaf with a partial
  # block (8-bit, reference rule), a small float32 leaf; the fused step and update, one step
  # at a time from the same state, and a non-finite gradient that is skipped.
  rng = np.random.default_rng(11)
  shapes = {"w": (16, QUANT_BLOCK), "odd": (20, 300), "b": (256,)}
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
  grads = [{k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()} for _ in range(3)]
  grads[1]["b"] = grads[1]["b"].at[3].set(jnp.nan)
  make = lambda kernel: optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, moment_format="8bit", kernel=kernel,
                                                  skip_nonfinite=True)
  txs = {k: make(k) for k in ("pallas", "xla")}
  steps = {k: jax.jit(tx.step, compiler_options=FAST_COMPILE) for k, tx in txs.items()}
  # The state's plan names the kernel: the same arrays in each optimizer's own state.
  structures = {k: jax.tree.structure(tx.init(params)) for k, tx in txs.items()}
  state_of = lambda k, state: jax.tree.unflatten(structures[k], jax.tree.leaves(state))
  p, s = params, txs["xla"].init(params)
  assert s.mu_scales["w"].size and s.mu_scales["b"].size == 0  # "b" keeps float32 moments: an empty entry
  for i, g in enumerate(grads):
    got, want = steps["pallas"](p, state_of("pallas", s), g), steps["xla"](p, s, g)
    assert got[1].plan.kernel == "pallas"
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert a.dtype == b.dtype and a.shape == b.shape
      if a.dtype == jnp.uint8:  # both quantize the same float32 values: any difference is a near tie
        diff = np.abs(np.asarray(a, np.int64) - np.asarray(b, np.int64))
        assert diff.max() <= 1 and np.mean(diff) < 1e-3, i
      else:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-8)
    if i == 1:  # skipped: nothing moved
      for a, b in zip(jax.tree.leaves(got[1].mu), jax.tree.leaves(s.mu)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    p, s = want
  with kernels.lowering_for("cuda"):
    text = jax.jit(txs["pallas"].step).trace(p, state_of("pallas", s), grads[0]).lower(
        lowering_platforms=("cuda",)).as_text()
  assert gpu_compile.gpu_launches(text) == 1
