"""Models written the way their users write them, for compiling whole train steps (GPU-compile checks, benchmarks).

Each model is a :class:`Model`: abstract params (``jax.ShapeDtypeStruct`` s
committed to the first device, as a placed model's would be), an abstract
batch, and ``loss(params, batch)``. Nothing is allocated: the params come from
the framework's own init under ``jax.eval_shape``.

* ``linen_tied`` / ``linen_untied``: Flax Linen, ``nn.Embed``, ``nn.LayerNorm``
  and ``nn.Dense`` layers (kernels ``(in, out)``); the output head is the
  embedding (``Embed.attend``) or an ``nn.Dense`` of its own (``(D, V)`` used
  as ``x @ kernel``: the layout that once broke the host tier's compile).
* ``nnx_cnn``: Flax NNX, ``nnx.Conv`` (kernels ``HWIO``), ``nnx.Linear`` and
  ``nnx.Embed`` (a class embedding added to the features), not scanned.
* ``llama``: a Llama-style decoder (RMSNorm, RoPE, causal attention, SwiGLU,
  untied ``(D, V)`` head), its layers' params stacked on a leading axis and
  run by ``jax.lax.scan`` over a ``jax.checkpoint`` ed layer.
* ``odd``: leaves used transposed (``x @ w.T``), a scalar and 1-D leaves, and
  dimensions that are multiples of neither 8 nor 128.

``make(name, **sizes)`` builds one; :data:`MODELS` lists the names.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Model:
  """A model to compile: abstract params and batch, and its loss."""

  name: str
  params: Any
  batch: Any
  loss: Callable[[Any, Any], jax.Array]

  @property
  def num_params(self) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(self.params))


def placed(tree: Any, memory_kind: str = "device", named: bool = True) -> Any:
  """ShapeDtypeStructs committed to the first device (as a real, placed model's would be), in ``memory_kind``.

  Host memory is named by a ``NamedSharding`` on a one-device mesh: JAX 0.10
  traces a ``ShapeDtypeStruct`` whose ``SingleDeviceSharding`` says
  ``pinned_host`` as a device value, and a ``NamedSharding`` one as a host
  value, as it does real arrays placed there (``named=False``: the
  ``SingleDeviceSharding`` anyway, to show what that compiles).
  """
  if memory_kind == "device":
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  elif not named:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=memory_kind)
  else:
    mesh = jax.make_mesh((1,), ("one",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=memory_kind)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def _tokens(batch: int, seq: int) -> dict:
  ints = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  return placed({"inputs": ints, "targets": ints})


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


# --- Flax Linen ------------------------------------------------------------------------


def linen(tied: bool, dtype: Any = jnp.float32, vocab: int = 1000, width: int = 256, depth: int = 2,
          batch: int = 4, seq: int = 64) -> Model:
  """An embedding, ``depth`` pre-LayerNorm MLP blocks of ``nn.Dense``, and a tied or untied output head."""
  from flax import linen as nn

  class Net(nn.Module):

    @nn.compact
    def __call__(self, tokens):
      embed = nn.Embed(vocab, width, param_dtype=dtype, dtype=dtype)
      x = embed(tokens)
      for _ in range(depth):
        h = nn.LayerNorm(param_dtype=dtype, dtype=dtype)(x)
        x = x + nn.Dense(width, param_dtype=dtype, dtype=dtype)(nn.gelu(nn.Dense(4 * width, param_dtype=dtype,
                                                                                 dtype=dtype)(h)))
      x = nn.LayerNorm(param_dtype=dtype, dtype=dtype)(x)
      return embed.attend(x) if tied else nn.Dense(vocab, use_bias=False, param_dtype=dtype, dtype=dtype)(x)

  net = Net()
  data = _tokens(batch, seq)
  params = placed(jax.eval_shape(net.init, jax.random.key(0), data["inputs"])["params"])
  loss = lambda p, b: _cross_entropy(net.apply({"params": p}, b["inputs"]), b["targets"])
  return Model(f"linen_{'tied' if tied else 'untied'}", params, data, loss)


# --- Flax NNX --------------------------------------------------------------------------


def nnx_cnn(dtype: Any = jnp.float32, classes: int = 10, channels: int = 32, image: int = 28,
            batch: int = 8) -> Model:
  """A small CNN: two ``nnx.Conv`` (HWIO kernels), a class ``nnx.Embed`` added to the features, ``nnx.Linear`` s."""
  from flax import nnx

  class CNN(nnx.Module):

    def __init__(self, rngs):
      self.conv1 = nnx.Conv(3, channels, (3, 3), param_dtype=dtype, dtype=dtype, rngs=rngs)
      self.conv2 = nnx.Conv(channels, 2 * channels, (3, 3), strides=2, param_dtype=dtype, dtype=dtype, rngs=rngs)
      self.hint = nnx.Embed(classes, 2 * channels, param_dtype=dtype, dtype=dtype, rngs=rngs)
      self.hidden = nnx.Linear(2 * channels, 4 * channels, param_dtype=dtype, dtype=dtype, rngs=rngs)
      self.out = nnx.Linear(4 * channels, classes, param_dtype=dtype, dtype=dtype, rngs=rngs)

    def __call__(self, images, hints):
      x = nnx.relu(self.conv2(nnx.relu(self.conv1(images))))
      x = x.mean(axis=(1, 2)) + self.hint(hints)
      return self.out(nnx.relu(self.hidden(x)))

  graphdef, state = nnx.split(nnx.eval_shape(lambda: CNN(nnx.Rngs(0))))
  params = placed(state)
  data = placed({"images": jax.ShapeDtypeStruct((batch, image, image, 3), dtype),
                 "hints": jax.ShapeDtypeStruct((batch,), jnp.int32),
                 "labels": jax.ShapeDtypeStruct((batch,), jnp.int32)})

  def loss(p, b):
    logits = nnx.merge(graphdef, p)(b["images"], b["hints"])
    return _cross_entropy(logits, b["labels"])

  return Model("nnx_cnn", params, data, loss)


# --- A Llama-style decoder, layers stacked and scanned -------------------------------------


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  layers: int = 2
  width: int = 256
  heads: int = 4
  ffn: int = 688
  vocab: int = 1000
  seq: int = 64
  batch: int = 2

  @property
  def head_dim(self) -> int:
    return self.width // self.heads


def llama_params(cfg: LlamaConfig, dtype: Any, layers_memory_kind: str = "device", named: bool = True) -> dict:
  """Abstract params: token embedding ``(V, D)``, layers stacked on axis 0 (in ``layers_memory_kind``), head ``(D, V)``."""
  L, d, f = cfg.layers, cfg.width, cfg.ffn
  s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
  layers = {"attn_norm": s(L, d), "wq": s(L, d, d), "wk": s(L, d, d), "wv": s(L, d, d), "wo": s(L, d, d),
            "mlp_norm": s(L, d), "w_gate": s(L, d, f), "w_up": s(L, d, f), "w_down": s(L, f, d)}
  return {**placed({"embed": s(cfg.vocab, d), "final_norm": s(d), "head": s(d, cfg.vocab)}),
          "layers": placed(layers, layers_memory_kind, named)}


# FSDP over a mesh axis "fsdp": every matrix of the decoder split on its width axis D (w_down is (L, F, D)),
# the norms' scales too; the batch split over its first axis.
FSDP_SPECS = {"embed": P(None, "fsdp"), "head": P("fsdp", None), "final_norm": P("fsdp"), "attn_norm": P(None, "fsdp"),
              "mlp_norm": P(None, "fsdp"), "w_down": P(None, None, "fsdp")}
FSDP_STACKED = P(None, "fsdp", None)  # the other stacked (L, D, F) matrices


def fsdp_placed(params: Any, batch: Any, mesh: Any, layers_memory_kind: str = "device",
                specs: dict | None = None) -> tuple[Any, Any]:
  """The decoder's params and batch as ``ShapeDtypeStruct`` s split over ``mesh`` as FSDP code splits them.

  Each matrix is split on its width axis (:data:`FSDP_SPECS`, updated by
  ``specs``), the stacked layers in ``layers_memory_kind``, the batch on its
  first axis.
  """
  specs = {**FSDP_SPECS, **(specs or {})}

  def one(path, x):
    kind = layers_memory_kind if path[0].key == "layers" else "device"
    spec = specs.get(path[-1].key, FSDP_STACKED)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, spec, memory_kind=kind))
  split = jax.sharding.NamedSharding(mesh, P("fsdp"))
  return (jax.tree_util.tree_map_with_path(one, params),
          jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=split), batch))


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + 1e-6)).astype(x.dtype) * scale


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
  """Rotary position embedding over the last axis (pairs of halves)."""
  half = x.shape[-1] // 2
  freqs = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions[:, None].astype(jnp.float32) * freqs  # (T, half)
  cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


def llama_layer(cfg: LlamaConfig, x: jax.Array, p: dict, positions: jax.Array) -> jax.Array:
  """One decoder layer: pre-RMSNorm causal attention with RoPE, then a pre-RMSNorm SwiGLU MLP."""
  b, t, d = x.shape
  h = rms_norm(x, p["attn_norm"])
  split = lambda w: (h @ w).reshape(b, t, cfg.heads, cfg.head_dim)
  q, k, v = rope(split(p["wq"]), positions), rope(split(p["wk"]), positions), split(p["wv"])
  scores = jnp.einsum("bqhc,bkhc->bhqk", q, k).astype(jnp.float32) / math.sqrt(cfg.head_dim)
  scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(jnp.float32).min)
  attn = jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(scores, -1).astype(x.dtype), v).reshape(b, t, d)
  x = x + attn @ p["wo"]
  h = rms_norm(x, p["mlp_norm"])
  return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def llama_parts(cfg: LlamaConfig, activations: Any = None) -> tuple[Callable, Callable, Callable]:
  """The decoder as ``optax_hybrid.step_in_backward`` takes it: ``embed(rest, batch)``, ``layer(x, p, rest, batch)``,
  ``head(rest, x, batch)`` (the mean cross-entropy); ``rest`` is the params without ``"layers"``.

  ``activations``: a sharding the activations between layers are constrained to (FSDP code splits them
  over the batch, ``NamedSharding(mesh, P("fsdp"))``, as MaxText does); None: XLA chooses.
  """
  keep = (lambda x: x) if activations is None else (lambda x: jax.lax.with_sharding_constraint(x, activations))
  embed = lambda rest, batch: keep(rest["embed"][batch["inputs"]])
  layer = lambda x, p, rest, batch: keep(llama_layer(cfg, x, p, jnp.arange(batch["inputs"].shape[1])))
  head = lambda rest, x, batch: _cross_entropy(rms_norm(x, rest["final_norm"]) @ rest["head"], batch["targets"])
  return embed, layer, head


def donation_ordered(step: Callable) -> Callable:
  """``optax_hybrid.step_in_backward``'s step as ``(params, state, *batch) -> (params, state, loss)``.

  The step returns its results in the donated arguments' order (JAX pairs
  donated arguments with results of the same shape and dtype in order: with
  the state first among the results, the donated bf16 params would pair with
  same-shaped state, a Kahan term, and XLA would copy both). What is left
  here: one batch argument is passed as it is, several as a tuple.
  """
  def train_step(params, state, *batch):
    return step(params, state, batch[0] if len(batch) == 1 else batch)
  return train_step


def llama_loss(cfg: LlamaConfig, params: dict, batch: dict, stream: Any = False,
               offload_carries: bool = False, activations: Any = None) -> jax.Array:
  """The mean cross-entropy; the layers run by ``jax.lax.scan`` over a checkpointed layer (``stream=False``),
  the same with each layer moved to the device in the body (``"device_put"``), or by ``scan_layers`` (True);
  ``activations`` as for :func:`llama_parts`."""
  embed, layer, head = llama_parts(cfg, activations)
  x = embed(params, batch)
  if stream == "device_put":  # the obvious route: each layer moved to the device inside a plain scan
    to_device = lambda p: jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), p)
    body = jax.checkpoint(lambda x, p: (layer(x, to_device(p), params, batch), None))
    x, _ = jax.lax.scan(body, x, params["layers"])
  elif stream:
    import optax_hybrid
    x = optax_hybrid.scan_layers(layer, x, params["layers"], args=(params, batch),
                                 offload_carries=offload_carries)
  else:
    body = jax.checkpoint(lambda x, p: (layer(x, p, params, batch), None))
    x, _ = jax.lax.scan(body, x, params["layers"])
  return head(params, x, batch)


def llama(dtype: Any = jnp.bfloat16, *, stream: Any = False, offload_carries: bool = False,
          layers_memory_kind: str = "device", named: bool = True, **config: Any) -> Model:
  """The Llama-style decoder; ``stream``: its layers run by ``optax_hybrid.scan_layers`` (from ``layers_memory_kind``)."""
  cfg = LlamaConfig(**config)
  return Model("llama", llama_params(cfg, dtype, layers_memory_kind, named), _tokens(cfg.batch, cfg.seq),
               lambda p, b: llama_loss(cfg, p, b, stream, offload_carries))


# --- Transposed uses, scalars, odd sizes -------------------------------------------------


def odd(dtype: Any = jnp.float32, batch: int = 5) -> Model:
  """Leaves used transposed, a scalar, 1-D leaves, sizes that are multiples of neither 8 nor 128."""
  s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
  params = placed({"w_in": s(301, 37), "b_in": s(301), "w_mid": s(77, 301), "w_out": s(13, 77),
                   "scale": s(), "b_out": s(13)})
  data = placed({"x": s(batch, 37), "y": s(batch, 13)})

  def loss(p, b):
    h = jnp.tanh(b["x"] @ p["w_in"].T + p["b_in"])
    h = jax.nn.gelu(h @ p["w_mid"].T) * p["scale"]
    return jnp.mean((h @ p["w_out"].T + p["b_out"] - b["y"]).astype(jnp.float32) ** 2)

  return Model("odd", params, data, loss)


MODELS = {
    "linen_tied": lambda dtype, **kw: linen(True, dtype, **kw),
    "linen_untied": lambda dtype, **kw: linen(False, dtype, **kw),
    "nnx_cnn": nnx_cnn,
    "llama": llama,
    "odd": odd,
}


def make(name: str, dtype: Any = jnp.float32, **sizes: Any) -> Model:
  """The model ``name`` (one of :data:`MODELS`) with params in ``dtype``."""
  if name not in MODELS:
    raise ValueError(f"`name` must be one of {sorted(MODELS)}; got {name!r}.")
  return MODELS[name](dtype, **sizes)
