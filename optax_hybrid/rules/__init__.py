"""The update rules, one file each: what an optimizer computes for one leaf.

* :mod:`optax_hybrid.rules.adamw`: :class:`AdamW` (``hybrid_adamw``,
  ``scale_by_hybrid_adam``, ``HybridAdamState``);
* :mod:`optax_hybrid.rules.lion`: :class:`Lion` (``hybrid_lion``, ``HybridLionState``);
* :mod:`optax_hybrid.rules.adagrad`: :class:`Adagrad` (``hybrid_adagrad``, ``HybridAdagradState``);
* :mod:`optax_hybrid.rules.sgd`: :class:`Sgd` (``hybrid_sgd``, ``HybridSgdState``).

Each is an :class:`optax_hybrid.base.UpdateRule` (the contract the engine
runs, kept below it in :mod:`optax_hybrid.base`) with its state type and its
``hybrid_<name>`` function, made with :func:`optax_hybrid.transform.optimizer`
and exported from :mod:`optax_hybrid`. Adding a rule is one file here and its
exports: see ``rules/adagrad.py``.
"""

from optax_hybrid.rules.adagrad import Adagrad
from optax_hybrid.rules.adamw import AdamW
from optax_hybrid.rules.lion import Lion
from optax_hybrid.rules.sgd import Sgd

__all__ = ["Adagrad", "AdamW", "Lion", "Sgd"]
