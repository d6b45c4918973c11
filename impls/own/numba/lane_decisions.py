"""Decisions of a group of systems at once, in vector lanes: the fused route's tiny systems.

A system of a few atoms (W5: 2-8) costs the fused route more in its decision than in its
data: ``fused_decision.decide`` is a square root, two divisions, error bounds and branches,
about 30 ns per system, several times the system's share of the memory roofline. The fused
kernel therefore decides a group of systems together (``decide_group``): for each lane the
very operations of ``decide`` -> ``finalize.finalize_one`` (p = 2, 24-bit factors), in the
same order, with the branches of the usual case written as selects, so that LLVM vectorizes
the loop over the group and every lane gets ``decide``'s bits. A lane outside the usual case
(a zero, non-finite or flagged sum, an infinite or zero threshold, an exponent beyond the
bit tricks' range) is marked and decided again by ``decide`` itself, so the fast lanes need
only be right where they are used; ``test_numba_lane_decisions`` checks every lane against
``decide`` bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from clipbench.impls.own import decision
from clipbench.impls.own.numba.double_double import two_prod, two_sum
from clipbench.impls.own.numba.finalize import SCALE_BITS, pow2, sum_rel_err_of_squares
from clipbench.impls.own.numba.fused_decision import decide, threshold_of
from clipbench.impls.own.numba.intrinsics import JIT, f64, u64

_EXPONENT = np.uint64(0x7FF) << np.uint64(52)
_ONE_BITS = np.uint64(1)


@njit(inline="always", **JIT)
def _exponent_field(v):
  return np.int64((u64(v) >> np.uint64(52)) & np.uint64(0x7FF))


def _make_decide_lanes(one_threshold: bool):
  """``_decide_lanes`` for thresholds of one per system, or (``one_threshold``) one for every
  system, read once before the loop. A compile-time choice: each loop vectorizes on its own."""

  # NumPy's error model: no zero-divisor checks (which raise, and so keep the loop scalar); the
  # usual lanes never divide by zero.
  @njit(error_model="numpy", **JIT)
  def decide_lanes(k0, n, totals, counts, c_m, c_e, c_inf, step, step_rel_err, norms, action,
                   s_m, s_e, tie, usual, factors, in_steps):
    """Systems k0 + j, j in [0, n) (``counts``, ``usual``, ``factors`` and ``in_steps`` indexed
    by j, the rest by system): ``decide``'s (norm, action, s_m, s_e, tie) where ``usual[j]``
    comes out True; the other lanes' entries are not to be used. ``in_steps[j]``: a usual lane
    whose runs the masked steps can apply, kept (``factors[j]`` 1.0) or scaled by a factor
    that is a float32 (``factors[j]``, ``ldexp(s_m, s_e)``, as ``fused_decision.run_action``
    gives it). Branch-free, so it vectorizes (indexed from 0 in views of the group: an index
    k0 + j might be negative to numba, whose wraparound select then keeps the loop scalar)."""
    k1 = k0 + n
    c0 = 0 if one_threshold else k0
    c1 = 1 if one_threshold else k1
    c_m, c_e, c_inf = c_m[c0:c1], c_e[c0:c1], c_inf[c0:c1]
    totals = totals[k0:k1]
    norms, action = norms[k0:k1], action[k0:k1]
    s_m, s_e, tie = s_m[k0:k1], s_e[k0:k1], tie[k0:k1]
    for j in range(n):
      _decide_lane(j, totals[j], counts[j], c_m[0 if one_threshold else j],
                   c_e[0 if one_threshold else j], c_inf[0 if one_threshold else j], step,
                   step_rel_err, norms, action, s_m, s_e, tie, usual, factors, in_steps)
  return decide_lanes


@njit(inline="always", error_model="numpy", **JIT)
def _decide_lane(j, total, count, cm, ce, cinf, step, step_rel_err, norms, action, s_m, s_e,
                 tie, usual, factors, in_steps):
  """Lane j of ``_decide_lanes``: one system's sum of squares, element count and threshold."""
  rel = step_rel_err if step else sum_rel_err_of_squares(count)
  ok = (total > 0.0) & (total < np.inf) & (not cinf) & (cm > 0.0)
  safe = total if ok else 1.0
  # finalize._root, p = 2, s_lo = 0.
  r = math.sqrt(safe)
  q_hi, q_lo = two_prod(r, r)
  d_hi, d_lo = two_sum(safe, -q_hi)
  delta = (d_hi + (d_lo + (0.0 - q_lo))) / (2.0 * q_hi)
  r_hi = r + r * delta
  r_lo = r * delta - (r_hi - r)
  eps = rel / 2.0 + rel * rel + 0.0 / 2.0 + 2.0 ** -80
  # finalize.finalize_one, sc_m = 0.5, sc_e = 1, precise False.
  t_hi, t_lo = two_prod(0.5, r_hi)
  t_lo = t_lo + 0.5 * r_lo
  t = t_hi + t_lo
  t_lo = t_lo - (t - t_hi)
  t_hi = t
  slack = t_hi * eps
  up_arg = t_hi + (t_lo + slack)
  lo_arg = t_hi + (t_lo - slack)
  up = f64(u64(up_arg) + _ONE_BITS)  # next_up of a positive finite value
  lo = f64(u64(lo_arg) - _ONE_BITS)  # next_toward_zero of a positive value
  ok = ok & (eps != 0.0) & (lo_arg > 0.0) & (up_arg < np.inf)
  norm_v = t_hi + t_lo
  d = ce - 1
  dc = min(max(d, -1000), 1000)
  c_t = cm * pow2(dc)
  keep = (d >= 1000) | ((d > -1000) & (c_t >= up))
  clip = (not keep) & ((d <= -1000) | (c_t < lo))
  q = cm if keep else cm / up
  q = q * (1.0 - 2.0 ** -50)
  field = _exponent_field(q)
  ok = ok & (field != 0) & (field != 0x7FF)
  q_m = f64((u64(q) & ~_EXPONENT) | (np.uint64(1022) << np.uint64(52)))
  q_e = field - 1022
  q_m = math.floor(q_m * 2.0 ** SCALE_BITS) * 2.0 ** -SCALE_BITS
  se = q_e + d
  sv = q_m * pow2(min(max(se, -1022), 1023))
  sv32 = np.float32(sv)
  factors[j] = np.float32(1.0) if keep else sv32
  in_steps[j] = ok & (keep | ((se >= -1022) & (se <= 1023) & (np.float64(sv32) == sv)))
  norms[j] = np.float32(norm_v * 2.0)
  action[j] = decision.KEEP if keep else decision.SCALE
  s_m[j] = q_m
  s_e[j] = se
  tie[j] = (not keep) & (not clip)
  usual[j] = ok


_decide_lanes_each = _make_decide_lanes(False)
_decide_lanes_one = _make_decide_lanes(True)


@njit(inline="always", **JIT)
def decide_group(k0, n, counts, flags, usual, factors, in_steps, rule, out):
  """``decide`` for systems [k0, k0 + n) of a group, from their sums (``out.sums``), element
  counts and non-finite flags (``counts``, ``flags``: indexed from 0), into ``out``'s
  per-system arrays: the vector lanes, then ``decide`` itself for every lane outside the usual
  case (``usual``: scratch of at least n). ``in_steps[j]`` (indexed from 0): the system's runs
  go to ``masked_apply.scale_run_masked`` with the float32 factor ``factors[j]``; the other
  systems' runs to ``masked_apply.apply_tiny_run_f32``."""
  c_m, c_e, c_inf = rule.threshold
  if rule.one_threshold:
    _decide_lanes_one(k0, n, out.sums, counts, c_m, c_e, c_inf, rule.step, rule.step_rel_err,
                      out.norms, out.action, out.s_m, out.s_e, out.tie, usual, factors, in_steps)
  else:
    _decide_lanes_each(k0, n, out.sums, counts, c_m, c_e, c_inf, rule.step, rule.step_rel_err,
                       out.norms, out.action, out.s_m, out.s_e, out.tie, usual, factors,
                       in_steps)
  for j in range(n):
    if flags[j] or not usual[j]:
      in_steps[j] = False
      k = k0 + j
      cm, ce, cinf = threshold_of(rule, k)
      out.norms[k], out.action[k], out.s_m[k], out.s_e[k], out.tie[k] = decide(
          out.sums[k], counts[j], flags[j], cm, ce, cinf, rule)
