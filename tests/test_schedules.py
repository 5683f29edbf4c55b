"""Tests for optax_hybrid.schedules against published values and a float64 formula."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_hybrid
from numpy_reference import colossal_lr


# Worked values for base 1.0, W 10, total 100, eta_min 0.1 (reference.md,
# section 1: ColossalAI's values, with the floor instead of its rise at k=150).
PUBLISHED = [(0, 0.1), (5, 0.6), (10, 1.0), (55, 0.55), (100, 0.1), (150, 0.1)]


@pytest.mark.parametrize("k,expected", PUBLISHED)
def test_published_values(k, expected):
  sched = optax_hybrid.warmup_cosine_schedule(1.0, total_steps=100, warmup_steps=10, eta_min=0.1)
  np.testing.assert_allclose(float(sched(k)), expected, rtol=1e-6)
  np.testing.assert_allclose(float(sched(jnp.int32(k))), expected, rtol=1e-6)


@pytest.mark.parametrize("peak,total,warmup,eta_min", [
    (3e-4, 1000, 30, 3e-5), (1.0, 7, 0, 0.0), (0.5, 50, 49, 0.5), (2.0, 11, 3, 0.25),
])
def test_matches_float64_formula_everywhere(peak, total, warmup, eta_min):
  sched = optax_hybrid.warmup_cosine_schedule(peak, total, warmup, eta_min)
  ks = np.arange(0, total + 20)
  expected = np.array([colossal_lr(k, peak, total, warmup, eta_min) for k in ks])
  traced = jax.jit(jax.vmap(sched))(jnp.asarray(ks, jnp.int32))
  eager = np.array([float(sched(int(k))) for k in ks])
  np.testing.assert_allclose(np.asarray(traced), expected, rtol=2e-6, atol=1e-7 * peak)
  np.testing.assert_allclose(eager, expected, rtol=1e-6, atol=1e-8 * peak)


def test_first_update_is_not_at_zero_and_floor_holds():
  sched = optax_hybrid.warmup_cosine_schedule(1e-3, total_steps=1000, warmup_steps=100, eta_min=1e-4)
  assert float(sched(0)) == pytest.approx(1e-5)
  for k in (1000, 1500, 2000, 10**6):
    assert float(sched(k)) == pytest.approx(1e-4)
    assert float(jax.jit(sched)(jnp.int32(k))) == pytest.approx(1e-4)


def test_python_int_counts_past_int32():
  sched = optax_hybrid.warmup_cosine_schedule(1.0, total_steps=2**33, warmup_steps=2**31, eta_min=0.0)
  k = 2**31 + 2**31 // 2  # a third of the way into the cosine, past int32
  expected = colossal_lr(k, 1.0, 2**33, 2**31, 0.0)
  np.testing.assert_allclose(float(sched(k)), expected, rtol=1e-6)
  assert float(sched(2**40)) == 0.0
  np.testing.assert_allclose(float(sched(2**31 - 1)), (2**31) / 2**31, rtol=1e-6)


# Step numbers beyond what the count's dtype holds (Optax's counts are int32):
# the case of optax.warmup_cosine_decay_schedule(0, 1, 10, 3_000_000_000, 0.1),
# which works, and of warmup lengths past int32 too.
LONG_SCHEDULES = [(3_000_000_000, 10), (2**40, 2**35), (2**63 - 1, 2**31 - 1), (2**63 - 1, 2**62)]


@pytest.mark.parametrize("total,warmup", LONG_SCHEDULES)
def test_total_and_warmup_steps_beyond_int32(total, warmup):
  sched = optax_hybrid.warmup_cosine_schedule(1.0, total_steps=total, warmup_steps=warmup, eta_min=0.1)
  ks = [0, 5, 9, 10, 11, 2**24 + 1, 2**31 - 1]
  expected = np.array([colossal_lr(k, 1.0, total, warmup, 0.1) for k in ks])
  eager = np.asarray(sched(jnp.asarray(ks, jnp.int32)))  # eager jax.numpy on an int32 array of counts
  np.testing.assert_allclose(eager, expected, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(float(sched(jnp.int32(11))), expected[4], rtol=1e-6)  # one eager int32 count
  for dtype in (jnp.int32, jnp.uint32):
    traced = np.asarray(jax.jit(jax.vmap(sched))(jnp.asarray(ks, dtype)))
    np.testing.assert_allclose(traced, expected, rtol=1e-6, atol=1e-9, err_msg=str(dtype))
  # Python counts of any size, to the end of the schedule and past it.
  python_ks = ks + [total - 1, total, 2**63 - 1, 2**70]
  np.testing.assert_allclose([float(sched(k)) for k in python_ks],
                             [colossal_lr(k, 1.0, total, warmup, 0.1) for k in python_ks], rtol=1e-6, atol=1e-9)
  # After warmup both schedules are the same cosine: Optax's agrees where it is defined alike.
  optax_sched = optax.warmup_cosine_decay_schedule(0.0, 1.0, warmup, total, 0.1)
  after = [k for k in ks if k >= warmup]
  np.testing.assert_allclose(np.asarray(jax.jit(jax.vmap(sched))(jnp.asarray(after, jnp.int32))),
                             [float(optax_sched(k)) for k in after], rtol=1e-6)


def test_total_steps_beyond_int64_are_refused_when_built():
  with pytest.raises(ValueError, match=r"`total_steps` must be at most 2\*\*63 - 1"):
    optax_hybrid.warmup_cosine_schedule(1.0, total_steps=2**63)
  optax_hybrid.warmup_cosine_schedule(1.0, total_steps=2**63 - 1)  # the largest accepted


def test_first_update_of_hybrid_adamw_uses_peak_over_warmup():
  sched = optax_hybrid.warmup_cosine_schedule(0.5, total_steps=20, warmup_steps=5)
  tx = optax_hybrid.hybrid_adamw(sched, weight_decay=0.0, bias_correction=False, eps=0.0)
  params = {"w": jnp.zeros(3)}
  state = tx.init(params)
  # Without bias correction and eps, the first step is -lr * g / |g| = -lr * sign(g).
  updates, _ = tx.update({"w": jnp.array([2.0, -1.0, 4.0])}, state, params)
  np.testing.assert_allclose(updates["w"], -0.1 * (1 - 0.9) / np.sqrt(1 - 0.999) * np.array([1, -1, 1]), rtol=1e-5)


def test_works_with_optax_inject_hyperparams():
  sched = optax_hybrid.warmup_cosine_schedule(1.0, total_steps=10, warmup_steps=2, eta_min=0.1)
  tx = optax.inject_hyperparams(optax.sgd)(learning_rate=sched)
  params = jnp.zeros(())
  state = tx.init(params)
  lrs = []
  for _ in range(12):
    _, state = tx.update(jnp.ones(()), state)
    lrs.append(float(state.hyperparams["learning_rate"]))  # the lr this update used
  np.testing.assert_allclose(lrs, [colossal_lr(k, 1.0, 10, 2, 0.1) for k in range(12)], rtol=1e-6)


@pytest.mark.parametrize("kwargs,name", [
    (dict(peak_value=1.0, total_steps=10, warmup_steps=10), "total_steps"),
    (dict(peak_value=1.0, total_steps=10, warmup_steps=20), "total_steps"),
    (dict(peak_value=1.0, total_steps=10, warmup_steps=-1), "warmup_steps"),
    (dict(peak_value=-1.0, total_steps=10), "peak_value"),
    (dict(peak_value=1.0, total_steps=10, eta_min=-0.1), "eta_min"),
    (dict(peak_value=1.0, total_steps=10, eta_min=2.0), "eta_min"),
    (dict(peak_value=float("nan"), total_steps=10), "peak_value"),
])
def test_value_errors_name_the_argument(kwargs, name):
  with pytest.raises(ValueError, match=name):
    optax_hybrid.warmup_cosine_schedule(**kwargs)


@pytest.mark.parametrize("kwargs,name", [
    (dict(peak_value=1.0, total_steps=10.5), "total_steps"),
    (dict(peak_value="1", total_steps=10), "peak_value"),
    (dict(peak_value=1.0, total_steps=10, warmup_steps=True), "warmup_steps"),
])
def test_type_errors_name_the_argument(kwargs, name):
  with pytest.raises(TypeError, match=name):
    optax_hybrid.warmup_cosine_schedule(**kwargs)


# Tests added for surviving mutants of schedules.py (mutation testing, docs/records/testing.md).

def test_defaults_are_no_warmup_and_a_floor_of_zero():
  sched = optax_hybrid.warmup_cosine_schedule(2.0, total_steps=10)
  assert float(sched(0)) == 2.0 and float(sched(jnp.int32(0))) == 2.0  # the first update at the peak
  # Halfway down a cosine over all 10 steps (a 1-step warmup would also start
  # at the peak, but its cosine would span 9).
  assert float(sched(5)) == pytest.approx(1.0, rel=1e-6)
  assert float(sched(jnp.int32(5))) == pytest.approx(1.0, rel=1e-6)
  assert float(sched(10)) == 0.0 and float(sched(jnp.int32(25))) == 0.0


def test_a_zero_peak_is_a_valid_all_zero_schedule():
  sched = optax_hybrid.warmup_cosine_schedule(0.0, total_steps=10, warmup_steps=2)
  assert [float(sched(k)) for k in (0, 1, 5, 10, 20)] == [0.0] * 5


def test_float_counts_give_the_values_of_integer_counts():
  # A float step count (optax schedules accept one) takes the float branch of the count's range.
  sched = optax_hybrid.warmup_cosine_schedule(1.0, total_steps=100, warmup_steps=10, eta_min=0.1)
  ks = [0, 5, 9, 10, 11, 55, 99, 100, 150]
  expected = [colossal_lr(k, 1.0, 100, 10, 0.1) for k in ks]
  for dtype in (jnp.float32, jnp.bfloat16):
    got = [float(sched(jnp.asarray(k, dtype))) for k in ks]
    np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=str(dtype))


def test_a_narrow_integer_count_at_its_largest_value_reaches_a_step_equal_to_it():
  # int8 counts end at 127: warmup_steps=127 is reached at count 127 (the cosine's start, the peak), not
  # still in warmup (128/127 of the peak); the same for total_steps=127 (the floor).
  sched = optax_hybrid.warmup_cosine_schedule(1.0, total_steps=200, warmup_steps=127, eta_min=0.1)
  assert float(sched(jnp.int8(127))) == pytest.approx(colossal_lr(127, 1.0, 200, 127, 0.1), rel=1e-6) == 1.0
  assert float(sched(jnp.int8(126))) == pytest.approx(colossal_lr(126, 1.0, 200, 127, 0.1), rel=1e-6)
  sched = optax_hybrid.warmup_cosine_schedule(1.0, total_steps=127, warmup_steps=0, eta_min=0.1)
  assert float(sched(jnp.int8(127))) == pytest.approx(0.1, rel=1e-6)
