"""The optimizer step compiled for real GPUs (H100, H200) on this CPU machine: what each tier promises.

XLA:GPU compiles deviceless (``optax_hybrid.gpu_compile``; JAX's CUDA plugin is
installed into a cache directory by the ``cuda_compiler_plugin`` fixture,
tests/conftest.py). Each tier's combinations (kernel x path x
dtype x real/abstract inputs, see ``gpu_compile_script.combinations``) are
compiled in one subprocess (``gpu_compile_script.py``), which prints one JSON
line per combination; an XLA abort fails the combination in progress, and the
rest run in a new subprocess. Every combination asserts:

* it compiles, and XLA's host offloader logged no fallback ("device compute in
  host memory space ... Converting into host compute");
* ``device``: the moments (and master) are device arguments;
* host tiers: no state in the device arguments or results (device arguments
  are the params, the gradients and the device tier's state);
* ``host`` (and the host half of ``offload_fraction``): the host state is
  updated stage by stage (each stage's new state written to new host buffers,
  then copied into the donated ones: docs/gpu_compile.md): host temp at most 3 stages (a stage being ``max(largest
  leaf's state, plan.STREAM_STAGE_BYTES)``), not a second copy of the state,
  and the device holds no moment or master: device temp at most two of the
  largest leaf's param + gradient (plus, for update + apply_updates, the
  update tree the Optax contract returns);
* ``host_state``: bounded staging: device temp at most 3 stages (plus that
  update tree for update + apply_updates), a stage being the largest group of
  leaves the plan streams together (its state bytes). The test tree's state
  is 4-8 stages, so staging it whole fails;
* ``disk``: cannot be compiled this way (its ``io_callback`` s lower only for
  the backend that traced them: see ``DISK_LOWERING_ERROR``); the test holds
  that real and abstract inputs both get that far;
* real and abstract inputs (``jax.ShapeDtypeStruct`` s of the state with its
  shardings, or ``tx.init`` called on ``ShapeDtypeStruct`` params) compile to
  the same memory figures (one combination per kernel, ``REAL_TOO``);
* 8-bit moments (device tier, ``kernel="pallas"`` and ``"auto"``): one Triton
  launch, codes and scales aliased in place, no float32 copy of the moments
  among the arguments or the temporaries.

The figures of every combination are printed (``-n 0 -s``: pytest-xdist
workers' output is not shown) and the sharded cases run on a deviceless 8-GPU
topology. Under pytest-xdist each tier's tests run in one worker
(:func:`same_worker`).
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

pytestmark = pytest.mark.usefixtures("cuda_compiler_plugin")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_compile_script.py")
script = load_script("tests/gpu_compile_script.py")
MiB = 2**20
SLACK = MiB  # counts, scalars, alignment
TIERS = ("device", "host_state", "host", "offload_fraction", "disk")
SHARDED_TIERS = ("host_state", "host")
SHARDED_DEVICES = 8


@functools.lru_cache(maxsize=None)
def compile_tier(tier: str, devices: int = 1) -> dict:
  """Runs every combination of a tier in subprocesses; returns {index: result}."""
  combos = script.combinations(tier, devices)
  # XLA's own optimization of the GPU programs, as a user's compile gets it:
  # the figures are what these tests measure (tests/compile_flags.py).
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=without_fast_compiles(os.environ.get("XLA_FLAGS", "")))
  if devices > 1:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  results, start = {}, 0
  while start < len(combos):
    proc = subprocess.run([sys.executable, SCRIPT, "--tier", tier, "--start", str(start), "--devices", str(devices)],
                          env=env, capture_output=True, text=True, timeout=600)
    last_start = None
    for line in proc.stdout.splitlines():
      if line.startswith("{"):
        record = json.loads(line)
        if "start" in record:
          last_start = record["start"]
        else:
          results[record["index"]] = record
    if last_start is None:
      raise RuntimeError(f"{SCRIPT} --tier {tier} failed before any compile:\n{proc.stderr[-3000:]}")
    if last_start not in results:  # XLA aborted the process during this combination
      crash = [l for l in proc.stderr.splitlines() if "Check failed" in l or "F0000" in l or "Fatal" in l]
      results[last_start] = dict(index=last_start, combo=combos[last_start], ok=False,
                                 error=f"the process died (rc {proc.returncode}): " + " | ".join(crash[-3:]))
    start = last_start + 1
  for i, r in sorted(results.items()):
    print(json.dumps({k: r.get(k) for k in ("combo", "ok", "error", "figures")})[:300])
  return results


def combo_id(c: dict) -> str:
  return f"{c['tier']}-{c['kernel']}-{c['path']}-{c['dtype']}-{c['inputs']}" + (
      f"-{c['devices']}gpus" if c["devices"] > 1 else "")


def same_worker(tier: str, devices: int = 1):
  """The mark that runs every test of one :func:`compile_tier` call in one pytest-xdist worker.

  Each tier's subprocesses then run once, in one worker, and different tiers
  can run in different workers (tests/conftest.py; docs/records/testing.md).
  """
  return pytest.mark.xdist_group(f"tests/test_gpu_compile.py:{tier}-{devices}")


CASES = [(tier, 1, i) for tier in TIERS for i in range(len(script.combinations(tier, 1)))]
CASES += [(tier, SHARDED_DEVICES, i) for tier in SHARDED_TIERS
          for i in range(len(script.combinations(tier, SHARDED_DEVICES)))]
IDS = [combo_id(script.combinations(t, d)[i]) for t, d, i in CASES]
CASE_PARAMS = [pytest.param(t, d, i, id=case_id, marks=same_worker(t, d)) for (t, d, i), case_id in zip(CASES, IDS)]


def describe(report: dict, figures: dict) -> str:
  n = figures["num_params"]
  keys = ("device_argument_bytes", "device_output_bytes", "device_temp_bytes", "device_alias_bytes",
          "host_argument_bytes", "host_output_bytes", "host_temp_bytes", "host_alias_bytes")
  per = ", ".join(f"{k.replace('_bytes', '')} {report[k] / n:.2f}" for k in keys)
  return (f"B/param: {per}; kernels {report['kernels']}, transfers {report['transfers']}, host calls "
          f"{report['host_calls']}, triton {report['triton_launches']}; warnings {len(report['warnings'])}")


def check_tier_promise(combo: dict, report: dict, figures: dict) -> None:
  tier = combo["tier"]
  why = describe(report, figures)
  state, largest_state, largest_param = (figures["state_bytes"], figures["largest_state_bytes"],
                                         figures["largest_param_bytes"])
  params, grads = figures["param_bytes"], figures["grad_bytes"]
  assert not report["warnings"], f"host-offloader fallback: {report['warnings'][:2]}; {why}"
  if tier == "device":
    # A param that a master stands in for is not read by tx.step: jit drops the argument.
    read_params = 0 if (combo["dtype"].startswith("bf16") and combo["path"] == "step") else params
    assert report["device_argument_bytes"] >= read_params + grads + state["device"], why
    assert report["host_argument_bytes"] + report["host_temp_bytes"] <= SLACK, why
    return
  # Host tiers: the state that lives on the host is not a device argument or result.
  assert report["device_argument_bytes"] <= params + grads + state["device"] + SLACK, (
      f"state bytes among the device arguments: {why}")
  assert report["device_output_bytes"] <= params + state["device"] + SLACK, f"state bytes among the device results: {why}"
  host_resident = state["host"] + state["host_state"]
  if host_resident:
    assert report["host_argument_bytes"] >= host_resident, f"the host state is not a host argument: {why}"
  # The Optax contract's update tree (update + apply_updates) is a full-size
  # device temporary whatever the tier: the updates of every leaf exist before
  # apply_updates adds them. tx.step has none.
  updates = figures["update_bytes"] if combo["path"] == "update" else 0
  if state["host"]:  # updated on the host stage by stage: a few stages of host temporaries, not a copy
    stage = max(largest_state["host"], figures["stage_bytes"])
    assert report["host_temp_bytes"] <= 3 * stage + SLACK, f"host state copied: {why}"
    assert report["device_temp_bytes"] <= 2 * largest_param["host"] + updates + SLACK + (
        3 * max(largest_state["host_state"], figures["stage_bytes"]) if state["host_state"] else 0), (
        f"moments or master staged on the device: {why}")
  if state["host_state"]:  # streamed through the device: at most three of its stages at a time
    stage = figures["largest_stage_bytes"]["host_state"]
    assert report["device_temp_bytes"] <= 3 * stage + updates + SLACK, (
        f"staging not bounded by 3 x {stage / MiB:.0f} MiB: {why}")
  if state["disk"]:
    assert report["host_calls"] >= 1, f"the disk tier's moments move through host callbacks: {why}"


# What stops the disk tier: its step reads and writes the moments with
# ``io_callback``, and JAX lowers a host callback only for the backend it traced
# on (the callback is registered with that backend's client). A CPU-traced
# program cannot be lowered for CUDA with one, so this method cannot check the
# disk tier; a GPU run (benchmarks/gpu_check.py) can.
DISK_LOWERING_ERROR = "is different from the lowering platform cuda"


@pytest.mark.parametrize("tier,devices,index", CASE_PARAMS)
def test_step_compiles_for_gpu_and_keeps_its_tier_promise(tier, devices, index):
  result = compile_tier(tier, devices)[index]
  if tier == "disk":
    # Real and abstract inputs alike must reach the CUDA lowering of the callbacks.
    assert not result["ok"] and DISK_LOWERING_ERROR in result["error"], result.get("error")
    return
  assert result["ok"], result.get("error")
  for target, report in result["reports"].items():
    check_tier_promise(result["combo"], report, result["figures"])


ABSTRACT_PAIRS = [(t, i) for t in TIERS if t != "disk" for i, c in enumerate(script.combinations(t, 1))
                  if c["inputs"] == "real" and i + 1 < len(script.combinations(t, 1))
                  and script.combinations(t, 1)[i + 1]["inputs"] == "abstract"]


@pytest.mark.parametrize("tier,index", [
    pytest.param(t, i, id=combo_id(script.combinations(t, 1)[i]).replace("-real", ""), marks=same_worker(t))
    for t, i in ABSTRACT_PAIRS])
def test_abstract_inputs_compile_the_same_program_as_real_ones(tier, index):
  results = compile_tier(tier, 1)
  real, abstract = results[index], results[index + 1]
  assert abstract["combo"]["inputs"] == "abstract"
  assert real["ok"] and abstract["ok"], (real.get("error"), abstract.get("error"))
  keys = ("device_argument_bytes", "device_output_bytes", "device_temp_bytes", "host_argument_bytes",
          "host_output_bytes", "host_temp_bytes", "transfers", "host_calls")
  for target in real["reports"]:
    want = {k: real["reports"][target][k] for k in keys}
    got = {k: abstract["reports"][target][k] for k in keys}
    assert got == want, target


EIGHT_BIT = [i for i, c in enumerate(script.combinations("device", 1)) if c["dtype"].endswith("8bit")]


@pytest.mark.parametrize("index", [
    pytest.param(i, id=combo_id(script.combinations("device", 1)[i]), marks=same_worker("device")) for i in EIGHT_BIT])
def test_8bit_moments_are_updated_in_place_by_one_triton_launch(index):
  # The tree's 8 big leaves keep 8-bit moments (the bias, under 4,096 values, float32 ones): one
  # launch updates all 9 (Pallas, and "auto", which is Pallas on CUDA), and no float32 copy of the
  # moments exists anywhere in the program: device temporaries are a small fraction of the 4 bytes
  # per weight one would take, and the codes and scales are aliased in place.
  result = compile_tier("device", 1)[index]
  assert result["ok"], result.get("error")
  report, figures = result["reports"]["h100"], result["figures"]
  why = describe(report, figures)
  n = figures["num_params"]
  assert report["triton_launches"] == 1, why
  assert report["device_temp_bytes"] <= 0.05 * 4 * n, why
  assert report["device_alias_bytes"] >= figures["state_bytes"]["device"], why
  # The arguments are the params, the gradients and the 8-bit state (with the master for bf16 params):
  # float32 moments would add 8 bytes per weight.
  assert report["device_argument_bytes"] <= figures["param_bytes"] + figures["grad_bytes"] + (
      figures["state_bytes"]["device"]) + SLACK, why


@same_worker("device")
def test_h100_and_h200_compile_the_same_step():
  # The same sm_90 chip: the programs agree, only the memory size differs.
  for r in compile_tier("device", 1).values():
    if "h200" in r.get("reports", {}):
      h100, h200 = r["reports"]["h100"], r["reports"]["h200"]
      assert {k: h100[k] for k in ("device_argument_bytes", "device_temp_bytes", "kernels")} == {
          k: h200[k] for k in ("device_argument_bytes", "device_temp_bytes", "kernels")}
