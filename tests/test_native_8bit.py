"""The native CPU kernel with 8-bit block-wise moments, against the reference rule and the float64 model.

The kernel reads the code maps and their thresholds as tables (quantized.py's
SIGNED_MAP, UNSIGNED_MAP and thresholds): a value's code is the number of
float32 thresholds below it, exactly (test_..._every_threshold). The reference
rule decodes and encodes by arithmetic, equal to those tables to float32
rounding. So codes are compared exactly except near ties: two float32
computations of the same moment (fused multiply-adds or not, a map value or a
scale one ulp apart) may round a value lying within a few float32 ulps of a
threshold to either side of it, and there a code may differ by one step.
Everywhere else a code that differs is a bug. Both the kernel and XLA run
with subnormals flushed to zero, which NumPy does not do, so the
float64-model tests keep their values normal.
"""

import itertools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_hybrid
from optax_hybrid.kernels import LeafFacts, LeafOperands, native_cpu, quantized, reference, step_of
from optax_hybrid.rules.adamw import AdamW
from numpy_reference import adamw_step_8bit, dequantize_blockwise, dynamic_tree_map
from stepping import adam_scalars, call_kernel, isas_this_cpu_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_native = pytest.mark.skipif(not native_cpu.available(), reason=f"native kernel: {native_cpu.why_unavailable()}")

# Rows whose length is not a multiple of the block (188 and 232 left over),
# exact blocks, rows of one value (a block each), and a 3-d leaf.
SHAPES = [(5, 700), (2, 3, 1000), (4096,), (600, 1), (1, 257)]
LR, B1, B2, EPS, WD, COUNT = 3e-2, 0.9, 0.99, 1e-6, 0.1, 4
F32_EPS = float(np.finfo(np.float32).eps)


def random_moment(rng, shape, signed, zero_blocks=0.0):
  """Random codes and log-uniform scales over six decades; a fraction of the blocks all zero."""
  codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
  scales = (10.0 ** rng.uniform(-4, 2, size=quantized.scales_shape(shape))).astype(np.float32)
  zero = rng.random(scales.shape) < zero_blocks
  scales[zero] = 0.0
  # A zero block holds the code of zero, as the kernel writes it.
  zero_code = 127 if signed else 0
  per_value = np.repeat(zero, quantized.BLOCK_SIZE, axis=-1)[..., :shape[-1]]
  codes[per_value] = zero_code
  return quantized.QuantizedMoment(jnp.asarray(codes), jnp.asarray(scales))


def random_leaves(shapes, dtype, seed, zero_blocks=0.0):
  rng = np.random.default_rng(seed)
  g = [jnp.asarray(rng.normal(size=s) * 10.0 ** rng.uniform(-3, 1), dtype) for s in shapes]
  p = [jnp.asarray(rng.normal(size=s), dtype) for s in shapes]
  m = [random_moment(rng, s, True, zero_blocks) for s in shapes]
  v = [random_moment(rng, s, False, zero_blocks) for s in shapes]
  return g, m, v, p


def scalars(step_ok=None, **kw):
  kw = dict(dict(learning_rate=LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, bias_correction=True), **kw)
  ok = None if step_ok is None else jnp.asarray(step_ok)
  return adam_scalars(jnp.int32(COUNT), kw["learning_rate"], kw["b1"], kw["b2"], kw["eps"],
                                kw["weight_decay"], kw["bias_correction"], ok)


def run(kernel, g, m, v, p, decays, out_dtypes, s, *, adamw_mode, write_params):
  fn = lambda g, m, v, p: call_kernel(kernel, g, m, v, p, decays, out_dtypes, s, adamw_mode=adamw_mode,
                                      write_params=write_params)
  return jax.jit(fn)(g, m, v, p)


def moment64(old, g64, beta, signed, g_size=None):
  """The new moment in float64 from the stored one, and the sum of its terms' magnitudes (its rounding scale).

  ``g_size``: the magnitude of the gradient's own terms when it is a float32
  sum (L2 decay adds ``wd * p`` to it), else ``|g|``.
  """
  # The values the kernel reads: map value times scale, rounded once to float32 (NumPy, not JAX: no compiles).
  table = quantized.SIGNED_MAP if signed else quantized.UNSIGNED_MAP
  per_value = np.repeat(np.asarray(old.scales), quantized.BLOCK_SIZE, axis=-1)[..., :old.codes.shape[-1]]
  values = (table[np.asarray(old.codes)] * per_value).astype(np.float64)
  g_size = np.abs(g64) if g_size is None else g_size
  term, term_size = (g64, g_size) if signed else (g64 * g64, g_size * g_size)
  return beta * values + (1 - beta) * term, np.abs(beta * values) + np.abs(1 - beta) * term_size


def new_moments64(g, m, v, p, *, decay, adamw_mode):
  """Both new moments in float64 from the leaf's float32 operands, with their rounding scales."""
  g64, p64 = np.asarray(g, np.float64), np.asarray(p, np.float64)
  g_size = np.abs(g64)
  if decay and not adamw_mode:
    g_size = g_size + np.abs(WD * p64)
    g64 = g64 + WD * p64
  return moment64(m, g64, B1, True, g_size), moment64(v, g64, B2, False, g_size)


def assert_first_close(got, want, p, m64, m_size, v64, *, decay, adamw_mode, write_params):
  """The update (or new param) within its float32 error: m's (bounded by its terms), a few ulps of the rest,
  then one rounding to the stored dtype (of p + u when writing params)."""
  p64 = np.asarray(p, np.float64)
  bc1, bc2_sqrt = 1 - B1**(COUNT + 1), np.sqrt(1 - B2**(COUNT + 1))
  denom = np.sqrt(v64) / bc2_sqrt + EPS
  u64 = -LR / bc1 * m64 / denom - (LR * WD * p64 if decay and adamw_mode else 0)
  want = np.asarray(want, np.float64)
  allowed = 8 * F32_EPS * (LR / bc1 * m_size / denom + np.abs(u64) + LR * WD * np.abs(p64))
  allowed += ulps(got.dtype) * (np.abs(want) + write_params * np.abs(p64))
  assert (np.abs(np.asarray(got, np.float64) - want) <= allowed).all()


def per_block_max(x):
  """The largest value of each block of ``x`` (..., L) -> (..., ceil(L / BLOCK_SIZE))."""
  last = x.shape[-1]
  blocks = -(-last // quantized.BLOCK_SIZE)
  padded = np.zeros(x.shape[:-1] + (blocks * quantized.BLOCK_SIZE,))
  padded[..., :last] = x
  return padded.reshape(x.shape[:-1] + (blocks, quantized.BLOCK_SIZE)).max(axis=-1)


def assert_scales_match(got, want, size64):
  """Scales equal to the float32 rounding of the block's largest value, which a cancellation can make relatively large."""
  allowed = 8 * F32_EPS * per_block_max(size64)
  assert (np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)) <= allowed).all()


def assert_codes_match(got, want, x64, size64, scales, signed, what):
  """Codes equal, or one step apart where x64 / scale lies within a few float32 ulps of that step's threshold.

  The rounding of a float32 computation of x is bounded by ulps of the sum of
  its terms' magnitudes (size64), not of x: near zero, cancellation leaves x
  small while its error stays that of its terms.
  """
  got, want = np.asarray(got, np.int64), np.asarray(want, np.int64)
  differ = got != want
  if not differ.any():
    return
  assert np.abs(got - want)[differ].max() == 1, f"{what}: a code differs by more than one step"
  thresholds = (quantized.SIGNED_THRESHOLDS if signed else quantized.UNSIGNED_THRESHOLDS).astype(np.float64)
  per_value = np.repeat(np.asarray(scales, np.float64), quantized.BLOCK_SIZE, axis=-1)[..., :got.shape[-1]]
  safe = np.where(per_value > 0, per_value, 1.0)
  between = thresholds[np.minimum(got, want)[differ]]
  distance = np.abs(x64[differ] / safe[differ] - between)
  allowed = 8 * F32_EPS * (size64[differ] / safe[differ] + np.abs(between))
  assert (distance <= allowed).all(), (
      f"{what}: {int((distance > allowed).sum())} of {int(differ.sum())} differing codes are not near a threshold")


def assert_new_moments_as_the_reference(got, want, old, g64, what):
  """Both new moments (mu, nu) of one leaf without decay: scales and codes as the reference rule's, to float32
  rounding of the float64 moments that ``old`` and the gradient ``g64`` give."""
  for new, ref_new, old_moment, beta, signed in zip(got, want, old, (B1, B2), (True, False)):
    x64, size64 = moment64(old_moment, g64, beta, signed)
    assert_scales_match(new.scales, ref_new.scales, size64)
    assert_codes_match(new.codes, ref_new.codes, x64, size64, ref_new.scales, signed, what)


def ulps(dtype):
  """One rounding step of a stored dtype, relative."""
  return {np.dtype(jnp.float32): F32_EPS, np.dtype(jnp.bfloat16): 2**-7, np.dtype(jnp.float16): 2**-10}[np.dtype(dtype)]


@needs_native
def test_native_takes_quantized_leaves():
  g, m, v, p = random_leaves([(4, 300)], jnp.bfloat16, seed=0)
  leaf = LeafOperands(g[0], (m[0], v[0]), p[0])
  update, fused = step_of(AdamW(), write_params=False), step_of(AdamW(), write_params=True)
  assert native_cpu.supports(leaf, LeafFacts(True, jnp.float32), update)
  assert native_cpu.supports(leaf, LeafFacts(True, jnp.bfloat16), fused)
  # The update of a bf16 leaf with 8-bit moments is float32 (the moments' values are).
  assert not native_cpu.supports(leaf, LeafFacts(True, jnp.bfloat16), update)
  # One moment quantized and the other not: the reference rule takes it.
  mixed = leaf._replace(state=(m[0], jnp.zeros((4, 300), jnp.float32)))
  assert not native_cpu.supports(mixed, LeafFacts(True, jnp.float32), update)
  s = scalars()
  lowered = jax.jit(lambda g, m, v, p: call_kernel(native_cpu.update_leaves, g, m, v, p, [True], [jnp.float32], s,
                                                   adamw_mode=True)).lower(g, m, v, p).as_text()
  call = lowered.split(f"custom_call @{native_cpu.TARGET}(")
  assert len(call) == 2 and "xui8>" in call[1].split("\n")[0]  # one call, taking the codes
  # The codes and scales are updated in place: aliased to their operands.
  assert call[1].split("\n")[0].count("output_operand_alias<") == 4


@needs_native
@pytest.mark.parametrize("dtype,write_params,adamw_mode",  # each dtype both ways, each flag with each dtype
                         [(jnp.float32, True, True), (jnp.float32, False, False), (jnp.bfloat16, True, False),
                          (jnp.bfloat16, False, True), (jnp.float16, True, True), (jnp.float16, False, False)])
def test_native_8bit_equals_reference(dtype, write_params, adamw_mode):
  g, m, v, p = random_leaves(SHAPES, dtype, seed=1, zero_blocks=0.1)
  decays = [i % 2 == 0 for i in range(len(SHAPES))]
  out_dtypes = [dtype if write_params else jnp.float32] * len(SHAPES)
  s = scalars()
  got = run(native_cpu.update_leaves, g, m, v, p, decays, out_dtypes, s, adamw_mode=adamw_mode,
            write_params=write_params)
  want = run(reference.update_leaves, g, m, v, p, decays, out_dtypes, s, adamw_mode=adamw_mode,
             write_params=write_params)
  for i, shape in enumerate(SHAPES):
    first, (mu, nu) = got[0][i], (got[1][i], got[2][i])
    assert first.dtype == want[0][i].dtype and first.shape == shape
    (m64, m_size), (v64, v_size) = new_moments64(g[i], m[i], v[i], p[i], decay=decays[i], adamw_mode=adamw_mode)
    assert_first_close(first, want[0][i], p[i], m64, m_size, v64, decay=decays[i], adamw_mode=adamw_mode,
                       write_params=write_params)
    for new, ref_new, x64, size64, signed in ((mu, want[1][i], m64, m_size, True), (nu, want[2][i], v64, v_size, False)):
      assert new.codes.dtype == jnp.uint8 and new.codes.shape == shape
      assert new.scales.dtype == jnp.float32 and new.scales.shape == quantized.scales_shape(shape)
      assert_scales_match(new.scales, ref_new.scales, size64)
      assert_codes_match(new.codes, ref_new.codes, x64, size64, ref_new.scales, signed, f"{shape} {'mu' if signed else 'nu'}")


@needs_native
@pytest.mark.parametrize("dtype,write_params,adamw_mode",
                         [(jnp.float32, True, True), (jnp.float32, False, False), (jnp.bfloat16, True, False),
                          (jnp.float16, False, True)])
def test_native_8bit_against_float64_model(dtype, write_params, adamw_mode):
  shapes = [(3, 700), (4096,)]
  g, m, v, p = random_leaves(shapes, dtype, seed=2)
  out_dtypes = [dtype if write_params else jnp.float32] * len(shapes)
  got = run(native_cpu.update_leaves, g, m, v, p, [True, True], out_dtypes, scalars(), adamw_mode=adamw_mode,
            write_params=write_params)
  for i in range(len(shapes)):
    p64, g64 = np.asarray(p[i], np.float64), np.asarray(g[i], np.float64)
    new_p, (mc, ms), (vc, vs) = adamw_step_8bit(
        g64, p64, np.asarray(m[i].codes), np.asarray(m[i].scales), np.asarray(v[i].codes), np.asarray(v[i].scales),
        lr=LR, t=COUNT + 1, b1=B1, b2=B2, eps=EPS, weight_decay=WD, adamw_mode=adamw_mode)
    (m64, m_size), (v64, v_size) = new_moments64(g[i], m[i], v[i], p[i], decay=True, adamw_mode=adamw_mode)
    assert_first_close(got[0][i], new_p if write_params else new_p - p64, p[i], m64, m_size, v64, decay=True,
                       adamw_mode=adamw_mode, write_params=write_params)
    for new, codes64, scales64, x64, size64, signed in ((got[1][i], mc, ms, m64, m_size, True),
                                                        (got[2][i], vc, vs, v64, v_size, False)):
      assert_scales_match(new.scales, scales64, size64)
      assert_codes_match(new.codes, codes64, x64, size64, scales64, signed, "float64 model")
      # The stored moment is the nearest value of the float64 map: within half a code step of x.
      table = dynamic_tree_map(signed)
      decoded = dequantize_blockwise(np.asarray(new.codes), np.asarray(new.scales), signed)
      step = np.diff(table).max() * np.repeat(scales64, quantized.BLOCK_SIZE, axis=-1)[..., :x64.shape[-1]]
      assert (np.abs(decoded - x64) <= step / 2 * (1 + 1e-5) + 1e-30).all()


def native_8bit_results():
  """One native step on SHAPES for each storage dtype, updates and new params: {name: array}."""
  results = {}
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    g, m, v, p = random_leaves(SHAPES, dtype, seed=5, zero_blocks=0.1)
    decays = [i % 2 == 0 for i in range(len(SHAPES))]
    for write_params in (False, True):
      out_dtypes = [dtype if write_params else jnp.float32] * len(SHAPES)
      got = run(native_cpu.update_leaves, g, m, v, p, decays, out_dtypes, scalars(), adamw_mode=True,
                write_params=write_params)
      for k, x in enumerate(jax.tree.leaves(got)):
        results[f"{np.dtype(dtype).name}_{write_params}_{k}"] = np.asarray(x).view(np.uint8)  # bits, compared exactly
  return results


@needs_native
@pytest.mark.skipif(isas_this_cpu_runs()[:1] != ("avx512vbmi",), reason="needs a CPU with AVX-512 VBMI")
def test_native_8bit_decodes_by_byte_permutes_exactly_as_by_gathers(tmp_path):
  # avx512vbmi and avx512 differ only in how they look the codes up, so every
  # bit of every result agrees. The other copy runs in a process of its own.
  env = dict(os.environ, JAX_PLATFORMS="cpu", OPTAX_HYBRID_NATIVE_ISA="avx512",
             PYTHONPATH=os.pathsep.join([ROOT] + [q for q in [os.environ.get("PYTHONPATH")] if q]))
  out = tmp_path / "avx512.npz"
  result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "native_8bit_script.py"), str(out),
                           "--expect-isa", "avx512"], env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  if native_cpu.isa() != "avx512vbmi":
    pytest.skip(f"this process runs {native_cpu.isa()} ({native_cpu.ISA_VARIABLE} is set)")
  by_gathers, by_permutes = np.load(out), native_8bit_results()
  assert sorted(by_gathers.files) == sorted(by_permutes) and len(by_permutes) == 3 * 2 * 5 * len(SHAPES)
  for name, bits in by_permutes.items():
    np.testing.assert_array_equal(by_gathers[name], bits, err_msg=name)


@needs_native
@pytest.mark.skipif("avx2" not in isas_this_cpu_runs() or native_cpu.isa() == "avx2",
                    reason="needs a CPU that runs AVX2 and a process that runs another copy")
def test_native_8bit_in_the_avx2_copy_follows_the_reference_and_the_float64_model():
  # The AVX2 copy has 8-bit loops of its own (8 lanes; a block's last n % 8
  # values go value by value). This file's rule tests, in a process that runs it.
  env = dict(os.environ, JAX_PLATFORMS="cpu", OPTAX_HYBRID_NATIVE_ISA="avx2",
             PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]
                                        + [q for q in [os.environ.get("PYTHONPATH")] if q]))
  tests = ("equals_reference or against_float64_model or every_threshold or zero_blocks or above_2_126 "
           "or non_finite or skipped_step")
  result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", __file__,
                           "-k", tests], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
  assert " passed" in result.stdout and " failed" not in result.stdout
  passed = int(result.stdout.strip().splitlines()[-1].split(" passed")[0].split()[-1])
  assert passed >= 15, result.stdout[-1000:]


@needs_native
def test_native_8bit_codes_on_and_beside_every_threshold():
  # b1 = b2 = 0: the new moments are g and g * g exactly, and a 1.0 in each
  # block makes the scale 1, so each code is that of g (of g * g) itself: the
  # number of float32 thresholds strictly below it (a value on a threshold
  # takes the lower code), exactly. (The reference rule computes codes by
  # arithmetic, exact to float32 rounding: at these ties it may differ by one.)
  values = []
  for t in quantized.SIGNED_THRESHOLDS[:-1]:
    values += [t, np.nextafter(t, np.float32(-2)), np.nextafter(t, np.float32(2))]
  values = np.asarray(values + [0.0, -0.0, 1.0, -1.0, np.finfo(np.float32).tiny, -np.finfo(np.float32).tiny],
                      np.float32)
  # Subnormals are flushed to zero by XLA and by the kernel alike (not by NumPy): left out.
  values = values[(np.abs(values) <= 1) & ((values == 0) | (np.abs(values) >= np.finfo(np.float32).tiny))]
  # g * g for the second moment: the square roots of the unsigned thresholds and their neighbours.
  roots = np.sqrt(quantized.UNSIGNED_THRESHOLDS[:-1].astype(np.float64)).astype(np.float32)
  roots = np.concatenate([roots, np.nextafter(roots, np.float32(0)), np.nextafter(roots, np.float32(2))])
  block = quantized.BLOCK_SIZE - 1
  rows = [np.concatenate([[1.0], chunk, np.zeros(block - len(chunk))])
          for chunk in itertools.chain((values[i:i + block] for i in range(0, len(values), block)),
                                       (roots[i:i + block] for i in range(0, len(roots), block)))]
  g = np.asarray(rows, np.float32)
  zero = quantized.QuantizedMoment(jnp.zeros(g.shape, jnp.uint8), jnp.zeros(quantized.scales_shape(g.shape)))
  s = scalars(b1=0.0, b2=0.0, weight_decay=0.0, bias_correction=False)
  _, (mu,), (nu,) = run(native_cpu.update_leaves, [jnp.asarray(g)], [zero], [zero], [jnp.asarray(g)], [False],
                        [jnp.float32], s, adamw_mode=True, write_params=False)
  np.testing.assert_array_equal(np.asarray(mu.scales), 1.0)
  np.testing.assert_array_equal(np.asarray(mu.codes), np.searchsorted(quantized.SIGNED_THRESHOLDS, g, side="left"))
  np.testing.assert_array_equal(np.asarray(nu.codes),
                                np.searchsorted(quantized.UNSIGNED_THRESHOLDS, g * g, side="left"))


@needs_native
@pytest.mark.parametrize("write_params", [False, True])
def test_native_8bit_skipped_step_keeps_codes_and_scales(write_params):
  g, m, v, p = random_leaves(SHAPES, jnp.bfloat16, seed=3)
  decays = [True] * len(SHAPES)
  out_dtypes = [jnp.bfloat16 if write_params else jnp.float32] * len(SHAPES)
  first, mus, nus = run(native_cpu.update_leaves, g, m, v, p, decays, out_dtypes, scalars(step_ok=False),
                        adamw_mode=True, write_params=write_params)
  for i in range(len(SHAPES)):
    for new, old in ((mus[i], m[i]), (nus[i], v[i])):
      np.testing.assert_array_equal(np.asarray(new.codes), np.asarray(old.codes))
      np.testing.assert_array_equal(np.asarray(new.scales), np.asarray(old.scales))
    want = np.asarray(p[i], np.float32) if write_params else np.zeros(SHAPES[i], np.float32)
    np.testing.assert_array_equal(np.asarray(first[i], np.float32), want)


@needs_native
def test_native_8bit_zero_blocks_and_extreme_scales():
  shape = (4, 1024)
  rng = np.random.default_rng(4)
  g = rng.normal(size=shape).astype(np.float32)
  g[0] = 0.0                 # row 0: all-zero blocks (zero gradients, zero moments)
  g[1, :256] = 0.0           # a zero-gradient block whose moments decay
  g[2] *= 1e15               # huge: v near 1e30
  g[3] *= 1e-15              # tiny: v near 1e-30, still normal
  m = random_moment(rng, shape, True)
  v = random_moment(rng, shape, False)
  codes, scales = np.asarray(m.codes).copy(), np.asarray(m.scales).copy()
  codes[0], scales[0] = 127, 0.0
  m = quantized.QuantizedMoment(jnp.asarray(codes), jnp.asarray(scales))
  codes, scales = np.asarray(v.codes).copy(), np.asarray(v.scales).copy()
  codes[0], scales[0] = 0, 0.0
  v = quantized.QuantizedMoment(jnp.asarray(codes), jnp.asarray(scales))
  s = scalars(weight_decay=0.0)
  args = ([jnp.asarray(g)], [m], [v], [jnp.asarray(g)], [False], [jnp.float32], s)
  got = run(native_cpu.update_leaves, *args, adamw_mode=True, write_params=False)
  want = run(reference.update_leaves, *args, adamw_mode=True, write_params=False)
  for x in jax.tree.leaves(got):
    assert np.isfinite(np.asarray(x, np.float64)).all()
  (u,), (mu,), (nu,) = got
  np.testing.assert_array_equal(np.asarray(u)[0], 0.0)
  for new, zero_code in ((mu, 127), (nu, 0)):
    np.testing.assert_array_equal(np.asarray(new.scales)[0], 0.0)
    np.testing.assert_array_equal(np.asarray(new.codes)[0], zero_code)
  np.testing.assert_allclose(np.asarray(u), np.asarray(want[0][0]), rtol=4e-6, atol=1e-30)
  assert_new_moments_as_the_reference((mu, nu), (want[1][0], want[2][0]), (m, v), g.astype(np.float64),
                                      "extreme blocks")


@needs_native
def test_native_8bit_blocks_above_2_126_shrink_before_normalizing_as_the_reference():
  # First moments near 3e38: the reciprocal of such a scale is subnormal, so
  # both the kernel and the reference rule shrink the block by 2**-64 first
  # (quantized.normalize); without it every code would be the zero code.
  shape = (2, 512)
  rng = np.random.default_rng(6)
  g = jnp.asarray(rng.normal(size=shape) * 1e-3, jnp.float32)
  m, v = random_moment(rng, shape, True), random_moment(rng, shape, False)
  m = m._replace(scales=jnp.asarray([[3e38, 1.5e38], [1.0, 2e-3]], jnp.float32))
  v = v._replace(scales=jnp.full((2, 2), 1e36, jnp.float32))
  args = ([g], [m], [v], [g], [False], [jnp.float32], scalars(weight_decay=0.0))
  (u,), (mu,), (nu,) = run(native_cpu.update_leaves, *args, adamw_mode=True, write_params=False)
  (want_u,), (want_mu,), (want_nu,) = run(reference.update_leaves, *args, adamw_mode=True, write_params=False)
  assert float(mu.scales[0, 0]) > 2.0**126 and float(mu.scales[0, 1]) > 2.0**126
  assert len(np.unique(np.asarray(mu.codes)[0])) > 100  # the huge blocks keep their spread of codes
  np.testing.assert_allclose(np.asarray(u), np.asarray(want_u), rtol=4e-6)
  assert_new_moments_as_the_reference((mu, nu), (want_mu, want_nu), (m, v), np.asarray(g, np.float64), "huge blocks")


@needs_native
def test_native_8bit_non_finite_gradients_as_the_reference():
  # Without skip_nonfinite: a NaN makes its block's scales NaN (the block
  # decodes to NaN, the other blocks stay finite); an infinity makes them
  # infinite. The codes inside such a block carry nothing (NaN or infinite
  # times any code), and the two rules give a NaN different codes: only the
  # finite blocks' codes are compared.
  shape = (2, 600)
  rng = np.random.default_rng(5)
  g = rng.normal(size=shape).astype(np.float32)
  g[0, 10] = np.nan
  g[1, 300] = np.inf
  m, v = random_moment(rng, shape, True), random_moment(rng, shape, False)
  args = ([jnp.asarray(g)], [m], [v], [jnp.asarray(g)], [False], [jnp.float32], scalars())
  got = run(native_cpu.update_leaves, *args, adamw_mode=True, write_params=False)
  want = run(reference.update_leaves, *args, adamw_mode=True, write_params=False)
  np.testing.assert_allclose(np.asarray(got[0][0]), np.asarray(want[0][0]), rtol=1e-5, atol=1e-7, equal_nan=True)
  (m64, m_size), (v64, v_size) = new_moments64(g, m, v, g, decay=False, adamw_mode=True)
  for new, ref_new, x64, size64, signed in ((got[1][0], want[1][0], m64, m_size, True),
                                            (got[2][0], want[2][0], v64, v_size, False)):
    scales, ref_scales = np.asarray(new.scales), np.asarray(ref_new.scales)
    assert np.isnan(scales[0, 0]) and np.isinf(scales[1, 1])
    finite = np.isfinite(ref_scales)
    np.testing.assert_array_equal(np.isfinite(scales), finite)
    np.testing.assert_array_equal(scales[~finite], ref_scales[~finite])  # NaN where NaN, the same infinities
    decoded = np.asarray(quantized.dequantize(new, signed=signed))
    assert np.isnan(decoded[0, :256]).all() and np.isfinite(decoded[0, 256:]).all()
    assert np.isfinite(decoded[1, :256]).all() and np.isfinite(decoded[1, 512:]).all()
    with np.errstate(invalid="ignore"):
      for row in range(shape[0]):
        keep = np.repeat(finite[row], quantized.BLOCK_SIZE)[:shape[1]]
        assert_codes_match(np.asarray(new.codes)[row][keep], np.asarray(ref_new.codes)[row][keep], x64[row][keep],
                           size64[row][keep], ref_scales[row][finite[row]], signed, "finite blocks")


@needs_native
@pytest.mark.parametrize("tier", ["device", "host"])
def test_native_8bit_through_hybrid_adamw_matches_the_xla_rule(tier):
  rng = np.random.default_rng(6)
  params = {"w": jnp.asarray(rng.normal(size=(40, 300)), jnp.bfloat16),
            "b": jnp.asarray(rng.normal(size=(300,)), jnp.bfloat16)}  # under MIN_QUANTIZED_SIZE: float32 moments
  grads = [{k: jnp.asarray(rng.normal(size=x.shape), jnp.bfloat16) for k, x in params.items()} for _ in range(4)]
  results = {}
  for kernel in ("native", "xla"):
    tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, kernel=kernel, moment_format="8bit", tiers=tier)
    step = jax.jit(tx.step)
    p, s = params, tx.init(params)
    if kernel == "native":
      assert step.lower(p, s, grads[0]).as_text().count(f"custom_call @{native_cpu.TARGET}(") == 1
    for g in grads:
      p, s = step(p, s, g)
    results[kernel] = (p, s)
  (p_native, s_native), (p_xla, s_xla) = results["native"], results["xla"]
  assert isinstance(s_native.mu["w"], jax.Array) and s_native.mu["w"].dtype == jnp.uint8
  for k in params:
    np.testing.assert_allclose(np.asarray(p_native[k], np.float32), np.asarray(p_xla[k], np.float32), rtol=2**-7)
  # Four steps in, codes that took the other side of a tie have moved the
  # values they feed a little: nearly every code is still the same.
  for a, b in ((s_native.mu["w"], s_xla.mu["w"]), (s_native.nu["w"], s_xla.nu["w"])):
    assert np.mean(np.asarray(a) == np.asarray(b)) > 0.999
