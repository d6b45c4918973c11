"""Exact comparisons of a system's norm with its threshold, for near-ties (SPEC rules 3-5).

Everything here is integer or interval arithmetic on the floats' bits: the JAX implementation
calls it from an XLA host callback, whose thread flushes subnormals to zero in float operations.
A near-tie needs the system within ~1e-9 (relative) of its threshold, which random data never
is, so this exact path costs nothing in practice.
"""

from __future__ import annotations

import contextlib
import math
from fractions import Fraction
from typing import Any, Callable

import numpy as np

_FORMATS = {2: (16, 10, 15), 4: (32, 23, 127), 8: (64, 52, 1023)}  # itemsize -> layout
_BF16_LAYOUT = (16, 7, 127)


def magnitudes_from_bits(bits: np.ndarray, layout: tuple[int, int, int]):
  """|x| = m * 2**e exactly, from raw bits (any shape); non-finite elements give m = 0."""
  nbits, mbits, bias = layout
  a = bits.astype(np.uint64) & np.uint64((1 << (nbits - 1)) - 1)
  ef = (a >> np.uint64(mbits)).astype(np.int64)
  mf = (a & np.uint64((1 << mbits) - 1)).astype(np.int64)
  normal = ef > 0
  m = np.where(normal, mf | (1 << mbits), mf)
  e = np.where(normal, ef - bias, 1 - bias) - mbits
  m = np.where(ef == (1 << (nbits - 1 - mbits)) - 1, 0, m)
  return m, e


def magnitudes_of(values: np.ndarray, layout: tuple[int, int, int] | None = None):
  """(m, e) of a float array (its own format: bits are reinterpreted, never converted)."""
  values = np.ascontiguousarray(values)
  if layout is None:
    layout = _BF16_LAYOUT if values.dtype.name == "bfloat16" else _FORMATS[values.dtype.itemsize]
  return magnitudes_from_bits(values.view(f"u{values.dtype.itemsize}"), layout)


def _power_sum(m: np.ndarray, e: np.ndarray, p: int) -> Fraction:
  pairs = [(mm, ee) for mm, ee in zip(m.ravel().tolist(), e.ravel().tolist()) if mm]
  if not pairs:
    return Fraction(0)
  low = min(ee for _, ee in pairs) * p
  total = 0
  for mm, ee in pairs:
    total += mm ** p << (ee * p - low)
  return Fraction(total) * Fraction(2) ** low


def power_sum(m: np.ndarray, e: np.ndarray, p: int) -> Fraction:
  """The exact sum of (m * 2**e)**p over magnitudes m * 2**e, for an integer p >= 1."""
  return _power_sum(m, e, p)


def exact_compare(m: np.ndarray, e: np.ndarray, p: float, c: Fraction) -> int:
  """-1, 0, 1 as the exact p-norm of magnitudes m * 2**e is <, ==, > the rational c."""
  m = np.asarray(m).ravel()
  e = np.asarray(e).ravel()
  if m.size == 0:
    return -1 if c > 0 else 0
  vals = [Fraction(mm) * Fraction(2) ** ee for mm, ee in zip(m.tolist(), e.tolist())] if \
      math.isinf(p) else None
  if p == math.inf:
    return _sign(max(vals) - c)
  if p == -math.inf:
    return _sign(min(vals) - c)
  if float(p).is_integer():
    return _sign(_power_sum(m, e, int(p)) - c ** int(p))
  return _interval_compare(m, e, p, c)


def _interval_compare(m: np.ndarray, e: np.ndarray, p: float, c: Fraction) -> int:
  terms = PowerSumTerms(m, e, p)
  if not terms.pairs:
    return -1 if c > 0 else 0
  if c == 0:
    return 1
  return enclosure_sign(terms.enclosure, p, c)


class PowerSumTerms:
  """The sum of (m * 2**e)**p over nonzero magnitudes, enclosed by mpmath intervals (a
  non-integer p), computed once per precision."""

  def __init__(self, m: np.ndarray, e: np.ndarray, p: float):
    self.pairs = [(mm, ee) for mm, ee in zip(np.asarray(m).ravel().tolist(),
                                             np.asarray(e).ravel().tolist()) if mm]
    self.p = p
    self._cache: dict[int, Any] = {}

  def enclosure(self, prec: int):
    """The sum as an ``mpmath.iv`` interval at ``prec`` bits (the context is set to it)."""
    if prec not in self._cache:
      import mpmath  # pylint: disable=import-outside-toplevel
      ctx = mpmath.iv
      pp = ctx.mpf(self.p)
      total = ctx.mpf(0)
      for mm, ee in self.pairs:
        total += ctx.ldexp(ctx.mpf(mm), ee) ** pp
      self._cache[prec] = total
    return self._cache[prec]


# The precisions of :func:`enclosure_sign`'s enclosures, in bits: doubled until they decide,
# from 96 (twice float64's, with room for the rounding of a long sum) to 12,288.
ENCLOSURE_PRECISIONS = tuple(96 << k for k in range(8))
FIRST_ENCLOSURE_BITS = ENCLOSURE_PRECISIONS[0]


def enclosure_sign(power_sum_at: Callable[[int], Any], p: float, c: Fraction) -> int:
  """Sign of S - c**p from mpmath interval enclosures of a power sum S at rising precisions.

  ``power_sum_at(prec)`` returns S as an ``mpmath.iv`` interval, evaluated while the interval
  context works at ``prec`` bits (:data:`ENCLOSURE_PRECISIONS`); 0 when even the last cannot
  tell (a tie).
  """
  for prec in ENCLOSURE_PRECISIONS:
    decided = sign_at(power_sum_at, p, c, prec)
    if decided is not None:
      return decided
  return 0  # indistinguishable at the last precision: an exact tie


def sign_at(power_sum_at: Callable[[int], Any], p: float, c: Fraction, prec: int) -> int | None:
  """Sign of S - c**p (as :func:`enclosure_sign`) from the enclosures at ``prec`` bits alone,
  or None where they overlap."""
  import mpmath  # pylint: disable=import-outside-toplevel
  ctx = mpmath.iv
  with interval_precision(prec):
    diff = power_sum_at(prec) - (ctx.mpf(c.numerator) / ctx.mpf(c.denominator)) ** ctx.mpf(p)
  return -1 if diff.b < 0 else 1 if diff.a > 0 else None


@contextlib.contextmanager
def interval_precision(prec: int):
  """mpmath's interval context at ``prec`` bits inside the block."""
  import mpmath  # pylint: disable=import-outside-toplevel
  saved = mpmath.iv.prec
  mpmath.iv.prec = prec
  try:
    yield
  finally:
    mpmath.iv.prec = saved


def exact_step_compare(m: np.ndarray, e: np.ndarray, c: Fraction) -> int:
  """Sign of (largest exact L2 norm of the vectors) - c; m, e of shape (vectors, d)."""
  c2 = c * c
  best = -1
  for mv, ev in zip(np.asarray(m).reshape(len(m), -1), np.asarray(e).reshape(len(e), -1)):
    best = max(best, _sign(_power_sum(mv, ev, 2) - c2))
    if best > 0:
      return 1
  return best


def _sign(q: Fraction) -> int:
  return (q > 0) - (q < 0)


def fraction_of_bits(bits: int, layout: tuple[int, int, int] = (64, 52, 1023)) -> Fraction:
  """The exact value of a finite nonnegative float from its bits (no float arithmetic)."""
  m, e = magnitudes_from_bits(np.array([bits], dtype=np.uint64), layout)
  return Fraction(int(m[0])) * Fraction(2) ** int(e[0])


def exact_frexp(c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(c_m, c_e, is_inf) of thresholds, exact for subnormals (host-side, numpy)."""
  c = np.asarray(c, dtype=np.float64)
  is_inf = np.isinf(c)
  m, e = np.frexp(np.where(is_inf, 1.0, c))
  return np.where(is_inf, 1.0, m), e.astype(np.int32), is_inf
