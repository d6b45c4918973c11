"""Compiled scalar twin of ``decision.finalize``: one system's norm, action and factor.

The norm is known within a rigorous bound (``(n-1) 2**-53`` relative for n float32 squares);
a threshold inside that bound is a near-tie settled exactly on the host
(:mod:`~clipbench.impls.own.numba.ties`); the factor s is the largest float with
``s * n_up <= c``. The same steps as the shared, vectorised ``decision.finalize``, one system
at a time and without array temporaries (``nextafter``, ``frexp``, ``ldexp`` and powers of two
on the bits, far cheaper than the libm calls), with one difference: factors of calls without
float64 leaves keep 24 bits, not ``decision.SHORT_SCALE_BITS`` (29), so the float32 apply
needs no float64 (``apply.scale_f32_fma``); truncation costs < 2**-23 = 2u of float32, the
coarsest such dtype, within rule 4's 4u of c / n. The fused kernels call ``finalize_one`` per system and
the general route ``finalize_systems`` over arrays, so both routes give the same bits.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from clipbench.impls.own import decision
from clipbench.impls.own import double_double as shared
from clipbench.impls.own.numba.double_double import (COEFFS_HI, COEFFS_LO, dd_int_power, dd_pow,
                                                     two_prod, two_sum)
from clipbench.impls.own.numba.intrinsics import JIT, f64, u64
from clipbench.impls.own.numba.records import SystemSums, Threshold

SCALE_BITS = 24


@njit(inline="always", **JIT)
def next_up(v):
  """np.nextafter(v, inf) on the bits."""
  if v != v or v == np.inf:
    return v
  if v == 0.0:
    return f64(np.uint64(1))
  return f64(u64(v) + np.uint64(1)) if v > 0.0 else f64(u64(v) - np.uint64(1))


@njit(inline="always", **JIT)
def next_toward_zero(v):
  """np.nextafter(v, 0.0) on the bits."""
  if v != v:
    return v
  if v == 0.0:
    return 0.0
  return f64(u64(v) - np.uint64(1))


@njit(inline="always", **JIT)
def pow2(k):
  """2.0 ** k for a normal power, -1022 <= k <= 1023, from its exponent bits."""
  return f64(np.uint64(k + 1023) << np.uint64(52))


_EXPONENT = np.uint64(0x7FF) << np.uint64(52)


@njit(inline="always", **JIT)
def frexp_bits(v):
  """math.frexp(v) (mantissa, int64 exponent) on the bits for a normal v; libm's call (~10 ns,
  far more than the rest of a tiny system's decision) only for 0, subnormals, inf and NaN."""
  field = np.int64((u64(v) >> np.uint64(52)) & np.uint64(0x7FF))
  if field == 0 or field == 0x7FF:
    m, e = math.frexp(v)
    return m, np.int64(e)
  return f64((u64(v) & ~_EXPONENT) | (np.uint64(1022) << np.uint64(52))), field - 1022


@njit(inline="always", **JIT)
def ldexp_bits(m, e):
  """math.ldexp(m, e) on the bits when m and the result are normal, else libm's call."""
  field = np.int64((u64(m) >> np.uint64(52)) & np.uint64(0x7FF))
  if field == 0 or field == 0x7FF or e < 1 - field or e > 0x7FE - field:
    return math.ldexp(m, e)
  return f64((u64(m) & ~_EXPONENT) | (np.uint64(field + e) << np.uint64(52)))


@njit(inline="always", **JIT)
def sum_rel_err_of_squares(count):
  """Twin of ``decision.sum_rel_err(count, 0.0)`` for one system (the same operations)."""
  k = max(np.float64(count) - 1.0, 0.0) * decision.U64
  acc = k / max(1.0 - k, 0.5)
  return 0.0 + acc * (1.0 + 0.0) + 2.0 ** -1000


@njit(inline="always", **JIT)
def _root(s_hi, s_lo, rel_err, p):
  """Twin of ``decision.root``: (r_hi, r_lo, eps), S ** (1/p) and its relative error bound."""
  if math.isinf(p):
    return 1.0, 0.0, 0.0
  if p == 1.0:
    r_hi = s_hi + s_lo
    return r_hi, s_lo - (r_hi - s_hi), rel_err + 2.0 ** -80
  pos = s_hi > 0
  safe = s_hi if pos else 1.0
  q_err = 0.0
  if p == 2.0:
    r = math.sqrt(safe)
    q_hi, q_lo = two_prod(r, r)
  elif p == math.floor(p) and p <= 64.0:
    r = safe ** (1.0 / p)
    q_hi, q_lo = dd_int_power(r, int(p))
  else:
    r = safe ** (1.0 / p)
    q_hi, q_lo = dd_pow(r, 0.0, p, COEFFS_HI, COEFFS_LO)
    q_err = shared.DD_POW_REL_ERR
  d_hi, d_lo = two_sum(safe, -q_hi)
  delta = (d_hi + (d_lo + ((s_lo if pos else 0.0) - q_lo))) / (p * q_hi)
  r_hi = r + r * delta
  r_lo = r * delta - (r_hi - r)
  if not pos:
    r_hi, r_lo = 0.0, 0.0
  re = rel_err
  return r_hi, r_lo, re / p + re * re + q_err / p + 2.0 ** -80


@njit(inline="always", **JIT)
def finalize_one(sums, threshold, p, precise):
  """One system of ``decision.finalize``: (norm_v, action, s_m, s_e, tie), from its
  :class:`~clipbench.impls.own.numba.records.SystemSums` and scalar ``Threshold``."""
  if sums.nan or sums.inf or not math.isfinite(sums.s_hi):
    # Poisoned (its sums are not finite): NaN outputs; the norm is set by the caller.
    return 0.0, decision.NAN_FILL, 0.0, 0, False
  c_m, c_e, c_inf = threshold
  sc_m = sums.sc_m
  r_hi, r_lo, eps = _root(sums.s_hi, sums.s_lo, sums.rel_err, p)
  t_hi, t_lo = two_prod(sc_m, r_hi)
  t_lo = t_lo + sc_m * r_lo
  t = t_hi + t_lo
  t_lo = t_lo - (t - t_hi)
  t_hi = t
  if eps == 0.0:
    up = lo = t_hi
  else:
    slack = t_hi * eps
    up = next_up(t_hi + (t_lo + slack))
    lo = next_toward_zero(t_hi + (t_lo - slack))
  norm_v = t_hi + t_lo
  d = np.int64(c_e) - np.int64(sums.sc_e)
  c_pos = c_m > 0
  c_t = c_m * pow2(min(max(d, -1000), 1000))
  keep = c_inf or sums.zero or (c_pos and (d >= 1000 or (d > -1000 and c_t >= up)))
  clip = (not keep) and ((not c_pos) or d <= -1000 or c_t < lo)
  is_tie = (not keep) and (not clip)
  active = not (keep or sums.zero)
  if precise:
    margin = t_lo + t_hi * (eps + 2.0 ** -100)
    q = c_m / (t_hi + margin) if active else c_m
    for _ in range(3):
      prod, err = two_prod(q, t_hi)
      if (prod - c_m) + err + q * margin > 0:
        q = next_toward_zero(q)
    for _ in range(2):
      nxt = next_up(q)
      prod, err = two_prod(nxt, t_hi)
      if (prod - c_m) + err + nxt * margin <= 0:
        q = nxt
  else:
    q = c_m / up if active else c_m
    q = q * (1.0 - 2.0 ** -50)
  q_m, q_e = frexp_bits(q)
  if not precise:
    q_m = math.floor(q_m * 2.0 ** SCALE_BITS) * 2.0 ** -SCALE_BITS
  if c_m == 0:
    s_m, s_e = 0.0, 0
  else:
    s_m, s_e = q_m, q_e + d
  return norm_v, decision.KEEP if keep else decision.SCALE, s_m, s_e, is_tie


@njit(**JIT)
def finalize_systems(sums, threshold, p, precise):
  """``finalize_one`` for every system of ``sums`` and ``threshold`` (records of arrays)."""
  s = sums.s_hi.size
  norm_v = np.empty(s)
  action = np.empty(s, dtype=np.int8)
  s_m = np.empty(s)
  s_e = np.empty(s, dtype=np.int32)
  tie = np.zeros(s, dtype=np.bool_)
  for k in range(s):
    one = SystemSums(sums.s_hi[k], sums.s_lo[k], sums.sc_m[k], sums.sc_e[k], sums.rel_err[k],
                     sums.zero[k], sums.nan[k], sums.inf[k])
    c = Threshold(threshold.c_m[k], threshold.c_e[k], threshold.c_inf[k])
    norm_v[k], action[k], s_m[k], s_e[k], tie[k] = finalize_one(one, c, p, precise)
  return norm_v, action, s_m, s_e, tie
