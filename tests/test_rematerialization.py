"""XLA:GPU recomputing to fit, and ``compile_for_gpu(recompute=False)``: the program as written.

A chain of ``L`` layers ``y = tanh(y @ w_i)`` differentiated in its weights
keeps every layer's activations for the backward pass. Compiled for a target
of 100 MB of device memory (the H200's ``GpuTargetConfig`` with a smaller
``device_memory_size``), a deep chain's scratch passes XLA's memory limit and
XLA's rematerialization pass recomputes activations to bring it down. What
must hold, against figures worked out here:

* with ``recompute=False`` the step's dot flops are the chain's as written,
  ``(3 L - 1) 2 B D^2`` (``L`` forward products, two backward ones per layer
  but the first, whose input needs no gradient); with XLA's default it
  recomputes and counts more;
* :func:`optax_hybrid.gpu_compile.rematerialization_limit` tells a chain XLA
  leaves alone (scratch well under the limit: the flops as written) from one
  it recomputes (scratch over it), and reads the slop factor from
  ``XLA_FLAGS``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from optax_hybrid import gpu_compile

pytestmark = [pytest.mark.usefixtures("cuda_compiler_plugin"),
              pytest.mark.xdist_group("tests/test_rematerialization.py")]

MEMORY = 100_000_000
B, D = 4096, 256


@pytest.fixture(scope="module")
def small_target(tmp_path_factory) -> str:
  text = re.sub(r"device_memory_size:\s*\d+", f"device_memory_size: {MEMORY}", gpu_compile.load_target("h200"))
  path = tmp_path_factory.mktemp("targets") / "h200_100mb.txtpb"
  path.write_text(text)
  return str(path)


def chain_step(layers: int):
  def step(ws, x):
    def loss(ws):
      y = x
      for i in range(layers):
        y = jnp.tanh(y @ ws[i])
      return jnp.sum(y)
    return ws - 0.1 * jax.grad(loss)(ws)
  return step


def compiled(layers: int, target: str, recompute: bool):
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  ws = jax.ShapeDtypeStruct((layers, D, D), jnp.float32, sharding=one)
  x = jax.ShapeDtypeStruct((B, D), jnp.float32, sharding=one)
  report = gpu_compile.compile_for_gpu(chain_step(layers), ws, x, target=target, donate_argnums=0,
                                       recompute=recompute)
  return report, gpu_compile.step_time.estimate(report).flops


def as_written_flops(layers: int) -> float:
  return (3 * layers - 1) * 2 * B * D * D


def test_recompute_false_compiles_the_program_as_written(small_target):
  layers = 20
  _, written = compiled(layers, small_target, recompute=False)
  _, default = compiled(layers, small_target, recompute=True)
  assert written == as_written_flops(layers)
  assert default > 1.05 * as_written_flops(layers)  # XLA recomputed activations to fit


def test_the_rematerialization_limit_tells_where_xla_recomputes(small_target):
  for layers, recomputes in ((8, False), (20, True)):
    report, written = compiled(layers, small_target, recompute=False)
    limit = gpu_compile.rematerialization_limit(small_target, report.device_peak_bytes - report.device_temp_bytes)
    assert limit == pytest.approx(0.95 * (0.8 * MEMORY - (report.device_argument_bytes + report.device_output_bytes
                                                          - report.device_alias_bytes)))
    # Well away from the limit on either side (XLA measures its scratch before its last passes).
    assert (report.device_temp_bytes > 1.1 * limit) if recomputes else (report.device_temp_bytes < 0.8 * limit)
    _, default = compiled(layers, small_target, recompute=True)
    assert (default > written) == recomputes, (layers, default, written)


def test_the_slop_factor_comes_from_xla_flags(monkeypatch, small_target):
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_memory_limit_slop_factor=50 --xla_force_host_platform_device_count=1")
  assert gpu_compile.rematerialization_limit(small_target, 10e6) == pytest.approx(0.5 * (0.8 * MEMORY - 10e6))
  monkeypatch.setenv("XLA_FLAGS", "")
  assert gpu_compile.rematerialization_limit("h200", 10e9) == pytest.approx(0.95 * (0.8 * 150754820096 - 10e9))


def test_recompute_must_be_a_bool():
  x = jax.ShapeDtypeStruct((4,), jnp.float32)
  for bad in ("no", 0, None):
    with pytest.raises(ValueError, match="`recompute` must be True"):
      gpu_compile.compile_for_gpu(jnp.sin, x, target="h200", recompute=bad)
