"""A state layout is a value the engine asks (optax_hybrid.layouts): init lays it out, the steps read and write
through it, and nothing else looks at ``state_layout``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_hybrid
from optax_hybrid import layouts, packing, transform


@dataclasses.dataclass(frozen=True)
class Counting(layouts.LeavesLayout):
  """The leaves layout, counting what the engine asks of it (a mutable list: shared by the copies init makes)."""

  name: str = "counting leaves"
  asked: list = dataclasses.field(default_factory=list, compare=False, hash=False)

  def laid_out(self, plan, params, attributes):
    self.asked.append("laid_out")
    return self

  def read(self, state, plan, treedef):
    self.asked.append("read")
    return super().read(state, plan, treedef)

  def written(self, state, plan, treedef, new):
    self.asked.append("written")
    return super().written(state, plan, treedef, new)


def params_and_grads():
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(4, 8)), jnp.float32), "b": jnp.asarray(rng.normal(size=8), jnp.float32)}
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
  return params, grads


def test_the_engine_reads_and_writes_the_state_through_its_layout(monkeypatch):
  layout = Counting()
  monkeypatch.setitem(transform._LAYOUTS, "leaves", layout)
  params, grads = params_and_grads()
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1)
  state = tx.init(params)
  assert state.plan.layout is layout and layout.asked == ["laid_out"]
  new_params, state = jax.jit(tx.step)(params, state, grads)
  assert layout.asked == ["laid_out", "read", "written"]
  # The same numbers as optax.adamw's (the layout changes where the values are kept, not what they are).
  opt = optax.adamw(1e-2, weight_decay=0.1)
  updates, _ = opt.update(grads, opt.init(params), params)
  want = optax.apply_updates(params, updates)
  for k in params:
    np.testing.assert_allclose(new_params[k], want[k], rtol=1e-6, atol=1e-7)
  mu, nu = optax_hybrid.moment_values(state)
  assert jax.tree.structure(mu) == jax.tree.structure(params)
  assert layout.asked[-1] == "read"  # moment_values reads through the layout too


def test_each_layout_is_one_value_and_the_plan_holds_the_one_laid_out():
  params, grads = params_and_grads()
  leaves = optax_hybrid.hybrid_adamw(1e-2).init(params)
  assert leaves.plan.layout is layouts.LEAVES and not layouts.LEAVES.packed
  packed = optax_hybrid.hybrid_adamw(1e-2, state_layout="packed").init(params)
  assert isinstance(packed.plan.layout, packing.Layout) and packed.plan.layout.packed
  assert packed.plan.layout is not packing.PACKED  # laid out for these params: their tree and slots
  assert packed.plan.layout.treedef == jax.tree.structure(params)
  assert set(packed.mu) == {"float32"} and packed.mu["float32"].shape == (40,)
  tx = optax_hybrid.hybrid_adamw(1e-2, state_layout="packed")
  with pytest.raises(ValueError, match="tree structure does not match"):
    tx.update({"w": grads["w"]}, packed, {"w": params["w"]})
