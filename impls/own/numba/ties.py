"""Near-ties decided exactly on the host (SPEC rule 3), for both routes.

A threshold within the norm's error bound needs the system within ~1e-9 (relative) of it,
which random data never is; then the shared exact comparisons of
:mod:`clipbench.impls.own.exact` decide on the system's elements.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from clipbench.impls.own import exact


def tie_is_kept(values: list[np.ndarray], c: float, p: float, step: bool) -> bool:
  """The exact decision of a near-tie: is the system's norm at or below c (rule 3)?
  ``values`` holds its elements as float64, one array per leaf (vectors along the last axis
  for max-step)."""
  c_k = Fraction(c)
  if step:
    signs = [exact.exact_step_compare(*exact.magnitudes_of(v), c_k)
             for v in values if v.size]
    return max(signs, default=-1) <= 0
  parts = [exact.magnitudes_of(v.ravel()) for v in values]
  m = np.concatenate([pm for pm, _ in parts]) if parts else np.zeros(0, np.int64)
  e = np.concatenate([pe_ for _, pe_ in parts]) if parts else np.zeros(0, np.int64)
  return exact.exact_compare(m, e, p, c_k) <= 0
