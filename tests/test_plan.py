"""Tests for optax_hybrid.plan: the plan's equality (what jit keys on) and the streaming stages.

The stage sizes below are written out by hand from the documented rule
(consecutive ``host_state``/``host`` leaves, counted per place the update runs,
up to ``STREAM_STAGE_BYTES`` of state each: every field of the rule and the
master; a leaf larger than that is a stage of its own), not computed with the
module's own helpers.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_hybrid
from optax_hybrid import masters, moments, placement
from optax_hybrid.plan import STREAM_STAGE_BYTES, LeafPlan, Plan, assign_slices, assign_stages, state_bytes

needs_host = pytest.mark.skipif("pinned_host" not in placement.available_memory_kinds(),
                                reason="no pinned_host memory on this backend")

F32, BF16 = np.dtype(np.float32), np.dtype(jnp.bfloat16)


COPY = masters.FORMATS[masters.FLOAT32]  # a float32 copy: what master_dtype=jnp.float32 keeps


def leaf(tier, dtypes=(F32, F32), master=None, stored_as=moments.AS_STORED):
  """A leaf's plan as make_plan writes it for Adam (two fields), stage 0."""
  state_kind = "device" if tier == "device" else "pinned_host"
  return LeafPlan(path=f"['{tier}']", tier=tier, param_kind="device", state_kind=state_kind, dtypes=dtypes,
                  master_dtype=master, master=masters.NO_MASTER if master is None else COPY, moments=stored_as)


# --- equality: what jit's cache keys on -----------------------------------------

def plan_of(leaves):
  return Plan(tuple(leaves), fields=(), owner="hybrid_adamw")


def test_plans_differing_in_one_leafs_tier_or_stage_are_not_equal():
  base = [leaf("device"), leaf("host_state"), leaf("host_state")]
  plan = plan_of(base)
  assert plan == plan_of(list(base)) and hash(plan) == hash(plan_of(list(base)))
  other_tier = plan_of([base[0], dataclasses.replace(base[1], tier="host"), base[2]])
  other_stage = plan_of([base[0], base[1], dataclasses.replace(base[2], stage=1)])
  for other in (other_tier, other_stage):
    assert plan != other and other != plan
    assert not plan == other  # __eq__ itself, not only __ne__
  # Something that is not a plan is never equal to one (and comparing does not raise).
  assert plan != "a plan" and plan != None  # noqa: E711


def test_a_jitted_step_retraces_for_a_plan_that_differs_only_in_a_stage():
  traces = []

  @jax.jit
  def count(plan, x):
    traces.append(plan)
    return x + 1

  base = [leaf("host_state"), leaf("host_state")]
  x = jnp.zeros(())
  count(plan_of(base), x)
  count(plan_of(list(base)), x)  # an equal plan: the trace is reused
  assert len(traces) == 1
  count(plan_of([base[0], dataclasses.replace(base[1], stage=1)]), x)
  assert len(traces) == 2 and traces[1].leaves[1].stage == 1


# --- streaming stages --------------------------------------------------------------

def test_state_bytes_counts_every_field_and_the_master():
  assert state_bytes(leaf("host_state"), (10, 3)) == 30 * (4 + 4)
  assert state_bytes(leaf("host_state", dtypes=(BF16, BF16), master=F32), (7,)) == 7 * (2 + 2 + 4)
  # 8-bit: per field one byte per value and a float32 scale per block of 256 along the last axis.
  q = leaf("host_state", stored_as=moments.BLOCKWISE_8BIT, master=F32)
  assert state_bytes(q, (3, 300)) == 2 * (900 + 3 * 2 * 4) + 900 * 4
  assert all(type(state_bytes(lp, (3, 300))) is int for lp in (q, leaf("host_state")))  # bytes, not a float


def test_stages_take_consecutive_leaves_up_to_the_budget_per_place():
  # fp32 Adam: 8 bytes of state per value. Budget 800 bytes.
  leaves = [leaf("host_state"), leaf("host"), leaf("host_state"), leaf("host"), leaf("host_state"),
            leaf("device"), leaf("disk"), leaf("host_state"), leaf("host_state")]
  shapes = [(40,), (40,), (40,), (200,), (20,), (1000,), (1000,), (40,), (40,)]
  # host_state (runs on the device): 320 + 320 + 160 = 800 fits exactly -> stage 0; 320 -> stage 1, 320 more
  # -> 640 still stage 1. host (runs on the host), counted apart: 320 -> stage 0; 1600 does not fit with
  # it -> stage 1 (alone: larger than the budget). device and disk leaves are not streamed: stage 0.
  got = assign_stages(leaves, shapes, budget=800)
  assert [lp.stage for lp in got] == [0, 0, 0, 1, 0, 0, 0, 1, 1]
  none = masters.NO_MASTER
  assert [lp.group for lp in got] == [("device", 0, none), ("host", 0, none), ("device", 0, none),
                                      ("host", 1, none), ("device", 0, none), ("device", 0, none),
                                      ("device", 0, none), ("device", 1, none), ("device", 1, none)]
  assert [lp.tier for lp in got] == [lp.tier for lp in leaves]  # nothing else changes
  assert [lp.stage for lp in leaves] == [0] * len(leaves)  # the input plans are left as they were



def test_a_host_state_leaf_larger_than_the_budget_crosses_in_slices_of_rows():
  # float32 mu and nu: 8 bytes per value. (12, 10) is 960 bytes: over a budget of 400, cut into the largest
  # number of rows dividing 12 whose state fits 400 bytes: 5 rows (400 B) does not divide 12, so 4 (320 B).
  leaves = [leaf("host_state"), leaf("host_state"), leaf("host"), leaf("device"), leaf("host_state"),
            leaf("host_state"), leaf("host_state")]
  shapes = [(12, 10), (4, 10), (12, 10), (12, 10), (7, 10), (120,), (1, 100)]
  got = assign_slices(leaves, shapes, budget=400)
  # (4, 10) fits whole; the host and device tiers are not cut; 7 rows of 80 B: 5 would fit but 7 is prime,
  # so one row at a time; a vector and a leaf of one row have no rows to cut.
  assert [lp.slice_rows for lp in got] == [4, 0, 0, 0, 1, 0, 0]
  assert [lp.stage for lp in got] == [lp.stage for lp in leaves]  # nothing else changes
  # A row larger than the budget still crosses a row at a time; 8-bit codes and scales count as stored.
  assert assign_slices([leaf("host_state")], [(3, 100)], budget=400)[0].slice_rows == 1
  q = leaf("host_state", stored_as=moments.BLOCKWISE_8BIT)
  per_row = 2 * (256 + 4)  # two moments: a code per value, a float32 scale per block of 256
  assert assign_slices([q], [(6, 256)], budget=3 * per_row)[0].slice_rows == 3
  assert assign_slices([q], [(6, 256)], budget=3 * per_row - 1)[0].slice_rows == 2


def test_a_leaf_larger_than_the_budget_is_a_stage_of_its_own():
  leaves = [leaf("host_state") for _ in range(4)]
  # 1600 bytes: stage 0 (nothing before it); 80 cannot join it (stage 1), 800 cannot join 80 (stage 2),
  # 8 cannot join 800 (stage 3).
  got = assign_stages(leaves, [(200,), (10,), (100,), (1,)], budget=800)
  assert [lp.stage for lp in got] == [0, 1, 2, 3]
  # A master counts: bf16 moments with an fp32 master are 8 bytes per value, plain bf16 Adam 4.
  mixed = [leaf("host_state", dtypes=(BF16, BF16), master=F32), leaf("host_state", dtypes=(BF16, BF16)),
           leaf("host_state", dtypes=(BF16, BF16), master=F32)]
  got = assign_stages(mixed, [(50,), (100,), (1,)], budget=800)  # 400 + 400 = 800; then 8 more
  assert [lp.stage for lp in got] == [0, 0, 1]
  assert [lp.group for lp in got] == [("device", 0, COPY), ("device", 0, masters.NO_MASTER), ("device", 1, COPY)]


@needs_host
def test_init_cuts_host_state_into_64_mib_stages():
  assert STREAM_STAGE_BYTES == 64 * 2**20
  # Abstract params (no memory): five fp32 leaves of 4 Mi values, 32 MiB of Adam state each, then a
  # device leaf and two host leaves, whose stages are counted apart.
  n = 4 * 2**20
  names = ["a", "b", "c", "d", "e", "f", "g", "h"]
  params = {k: jax.ShapeDtypeStruct((n,), jnp.float32) for k in names}
  tiers = dict(zip(names, ["host_state"] * 5 + ["device", "host", "host"]))
  plan = jax.eval_shape(optax_hybrid.hybrid_adamw(1e-3, tiers=tiers).init, params).plan
  assert [lp.stage for lp in plan.leaves] == [0, 0, 1, 1, 2, 0, 0, 0]
  assert [lp.group[:2] for lp in plan.leaves] == [("device", 0), ("device", 0), ("device", 1), ("device", 1),
                                                  ("device", 2), ("device", 0), ("host", 0), ("host", 0)]
