"""Binary floating-point formats and exact rounding of rationals into them.

Every float of the four leaf dtypes converts exactly to a Python ``Fraction``; this module
rounds exact rationals back into a format. A format is its precision ``prec`` (significand
bits, hidden bit included) and exponent range ``[emin, emax]``: a positive finite value is
``n * 2**(e - prec + 1)`` with ``emin <= e <= emax`` and ``n < 2**prec``; below ``2**emin`` the
values are subnormal (``e`` clamps at ``emin``).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class Format:
  name: str
  prec: int
  emin: int
  emax: int

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if self.name == "bfloat16" else np.dtype(self.name)

  @property
  def max_finite(self) -> Fraction:
    return (2 - Fraction(1, 2 ** (self.prec - 1))) * Fraction(2) ** self.emax

  @property
  def overflow_threshold(self) -> Fraction:
    """Round to nearest sends every value at or above this to infinity (IEEE 754 4.3.1)."""
    return self.max_finite + ulp(self.max_finite, self) / 2

  @property
  def unit_roundoff(self) -> Fraction:
    return Fraction(1, 2 ** self.prec)


FORMATS = {
    "float16": Format("float16", 11, -14, 15),
    "bfloat16": Format("bfloat16", 8, -126, 127),
    "float32": Format("float32", 24, -126, 127),
    "float64": Format("float64", 53, -1022, 1023),
}


def format_of(dtype) -> Format:
  """The format of a numpy dtype (bfloat16 through ml_dtypes); KeyError for non-floats."""
  return FORMATS[np.dtype(dtype).name]


def floor_log2(q: Fraction) -> int:
  """The integer e with 2**e <= q < 2**(e+1), for q > 0."""
  n, d = q.numerator, q.denominator
  e = n.bit_length() - d.bit_length()
  if (n << max(-e, 0)) < (d << max(e, 0)):
    e -= 1
  return e


def ulp(q: Fraction, fmt: Format) -> Fraction:
  """The spacing of ``fmt``'s floats in the binade of |q| (subnormal spacing below 2**emin)."""
  if q == 0:
    return Fraction(2) ** (fmt.emin - fmt.prec + 1)
  return Fraction(2) ** (max(floor_log2(abs(q)), fmt.emin) - fmt.prec + 1)


def round_to_precision(q: Fraction, prec: int, emin: int | None = None,
                       mode: str = "nearest") -> Fraction:
  """Rounds q to ``prec`` significand bits; exponent unbounded above (and below if emin None).

  ``mode``: ``"nearest"`` (ties to even), ``"toward_zero"`` or ``"away_from_zero"``.
  """
  if q == 0:
    return Fraction(0)
  magnitude = abs(q)
  e = floor_log2(magnitude)
  if emin is not None:
    e = max(e, emin)
  quantum = Fraction(2) ** (e - prec + 1)
  m = magnitude / quantum
  if mode == "nearest":
    n = round(m)  # Fraction.__round__ rounds half to even.
  elif mode == "toward_zero":
    n = math.floor(m)
  elif mode == "away_from_zero":
    n = math.ceil(m)
  else:
    raise ValueError(f"mode: unknown rounding mode {mode!r}")
  return n * quantum if q > 0 else -n * quantum


def round_to_format(q: Fraction, fmt: Format, mode: str = "nearest") -> float:
  """Rounds the exact rational q into ``fmt``; returns the result as an (exact) Python float.

  Overflow gives +-inf when rounding to nearest and +-max_finite when rounding toward zero.
  The sign of a zero result is the sign of q.
  """
  r = round_to_precision(q, fmt.prec, fmt.emin, mode)
  if abs(r) > fmt.max_finite:
    if mode == "toward_zero":
      r = fmt.max_finite if q > 0 else -fmt.max_finite
    else:
      return math.inf if q > 0 else -math.inf
  return (0.0 if q >= 0 else -0.0) if r == 0 else float(r)


def next_up(f: Fraction, fmt: Format) -> Fraction:
  """The next float of ``fmt`` above f >= 0 (may exceed max_finite: caller's business)."""
  return f + ulp(f, fmt)


def next_down(f: Fraction, fmt: Format) -> Fraction:
  """The largest float of ``fmt`` below f > 0."""
  step = ulp(f, fmt)
  e = floor_log2(f)
  if f == Fraction(2) ** e and e > fmt.emin:
    step /= 2  # just below a power of two the spacing halves
  return f - step


def exact(x) -> Fraction:
  """The exact rational value of a finite float of any leaf dtype."""
  return Fraction(float(x))
