"""The exact reference implementation of clipbench's three operations; it is the spec.

Functions are named exactly like the canonical API (as ``jax._src.lax_reference`` names its
functions like the primitives) and work on numpy arrays; see ``SPEC.md`` beside this file.

Rule 14 (sharded leaves give the unsharded call's bits) holds for the reference trivially:
it runs in one process on numpy arrays, which have no shards, and it computes every norm
exactly (rationals, then one correct rounding), so no order of partial sums exists that a
split could change. (The suite holds each implementation's sharded result against that same
implementation's unsharded call; rules 1-10 hold the unsharded call against this reference.)
"""

from clipbench.reference.clipping import (clip_by_global_norm, clip_by_max_step, clip_grad_norm,
                                          norm_format, system_norm, system_step_norm)
from clipbench.reference.norms import ExactNorm, largest_scale_within


class _Reference:
  """The reference registered as the implementation ``reference``."""

  framework = "numpy"
  description = "exact rational/mpmath reference (the spec)"
  # A plain dict (the registry normalizes it): the spec imports nothing of what it judges.
  capabilities = {"per_system": True, "per_system_max": True, "norm_types": "any",
                  "nonfinite": ("propagate", "zero")}
  clip_by_global_norm = staticmethod(clip_by_global_norm)
  clip_by_max_step = staticmethod(clip_by_max_step)
  clip_grad_norm = staticmethod(clip_grad_norm)


implementation = _Reference()

__all__ = ["clip_by_global_norm", "clip_by_max_step", "clip_grad_norm", "norm_format",
           "system_norm", "system_step_norm", "ExactNorm", "largest_scale_within",
           "implementation"]
