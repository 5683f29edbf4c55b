"""``optax_hybrid.gpu_compile.step_time``: step times read off scheduled HLO, against answers worked out by hand.

In-process and compiler-free: small hand-written scheduled modules (and the
captured H100 modules of ``tests/data/hlo``) on a machine of round figures
(:data:`HW`), so that each expected time is a line of arithmetic written in
the test from the shapes: a copy of ``n`` bytes takes ``n / pcie``, a dot of
``2 m n k`` flops takes that over the peak, a copy overlaps compute only
between its start and its done. What XLA:GPU itself schedules (a copy loop, a
matmul chain, a loop fetching a trip ahead or not) is compiled for the H200
in ``tests/test_step_time_compile.py``.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest

from optax_hybrid import gpu_compile
from optax_hybrid.gpu_compile import step_time

HW = step_time.Hardware("round figures, no overheads", peak_flops=1e12, hbm_bandwidth=1e11, pcie_bandwidth=1e9,
                        nvlink_bandwidth=1e10, host_memory_bandwidth=1e10, gpus_per_node=1, launch_seconds=0,
                        while_trip_seconds=0, copy_latency_seconds=0, nccl_efficiency=1)
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hlo")

M = "f32[1000,1000]{1,0}"  # 4e6 bytes: 4 ms over the link
HOST_M = "f32[1000,1000]{1,0:S(5)}"
COPY = 4e6 / HW.pcie_bandwidth  # 4 ms
DOT = 2 * 1000 ** 3 / HW.peak_flops  # 2 ms (its 12e6 bytes take 0.12 ms)

FUSED_DOT = f"""
%fused_dot (p0: f32[1000,1000], p1: f32[1000,1000]) -> f32[1000,1000] {{
  %p0 = {M} parameter(0)
  %p1 = {M} parameter(1)
  ROOT %d = {M} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
"""


def module(entry: str, *computations: str, params: str = "") -> str:
  """A scheduled module: the computations, then ENTRY with ``entry``'s lines (the last is the root)."""
  return ("HloModule m, is_scheduled=true\n" + "".join(computations)
          + f"\nENTRY %main ({params}) -> f32[] {{\n{entry.strip()}\n}}\n")


def estimate(text: str) -> step_time.StepTime:
  return step_time.estimate(text, HW)


# --- one copy beside one kernel -------------------------------------------------

def test_a_copy_overlaps_the_kernel_scheduled_between_its_start_and_its_done():
  t = estimate(module(f"""
  %h = {HOST_M} parameter(0)
  %a = {M} parameter(1)
  %cs = ({M}, {HOST_M}, u32[]) copy-start(%h)
  %k = {M} fusion(%a, %a), kind=kCustom, calls=%fused_dot
  %cd = {M} copy-done(%cs)
  ROOT %t = ({M}, {M}) tuple(%k, %cd)""", FUSED_DOT))
  assert t.seconds == pytest.approx(max(COPY, DOT))
  assert t.compute == pytest.approx(DOT) and t.bus_in == pytest.approx(COPY) and t.bus_out == 0
  assert t.bus_busy == pytest.approx(COPY) and t.bus_hidden == pytest.approx(DOT)  # the kernel's 2 ms of the 4
  assert t.lower_bound == pytest.approx(COPY) and t.bus_hidden_fraction == pytest.approx(DOT / COPY)
  assert t.flops == 2e9 and t.kernels == 1


def test_a_copy_done_before_the_kernel_hides_nothing():
  t = estimate(module(f"""
  %h = {HOST_M} parameter(0)
  %a = {M} parameter(1)
  %cs = ({M}, {HOST_M}, u32[]) copy-start(%h)
  %cd = {M} copy-done(%cs)
  %k = {M} fusion(%a, %cd), kind=kCustom, calls=%fused_dot
  ROOT %t = ({M}) tuple(%k)""", FUSED_DOT))
  assert t.seconds == pytest.approx(COPY + DOT)
  assert t.bus_hidden == 0 and t.lower_bound == pytest.approx(COPY)


def test_a_synchronous_transfer_holds_the_stream_and_the_copy_out_uses_the_other_engine():
  t = estimate(module(f"""
  %a = {M} parameter(0)
  %h = {HOST_M} copy(%a)
  %cs = ({HOST_M}, {M}, u32[]) copy-start(%a)
  %k = {M} fusion(%a, %a), kind=kCustom, calls=%fused_dot
  %cd = {HOST_M} copy-done(%cs)
  ROOT %t = ({HOST_M}, {HOST_M}, {M}) tuple(%h, %cd, %k)"""))
  # The synchronous copy out (4 ms), then the asynchronous one queued behind it on the same engine (4 ms)
  # while the kernel runs (2 ms, no FUSED_DOT here: its bytes, 12e6 / 1e11 = 0.12 ms).
  kernel = 3 * 4e6 / HW.hbm_bandwidth
  assert t.bus_out == pytest.approx(2 * COPY) and t.bus_in == 0
  assert t.seconds == pytest.approx(2 * COPY)
  assert t.bus_hidden == pytest.approx(kernel)


def test_copies_in_and_out_run_at_once_on_their_two_engines():
  t = estimate(module(f"""
  %h = {HOST_M} parameter(0)
  %a = {M} parameter(1)
  %in = ({M}, {HOST_M}, u32[]) copy-start(%h)
  %out = ({HOST_M}, {M}, u32[]) copy-start(%a)
  %d1 = {M} copy-done(%in)
  %d2 = {HOST_M} copy-done(%out)
  ROOT %t = ({M}, {HOST_M}) tuple(%d1, %d2)"""))
  assert t.seconds == pytest.approx(COPY) and t.bus_in == pytest.approx(COPY) and t.bus_out == pytest.approx(COPY)
  assert t.bus_busy == pytest.approx(COPY)  # the union of the two engines' busy time


def test_two_copies_in_queue_on_one_engine():
  t = estimate(module(f"""
  %h = {HOST_M} parameter(0)
  %c1 = ({M}, {HOST_M}, u32[]) copy-start(%h)
  %c2 = ({M}, {HOST_M}, u32[]) copy-start(%h)
  %d1 = {M} copy-done(%c1)
  %d2 = {M} copy-done(%c2)
  ROOT %t = ({M}, {M}) tuple(%d1, %d2)"""))
  assert t.seconds == pytest.approx(2 * COPY) and t.bus_in == pytest.approx(2 * COPY)


# --- loops ----------------------------------------------------------------------

def loop_module(body_lines: str, trips: int, init: str, carried: str, after: str = "") -> str:
  """A loop of ``trips`` over ``body_lines`` (``%i``, ``%h`` given), started by ``init``; ``after``: entry lines after it."""
  body = f"""
%body (arg: {carried}) -> {carried} {{
  %arg = {carried} parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %h = {HOST_M} get-tuple-element(%arg), index=1
{body_lines}
}}

%cond (c: {carried}) -> pred[] {{
  %c = {carried} parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  ROOT %lt = pred[] compare(%ci, %ci), direction=LT
}}
"""
  entry = f"""
  %h = {HOST_M} parameter(0)
  %a = {M} parameter(1)
  %zero = s32[] constant(0)
{init}
  %w = {carried} while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"{trips}"}}}}
{after}
  ROOT %r = s32[] get-tuple-element(%w), index=0"""
  return module(entry, FUSED_DOT, body)


def test_a_loop_that_fetches_and_then_computes_pays_both_per_trip():
  carried = f"(s32[], {HOST_M}, {M})"
  text = loop_module(f"""
  %w0 = {M} get-tuple-element(%arg), index=2
  %cs = ({M}, {HOST_M}, u32[]) copy-start(%h)
  %cd = {M} copy-done(%cs)
  %k = {M} fusion(%w0, %cd), kind=kCustom, calls=%fused_dot
  ROOT %next = {carried} tuple(%i, %h, %k)""", 1000, f"  %init = {carried} tuple(%zero, %h, %a)", carried)
  t = estimate(text)
  assert t.seconds == pytest.approx(1000 * (COPY + DOT))
  assert t.bus_in == pytest.approx(1000 * COPY) and t.compute == pytest.approx(1000 * DOT)
  assert t.flops == 1000 * 2e9 and t.kernels == 1000
  (loop,) = t.loops
  assert (loop.body, loop.trips) == ("body", 1000)
  assert loop.seconds == pytest.approx(t.seconds) and loop.bus_in == pytest.approx(t.bus_in)


PENDING = f"({M}, {HOST_M}, u32[])"  # an asynchronous copy in flight, as a loop carries it
AHEAD = f"(s32[], {HOST_M}, {PENDING}, {M})"


def fetch_ahead(dots: int, trips: int) -> str:
  """A loop whose trip waits for the copy started in the trip before, starts the next one, then runs ``dots`` dots."""
  kernels = "\n".join(f"  %k{j} = {M} fusion(%{'w' if j == 0 else f'k{j - 1}'}, %w), kind=kCustom, calls=%fused_dot"
                      for j in range(dots))
  return loop_module(f"""
  %prev = {PENDING} get-tuple-element(%arg), index=2
  %w = {M} copy-done(%prev)
  %cs = {PENDING} copy-start(%h)
{kernels}
  ROOT %next = {AHEAD} tuple(%i, %h, %cs, %k{dots - 1})""", trips,
                     f"  %first = {PENDING} copy-start(%h)\n  %init = {AHEAD} tuple(%zero, %h, %first, %a)", AHEAD,
                     after=f"  %last = {PENDING} get-tuple-element(%w), index=2\n  %unused = {M} copy-done(%last)")


@pytest.mark.parametrize("dots,per_trip", [(1, COPY), (3, 3 * DOT)])
def test_a_loop_that_fetches_a_trip_ahead_hides_the_smaller_of_copy_and_compute(dots, per_trip):
  # 1000 trips; the copy started before the loop is waited for in full, then each trip takes the
  # longer of its copy (the next trip's) and its kernels.
  t = estimate(fetch_ahead(dots, 1000))
  assert t.seconds == pytest.approx(COPY + 1000 * per_trip, rel=1e-9)
  assert t.bus_in == pytest.approx(1001 * COPY)
  assert t.bus_hidden == pytest.approx(1000 * min(COPY, dots * DOT), rel=1e-9)
  assert t.lower_bound == pytest.approx(max(1001 * COPY, 1000 * dots * DOT))


@pytest.mark.parametrize("dots", [1, 3])
def test_the_trips_added_without_replay_equal_the_trips_replayed(dots, monkeypatch):
  text = fetch_ahead(dots, 300)
  shortcut = estimate(text)
  monkeypatch.setattr(step_time, "_close", lambda a, b: False)  # never two trips alike: all 300 replayed
  replayed = estimate(text)
  for field in ("seconds", "compute", "bus_in", "bus_busy", "bus_hidden", "flops", "kernels"):
    assert getattr(shortcut, field) == pytest.approx(getattr(replayed, field), rel=1e-9), field
  (fast,), (slow,) = shortcut.loops, replayed.loops
  assert fast.trips == slow.trips == 300 and fast.seconds == pytest.approx(slow.seconds, rel=1e-9)


def test_trips_alike_in_time_but_not_in_backlog_are_replayed():
  # Each trip starts a 4 ms copy and waits for the one started three trips before, then computes 2 ms:
  # the first trips each take 2 ms while the copy engine falls further behind (its backlog grows by
  # 2 ms a trip), so two trips of equal time are not yet a repeating state. Once the backlog binds,
  # a trip takes a copy's 4 ms; copy k ends at 4k ms, and the step ends with the last: 4 N ms.
  # (The three slots the loop starts with hold no copy: as if done before the loop.)
  carried = f"(s32[], {HOST_M}, {PENDING}, {PENDING}, {PENDING}, {M})"
  text = loop_module(f"""
  %p1 = {PENDING} get-tuple-element(%arg), index=2
  %p2 = {PENDING} get-tuple-element(%arg), index=3
  %p3 = {PENDING} get-tuple-element(%arg), index=4
  %w = {M} get-tuple-element(%arg), index=5
  %old = {M} copy-done(%p3)
  %cs = {PENDING} copy-start(%h)
  %k = {M} fusion(%w, %w), kind=kCustom, calls=%fused_dot
  ROOT %next = {carried} tuple(%i, %h, %cs, %p1, %p2, %k)""", 100,
                     f"  %init = {carried} tuple(%zero, %h, %a, %a, %a, %a)", carried,
                     after="\n".join(f"  %l{j} = {PENDING} get-tuple-element(%w), index={j}\n"
                                     f"  %d{j} = {M} copy-done(%l{j})" for j in (2, 3, 4)))
  t = estimate(text)
  assert t.seconds == pytest.approx(100 * COPY, rel=1e-9)
  assert t.bus_in == pytest.approx(100 * COPY) and t.compute == pytest.approx(100 * DOT)


def test_a_loop_of_unknown_trip_count_runs_once_and_is_counted():
  carried = f"(s32[], {HOST_M}, {M})"
  text = loop_module(f"""
  %w0 = {M} get-tuple-element(%arg), index=2
  %k = {M} fusion(%w0, %w0), kind=kCustom, calls=%fused_dot
  ROOT %next = {carried} tuple(%i, %h, %k)""", 7, f"  %init = {carried} tuple(%zero, %h, %a)", carried)
  text = text.replace(', backend_config={"known_trip_count":{"n":"7"}}', "")
  t = estimate(text)
  assert t.unknown_trip_counts == 1 and t.seconds == pytest.approx(DOT)


# --- what a kernel costs ----------------------------------------------------------

def test_a_fusion_that_updates_a_buffer_in_place_moves_the_update_only():
  text = module(f"""
  %big = f32[100,1000,1000]{{2,1,0}} parameter(0)
  %row = f32[1,1000,1000]{{2,1,0}} parameter(1)
  %i = s32[] parameter(2)
  ROOT %f = f32[100,1000,1000]{{2,1,0}} fusion(%big, %row, %i), kind=kLoop, calls=%put""", f"""
%put (p0: f32[100,1000,1000], p1: f32[1,1000,1000], p2: s32[]) -> f32[100,1000,1000] {{
  %p0 = f32[100,1000,1000]{{2,1,0}} parameter(0)
  %p1 = f32[1,1000,1000]{{2,1,0}} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %neg = f32[1,1000,1000]{{2,1,0}} negate(%p1)
  ROOT %u = f32[100,1000,1000]{{2,1,0}} dynamic-update-slice(%p0, %neg, %p2, %z, %z)
}}
""")
  # Read the row (4e6) and the index (4), write the row (4e6): not the 400 MB buffer.
  assert estimate(text).seconds == pytest.approx((2 * 4e6 + 4) / HW.hbm_bandwidth)


def test_a_fusion_that_reads_a_slice_of_an_operand_reads_the_slice_only():
  text = module(f"""
  %big = f32[100,1000,1000]{{2,1,0}} parameter(0)
  %i = s32[] parameter(1)
  ROOT %f = f32[1000,1000]{{1,0}} fusion(%big, %i), kind=kLoop, calls=%take""", f"""
%take (p0: f32[100,1000,1000], p1: s32[]) -> f32[1000,1000] {{
  %p0 = f32[100,1000,1000]{{2,1,0}} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %s = f32[1,1000,1000]{{2,1,0}} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={{1,1000,1000}}
  %b = f32[1000,1000]{{1,0}} bitcast(%s)
  ROOT %e = f32[1000,1000]{{1,0}} exponential(%b)
}}
""")
  assert estimate(text).seconds == pytest.approx((2 * 4e6 + 4) / HW.hbm_bandwidth)


def test_a_batched_dot_counts_its_batch_and_a_cublas_gemm_its_backend_dimensions():
  dot = module("""
  %q = bf16[32,2048,128]{2,1,0} parameter(0)
  %k = bf16[32,2048,128]{2,1,0} parameter(1)
  ROOT %s = bf16[32,2048,2048]{2,1,0} dot(%q, %k), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={2}""")
  assert estimate(dot).flops == 2 * 32 * 2048 * 2048 * 128
  gemm = module("""
  %a = bf16[4096,1024]{1,0} parameter(0)
  %b = bf16[1024,512]{1,0} parameter(1)
  ROOT %g = (bf16[4096,512]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}""")
  t = estimate(gemm)
  assert t.flops == 2 * 4096 * 512 * 1024 and t.seconds == pytest.approx(t.flops / HW.peak_flops)


def test_a_convolution_counts_a_kernel_window_per_output():
  conv = module("""
  %x = f32[8,32,32,16]{3,2,1,0} parameter(0)
  %w = f32[3,3,16,64]{3,2,1,0} parameter(1)
  ROOT %y = f32[8,32,32,64]{3,2,1,0} convolution(%x, %w), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f""")
  assert estimate(conv).flops == 2 * (8 * 32 * 32 * 64) * (3 * 3 * 16)


# --- host computations, collectives, branches ---------------------------------------

def test_a_host_computation_reads_its_device_input_over_the_link_then_runs_at_host_bandwidth():
  with open(os.path.join(DATA, "host_compute.hlo")) as f:
    t = estimate(f.read())
  # custom-call-start ((g f32[256] on the device, a f32[256] in host memory), f32[256] in host memory, u32[]):
  # g crosses to the host (1024 B), then the host reads g and a and writes the result (3 x 1024 B + the u32).
  assert t.bus_out == pytest.approx(1024 / HW.pcie_bandwidth) and t.bus_in == 0
  assert t.host == pytest.approx((3 * 1024 + 4) / HW.host_memory_share)
  assert t.seconds == pytest.approx(t.bus_out + t.host) and t.compute == 0


@pytest.mark.parametrize("op,attrs,moved", [
    ("all-reduce", "replica_groups={{0,1,2,3}}, to_apply=%add", 2 * 3 / 4),
    ("all-gather", "replica_groups=[1,4]<=[4], dimensions={0}", 3 / 4),
    ("collective-permute", "source_target_pairs={{0,1},{1,0}}", 1.0),
])
def test_a_collective_moves_its_ring_share_at_nvlink_bandwidth(op, attrs, moved):
  out = "f32[4000000]{0}" if op == "all-gather" else "f32[1000000]{0}"
  t = estimate(module(f"""
  %x = f32[1000000]{{0}} parameter(0)
  ROOT %y = {out} {op}(%x), {attrs}"""))
  assert t.collectives == pytest.approx(moved * 16e6 / HW.nvlink_bandwidth if op == "all-gather"
                                        else moved * 4e6 / HW.nvlink_bandwidth)
  assert t.seconds == pytest.approx(t.collectives) and t.compute == 0


def test_a_conditional_takes_its_slowest_branch():
  text = module(f"""
  %p = s32[] parameter(0)
  %a = {M} parameter(1)
  ROOT %c = {M} conditional(%p, %a, %a), branch_computations={{%cheap, %dear}}""", FUSED_DOT, f"""
%cheap (x: f32[1000,1000]) -> f32[1000,1000] {{
  %x = {M} parameter(0)
  ROOT %n = {M} negate(%x)
}}

%dear (y: f32[1000,1000]) -> f32[1000,1000] {{
  %y = {M} parameter(0)
  %d1 = {M} fusion(%y, %y), kind=kCustom, calls=%fused_dot
  ROOT %d2 = {M} fusion(%d1, %y), kind=kCustom, calls=%fused_dot
}}
""")
  assert estimate(text).seconds == pytest.approx(2 * DOT)


# --- real modules and the API ---------------------------------------------------------

@pytest.mark.parametrize("name", ["scan_host_stack", "streamed_layers", "host_device_copies"])
def test_the_link_carries_what_count_hlo_counts(name):
  with open(os.path.join(DATA, name + ".hlo")) as f:
    text = f.read()
  summary, t = gpu_compile.count_hlo(text), estimate(text)
  assert t.bus_in == pytest.approx(summary.to_device_bytes / HW.pcie_bandwidth)
  assert t.bus_out == pytest.approx(summary.to_host_bytes / HW.pcie_bandwidth)
  assert t.lower_bound <= t.seconds <= t.compute + t.bus_in + t.bus_out + t.host + 1e-12


def test_mfu_is_model_flops_over_time_and_peak():
  t = estimate(module(f"""
  %a = {M} parameter(0)
  ROOT %k = {M} fusion(%a, %a), kind=kCustom, calls=%fused_dot""", FUSED_DOT))
  assert t.mfu(1e9) == pytest.approx(1e9 / (DOT * HW.peak_flops))
  assert t.as_dict()["lower_bound"] == pytest.approx(DOT) and t.as_dict()["hardware"] == HW.name


def test_named_hardware_and_bad_input():
  text = module(f"%a = {M} parameter(0)\n  ROOT %n = {M} negate(%a)")
  assert step_time.estimate(text, "h100").hardware is step_time.H100_SXM
  assert step_time.estimate(text).hardware is step_time.H200_SXM
  with pytest.raises(ValueError, match="`hardware` must be a Hardware or one of"):
    step_time.estimate(text, "a100")
  with pytest.raises(ValueError, match="`hlo` must be an optimized HLO module's text"):
    step_time.estimate("not HLO")
  with pytest.raises(TypeError):  # every figure is a keyword: the order of earlier releases cannot slip through
    step_time.Hardware("x", 1e12, 1e11, 1e9, 1e10, 1e10)
  bad = [("pcie_bandwidth", 0, "must be a positive number"), ("peak_flops", float("nan"), "must be a finite number"),
         ("launch_seconds", -1e-6, "must be 0 or more seconds"), ("copy_latency_seconds", math.inf, "must be a finite number"),
         ("nccl_efficiency", 1.5, r"must be in \(0, 1\]"), ("gpus_per_node", 0, "must be a positive int"),
         ("gpus_per_node", 8.0, "must be a positive int"), ("host_memory_bandwidth", True, "must be a finite number"),
         ("launch_queue", 0, "must be a positive int")]
  for field, value, message in bad:
    with pytest.raises(ValueError, match=f"`{field}` {message}"):
      dataclasses.replace(HW, **{field: value})


def test_the_h200_figures_are_the_spec_sheets_and_the_cited_measurements():
  h = step_time.H200_SXM
  assert (h.peak_flops, h.hbm_bandwidth, h.nvlink_bandwidth) == (989e12, 4.8e12, 450e9)
  assert 50e9 <= h.pcie_bandwidth <= 64e9 and step_time.H100_SXM.hbm_bandwidth == 3.35e12
  # DGX H200: 2 sockets x 8 DDR5-4800 channels x 8 bytes, shared by its 8 GPUs.
  assert h.host_memory_bandwidth == 614.4e9 and h.gpus_per_node == 8 and h.host_memory_share == 76.8e9
  # NVIDIA's CUDA Graphs blog (3.8 us per launch; 9.6 - 3.8 us per synchronization), GDRCopy (6-7 us per
  # cudaMemcpy), nccl-tests issue 326 (360 of 450 GB/s).
  assert (h.launch_seconds, h.while_trip_seconds, h.copy_latency_seconds) == (3.8e-6, 5.8e-6, 6e-6)
  assert h.launch_queue == 1024  # OneFlow pull request 890: launches block past 1,024 pending kernels
  assert h.nccl_efficiency == 360 / 450


def test_kernel_seconds_name_each_kernel_and_leave_out_transfers():
  seconds = step_time.kernel_seconds(module(f"""
  %h = {HOST_M} parameter(0)
  %a = {M} parameter(1)
  %cs = ({M}, {HOST_M}, u32[]) copy-start(%h)
  %k = {M} fusion(%a, %a), kind=kCustom, calls=%fused_dot
  %cd = {M} copy-done(%cs)
  %sync = {HOST_M} copy(%k)
  ROOT %t = ({M}, {HOST_M}) tuple(%cd, %sync)""", FUSED_DOT), HW)
  assert seconds == pytest.approx({"k": DOT})


# --- what a GPU costs beyond its rooflines: launches, loop trips, copy latency, shared host memory, NCCL ------

LAUNCH, TRIP, LATENCY = 5e-6, 7e-6, 3e-6
OVERHEADS = dataclasses.replace(HW, name="round figures with overheads", launch_seconds=LAUNCH,
                                while_trip_seconds=TRIP, copy_latency_seconds=LATENCY)
TINY = "f32[2]{0}"
TINY_KERNEL = 2 * 8 / HW.hbm_bandwidth  # reads 8 bytes, writes 8: 0.16 ns


def tiny_kernels(count: int) -> str:
  """``count`` kernels one after the other, each negating an 8-byte vector."""
  lines = [f"%a = {TINY} parameter(0)"] + [f"%n{j} = {TINY} negate(%{'a' if j == 0 else f'n{j - 1}'})"
                                           for j in range(count)]
  return module("\n  ".join(lines[:-1] + ["ROOT " + lines[-1]]))


def test_a_thousand_tiny_kernels_take_a_launch_each():
  t = step_time.estimate(tiny_kernels(1000), OVERHEADS)
  # The host issues kernel j at (j + 1) launches; each runs as soon as it is issued (0.16 ns < 5 us).
  assert t.seconds == pytest.approx(1000 * LAUNCH + TINY_KERNEL, rel=1e-9)
  assert t.launches == t.kernels == 1000 and t.launch_time == pytest.approx(1000 * LAUNCH)
  assert t.lower_bound == pytest.approx(1000 * LAUNCH) and t.compute == pytest.approx(1000 * TINY_KERNEL)
  assert t.launch_wait == pytest.approx(LAUNCH + 999 * (LAUNCH - TINY_KERNEL))
  assert not t.command_buffers_read


def test_a_command_buffer_launches_its_kernels_at_once():
  names = frozenset(f"n{j}" for j in range(1000))
  plan = gpu_compile.CommandBuffers(members=names, launched_at=frozenset({"n0"}), buffers=1)
  t = step_time.estimate(tiny_kernels(1000), OVERHEADS, plan)
  assert t.seconds == pytest.approx(LAUNCH + 1000 * TINY_KERNEL, rel=1e-9)
  assert t.launches == 1 and t.kernels == 1000 and t.command_buffers_read


def test_kernels_longer_than_a_launch_hide_the_launches_after_the_first():
  lines = "\n  ".join(f"%k{j} = {M} fusion(%{'a' if j == 0 else f'k{j - 1}'}, %a), kind=kCustom, calls=%fused_dot"
                      for j in range(999))
  t = step_time.estimate(module(f"%a = {M} parameter(0)\n  {lines}\n  ROOT %k999 = {M} fusion(%k998, %a), "
                                f"kind=kCustom, calls=%fused_dot", FUSED_DOT), OVERHEADS)
  assert t.seconds == pytest.approx(LAUNCH + 1000 * DOT, rel=1e-9) and t.launch_wait == pytest.approx(LAUNCH)


def test_the_host_runs_ahead_of_a_long_kernel_by_at_most_its_launch_queue():
  # One 2 ms matmul, then 2,000 tiny kernels launched 5 us apart: 10 ms of launches.
  tiny = "\n  ".join(f"%n{j} = {TINY} negate(%{'v' if j == 0 else f'n{j - 1}'})" for j in range(2000))
  text = module(f"""
  %a = {M} parameter(0)
  %v = {TINY} parameter(1)
  %k = {M} fusion(%a, %a), kind=kCustom, calls=%fused_dot
  {tiny}
  ROOT %t = ({M}, {TINY}) tuple(%k, %n1999)""", FUSED_DOT)
  unbounded, queued = (step_time.estimate(text, dataclasses.replace(OVERHEADS, launch_queue=q)) for q in (10**6, 100))
  # Without a bound the host keeps launching while the matmul runs: 2,001 launches are the step.
  assert unbounded.seconds == pytest.approx(2001 * LAUNCH + TINY_KERNEL, rel=1e-9)
  # With 100 places the host stops at the 102nd launch until the second kernel starts (after the matmul), then
  # launches the last 1,900 one by one.
  assert queued.seconds == pytest.approx(LAUNCH + DOT + 1900 * LAUNCH + TINY_KERNEL, rel=1e-9)


SMALL = "f32[1024]{0}"  # 4 KB
HOST_SMALL = "f32[1024]{0:S(5)}"


def copies_in(count: int) -> str:
  """A loop of ``count`` trips, each bringing 4 KB in from host memory and waiting for it."""
  carried = f"(s32[], {HOST_M}, {HOST_SMALL}, {SMALL})"
  return loop_module(f"""
  %s = {HOST_SMALL} get-tuple-element(%arg), index=2
  %cs = ({SMALL}, {HOST_SMALL}, u32[]) copy-start(%s)
  %cd = {SMALL} copy-done(%cs)
  ROOT %next = {carried} tuple(%i, %h, %s, %cd)""", count,
                     f"  %small = {HOST_SMALL} parameter(2)\n  %d = {SMALL} parameter(3)\n"
                     f"  %init = {carried} tuple(%zero, %h, %small, %d)", carried)


def test_a_thousand_small_copies_pay_their_latency_each():
  no_launch = dataclasses.replace(OVERHEADS, launch_seconds=0)
  t = step_time.estimate(copies_in(1000), no_launch)
  copy = LATENCY + 4096 / HW.pcie_bandwidth  # 3 us + 4.1 us
  assert t.seconds == pytest.approx(1000 * copy, rel=1e-9) and t.bus_in == pytest.approx(1000 * copy, rel=1e-9)
  assert t.loop_trips == 1000 and t.launches == 1000  # each copy is issued (at no cost here)
  with_launch = step_time.estimate(copies_in(1000), OVERHEADS)
  # The host issues every copy 5 us after the one before, ahead of the link: only the first launch shows.
  assert with_launch.seconds == pytest.approx(LAUNCH + 1000 * copy, rel=1e-9)


def tiny_loop(trips: int, known: bool = True) -> str:
  carried = f"(s32[], {HOST_M}, {TINY})"
  text = loop_module(f"""
  %v = {TINY} get-tuple-element(%arg), index=2
  %n = {TINY} negate(%v)
  ROOT %next = {carried} tuple(%i, %h, %n)""", trips, f"  %v0 = {TINY} parameter(2)\n  %init = {carried} tuple(%zero, %h, %v0)",
                     carried)
  return text if known else text.replace(f', backend_config={{"known_trip_count":{{"n":"{trips}"}}}}', "")


def test_a_loop_of_many_short_trips_is_bound_by_the_host():
  t = step_time.estimate(tiny_loop(1000), OVERHEADS)
  # XLA knows the trip count: the host launches each trip's kernel without waiting for the device.
  assert t.seconds == pytest.approx(1000 * LAUNCH + TINY_KERNEL, rel=1e-9)
  assert t.loop_trips == 1000 and t.launches == 1000
  (loop,) = t.loops
  assert (loop.trips, loop.launches, loop.kernels, loop.inner_trips) == (1000, 1000, 1000, 0)


def test_a_loop_counts_the_kernels_and_the_trips_of_the_loops_in_its_body():
  carried = f"(s32[], {TINY})"
  count_to = lambda name: f"""
%{name} (c: {carried}) -> pred[] {{
  %c = {carried} parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  ROOT %lt = pred[] compare(%ci, %ci), direction=LT
}}
"""
  inner = f"""
%inner (a: {carried}) -> {carried} {{
  %a = {carried} parameter(0)
  %j = s32[] get-tuple-element(%a), index=0
  %v = {TINY} get-tuple-element(%a), index=1
  %n = {TINY} negate(%v)
  ROOT %r = {carried} tuple(%j, %n)
}}
"""
  outer = f"""
%outer (b: {carried}) -> {carried} {{
  %b = {carried} parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %v = {TINY} get-tuple-element(%b), index=1
  %m = {TINY} negate(%v)
  %start = {carried} tuple(%i, %m)
  ROOT %w = {carried} while(%start), condition=%inner_cond, body=%inner, backend_config={{"known_trip_count":{{"n":"5"}}}}
}}
"""
  text = module(f"""
  %p = {TINY} parameter(0)
  %zero = s32[] constant(0)
  %start = {carried} tuple(%zero, %p)
  %w = {carried} while(%start), condition=%outer_cond, body=%outer, backend_config={{"known_trip_count":{{"n":"10"}}}}
  ROOT %r = s32[] get-tuple-element(%w), index=0""", count_to("inner_cond"), count_to("outer_cond"), inner, outer)
  t = step_time.estimate(text, OVERHEADS)
  by_body = {loop.body: loop for loop in t.loops}
  assert (by_body["outer"].trips, by_body["outer"].kernels, by_body["outer"].inner_trips) == (10, 10 * (1 + 5), 10 * 5)
  assert (by_body["inner"].trips, by_body["inner"].kernels, by_body["inner"].inner_trips) == (50, 50, 0)
  assert t.kernels == 60 and t.loop_trips == 10 + 50


def test_a_loop_run_from_a_command_buffer_costs_one_launch():
  plan = gpu_compile.CommandBuffers(members=frozenset({"w", "n"}), launched_at=frozenset({"w"}),
                                  captured_loops=frozenset({"w"}), buffers=1)
  t = step_time.estimate(tiny_loop(1000), OVERHEADS, plan)
  assert t.seconds == pytest.approx(LAUNCH + 1000 * TINY_KERNEL, rel=1e-9)
  assert t.launches == 1 and t.loop_trips == 0  # the device runs the trips
  (loop,) = t.loops
  assert (loop.trips, loop.kernels, loop.inner_trips) == (1000, 1000, 0)


def test_a_trip_of_unknown_count_waits_for_its_predicate_on_the_host():
  t = step_time.estimate(tiny_loop(1000, known=False), OVERHEADS)
  # One trip (its count unknown): the condition's kernel (launched; compare(i, i) reads 2 x 4 bytes, writes 1),
  # its predicate copied back and waited for, then the body's kernel launched.
  condition = (2 * 4 + 1) / HW.hbm_bandwidth
  assert t.unknown_trip_counts == 1 and t.loop_trips == 1 and t.launches == 2
  assert t.seconds == pytest.approx(LAUNCH + condition + LATENCY + TRIP + LAUNCH + TINY_KERNEL, rel=1e-9)


BIG = "f32[100000000]{0}"  # 400 MB
HOST_BIG = "f32[100000000]{0:S(5)}"
NODE = dataclasses.replace(HW, name="8 GPUs at 1 GB/s each way sharing 4 GB/s of host memory",
                           host_memory_bandwidth=4e9, gpus_per_node=8)


@pytest.mark.parametrize("gpus,expected", [(1, 0.4), (2, 0.4), (8, 0.8)])
def test_a_copy_is_bound_by_the_link_or_by_its_gpus_share_of_host_memory(gpus, expected):
  text = module(f"""
  %h = {HOST_BIG} parameter(0)
  %cs = ({BIG}, {HOST_BIG}, u32[]) copy-start(%h)
  ROOT %cd = {BIG} copy-done(%cs)""")
  t = step_time.estimate(text, dataclasses.replace(NODE, gpus_per_node=gpus))
  # 400 MB: 0.4 s over the 1 GB/s link; through host memory, 400 MB / (4 GB/s / gpus).
  assert t.seconds == pytest.approx(max(4e8 / 1e9, 4e8 / (4e9 / gpus))) == expected
  assert t.bus_in == pytest.approx(0.4) and t.host_memory == pytest.approx(4e8 / (4e9 / gpus))


def test_eight_gpus_copying_both_ways_share_the_node_host_memory():
  text = module(f"""
  %h = {HOST_BIG} parameter(0)
  %d = {BIG} parameter(1)
  %in = ({BIG}, {HOST_BIG}, u32[]) copy-start(%h)
  %out = ({HOST_BIG}, {BIG}, u32[]) copy-start(%d)
  %d1 = {BIG} copy-done(%in)
  %d2 = {HOST_BIG} copy-done(%out)
  ROOT %t = ({BIG}, {HOST_BIG}) tuple(%d1, %d2)""")
  alone, node = (step_time.estimate(text, dataclasses.replace(NODE, gpus_per_node=g)) for g in (1, 8))
  assert alone.seconds == pytest.approx(0.4)  # 800 MB through 4 GB/s of host memory: 0.2 s, under the links' 0.4
  assert node.seconds == pytest.approx(8e8 / 0.5e9) and node.lower_bound == pytest.approx(1.6)  # 0.5 GB/s each


def test_nccl_reaches_its_share_of_nvlink():
  text = module("""
  %x = f32[1000000]{0} parameter(0)
  ROOT %y = f32[8000000]{0} all-gather(%x), replica_groups=[1,8]<=[8], dimensions={0}""")
  t = step_time.estimate(text, dataclasses.replace(HW, nccl_efficiency=0.8))
  assert t.collectives == pytest.approx(7 / 8 * 32e6 / (0.8 * HW.nvlink_bandwidth))


@pytest.mark.parametrize("groups,size", [
    ("mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", 8),  # what the SPMD partitioner writes
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", 4),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}", 8),
    ("{{0,1,2,3},{4,5,6,7}}", 4),
    ("[2,4]<=[4,2]T(1,0)", 4),
    ("{}", 8),  # every device of the program (num_partitions=8)
])
def test_every_form_of_replica_groups_is_read(groups, size):
  text = module(f"""
  %x = f32[1000000]{{0}} parameter(0)
  ROOT %y = f32[1000000]{{0}} all-reduce(%x), replica_groups={groups}, to_apply=%add""").replace(
      "HloModule m, is_scheduled=true", "HloModule m, is_scheduled=true, num_partitions=8")
  t = estimate(text)
  assert t.collectives == pytest.approx(2 * (size - 1) / size * 4e6 / HW.nvlink_bandwidth)


THUNK_SEQUENCE = """\
001: kCopy          [source       | next=002 (1)] kCopy
002: kWhile         [prev=001 (1) | next=000 (1)]
condition:
    003: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1]
  body:
    000: kCommandBuffer [source | sink]
        004: kCustomKernel [source       | next=005 (1)] loop_add_fusion grid: [2, 1, 1]
        005: kCustomKernel [prev=004 (1) | sink        ] loop_slice_fusion grid: [1, 1, 1]
000: kCommandBuffer [prev=002 (1) | sink        ]
    006: kCustomKernel [source       | next=007 (1)] loop_multiply_fusion grid: [2, 1, 1]
    007: kWhile        [prev=006 (1) | sink        ]
    condition:
        008: kCustomKernel [source | sink] loop_compare_fusion_1 grid: [1, 1, 1]
      body:
        009: kCustomKernel [source | sink] loop_negate_fusion grid: [1, 1, 1]
"""
THUNK_NAMES = {1: "copy.1", 2: "while.2", 3: "compare.3", 4: "add.4", 5: "slice.5", 6: "mul.6", 7: "while.7",
               8: "compare.8", 9: "neg.9"}


def test_the_thunk_plan_names_what_runs_from_command_buffers():
  metadata = "".join(f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n    thunk_id: {i}\n  }}\n'
                     f'  thunk_kind: "k"\n}}\n' for i, name in THUNK_NAMES.items())
  plan = gpu_compile.parse_thunk_plan(THUNK_SEQUENCE, metadata)
  # The first loop is driven by the host, its body one command buffer (launched at add.4 each trip); the
  # second command buffer holds a loop whose trips the device runs.
  assert plan.members == {"add.4", "slice.5", "mul.6", "while.7", "compare.8", "neg.9"}
  assert plan.launched_at == {"add.4", "mul.6"} and plan.captured_loops == {"while.7"} and plan.buffers == 2
