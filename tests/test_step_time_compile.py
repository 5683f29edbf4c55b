"""Step times of programs XLA:GPU compiles for the H200, against what their shapes say they take.

``tests/step_time_compile_script.py`` compiles four programs deviceless for
the H200 target (in a subprocess: an XLA abort must not take the test worker
down) and estimates each with ``optax_hybrid.gpu_compile.step_time`` on the H200 SXM
figures. Each expected time is worked out here from the program's sizes and
the published figures (989 TFLOP/s dense bf16, PCIe 5 x16 at 55 GB/s each
way), not from the estimator:

* a loop that only copies ``L`` slices in: ``L * slice / pcie``;
* a chain of matmuls: ``chain * 2 n^3 / peak``;
* a loop that fetches slice ``i`` and then computes on it pays both per trip:
  ``L * (copy + compute)``;
* a loop that fetches slice ``i + 1`` beside trip ``i``'s arithmetic (more
  arithmetic than copy) pays the first copy, then the arithmetic:
  ``copy + L * compute``, its copies hidden behind the kernels.

The last two hold only because XLA's scheduler puts the fetch ahead beside the
kernels: if a new XLA stops doing so, the test says it.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from compile_flags import without_fast_compiles
from loading import load_script

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "step_time_compile_script.py")
script = load_script("tests/step_time_compile_script.py")
pytestmark = [pytest.mark.usefixtures("cuda_compiler_plugin"), pytest.mark.xdist_group("tests/test_step_time_compile.py")]

PEAK, PCIE = 989e12, 55e9  # NVIDIA's H200 SXM and PCIe 5 x16 figures, as docs/step_time.md cites them
SLICE = script.N * script.N * 2  # one bf16 slice of the stack
COPY = SLICE / PCIE
LAYER = script.DOTS * 2 * script.ROWS * script.N * script.N / PEAK  # DOTS products (ROWS, N) x (N, N)


@functools.lru_cache(maxsize=None)
def estimates() -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=without_fast_compiles(os.environ.get("XLA_FLAGS", "")))
  proc = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=600)
  records = {r["program"]: r for r in map(json.loads, (l for l in proc.stdout.splitlines() if l.startswith("{")))}
  if len(records) != 4:
    raise RuntimeError(f"{SCRIPT} stopped after {sorted(records)}:\n{proc.stderr[-3000:]}")
  for name, record in records.items():
    assert not record["warnings"], (name, record["warnings"][:2])
  return records


def test_a_copy_loop_takes_its_bytes_over_the_link():
  e = estimates()["copy_loop"]["estimate"]
  assert e["bus_in"] == pytest.approx(script.LAYERS * COPY, rel=1e-6)
  assert e["seconds"] == pytest.approx(script.LAYERS * COPY, rel=1e-3)
  assert e["compute"] < 1e-3 * e["seconds"] and e["flops"] == 0


def test_a_matmul_chain_takes_its_flops_at_the_peak():
  e = estimates()["matmul_chain"]["estimate"]
  flops = script.CHAIN * 2 * script.N ** 3
  assert e["flops"] == flops
  assert e["seconds"] == pytest.approx(flops / PEAK, rel=1e-6) and e["bus_in"] == 0


def test_a_loop_that_fetches_then_computes_pays_both():
  e = estimates()["fetch_then_compute"]["estimate"]
  assert e["seconds"] == pytest.approx(script.LAYERS * (COPY + LAYER), rel=0.01)
  assert e["bus_hidden_fraction"] < 0.01


def test_a_loop_that_fetches_a_trip_ahead_hides_its_copies():
  records = estimates()
  e, naive = records["fetch_ahead"]["estimate"], records["fetch_then_compute"]["estimate"]
  assert LAYER > COPY  # more arithmetic than copy per trip: the copies can hide
  assert e["seconds"] == pytest.approx(COPY + script.LAYERS * LAYER, rel=0.02)
  assert e["bus_in"] == pytest.approx((script.LAYERS + 1) * COPY, rel=1e-6)  # one slice fetched twice: the last trip's
  assert e["bus_hidden"] == pytest.approx(script.LAYERS * COPY, rel=0.01)  # all but the first copy
  assert e["seconds"] < naive["seconds"] - 0.9 * (script.LAYERS - 1) * COPY
  (loop,) = records["fetch_ahead"]["loops"]
  assert loop["carried"] == loop["fetches"] == 1
