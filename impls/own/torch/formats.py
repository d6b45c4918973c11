"""Binary float formats on exact rationals: rounding, grids, and the searches built on them.

The torch implementations define every output bit from the exact norm (see
:mod:`clipbench.impls.own.torch`); these are the pieces that turn an exact comparison
``compare(t) = sign(norm - t)`` into the reported norm (correctly rounded to nearest) and the
factor (the largest float of a grid that keeps the output within the threshold). Everything
is Python ``Fraction`` arithmetic: it runs only for the systems that need it (near-ties).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Format:
  """A binary format: ``prec`` significand bits, normal exponents in [emin, emax]."""

  prec: int
  emin: int
  emax: int

  @property
  def max_finite(self) -> Fraction:
    return (2 - Fraction(1, 2 ** (self.prec - 1))) * Fraction(2) ** self.emax

  @property
  def overflow(self) -> Fraction:
    """Rounding to nearest sends values at or above this to infinity."""
    return self.max_finite + Fraction(2) ** (self.emax - self.prec)


FMT32 = Format(24, -126, 127)
FMT64 = Format(53, -1022, 1023)
# s * n * (1 + w) <= c leaves room for one rounding to nearest of x * s (and subnormal slack).
MARGIN = {24: Fraction(5, 2 ** 26), 53: Fraction(5, 2 ** 55)}


class Ambiguous(Exception):
  """A certified interval cannot decide a comparison: the system needs its exact oracle."""


def sign(q: Fraction) -> int:
  return (q > 0) - (q < 0)


def floor_log2(q: Fraction) -> int:
  """floor(log2(q)) of a positive rational, from integer bit lengths (no float rounding)."""
  n, d = q.numerator, q.denominator
  e = n.bit_length() - d.bit_length()
  if (n << max(-e, 0)) < (d << max(e, 0)):
    e -= 1
  return e


def quantum(q: Fraction, prec: int, emin: int | None) -> Fraction:
  """The spacing of ``prec``-bit floats at q (subnormal spacing below 2**emin)."""
  e = floor_log2(q)
  if emin is not None:
    e = max(e, emin)
  return Fraction(2) ** (e - prec + 1)


def round_to(q: Fraction, prec: int, emin: int | None, mode: str) -> Fraction:
  """Rounds q >= 0 to ``prec`` bits: "nearest" (ties to even), "down" or "up"."""
  if q == 0:
    return Fraction(0)
  step = quantum(q, prec, emin)
  m = q / step
  n = round(m) if mode == "nearest" else math.floor(m) if mode == "down" else math.ceil(m)
  return n * step


def next_up(f: Fraction, prec: int, emin: int | None) -> Fraction:
  if f == 0:
    return Fraction(2) ** (emin - prec + 1)
  return f + quantum(f, prec, emin)


def largest_on_grid(pred: Callable[[Fraction], bool], guess: Fraction, prec: int,
                    emin: int | None) -> Fraction:
  """The largest positive float f of the grid (``prec`` bits, ``emin``) with ``pred(f)``.

  ``pred`` is true up to some point and false after it; ``guess`` is a close estimate of
  that point (a poor one only costs a few more steps: the search brackets, then bisects).
  """
  tiny = None if emin is None else Fraction(2) ** (emin - prec + 1)
  f = round_to(guess, prec, emin, "down") if guess > 0 else Fraction(0)
  if f == 0:
    f = tiny if tiny is not None else Fraction(1)
  width = quantum(f, prec, emin)
  if pred(f):
    lo, hi = f, next_up(f, prec, emin)
    while pred(hi):
      lo, width = hi, width * 2
      hi = max(round_to(lo + width, prec, emin, "down"), next_up(lo, prec, emin))
  else:
    hi = f
    while True:
      lo = round_to(hi - width, prec, emin, "down") if hi > width else round_to(hi / 2, prec,
                                                                                 emin, "down")
      if lo == 0 or pred(lo):
        break
      hi, width = lo, width * 2
  while True:
    nxt = next_up(lo, prec, emin) if lo > 0 else tiny
    if nxt >= hi:
      return lo
    mid = round_to((lo + hi) / 2, prec, emin, "down")
    if mid <= lo:
      mid = nxt
    if pred(mid):
      lo = mid
    else:
      hi = mid


def round_norm(compare: Callable[[Fraction], int], approx: Fraction, fmt: Format) -> float:
  """The (nonzero) norm correctly rounded to nearest in ``fmt``; +inf past its range.

  ``compare(t)`` is the sign of ``norm - t``; ``approx`` a close estimate (a start only).
  """
  if compare(fmt.overflow) >= 0:
    return math.inf
  f = largest_on_grid(lambda t: compare(t) >= 0, min(approx, fmt.max_finite), fmt.prec,
                      fmt.emin)  # the norm rounded down
  nxt = next_up(f, fmt.prec, fmt.emin) if f > 0 else Fraction(2) ** (fmt.emin - fmt.prec + 1)
  c = compare((f + nxt) / 2)
  if c < 0 or (c == 0 and _is_even(f, fmt)):
    return float(f)
  return float(nxt)


def _is_even(f: Fraction, fmt: Format) -> bool:
  if f == 0:
    return True
  return (f / quantum(f, fmt.prec, fmt.emin)).numerator % 2 == 0


def largest_scale(compare: Callable[[Fraction], int], c: float, prec: int,
                  approx: Fraction) -> Fraction:
  """max{s in F_prec : s * norm * (1 + w) <= c} for norm > c >= 0 (0 when c == 0)."""
  if c == 0:
    return Fraction(0)
  cq, w = Fraction(c), MARGIN[prec]
  guess = cq / (approx * (1 + w)) if approx > 0 else cq
  return largest_on_grid(lambda s: compare(cq / (s * (1 + w))) <= 0, guess, prec, None)


def fraction_root(q: Fraction, p: float) -> Fraction:
  """q**(1/p) to about 50 bits, as a rational (no float overflow or underflow)."""
  if q <= 0:
    return Fraction(0)
  e = floor_log2(q)
  k = math.floor(e / p)
  m = float(q / Fraction(2) ** round(k * p)) if float(k * p).is_integer() else None
  if m is None:  # non-integer p: root of the mantissa and of the power of two separately
    m = float(q / Fraction(2) ** e)
    return Fraction(m ** (1.0 / p)) * Fraction(2.0 ** ((e / p) % 1)) * Fraction(2) ** math.floor(
        e / p)
  return Fraction(m ** (1.0 / p)) * Fraction(2) ** k
