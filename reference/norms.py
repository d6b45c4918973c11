"""Exact p-norms of a system's elements: comparisons with a rational, correct rounding.

A system's norm ``||x||_p = (sum |x_i|**p) ** (1/p)`` is in general irrational, so the
reference never computes it as a float. It answers two exact questions instead:

* ``compare(t)``: is the norm below, equal to or above a rational t?  For integer p this is
  ``sum |x_i|**p`` against ``t**p`` in exact rational arithmetic; for other p the power sum is
  enclosed in mpmath intervals whose precision doubles until the answer is certain;
* ``rounded(fmt)``: the norm correctly rounded (to nearest, ties to even) into a format, found
  by moving a candidate float until the norm lies between the midpoints around it, each
  midpoint tested with ``compare``.

``p = inf`` is ``max |x_i|`` and ``p = -inf`` is ``min |x_i|`` (not a norm), both exact. A
system with no elements has norm 0 for every p.
"""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np

from clipbench.reference.formats import (Format, exact, floor_log2, next_down, next_up,
                                         round_to_format, round_to_precision)

# Precision (bits) of the first interval enclosure for non-integer p; doubled until decided.
_FIRST_INTERVAL_PREC = 96
# Beyond this the two sides are taken as equal: a tie this close has never been constructed.
_LAST_INTERVAL_PREC = 1 << 14


def exact_power_sum(magnitudes: np.ndarray, p: int) -> Fraction:
  """sum(m**p) exactly, for float64 magnitudes (exact copies of any leaf dtype) and integer p."""
  # Every float is n / 2**k; summing numerators over a common power of two keeps it exact
  # without a gcd per term (what Fraction addition would do).
  total, shift = 0, 0
  for v in magnitudes.tolist():
    if v == 0.0:
      continue
    n, d = v.as_integer_ratio()
    term, k = n ** p, (d.bit_length() - 1) * p
    if k > shift:
      total <<= k - shift
      shift = k
    total += term << (shift - k)
  return Fraction(total, 1 << shift)


class ExactNorm:
  """The exact p-norm of a set of magnitudes (a value object: nothing changes after init)."""

  def __init__(self, magnitudes: np.ndarray, p: float):
    self.magnitudes = np.abs(np.asarray(magnitudes, dtype=np.float64)).ravel()
    self.p = float(p)
    self._power_sum = None
    self._intervals = {}
    if self.p in (math.inf, -math.inf) or self.magnitudes.size == 0:
      return
    if self.p.is_integer():
      self._power_sum = exact_power_sum(self.magnitudes, int(self.p))

  @property
  def is_zero(self) -> bool:
    if self.p == -math.inf:
      return self.magnitudes.size == 0 or bool(np.min(self.magnitudes) == 0)
    return not np.any(self.magnitudes)

  def compare(self, t: Fraction) -> int:
    """-1, 0 or 1 as the exact norm is below, equal to or above the rational t >= 0."""
    t = Fraction(t)
    if self.magnitudes.size == 0:
      return _sign(-t)
    if self.p == math.inf:
      return _sign(exact(np.max(self.magnitudes)) - t)
    if self.p == -math.inf:
      return _sign(exact(np.min(self.magnitudes)) - t)
    if self._power_sum is not None:
      return _sign(self._power_sum - t ** int(self.p))
    return self._compare_by_intervals(t)

  def _compare_by_intervals(self, t: Fraction) -> int:
    ctx = mpmath.iv
    prec = _FIRST_INTERVAL_PREC
    while prec <= _LAST_INTERVAL_PREC:
      saved = ctx.prec
      ctx.prec = prec
      try:
        power_sum = self._interval_power_sum(prec)
        t_power = (ctx.mpf(t.numerator) / ctx.mpf(t.denominator)) ** ctx.mpf(self.p)
        difference = power_sum - t_power
      finally:
        ctx.prec = saved
      if difference.b < 0:
        return -1
      if difference.a > 0:
        return 1
      if t == 0:
        return 0 if self.is_zero else 1
      prec *= 2
    return 0

  def _interval_power_sum(self, prec: int):
    if prec not in self._intervals:
      ctx = mpmath.iv
      p = ctx.mpf(self.p)
      total = ctx.mpf(0)
      for v in self.magnitudes.tolist():
        if v != 0.0:
          total += ctx.mpf(v) ** p
      self._intervals[prec] = total
    return self._intervals[prec]

  def approximate(self) -> Fraction:
    """A close (not exact) rational estimate, used only as a starting point of searches."""
    if self.magnitudes.size == 0:
      return Fraction(0)
    if self.p == math.inf:
      return exact(np.max(self.magnitudes))
    if self.p == -math.inf:
      return exact(np.min(self.magnitudes))
    with mpmath.workprec(128):
      if self._power_sum is not None:
        s = mpmath.mpf(self._power_sum.numerator) / self._power_sum.denominator
      else:
        s = mpmath.fsum(mpmath.mpf(v) ** self.p for v in self.magnitudes.tolist() if v)
      if s == 0:
        return Fraction(0)
      value = mpmath.root(s, 1) if self.p == 1 else s ** (mpmath.mpf(1) / self.p)
      mantissa, exponent = mpmath.frexp(value)
      return Fraction(int(mpmath.ldexp(mantissa, 120))) * Fraction(2) ** (exponent - 120)

  def rounded(self, fmt: Format) -> float:
    """The norm correctly rounded to nearest (ties to even) in ``fmt``; +inf past its range."""
    if self.is_zero:
      return 0.0
    if self.p in (math.inf, -math.inf):
      return round_to_format(self.approximate(), fmt)  # exact value, exactly representable
    f = Fraction(round_to_format(self.approximate(), fmt)) if math.isfinite(
        round_to_format(self.approximate(), fmt)) else None
    while True:
      if f is None:  # candidate is +inf
        c = self.compare(fmt.overflow_threshold)
        if c >= 0:
          return math.inf
        f = fmt.max_finite
        continue
      if f > 0:
        below = (next_down(f, fmt) + f) / 2
        c = self.compare(below)
        if c < 0:
          f = next_down(f, fmt)
          continue
        if c == 0:
          return round_to_format(below, fmt)
      above = (f + next_up(f, fmt)) / 2
      c = self.compare(above)
      if c > 0:
        f = None if f == fmt.max_finite else next_up(f, fmt)
        continue
      if c == 0:
        return round_to_format(above, fmt)
      return float(f)


def _sign(q: Fraction) -> int:
  return (q > 0) - (q < 0)


# s is a 53-bit binary float with an unbounded exponent: every value of every leaf dtype, and
# every max/norm ratio, is then within reach without overflow or underflow.
_SCALE_FORMAT = Format("scale", 53, -(1 << 30), 1 << 30)


def largest_scale_within(threshold: Fraction, norm: ExactNorm) -> Fraction:
  """The largest 53-bit float s with s * norm <= threshold (exactly), for norm > threshold >= 0."""
  if threshold == 0:
    return Fraction(0)
  estimate = Fraction(threshold) / norm.approximate()
  s = round_to_precision(estimate, 53, None, "toward_zero")

  def fits(candidate: Fraction) -> bool:  # candidate * norm <= threshold
    return norm.compare(Fraction(threshold) / candidate) <= 0

  while not fits(s):
    s = next_down(s, _SCALE_FORMAT)
  while fits(next_up(s, _SCALE_FORMAT)):
    s = next_up(s, _SCALE_FORMAT)
  return s


__all__ = ["ExactNorm", "exact_power_sum", "largest_scale_within", "floor_log2"]
