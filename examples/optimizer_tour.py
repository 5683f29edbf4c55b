"""A tour of the optimizer: SGD, momentum, Adam, AdamW, the LLaMA 2 schedule and its memory.

    python examples/optimizer_tour.py                      # writes ./optimizer_tour_out/
    python examples/optimizer_tour.py --out-dir /tmp/tour --steps 40

One figure with three panels, plus the same numbers as text:

1. A toy loss over two weights, L(w) = 0.5 * (w1^2 + 100 * w2^2): a valley 100
   times steeper across (w2) than along (w1). Plain gradient descent, momentum,
   Adam and AdamW (``optax_hybrid.hybrid_adamw``, its moments in host memory)
   each take the same number of steps from the same start, drawn on the
   contours. Plain descent has to use a step size that is safe across the
   valley, so it zigzags across and crawls along; momentum lets the zigzags
   cancel and the push along the valley add up; Adam divides each weight's step
   by the size of its own gradients, so both weights move at a similar pace.
2. The LLaMA 2 learning-rate schedule, drawn with
   ``optax_hybrid.warmup_cosine_schedule``: linear warmup over 2,000 steps to a
   3e-4 peak, then a cosine down to 10% of the peak at step 500,000.
3. Bytes of memory per weight: training with AdamW entirely on the accelerator,
   the same training with ``hybrid_adamw(state_memory_kind="pinned_host")``,
   and serving.

Needs matplotlib for the figure (``pip install matplotlib``); without it the
numbers are still printed and written.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_hybrid

# The valley's curvature along w1 and across w2. The start and the plain-descent
# step size are chosen so that plain descent ends at the explainer's "loss 0.39
# after 20 steps"; the start is also far enough off the valley floor that the
# first gradient is 17 times larger across than along.
CURVATURE = np.array([1.0, 100.0])
START = np.array([-1.2, 0.2])

# Plain descent diverges across the valley for lr >= 2 / 100; 0.015 is safely
# below that, which makes the step along the valley 100 times smaller than the
# one across. Momentum keeps that step size so that momentum alone makes the
# difference. Its beta is 0.7 rather than the usual 0.9: with 0.9 the
# along-valley motion is so underdamped that 20 steps end wherever the
# oscillation happens to be, sometimes above plain descent.
SGD_LR = 0.015
MOMENTUM = 0.7
# Adam moves every weight by about lr per step whatever its gradient, so lr is
# a distance: 0.06 covers the 1.2 along the valley in 20 steps.
ADAM_LR = 0.06
# The explainer's (and LLaMA 2's) AdamW hyperparameters.
B1, B2, WEIGHT_DECAY = 0.9, 0.95, 0.1

# LLaMA 2: 2,000 warmup steps to a 3e-4 peak, cosine to 10% of it at 500,000.
LLAMA2_PEAK, LLAMA2_TOTAL, LLAMA2_WARMUP = 3e-4, 500_000, 2_000
LLAMA2_ETA_MIN = 0.1 * LLAMA2_PEAK

# Bytes per weight by component, for mixed-precision training: bf16 weights and
# gradients for compute, fp32 moments, and an fp32 master copy of the weights so
# that small updates are not lost to bf16 rounding.
COMPONENT_BYTES = {
    "bf16 weight": 2,
    "bf16 gradient": 2,
    "fp32 master weight": 4,
    "fp32 Adam m": 4,
    "fp32 Adam v": 4,
}
# (label, components in device memory, components in host memory). The README's
# table counts the hybrid_adamw row without a master copy (2 + 2 on the device,
# 8 on the host): with bf16 params hybrid_adamw does its update math in fp32 and
# rounds once, keeping no master. A master copy, where one is wanted, is fp32
# params in host memory, which hybrid_adamw updates there with host compute
# (refreshing the bf16 copy on the device is then the training loop's job).
MEMORY_LAYOUTS = [
    ("AdamW\nall on the\naccelerator",
     ["bf16 weight", "bf16 gradient", "fp32 master weight", "fp32 Adam m", "fp32 Adam v"], []),
    ("hybrid_adamw\nhost moments\nno master",
     ["bf16 weight", "bf16 gradient"], ["fp32 Adam m", "fp32 Adam v"]),
    ("hybrid_adamw\nhost moments\n+ host master",
     ["bf16 weight", "bf16 gradient"], ["fp32 master weight", "fp32 Adam m", "fp32 Adam v"]),
    ("serving\nbf16", ["bf16 weight"], []),
]


def loss(w):
  return 0.5 * jnp.sum(jnp.asarray(CURVATURE, w.dtype) * w * w)


def optimizers() -> dict[str, dict]:
  """The four optimizers of the tour, each with its label and learning rate."""
  # Where the backend has host memory AdamW keeps its moments there, as when
  # training a model that does not fit; the numbers are the same either way.
  kind = "pinned_host" if "pinned_host" in optax_hybrid.available_memory_kinds() else None
  return {
      "sgd": {"label": "gradient descent", "lr": SGD_LR,
              "tx": optax.sgd(SGD_LR)},
      "momentum": {"label": f"momentum (beta {MOMENTUM})", "lr": SGD_LR,
                   "tx": optax.sgd(SGD_LR, momentum=MOMENTUM)},
      "adam": {"label": f"Adam (b1 {B1}, b2 {B2})", "lr": ADAM_LR,
               "tx": optax.adam(ADAM_LR, b1=B1, b2=B2)},
      "adamw": {"label": f"AdamW, hybrid_adamw (wd {WEIGHT_DECAY})", "lr": ADAM_LR,
                "tx": optax_hybrid.hybrid_adamw(ADAM_LR, b1=B1, b2=B2, weight_decay=WEIGHT_DECAY,
                                                state_memory_kind=kind),
                "state_memory_kind": kind or "beside the params"},
  }


def trajectory(tx: optax.GradientTransformation, steps: int) -> np.ndarray:
  """The weights before the first step and after each of ``steps`` steps, shape (steps + 1, 2)."""
  # Committed to a device: host-resident optimizer state is committed, and a
  # jitted step whose inputs are all committed compiles once.
  w = jax.device_put(jnp.asarray(START, jnp.float32), jax.devices()[0])
  state = tx.init(w)

  @jax.jit
  def step(w, state):
    updates, state = tx.update(jax.grad(loss)(w), state, w)
    return optax_hybrid.apply_updates(w, updates), state

  path = [np.asarray(w)]
  for _ in range(steps):
    w, state = step(w, state)
    path.append(np.asarray(w))
  return np.stack(path)


def run_tour(steps: int = 20) -> dict:
  """Runs every optimizer for ``steps`` steps from ``START``.

  Returns a dict: ``"start"``, ``"steps"``, and ``"optimizers"``, mapping
  ``"sgd"``, ``"momentum"``, ``"adam"`` and ``"adamw"`` to their ``label``,
  ``lr``, ``trajectory`` (float32 array, shape (steps + 1, 2)), ``losses``
  (float64 loss at each point of the trajectory) and ``final_loss``.
  """
  results = {}
  for name, spec in optimizers().items():
    path = trajectory(spec["tx"], steps)
    losses = 0.5 * (path.astype(np.float64) ** 2 @ CURVATURE)
    results[name] = {key: value for key, value in spec.items() if key != "tx"}
    results[name].update(trajectory=path, losses=losses, final_loss=float(losses[-1]))
  return {"start": START.copy(), "steps": steps, "optimizers": results}


def llama2_schedule(num_points: int = 2_000) -> tuple[np.ndarray, np.ndarray]:
  """Steps and learning rates of the LLaMA 2 schedule, densely through warmup, sparsely after."""
  schedule = optax_hybrid.warmup_cosine_schedule(
      LLAMA2_PEAK, total_steps=LLAMA2_TOTAL, warmup_steps=LLAMA2_WARMUP, eta_min=LLAMA2_ETA_MIN)
  # Warmup is 0.4% of the run: a uniform subsample would give it 8 points, too
  # few for the inset that shows it.
  steps = np.unique(np.concatenate([
      np.arange(0, 3 * LLAMA2_WARMUP, 10),
      np.linspace(0, LLAMA2_TOTAL + 20_000, num_points).astype(np.int64),
      [LLAMA2_WARMUP - 1, LLAMA2_WARMUP, LLAMA2_TOTAL],
  ]))
  lrs = jax.jit(jax.vmap(schedule))(jnp.asarray(steps, jnp.int32))
  return steps, np.asarray(lrs)


def memory_rows() -> list[tuple[str, int, int]]:
  return [(" ".join(label.split()), sum(COMPONENT_BYTES[c] for c in device),
           sum(COMPONENT_BYTES[c] for c in host)) for label, device, host in MEMORY_LAYOUTS]


def report(tour: dict, schedule_steps: np.ndarray, schedule_lrs: np.ndarray) -> str:
  lines = [
      f"Toy loss L(w) = 0.5 * (w1^2 + 100 * w2^2), start w = ({START[0]}, {START[1]}), "
      f"L = {0.5 * float(START ** 2 @ CURVATURE):.4f}, {tour['steps']} steps each",
      f"{'optimizer':<38} {'lr':>6} {'final w1':>10} {'final w2':>10} {'final loss':>11}",
  ]
  for result in tour["optimizers"].values():
    w1, w2 = result["trajectory"][-1]
    lines.append(f"{result['label']:<38} {result['lr']:>6g} {w1:>10.4f} {w2:>10.4f} "
                 f"{result['final_loss']:>11.4f}")
  adamw = tour["optimizers"]["adamw"]
  lines.append(f"(AdamW: optax_hybrid.hybrid_adamw, moments in {adamw['state_memory_kind']} memory)")
  first = {name: np.abs(r["trajectory"][1] - r["trajectory"][0]) for name, r in tour["optimizers"].items()}
  lines.append("first step |dw1|, |dw2|: " + "; ".join(
      f"{name} {d[0]:.4f}, {d[1]:.4f}" for name, d in first.items()))
  lines += [
      "",
      f"LLaMA 2 schedule: optax_hybrid.warmup_cosine_schedule({LLAMA2_PEAK:g}, "
      f"total_steps={LLAMA2_TOTAL}, warmup_steps={LLAMA2_WARMUP}, eta_min={LLAMA2_ETA_MIN:g})",
  ]
  lookup = dict(zip(schedule_steps.tolist(), schedule_lrs.tolist()))
  for k in (0, 999, LLAMA2_WARMUP - 1, LLAMA2_WARMUP, 251_000, LLAMA2_TOTAL):
    value = lookup[k] if k in lookup else float(optax_hybrid.warmup_cosine_schedule(
        LLAMA2_PEAK, LLAMA2_TOTAL, LLAMA2_WARMUP, LLAMA2_ETA_MIN)(k))
    lines.append(f"  step {k:>7,}: lr {value:.3e}")
  lines += ["", "Bytes per weight (" + ", ".join(f"{c} {b}" for c, b in COMPONENT_BYTES.items()) + ")",
            f"  {'':<40} {'device':>6} {'host':>5} {'total':>6}"]
  for label, device, host in memory_rows():
    lines.append(f"  {label:<40} {device:>6} {host:>5} {device + host:>6}")
  return "\n".join(lines) + "\n"


def plot(tour: dict, schedule_steps: np.ndarray, schedule_lrs: np.ndarray, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")  # files only, no screen
  import matplotlib.pyplot as plt
  from matplotlib.colors import LogNorm
  from matplotlib.ticker import FuncFormatter

  fig, (ax_path, ax_sched, ax_mem) = plt.subplots(
      1, 3, figsize=(19, 6), gridspec_kw={"width_ratios": [1.45, 1, 1.05]})

  # Panel 1: the trajectories on the contours.
  results = tour["optimizers"]
  points = np.concatenate([r["trajectory"] for r in results.values()] + [np.zeros((1, 2))])
  lo, hi = points.min(axis=0), points.max(axis=0)
  pad = 0.08 * (hi - lo)
  x = np.linspace(lo[0] - pad[0], hi[0] + pad[0], 400)
  y = np.linspace(lo[1] - pad[1], hi[1] + pad[1], 400)
  xx, yy = np.meshgrid(x, y)
  zz = 0.5 * (CURVATURE[0] * xx ** 2 + CURVATURE[1] * yy ** 2)
  # Geometric levels: the loss spans four decades across the plotted area.
  levels = np.geomspace(1e-3, zz.max(), 18)
  ax_path.contourf(xx, yy, zz, levels=levels, norm=LogNorm(), cmap="Blues_r", alpha=0.35)
  ax_path.contour(xx, yy, zz, levels=levels, colors="0.55", linewidths=0.6)
  styles = {"sgd": ("tab:red", "o"), "momentum": ("tab:blue", "s"),
            "adam": ("tab:green", "^"), "adamw": ("tab:purple", "D")}
  for name, r in results.items():
    color, marker = styles[name]
    ax_path.plot(*r["trajectory"].T, color=color, marker=marker, markersize=3.5, linewidth=1.4,
                 label=f"{r['label']}, lr {r['lr']:g}: loss {r['final_loss']:.3f}")
  ax_path.plot(*START, "ko", markersize=7)
  ax_path.annotate("start", START, textcoords="offset points", xytext=(6, 6))
  ax_path.plot(0, 0, "k*", markersize=12)
  ax_path.set_xlabel("w1 (along the valley, curvature 1)")
  ax_path.set_ylabel("w2 (across the valley, curvature 100)")
  ax_path.set_title(f"{tour['steps']} steps on L(w) = ½ (w1² + 100 w2²)\n"
                    f"start loss {0.5 * float(START ** 2 @ CURVATURE):.2f}; final loss in the legend")
  ax_path.legend(loc="lower right", fontsize=8.5, framealpha=0.9)

  # Panel 2: the schedule, with the warmup enlarged in an inset.
  ax_sched.plot(schedule_steps, schedule_lrs, color="tab:orange", linewidth=2)
  ax_sched.axhline(LLAMA2_ETA_MIN, color="grey", linestyle=":", linewidth=1)
  ax_sched.annotate(f"floor {LLAMA2_ETA_MIN:.0e} (10% of peak)", (LLAMA2_TOTAL * 0.45, LLAMA2_ETA_MIN),
                    textcoords="offset points", xytext=(0, 5), color="grey", fontsize=9)
  ax_sched.set_xlim(0, schedule_steps.max())
  ax_sched.set_ylim(0, LLAMA2_PEAK * 1.12)
  ax_sched.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1000:.0f}k"))
  ax_sched.set_xlabel("optimizer step")
  ax_sched.set_ylabel("learning rate")
  lr_format = FuncFormatter(lambda v, _: f"{v:.1e}" if v else "0")
  ax_sched.yaxis.set_major_formatter(lr_format)
  ax_sched.set_title("LLaMA 2 schedule: warmup_cosine_schedule(3e-4,\n"
                     "total_steps=500,000, warmup_steps=2,000, eta_min=3e-5)")
  inset = ax_sched.inset_axes([0.5, 0.5, 0.46, 0.34])
  near = schedule_steps <= 3 * LLAMA2_WARMUP
  inset.plot(schedule_steps[near], schedule_lrs[near], color="tab:orange", linewidth=1.5)
  inset.axvline(LLAMA2_WARMUP, color="grey", linestyle="--", linewidth=0.8)
  inset.set_title("first 6,000 steps: linear warmup", fontsize=8)
  inset.tick_params(labelsize=7)
  inset.yaxis.set_major_formatter(lr_format)
  inset.set_ylim(0, LLAMA2_PEAK * 1.1)

  # Panel 3: bytes per weight, device memory above the axis, host memory below.
  colors = dict(zip(COMPONENT_BYTES, ["tab:blue", "tab:cyan", "tab:gray", "tab:orange", "tab:red"]))
  labelled = set()
  for i, (label, device, host) in enumerate(MEMORY_LAYOUTS):
    for components, sign in ((device, 1), (host, -1)):
      bottom = 0
      for c in components:
        height = sign * COMPONENT_BYTES[c]
        ax_mem.bar(i, height, bottom=bottom, color=colors[c], edgecolor="black", linewidth=0.6,
                   hatch="//" if sign < 0 else None, label=None if c in labelled else c)
        labelled.add(c)
        bottom += height
      if components:
        total = sum(COMPONENT_BYTES[c] for c in components)
        ax_mem.annotate(str(total), (i, sign * total), ha="center", va="bottom" if sign > 0 else "top",
                        textcoords="offset points", xytext=(0, 3 * sign), fontweight="bold")
  ax_mem.axhline(0, color="black", linewidth=1)
  ax_mem.set_xticks(range(len(MEMORY_LAYOUTS)), [label for label, _, _ in MEMORY_LAYOUTS], fontsize=9)
  ax_mem.set_ylim(-15, 21)
  ax_mem.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{abs(v):.0f}"))
  ax_mem.set_ylabel("bytes per weight")
  ax_mem.text(0.02, 0.97, "↑ accelerator memory", transform=ax_mem.transAxes, va="top", fontsize=9)
  ax_mem.text(0.02, 0.03, "↓ host memory", transform=ax_mem.transAxes, va="bottom", fontsize=9)
  ax_mem.set_title("What training keeps per weight\n(hatched: in host memory)")
  ax_mem.legend(loc="upper right", fontsize=8)

  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out-dir", default="optimizer_tour_out",
                      help="folder for optimizer_tour.png and optimizer_tour.txt (default ./optimizer_tour_out)")
  parser.add_argument("--steps", type=int, default=20, help="steps per optimizer on the toy loss (default 20)")
  args = parser.parse_args(argv)
  if args.steps < 1:
    parser.error("--steps must be at least 1")

  start = time.perf_counter()
  tour = run_tour(args.steps)
  schedule_steps, schedule_lrs = llama2_schedule()
  text = report(tour, schedule_steps, schedule_lrs)
  print(text, end="")

  os.makedirs(args.out_dir, exist_ok=True)
  txt_path = os.path.join(args.out_dir, "optimizer_tour.txt")
  with open(txt_path, "w") as f:
    f.write(text)
  png_path = os.path.join(args.out_dir, "optimizer_tour.png")
  try:
    import matplotlib  # noqa: F401  (only the figure needs it)
  except ImportError:
    png_path = None
    print("matplotlib is not installed (pip install matplotlib): wrote the numbers only")
  else:
    plot(tour, schedule_steps, schedule_lrs, png_path)
  print(f"wrote {txt_path}" + (f" and {png_path}" if png_path else "")
        + f" ({time.perf_counter() - start:.1f} s)")
  return {"tour": tour, "txt": txt_path, "png": png_path}


if __name__ == "__main__":
  main()
