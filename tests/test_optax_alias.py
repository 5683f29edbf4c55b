"""Optax's own tests of its optimizers, run against ours: ``AliasTest`` of the installed optax.

``optax/_src/alias_test.py`` (shipped with optax) tests ``optax.adamw``,
``optax.lion``, ``optax.adagrad`` and ``optax.sgd`` among others: convergence
on a parabola and Rosenbrock's function (float32 and complex64), no recompile
on the second step, ``optax.tree.map_params``, extra update arguments,
``optax.inject_hyperparams`` (same updates and state), explicit state dtypes,
update dtypes, ``optax.MultiSteps`` and dtype stability under ``lax.cond``.
Here each of those test methods runs with the four names patched, in
``optax._src.alias``, to ``hybrid_adamw``, ``hybrid_lion``, ``hybrid_adagrad``
and ``hybrid_sgd`` (default tier), and must pass, but for the deliberate
differences below (docs/optimizer.md#differences-from-optaxadamw).

Selected, for CI's time: every method for the four optimizers (and
``test_explicit_dtype``'s ``sgd_mom`` and ``adamw`` cases), except that
``test_state_shape_dtype_shard_stability`` runs for bfloat16, float64 and
complex64 only (float16, float32 and complex128 add nothing our float32 step
does not already see; 10 of its 22 cases' time). The other optimizers of the
class are not ours and are not run.
"""

from __future__ import annotations

import re
import sys
import types
import unittest

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import optax_hybrid

from optax._src import alias  # noqa: E402


def _import_alias_test():
  """optax's alias_test module. It imports scikit-learn for its L-BFGS tests (not run here, and not among our
  dependencies): empty stand-ins while it is imported, taken out again after (torch's importer, in the same
  process, reads every module's spec)."""
  stand_ins = []
  for name in ("sklearn", "sklearn.datasets", "sklearn.linear_model"):
    try:
      __import__(name)
    except ImportError:
      sys.modules[name] = types.ModuleType(name)
      stand_ins.append(name)
  try:
    from optax._src import alias_test as module
  finally:
    for name in stand_ins:
      del sys.modules[name]
  return module


alias_test = _import_alias_test()

OURS = {"adamw": optax_hybrid.hybrid_adamw, "lion": optax_hybrid.hybrid_lion,
        "adagrad": optax_hybrid.hybrid_adagrad, "sgd": optax_hybrid.hybrid_sgd}
# test_explicit_dtype names its cases by optimizer: "sgd_mom" calls alias.sgd; "adam" is not ours.
CASE_NAMES = set(OURS) | {"sgd_mom"}
SKIPPED_STABILITY_DTYPES = ("float16", "float32", "complex128")


def case_params(method: str) -> str:
  """The parameters absl's ``parameterized`` recorded for a generated test method, as it prints them."""
  return getattr(getattr(alias_test.AliasTest, method), "__x_params_repr__", "")


def selected(method: str) -> bool:
  params = case_params(method)
  name = re.search(r"opt_name='(\w+)'", params)
  if not name or name.group(1) not in CASE_NAMES:
    return False
  if method.startswith("test_state_shape_dtype_shard_stability"):
    return not any(f"jax.numpy.{d}'" in params for d in SKIPPED_STABILITY_DTYPES)
  return True


CASES = sorted((m for m in dir(alias_test.AliasTest) if m.startswith("test") and selected(m)),
               key=lambda m: (re.sub(r"\d+$", "", m), int(re.search(r"\d+$", m).group())))


def deliberate_difference(method: str) -> str | None:
  """The documented message a case fails with on purpose, or None.

  A complex param with a real ``mu_dtype`` / ``accumulator_dtype``: Optax
  stores the complex moment cast to the real dtype (its imaginary part
  dropped); we refuse it at ``init``, naming the leaf (here the params are one
  array: ``<root>``).
  """
  params = case_params(method)
  if (method.startswith("test_explicit_dtype") and "params_dtype='complex64'" in params
      and re.search(r"state_dtype='(bfloat16|float32)'", params)):
    return "cannot hold `(mu|trace)` of the complex param <root> \\(complex64\\)"
  return None


@pytest.fixture
def ours_patched_into_optax(monkeypatch):
  for name, fn in OURS.items():
    monkeypatch.setattr(alias, name, fn)


def test_the_selection_covers_every_method_for_each_optimizer():
  methods = {re.sub(r"\d+$", "", m) for m in CASES}
  assert {"test_optimization", "test_optimizers_accept_extra_args",
          "test_optimizers_can_be_wrapped_in_inject_hyperparams", "test_explicit_dtype", "test_preserve_dtype",
          "test_state_shape_dtype_shard_stability", "test_gradient_accumulation"} <= methods
  for name in OURS:
    assert any(f"opt_name='{name}'" in case_params(m) for m in CASES if m.startswith("test_optimization")), name


def case_id(method: str) -> str:
  """The method and its parameters, without the addresses of functions (the same in every xdist worker)."""
  return (method + re.sub(r"<function (\w+) at 0x[0-9a-f]+>", r"\1", case_params(method)))[:140]


@pytest.mark.parametrize("method", CASES, ids=[case_id(m) for m in CASES])
def test_optax_alias_test_case(method, ours_patched_into_optax):
  result = unittest.TestResult()
  alias_test.AliasTest(method).run(result)
  problems = [text for _, text in result.failures + result.errors]
  expected = deliberate_difference(method)
  if expected is None:
    assert not problems, "\n".join(problems)
  else:
    assert problems and all(re.search(expected, text) for text in problems), (expected, problems)
  assert result.testsRun == 1


# --- hybrid_sgd with a low-precision accumulator: a documented difference ---


def sgd_run(tx, steps=20):
  params = {"w": jnp.linspace(-1, 1, 64, dtype=jnp.float32)}
  state = tx.init(params)
  for i in range(steps):
    grads = jax.tree.map(lambda w: jnp.sin(3 * w + i), params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return np.asarray(params["w"])


def sgd_reference(momentum_product_in_bf16: bool, steps=20):
  """NumPy, a bfloat16 trace: ``b = g + 0.9 * trace`` in float32, or with the product in bfloat16 (0.9 rounded)."""
  bf16 = ml_dtypes.bfloat16
  w, trace = np.linspace(-1, 1, 64, dtype=np.float32), np.zeros(64, bf16)
  for i in range(steps):
    g = np.sin(3 * w + i).astype(np.float32)
    if momentum_product_in_bf16:
      product = (np.asarray(0.9, bf16) * trace).astype(bf16).astype(np.float32)
    else:
      product = np.float32(0.9) * trace.astype(np.float32)
    b = g + product
    w = (w - np.float32(0.05) * b).astype(np.float32)
    trace = b.astype(bf16)
  return w


def test_sgd_low_precision_accumulator_multiplies_the_momentum_in_float32():
  """The stored trace is bfloat16 in both; optax.sgd multiplies it by 0.9 in bfloat16 (0.8984375), we in float32."""
  ours = sgd_run(optax_hybrid.hybrid_sgd(0.05, 0.9, accumulator_dtype=jnp.bfloat16))
  theirs = sgd_run(optax.sgd(0.05, 0.9, accumulator_dtype=jnp.bfloat16))
  np.testing.assert_allclose(ours, sgd_reference(False), rtol=0, atol=1e-6)
  np.testing.assert_allclose(theirs, sgd_reference(True), rtol=0, atol=1e-6)  # the cause of the difference
  float32_trace = sgd_run(optax.sgd(0.05, 0.9))
  assert np.abs(ours - float32_trace).max() < 0.7 * np.abs(theirs - float32_trace).max()
