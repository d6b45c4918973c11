"""Accuracy of an implementation's output against the exact reference, in units in the last place.

For each output element ``y`` with exact reference value ``r`` (both in the leaf dtype) the error
is ``|y - r| / ulp(r)``, ``ulp(r)`` the spacing of the leaf dtype at ``r`` (the smallest
subnormal at zero). A leaf's error is the maximum over its elements; non-finite values count 0
where they agree (same NaN-ness, same infinity) and +inf where they do not.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def max_ulp_error(out: np.ndarray, ref: np.ndarray) -> float:
  """Largest error of ``out`` against ``ref`` in ulps of ``ref``'s dtype."""
  out = np.asarray(out)
  ref = np.asarray(ref)
  if out.shape != ref.shape:
    return float("inf")
  if ref.size == 0:
    return 0.0
  spacing = np.abs(np.spacing(ref)).astype(np.float64)
  y = out.astype(np.float64)
  r = ref.astype(np.float64)
  finite = np.isfinite(r) & np.isfinite(y)
  agree = (np.isnan(r) & np.isnan(y)) | (~np.isnan(r) & (y == r))
  if np.any(~finite & ~agree):
    return float("inf")
  err = np.abs(y[finite] - r[finite]) / spacing[finite]
  return float(err.max()) if err.size else 0.0


def max_ulp_error_leaves(outs: Sequence[np.ndarray], refs: Sequence[np.ndarray]) -> float:
  """Largest ``max_ulp_error`` over leaves (+inf when the leaf counts differ)."""
  if len(outs) != len(refs):
    return float("inf")
  return max((max_ulp_error(o, r) for o, r in zip(outs, refs)), default=0.0)
