"""The examples run for a few steps, keep the moments on host and actually learn."""

import importlib.util
import os
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples")


def load(name):
  pytest.importorskip("flax")
  spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # Linen dataclasses look their module up
  spec.loader.exec_module(module)
  return module


def test_flax_nnx_mlp(capsys):
  result = load("flax_nnx_mlp").main(["--steps", "150"])
  assert result["moment_memory_kinds"] == ["pinned_host"]
  assert result["final_loss"] < 0.25 * result["initial_loss"]
  assert "Adam moments in pinned_host memory" in capsys.readouterr().out


def test_flax_train_state(capsys):
  result = load("flax_train_state").main(["--steps", "120"])
  assert result["moment_memory_kinds"] == ["pinned_host"]
  assert result["final_accuracy"] > 0.9 > result["initial_accuracy"] + 0.2
  assert "test accuracy" in capsys.readouterr().out


def test_nnx_example_rejects_bad_steps(capsys):
  with pytest.raises(SystemExit):
    load("flax_nnx_mlp").main(["--steps", "1"])
  assert "--steps" in capsys.readouterr().err
