"""Double-double arithmetic written once for numpy and ``jax.numpy`` (the array namespace ``xp``).

Every own implementation's decision (:mod:`clipbench.impls.own.decision`) takes the p-th root
and forms products in double-double, so that the norm is known to ~2**-80 relative whatever the
data. All of it uses Dekker's splitting (no fused multiply-add, which neither numpy nor XLA
exposes); XLA does not contract ``a*b - p`` (checked against numpy bit for bit).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np

def split(xp: Any, a):
  """Veltkamp split: a = hi + lo with hi, lo of at most 26 significant bits (|a| < 2**995)."""
  c = 134217729.0 * a
  hi = c - (c - a)
  return hi, a - hi


def two_prod(xp: Any, a, b):
  """p + e == a * b exactly (Dekker), for moderate a, b (no overflow or underflow)."""
  p = a * b
  ah, al = split(xp, a)
  bh, bl = split(xp, b)
  return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def fast_two_sum(xp: Any, a, b):
  """s + e == a + b exactly, for |a| >= |b| (or a == 0)."""
  s = a + b
  return s, b - (s - a)


def two_sum(xp: Any, a, b):
  s = a + b
  bb = s - a
  return s, (a - (s - bb)) + (b - bb)


def dd_mul(xp: Any, ahi, alo, bhi, blo):
  p, e = two_prod(xp, ahi, bhi)
  e = e + (ahi * blo + alo * bhi)
  return fast_two_sum(xp, p, e)


def dd_int_power(xp: Any, r, n: int):
  """r**n as a double-double (relative error ~ n * 2**-104), for integer n >= 1."""
  hi, lo = r, xp.zeros_like(r)
  acc_hi, acc_lo = None, None
  while n:
    if n & 1:
      if acc_hi is None:
        acc_hi, acc_lo = hi, lo
      else:
        acc_hi, acc_lo = dd_mul(xp, acc_hi, acc_lo, hi, lo)
    n >>= 1
    if n:
      hi, lo = dd_mul(xp, hi, lo, hi, lo)
  return acc_hi, acc_lo


def pow2(xp: Any, e):
  """2.0**e exactly for integer arrays e in [-1022, 1023], built from the exponent bits."""
  if xp is np:
    return np.ldexp(1.0, e.astype(np.int32))
  from jax import lax  # pylint: disable=import-outside-toplevel
  return lax.bitcast_convert_type((e.astype(xp.int64) + 1023) << 52, xp.float64)


def frexp(xp: Any, v):
  """(m, e) with v = m * 2**e, m in [0.5, 1) (0 for v == 0), for normal float64 v >= 0.

  JAX: from the bits (jnp.frexp does not lower inside an enclosing jit with x64 off)."""
  if xp is np:
    return np.frexp(v)
  from jax import lax  # pylint: disable=import-outside-toplevel
  b = lax.bitcast_convert_type(v, xp.uint64)
  e = (b >> 52).astype(xp.int32) - 1022
  m = lax.bitcast_convert_type((b & ((1 << 52) - 1)) | (1022 << 52), xp.float64)
  zero = v == 0
  return xp.where(zero, 0.0, m), xp.where(zero, 0, e)


# Double-double exp/log/pow for non-integer p: the root's Newton step and (float64 leaves)
# each |x|**p are then accurate to ~2**-95, so no libm pow error enters the bounds.
LN2_HI = 0.6931471805599453
LN2_LO = 2.3190468138462996e-17
EXP_SQUARINGS = 4  # |r| <= ln2/2 / 16 < 0.022; each squaring doubles the relative error


def _dd_const(q: Fraction) -> tuple[float, float]:
  hi = float(q)
  return hi, float(q - Fraction(hi))


# Taylor coefficients 1/k! (k = 16..2) as double-doubles: r**16/16! < 2**-110 for |r| < 0.022.
EXP_COEFFS = tuple(_dd_const(Fraction(1, math.factorial(k))) for k in range(16, 1, -1))
DD_POW_REL_ERR = 2.0 ** -90


def dd_add_d(xp: Any, hi, lo, d):
  """(hi + lo) + d in double-double."""
  s, e = two_sum(xp, hi, d)
  return fast_two_sum(xp, s, e + lo)


def dd_exp(xp: Any, h, l):
  """exp(h + l) as a double-double, for -700 < h < 700 (moderate results only)."""
  k = xp.floor(h / LN2_HI + 0.5)
  p1, e1 = two_prod(xp, k, LN2_HI)
  r_hi, r_lo = two_sum(xp, h, -p1)
  r_hi, r_lo = fast_two_sum(xp, r_hi, r_lo + (l - e1 - k * LN2_LO))
  r_hi = r_hi * 2.0 ** -EXP_SQUARINGS
  r_lo = r_lo * 2.0 ** -EXP_SQUARINGS
  # exp(r) - 1 by Horner in double-double (coefficients past 1/2 need no extra precision).
  zero = xp.zeros_like(h)
  a_hi, a_lo = zero + EXP_COEFFS[0][0], zero + EXP_COEFFS[0][1]
  for c_hi, c_lo in EXP_COEFFS[1:]:
    a_hi, a_lo = dd_mul(xp, a_hi, a_lo, r_hi, r_lo)
    a_hi, a_lo = dd_add_d(xp, a_hi, a_lo + c_lo, zero + c_hi)
  a_hi, a_lo = dd_mul(xp, a_hi, a_lo, r_hi, r_lo)   # r/2 + r^2/6 + ...
  a_hi, a_lo = dd_add_d(xp, a_hi, a_lo, zero + 1.0)
  a_hi, a_lo = dd_mul(xp, a_hi, a_lo, r_hi, r_lo)   # r + r^2/2 + ... = exp(r) - 1
  # Squaring 1 + a as a (2 + a) keeps the "minus one" form, free of cancellation.
  for _ in range(EXP_SQUARINGS):
    t_hi, t_lo = dd_add_d(xp, a_hi, a_lo, zero + 2.0)
    a_hi, a_lo = dd_mul(xp, a_hi, a_lo, t_hi, t_lo)
  e_hi, e_lo = dd_add_d(xp, a_hi, a_lo, zero + 1.0)
  scale = pow2(xp, xp.clip(k, -1000, 1000).astype(xp.int32))
  return e_hi * scale, e_lo * scale


def dd_log(xp: Any, h, l):
  """log(h + l) as a double-double for h > 0 (normal): frexp, then one Newton step."""
  m, e = frexp(xp, h)
  scale = pow2(xp, -e.astype(xp.int32))
  mh, ml = m, l * scale
  y = xp.log(mh)
  x_hi, x_lo = dd_exp(xp, -y, xp.zeros_like(y))
  t_hi, t_lo = dd_mul(xp, mh, ml, x_hi, x_lo)
  t_hi, t_lo = dd_add_d(xp, t_hi, t_lo, xp.zeros_like(y) - 1.0)  # m exp(-y) - 1, tiny
  y_hi, y_lo = fast_two_sum(xp, y, t_hi + t_lo)
  ef = e.astype(y.dtype)
  k_hi, k_lo = two_prod(xp, ef, xp.zeros_like(y) + LN2_HI)
  k_lo = k_lo + ef * LN2_LO
  s_hi, s_lo = two_sum(xp, k_hi, y_hi)
  return fast_two_sum(xp, s_hi, s_lo + (k_lo + y_lo))


def dd_pow(xp: Any, h, l, p: float):
  """(h + l) ** p as a double-double, for h > 0 with a moderate result."""
  y_hi, y_lo = dd_log(xp, h, l)
  z_hi, z_lo = two_prod(xp, y_hi, xp.zeros_like(y_hi) + p)
  z_hi, z_lo = fast_two_sum(xp, z_hi, z_lo + y_lo * p)
  return dd_exp(xp, z_hi, z_lo)
