"""Whole train steps of models written the way their users write them, compiled for GPU targets: every tier.

The optimizer-step tests (tests/test_gpu_compile.py) compile ``tx.step`` on a
synthetic tree; the layouts XLA picks for a real model's gradients never
appear there (a Flax ``nn.Dense`` output head, ``(D, V)`` used as ``x @ w``,
once broke the host tier's compile: docs/gpu_compile.md). Here each model of
``benchmarks/models.py`` (Flax Linen with a tied and an untied head, a Flax
NNX CNN with ``HWIO`` kernels, a Llama-style decoder whose layers are stacked
and scanned, transposed uses with a scalar and odd sizes) is compiled whole
(loss, gradient, optimizer; params and state donated; from abstract inputs) in
every tier (``device``, ``host_state``, ``host``, ``offload_fraction=0.5``)
with one of the eight (moments, kernel, path) variants per tier, rotated over
the models so that every tier meets both moment formats, both kernels and both
paths (``model_compile_script.cases``),
and next to it the model's own step without optimizer state (the baseline).

Every case asserts that it compiles, that XLA's host offloader logged no
fallback, and that the tier keeps its memory promise against the baseline:

* ``device``: the state is among the device arguments; device temporaries
  grow by at most the update tree (update + ``apply_updates``);
* ``host_state``, ``host``: no state among the device arguments or results,
  all of it a host argument;
* ``host_state``: device temporaries grow by at most three stages of state
  (a stage's bytes read off the state's arrays, by the plan's stages), plus
  the update tree on the update path;
* ``host`` and ``offload_fraction``: device temporaries grow by at most two of
  the largest leaf's param + gradient (plus the update tree): no moment or
  master is staged, and the device half of ``offload_fraction`` is stepped in
  place; host temporaries at most three stages (of the state as the host
  computes it: 8-bit moments as float32).
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

# JAX's CUDA plugin, installed into a cache directory if the environment has none (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("cuda_compiler_plugin")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_compile_script.py")
script = load_script("tests/model_compile_script.py")
MiB = 2**20
SLACK = MiB  # counts, scalars, alignment, small kernels' scratch


@functools.lru_cache(maxsize=None)
def compile_model(model: str) -> dict:
  """Runs every case of one model in subprocesses (an XLA abort fails its case only); returns {index: result}."""
  cases = script.cases(model)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=without_fast_compiles(os.environ.get("XLA_FLAGS", "")))
  results, start = {}, 0
  while start < len(cases):
    proc = subprocess.run([sys.executable, SCRIPT, "--model", model, "--start", str(start)], env=env,
                          capture_output=True, text=True, timeout=900)
    last_start = None
    for line in proc.stdout.splitlines():
      if line.startswith("{"):
        record = json.loads(line)
        if "start" in record:
          last_start = record["start"]
        else:
          results[record["index"]] = record
    if last_start is None:
      raise RuntimeError(f"{SCRIPT} --model {model} failed before any compile:\n{proc.stderr[-3000:]}")
    if last_start not in results:  # XLA aborted the process during this case
      crash = [l for l in proc.stderr.splitlines() if "Check failed" in l or "F0000" in l or "Fatal" in l]
      results[last_start] = dict(index=last_start, case=cases[last_start], ok=False,
                                 error=f"the process died (rc {proc.returncode}): " + " | ".join(crash[-3:]))
    start = last_start + 1
  for i, r in sorted(results.items()):
    print(json.dumps({k: r.get(k) for k in ("case", "ok", "error")})[:300])
  return results


def case_id(c: dict) -> str:
  if c["tier"] == "baseline":
    return f"{c['model']}-baseline"
  return f"{c['model']}-{c['tier']}-{c['moments']}-{c['kernel']}-{c['path']}"


PARAMS = [pytest.param(m, i, id=case_id(c), marks=pytest.mark.xdist_group(f"tests/test_model_compile.py:{m}"))
          for m in script.MODELS for i, c in enumerate(script.cases(m))]


def describe(report: dict, figures: dict) -> str:
  n = figures["num_params"]
  keys = ("device_argument_bytes", "device_output_bytes", "device_temp_bytes", "host_argument_bytes",
          "host_temp_bytes")
  per = ", ".join(f"{k.replace('_bytes', '')} {report[k] / n:.2f}" for k in keys)
  return f"B/param: {per}; stage {figures.get('largest_stage', 0) / n:.2f}; warnings {len(report['warnings'])}"


def check_promise(case: dict, report: dict, base: dict, figures: dict) -> None:
  why = describe(report, figures)
  assert not report["warnings"], f"host-offloader fallback: {report['warnings'][:2]}; {why}"
  if case["tier"] == "baseline":
    return
  updates = figures["update_bytes"] if case["path"] == "update" else 0
  grown = report["device_temp_bytes"] - base["device_temp_bytes"]
  state_device, state_host = figures["state_device"], figures["state_host"]
  # The state lives where its tier says: device state among the device
  # arguments, host state a host argument and neither a device argument nor result.
  assert report["device_argument_bytes"] >= base["device_argument_bytes"] + state_device - SLACK, why
  assert report["device_argument_bytes"] <= base["device_argument_bytes"] + state_device + SLACK, (
      f"host state among the device arguments: {why}")
  assert report["device_output_bytes"] <= base["device_output_bytes"] + state_device + SLACK, (
      f"host state among the device results: {why}")
  assert report["host_argument_bytes"] >= state_host, f"the host state is not a host argument: {why}"
  if case["tier"] == "device":
    assert state_host == 0 and grown <= updates + SLACK, f"device temporaries grew: {why}"
  elif case["tier"] == "host_state":
    assert state_device == 0 and grown <= 3 * figures["largest_stage"] + updates + SLACK, (
        f"more than 3 stages of {figures['largest_stage'] / MiB:.1f} MiB staged: {why}")
  else:  # host, offload_fraction: no moment or master staged on the device
    assert grown <= 2 * 2 * figures["largest_leaf_bytes"] + updates + SLACK, f"state staged on the device: {why}"
  # Host computations work in float32: a stage of 8-bit moments takes its float32 bytes there.
  assert report["host_temp_bytes"] <= 3 * figures["largest_working_stage"] + SLACK, f"host state copied: {why}"


@pytest.mark.parametrize("model,index", PARAMS)
def test_train_step_compiles_for_gpu_and_keeps_its_tier_promise(model, index):
  results = compile_model(model)
  result, base = results[index], results[0]
  assert result["ok"], result.get("error")
  assert base["ok"], base.get("error")
  for target, report in result["reports"].items():
    check_promise(result["case"], report, base["reports"]["h100"], result["figures"])


def test_every_tier_meets_both_formats_kernels_and_paths():
  """The rotation gives each tier both moment formats, both kernels and both paths, and every variant some tier."""
  seen = {(c["tier"], c["moments"], c["kernel"], c["path"]) for m in script.MODELS for c in script.cases(m)
          if c["tier"] != "baseline"}
  for tier in script.TIERS:
    mine = [v for t, *v in seen if t == tier]
    for axis, values in enumerate((("float32", "8bit"), ("xla", "pallas"), ("step", "update"))):
      assert {v[axis] for v in mine} == set(values), (tier, axis)
  assert {tuple(v) for _, *v in seen} == set(script.VARIANTS)


def test_largest_model_bisection_stops_on_a_compile_error(monkeypatch):
  """benchmarks/gpu_memory.py must not count a failed compile as "does not fit" (a bug would shrink the figure)."""
  gpu_memory = load_script("benchmarks/gpu_memory.py")

  def fails(setup, cfg, target):
    raise RuntimeError("INTERNAL: during context [end-of-post-layout_assignment]")

  monkeypatch.setattr(gpu_memory, "compile_train_step", fails)
  with pytest.raises(RuntimeError, match="end-of-post-layout_assignment"):
    gpu_memory.largest_fitting("host", 256, 2, "h100", 8, {})
  # A setup's subprocess that fails stops the table, with the child's error in the message.
  with pytest.raises(gpu_memory.CompileFailed, match="no-such-setup"):
    gpu_memory.in_subprocess(["--one-setup", "no-such-setup", "--width", "64", "--max-layers", "1"])
