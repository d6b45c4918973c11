"""Adapter: ``jax_privacy.clipping.clip_pytree`` (global L2 clipping with formal guarantees).

Library call, as a jax_privacy user writes it::

  clipped, l2_norm = jax_privacy.clipping.clip_pytree(tree, clip_norm, nan_safe=...)

Scale formula (jax-privacy 2.0.0, ``jax_privacy/clipping.py``, measured)::

  if clip_norm is a Python/numpy real and clip_norm < 0: raise ValueError
  tree  = nan_to_num(tree, nan=0, posinf=0, neginf=0)         # only with nan_safe=True
  c     = maximum(clip_norm, 0)
  l2    = optax.global_norm(tree)                              # in the leaf dtype
  scale = nan_to_num(minimum(1, c / l2), nan=0, posinf=0)
  out   = scale.astype(x.dtype) * x                            # every element is multiplied
  return out, l2.astype(float32)

Two registered objects, one per value of ``nan_safe`` (the library's only non-finite switch):
``nan_safe=True`` counts NaN and +-inf as 0 and outputs 0 there (the canonical
``nonfinite="zero"``); ``nan_safe=False`` lets them propagate (``nonfinite="propagate"``).
``rescale_to_unit_norm`` and ``return_zero`` keep their defaults (False), as for plain clipping.
The norm always comes back as float32, also for float64 leaves. jit, vmap and grad run through
it unchanged (checked with jax 0.12).
"""

from __future__ import annotations

from typing import Any, Sequence

from jax_privacy import clipping

from clipbench.impls.adapters import _common, _jax_common

_LIBRARY = "jax_privacy.clipping.clip_pytree"


class JaxPrivacyClipPytree:
  """``clip_pytree(leaves, clip_norm, nan_safe=...)`` with one fixed ``nan_safe``.

  The object implements exactly one non-finite mode, so that mode is also the default of its
  ``nonfinite`` argument; asking for the other one raises ``NotImplementedError``.
  """

  framework = "jax"
  library = "jax-privacy"

  def __init__(self, nan_safe: bool):
    self.nan_safe = nan_safe
    self.mode = "zero" if nan_safe else "propagate"
    self.description = f"jax_privacy.clipping.clip_pytree(leaves, clip_norm, nan_safe={nan_safe})"
    # The library call a bug report would show (the suite's reproducer appends it).
    self.reproducer = (
        "import jax.numpy as jnp\nfrom jax_privacy import clipping\n"
        "out, norm = clipping.clip_pytree([jnp.asarray(x) for x in leaves], threshold, "
        f"nan_safe={nan_safe})\nprint(out, norm)")
    self.capabilities = _jax_common.capabilities(nonfinite=(self.mode,))

  def clip_grad_norm(self, leaves: Sequence[Any], max_norm: Any, *, norm_type: float = 2.0,
                     nonfinite: str | None = None) -> tuple[list[Any], Any]:
    _common.require_l2(norm_type, _LIBRARY)
    if nonfinite is not None:
      _common.require_mode(nonfinite, (self.mode,), f"{_LIBRARY}(nan_safe={self.nan_safe})")
    clipped, l2_norm = clipping.clip_pytree(list(leaves), max_norm, nan_safe=self.nan_safe)
    return list(clipped), l2_norm


clip_pytree_nan_safe = JaxPrivacyClipPytree(nan_safe=True)
clip_pytree_nan_unsafe = JaxPrivacyClipPytree(nan_safe=False)
