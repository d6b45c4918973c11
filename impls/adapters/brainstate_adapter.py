"""Adapter: ``brainstate.nn.clip_grad_norm`` (global p-norm clipping of a gradient pytree).

Library call, as a brainstate user writes it::

  clipped, total_norm = brainstate.nn.clip_grad_norm(grads, max_norm, norm_type=p,
                                                     return_norm=True)

Scale formula (brainstate 0.6.0, ``brainstate/nn/_utils.py``, measured)::

  total = jnp.linalg.norm(jnp.concatenate([g.ravel() for g in leaves]), ord=p)
  out   = g * minimum(1.0, max_norm / (total + 1e-6))

The epsilon is an absolute ``1e-6`` in every dtype; every element is multiplied, also when the
factor is 1. The concatenation promotes mixed leaf dtypes to one, so the norm (and every output
leaf) takes the promoted dtype. An empty tree returns ``(tree, 0.0)``. Any p is passed through
(``jnp.linalg.norm`` decides: p >= 1, +-inf, but also p < 1, which the library does not refuse).
jit, vmap and grad run through it unchanged (checked with jax 0.12).
"""

from __future__ import annotations

from typing import Any, Sequence

import brainstate

from clipbench.impls.adapters import _common, _jax_common
from clipbench.protocol import ANY_NORM_TYPE

_LIBRARY = "brainstate.nn.clip_grad_norm"


class BrainstateClipGradNorm:
  """``brainstate.nn.clip_grad_norm(..., return_norm=True)`` on a list of leaves."""

  framework = "jax"
  library = "brainstate"
  description = "brainstate.nn.clip_grad_norm(leaves, max_norm, norm_type=p, return_norm=True)"
  capabilities = _jax_common.capabilities(norm_types=ANY_NORM_TYPE)

  # The library call a bug report would show (the suite's reproducer appends it).
  reproducer = ("import brainstate\nimport jax.numpy as jnp\n"
                "out, norm = brainstate.nn.clip_grad_norm([jnp.asarray(x) for x in leaves], "
                "threshold, norm_type=norm_type, return_norm=True)\nprint(out, norm)")

  def clip_grad_norm(self, leaves: Sequence[Any], max_norm: Any, *, norm_type: float = 2.0,
                     nonfinite: str = "propagate") -> tuple[list[Any], Any]:
    _common.require_mode(nonfinite, ("propagate",), _LIBRARY)
    clipped, total_norm = brainstate.nn.clip_grad_norm(
        list(leaves), max_norm, norm_type=norm_type, return_norm=True)
    return list(clipped), total_norm


clip_grad_norm = BrainstateClipGradNorm()
