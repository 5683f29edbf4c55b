"""A moment format is a value (optax_hybrid.moments): one defined here alone runs through the engine.

``Fp8PerBlock`` stores each field as float8 ``e4m3`` codes and a float32 scale
per block of 32 values along the last axis (the block's largest magnitude over
448, e4m3's largest value), a format no module of the package knows. What must
hold:

* ``moment_format=`` takes it; ``init`` keeps the arrays it names (codes in
  ``mu``, scales in ``mu_scales``) for the leaves it applies to, the others as
  stored;
* every tier (device, host_state, host, disk) and every kernel asked for
  (the custom kernels do not name it: the reference rule, which asks the
  format to decode and encode) steps its leaves' same numbers, bit for bit, and
  those of a float64 NumPy AdamW whose moments are stored the same way
  (written here with ml_dtypes, apart from the format's jnp code);
* ``moment_values`` and the plan's state bytes ask the format;
* a checkpoint saved mid-run restores and steps on as the run that did not stop.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import optax_hybrid
from optax_hybrid import moments, placement, plan as plan_lib

BLOCK, E4M3_MAX = 32, 448.0
F8 = np.dtype(ml_dtypes.float8_e4m3fn)


class Fp8Moment(NamedTuple):
  """Named unlike the 8-bit format's record: the engine reaches the arrays only through the format (arrays_of)."""

  e4m3: jax.Array
  block_scales: jax.Array


@dataclasses.dataclass(frozen=True)
class Fp8PerBlock(moments.MomentFormat):
  """float8 e4m3 codes and a float32 scale per block of 32 along the last axis."""

  name: str = "fp8 e4m3 per block"
  value_dtype: object = np.dtype(np.float32)
  suffixes: tuple = ("_scales",)
  in_row_slices: bool = True

  def applies_to(self, shape, dtype, last_axis_shards=1):
    return len(shape) >= 1 and shape[-1] % BLOCK == 0 and jnp.issubdtype(dtype, jnp.floating)

  def arrays(self, shape, dtype):
    return (("", tuple(shape), F8), ("_scales", (*shape[:-1], shape[-1] // BLOCK), np.dtype(np.float32)))

  def initial(self, shape, dtype, fill, *, signed):
    return [None, None] if fill is None else list(self.encode(jnp.full(shape, fill, jnp.float32), like=None,
                                                               signed=signed))

  def encode(self, values, *, like, signed):
    blocks = values.astype(jnp.float32).reshape(*values.shape[:-1], -1, BLOCK)
    scales = jnp.max(jnp.abs(blocks), axis=-1) / E4M3_MAX
    # No bare constants (host compute types them as device values): an all-zero block divides by 1.
    safe = (scales + (scales == 0).astype(jnp.float32))[..., None]
    codes = (blocks / safe).astype(F8)
    return Fp8Moment(codes.reshape(values.shape), scales)

  def decode(self, stored, *, signed):
    codes = stored.e4m3.astype(jnp.float32)
    blocks = codes.reshape(*codes.shape[:-1], -1, BLOCK) * stored.block_scales[..., None]
    return blocks.reshape(codes.shape)

  def stored(self, arrays):
    return Fp8Moment(*arrays)

  def arrays_of(self, stored):
    return list(stored)


FP8 = Fp8PerBlock()
LR, B1, B2, EPS, WD, STEPS = 1e-2, 0.9, 0.999, 1e-8, 0.1, 3


def params():
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.normal(size=(8, 64)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(10,)), jnp.float32)}  # 10 values: not a whole block, kept as stored


def grads(k):
  rng = np.random.default_rng(100 + k)
  return {"w": jnp.asarray(rng.normal(size=(8, 64)) * 10.0 ** rng.integers(-3, 2, size=(8, 1)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(10,)), jnp.float32)}


def numpy_reference():
  """AdamW in float64, ``w``'s moments stored as float8 e4m3 per block of 32 (ml_dtypes), ``b``'s as float32."""
  def stored(x):
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, BLOCK)
    scales = np.max(np.abs(blocks), axis=-1) / np.float32(E4M3_MAX)
    with np.errstate(divide="ignore", invalid="ignore"):
      codes = np.where(scales[..., None] == 0, 0, blocks / scales[..., None]).astype(F8)
    return (codes.astype(np.float64) * scales[..., None].astype(np.float64)).reshape(x.shape)

  # The hyperparameters as the step holds them, float32 (1 - b2 in float32 is 1.3e-5 off 0.001).
  b1, b2, lr, eps, wd = (float(np.float32(x)) for x in (B1, B2, LR, EPS, WD))
  p = {k: np.asarray(v, np.float64) for k, v in params().items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  for t in range(1, STEPS + 1):
    g = {k: np.asarray(x, np.float64) for k, x in grads(t - 1).items()}
    for k in p:
      m_new, v_new = b1 * m[k] + (1 - b1) * g[k], b2 * v[k] + (1 - b2) * g[k] ** 2
      update = (m_new / (1 - b1 ** t)) / (np.sqrt(v_new / (1 - b2 ** t)) + eps)
      p[k] = p[k] - lr * (update + wd * p[k])
      m[k], v[k] = (stored(m_new), stored(v_new)) if k == "w" else (m_new, v_new)
  return p, m, v


def run(tier: str, kernel: str):
  kinds = {"device": {}, "disk": dict(tiers="disk")}.get(tier, dict(state_memory_kind=tier))
  tx = optax_hybrid.hybrid_adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, moment_format=FP8, kernel=kernel,
                                 **kinds)
  p, state = optax_hybrid.commit((params(), tx.init(params())))
  step = jax.jit(tx.step)
  for k in range(STEPS):
    p, state = step(p, state, grads(k))
  return tx, p, state


needs_host = pytest.mark.skipif("pinned_host" not in placement.available_memory_kinds(),
                                reason="no pinned_host memory on this backend")
CASES = [("device", "xla"), ("device", "native"), ("device", "pallas"),
         pytest.param("host_state", "auto", marks=needs_host), pytest.param("host", "auto", marks=needs_host),
         ("disk", "auto")]


def test_init_keeps_the_arrays_the_format_names():
  tx = optax_hybrid.hybrid_adamw(LR, moment_format=FP8)
  state = tx.init(params())
  w, b = (lp for lp in state.plan.leaves if lp.path == "['w']"), (lp for lp in state.plan.leaves
                                                                   if lp.path == "['b']")
  assert next(w).moments is FP8 and next(b).moments is moments.AS_STORED
  assert state.mu["w"].dtype == F8 and state.mu_scales["w"].shape == (8, 2)
  assert state.mu["b"].dtype == np.float32 and state.mu_scales["b"].size == 0
  lp = state.plan.leaves[[x.path for x in state.plan.leaves].index("['w']")]
  assert plan_lib.state_bytes(lp, (8, 64)) == 2 * (8 * 64 * 1 + 8 * 2 * 4)


@pytest.mark.parametrize("tier, kernel", CASES)
def test_every_tier_and_kernel_steps_the_numpy_reference(tier, kernel):
  tx, p, state = run(tier, kernel)
  want_p, want_m, want_v = numpy_reference()
  mu, nu = optax_hybrid.moment_values(state)
  for k in ("w", "b"):
    np.testing.assert_allclose(np.asarray(p[k]), want_p[k], rtol=2e-5, atol=1e-6, err_msg=k)
  # The stored moments: the same float8 codes as the reference but where float32 and float64 round a value
  # on either side of a code's boundary (one code apart at most).
  for got, want in ((mu["w"], want_m["w"]), (nu["w"], want_v["w"])):
    got = np.asarray(got, np.float64)
    same = np.isclose(got, want, rtol=1e-6, atol=0)
    assert same.mean() > 0.99, same.mean()
    np.testing.assert_allclose(got, want, rtol=0.13, atol=1e-30)
  tx.close() if hasattr(tx, "close") else None


def test_every_tier_and_kernel_steps_the_same_numbers():
  runs = {}
  for case in CASES:
    tier, kernel = case.values if hasattr(case, "values") else case
    if tier in ("host_state", "host") and "pinned_host" not in placement.available_memory_kinds():
      continue
    _, p, state = run(tier, kernel)
    mu, nu = optax_hybrid.moment_values(state)
    runs[tier, kernel] = [np.asarray(x["w"]) for x in (p, mu, nu)]  # the leaf in this format (b: each kernel's)
  first = next(iter(runs.values()))
  for case, got in runs.items():
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b, err_msg=str(case)), got, first)


def test_a_checkpoint_restores_and_steps_on(tmp_path):
  tx = optax_hybrid.hybrid_adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, moment_format=FP8)
  step = jax.jit(tx.step)
  p, state = optax_hybrid.commit((params(), tx.init(params())))
  p, state = step(p, state, grads(0))
  manager = optax_hybrid.checkpoint.manager(tmp_path / "ckpt")
  optax_hybrid.checkpoint.save(manager, 1, {"params": p, "state": state}, wait=True)
  straight = (p, state)
  for k in (1, 2):
    straight = step(*straight, grads(k))
  fresh = params()
  restored = optax_hybrid.checkpoint.restore(manager, like={"params": fresh, "state": tx.init(fresh)})
  assert restored["state"].mu["w"].dtype == F8
  resumed = (restored["params"], restored["state"])
  for k in (1, 2):
    resumed = step(*resumed, grads(k))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               (resumed[0], optax_hybrid.moment_values(resumed[1])),
               (straight[0], optax_hybrid.moment_values(straight[1])))


def test_a_leaf_larger_than_a_slice_is_stepped_in_slices_of_rows_with_the_same_numbers(monkeypatch):
  """The format's stored value is a pytree of arrays with the leaf's leading axes: the reference rule cuts it into
  slices of rows (``in_row_slices``), each stepped as a whole leaf, with the numbers of one pass."""
  from optax_hybrid.kernels import reference
  whole = [np.asarray(x["w"]) for x in (lambda r: (r[1], *optax_hybrid.moment_values(r[2])))(run("device", "xla"))]
  monkeypatch.setattr(reference, "SLICE_VALUES", 3 * 64)  # 8 rows of 64: slices of 3 rows, the last of 2
  seen = []
  original = reference._in_row_slices
  monkeypatch.setattr(reference, "_in_row_slices", lambda *a, **k: seen.append(1) or original(*a, **k))
  sliced = [np.asarray(x["w"]) for x in (lambda r: (r[1], *optax_hybrid.moment_values(r[2])))(run("device", "xla"))]
  assert seen, "the leaf was not stepped in slices"
  for a, b in zip(sliced, whole):
    np.testing.assert_array_equal(a, b)
