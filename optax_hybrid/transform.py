"""The Optax-facing AdamW transform: ``hybrid_adamw`` and its building block."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax._src import numerics

from optax_hybrid import _compat, disk, placement, tiers as tiers_lib
from optax_hybrid.kernels import check_kernel_name, resolve_kernel, step_scalars

ScalarOrSchedule = Union[float, jax.Array, optax.Schedule]
MaskOrFn = Optional[Union[Any, Callable[[optax.Params], Any]]]


class HybridAdamState(NamedTuple):
  """State of :func:`hybrid_adamw` and :func:`scale_by_hybrid_adam`.

  Attributes:
    count: int32 scalar, the number of updates taken (on device).
    mu: first moments, shaped like the params, in ``mu_dtype`` and their
      state memory kind.
    nu: second moments, likewise in ``nu_dtype`` (real for complex params).
    skipped: int32 scalar, the number of steps skipped for non-finite
      gradients (``skip_nonfinite=True``); they do not advance ``count``.
    master: with ``master_dtype``, the master copy of each lower-precision
      param (a tree shaped like the params, ``None`` where a param keeps no
      master), placed with the leaf's moments; ``None`` otherwise.
    plan: each leaf's placement tier (:class:`optax_hybrid.tiers.Plan`),
      static data that holds no arrays.
  """

  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  skipped: jax.Array
  master: Any = None
  plan: Any = None


class HybridAdamW(optax.GradientTransformationExtraArgs):
  """An Optax gradient transformation with one more method: ``step``, the fused one-pass step.

  ``init`` and ``update`` follow the Optax contract. ``step`` returns the new
  params directly: each leaf's parameter is read once and written once (in
  place when the buffers are donated), instead of returning an update that a
  second pass adds.
  """

  __slots__ = ()

  def step(self, params: optax.Params, state: "HybridAdamState",
           grads: optax.Updates) -> tuple[optax.Params, "HybridAdamState"]:
    r"""One fused optimizer step: ``(params, state, grads) -> (new_params, new_state)``.

    Equal to ``u, s = tx.update(grads, state, params); optax_hybrid.apply_updates(params, u)``
    except that :math:`p + u` is added in float32 and rounded once to the
    param's dtype. Params in host memory are updated on the host. Arguments
    come in the order of the results, so ``jax.jit(tx.step,
    donate_argnums=(0, 1))`` pairs every donated buffer with its own result
    (JAX pairs donations with outputs by shape, in order).

    Example:
      >>> import jax, jax.numpy as jnp, optax_hybrid
      >>> tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1)
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> step = jax.jit(tx.step, donate_argnums=(0, 1))
      >>> params, state = step(params, state, {"w": jnp.ones(3)})
    """
    return self.update.fused_step(params, state, grads)

  def close(self) -> None:
    """Removes the disk tier's files (and their temporary directory). A no-op without disk leaves.

    Also done at interpreter exit. The state's disk leaves cannot be stepped
    afterwards.
    """
    self.update.close()


# ---------------------------------------------------------------------------
# Argument validation
# ---------------------------------------------------------------------------


def _concrete_float(name: str, value: Any) -> float | None:
  """``value`` as a Python float, or None when it is traced (checked by the caller's caller)."""
  if _compat.is_tracer(value):
    return None
  if isinstance(value, bool):
    raise TypeError(f"hybrid_adamw: `{name}` must be a number, got the bool {value!r}.")
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, (np.ndarray, np.generic, jax.Array)):
    if np.ndim(value) != 0 or not jnp.issubdtype(np.asarray(value).dtype, jnp.number):
      raise TypeError(
          f"hybrid_adamw: `{name}` must be a scalar number, got an array of "
          f"shape {np.shape(value)} and dtype {np.asarray(value).dtype}."
      )
    return float(np.asarray(value))
  raise TypeError(
      f"hybrid_adamw: `{name}` must be a number, got {value!r} of type {type(value).__name__}."
  )


def _check_range(name: str, value: Any, *, low: float, high: float | None = None, high_open: bool = False) -> None:
  x = _concrete_float(name, value)
  if x is None:
    return
  if not math.isfinite(x):
    raise ValueError(f"hybrid_adamw: `{name}` must be finite, got {x!r}.")
  if x < low or (high is not None and (x >= high if high_open else x > high)):
    if high is None:
      accepted = f">= {low}"
    else:
      accepted = f"in [{low}, {high}{')' if high_open else ']'}"
    hint = ""
    if high_open and x == high and not isinstance(value, numbers.Real):
      # A beta that rounded up to 1: typically optax.inject_hyperparams casting
      # hyperparameters to the dtype of bf16/fp16 params.
      hint = (" It is a low-precision array: with optax.inject_hyperparams and "
              "bf16/fp16 params pass hyperparam_dtype=jnp.float32.")
    raise ValueError(f"hybrid_adamw: `{name}` must be {accepted}, got {x!r}.{hint}")


def _check_learning_rate(learning_rate: Any) -> None:
  if callable(learning_rate):
    return
  _check_range("learning_rate", learning_rate, low=0.0)


def _is_zero(value: Any) -> bool:
  """True when ``value`` is a concrete zero, so weight decay can be left out statically."""
  return not _compat.is_tracer(value) and float(np.asarray(value)) == 0.0


def _is_inexact(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating)


def _check_inexact_leaves(tree: Any, what: str) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    dtype = jnp.result_type(leaf) if not hasattr(leaf, "dtype") else leaf.dtype
    if not _is_inexact(dtype):
      raise TypeError(
          f"hybrid_adamw: {what} leaf {jax.tree_util.keystr(path) or '<root>'} has "
          f"dtype {dtype}; only floating-point and complex leaves can be "
          "optimized. Keep integer and boolean leaves out of the optimized tree "
          "(for example with optax.masked or nnx.Optimizer(..., wrt=nnx.Param))."
      )


def _moment_dtypes(param_dtype, mu_dtype, nu_dtype, path) -> tuple:
  """Storage dtypes of one leaf's moments. The second moment of a complex leaf is real."""
  complex_param = jnp.issubdtype(param_dtype, jnp.complexfloating)
  mu = param_dtype if mu_dtype is None else mu_dtype
  nu = (jnp.finfo(param_dtype).dtype if complex_param else param_dtype) if nu_dtype is None else nu_dtype
  if complex_param and not jnp.issubdtype(mu, jnp.complexfloating):
    raise ValueError(
        f"hybrid_adamw: `mu_dtype`={jnp.dtype(mu)} cannot hold the first moment of the "
        f"complex param {jax.tree_util.keystr(path)}; use a complex mu_dtype or None."
    )
  if jnp.issubdtype(nu, jnp.complexfloating):
    raise ValueError(
        f"hybrid_adamw: `nu_dtype`={jnp.dtype(nu)} must be real: the second moment "
        "accumulates |g|^2."
    )
  return mu, nu


def _paths(treedef) -> Any:
  """A tree shaped like ``treedef`` whose leaves are their own key paths, as strings."""
  dummy = treedef.unflatten([0] * treedef.num_leaves)
  return jax.tree_util.tree_map_with_path(lambda path, _: jax.tree_util.keystr(path) or "<root>", dummy)


def _mask_leaves(mask: MaskOrFn, params: Any, treedef: Any) -> list[bool]:
  """One bool per params leaf: does the leaf take weight decay?"""
  if mask is None:
    return [True] * treedef.num_leaves
  if callable(mask):
    if params is None:
      raise ValueError(
          "hybrid_adamw: a callable `mask` needs the params: call "
          "tx.update(grads, state, params)."
      )
    mask = mask(params)
  try:
    # A mask may be a prefix of the params tree: one bool for a whole subtree.
    leaves = treedef.flatten_up_to(
        jax.tree.map(
            lambda m, sub: jax.tree.map(lambda _: m, sub),
            mask,
            treedef.unflatten([0] * treedef.num_leaves),
        )
    )
  except (ValueError, TypeError) as e:
    raise ValueError(
        "hybrid_adamw: `mask` must have the tree structure of the params (or "
        f"be a prefix of it) with bool leaves; params: {treedef}, mask: "
        f"{jax.tree.structure(mask)}."
    ) from e
  out = []
  for leaf in leaves:
    if _compat.is_tracer(leaf):
      raise TypeError(
          "hybrid_adamw: `mask` leaves must be concrete bools, not traced "
          "values; compute the mask from the params' structure, not their values."
      )
    if np.ndim(leaf) != 0 or np.asarray(leaf).dtype != np.bool_:
      raise TypeError(
          f"hybrid_adamw: `mask` leaves must be bools, got {leaf!r}."
      )
    out.append(bool(leaf))
  return out


# ---------------------------------------------------------------------------
# The transform
# ---------------------------------------------------------------------------


def _hybrid_adam(
    learning_rate: ScalarOrSchedule,
    b1: Any,
    b2: Any,
    eps: Any,
    weight_decay: Any,
    *,
    bias_correction: bool,
    adamw_mode: bool,
    mask: MaskOrFn,
    mu_dtype: Any,
    nu_dtype: Any,
    state_memory_kind: placement.MemoryKindSpec,
    kernel: str,
    skip_nonfinite: bool,
    tiers: tiers_lib.TierSpec = None,
    offload_fraction: float | None = None,
    master_dtype: Any = None,
    nvme_offload_fraction: float | None = None,
    nvme_offload_dir: Any = None,
    shard_state_over: str | None = None,
) -> optax.GradientTransformationExtraArgs:
  _check_range("b1", b1, low=0.0, high=1.0, high_open=True)
  _check_range("b2", b2, low=0.0, high=1.0, high_open=True)
  _check_range("eps", eps, low=0.0)
  _check_range("weight_decay", weight_decay, low=0.0)
  for name, flag in (("bias_correction", bias_correction), ("adamw_mode", adamw_mode)):
    if not isinstance(flag, (bool, np.bool_)):
      raise TypeError(f"hybrid_adamw: `{name}` must be a Python bool, got {flag!r}.")
  mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
  nu_dtype = None if nu_dtype is None else jnp.dtype(nu_dtype)
  for name, dtype in (("mu_dtype", mu_dtype), ("nu_dtype", nu_dtype)):
    if dtype is not None and not _is_inexact(dtype):
      raise ValueError(f"hybrid_adamw: `{name}` must be a floating dtype, got {dtype}.")
  if not isinstance(skip_nonfinite, (bool, np.bool_)):
    raise TypeError(f"hybrid_adamw: `skip_nonfinite` must be a Python bool, got {skip_nonfinite!r}.")
  placement.check_memory_kind_spec(state_memory_kind)
  tiers_lib.check_tier_spec(tiers)
  if tiers is not None and state_memory_kind is not None:
    raise ValueError(
        "hybrid_adamw: pass either `tiers` or `state_memory_kind`, not both: a tier sets where the "
        "state lives ('device': device memory; 'host_state' and 'host': pinned_host).")
  offload_fraction = tiers_lib.check_fraction("offload_fraction", offload_fraction)
  nvme_offload_fraction = tiers_lib.check_fraction("nvme_offload_fraction", nvme_offload_fraction)
  if (offload_fraction or 0.0) + (nvme_offload_fraction or 0.0) > 1.0 + 1e-12:
    raise ValueError(
        f"hybrid_adamw: `offload_fraction` + `nvme_offload_fraction` is {offload_fraction + nvme_offload_fraction}"
        "; together they can place at most all of the params (sum <= 1).")
  if shard_state_over is not None and not isinstance(shard_state_over, str):
    raise TypeError(f"hybrid_adamw: `shard_state_over` must be a mesh axis name (a str), got {shard_state_over!r}.")
  if nvme_offload_dir is not None:
    disk.check_directory(nvme_offload_dir)  # before any step, and before init writes anything
  disk_store: list = []  # the DiskStore, made by the first init that places a leaf on disk
  if master_dtype is not None:
    master_dtype = jnp.dtype(master_dtype)
    if not jnp.issubdtype(master_dtype, jnp.floating):
      raise ValueError(f"hybrid_adamw: `master_dtype` must be a real floating dtype such as jnp.float32, "
                       f"got {master_dtype}.")
  check_kernel_name(kernel)
  # Resolved at the first step, not here: resolving reads the device count,
  # which starts the backend, and on a cluster jax.distributed.initialize must
  # come first. An optimizer built at import time must not prevent that.
  resolved_kernels: dict[bool, Callable] = {}

  def kernel_for(fused: bool) -> Callable:
    if fused not in resolved_kernels:
      resolved_kernels[fused] = resolve_kernel(kernel, fused=fused)
    return resolved_kernels[fused]
  decay_is_static_zero = _is_zero(weight_decay)

  def init_fn(params):
    _check_inexact_leaves(params, "params")
    plan, kind_leaves = tiers_lib.resolve(params, tiers=tiers, state_memory_kind=state_memory_kind,
                                          offload_fraction=offload_fraction,
                                          nvme_offload_fraction=nvme_offload_fraction)
    param_leaves, treedef = jax.tree.flatten(params)
    moment_dtypes = [_moment_dtypes(p.dtype, mu_dtype, nu_dtype, path)
                     for path, p in jax.tree_util.tree_leaves_with_path(params)]
    if tiers_lib.DISK_KIND in kind_leaves:
      for p, k in zip(param_leaves, kind_leaves):
        if k == tiers_lib.DISK_KIND and len(placement._devices_of(p)) > 1:
          raise ValueError(
              "hybrid_adamw: the 'disk' tier needs single-device params (its ordered file callbacks "
              "cannot run in a multi-device computation); keep sharded params in 'host' or 'host_state'.")
      if not disk_store or disk_store[0].closed:
        disk_store[:] = [disk.DiskStore(nvme_offload_dir)]

    memory_kinds = [placement.HOST_KIND if k == tiers_lib.DISK_KIND else k for k in kind_leaves]
    zero = [None] * len(param_leaves)  # ZeRO-1: the state's sharding where it differs from the param's
    if shard_state_over is not None:
      zero = [tiers_lib.zero1_sharding(p, shard_state_over) if k != tiers_lib.DISK_KIND else None
              for p, k in zip(param_leaves, kind_leaves)]
      plan = dataclasses.replace(plan, param_shardings=tuple(
          None if z is None else p.sharding for p, z in zip(param_leaves, zero)))
    plan = dataclasses.replace(plan, state_shardings=tuple(
        tiers_lib.device_sharding_of(p, z) for p, z in zip(param_leaves, zero)))

    def moments(which):
      out = []
      for p, k, dts, z in zip(param_leaves, kind_leaves, moment_dtypes, zero):
        if z is not None:
          out.append(placement.placed_with(None, np.shape(p), dts[which], z.with_memory_kind(k),
                                           abstract=isinstance(p, jax.ShapeDtypeStruct)))
        elif k == tiers_lib.DISK_KIND:
          out.append(disk_store[0].create(np.shape(p), dts[which]))
        else:
          out.append(placement.zeros_placed(p, dts[which], k))
      return treedef.unflatten(out)

    mu, nu = moments(0), moments(1)
    master = None
    if master_dtype is not None:
      master = treedef.unflatten([
          None if not tiers_lib.master_needed(p.dtype, master_dtype)
          else placement.copy_placed(p, master_dtype, k) if z is None
          else placement.placed_with(p, np.shape(p), master_dtype, z.with_memory_kind(k),
                                     abstract=isinstance(p, jax.ShapeDtypeStruct))
          for p, k, z in zip(param_leaves, memory_kinds, zero)])
    state_leaves = jax.tree.leaves(mu) + jax.tree.leaves(nu)
    if not state_leaves:  # every moment on disk: the counter follows the params
      state_leaves = [p for p in param_leaves if getattr(p, "committed", False)]
    count = placement.step_counter_like(state_leaves)
    return HybridAdamState(count=count, mu=mu, nu=nu, skipped=placement.step_counter_like(state_leaves),
                           master=master, plan=plan)

  def step(updates, state, params, write_params):
    if not isinstance(state, HybridAdamState):
      raise TypeError(
          "hybrid_adamw: `state` must be the HybridAdamState made by this "
          f"optimizer's init, got {type(state).__name__}."
      )
    grad_leaves, treedef = jax.tree.flatten(updates)
    try:
      mu_leaves = treedef.flatten_up_to(state.mu)
      nu_leaves = treedef.flatten_up_to(state.nu)
    except (ValueError, TypeError) as e:
      raise ValueError(
          "hybrid_adamw: the gradients' tree structure does not match the "
          f"optimizer state's; gradients: {treedef}, state.mu: "
          f"{jax.tree.structure(state.mu)}. Pass gradients for the same params "
          "tree the state was initialized with."
      ) from e
    _check_inexact_leaves(updates, "gradient")
    for path, g, m in zip(treedef.flatten_up_to(_paths(treedef)), grad_leaves, mu_leaves):
      if isinstance(m, disk.DiskMoment):
        if disk_store and disk_store[0].closed:
          raise ValueError(f"hybrid_adamw: the disk-tier files of {path} were removed by tx.close(); "
                           "initialize a new state.")
        m = jax.ShapeDtypeStruct(m.shape, np.dtype(m.dtype))
      if np.shape(g) != np.shape(m):
        raise ValueError(
            f"hybrid_adamw: the gradient at {path} has shape {np.shape(g)} but its "
            f"optimizer state has shape {np.shape(m)}."
        )
      if jnp.issubdtype(g.dtype, jnp.complexfloating) != jnp.issubdtype(m.dtype, jnp.complexfloating):
        raise TypeError(
            f"hybrid_adamw: the gradient at {path} has dtype {g.dtype} but its "
            f"first moment has dtype {m.dtype}: complex params need complex "
            "gradients and real params real ones."
        )

    decays = [False] * len(grad_leaves)
    if not decay_is_static_zero:
      decays = _mask_leaves(mask, params, treedef)
    param_leaves: list = [None] * len(grad_leaves)
    if params is not None:
      try:
        param_leaves = treedef.flatten_up_to(params)
      except (ValueError, TypeError) as e:
        raise ValueError(
            "hybrid_adamw: `params` must have the tree structure of the "
            f"gradients; gradients: {treedef}, params: {jax.tree.structure(params)}."
        ) from e
    elif any(decays) or write_params:
      raise ValueError(
          "hybrid_adamw: weight_decay is non-zero, so `params` is required: call "
          "tx.update(grads, state, params)." if not write_params else
          "hybrid_adamw: tx.step(params, state, grads) needs `params`."
      )

    master_leaves = [None] * len(grad_leaves)
    if state.master is not None:
      try:
        master_leaves = treedef.flatten_up_to(state.master)
      except (ValueError, TypeError) as e:
        raise ValueError(
            "hybrid_adamw: the state's master weights do not match the gradients' tree structure; "
            "pass gradients for the params the state was initialized with.") from e
      if params is None and any(w is not None for w in master_leaves):
        raise ValueError(
            "hybrid_adamw: with master weights, `params` is required: call tx.update(grads, state, "
            "params) (the update is new_param - param).")
    plan = state.plan
    if plan is not None and len(plan.tiers) != len(grad_leaves):
      raise ValueError(
          f"hybrid_adamw: the state's placement plan has {len(plan.tiers)} leaves but the gradients "
          f"have {len(grad_leaves)}; pass gradients for the params the state was initialized with.")

    # Disk-tier moments: read before the update, written back after it.
    on_disk = [i for i, m in enumerate(mu_leaves) if isinstance(m, disk.DiskMoment)]
    stored = [mu_leaves[i] for i in on_disk] + [nu_leaves[i] for i in on_disk]
    if on_disk:
      loaded = disk.load_in_step(stored, after=state.count)
      mu_leaves, nu_leaves = list(mu_leaves), list(nu_leaves)
      for j, i in enumerate(on_disk):
        mu_leaves[i], nu_leaves[i] = loaded[j], loaded[len(on_disk) + j]

    count = state.count
    lr = learning_rate(count) if callable(learning_rate) else learning_rate
    step_ok = placement.all_finite(grad_leaves) if skip_nonfinite else None
    scalars = step_scalars(count, lr, b1, b2, eps, weight_decay, bias_correction, step_ok)
    if write_params:
      out_dtypes = [jnp.asarray(p).dtype for p in param_leaves]
    else:
      out_dtypes = [
          jnp.result_type(g.dtype, m.dtype, v.dtype) if w is None else w.dtype
          for g, m, v, w in zip(grad_leaves, mu_leaves, nu_leaves, master_leaves)
      ]
    new_updates, new_mu, new_nu, new_master = placement.run_placed_update(
        kernel_for(write_params),
        grad_leaves,
        mu_leaves,
        nu_leaves,
        param_leaves,
        decays,
        out_dtypes,
        scalars,
        adamw_mode=adamw_mode,
        write_params=write_params,
        masters=master_leaves,
        on_host=tiers_lib.host_leaves_mask(plan, len(grad_leaves)),
        shardings=None if plan is None else plan.state_shardings,
    )
    if plan is not None and plan.param_shardings is not None:
      # ZeRO-1: each device computed its shard of the update; gather it back
      # to the param's sharding (otherwise the sharding would leak into params).
      for i, sharding in enumerate(plan.param_shardings):
        if sharding is not None:
          new_updates[i] = placement.bring_back(new_updates[i], sharding)
    written = None
    if on_disk:
      written = disk.store_in_step(stored, [new_mu[i] for i in on_disk] + [new_nu[i] for i in on_disk])
      for j, i in enumerate(on_disk):
        new_mu[i], new_nu[i] = stored[j], stored[len(on_disk) + j]
    new_count, skipped = numerics.safe_increment(count), state.skipped
    if step_ok is not None:
      new_count = jnp.where(step_ok, new_count, count)
      skipped = jnp.where(step_ok, skipped, numerics.safe_increment(skipped))
    if written is not None:
      new_count = new_count + written  # the next step's read waits for this write
    new_state = HybridAdamState(
        count=new_count,
        mu=jax.tree.unflatten(treedef, new_mu),
        nu=jax.tree.unflatten(treedef, new_nu),
        skipped=skipped,
        master=None if state.master is None else treedef.unflatten(new_master),
        plan=plan,
    )
    return jax.tree.unflatten(treedef, new_updates), new_state

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    return step(updates, state, params, write_params=False)

  def fused_step(params, state, grads):
    return step(grads, state, params, write_params=True)

  def close():
    for store in disk_store:
      store.close()

  update_fn.fused_step = fused_step
  update_fn.close = close
  return HybridAdamW(init_fn, update_fn)


def scale_by_hybrid_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    bias_correction: bool = True,
    adamw_mode: bool = True,
    mask: MaskOrFn = None,
    mu_dtype: Any = None,
    nu_dtype: Any = None,
    state_memory_kind: placement.MemoryKindSpec = None,
    kernel: str = "auto",
    skip_nonfinite: bool = False,
    tiers: tiers_lib.TierSpec = None,
    offload_fraction: float | None = None,
    nvme_offload_fraction: float | None = None,
    nvme_offload_dir: Any = None,
    shard_state_over: str | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""The Adam direction, without the learning rate, for users who compose their own chain.

  Returns :math:`\hat m / (\sqrt{\hat v} + \epsilon)` plus, in AdamW mode,
  :math:`\lambda p` on masked leaves; so that
  ``optax.chain(scale_by_hybrid_adam(...), optax.scale_by_learning_rate(lr))``
  equals ``hybrid_adamw(lr, ...)``. Arguments are those of
  :func:`hybrid_adamw` (master weights need the learning rate inside the
  step, so ``master_dtype`` is only offered there).

  Example:
    >>> import optax, optax_hybrid
    >>> tx = optax.chain(
    ...     optax.clip_by_global_norm(1.0),
    ...     optax_hybrid.scale_by_hybrid_adam(b2=0.95),
    ...     optax.scale_by_learning_rate(3e-4))
  """
  tx = _hybrid_adam(
      -1.0,
      b1,
      b2,
      eps,
      weight_decay,
      bias_correction=bias_correction,
      adamw_mode=adamw_mode,
      mask=mask,
      mu_dtype=mu_dtype,
      nu_dtype=nu_dtype,
      state_memory_kind=state_memory_kind,
      kernel=kernel,
      skip_nonfinite=skip_nonfinite,
      tiers=tiers,
      offload_fraction=offload_fraction,
      nvme_offload_fraction=nvme_offload_fraction,
      nvme_offload_dir=nvme_offload_dir,
      shard_state_over=shard_state_over,
  )
  # A plain Optax transformation: the fused ``step`` applies a learning rate,
  # which this building block leaves to the chain (its internal rate is -1).
  return optax.GradientTransformationExtraArgs(tx.init, tx.update)


def hybrid_adamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    bias_correction: bool = True,
    adamw_mode: bool = True,
    mask: MaskOrFn = None,
    mu_dtype: Any = None,
    nu_dtype: Any = None,
    state_memory_kind: placement.MemoryKindSpec = None,
    kernel: str = "auto",
    skip_nonfinite: bool = False,
    weight_decay_mask: MaskOrFn = None,
    tiers: tiers_lib.TierSpec = None,
    offload_fraction: float | None = None,
    master_dtype: Any = None,
    nvme_offload_fraction: float | None = None,
    nvme_offload_dir: Any = None,
    shard_state_over: str | None = None,
) -> HybridAdamW:
  r"""AdamW as ColossalAI's HybridAdam and ``torch.optim.AdamW`` compute it, with placeable state.

  With :math:`t` the 1-based step, :math:`\eta_t` the learning rate and
  :math:`\lambda` the weight decay, each leaf's update is (float32 math
  whatever the parameter dtype):

  .. math::

    g_t &\leftarrow g_t + \lambda p_{t-1} \quad\text{(only if adamw\_mode=False)} \\
    m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t, \qquad
    v_t = \beta_2 v_{t-1} + (1 - \beta_2) g_t^2 \\
    u_t &= -\eta_t \left( \frac{m_t / (1 - \beta_1^t)}{\sqrt{v_t / (1 - \beta_2^t)} + \epsilon}
          + \lambda p_{t-1} \,\text{(only if adamw\_mode)} \right)

  ``adamw_mode=True`` is ``torch.optim.AdamW`` (decay decoupled and scaled by
  the current learning rate); ``adamw_mode=False`` is
  ``torch.optim.Adam(weight_decay=...)`` (L2 decay added to the gradient);
  ``bias_correction=False`` drops both :math:`1 - \beta^t` factors.

  The moments can live in host memory (``state_memory_kind="pinned_host"``):
  inside ``update`` they are moved to the device, updated by the fused step
  and moved back, so a jitted train step keeps them in host memory between
  steps. Parameters that live in host memory are updated on the host (XLA host
  compute); use :func:`optax_hybrid.apply_updates` to apply the updates.

  Args:
    learning_rate: a float ``>= 0`` or an Optax schedule of the step count.
    b1: decay of the first moment, in ``[0, 1)``.
    b2: decay of the second moment, in ``[0, 1)``.
    eps: added to the denominator, outside the square root; ``>= 0``.
    weight_decay: decay coefficient :math:`\lambda`; ``>= 0``.
    bias_correction: divide the moments by :math:`1 - \beta^t`.
    adamw_mode: decoupled decay (True) or L2 decay through the gradient (False).
    mask: which leaves take weight decay: a tree of bools with the structure
      of the params (or a prefix of it), or a callable ``params -> tree``.
      ``None``: every leaf.
    mu_dtype: dtype of the first moments; ``None``: the param's dtype.
    nu_dtype: dtype of the second moments; ``None``: the param's dtype (its
      real counterpart for complex params, whose second moment is real).
    state_memory_kind: where the moments live: ``None`` (beside each param),
      ``"device"``, ``"pinned_host"``, or a callable ``(path, param) -> kind``
      choosing per leaf (returning ``None`` for "beside the param").
    kernel: ``"auto"`` (the fastest measured: on a GPU the Pallas kernel; on a
      CPU the native kernel for ``tx.step`` and XLA for ``update``), ``"xla"``
      (one fused XLA loop per leaf), ``"native"`` (the compiled CPU kernel: one
      custom call for all CPU-resident leaves), ``"pallas"`` (the fused Pallas
      GPU kernel: one launch per 64 device-resident leaves; interpret mode off
      the GPU, for tests).
    skip_nonfinite: skip a step whose gradients hold a NaN or an infinity:
      zero updates, moments and ``count`` unchanged, ``state.skipped``
      incremented. Costs one reduction over the gradients, no extra pass over
      the moments (the choice is made inside the fused step).
    weight_decay_mask: alias of ``mask``, as ``optax.adamw`` names it.
    tiers: where each leaf's state lives and where its update runs, instead
      of ``state_memory_kind``: ``"device"``, ``"host_state"`` (moments in
      ``pinned_host``, updated on the device), ``"host"`` (moments and
      master in ``pinned_host``, updated on the host CPU: the gradient moves
      to the host, only the new param moves back) or ``"disk"`` (moments in
      files under ``nvme_offload_dir``, read and written around each step).
      A tier name, a callable ``(path, param) -> tier or None``, or a tree of
      tier names shaped like the params (or a prefix of it). See
      :mod:`optax_hybrid.tiers`.
    offload_fraction: move this fraction of the params, by size, to the
      ``"host"`` tier, the rest updating on the device at the same time (like
      Twin-Flow's ratio). Leaves are taken in ``jax.tree.leaves`` order, each
      one when at least half of it falls within the fraction
      (:func:`optax_hybrid.tiers.pick_by_fraction`).
    nvme_offload_fraction: move this fraction of the params, by size, to the
      ``"disk"`` tier (chosen first, the same way), as HybridAdam's
      ``nvme_offload_fraction``. Single-device params only.
    nvme_offload_dir: the directory for the disk tier's files (it must exist
      and be writable: checked here); ``None``: a new temporary directory.
      Files are owner-only, never followed through symlinks, and removed by
      ``tx.close()`` or at exit. See :mod:`optax_hybrid.disk`.
    shard_state_over: ZeRO-1: a mesh axis name (e.g. ``"data"``) over which
      the optimizer state (moments and master) is split even where the params
      are replicated: each leaf's first dimension that its param leaves
      unsharded and that the axis divides is split over it
      (:func:`optax_hybrid.tiers.zero1_sharding`). Each device then updates
      its shard and the update is gathered back to the param's sharding.
      Params must be placed with a ``NamedSharding`` on a mesh with that axis.
    master_dtype: keep a master copy in this dtype (e.g. ``jnp.float32``) for
      each lower-precision param (bf16, fp16), placed with its moments. The
      step is computed against the master; the new param is the new master
      rounded to the param's dtype (``tx.step``), and ``update`` returns, in
      the master's dtype, the difference that makes ``apply_updates`` land
      exactly on it. Small steps then accumulate instead of rounding away.

  All numeric hyperparameters may be traced, so
  ``optax.inject_hyperparams(hybrid_adamw)(...)`` works and changing an
  injected value does not recompile (pass ``hyperparam_dtype=jnp.float32``
  there for low-precision params: Optax otherwise casts the injected betas to
  the params' dtype).

  Returns:
    A :class:`HybridAdamW`: an ``optax.GradientTransformationExtraArgs`` whose
    state is a :class:`HybridAdamState`, with the fused ``step`` method.

  Raises:
    ValueError: for a hyperparameter out of range, an unknown memory kind or
      kernel, or a memory kind the backend does not have.
    TypeError: for arguments of the wrong type.

  Example:
    >>> import jax, jax.numpy as jnp, optax_hybrid
    >>> params = {"w": jnp.ones((3,))}
    >>> tx = optax_hybrid.hybrid_adamw(
    ...     optax_hybrid.warmup_cosine_schedule(1e-3, total_steps=1000, warmup_steps=30),
    ...     weight_decay=0.1, state_memory_kind="pinned_host")
    >>> state = tx.init(params)
    >>> state.mu["w"].sharding.memory_kind
    'pinned_host'
    >>> updates, state = tx.update({"w": jnp.ones((3,))}, state, params)
    >>> params = optax_hybrid.apply_updates(params, updates)
  """
  if weight_decay_mask is not None:
    if mask is not None:
      raise ValueError(
          "hybrid_adamw: pass either `mask` or its alias `weight_decay_mask`, not both."
      )
    mask = weight_decay_mask
  _check_learning_rate(learning_rate)
  return _hybrid_adam(
      learning_rate,
      b1,
      b2,
      eps,
      weight_decay,
      bias_correction=bias_correction,
      adamw_mode=adamw_mode,
      mask=mask,
      mu_dtype=mu_dtype,
      nu_dtype=nu_dtype,
      state_memory_kind=state_memory_kind,
      kernel=kernel,
      skip_nonfinite=skip_nonfinite,
      tiers=tiers,
      offload_fraction=offload_fraction,
      master_dtype=master_dtype,
      nvme_offload_fraction=nvme_offload_fraction,
      nvme_offload_dir=nvme_offload_dir,
      shard_state_over=shard_state_over,
  )
