"""The optimizer tour shows what the explainer claims, and AdamW in it is the float64 rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

import optax_hybrid
from loading import load_script
from numpy_reference import colossal_lr



def load():
  return load_script("examples/optimizer_tour.py")


@pytest.fixture(scope="module")
def tour_module():
  return load()


@pytest.fixture(scope="module")
def tour(tour_module):
  return tour_module.run_tour(steps=20)


def test_plain_descent_crawls_and_momentum_goes_further(tour):
  results = tour["optimizers"]
  # The explainer: "loss 0.39 after 20 steps".
  assert results["sgd"]["final_loss"] == pytest.approx(0.39, abs=0.01)
  assert results["momentum"]["final_loss"] < 0.5 * results["sgd"]["final_loss"]
  # Same step size: the difference is momentum's along the valley.
  assert results["momentum"]["lr"] == results["sgd"]["lr"]
  assert abs(results["momentum"]["trajectory"][-1, 0]) < 0.6 * abs(results["sgd"]["trajectory"][-1, 0])


def test_adam_moves_both_weights_at_a_similar_pace(tour):
  results = tour["optimizers"]
  sgd_step = np.abs(np.diff(results["sgd"]["trajectory"], axis=0))
  assert sgd_step[0, 1] > 10 * sgd_step[0, 0]
  for name in ("adam", "adamw"):
    steps = np.abs(np.diff(results[name]["trajectory"], axis=0))[:3]
    ratio = steps[:, 1] / steps[:, 0]
    assert np.all((ratio > 0.5) & (ratio < 2)), (name, ratio)
    # And the pace is set by the learning rate, not by the gradient's scale.
    np.testing.assert_allclose(steps[0], results[name]["lr"], rtol=0.15)


def adamw_float64(start, curvature, steps, lr, b1, b2, eps, weight_decay):
  """torch.optim.AdamW on the toy loss, in float64."""
  w = np.asarray(start, np.float64)
  m = np.zeros(2)
  v = np.zeros(2)
  path = [w.copy()]
  for t in range(1, steps + 1):
    g = curvature * w
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat = m / (1 - b1**t)
    v_hat = v / (1 - b2**t)
    w = w - lr * (m_hat / (np.sqrt(v_hat) + eps) + weight_decay * w)
    path.append(w.copy())
  return np.stack(path)


def test_adamw_is_the_float64_rule_along_the_whole_trajectory(tour, tour_module):
  m = tour_module
  ours = tour["optimizers"]["adamw"]
  expected = adamw_float64(m.START, m.CURVATURE, 20, m.ADAM_LR, m.B1, m.B2, 1e-8, m.WEIGHT_DECAY)
  assert ours["trajectory"].shape == (21, 2)
  np.testing.assert_allclose(ours["trajectory"], expected, rtol=1e-5, atol=1e-6)
  # Weight decay does act: Adam without it ends elsewhere.
  assert not np.allclose(tour["optimizers"]["adam"]["trajectory"][-1], expected[-1], atol=1e-3)
  if "pinned_host" in optax_hybrid.available_memory_kinds():
    assert ours["state_memory_kind"] == "pinned_host"


def test_llama2_schedule_matches_the_float64_formula(tour_module):
  m = tour_module
  steps, lrs = m.llama2_schedule(num_points=500)
  expected = [colossal_lr(int(k), 3e-4, 500_000, 2_000, 3e-5) for k in steps]
  np.testing.assert_allclose(lrs, expected, rtol=2e-6, atol=1e-11)
  lookup = dict(zip(steps.tolist(), lrs.tolist()))
  assert lookup[1_999] == pytest.approx(3e-4) and lookup[500_000] == pytest.approx(3e-5)
  # Densely sampled through warmup, where a uniform subsample would miss it.
  assert np.sum(steps < 2_000) >= 100


def test_byte_accounting_agrees_with_the_readme(tour_module):
  rows = {label: (device, host) for label, device, host in tour_module.memory_rows()}
  # The explainer's "about 16 bytes per weight vs 2 to serve".
  assert rows["AdamW all on the accelerator"] == (16, 0)
  assert rows["serving bf16"] == (2, 0)
  # README: hybrid_adamw(state_memory_kind="pinned_host") is 2 + 2 on the device, 8 on the host.
  assert rows["hybrid_adamw host moments no master"] == (4, 8)
  assert rows["hybrid_adamw host moments + host master"] == (4, 12)


def test_cli_writes_the_figure_and_the_numbers(tmp_path, tour_module, capsys):
  pytest.importorskip("matplotlib")
  out = tmp_path / "tour"
  result = tour_module.main(["--out-dir", str(out), "--steps", "20"])
  png = out / "optimizer_tour.png"
  assert result["png"] == str(png)
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert png.stat().st_size > 50_000  # three panels, not an empty canvas
  text = (out / "optimizer_tour.txt").read_text()
  printed = capsys.readouterr().out
  assert text in printed
  for r in result["tour"]["optimizers"].values():
    assert f"{r['final_loss']:.4f}" in text and r["label"] in text
  assert math.isclose(result["tour"]["optimizers"]["sgd"]["final_loss"], 0.3934, abs_tol=1e-4)


def test_cli_rejects_zero_steps(tour_module, capsys):
  with pytest.raises(SystemExit):
    tour_module.main(["--steps", "0"])
  assert "--steps" in capsys.readouterr().err
