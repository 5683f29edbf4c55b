"""The spellings that give way to one argument per choice (docs/optimizer.md, "One spelling per choice").

Each still works, with the same results as its replacement, and warns once per
process: a ``FutureWarning`` (shown by default: it is meant for whoever runs
the training script, not only for the library's developers) naming the
argument to use and the release that removes it.
"""

from __future__ import annotations

import sys
import warnings

#: The release that removes the deprecated spellings.
REMOVED_IN = "0.3"

#: ``old spelling -> replacement``, as the warnings and docs/optimizer.md name them.
SPELLINGS = {
    "tiers": "state_memory_kind (the same values)",
    "offload_fraction": "state_memory_kind=optax_hybrid.by_fraction(host=...)",
    "nvme_offload_fraction": "state_memory_kind=optax_hybrid.by_fraction(disk=...)",
    "master_dtype": "master (master=jnp.float32 or master='float32')",
    "nu_dtype": ("moment_format (moment_format='bfloat16' stores both moments in bfloat16; mu_dtype, "
                 "optax.adamw's argument, the first alone; the second moment alone in another dtype than the "
                 "first is not offered after 0.3)"),
    "weight_decay_mask": "mask (optax.adamw's name)",
    "min_lr_ratio": "min_lr (min_lr_ratio times learning_rate)",
}

_told: set[str] = set()


def warn(owner: str, old: str, replacement: str) -> None:
  """Warns, once per process for each ``old`` spelling, that ``owner`` takes ``replacement`` instead."""
  if old in _told:
    return
  _told.add(old)
  warnings.warn(f"{owner}: `{old}` is deprecated and will be removed in optax_hybrid {REMOVED_IN}; "
                f"use {replacement}. Until then it works as before (docs/optimizer.md, 'One spelling per choice').",
                FutureWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
  """The stack level of the first frame outside optax_hybrid (and optax's wrappers): the line that passed it."""
  frame, level = sys._getframe(2), 2
  while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in ("optax_hybrid", "optax"):
    frame, level = frame.f_back, level + 1
  return level
