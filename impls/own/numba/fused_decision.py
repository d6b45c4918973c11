"""One system's decision in the fused routes, and what their kernels return.

Both fused routes (:mod:`.fused`, whole systems per chunk; :mod:`.long_runs`, blocks of a
few long runs) end a system the same way: its sum of squares (or largest vector sum), element
count and non-finite flags go through ``finalize.finalize_one`` as the general route's
``finalize_systems`` would take them, so every route gives the same norms, decisions and
factors.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from clipbench.impls.own.numba.decode import F32, block_flags, views
from clipbench.impls.own.numba.finalize import finalize_one, ldexp_bits, sum_rel_err_of_squares
from clipbench.impls.own.numba.intrinsics import JIT
from clipbench.impls.own.numba.records import RunAction, SystemSums, Threshold

FUSED_OK, FUSED_UNSORTED, FUSED_NONFINITE = 0, 1, 2


@njit(inline="always", **JIT)
def nonfinite_flags(leaves, leaf, start, n):
  """block_flags of elements [start, start + n) of a float32 leaf."""
  a16, a32, a64 = views(leaves.addrs[leaf], leaves.sizes[leaf], F32)
  return block_flags(F32, a16, a32, a64, leaves.table, start, n)


@njit(inline="always", **JIT)
def threshold_of(rule, k):
  """System k's threshold parts (c_m, c_e, c_inf) of ``rule`` (a FusedRule)."""
  i = 0 if rule.one_threshold else k
  c_m, c_e, c_inf = rule.threshold
  return c_m[i], c_e[i], c_inf[i]


@njit(inline="always", **JIT)
def decide(total, count, flags, c_m, c_e, c_inf, rule):
  """One system's (float32 norm, action, s_m, s_e, near-tie flag) from its sum of squares (or
  largest vector sum), element count, non-finite flags and threshold ``c_m * 2**c_e``
  (``c_inf``: +inf). Scalars in and out: the callers index the per-system arrays in their
  own loops (reached through the records inside this function, a decision cost about three
  times as much; docs/cpu-kernels.md)."""
  nan = (flags & 1) != 0
  inf = (flags & 2) != 0 and not nan
  rel = rule.step_rel_err if rule.step else sum_rel_err_of_squares(count)
  zero = total == 0.0
  norm_v, act, sm, se, is_tie = finalize_one(
      SystemSums(total, 0.0, 0.5, np.int64(1), rel, zero, nan, inf),
      Threshold(c_m, np.int64(c_e), c_inf), 2.0, False)
  # decision.compose_norm: ldexp(norm_v, 1), then zero, inf and NaN, rounded to float32.
  v = norm_v * 2.0
  if zero:
    v = 0.0
  if inf:
    v = np.inf
  if nan:
    v = np.nan
  return np.float32(v), act, sm, np.int64(se), is_tie


@njit(inline="always", **JIT)
def run_action(act, sm, se):
  """The :class:`~clipbench.impls.own.numba.records.RunAction` of a decided system."""
  return RunAction(act, sm, se, ldexp_bits(sm, se), False, False)
