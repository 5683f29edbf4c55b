"""What ``optax_hybrid.gpu_compile`` reads off optimized HLO text, against counts worked out by hand.

In-process and compiler-free (no CUDA plugin, no subprocess but one ``pip``
run): ``count_hlo``, ``loop_transfers`` and their helpers are text
processing, checked here on

* four optimized HLO modules XLA:GPU compiled for the H100, captured once by
  ``tests/data/hlo/capture.py`` (host<->device ``copy-start``, a ``while``
  fetching slices of a host stack, a ``HostExecute`` host computation, a
  streamed gradient writing slices back to host memory);
* small hand-written modules for what those lack (synchronous transfers,
  ``conditional`` and ``call`` bodies, host callbacks, Triton launches, a loop
  of unknown trip count).

Every expected figure comes from reading the text (each test says how), not
from running the code. What needs the CUDA compiler itself
(``compile_for_gpu``, ``compile_lowered``, the plugin's registration) is
tested by ``test_gpu_compile.py``, ``test_model_compile.py``,
``test_streaming_compile.py`` and ``test_cuda_plugin.py`` in subprocesses.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

import jax
import jax.numpy as jnp
import pytest

from optax_hybrid import gpu_compile
from optax_hybrid.gpu_compile import HloSummary, LoopTransfers, deviceless, hlo, plugin

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hlo")
JAXLIB = importlib.metadata.version("jaxlib")


def fixture(name: str) -> str:
  with open(os.path.join(DATA, name + ".hlo")) as f:
    return f.read()


# --- shapes -------------------------------------------------------------------

@pytest.mark.parametrize("shape,nbytes", [
    ("f32[2,3]{1,0}", 2 * 3 * 4),
    ("f32[]", 4),
    ("s32[0,5]{1,0}", 0),
    ("bf16[7]{0:S(5)}", 14),
    ("pred[3]", 3),
    ("token[]", 0),
    ("s4[3]{0}", 1),  # 1.5 bytes, rounded down
    ("(s4[3]{0}, s4[3]{0})", 3),  # the halves add up before rounding
    ("f8e4m3fn[10]{0}", 10),  # not read as f8e4m3 followed by "fn"
    ("c128[2]", 32),
    ("((f32[4]{0:S(5)}, s32[]), f64[2,2]{1,0}, u32[])", 16 + 4 + 32 + 4),
])
def test_array_bytes_of_a_shape_or_a_tuple_of_shapes(shape, nbytes):
  assert gpu_compile.array_bytes(shape) == nbytes


def test_host_memory_is_the_layouts_memory_space_5_per_array():
  assert gpu_compile.in_host_memory("(f32[4]{0:S(5)}, f32[4]{0}, s32[], bf16[2,2]{1,0:S(5)})") == [
      True, False, False, True]
  assert gpu_compile.in_host_memory("f32[4]{0:S(1)}") == [False]


@pytest.mark.parametrize("shape,parts", [
    ("f32[3]{0}", ["f32[3]{0}"]),
    ("  f32[3]{0:S(5)} ", ["f32[3]{0:S(5)}"]),
    ("((f32[2]{0:S(5)}, s32[]), f32[1,2]{1,0}, u32[])", ["(f32[2]{0:S(5)}, s32[])", "f32[1,2]{1,0}", "u32[]"]),
    ("(s32[], /*index=5*/f32[3,32]{1,0})", ["s32[]", "/*index=5*/f32[3,32]{1,0}"]),
    ("()", []),
])
def test_top_level_splits_a_tuple_at_its_own_commas(shape, parts):
  assert hlo._top_level(shape) == parts


def test_operands_are_the_names_before_the_closing_parenthesis():
  # `rest` is what follows "opcode(": control predecessors and called computations are not operands.
  assert hlo._operand_names("%a, %b.1-x), calls=%c, control-predecessors={%d}") == ["a", "b.1-x"]
  assert hlo._operand_names("), custom_call_target=\"AllocateBuffer\"") == []
  assert hlo._operand_names("%t), index=0") == ["t"]
  # Nested parentheses inside the operand list do not end it.
  assert hlo._operand_names("f32[2]{0} %p, (s32[]) %q), to_apply=%r") == ["p", "q"]


def test_called_computations_of_control_flow():
  assert hlo._called("%t), condition=%cond.1, body=%body.2") == ["body.2", "cond.1"]
  assert hlo._called("%k, %a, %b), branch_computations={%br_0, %br.1}") == ["br_0", "br.1"]
  assert hlo._called("%p, %q), true_computation=%yes, false_computation=%no") == ["yes", "no"]
  assert hlo._called("%x), to_apply=%fn.3") == ["fn.3"]
  assert hlo._called("%x), kind=kLoop, calls=%fused_add") == ["fused_add"]
  assert hlo._called("%x), dimensions={0}") == []


@pytest.mark.parametrize("rest,trips", [
    ('%t), condition=%c, body=%b, backend_config={"known_trip_count":{"n":"12"},"known_init_step":{}}', 12),
    ("%t), condition=%c, body=%b", 1),
    ('%t), condition=%c, body=%b, backend_config={"known_init_step":{"init":"0","step":"1"}}', 1),
])
def test_trip_count_is_the_known_one_else_one(rest, trips):
  assert hlo._trip_count(rest) == trips


# --- captured modules -----------------------------------------------------------

def test_parse_splits_computations_and_names_the_entry():
  computations, entry = gpu_compile.parse_hlo(fixture("scan_host_stack"))
  # The text's computations, in order; the file/function/stack tables between the header and them are not.
  assert list(computations) == ["wrapped_dynamic-slice_computation", "scalar_add_computation", "fused_reduce",
                                "fused_add", "region_0.3", "fused_compare", "region_1.4", "main.5"]
  assert entry == "main.5"
  main = computations["main.5"]
  assert [(i.name, i.opcode) for i in main] == [
      ("constant_7_0", "constant"), ("copy.10", "copy"), ("x.1", "parameter"), ("copy.9", "copy"),
      ("w.1", "parameter"), ("tuple", "tuple"), ("while.5", "while"), ("while.7.0", "get-tuple-element")]
  assert main[4].shape == "f32[4,64,64]{2,1,0:S(5)}"
  assert main[1].rest.startswith("%constant_7_0)")
  # A host computation's closing '}, execution_thread="host"' ends it: the entry after it is read.
  computations, entry = gpu_compile.parse_hlo(fixture("host_compute"))
  assert list(computations) == ["called_computation", "main.2"] and entry == "main.2"
  assert [i.opcode for i in computations["main.2"]] == ["parameter", "parameter", "custom-call-start",
                                                        "custom-call-done"]


def test_parse_of_text_without_an_entry():
  assert gpu_compile.parse_hlo("HloModule m\n\n%f (p: f32[]) -> f32[] {\n  ROOT %p = f32[] parameter(0)\n}\n") == (
      {"f": [gpu_compile.HloInstruction("p", "f32[]", "parameter", "0)")]}, None)
  assert gpu_compile.count_hlo("") == HloSummary(0, 0, 0, 0, 0, {}, 0, 0, 0)


def test_count_host_device_copies():
  # ENTRY: a.1 (host) -> copy-start.2 -> f32[256] on the device: 1024 bytes to the device; loop_add_fusion
  # (1024 out + 1024 in); copy-start.1.0 of it into S(5): 1024 bytes to the host; loop_convert_fusion of
  # bf16[128] b.1 (512 out + 256 in). Copy starts and dones, parameters and the tuple launch nothing.
  assert gpu_compile.count_hlo(fixture("host_device_copies")) == HloSummary(
      kernels=2, triton_launches=0, transfers=2, host_calls=0, kernel_bytes=2048 + 768, kernel_ops={"fusion": 2},
      transfer_bytes=2048, to_device_bytes=1024, to_host_bytes=1024)


def test_count_a_loop_over_a_host_stack():
  # ENTRY: copy.10 (s32: 4 + 4), copy.9 (f32[64]: 256 + 256), while.5 (known_trip_count 4).
  # Body region_0.3 (4 trips): the slice copy dynamic-slice-start.1 of f32[1,64,64] (16384 bytes) from the
  # S(5) stack into device memory, a transfer per trip; input_reduce_fusion (256 out, 256 + 16384 in),
  # loop_add_fusion (s32: 4 + 4; its control predecessors are no operands), copy.6 (256 + 256).
  # Condition region_1.4: loop_compare_fusion (pred 1 + s32 4). Kernels are counted once, bytes moved per trip.
  assert gpu_compile.count_hlo(fixture("scan_host_stack")) == HloSummary(
      kernels=6, triton_launches=0, transfers=1, host_calls=0,
      kernel_bytes=8 + 512 + (256 + 256 + 16384) + 8 + 512 + 5, kernel_ops={"copy": 3, "fusion": 3},
      transfer_bytes=4 * 16384, to_device_bytes=4 * 16384, to_host_bytes=0)


def test_count_a_host_computation():
  # One custom-call-start to HostExecute: inputs (g.1 f32[256] on the device: 1024 bytes read across the
  # link; a.1 in S(5)), output in S(5) (nothing written to the device). Its done launches nothing.
  assert gpu_compile.count_hlo(fixture("host_compute")) == HloSummary(
      kernels=0, triton_launches=0, transfers=0, host_calls=1, kernel_bytes=0, kernel_ops={},
      transfer_bytes=1024, to_device_bytes=0, to_host_bytes=1024)


def test_count_a_streamed_gradient():
  # ENTRY: copy.30, copy.3, copy.29, loop_broadcast_fusion, two AllocateBuffer custom calls; two slice
  # copies of f32[1,32,32] (4096 bytes) out of the S(5) stack w.1 (layers 0 and 2), both whiles 3 trips.
  # Forward body region_0.2...: 3 fusions (the dynamic-update-slice fusion is a device one), copy.12,
  # copy.13, a slice fetch per trip. Backward body region_2.5...: 5 fusions, copy.24, a slice fetch per
  # trip, and dynamic-update-slice-start.1 writing the f32[1,32,32] gradient slice (device) into the S(5)
  # stack per trip. The two conditions: one fusion each.
  summary = gpu_compile.count_hlo(fixture("streamed_layers"))
  assert summary.kernel_ops == {"copy": 6, "custom-call AllocateBuffer": 2, "fusion": 11}
  assert (summary.kernels, summary.triton_launches, summary.transfers, summary.host_calls) == (19, 0, 5, 0)
  assert (summary.to_device_bytes, summary.to_host_bytes) == (2 * 4096 + 3 * 4096 + 3 * 4096, 3 * 4096)
  assert summary.transfer_bytes == 11 * 4096


def test_loop_transfers_of_captured_loops():
  # scan_host_stack: the body fetches its slice and uses it in the same trip (input_reduce_fusion reads
  # the done), with nothing scheduled between start and done.
  assert gpu_compile.loop_transfers(fixture("scan_host_stack")) == [LoopTransfers("region_0.3", 4, 1, 0, 0)]
  # streamed_layers: each body starts the next trip's slice, computes (input_reduce_fusion; loop_add_fusion)
  # before its done, and the done reaches the root tuple through a bitcast (and a copy): a prefetch. The
  # backward body's gradient write-out goes to the host: not a fetch.
  assert gpu_compile.loop_transfers(fixture("streamed_layers")) == [
      LoopTransfers("region_0.2.clone.clone.sunk.clone", 3, 1, 1, 1),
      LoopTransfers("region_2.5.clone.clone.sunk.clone", 3, 1, 1, 1)]
  assert gpu_compile.loop_transfers(fixture("host_device_copies")) == []


# --- hand-written modules -----------------------------------------------------------

SYNCHRONOUS = """\
HloModule sync, is_scheduled=true

%negate_branch (p.a: f32[16]) -> f32[16] {
  %p.a = f32[16]{0} parameter(0)
  ROOT %n.a = f32[16]{0} negate(%p.a)
}

%copy_branch (p.b: f32[16]) -> f32[16] {
  %p.b = f32[16]{0} parameter(0)
  ROOT %c.b = f32[16]{0} copy(%p.b)
}

ENTRY %main (h: f32[4,16], d: f32[16], i: s32[], u: f32[1,16], k: s32[]) -> f32[16] {
  %h = f32[4,16]{1,0:S(5)} parameter(0)
  %d = f32[16]{0} parameter(1)
  %i = s32[] parameter(2)
  %u = f32[1,16]{1,0} parameter(3)
  %k = s32[] parameter(4)
  %slice = f32[1,16]{1,0} dynamic-slice(%h, %i, %i), dynamic_slice_sizes={1,16}
  %write = f32[4,16]{1,0:S(5)} dynamic-update-slice(%h, %u, %i, %i)
  %hh = f32[4,16]{1,0:S(5)} copy(%h)
  %dd = f32[16]{0} copy(%d)
  %branch = f32[16]{0} conditional(%k, %d, %d), branch_computations={%negate_branch, %copy_branch}
  ROOT %t = (f32[1,16]{1,0}, f32[4,16]{1,0:S(5)}, f32[4,16]{1,0:S(5)}, f32[16]{0}, f32[16]{0}) tuple(%slice, %write, %hh, %dd, %branch)
}
"""


def test_count_synchronous_transfers_and_conditional_branches():
  # slice: host stack -> device slice f32[1,16], 64 bytes to the device (kernel: 64 out + 256 + 4 + 4 in).
  # write: the device update u (64 bytes) into the host stack (kernel: 256 out + 256 + 64 + 4 + 4 in).
  # hh: a copy between two host buffers: a kernel, named so, no transfer (256 + 256). dd: a device copy
  # (64 + 64). Both branches of the conditional run on the device: negate (64 + 64), copy (64 + 64).
  assert gpu_compile.count_hlo(SYNCHRONOUS) == HloSummary(
      kernels=6, triton_launches=0, transfers=2, host_calls=0,
      kernel_bytes=328 + 584 + 512 + 128 + 128 + 128,
      kernel_ops={"copy": 2, "copy (host->host)": 1, "dynamic-slice": 1, "dynamic-update-slice": 1, "negate": 1},
      transfer_bytes=128, to_device_bytes=64, to_host_bytes=64)


CALLS = """\
HloModule calls, is_scheduled=true

%host_fn (x.h: f32[8]) -> f32[8] {
  %x.h = f32[8]{0} parameter(0)
  ROOT %y.h = f32[8]{0} exponential(%x.h)
}, execution_thread="host"

%device_fn (x.d: f32[8]) -> f32[8] {
  %x.d = f32[8]{0} parameter(0)
  ROOT %y.d = f32[8]{0} sine(%x.d)
}

%fused_triton (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %c0 = f32[8]{0} cosine(%p0)
}

ENTRY %main (a: f32[8], b: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %b = f32[8]{0:S(5)} parameter(1)
  %call-start = ((f32[8]{0}, f32[8]{0:S(5)}), (f32[8]{0}, f32[8]{0:S(5)}), u32[]) call-start(%a, %b), async_execution_thread="host", to_apply=%host_fn, backend_config={"device_type":"DEVICE_TYPE_HOST"}
  %call-done = (f32[8]{0}, f32[8]{0:S(5)}) call-done(%call-start)
  %host_sync = f32[8]{0:S(5)} call(%b), to_apply=%host_fn, backend_config={"device_type":"DEVICE_TYPE_HOST"}
  %on_device = f32[8]{0} call(%a), to_apply=%device_fn
  %cb = f32[8]{0} custom-call(%a), custom_call_target="xla_ffi_python_gpu_callback"
  %host_op = f32[8]{0:S(5)} custom-call(%b), custom_call_target="SomeHostOp", backend_config={"device_type":"DEVICE_TYPE_HOST"}
  %tr = f32[8]{0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton"
  %tf = f32[8]{0} fusion(%a), kind=kCustom, calls=%fused_triton, backend_config={"fusion_backend_config":{"kind":"__triton"}}
  %gemm = f32[8]{0} custom-call(%a, %a), custom_call_target="__cublas$gemm"
  %async_tr = ((f32[8]{0}), f32[8]{0}, u32[]) custom-call-start(%a), custom_call_target="__gpu$xla.gpu.triton"
  %async_tr_done = f32[8]{0} custom-call-done(%async_tr)
  ROOT %t = (f32[8]{0}, f32[8]{0}, f32[8]{0}) tuple(%on_device, %tr, %gemm)
}
"""


def test_count_host_calls_device_calls_and_triton():
  # Host calls: the asynchronous call-start (reads a: 32 bytes across the link; writes its device output:
  # 32 bytes back), the synchronous host call, the Python callback, the custom call on DEVICE_TYPE_HOST.
  # The device call's body runs on the device: sine (32 + 32). Kernels besides: the Triton custom call
  # (32 + 32), the Triton fusion (32 + 32), cuBLAS (32 + 32 + 32), and the asynchronous Triton custom call
  # (a custom-call-start to a device target: its ((operands), result, context) 32 + 32 + 4 and a: 32);
  # three Triton launches.
  assert gpu_compile.count_hlo(CALLS) == HloSummary(
      kernels=5, triton_launches=3, transfers=0, host_calls=4, kernel_bytes=64 + 64 + 64 + 96 + 100,
      kernel_ops={"custom-call __cublas$gemm": 1, "custom-call __gpu$xla.gpu.triton": 2, "fusion": 1, "sine": 1},
      transfer_bytes=64, to_device_bytes=32, to_host_bytes=32)


def test_host_call_bytes_count_device_buffers_only():
  call = gpu_compile.HloInstruction(
      "s", "((f32[8]{0}, bf16[4]{0:S(5)}, s32[2]{0}), (f32[2]{0:S(5)}, f32[3]{0}), u32[])", "custom-call-start",
      '%a, %b, %c), custom_call_target="HostExecute"')
  # Down: the device outputs (f32[3]: 12 bytes); up: the device inputs (f32[8] and s32[2]: 32 + 8).
  assert gpu_compile.host_call_bytes(call) == (12, 40)
  # A synchronous host call has no (inputs, outputs) shape: nothing counted.
  assert gpu_compile.host_call_bytes(gpu_compile.HloInstruction("c", "f32[8]{0}", "call", "%a)")) == (0, 0)
  assert gpu_compile.host_call_bytes(gpu_compile.HloInstruction("c", "u32[]", "call-start", "%a)")) == (0, 0)


# The entry follows a host computation directly, as XLA prints a module whose only host computation is
# printed last before the entry: its copy between two host buffers and its host call must be counted.
HOST_COMPUTATION_THEN_ENTRY = """\
HloModule jit_step, is_scheduled=true, input_output_alias={ {0}: (0, {}, may-alias) }

%called_computation (param_0.1: f32[8], param_1.1: f32[8]) -> f32[8] {
  %param_0.1 = f32[8]{0} parameter(0)
  %param_1.1 = f32[8]{0} parameter(1)
  ROOT %add.1 = f32[8]{0} add(%param_0.1, %param_1.1)
}, execution_thread="host"

ENTRY %main.2 (m.1: f32[8], g.1: f32[8]) -> f32[8] {
  %m.1 = f32[8]{0:S(5)} parameter(0)
  %g.1 = f32[8]{0:S(5)} parameter(1)
  %call-start = ((f32[8]{0:S(5)}, f32[8]{0:S(5)}), f32[8]{0:S(5)}, u32[]) custom-call-start(%m.1, %g.1), \
async_execution_thread="host", custom_call_target="HostExecute", called_computations={%called_computation}
  %call-done = f32[8]{0:S(5)} custom-call-done(%call-start)
  ROOT %copy.1 = f32[8]{0:S(5)} copy(%call-done)
}
"""


def test_count_hlo_reads_the_entry_after_a_host_computation():
  # Everything in host memory: the host call moves nothing across the link; the copy is host->host (32 + 32).
  assert gpu_compile.count_hlo(HOST_COMPUTATION_THEN_ENTRY) == HloSummary(
      kernels=1, triton_launches=0, transfers=0, host_calls=1, kernel_bytes=64, kernel_ops={"copy (host->host)": 1},
      transfer_bytes=0, to_device_bytes=0, to_host_bytes=0)


LOOPS = """\
HloModule loops, is_scheduled=true

%wrapped_dynamic-slice_computation (s.0: f32[4,8], s.1: s32[], s.2: s32[]) -> f32[1,8] {
  %s.0 = f32[4,8]{1,0:S(5)} parameter(0)
  %s.1 = s32[] parameter(1)
  %s.2 = s32[] parameter(2)
  ROOT %s.3 = f32[1,8]{1,0} dynamic-slice(%s.0, %s.1, %s.2), dynamic_slice_sizes={1,8}
}

%wrapped_dynamic-update-slice_computation (v.0: f32[4,8], v.1: f32[1,8], v.2: s32[], v.3: s32[]) -> f32[4,8] {
  %v.0 = f32[4,8]{1,0:S(5)} parameter(0)
  %v.1 = f32[1,8]{1,0} parameter(1)
  %v.2 = s32[] parameter(2)
  %v.3 = s32[] parameter(3)
  ROOT %v.4 = f32[4,8]{1,0:S(5)} dynamic-update-slice(%v.0, %v.1, %v.2, %v.3)
}

%fused_work (w.0: f32[1,8]) -> f32[1,8] {
  %w.0 = f32[1,8]{1,0} parameter(0)
  ROOT %w.1 = f32[1,8]{1,0} tanh(%w.0)
}

%cond1 (c1.0: (s32[], f32[4,8], f32[1,8])) -> pred[] {
  %c1.0 = (s32[], f32[4,8]{1,0:S(5)}, f32[1,8]{1,0}) parameter(0)
  %c1.1 = s32[] get-tuple-element(%c1.0), index=0
  %c1.2 = s32[] constant(5)
  ROOT %c1.3 = pred[] compare(%c1.1, %c1.2), direction=LT
}

%cond2 (c2.0: (s32[], f32[4,8], f32[1,8])) -> pred[] {
  %c2.0 = (s32[], f32[4,8]{1,0:S(5)}, f32[1,8]{1,0}) parameter(0)
  %c2.1 = s32[] get-tuple-element(%c2.0), index=0
  %c2.2 = s32[] constant(5)
  ROOT %c2.3 = pred[] compare(%c2.1, %c2.2), direction=LT
}

%cond3 (c3.0: (s32[], f32[4,8], f32[1,8])) -> pred[] {
  %c3.0 = (s32[], f32[4,8]{1,0:S(5)}, f32[1,8]{1,0}) parameter(0)
  %c3.1 = s32[] get-tuple-element(%c3.0), index=0
  %c3.2 = s32[] constant(5)
  ROOT %c3.3 = pred[] compare(%c3.1, %c3.2), direction=LT
}

%prefetch (t: (s32[], f32[4,8], f32[1,8])) -> (s32[], f32[4,8], f32[1,8]) {
  %t = (s32[], f32[4,8]{1,0:S(5)}, f32[1,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %stack = f32[4,8]{1,0:S(5)} get-tuple-element(%t), index=1
  %prev = f32[1,8]{1,0} get-tuple-element(%t), index=2
  %fetch-start = ((f32[4,8]{1,0:S(5)}, s32[], s32[]), f32[1,8]{1,0}, u32[]) fusion-start(%stack, %i, %i), kind=kCustom, calls=%wrapped_dynamic-slice_computation
  %work = f32[1,8]{1,0} fusion(%prev), kind=kLoop, calls=%fused_work
  %fetch-done = f32[1,8]{1,0} fusion-done(%fetch-start)
  %next = s32[] add(%i, %i)
  ROOT %r = (s32[], f32[4,8]{1,0:S(5)}, f32[1,8]{1,0}) tuple(%next, %stack, %fetch-done)
}

%fetch_and_use (t2: (s32[], f32[4,8], f32[1,8])) -> (s32[], f32[4,8], f32[1,8]) {
  %t2 = (s32[], f32[4,8]{1,0:S(5)}, f32[1,8]{1,0}) parameter(0)
  %i2 = s32[] get-tuple-element(%t2), index=0
  %stack2 = f32[4,8]{1,0:S(5)} get-tuple-element(%t2), index=1
  %out2 = f32[1,8]{1,0} get-tuple-element(%t2), index=2
  %get-start = ((f32[4,8]{1,0:S(5)}, s32[], s32[]), f32[1,8]{1,0}, u32[]) fusion-start(%stack2, %i2, %i2), kind=kCustom, calls=%wrapped_dynamic-slice_computation
  %other = f32[1,8]{1,0} fusion(%out2), kind=kCustom, calls=%wrapped_dynamic-slice_computation
  %get-done = f32[1,8]{1,0} fusion-done(%get-start)
  %used = f32[1,8]{1,0} multiply(%get-done, %get-done)
  %passed = f32[1,8]{1,0} bitcast(%get-done)
  %put-start = ((f32[4,8]{1,0:S(5)}, f32[1,8]{1,0}, s32[], s32[]), f32[4,8]{1,0:S(5)}, u32[]) fusion-start(%stack2, %used, %i2, %i2), kind=kCustom, calls=%wrapped_dynamic-update-slice_computation
  %put-done = f32[4,8]{1,0:S(5)} fusion-done(%put-start)
  ROOT %r2 = (s32[], f32[4,8]{1,0:S(5)}, f32[1,8]{1,0}) tuple(%i2, %put-done, %passed)
}

%device_slices (t3: (s32[], f32[4,8], f32[1,8])) -> (s32[], f32[4,8], f32[1,8]) {
  %t3 = (s32[], f32[4,8]{1,0}, f32[1,8]{1,0}) parameter(0)
  %i3 = s32[] get-tuple-element(%t3), index=0
  %stack3 = f32[4,8]{1,0} get-tuple-element(%t3), index=1
  %local-start = ((f32[4,8]{1,0}, s32[], s32[]), f32[1,8]{1,0}, u32[]) fusion-start(%stack3, %i3, %i3), kind=kCustom, calls=%wrapped_dynamic-slice_computation
  %local-done = f32[1,8]{1,0} fusion-done(%local-start)
  ROOT %r3 = (s32[], f32[4,8]{1,0}, f32[1,8]{1,0}) tuple(%i3, %stack3, %local-done)
}

ENTRY %main (init: (s32[], f32[4,8], f32[1,8]), dev: (s32[], f32[4,8], f32[1,8])) -> f32[1,8] {
  %init = (s32[], f32[4,8]{1,0:S(5)}, f32[1,8]{1,0}) parameter(0)
  %dev = (s32[], f32[4,8]{1,0}, f32[1,8]{1,0}) parameter(1)
  %loop1 = (s32[], f32[4,8]{1,0:S(5)}, f32[1,8]{1,0}) while(%init), condition=%cond1, body=%prefetch, backend_config={"known_trip_count":{"n":"5"}}
  %loop2 = (s32[], f32[4,8]{1,0:S(5)}, f32[1,8]{1,0}) while(%loop1), condition=%cond2, body=%fetch_and_use
  %loop3 = (s32[], f32[4,8]{1,0}, f32[1,8]{1,0}) while(%dev), condition=%cond3, body=%device_slices, backend_config={"known_trip_count":{"n":"2"}}
  ROOT %last = f32[1,8]{1,0} get-tuple-element(%loop2), index=2
}
"""


def test_loop_transfers_of_a_prefetch_a_fetch_used_at_once_and_device_slices():
  # prefetch (5 trips): fetch-start, a device fusion (work) before its done, the done only passed to the
  # root: overlapped and carried. fetch_and_use (unknown trip count: 1): the only op between get-start and
  # get-done is another slice fusion (no device compute to hide behind), the done is multiplied (and also
  # passed to the root): neither; put-start writes to the host, no fetch. device_slices: a device-to-device
  # slice, no fetch, so no entry.
  assert gpu_compile.loop_transfers(LOOPS) == [LoopTransfers("prefetch", 5, 1, 1, 1),
                                               LoopTransfers("fetch_and_use", 1, 1, 0, 0)]


def test_count_loops_multiplies_transfers_by_trips_and_counts_kernels_once():
  # Transfers: fetch-start (32 bytes) x 5 trips; get-start (32) and put-start (the update, 32 bytes to the
  # host) x 1 trip. Kernels: work (32 + 32), next (add: 4 + 4 + 4), other (fusion: 32 + 32), used (multiply:
  # 32 + 32 + 32), local-start (a device slice: its ((operands), result, context) shape 128 + 4 + 4 + 32 + 4,
  # its operands 128 + 4 + 4), each while's condition's compare (1 + 4 + 4).
  summary = gpu_compile.count_hlo(LOOPS)
  assert summary == HloSummary(
      kernels=8, triton_launches=0, transfers=3, host_calls=0,
      kernel_bytes=64 + 12 + 64 + 96 + (172 + 136) + 3 * 9,
      kernel_ops={"add": 1, "compare": 3, "fusion": 2, "fusion-start": 1, "multiply": 1},
      transfer_bytes=5 * 32 + 32 + 32, to_device_bytes=5 * 32 + 32, to_host_bytes=32)


def test_a_loop_whose_body_is_not_in_the_text_has_nothing_to_report():
  # Text cut after the entry (its while's body and condition not printed): no loop to describe, no error.
  entry_only = LOOPS[LOOPS.index("ENTRY"):]
  assert gpu_compile.loop_transfers(entry_only) == []
  assert gpu_compile.count_hlo(entry_only) == HloSummary(0, 0, 0, 0, 0, {}, 0, 0, 0)


@pytest.mark.parametrize("opcode,shape,operand_shapes,moved", [
    # copy-start: (destination, source, context); the operand's bytes, in the destination's direction.
    ("copy-start", "(f32[4]{0:S(5)}, f32[4]{0}, u32[])", ["f32[4]{0}"], (0, 16)),
    ("copy-start", "(f32[4]{0}, f32[4]{0:S(5)}, u32[])", ["f32[4]{0:S(5)}"], (16, 0)),
    # Synchronous ops between memory spaces: the result's bytes; a dynamic-update-slice's update.
    ("copy", "bf16[6]{0}", ["bf16[6]{0:S(5)}"], (12, 0)),
    ("copy", "bf16[6]{0:S(5)}", ["bf16[6]{0}"], (0, 12)),
    ("dynamic-slice", "f32[1,4]{1,0}", ["f32[3,4]{1,0:S(5)}", "s32[]", "s32[]"], (16, 0)),
    ("dynamic-update-slice", "f32[3,4]{1,0}", ["f32[3,4]{1,0}", "f32[1,4]{1,0:S(5)}", "s32[]", "s32[]"], (16, 0)),
    ("dynamic-update-slice", "f32[3,4]{1,0:S(5)}", ["f32[3,4]{1,0:S(5)}", "f32[1,4]{1,0}", "s32[]"], (0, 16)),
    # Within one memory space, or another op: no transfer.
    ("copy", "f32[4]{0:S(5)}", ["f32[4]{0:S(5)}"], None),
    ("dynamic-slice", "f32[1,4]{1,0}", ["f32[3,4]{1,0}", "s32[]", "s32[]"], None),
    ("add", "f32[4]{0}", ["f32[4]{0:S(5)}", "f32[4]{0}"], None),
])
def test_transfer_of_one_instruction(opcode, shape, operand_shapes, moved):
  names = [f"o{k}" for k in range(len(operand_shapes))]
  ins = gpu_compile.HloInstruction("x", shape, opcode, ", ".join("%" + n for n in names) + "), metadata={}")
  assert gpu_compile.transfer_of(ins, dict(zip(names, operand_shapes))) == moved


@pytest.mark.parametrize("calls,shape,operand_shapes,moved", [
    # An asynchronous slice: ((operands), result, context); the result's bytes if it crosses.
    ("wrapped_dynamic-slice_computation", "((f32[3,4]{1,0:S(5)}, s32[]), f32[1,4]{1,0}, u32[])",
     ["f32[3,4]{1,0:S(5)}", "s32[]"], (16, 0)),
    ("wrapped_dynamic-slice_computation.7", "((f32[3,4]{1,0}, s32[]), f32[1,4]{1,0:S(5)}, u32[])",
     ["f32[3,4]{1,0}", "s32[]"], (0, 16)),
    ("wrapped_dynamic-slice_computation", "((f32[3,4]{1,0}, s32[]), f32[1,4]{1,0}, u32[])",
     ["f32[3,4]{1,0}", "s32[]"], None),
    # An asynchronous update: the update's bytes (operand 1, f32[2,4]) into the result's memory.
    ("wrapped_dynamic-update-slice_computation",
     "((f32[3,4]{1,0:S(5)}, f32[2,4]{1,0}, s32[]), f32[3,4]{1,0:S(5)}, u32[])",
     ["f32[3,4]{1,0:S(5)}", "f32[2,4]{1,0}", "s32[]"], (0, 32)),
    ("wrapped_dynamic-update-slice_computation",
     "((f32[3,4]{1,0}, f32[2,4]{1,0:S(5)}, s32[]), f32[3,4]{1,0}, u32[])",
     ["f32[3,4]{1,0}", "f32[2,4]{1,0:S(5)}", "s32[]"], (32, 0)),
    ("wrapped_dynamic-update-slice_computation",
     "((f32[3,4]{1,0:S(5)}, f32[2,4]{1,0:S(5)}, s32[]), f32[3,4]{1,0:S(5)}, u32[])",
     ["f32[3,4]{1,0:S(5)}", "f32[2,4]{1,0:S(5)}", "s32[]"], None),
    # Another asynchronous fusion: no transfer.
    ("fused_add", "((f32[4]{0:S(5)}), f32[4]{0}, u32[])", ["f32[4]{0:S(5)}"], None),
])
def test_transfer_of_an_asynchronous_slice(calls, shape, operand_shapes, moved):
  names = [f"o{k}" for k in range(len(operand_shapes))]
  ins = gpu_compile.HloInstruction("x", shape, "fusion-start", ", ".join("%" + n for n in names) +
                                 f"), kind=kCustom, calls=%{calls}")
  assert gpu_compile.transfer_of(ins, dict(zip(names, operand_shapes))) == moved


# --- the report, targets, the plugin's place ------------------------------------------

def test_report_peaks_and_dict():
  report = gpu_compile.GpuCompileReport(
      target="h200", num_devices=2, device_argument_bytes=1000, device_output_bytes=200, device_temp_bytes=30,
      device_alias_bytes=150, host_argument_bytes=4000, host_output_bytes=500, host_temp_bytes=60,
      host_alias_bytes=400, kernels=3, triton_launches=1, transfers=2, host_calls=0, kernel_bytes=77,
      kernel_ops={"fusion": 3}, warnings=("w1",), log="the log", hlo="the hlo", transfer_bytes=9,
      to_device_bytes=5, to_host_bytes=4, parameter_shardings=("{replicated}",),
      output_shardings=("{devices=[2]<=[2]}",))
  assert report.device_peak_bytes == 1000 + 200 + 30 - 150
  assert report.host_peak_bytes == 4000 + 500 + 60 - 400
  assert report.as_dict() == dict(
      target="h200", num_devices=2, device_argument_bytes=1000, device_output_bytes=200, device_temp_bytes=30,
      device_alias_bytes=150, host_argument_bytes=4000, host_output_bytes=500, host_temp_bytes=60,
      host_alias_bytes=400, kernels=3, triton_launches=1, transfers=2, host_calls=0, kernel_bytes=77,
      kernel_ops={"fusion": 3}, warnings=["w1"], transfer_bytes=9, to_device_bytes=5, to_host_bytes=4,
      parameter_shardings=["{replicated}"], output_shardings=["{devices=[2]<=[2]}"], collective_bytes={},
      device_peak_bytes=1080, host_peak_bytes=4160)
  assert "the hlo" not in repr(report) and "the log" not in repr(report)


def test_targets_and_their_device_memory(tmp_path):
  # NVIDIA's H100 SXM (80 GB) and H200 (141 GB), as XLA's target configs give their usable memory.
  assert gpu_compile.target_device_memory_bytes("h100") == 84929347584
  assert gpu_compile.target_device_memory_bytes("h200") == 150754820096
  assert "gpu_device_info" in gpu_compile.load_target("h100")
  own = tmp_path / "own.txtpb"
  own.write_text("gpu_device_info {\n  device_memory_size: 123456\n  clock_rate_ghz: 1.0\n}\n")
  assert gpu_compile.load_target(str(own)) == own.read_text()
  assert gpu_compile.target_device_memory_bytes(str(own)) == 123456
  own.write_text("gpu_device_info {\n  clock_rate_ghz: 1.0\n}\n")
  with pytest.raises(ValueError, match="has no device_memory_size"):
    gpu_compile.target_device_memory_bytes(str(own))
  with pytest.raises(ValueError, match="`target` must be one of"):
    gpu_compile.load_target("h300")


def test_the_plugin_directory_is_in_the_user_cache(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert gpu_compile.cuda_plugin_dir() == str(tmp_path / "xdg" / "optax_hybrid" / f"jax-cuda12-{JAXLIB}")
  for unset in (True, False):  # unset or empty: ~/.cache
    if unset:
      monkeypatch.delenv("XDG_CACHE_HOME")
    else:
      monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert gpu_compile.cuda_plugin_dir() == str(tmp_path / "home" / ".cache" / "optax_hybrid" / f"jax-cuda12-{JAXLIB}")


def test_an_installed_plugin_is_not_installed_again(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  directory = tmp_path / "optax_hybrid" / f"jax-cuda12-{JAXLIB}"
  directory.mkdir(parents=True)
  assert gpu_compile.install_cuda_plugin() == str(directory)
  assert sorted(os.listdir(tmp_path / "optax_hybrid")) == [directory.name]  # no lock taken, nothing run


def test_a_failed_install_names_pips_command_and_leaves_only_the_lock(monkeypatch, tmp_path):
  # pip with no index and nothing to find locally fails fast, in this process's environment.
  for name, value in dict(XDG_CACHE_HOME=str(tmp_path), PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1",
                          PIP_FIND_LINKS=str(tmp_path), PIP_DISABLE_PIP_VERSION_CHECK="1").items():
    monkeypatch.setenv(name, value)
  with pytest.raises(gpu_compile.GpuCompileError) as raised:
    gpu_compile.install_cuda_plugin()
  message = str(raised.value)
  assert message.startswith(f"Installing the CUDA plugin failed ({sys.executable} -m pip install --no-deps --target ")
  assert f" jax-cuda12-plugin=={JAXLIB} jax-cuda12-pjrt=={JAXLIB}):\n" in message
  assert "jax-cuda12-plugin" in message.split(":\n", 1)[1]  # pip's own error, from its stderr
  assert sorted(os.listdir(tmp_path / "optax_hybrid")) == [f"jax-cuda12-{JAXLIB}.lock"]


def test_without_the_plugin_compile_for_gpu_names_the_install(monkeypatch, tmp_path):
  # As in an environment without JAX's CUDA plugin (CI's: the test extra keeps it out of site-packages) and
  # nothing in the cache yet: the error says where it looked and what to run, before anything is loaded.
  monkeypatch.setattr(plugin, "_PLUGIN_PACKAGE", "jax_cuda12_plugin_not_installed_here")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  directory = tmp_path / "optax_hybrid" / f"jax-cuda12-{JAXLIB}"
  # A target text no compile in this process has used: the topology is cached per text, and an earlier test
  # of the same worker (a docs example, test_rules.py) may have compiled for "h100" or "h200".
  target = tmp_path / "fresh.txtpb"
  target.write_text(gpu_compile.load_target("h200") + "\n# used by this test only\n")
  with pytest.raises(gpu_compile.GpuCompileError) as raised:
    gpu_compile.compile_for_gpu(jnp.sin, jax.ShapeDtypeStruct((8,), jnp.float32), target=str(target), num_devices=1)
  assert str(raised.value).startswith(f"Compiling for a GPU needs JAX's CUDA plugin, which is neither installed "
                                      f"nor in {directory}: python -c ")
  assert f"--target {directory} jax-cuda12-plugin=={JAXLIB} jax-cuda12-pjrt=={JAXLIB})" in str(raised.value)
  assert not (tmp_path / "optax_hybrid").exists()
  with pytest.raises(ValueError, match="`target` must be one of"):  # the target is read first
    gpu_compile.compile_for_gpu(jnp.sin, jax.ShapeDtypeStruct((8,), jnp.float32), target="h300")


def test_compile_for_gpu_refuses_bad_device_counts_before_loading_a_compiler():
  x = jax.ShapeDtypeStruct((4,), jnp.float32)
  for bad in (0, -1, 1.0, "1"):
    with pytest.raises(ValueError, match="`num_devices` must be a positive int"):
      gpu_compile.compile_for_gpu(jnp.sin, x, num_devices=bad)
  more = len(jax.devices()) + 1
  with pytest.raises(ValueError, match=f"--xla_force_host_platform_device_count={more} before JAX starts"):
    gpu_compile.compile_for_gpu(jnp.sin, x, num_devices=more)


def test_a_jitted_function_is_compiled_as_it_is_and_takes_no_jit_options():
  jitted = jax.jit(jnp.sin)
  assert deviceless._jitted(jitted, (), {}) is jitted
  for donate, options in (((0,), {}), (0, {}), ((), {"static_argnums": 0})):
    with pytest.raises(ValueError, match="already jitted"):
      deviceless._jitted(jitted, donate, options)
  plain = deviceless._jitted(lambda a, b: a * b, (0,), {"static_argnums": 1})
  lowered = plain.trace(jnp.ones(3), 2.0).lower()
  assert lowered.args_info[0][0].donated
  assert "multiply" in lowered.as_text()


def test_a_slice_of_a_buffer_just_updated_in_place_is_a_fetch():
  # Operand 0 is the done of an asynchronous update (XLA's double-buffered loops slice the buffer the first
  # iteration wrote): its name says "dynamic-update-slice", the computation called says a slice. 16 B in.
  shapes = {"dynamic-update-slice-done.49.0": "f32[3,4]{1,0:S(5)}", "i": "s32[]"}
  ins = gpu_compile.HloInstruction(
      "dynamic-slice-start.49.0.double_buffer_clone", "((f32[3,4]{1,0:S(5)}, s32[]), f32[1,4]{1,0}, u32[])",
      "fusion-start", "%dynamic-update-slice-done.49.0, %i), kind=kCustom, calls=%wrapped_dynamic-slice_computation.3")
  assert gpu_compile.transfer_of(ins, shapes) == (16, 0)


COLLECTIVES = """HloModule collectives, is_scheduled=true

%layer (t: (s32[], bf16[4,64,16])) -> (s32[], bf16[4,64,16]) {
  %t = (s32[], bf16[4,64,16]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %shard = bf16[8,16]{1,0} parameter(1)
  %gathered = bf16[64,16]{1,0} all-gather(%shard), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %partial = f32[64,16]{1,0} fusion(%gathered), kind=kLoop, calls=%grad
  %rs-start = ((f32[64,16]{1,0}), f32[8,16]{1,0}) async-start(%partial), calls=%scatter
  %rs-done = f32[8,16]{1,0} async-done(%rs-start)
  ROOT %r = (s32[], bf16[4,64,16]{2,1,0}) tuple(%i, %t)
}

%scatter (p: f32[64,16]) -> f32[8,16] {
  %p = f32[64,16]{1,0} parameter(0)
  ROOT %rs = f32[8,16]{1,0} reduce-scatter(%p), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
}

ENTRY %main (s: (s32[], bf16[4,64,16])) -> (s32[], bf16[4,64,16]) {
  %s = (s32[], bf16[4,64,16]{2,1,0}) parameter(0)
  %x = f32[128]{0} parameter(1)
  %ar-start = f32[128]{0} all-reduce-start(%x), channel_id=3, replica_groups=[1,8]<=[8], to_apply=%add
  %ar-done = f32[128]{0} all-reduce-done(%ar-start)
  ROOT %loop = (s32[], bf16[4,64,16]{2,1,0}) while(%s), condition=%cond, body=%layer, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_collective_bytes_per_gpu_count_each_trip():
  # Per trip of 4: an all-gather into 64 x 16 bf16 (2,048 B) and an asynchronous reduce-scatter of 64 x 16 f32
  # (4,096 B, its operand: the larger side); once, an all-reduce of 128 f32 (512 B). The -done ops add nothing.
  summary = gpu_compile.count_hlo(COLLECTIVES)
  assert summary.collective_bytes == {"all-gather": 4 * 64 * 16 * 2, "all-reduce": 128 * 4,
                                      "reduce-scatter": 4 * 64 * 16 * 4}
