"""Step times of programs XLA:GPU compiles for the H200, against what their sizes say they take.

``tests/step_time_compile_script.py`` compiles small programs deviceless for
the H200 target (in subprocesses: an XLA abort must not take the test worker
down) and estimates each with ``optax_hybrid.gpu_compile.step_time`` on the
H200 SXM figures. Each expected time is worked out here from the program's
sizes and the published figures (989 TFLOP/s dense bf16, PCIe 5 x16 at 55
GB/s each way, 6 us per copy, 3.8 us per launch, NCCL at 0.8 of NVLink's 450
GB/s), not from the estimator:

* a loop that only copies ``L`` slices in: ``L * (latency + slice / pcie)``;
* a chain of matmuls: one launch, then ``chain * 2 n^3 / peak``;
* a loop that fetches slice ``i`` and then computes on it pays both per trip:
  ``L * (copy + compute)``;
* a loop that fetches slice ``i + 1`` beside trip ``i``'s arithmetic (more
  arithmetic than copy) pays the first copy, then the arithmetic:
  ``copy + L * compute``, its copies hidden behind the kernels;
* a loop of 1,000 trips of tiny kernels, which XLA runs from one command
  buffer per trip: a launch per trip; with command buffers turned off
  (``--xla_gpu_enable_command_buffer=``), a launch per kernel;
* on a node of 8, collectives XLA's SPMD partitioner inserts (the mesh form
  of replica groups) and one written with ``shard_map``: an all-gather of a
  split array, an FSDP matmul (gather the weight, then multiply), a
  reduce-scatter of per-GPU sums, a gather over one axis of a ``(2, 4)``
  mesh: each ``(n - 1) / n`` of its whole buffer at 360 GB/s.

The loop results hold only because XLA's scheduler and thunk passes do what
is said above: if a new XLA stops doing so, the test says it.
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

# NVIDIA's H200 SXM and PCIe 5 x16 figures and the overheads' measurements, as docs/step_time.md cites them.
PEAK, PCIE, NCCL = 989e12, 55e9, 0.8 * 450e9
LAUNCH, LATENCY = 3.8e-6, 6e-6
SLICE = script.N * script.N * 2  # one bf16 slice of the stack
COPY = LATENCY + SLICE / PCIE
LAYER = script.DOTS * 2 * script.ROWS * script.N * script.N / PEAK  # DOTS products (ROWS, N) x (N, N)


def run_script(*args: str, xla_flags: str = "", expect: int) -> dict:
  flags = without_fast_compiles((os.environ.get("XLA_FLAGS", "") + " " + xla_flags).strip())
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
  proc = subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=600)
  records = {r["program"]: r for r in map(json.loads, (l for l in proc.stdout.splitlines() if l.startswith("{")))}
  if len(records) != expect:
    raise RuntimeError(f"{SCRIPT} {' '.join(args)} stopped after {sorted(records)}:\n{proc.stderr[-3000:]}")
  for name, record in records.items():
    assert not record["warnings"], (name, record["warnings"][:2])
  return records


@functools.lru_cache(maxsize=None)
def estimates() -> dict:
  return run_script(expect=5)


@functools.lru_cache(maxsize=None)
def node_estimates() -> dict:
  return run_script("--node", xla_flags="--xla_force_host_platform_device_count=8", expect=5)


def test_a_copy_loop_takes_its_bytes_over_the_link_and_a_latency_per_copy():
  e = estimates()["copy_loop"]["estimate"]
  assert e["bus_in"] == pytest.approx(script.LAYERS * COPY, rel=1e-6)
  # Each trip's few small kernels and their launches are the rest: a few launches per trip at most.
  assert script.LAYERS * COPY <= e["seconds"] <= script.LAYERS * COPY + e["launches"] * LAUNCH
  assert e["compute"] < 1e-3 * e["seconds"] and e["flops"] == 0


def test_a_matmul_chain_takes_one_launch_then_its_flops_at_the_peak():
  e = estimates()["matmul_chain"]["estimate"]
  flops = script.CHAIN * 2 * script.N ** 3
  assert e["flops"] == flops and e["launches"] == script.CHAIN
  assert e["seconds"] == pytest.approx(LAUNCH + flops / PEAK, rel=1e-6) and e["bus_in"] == 0


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


def test_a_loop_of_tiny_kernels_launches_one_command_buffer_per_trip():
  record = estimates()["tiny_loop"]
  e, (loop,) = record["estimate"], record["estimate"]["loops"]
  assert e["command_buffers_read"] and record["command_buffers"] >= 1
  assert loop["trips"] == e["loop_trips"] == script.TRIPS and loop["launches"] == script.TRIPS
  kernels_per_trip = (e["kernels"] - 2) / script.TRIPS  # the entry's two copies of the carry besides
  assert kernels_per_trip >= script.TINY_KERNELS
  # Each trip's kernels take well under a microsecond: the host's launch of each trip's buffer is the step.
  assert e["seconds"] == pytest.approx(script.TRIPS * LAUNCH, rel=0.01)


def test_without_command_buffers_each_kernel_is_a_launch():
  e = run_script("--only", "tiny_loop", xla_flags="--xla_gpu_enable_command_buffer=", expect=1)["tiny_loop"]["estimate"]
  assert e["command_buffers_read"] and e["launches"] == e["kernels"] > script.TRIPS * script.TINY_KERNELS
  assert e["seconds"] == pytest.approx(e["kernels"] * LAUNCH, rel=0.01)


def gather(nbytes: float, group: int) -> float:
  """A ring all-gather or reduce-scatter of a whole buffer of ``nbytes``: each GPU sends ``(n - 1) / n`` of it."""
  return (group - 1) / group * nbytes / NCCL


def test_an_all_gather_the_partitioner_inserts_crosses_nvlink():
  record = node_estimates()["all_gather"]
  assert record["replica_groups"] == ["replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}"]
  e = record["estimate"]
  whole = 8 * script.ROWS * script.N * 4
  assert e["collectives"] == pytest.approx(gather(whole, 8), rel=1e-9)
  doubling = 2 * whole / 8 / 4.8e12  # each GPU reads and writes its eighth at 4.8 TB/s
  assert e["seconds"] == pytest.approx(gather(whole, 8) + doubling, rel=0.01)


def test_an_fsdp_matmul_gathers_its_weight_then_multiplies():
  e = node_estimates()["fsdp_matmul"]["estimate"]
  weight, matmul = script.N * script.N * 2, 2 * script.ROWS * script.N * script.N / PEAK
  assert e["collectives"] == pytest.approx(gather(weight, 8), rel=1e-9) and e["flops"] == 2 * script.ROWS * script.N ** 2
  assert e["seconds"] == pytest.approx(LAUNCH + gather(weight, 8) + matmul, rel=0.01)


def test_a_reduce_scatter_of_per_gpu_sums():
  e = node_estimates()["reduce_scatter"]["estimate"]
  sums = 8 * script.SUM_COLUMNS * 4  # each GPU's sums over its rows, before the scatter
  rows = script.SUM_ROWS * 8 * script.SUM_COLUMNS * 4
  assert e["collectives"] == pytest.approx(gather(sums, 8), rel=1e-9)
  assert e["seconds"] == pytest.approx(LAUNCH + (rows + sums) / 4.8e12 + gather(sums, 8), rel=0.05)


def test_a_gather_over_one_axis_of_a_two_axis_mesh_has_groups_of_four():
  record = node_estimates()["two_axis_gather"]
  assert "device_ids=" in record["replica_groups"][0]  # the mesh form with a device order
  assert record["estimate"]["collectives"] == pytest.approx(gather(script.ROWS * 4 * script.N * 4, 4), rel=1e-9)


def test_a_gather_written_with_shard_map_reads_its_listed_group():
  record = node_estimates()["shard_map_gather"]
  assert record["replica_groups"] == ["replica_groups={{0,1,2,3,4,5,6,7}}"]
  assert record["estimate"]["collectives"] == pytest.approx(gather(8 * script.ROWS * script.N * 4, 8), rel=1e-9)
