"""Compiled scalar twins of :mod:`clipbench.impls.own.double_double` (one value at a time).

The shared module works on whole arrays (numpy or ``jax.numpy``) with Dekker's splitting; the
kernels need the same arithmetic per element and per system, where an FMA gives the exact
product error directly. Each function names the shared one it twins. ``dd_exp``/``dd_pow``
follow the shared reduction, Taylor terms and squarings step for step.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from clipbench.impls.own import double_double as shared
from clipbench.impls.own.numba.intrinsics import JIT, fma

COEFFS_HI = np.array([c[0] for c in shared.EXP_COEFFS])
COEFFS_LO = np.array([c[1] for c in shared.EXP_COEFFS])


@njit(inline="always", **JIT)
def dd_add(hi, lo, t_hi, t_lo):
  """(hi + lo) + (t_hi + t_lo), for accumulating sums (the lo parts summed plainly)."""
  s = hi + t_hi
  bb = s - hi
  e = (hi - (s - bb)) + (t_hi - bb)
  return s, lo + (e + t_lo)


@njit(inline="always", **JIT)
def two_prod(a, b):
  """Twin of ``double_double.two_prod``: p + e == a * b exactly (from an FMA)."""
  p = a * b
  return p, fma(a, b, -p)


@njit(inline="always", **JIT)
def two_sum(a, b):
  """Twin of ``double_double.two_sum``: s + e == a + b exactly."""
  s = a + b
  bb = s - a
  return s, (a - (s - bb)) + (b - bb)


@njit(inline="always", **JIT)
def dd_mul(ah, al, bh, bl):
  """Twin of ``double_double.dd_mul``."""
  p, e = two_prod(ah, bh)
  e += ah * bl + al * bh
  s = p + e
  return s, e - (s - p)


@njit(inline="always", **JIT)
def dd_add_d(hi, lo, d):
  """Twin of ``double_double.dd_add_d``: (hi + lo) + d."""
  s, e = two_sum(hi, d)
  e += lo
  t = s + e
  return t, e - (t - s)


@njit(**JIT)
def dd_int_power(r, n):
  """Twin of ``double_double.dd_int_power``: r**n for integer n >= 1."""
  hi, lo = r, 0.0
  acc_hi, acc_lo = 1.0, 0.0
  first = True
  while n:
    if n & 1:
      if first:
        acc_hi, acc_lo = hi, lo
        first = False
      else:
        acc_hi, acc_lo = dd_mul(acc_hi, acc_lo, hi, lo)
    n >>= 1
    if n:
      hi, lo = dd_mul(hi, lo, hi, lo)
  return acc_hi, acc_lo


@njit(**JIT)
def dd_exp(h, l, coeffs_hi, coeffs_lo):
  """Twin of ``double_double.dd_exp`` (same reduction, Taylor terms and squarings)."""
  k = math.floor(h / shared.LN2_HI + 0.5)
  p1, e1 = two_prod(k, shared.LN2_HI)
  r_hi, r_lo = two_sum(h, -p1)
  r_lo += l - e1 - k * shared.LN2_LO
  t = r_hi + r_lo
  r_lo = r_lo - (t - r_hi)
  r_hi = t * 0.0625
  r_lo = r_lo * 0.0625
  a_hi, a_lo = coeffs_hi[0], coeffs_lo[0]
  for i in range(1, coeffs_hi.size):
    a_hi, a_lo = dd_mul(a_hi, a_lo, r_hi, r_lo)
    a_hi, a_lo = dd_add_d(a_hi, a_lo + coeffs_lo[i], coeffs_hi[i])
  a_hi, a_lo = dd_mul(a_hi, a_lo, r_hi, r_lo)
  a_hi, a_lo = dd_add_d(a_hi, a_lo, 1.0)
  a_hi, a_lo = dd_mul(a_hi, a_lo, r_hi, r_lo)
  for _ in range(4):
    t_hi, t_lo = dd_add_d(a_hi, a_lo, 2.0)
    a_hi, a_lo = dd_mul(a_hi, a_lo, t_hi, t_lo)
  e_hi, e_lo = dd_add_d(a_hi, a_lo, 1.0)
  if k < -1000.0:
    return 0.0, 0.0  # far below the system's largest term (>= 2**-512): negligible
  s = math.ldexp(1.0, int(k))
  return e_hi * s, e_lo * s


@njit(**JIT)
def dd_pow(a, a_lo, p, coeffs_hi, coeffs_lo):
  """Twin of ``double_double.dd_pow``: (a + a_lo)**p (0 < a <= 1), via dd log and dd exp."""
  m, e = math.frexp(a)
  ml = math.ldexp(a_lo, -e)
  y = math.log(m)
  x_hi, x_lo = dd_exp(-y, 0.0, coeffs_hi, coeffs_lo)
  t_hi, t_lo = dd_mul(m, ml, x_hi, x_lo)
  t_hi, t_lo = dd_add_d(t_hi, t_lo, -1.0)
  y_hi = y + (t_hi + t_lo)
  y_lo = (t_hi + t_lo) - (y_hi - y)
  k_hi, k_lo = two_prod(float(e), shared.LN2_HI)
  k_lo += float(e) * shared.LN2_LO
  s_hi, s_lo = two_sum(k_hi, y_hi)
  s_lo += k_lo + y_lo
  z_hi, z_lo = two_prod(s_hi, p)
  z_lo += s_lo * p
  if z_hi < -740.0:
    return 0.0, 0.0
  return dd_exp(z_hi, z_lo, coeffs_hi, coeffs_lo)
