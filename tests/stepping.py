"""Small drivers the tests share: random trees, a few optimizer steps, the inject_hyperparams loop."""

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_hybrid

def placed_params(shapes, dtype=jnp.float32, seed=0):
  """Normal random params of ``shapes`` (a dict), committed to the first device."""
  rng = np.random.default_rng(seed)
  return jax.device_put({k: jnp.asarray(rng.normal(size=s), dtype) for k, s in shapes.items()}, jax.devices()[0])


def grads_like(params, n, seed=1):
  """``n`` normal random gradient trees shaped and typed like ``params``."""
  rng = np.random.default_rng(seed)
  return [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params) for _ in range(n)]


def run_steps(tx, params, grads, fused=True, state=None):
  """Jitted steps over ``grads``: the fused ``tx.step``, or update + ``optax_hybrid.apply_updates``."""
  state = tx.init(params) if state is None else state
  if fused:
    step = jax.jit(tx.step)
  else:
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax_hybrid.apply_updates(p, u), s))(*tx.update(g, s, p)))
  for g in grads:
    params, state = step(params, state, g)
  return params, state


def run_with_injected_hyperparams(kernel, params, grads, vary):
  """``hybrid_adamw(kernel=...)`` under ``optax.inject_hyperparams``, ``vary(i)`` giving step i's values.

  Returns the final params and the jitted update (for its cache size and lowering).
  """
  tx = optax.inject_hyperparams(optax_hybrid.hybrid_adamw, static_args=("kernel",))(
      learning_rate=1e-2, weight_decay=0.1, kernel=kernel)
  update = jax.jit(tx.update)
  p, s = params, tx.init(params)
  for i, g in enumerate(grads):
    for name, value in vary(i).items():
      s.hyperparams[name] = jnp.asarray(value, jnp.float32)
    u, s = update(g, s, p)
    p = optax_hybrid.apply_updates(p, u)
  return p, update, s


def random_leaves(sizes, pdtype, mdtype, seed=0):
  """Lists (grads, mus, nus, params) of ``sizes``: params/grads in ``pdtype``, moments in ``mdtype``, v >= 0."""
  rng = np.random.default_rng(seed)
  g = [jnp.asarray(rng.normal(size=s), pdtype) for s in sizes]
  m = [jnp.asarray(rng.normal(size=s) * 0.1, mdtype) for s in sizes]
  v = [jnp.asarray(np.abs(rng.normal(size=s)) * 0.01, mdtype) for s in sizes]
  p = [jnp.asarray(rng.normal(size=s), pdtype) for s in sizes]
  return g, m, v, p


def kernel_and_reference(kernel, sizes, pdtype, mdtype, *, adamw_mode, write_params, step_ok=None,
                         bias_correction=True):
  """One jitted step of ``kernel`` and of the reference rule on the same random leaves (every other one decayed).

  Returns ``(kernel's outputs, reference's outputs, (g, m, v, p))``.
  """
  from optax_hybrid.kernels import reference
  g, m, v, p = random_leaves(sizes, pdtype, mdtype)
  decays = [i % 2 == 0 for i in range(len(sizes))]
  out_dtypes = [x.dtype for x in p] if write_params else [jnp.result_type(a.dtype, b.dtype) for a, b in zip(g, m)]
  ok = None if step_ok is None else jnp.asarray(step_ok)
  s = adam_scalars(jnp.int32(4), 3e-2, 0.9, 0.99, 1e-6, 0.1, bias_correction, ok)

  def run(k):
    return jax.jit(lambda g, m, v, p: call_kernel(k, g, m, v, p, decays, out_dtypes, s, adamw_mode=adamw_mode,
                                                  write_params=write_params))(g, m, v, p)

  return run(kernel), run(reference.update_leaves), (g, m, v, p)


def adam_scalars(count, learning_rate, b1, b2, eps, weight_decay, bias_correction, step_ok=None):
  """AdamW's per-step scalars for the update after ``count`` earlier ones (the rule's own ``scalars``)."""
  from optax_hybrid.rules.adamw import AdamW
  rule = AdamW(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
  return rule.scalars(count, learning_rate, step_ok)


def call_kernel(kernel, g, m, v, p, decays, out_dtypes, s, *, adamw_mode, write_params=False, **kwargs):
  """An AdamW kernel on parallel lists, through the kernel contract: returns ``(firsts, new_mus, new_nus)``.

  Params are passed to the kernel only where it reads them (decay or ``write_params``), as the step does.
  """
  from optax_hybrid import moments
  from optax_hybrid.kernels import LeafFacts, LeafOperands, quantized, step_of
  from optax_hybrid.rules.adamw import AdamW
  leaves = [LeafOperands(gi, (mi, vi), pi if (d or write_params) else None)
            for gi, mi, vi, pi, d in zip(g, m, v, p, decays)]
  # A leaf's moment format, as init gives it: 8-bit for codes and scales, else the values as stored.
  format_of = lambda mi: moments.BLOCKWISE_8BIT if isinstance(mi, quantized.QuantizedMoment) else moments.AS_STORED
  facts = [LeafFacts(d, dt, moments=format_of(mi)) for d, dt, mi in zip(decays, out_dtypes, m)]
  results = kernel(leaves, facts, s, step_of(AdamW(adamw_mode=adamw_mode), write_params), **kwargs)
  return [r.first for r in results], [r.state[0] for r in results], [r.state[1] for r in results]


def isas_this_cpu_runs():
  """The instruction sets the built native library has for this CPU, widest first, as the library itself finds them
  (its ``OptaxHybridIsasThisCpuRuns``); empty when the library is not built."""
  from optax_hybrid.kernels import native_cpu
  path = native_cpu._library_path()
  if path is None:
    return ()
  found = ctypes.CDLL(path).OptaxHybridIsasThisCpuRuns
  found.restype, found.argtypes = ctypes.c_char_p, []
  return tuple(found().decode().split())
