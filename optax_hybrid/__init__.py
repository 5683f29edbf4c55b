"""optax_hybrid: AdamW for JAX with optimizer state in host memory, ColossalAI-style.

Public API:

* :func:`warmup_cosine_schedule`: linear warmup then a cosine to a floor.
* :func:`hybrid_adamw`: the AdamW transform (HybridAdam / torch semantics)
  whose moments can live in ``pinned_host`` memory.
* :func:`scale_by_hybrid_adam`: the same step without the learning rate.
* :class:`HybridAdamW`: what ``hybrid_adamw`` returns; adds the fused
  ``step(params, state, grads)``.
* :class:`HybridAdamState`: its state (``count``, ``mu``, ``nu``, ``skipped``).
* :func:`apply_updates`: ``optax.apply_updates`` that is correct for params in
  any memory kind.
* :func:`host_arithmetic_outside_host_compute`: finds device arithmetic on
  host-resident values in a jaxpr.
* :mod:`optax_hybrid.checkpoint`: Orbax save/restore that keeps memory kinds.
"""

from optax_hybrid import checkpoint
from optax_hybrid.placement import (
    STATE_MEMORY_KINDS,
    apply_updates,
    available_memory_kinds,
    host_arithmetic_outside_host_compute,
)
from optax_hybrid.schedules import warmup_cosine_schedule
from optax_hybrid.transform import HybridAdamState, HybridAdamW, hybrid_adamw, scale_by_hybrid_adam

__version__ = "0.1.0"

__all__ = [
    "HybridAdamState",
    "HybridAdamW",
    "STATE_MEMORY_KINDS",
    "apply_updates",
    "checkpoint",
    "available_memory_kinds",
    "host_arithmetic_outside_host_compute",
    "hybrid_adamw",
    "scale_by_hybrid_adam",
    "warmup_cosine_schedule",
]
