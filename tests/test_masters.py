"""Master weight formats (``master="float32" | "kahan" | "stochastic"``), against float64 NumPy references.

* stochastic rounding: every result is one of the two neighbouring bf16/fp16
  values (found in the full table of the dtype's values), and the mean of many
  draws is the float32 value (unbiased);
* the Kahan term: a bit-exact NumPy model of ``param + term`` (float32 sums,
  ml_dtypes roundings) stepped by SGD, and the float64 sum of the steps it
  tracks where a bf16 param alone stalls;
* every tier and kernel gives the xla reference's bits, with float and 8-bit
  moments; checkpoints restore across master formats; the memory report
  counts what each keeps.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import optax_hybrid
from optax_hybrid import masters

BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(jnp.float16)


# ---------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------


def test_master_dtype_float32_is_master_float32():
  params = {"w": jnp.linspace(-1, 1, 64, dtype=jnp.bfloat16)}
  grads = {"w": jnp.cos(jnp.arange(64.0)).astype(jnp.bfloat16)}
  old, new = (optax_hybrid.hybrid_adamw(1e-3, **kw) for kw in ({"master_dtype": jnp.float32}, {"master": "float32"}))
  s_old, s_new = old.init(params), new.init(params)
  assert s_old.plan == s_new.plan and s_new.plan.leaves[0].master == masters.FORMATS["float32"]
  p_old, s_old = old.step(params, s_old, grads)
  p_new, s_new = new.step(params, s_new, grads)
  np.testing.assert_array_equal(np.asarray(p_old["w"], np.float32), np.asarray(p_new["w"], np.float32))
  np.testing.assert_array_equal(np.asarray(s_old.master["w"]), np.asarray(s_new.master["w"]))


@pytest.mark.parametrize("make", [optax_hybrid.hybrid_adamw, optax_hybrid.hybrid_lion, optax_hybrid.hybrid_sgd,
                                  optax_hybrid.hybrid_adagrad])
def test_bad_master_arguments_name_the_argument_and_the_fix(make):
  with pytest.raises(ValueError, match=r"unknown `master`='bf16'; accepted values are 'float32', 'kahan', "
                                       r"'stochastic', a real floating dtype such as jnp.float32"):
    make(1e-3, master="bf16")
  with pytest.raises(ValueError, match=r"unknown `master`=<class 'jax.numpy.int32'> \(dtype int32\)"):
    make(1e-3, master=jnp.int32)


def test_a_master_dtype_is_the_copy_in_it():
  params = {"w": jnp.ones(4, jnp.bfloat16)}
  as_name, as_dtype = (optax_hybrid.hybrid_adamw(1e-3, master=m).init(params) for m in ("float32", jnp.float32))
  assert as_name.plan == as_dtype.plan and as_dtype.master["w"].dtype == jnp.float32


def test_the_building_block_takes_no_master():
  with pytest.raises(TypeError, match="unexpected keyword argument 'master'"):
    optax_hybrid.scale_by_hybrid_adam(master="kahan")


# ---------------------------------------------------------------------------
# Stochastic rounding against the table of every value of the dtype
# ---------------------------------------------------------------------------


def _neighbours(x: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
  """The largest value of ``dtype`` <= x and the smallest >= x, from the sorted table of all its finite values."""
  with np.errstate(invalid="ignore"):  # the NaN bit patterns
    table = np.arange(2**16, dtype=np.uint16).view(dtype).astype(np.float64)
  table = np.unique(table[np.isfinite(table)])
  x = x.astype(np.float64)
  hi = table[np.searchsorted(table, x, side="left")]
  lo = table[np.searchsorted(table, x, side="right") - 1]
  return lo, hi


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
def test_stochastic_rounding_gives_a_neighbour_and_is_unbiased(dtype):
  rng = np.random.default_rng(0)
  # Normal values over many binades, both signs, values the dtype holds exactly, and float16 subnormals.
  x = np.concatenate([rng.uniform(-1, 1, 3000) * 2.0 ** rng.integers(-12, 12, 3000),
                      np.asarray([1.0, -2.0, 0.5, 0.0], np.float64),
                      rng.uniform(-1, 1, 200) * 2.0**-20]).astype(np.float32)
  lo, hi = _neighbours(x, dtype)
  draws = []
  for count in range(64):  # the seed changes with the step count
    bits = masters.random_bits(masters.step_seed(jnp.int32(count), 7)[0], masters.positions(x.shape))
    got = np.asarray(masters.stochastic_round(jnp.asarray(x), dtype, bits)).astype(np.float64)
    assert np.all((got == lo) | (got == hi)), "a result that is not a neighbour"
    draws.append(got)
  exact = lo == hi
  np.testing.assert_array_equal(np.stack(draws)[:, exact], np.broadcast_to(x[exact], (64, exact.sum())))
  # Unbiased: one value drawn at 20000 positions; the mean is x within 5 standard errors.
  for value in np.float32([1.0 + 2**-12, -3.3e-3, 0.7, 123.456]):  # none held exactly by either dtype
    lo1, hi1 = _neighbours(np.asarray([value]), dtype)
    n = 20000
    bits = masters.random_bits(masters.step_seed(jnp.int32(3), 11)[0], masters.positions((n,)))
    got = np.asarray(masters.stochastic_round(jnp.full((n,), value), dtype, bits)).astype(np.float64)
    p_up = (float(value) - lo1[0]) / (hi1[0] - lo1[0])
    stderr = (hi1[0] - lo1[0]) * np.sqrt(p_up * (1 - p_up) / n)
    assert abs(got.mean() - float(value)) < 5 * stderr + 1e-12, (value, got.mean())


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
def test_stochastic_rounding_goes_up_exactly_when_the_draw_is_below_the_fraction(dtype):
  # The rule: up (to hi) when the uniform draw u (the top 24 of the bits, times 2**-24) is below
  # (x - lo) / (hi - lo). Draw 0 rounds every inexact value up, the largest draw rounds it down: every
  # float32 bit pattern, its last mantissa bits included. mutmut: masters.stochastic_round 14 (the
  # exponent mask 0x7F800000 -> 0x7F800001, which moved x with an odd last bit across the floor) survived
  # the random draws (it changes a result with probability about 2**-16).
  rng = np.random.default_rng(2)
  patterns = rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32)
  x = patterns.view(np.float32)
  x = x[np.isfinite(x) & (np.abs(x) > 2.0**-14) & (np.abs(x) < 6e4)]  # dtype's normal range (float16's)
  x = np.concatenate([x, np.float32([1.5 + 2**-23, -1.5 - 2**-23, 1.0 + 2**-23])])
  lo, hi = _neighbours(x, dtype)
  for bits, want in ((0, hi), (2**32 - 1, lo)):
    got = np.asarray(masters.stochastic_round(jnp.asarray(x), dtype, jnp.full(x.shape, bits, jnp.uint32)))
    np.testing.assert_array_equal(got.astype(np.float64), want)


def test_stochastic_rounding_passes_infinities_and_nans_through():
  x = jnp.asarray([np.inf, -np.inf, np.nan, 1e30], jnp.float32)
  got = np.asarray(masters.stochastic_round(x, BF16, masters.positions((4,))).astype(jnp.float32))
  assert got[0] == np.inf and got[1] == -np.inf and np.isnan(got[2]) and np.isfinite(got[3])


def test_random_bits_are_a_function_of_count_leaf_and_position():
  at = lambda count, salt, shape=(8,), offset=0: np.asarray(
      masters.random_bits(masters.step_seed(jnp.int32(count), salt)[0], masters.positions(shape, offset)))
  np.testing.assert_array_equal(at(5, 1), at(5, 1))
  assert not np.array_equal(at(5, 1), at(6, 1)) and not np.array_equal(at(5, 1), at(5, 2))
  np.testing.assert_array_equal(at(5, 1, (16,))[8:], at(5, 1, (8,), offset=8))  # a tile draws its own bits


# ---------------------------------------------------------------------------
# Kahan: a bit-exact NumPy model, and the float64 sum it tracks
# ---------------------------------------------------------------------------


def _kahan_model(p0: np.ndarray, updates: list) -> tuple[np.ndarray, np.ndarray]:
  """``param + term``: the float32 value plus the step, rounded to bf16, and what rounding dropped, in bf16."""
  p, c = p0.astype(BF16), np.zeros(p0.shape, BF16)
  for u in updates:
    w = (p.astype(np.float32) + c.astype(np.float32)) + u.astype(np.float32)
    p = w.astype(BF16)
    c = (w - p.astype(np.float32)).astype(BF16)
  return p, c


@pytest.mark.parametrize("master", ["kahan", "stochastic", None])
def test_small_sgd_steps_accumulate_against_the_float64_sum(master):
  # Steps of 1e-4 on params near 1: far below half a bf16 unit (2**-8), so a
  # bf16 param alone never moves, and the formats must carry them.
  n, steps, lr = 4096, 150, 1e-4
  p0 = np.full(n, 1.0, np.float32)
  g = np.random.default_rng(1).uniform(0.5, 1.5, n).astype(np.float32)
  tx = optax_hybrid.hybrid_sgd(lr, master=master, kernel="xla")
  params = {"w": jnp.asarray(p0, jnp.bfloat16)}
  state = tx.init(params)
  step = jax.jit(tx.step)
  for _ in range(steps):
    params, state = step(params, state, {"w": jnp.asarray(g, jnp.bfloat16)})
  g_bf16 = g.astype(BF16).astype(np.float64)
  exact = p0.astype(np.float64) - steps * lr * g_bf16  # float64: the sum of the steps
  got = np.asarray(params["w"]).astype(np.float64)
  if master is None:
    np.testing.assert_array_equal(got, p0)  # the stall every format must avoid
  elif master == "kahan":
    want_p, want_c = _kahan_model(p0, [np.float32(-lr) * g.astype(BF16).astype(np.float32)] * steps)
    np.testing.assert_array_equal(np.asarray(params["w"]).view(np.uint16), want_p.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(state.master["w"]).view(np.uint16), want_c.view(np.uint16))
    value = got + np.asarray(state.master["w"]).astype(np.float64)
    # A step loses at most half a unit in the last place of the term (|term| <= 2**-9 near 1: 2**-18), against
    # the 0.0150 that the steps move in all: the param alone keeps none of it.
    np.testing.assert_allclose(value, exact, rtol=0, atol=steps * 2**-18)
    assert np.abs(value - exact).mean() < 0.02 * np.abs(exact - p0).mean()
  else:  # unbiased: the mean over 4096 independent elements is the exact sum's
    assert state.master is None
    assert abs((got - exact).mean()) < 5 * 2**-7 / np.sqrt(n)


# ---------------------------------------------------------------------------
# Every tier and kernel: the xla reference's bits
# ---------------------------------------------------------------------------


def _params():
  rng = np.random.default_rng(2)
  return {"w": jnp.asarray(rng.normal(size=(16, 512)), jnp.bfloat16),  # 8-bit moments take it
          "h": jnp.asarray(rng.normal(size=(7, 33)), jnp.float16),
          "b": jnp.asarray(rng.normal(size=(5,)), jnp.bfloat16),
          "f": jnp.asarray(rng.normal(size=(3,)), jnp.float32)}  # no master


def _grads(k):
  return jax.tree.map(lambda p: (jnp.sin(jnp.arange(p.size, dtype=jnp.float32) * (k + 1.3)).reshape(p.shape)
                                 * 0.1).astype(p.dtype), _params())


def _numpy(tree):
  return {k: np.asarray(v) for k, v in tree.items()} if tree is not None else None


def _bits(tree):
  return {k: v.view(np.uint8) for k, v in tree.items()} if tree is not None else None


def _run(master, moment_format, tmp_path, *, fused=True, **options):
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, master=master, moment_format=moment_format,
                                 nvme_offload_dir=tmp_path, **options)
  params = _params()
  state = tx.init(params)
  step = jax.jit(tx.step) if fused else jax.jit(lambda p, s, g: _update_then_apply(tx, p, s, g))
  for k in range(3):
    params, state = step(params, state, _grads(k))
  out = (_numpy(params), _numpy(state.master), [_numpy(m) for m in optax_hybrid.moment_values(state)])
  tx.close()
  return out


def _update_then_apply(tx, params, state, grads):
  updates, state = tx.update(grads, state, params)
  assert all(u.dtype == jnp.float32 for k, u in updates.items() if k != "f")
  return optax_hybrid.apply_updates(params, updates), state


VARIANTS = {
    "pallas": {"kernel": "pallas"},
    "native": {"kernel": "native"},
    "host_state": {"state_memory_kind": "host_state", "kernel": "xla"},
    "host": {"state_memory_kind": "host", "kernel": "native"},
    "disk": {"state_memory_kind": "disk", "kernel": "xla"},
    "offload_fraction": {"state_memory_kind": optax_hybrid.by_fraction(host=0.5), "kernel": "pallas"},
}


@functools.lru_cache(maxsize=None)
def _reference(master, moment_format, tmp_path):
  return _run(master, moment_format, tmp_path, kernel="xla")


def _values(run):
  """Each bf16/fp16 leaf's float32 value (param plus Kahan term, where kept) and the moments, as float64."""
  params, master, moments = run
  values = {k: v.astype(np.float64) + (0 if master is None or k == "f" else master[k].astype(np.float64))
            for k, v in params.items()}
  return values, [{k: v.astype(np.float64) for k, v in m.items()} for m in moments]


@pytest.mark.parametrize("moment_format", [None, "8bit"])
@pytest.mark.parametrize("master", ["kahan", "stochastic"])
def test_every_tier_and_kernel_gives_the_reference_bits(master, moment_format, tmp_path_factory):
  base = tmp_path_factory.mktemp("disk")
  want = _reference(master, moment_format, base)
  for name, options in VARIANTS.items():
    got = _run(master, moment_format, base, **options)
    if options["kernel"] != "pallas":  # the reference's own arithmetic (the native kernel declines the formats)
      # The float32 leaf "f" keeps no master: the native kernel takes it, in its own arithmetic.
      mastered = lambda tree: None if tree is None else _bits({k: v for k, v in tree.items() if k != "f"})
      for what, a, b in zip(("params", "master", "moments"), got, want):
        bits = lambda x: [mastered(t) for t in x] if isinstance(x, list) else mastered(x)
        np.testing.assert_equal(bits(a), bits(b), err_msg=f"{name}: {what}")
      np.testing.assert_allclose(got[0]["f"], want[0]["f"], rtol=1e-6, err_msg=name)
      continue
    # The Pallas kernel runs the same jax.numpy on tiles, compiled apart from the reference's fused loop: its
    # float32 arithmetic may differ in the last place (so does a float32 master's), never its random bits.
    (values, moments), (want_values, want_moments) = _values(got), _values(want)
    for k in values:
      # Kahan: param + term hold 16 bits, the term's last place 2**-17 of the value. Stochastic: the same draws,
      # so a param moves a unit (2**-8, fp16 2**-11) from the reference's only where that last place crosses
      # its threshold.
      rtol = 2**-16 if master == "kahan" else 2**-7
      np.testing.assert_allclose(values[k], want_values[k], rtol=rtol, atol=0, err_msg=f"{name}: {k}")
      assert np.mean(values[k] == want_values[k]) > 0.99, (name, k)
    for a, b in zip(moments, want_moments):
      jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-12), a, b)
  # update + apply_updates lands on the fused step's params.
  got = _run(master, moment_format, base, fused=False, kernel="xla")
  np.testing.assert_equal(_bits(got[0]), _bits(want[0]), err_msg="update then apply_updates")


@pytest.mark.parametrize("make", [functools.partial(optax_hybrid.hybrid_adamw, 1e-3),
                                  functools.partial(optax_hybrid.hybrid_lion, 1e-4),
                                  functools.partial(optax_hybrid.hybrid_adagrad, 1e-2),
                                  functools.partial(optax_hybrid.hybrid_sgd, 1e-2, momentum=0.9)],
                         ids=["adamw", "lion", "adagrad", "sgd"])
def test_every_rule_with_a_kahan_term_follows_its_float32_master(make):
  params = {k: v for k, v in _params().items() if k != "h"}
  grads = lambda k: {key: g for key, g in _grads(k).items() if key != "h"}
  runs, largest = {}, {key: np.abs(np.asarray(params[key], np.float64)) for key in ("w", "b")}
  for master in ("float32", "kahan"):
    tx = make(master=master, kernel="xla")
    p, s = params, tx.init(params)
    for k in range(5):
      p, s = tx.step(p, s, grads(k))
      if master == "float32":  # the weights' path
        largest = {key: np.maximum(v, np.abs(np.asarray(s.master[key], np.float64))) for key, v in largest.items()}
    runs[master] = (p, s)
  for key in ("w", "b"):
    value = (np.asarray(runs["kahan"][0][key], np.float64)
             + np.asarray(runs["kahan"][1].master[key], np.float64))
    # Each step loses at most half a unit in the term's last place: 2**-18 of the weight's magnitude on its way
    # (a bf16 param's binade spans 2x: 2**-17 of the largest magnitude).
    bound = 5 * 2**-17 * largest[key] + 1e-12
    np.testing.assert_array_less(np.abs(value - np.asarray(runs["float32"][1].master[key], np.float64)), bound)


# ---------------------------------------------------------------------------
# A new master format: a value in masters.FORMATS, nothing else
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Float32CopyThroughTheKernel(masters.MasterFormat):
  """A float32 copy read and written through the master operands (not stepped as the param, as "float32" is)."""

  name: str = "copy_through_the_kernel"
  reads_param: bool = False

  def stored_dtype(self, param_dtype):
    return np.dtype(np.float32)

  def initial(self, param):
    return param

  def from_value(self, value, param):
    return np.asarray(value, np.float32)

  def value(self, param, operand):
    return operand.astype(jnp.float32)

  def write(self, value, param_dtype, operand, positions):
    return value.astype(param_dtype), value.astype(jnp.float32)


@pytest.mark.parametrize("options", [dict(kernel="xla"), dict(kernel="pallas"), dict(kernel="native"),
                                     dict(state_memory_kind="host_state", kernel="xla"), dict(state_memory_kind="host", kernel="native")],
                         ids=["xla", "pallas", "native", "host_state", "host"])
def test_a_new_master_format_is_one_value_in_masters(options, monkeypatch):
  # docs/architecture.md: a new master format is one MasterFormat value in masters.py, registered in FORMATS; the
  # engine (plan, pipeline, every kernel and tier) asks it what it needs. This one follows "float32"'s weights.
  monkeypatch.setitem(masters.FORMATS, "copy_through_the_kernel", _Float32CopyThroughTheKernel())
  params = {k: v for k, v in _params().items() if k != "h"}
  runs = {}
  for master in ("float32", "copy_through_the_kernel"):
    tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, master=master, **options)
    p, s = params, tx.init(params)
    assert s.plan.leaves[0].master == masters.FORMATS[master] and s.master["w"].dtype == jnp.float32
    step = jax.jit(tx.step)
    for k in range(3):
      p, s = step(p, s, {key: g for key, g in _grads(k).items() if key != "h"})
    runs[master] = (_numpy(p), _numpy(s.master))
  (p_new, m_new), (p_f32, m_f32) = runs["copy_through_the_kernel"], runs["float32"]
  for key in ("w", "b"):
    np.testing.assert_allclose(m_new[key], m_f32[key], rtol=1e-6, atol=1e-9, err_msg=key)
    np.testing.assert_array_equal(p_new[key], np.asarray(m_new[key]).astype(p_new[key].dtype), err_msg=key)


# ---------------------------------------------------------------------------
# Checkpoints across master formats
# ---------------------------------------------------------------------------


def test_checkpoints_restore_across_master_formats(tmp_path):
  manager = optax_hybrid.checkpoint.manager(tmp_path / "ckpt", max_to_keep=None)
  params = {k: v for k, v in _params().items() if k != "h"}
  txs = {m: optax_hybrid.hybrid_adamw(1e-3, master=m, kernel="xla") for m in ("float32", "kahan", "stochastic")}
  from_params = lambda restored: restored["params"]
  grads = lambda k: {key: g for key, g in _grads(k).items() if key != "h"}
  p, s = params, txs["float32"].init(params)
  for k in range(3):
    p, s = txs["float32"].step(p, s, grads(k))
  optax_hybrid.checkpoint.save(manager, 1, {"params": p, "opt": s}, wait=True)
  f32_master = np.asarray(s.master["w"])

  # float32 -> kahan: the term is the copy minus its param (the param is the copy rounded).
  like = {"params": params, "opt": txs["kahan"].init(params)}
  with pytest.raises(ValueError, match=r"in another master format than `like`.*masters_from="):
    optax_hybrid.checkpoint.restore(manager, like, step=1)
  r = optax_hybrid.checkpoint.restore(manager, like, step=1, masters_from=from_params)
  term = np.asarray(r["opt"].master["w"])
  assert term.dtype == BF16 and r["opt"].master["f"].shape == (0,)
  np.testing.assert_array_equal(term, (f32_master - np.asarray(p["w"], np.float32)).astype(BF16))
  np.testing.assert_allclose(np.asarray(p["w"], np.float64) + term.astype(np.float64), f32_master, rtol=2**-16)
  for a, b in zip(optax_hybrid.moment_values(r["opt"]), optax_hybrid.moment_values(s)):
    jax.tree.map(np.testing.assert_array_equal, a, b)
  p, s = r["params"], r["opt"]
  p, s = txs["kahan"].step(p, s, grads(4))
  optax_hybrid.checkpoint.save(manager, 2, {"params": p, "opt": s}, wait=True)

  # kahan -> float32: the copy is param + term, exactly (float32 holds both).
  like = {"params": params, "opt": txs["float32"].init(params)}
  back = optax_hybrid.checkpoint.restore(manager, like, step=2, masters_from=from_params)
  np.testing.assert_array_equal(np.asarray(back["opt"].master["w"]),
                                np.asarray(p["w"], np.float32) + np.asarray(s.master["w"], np.float32))

  # kahan -> stochastic: nothing kept (the term is not read); stochastic -> kahan: the term starts at zero,
  # and needs no params.
  like = {"params": params, "opt": txs["stochastic"].init(params)}
  r = optax_hybrid.checkpoint.restore(manager, like, step=2)
  assert r["opt"].master is None
  p, s = txs["stochastic"].step(r["params"], r["opt"], grads(5))
  optax_hybrid.checkpoint.save(manager, 3, {"params": p, "opt": s}, wait=True)
  r = optax_hybrid.checkpoint.restore(manager, {"params": params, "opt": txs["kahan"].init(params)}, step=3)
  np.testing.assert_array_equal(np.asarray(r["opt"].master["w"], np.float32), 0.0)
  jax.tree.map(np.testing.assert_array_equal, r["params"], p)
  for a, b in zip(optax_hybrid.moment_values(r["opt"]), optax_hybrid.moment_values(s)):
    jax.tree.map(np.testing.assert_array_equal, a, b)
  # stochastic -> float32: the copy is built from the param, as init builds it.
  r = optax_hybrid.checkpoint.restore(manager, {"params": params, "opt": txs["float32"].init(params)}, step=3,
                                      masters_from=from_params)
  np.testing.assert_array_equal(np.asarray(r["opt"].master["w"]), np.asarray(p["w"], np.float32))
  manager.close()


# ---------------------------------------------------------------------------
# Memory report
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("master, kept", [("float32", 4), ("kahan", 2), ("stochastic", 0), (None, 0)])
def test_the_memory_report_counts_what_each_format_keeps(master, kept):
  params = {"w": jnp.zeros((64, 64), jnp.bfloat16), "f": jnp.zeros((10,), jnp.float32)}
  tx = optax_hybrid.hybrid_adamw(1e-3, master=master, state_memory_kind="host_state")
  report = optax_hybrid.memory_report(params, tx.init(params))
  assert report.by_component["master_weights"]["host"] == kept * 64 * 64
  assert report.by_component["master_weights"]["device"] == 0
  # bf16 moments (the param's dtype) and the master, on the host; the f32 leaf keeps 8 B of moments.
  assert report.host_bytes == (4 + kept) * 64 * 64 + 8 * 10


# ---------------------------------------------------------------------------
# What a GPU would be given
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("master", ["kahan", "stochastic"])
def test_lowered_for_cuda_the_formats_run_inside_the_triton_launch(master):
  from optax_hybrid.gpu_compile import gpu_launches
  from optax_hybrid.kernels import lowering_for

  params = {"w": jax.ShapeDtypeStruct((300, 40), jnp.bfloat16), "b": jax.ShapeDtypeStruct((7,), jnp.float16)}
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, master=master, kernel="pallas", skip_nonfinite=True)
  with lowering_for("cuda"):
    text = jax.jit(tx.step).trace(params, jax.eval_shape(tx.init, params), params).lower(
        lowering_platforms=("cuda",)).as_text()
  assert gpu_launches(text) == 1
  # The rounding is inside the launch: no float32 -> bf16 conversion of a whole leaf around it.
  assert not any("stablehlo.convert" in line and "tensor<300x40xf32>" in line and "bf16" in line
                 for line in text.splitlines())


def test_positions_are_row_major_indices_modulo_2_to_the_32_for_any_leaf_size():
  for shape in [(3, 4, 5), (7,), (), (1, 6), (2, 1, 3)]:
    want = (np.arange(int(np.prod(shape)), dtype=np.uint64).reshape(shape) + 10).astype(np.uint32)
    np.testing.assert_array_equal(np.asarray(masters.positions(shape, 10)), want)
  # A stacked leaf of more than 2**32 elements (64 layers of 4096 x 11008) traces: positions wrap, as uint32 does
  # (a flat iota of its size raised OverflowError).
  big = jax.eval_shape(lambda: masters.positions((64, 4096, 11008)))
  assert big.shape == (64, 4096, 11008) and big.dtype == jnp.uint32
  # A slice of rows of such a leaf may start past 2**32 (a Python int offset): wrapped too.
  start = 162 * 4096 * 11008
  np.testing.assert_array_equal(np.asarray(masters.positions((2, 3), start)),
                                ((np.arange(6, dtype=np.uint64) + start) % 2**32).astype(np.uint32).reshape(2, 3))


@pytest.mark.skipif(not optax_hybrid.kernels.native_cpu.available(), reason="native kernel: not built")
@pytest.mark.parametrize("tiers", ["device", "host"])
def test_a_float32_master_with_float32_gradients_runs_in_the_native_kernel_as_the_reference(tiers):
  # bf16 params, float32 gradients and moments: the native kernel steps the float32 master as the param (kernels.reference.
  # with_master_as_param), in host compute too, where its call must be emitted directly (no
  # platform_dependent: lowered for two platforms, nested ones type their outputs' memory kinds apart).
  # mutmut: kernels.native_cpu.update_leaves 31 (`direct` dropped in that path) survived.
  rng = np.random.default_rng(4)
  params = {"w": jnp.asarray(rng.normal(size=(24, 16)), jnp.bfloat16), "b": jnp.asarray(rng.normal(size=16), jnp.bfloat16)}
  grads = [{k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in params.items()} for _ in range(3)]
  runs = {}
  for kernel in ("native", "xla"):
    tx = optax_hybrid.hybrid_adamw(1e-2, master="float32", moment_format="float32",
                                   state_memory_kind=tiers, kernel=kernel)
    p, s = params, tx.init(params)
    step = jax.jit(tx.step)
    if kernel == "native":
      assert "optax_hybrid_adamw_cpu" in step.lower(p, s, grads[0]).as_text()
      # Lowered for a GPU and a CPU at once (kernels.lowering_for): the host group's platform_dependent
      # picks the native kernel for the CPU, whose own call is then emitted directly.
      with optax_hybrid.kernels.lowering_for("cuda", "cpu"):
        both = step.trace(p, s, grads[0]).lower(lowering_platforms=("cuda", "cpu")).as_text()
      assert "optax_hybrid_adamw_cpu" in both
    for g in grads:
      p, s = step(p, s, g)
    runs[kernel] = (p, s.master, s.mu, s.nu)
  for got, want in zip(jax.tree.leaves(runs["native"]), jax.tree.leaves(runs["xla"])):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=1e-5, atol=1e-7)
