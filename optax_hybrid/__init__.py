"""optax_hybrid: Optax optimizers whose state can live in host memory, on the host CPU or on disk.

Public API:

* :func:`hybrid_adamw` (AdamW, HybridAdam / ``optax.adamw`` / torch
  semantics) and one ``hybrid_<rule>`` per update rule of
  :mod:`optax_hybrid.rules` (``hybrid_lion``, ``hybrid_sgd``...): each takes its
  Optax counterpart's arguments, then the engine's keyword-only placement,
  storage and kernel options (:mod:`optax_hybrid.options`).
* :func:`scale_by_hybrid_adam`: Adam's direction without the learning rate.
* :class:`HybridOptimizer` (alias :class:`HybridAdamW`): what they return;
  adds the fused ``step(params, state, grads)``.
* :class:`HybridAdamState` and one state type per rule (``count``, the rule's
  fields, ``skipped``, ``master``, ``plan``).
* :func:`moment_values`: the rule's state as float trees shaped like the params
  (8-bit values dequantized, disk values read).
* :func:`warmup_cosine_schedule`: linear warmup then a cosine to a floor.
* :func:`apply_updates`: ``optax.apply_updates`` that is correct for params in
  any memory kind.
* :func:`commit`: commits what a jitted step takes (params, state, a
  ``TrainState``, an NNX model and optimizer), so that a step with state in
  host memory compiles once.
* :func:`scan_layers`: ``jax.lax.scan`` over stacked layers that may live in
  host memory: one layer on the device at a time, the gradient written where
  the layers live (:mod:`optax_hybrid.streaming`).
* :func:`step_in_backward`: a train step whose optimizer steps each streamed
  layer inside the backward pass, so no gradient of the layers is kept.
* :func:`host_arithmetic_outside_host_compute`: finds device arithmetic on
  host-resident values in a jaxpr.
* :mod:`optax_hybrid.checkpoint`: Orbax save/restore that keeps memory kinds.
* :func:`memory_report` / :class:`MemoryReport`: where training memory went,
  by tier and by memory (device, host, disk).
* :func:`clip_by_global_norm` / :func:`global_norm`: Optax's, for gradients
  in any memory kind (host memory included), to chain in front of an optimizer.
* :func:`standard_optimizer`: clipping, AdamW with warmup-cosine,
  accumulation and parameter groups in one call; :func:`last_learning_rate`
  reads the rate of the latest update from its state.
* :mod:`optax_hybrid.masters`: the master weight formats of ``master=``
  (``"float32"``, ``"kahan"``, ``"stochastic"``).
* :mod:`optax_hybrid.tiers` and :mod:`optax_hybrid.disk`: placement tiers and
  the disk tier; :mod:`optax_hybrid.plan`: every per-leaf decision ``init``
  makes (``state.plan``).
* :mod:`optax_hybrid.gpu_compile`: compile a step for an H100/H200 without a
  GPU and read what XLA planned (``import optax_hybrid.gpu_compile``; needs
  JAX's CUDA plugin: ``gpu_compile.install_cuda_plugin()``).
"""

from optax_hybrid import checkpoint, disk, masters, options, plan, recipe, report, rules, tiers
from optax_hybrid.placement import (
    STATE_MEMORY_KINDS,
    apply_updates,
    available_memory_kinds,
    commit,
    host_arithmetic_outside_host_compute,
)
from optax_hybrid.recipe import clip_by_global_norm, global_norm, last_learning_rate, standard_optimizer
from optax_hybrid.report import MemoryReport, memory_report
from optax_hybrid.schedules import warmup_cosine_schedule
from optax_hybrid.streaming import scan_layers, step_in_backward
from optax_hybrid.rules.adagrad import HybridAdagradState, hybrid_adagrad
from optax_hybrid.rules.adamw import HybridAdamState, hybrid_adamw, scale_by_hybrid_adam
from optax_hybrid.rules.lion import HybridLionState, hybrid_lion
from optax_hybrid.rules.sgd import HybridSgdState, hybrid_sgd
from optax_hybrid.transform import HybridAdamW, HybridOptimizer, StepInParts, moment_values

__version__ = "0.1.0"

__all__ = [
    "HybridAdagradState",
    "HybridAdamState",
    "HybridAdamW",
    "HybridLionState",
    "HybridOptimizer",
    "HybridSgdState",
    "MemoryReport",
    "STATE_MEMORY_KINDS",
    "StepInParts",
    "apply_updates",
    "checkpoint",
    "clip_by_global_norm",
    "commit",
    "disk",
    "global_norm",
    "last_learning_rate",
    "masters",
    "memory_report",
    "moment_values",
    "options",
    "plan",
    "recipe",
    "report",
    "rules",
    "standard_optimizer",
    "tiers",
    "available_memory_kinds",
    "host_arithmetic_outside_host_compute",
    "hybrid_adagrad",
    "hybrid_adamw",
    "hybrid_lion",
    "hybrid_sgd",
    "scale_by_hybrid_adam",
    "scan_layers",
    "step_in_backward",
    "warmup_cosine_schedule",
]
