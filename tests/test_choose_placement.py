"""optax_hybrid.choose_placement: the split of a stack that fits both memories and moves the fewest bytes.

The script (tests/choose_placement_script.py) compiles, for the H200 and
without the planner, every placement of a 4-layer stack (k resident layers
with their state on the device or in host memory, the rest streamed), sets a
device budget between "every layer streamed" and "every layer resident", and
asks the planner. What must hold:

* the choice fits the budgets as compiled here, and every placement that
  moves fewer bytes over the bus does not fit (the best there is);
* its figures are those of its own compile here;
* the placed params and ``state_memory_kind`` put each part where the
  choice says;
* the chosen split, and the same split with its resident layers' state on the
  device, step as the stack held whole in host memory, bit for bit (CPU);
* budgets that cannot hold what stays on the device, a stack that is not
  there and a budget that is not a number are refused, naming the argument.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from compile_flags import without_fast_compiles

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "choose_placement_script.py")
pytestmark = [pytest.mark.usefixtures("cuda_compiler_plugin"), pytest.mark.xdist_group("tests/test_choose_placement.py")]


@functools.lru_cache(maxsize=None)
def records() -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=without_fast_compiles(os.environ.get("XLA_FLAGS", "")))
  proc = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=900)
  out = {r["case"]: r for r in map(json.loads, (l for l in proc.stdout.splitlines() if l.startswith("{")))}
  if set(out) != {"choice", "numbers", "errors"}:
    raise RuntimeError(f"{SCRIPT} stopped after {sorted(out)}:\n{proc.stderr[-3000:]}")
  return out


def test_the_choice_fits_and_nothing_that_moves_fewer_bytes_does():
  r = records()["choice"]
  by_hand = {(p["resident"], p["state"]): p for p in r["every"]}
  mine = by_hand[r["resident"], r["state"]]
  assert 0 < r["resident"] < 4, "the budget sits between every layer streamed and every layer resident"
  assert mine["device"] <= r["device_budget"]
  better = [p for p in r["every"] if p["bus"] < mine["bus"]]
  assert better, "the budget leaves some placement that moves fewer bytes out of reach"
  for p in better:
    assert p["device"] > r["device_budget"], p
  assert (r["device"], r["host"], r["bus"]) == (mine["device"], mine["host"], mine["bus"])
  assert 0 < r["step_lower_bound"] <= r["step_seconds"]
  assert "2 streamed" in r["table"] or f"{4 - r['resident']} streamed" in r["table"]


def test_the_placed_params_and_state_kinds_follow_the_choice():
  r = records()["choice"]
  assert r["placed"]["['layers'].resident['w']"] == "device"
  assert r["placed"]["['layers'].streamed['w']"] == "pinned_host"
  assert r["kinds"]["['layers'].streamed['w']"] == "host_state"
  assert r["kinds"]["['layers'].resident['w']"] == r["state"]
  assert r["kinds"]["['embed']"] == r["rest_state"]


def test_the_chosen_split_steps_as_the_whole_stack():
  r = records()["numbers"]
  for name in ("chosen", "device_state"):
    assert r[name]["losses_equal"] and r[name]["params_equal"], (name, r[name])


@pytest.mark.parametrize("case, words", [
    ("device", ["device memory is short by", "embedding and head", "device_bytes"]),
    ("stack", ["`stack`='blocks'", "'layers'"]),
    ("host_bytes", ["`host_bytes` must be a positive number", "-1"]),
])
def test_bad_input_is_refused_naming_the_argument(case, words):
  message = records()["errors"][case]
  assert message is not None, f"{case}: accepted"
  for w in words:
    assert w in message, message
