"""char-GPT trained twice with the same seed: float32 moments against 8-bit block-wise moments.

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/moment_formats.py [--steps 400] [--out docs/char_gpt_8bit.png]

Runs ``examples/char_gpt.py`` (default model and data, Adam moments in host
memory) with ``--moment-format float32`` and ``--moment-format 8bit``, prints
both runs' final train and validation losses, their relative difference, the
moments' bytes per weight and tokens/s, and draws both loss curves in one plot.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, os.pardir)


def load_char_gpt():
  spec = importlib.util.spec_from_file_location("char_gpt", os.path.join(ROOT, "examples", "char_gpt.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules["char_gpt"] = module  # dataclasses look their module up
  spec.loader.exec_module(module)
  return module


def read_metrics(path: str) -> list[dict]:
  with open(path) as f:
    return list(csv.DictReader(f))


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=os.path.join(ROOT, "docs", "char_gpt_8bit.png"))
  args = parser.parse_args(argv)
  char_gpt = load_char_gpt()
  runs = {}
  with tempfile.TemporaryDirectory() as tmp:
    for fmt in ("float32", "8bit"):
      out_dir = os.path.join(tmp, fmt)
      summary = char_gpt.main(["--steps", str(args.steps), "--seed", str(args.seed), "--moment-format", fmt,
                               "--sample-chars", "0", "--out-dir", out_dir])
      runs[fmt] = (summary, read_metrics(os.path.join(out_dir, "metrics.csv")))
  print("\n| moments | final train loss | final validation loss | moments B/weight | tokens/s |")
  print("|---|---:|---:|---:|---:|")
  for fmt, (s, _) in runs.items():
    moments = sum(s["memory"]["by_component"]["moments"].values()) / s["params"]
    print(f"| {fmt} | {s['final_train_loss']:.4f} | {s['final_val_loss']:.4f} | {moments:.2f} | "
          f"{s['tokens_per_s']:,.0f} |")
  full, eight = runs["float32"][0]["final_val_loss"], runs["8bit"][0]["final_val_loss"]
  print(f"\nvalidation loss, 8-bit against float32 moments: {100 * (eight - full) / full:+.2f}% "
        f"(seed {args.seed}, {args.steps} steps)")
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: no plot")
    return runs
  fig, ax = plt.subplots(figsize=(8, 4.8))
  for fmt, (s, rows) in runs.items():
    steps = [int(r["step"]) for r in rows]
    ax.plot(steps, [float(r["loss"]) for r in rows], lw=0.8, alpha=0.6, label=f"{fmt} moments: train")
    val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss")]
    ax.plot(*zip(*val), "o-", label=f"{fmt} moments: validation ({s['final_val_loss']:.4f})")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats/char)")
  ax.set_title(f"char-GPT, seed {args.seed}: float32 against 8-bit block-wise Adam moments")
  ax.legend()
  fig.tight_layout()
  fig.savefig(args.out, dpi=110)
  print(f"plot: {os.path.relpath(args.out)}")
  return runs


if __name__ == "__main__":
  sys.exit(0 if main() else 1)
