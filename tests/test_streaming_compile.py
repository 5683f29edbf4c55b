"""A train step whose layers stream from host memory (optax_hybrid.scan_layers + the host tier), compiled for the H200.

The cases (``streaming_compile_script.cases``) compile the whole train step of
a Llama-style decoder, its stacked layers in ``pinned_host``, at 2 and 4
layers, with and without the saved carries offloaded, from abstract inputs
and (at 4 layers) real arrays. What must hold:

* it compiles without a host-offloader fallback;
* the device grows with depth by the saved carries only (by nothing with
  ``offload_carries``): no param, gradient or optimizer-state term;
* the bus carries, per step and counted from the optimized HLO, each layer's
  params in for the forward and again for the backward (plus the one layer
  each loop fetches ahead and does not use), each layer's gradient out, and
  for the params outside the stack (the host tier's) their gradient out and
  their new value in: nothing else that scales with the model;
* each loop fetches the next layer in the trip before (the copy's result goes
  to the loop's carry);
* abstract and real inputs compile the same program;
* the optimizer in the backward pass (``step_in_backward``) keeps no gradient
  buffer in host memory and moves no gradient over the bus;
* the ``host_state`` tier's step on the stacked layers stages at most three
  slices of state on the device (a slice: a layer of one stacked leaf, or a
  stage's budget), whatever the depth, and no state in host temporaries.
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


SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "streaming_compile_script.py")
script = load_script("tests/streaming_compile_script.py")
SLACK = 2**16  # scalars (the step count, the schedule's values) crossing the link


@functools.lru_cache(maxsize=None)
def compiled() -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=without_fast_compiles(os.environ.get("XLA_FLAGS", "")))
  proc = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=900)
  results = {}
  for line in proc.stdout.splitlines():
    if line.startswith("{") and '"index"' in line:
      record = json.loads(line)
      c = record["case"]
      results[(c["layers"], c["offload"], c["inputs"], c["tier"], c["step_only"], c["in_backward"], c["master"])] = record
  if len(results) != len(script.cases()):
    raise RuntimeError(f"{SCRIPT} stopped after {len(results)} cases:\n{proc.stderr[-3000:]}")
  for key, record in results.items():
    assert record["ok"], (key, record.get("error"))
  return results


# JAX's CUDA plugin, installed into a cache directory if the environment has none (tests/conftest.py).
pytestmark = [pytest.mark.usefixtures("cuda_compiler_plugin"), pytest.mark.xdist_group("tests/test_streaming_compile.py")]


def case(layers, offload=False, inputs="abstract", tier="host", step_only=False, in_backward=False, master="float32"):
  return compiled()[(layers, offload, inputs, tier, step_only, in_backward, master)]


@pytest.mark.parametrize("key", [(c["layers"], c["offload"], c["inputs"]) for c in script.cases()
                                 if c["tier"] == "host"],
                         ids=lambda k: f"L{k[0]}-{'offload' if k[1] else 'saved'}-{k[2]}")
def test_compiles_without_fallback_and_moves_only_the_layers(key):
  record = case(*key)
  report, figures = record["report"], record["figures"]
  assert not report["warnings"], report["warnings"][:2]
  layers, carry = key[0], figures["carry_bytes"] if key[1] else 0
  layer, other = figures["layer_bytes"], figures["other_param_bytes"]
  # In: every layer twice and one layer ahead per loop; the host tier's new params for the rest.
  expected_down = 2 * (layers + 1) * layer + other + layers * carry
  # Out: every layer's gradient; the rest's gradient (to the host tier).
  expected_up = layers * layer + other + layers * carry
  assert expected_down <= report["to_device_bytes"] <= expected_down + SLACK, (report["to_device_bytes"], expected_down)
  assert expected_up <= report["to_host_bytes"] <= expected_up + SLACK, (report["to_host_bytes"], expected_up)
  # The stack is never a device argument: the device holds the params outside it (and the batch).
  assert report["device_argument_bytes"] <= other + 2**16


@pytest.mark.parametrize("offload", [False, True], ids=["carries-on-device", "carries-offloaded"])
def test_the_device_grows_with_depth_by_the_saved_carries_only(offload):
  shallow, deep = case(2, offload)["report"], case(4, offload)["report"]
  figures = case(4, offload)["figures"]
  grown = deep["device_peak_bytes"] - shallow["device_peak_bytes"]
  per_layer = 0 if offload else figures["carry_bytes"]
  # Two more layers: at most their saved carries (5% slack); a layer's params
  # or gradient (6x a carry) kept on the device would not fit.
  assert grown <= 2 * per_layer * 1.05 + (0.05 * 2 * figures["carry_bytes"] if offload else 0), (
      grown, per_layer, figures["layer_bytes"])
  assert figures["layer_bytes"] > 5 * figures["carry_bytes"]


def test_each_loop_fetches_the_next_layer_a_trip_ahead():
  loops = case(4)["loops"]
  leaves = case(4)["figures"]["layer_leaves"]
  assert len(loops) == 2  # forward and backward
  for loop in loops:
    assert loop["trips"] == 4
    assert loop["carried"] >= leaves, loop  # every layer array's copy feeds the next trip


def test_abstract_inputs_compile_the_same_program_as_real_arrays():
  abstract, real = case(4)["report"], case(4, inputs="real")["report"]
  for key in ("device_peak_bytes", "host_peak_bytes", "device_temp_bytes", "host_temp_bytes", "to_device_bytes",
              "to_host_bytes", "transfers", "host_calls"):
    assert abstract[key] == real[key], key


def test_the_host_state_step_stages_at_most_three_slices_of_state_whatever_the_depth():
  shallow, deep = case(2, tier="host_state", step_only=True), case(4, tier="host_state", step_only=True)
  figures = deep["figures"]
  assert figures["sliced"] >= figures["stacked"], figures  # every stacked leaf crosses in slices
  for record in (shallow, deep):
    report = record["report"]
    assert not report["warnings"], report["warnings"][:2]
    assert report["device_temp_bytes"] <= 3 * record["figures"]["largest_slice_bytes"], (
        report["device_temp_bytes"], record["figures"])
    assert report["host_temp_bytes"] <= SLACK  # the state is written back in place
  # Twice the layers, the same staging but for the small stacked leaves that cross whole (the norms'
  # scales: kB); staging whole stacked leaves would add two layers' state of each (tens of MB here).
  grown = deep["report"]["device_temp_bytes"] - shallow["report"]["device_temp_bytes"]
  assert grown <= 0.01 * figures["largest_slice_bytes"], grown
  assert deep["figures"]["state_bytes"] > 10 * figures["largest_slice_bytes"]


def test_streamed_layers_stepped_on_the_device_keep_only_the_gradient_in_host_temporaries():
  # tiers="host_state" with the layers in pinned_host: each layer's slice of params, gradient and state crosses
  # to the device and back, written in place; the host's temporaries are scan_layers' gradient buffer alone.
  shallow, deep = case(2, tier="host_state"), case(4, tier="host_state")
  for record in (shallow, deep):
    report, figures = record["report"], record["figures"]
    assert not report["warnings"], report["warnings"][:2]
    gradient_buffer = figures["layer_bytes"] * record["case"]["layers"]
    assert gradient_buffer <= report["host_temp_bytes"] <= gradient_buffer + SLACK, (
        report["host_temp_bytes"], gradient_buffer)
  # Two more layers grow the device by their saved carries and small leaves crossing whole (the norms'
  # scales), not by a layer's params, gradient or state (each a layer's size or more).
  grown = deep["report"]["device_peak_bytes"] - shallow["report"]["device_peak_bytes"]
  assert grown <= 2 * deep["figures"]["carry_bytes"] * 1.05 + 0.05 * deep["figures"]["layer_bytes"], (
      grown, deep["figures"])


def test_the_optimizer_in_the_backward_pass_keeps_no_gradient_and_moves_it_nowhere():
  # optax_hybrid.step_in_backward: each layer is stepped (host_state: on the device, written back in place) as
  # soon as its gradient exists, so the gradient buffer that value_and_grad then tx.step keeps is gone.
  shallow, deep = case(2, tier="host_state", in_backward=True), case(4, tier="host_state", in_backward=True)
  for record in (shallow, deep):
    report, layers = record["report"], record["case"]["layers"]
    assert not report["warnings"], report["warnings"][:2]
    assert report["host_temp_bytes"] <= SLACK, report["host_temp_bytes"]
    then_step = case(layers, tier="host_state")["report"]
    assert then_step["host_temp_bytes"] >= layers * record["figures"]["layer_bytes"]  # what is saved
  grown = deep["report"]["device_peak_bytes"] - shallow["report"]["device_peak_bytes"]
  assert grown <= 2 * deep["figures"]["carry_bytes"] * 1.05 + 0.05 * deep["figures"]["layer_bytes"], grown
  # Per layer (two more layers, counted from the HLO): in, its bf16 params for the forward and the backward and
  # its state (an fp32 master and fp32 moments: 6x the bf16 params); out, its state and new params. No gradient.
  layer = deep["figures"]["layer_bytes"]
  per_layer = lambda records, key: (records[1]["report"][key] - records[0]["report"][key]) // 2
  assert per_layer((shallow, deep), "to_device_bytes") == (2 + 6) * layer
  assert per_layer((shallow, deep), "to_host_bytes") == (1 + 6) * layer
  then_step = (case(2, tier="host_state"), case(4, tier="host_state"))  # the gradient out and back in besides
  assert per_layer(then_step, "to_device_bytes") == (2 + 6 + 1) * layer
  assert per_layer(then_step, "to_host_bytes") == (1 + 6 + 1) * layer


def test_the_step_in_the_backward_pass_reads_the_params_the_backward_pass_brought_in():
  # With stochastic rounding (no master) the step reads each layer's bf16 params: it takes the device copy the
  # layer's backward already fetched, so per layer the bus carries in the params twice (forward, backward) and
  # the fp32 moments (4x the bf16 params), not the params a third time; out, the moments and the new params.
  records = case(2, tier="host_state", in_backward=True, master="stochastic"), case(
      4, tier="host_state", in_backward=True, master="stochastic")
  layer = records[1]["figures"]["layer_bytes"]
  per_layer = lambda key: (records[1]["report"][key] - records[0]["report"][key]) // 2
  assert not records[1]["report"]["warnings"]
  assert per_layer("to_device_bytes") == (2 + 4) * layer
  assert per_layer("to_host_bytes") == (1 + 4) * layer


WIDE = dict(width=1024, heads=8, ffn=2752, vocab=32000, seq=512, batch=1)
WIDE_SCRIPT = """
import json, sys
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp, numpy as np
import models, optax_hybrid
from optax_hybrid import gpu_compile

def peak(layers):
  cfg = models.LlamaConfig(layers=layers, **SIZES)
  device = jax.devices()[0]
  real = lambda x: jax.device_put(np.zeros(x.shape, x.dtype), jax.sharding.SingleDeviceSharding(
      device, memory_kind=getattr(x.sharding, "memory_kind", None) or "device"))
  params = jax.tree.map(real, models.llama_params(cfg, jnp.bfloat16, "pinned_host"))
  tx = optax_hybrid.hybrid_adamw(1e-4, weight_decay=0.1, state_memory_kind="host", master="float32",
                                 moment_format="float32")
  def step(p, s, b):
    loss, g = jax.value_and_grad(lambda p: models.llama_loss(cfg, p, b, stream=True))(p)
    p, s = tx.step(p, s, g)
    return p, s, loss
  report = gpu_compile.compile_for_gpu(step, params, tx.init(params), models._tokens(cfg.batch, cfg.seq),
                                       target="h200", donate_argnums=(0, 1))
  return report.device_peak_bytes

print(json.dumps({"peaks": [peak(2), peak(4)]}))
"""


def test_a_wider_decoder_scanned_in_value_and_grad_then_stepped_grows_by_its_carry_alone():
  # Issue 40's case: scan_layers inside jax.value_and_grad, then tx.step, the host tier with an fp32 master and
  # moments, real bf16 layers in pinned_host, an untied (D, V) head used as x @ head. It once grew 5.4 MB per
  # layer against a 1.0 MB carry.
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root,
             XLA_FLAGS=without_fast_compiles(os.environ.get("XLA_FLAGS", "")))
  proc = subprocess.run([sys.executable, "-c", f"SIZES = {WIDE!r}" + WIDE_SCRIPT], env=env, cwd=root,
                        capture_output=True, text=True, timeout=600)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  assert lines, proc.stderr[-3000:]
  shallow, deep = json.loads(lines[-1])["peaks"]
  carry = WIDE["batch"] * WIDE["seq"] * WIDE["width"] * 2  # the bf16 activations saved per layer
  assert (deep - shallow) / 2 <= carry * 1.01, ((deep - shallow) / 2, carry)
