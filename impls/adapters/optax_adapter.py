"""Adapter: ``optax.clip_by_global_norm`` (a global L2 clipping gradient transformation).

Library call, as an optax user writes it::

  tx = optax.clip_by_global_norm(max_norm)
  updates, _ = tx.update(updates, tx.init(updates))

Scale formula (optax 0.2.8, ``optax/transforms/_clipping.py``, measured)::

  g   = optax.tree.norm(updates)          # sqrt of the left-to-right sum of per-leaf sums of
                                          # squares; computed and returned in the leaf dtype
  out = select(g < max_norm, t, (t / g.astype(t.dtype)) * max_norm)

No epsilon; the input is returned untouched when ``g < max_norm``, otherwise every element is
divided by ``g`` and then multiplied by ``max_norm`` (two roundings). optax does not return the
norm: the adapter returns ``None`` for it (``returns_norm=False``) rather than recomputing one.
Only the L2 norm and non-finite propagation exist in the API. jit, vmap (over a leading batch
axis of the leaves) and grad run through ``update`` unchanged (checked with jax 0.12).
"""

from __future__ import annotations

from typing import Any, Sequence

import optax

from clipbench.impls.adapters import _common, _jax_common

_LIBRARY = "optax.clip_by_global_norm"


class OptaxClipByGlobalNorm:
  """``optax.clip_by_global_norm(max_norm)`` applied with ``init`` + ``update``."""

  framework = "jax"
  library = "optax"
  description = "optax.clip_by_global_norm(max_norm).update(leaves, init(leaves))"
  capabilities = _jax_common.capabilities(returns_norm=False)

  # The library call a bug report would show (the suite's reproducer appends it).
  reproducer = ("import jax.numpy as jnp\nimport optax\n"
                "updates = [jnp.asarray(x) for x in leaves]\n"
                "tx = optax.clip_by_global_norm(threshold)\n"
                "out, _ = tx.update(updates, tx.init(updates))\nprint(out)")

  def clip_grad_norm(self, leaves: Sequence[Any], max_norm: Any, *, norm_type: float = 2.0,
                     nonfinite: str = "propagate") -> tuple[list[Any], None]:
    _common.require_l2_propagate(norm_type, nonfinite, _LIBRARY)
    updates = list(leaves)
    tx = optax.clip_by_global_norm(max_norm)
    clipped, _ = tx.update(updates, tx.init(updates))
    return list(clipped), None


clip_by_global_norm = OptaxClipByGlobalNorm()
