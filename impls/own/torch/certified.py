"""Certified decisions, vectorized over systems (numpy, on the host).

Each system's clip decision, reported norm and factor (the canonical definitions in
:mod:`clipbench.impls.own.torch`) are taken from its certified interval when the interval
decides them (the rule for random data: ~2**-37 wide against grids of 2**-24..2**-26); the
others are flagged *ambiguous* for the exact path (:mod:`clipbench.impls.own.torch.decisions`).

The shared decision (:func:`clipbench.impls.own.decision.finalize`) does not apply: it defines
the factor differently (a 29-bit cut and rounding toward zero of every element), so its bits
are not these. Its double-double pieces do, with ``xp = numpy``: the decisions run on the host,
so no torch namespace is needed (torch tensors would not do as ``xp``: no ``astype``, and
``torch.where`` does not broadcast Python floats against float64 the way numpy does).
"""

from __future__ import annotations

import numpy as np

from clipbench.impls.own.double_double import fast_two_sum, two_prod, two_sum
from clipbench.impls.own.torch.formats import FMT32

_W24 = 5.0 * 2.0 ** -26


def round_down_to_bits(q: np.ndarray, prec) -> np.ndarray:
  """q >= 0 rounded down to ``prec`` significant bits (unbounded exponent)."""
  m, e = np.frexp(q)
  return np.ldexp(np.floor(np.ldexp(m, prec)), e - prec)


def next_on_grid(v: np.ndarray, prec, up: bool) -> np.ndarray:
  """The neighbour of a ``prec``-bit float v > 0 above (``up``) or below it."""
  m, e = np.frexp(v)
  ulp = np.ldexp(1.0, e - prec)
  return v + ulp if up else v - np.where(m == 0.5, ulp / 2, ulp)


def decide_float32(lo, mid, hi, c, todo):
  """Vectorized certified decisions (norm dtype float32, P = 24).

  Returns (clip, norm, scale, ambiguous); entries with ``ambiguous`` need the exact oracle.
  """
  with np.errstate(all="ignore"):
    amb = ~todo.copy()
    finite_c = np.isfinite(c)
    clip = finite_c & (lo > c)
    keep = ~finite_c | (hi <= c)
    amb |= ~(clip | keep)
    # Reported norm: correctly rounded to float32 when the interval avoids both midpoints.
    r = mid.astype(np.float32)
    prev = np.nextafter(r, np.float32(0)).astype(np.float64)
    nxt = np.nextafter(r, np.float32(np.inf)).astype(np.float64)
    r64 = r.astype(np.float64)
    overflow = float(FMT32.overflow)
    m_lo = (r64 + prev) / 2
    m_hi = np.where(np.isinf(nxt), overflow, (r64 + nxt) / 2)
    exact_r = (lo > m_lo) & (hi < m_hi) & np.isfinite(r64) & (r64 > 0)
    inf_r = np.isinf(r64) & (lo >= overflow)
    amb |= ~(exact_r | inf_r)
    norm = np.where(inf_r, np.inf, r64)
    # Scale: the largest 24-bit s with s * n * (1 + w) <= c, certified from [lo, hi].
    work = clip & ~amb & (c > 0)
    q = np.where(work, c / (np.where(lo > 0, lo, 1.0) * (1 + _W24)), 1.0)
    amb |= work & ~((q > 2.0 ** -1000) & (q < 2.0 ** 1000))
    work &= ~amb
    s = np.where(work, round_down_to_bits(np.where(work, q, 1.0), 24), 0.0)

    def fits_yes(v):
      return hi * (v + v * 5.0 * 2.0 ** -26) * (1 + 2.0 ** -50) <= c

    def fits_no(v):
      return lo * (v + v * 5.0 * 2.0 ** -26) * (1 - 2.0 ** -50) > c

    for _ in range(4):
      down = work & ~fits_yes(s) & fits_no(s)
      s = np.where(down, next_on_grid(np.where(down, s, 1.0), 24, False), s)
    ok = fits_yes(s) & fits_no(next_on_grid(np.where(work, s, 1.0), 24, True))
    amb |= work & ~ok
  return clip, norm, s, amb


def decide_float64(pieces: dict[str, np.ndarray], e: np.ndarray, p: int, c: np.ndarray,
                   prec: np.ndarray, todo: np.ndarray):
  """Vectorized certified decisions for float64 norms (p = 1, 2) in double-double.

  Works in the scaled domain (norm = 2**e * n_s with n_s near 1): ``n_s = nh + nl`` with an
  absolute error bound ``dn``; the clip decision, the correctly rounded norm and the factor
  are taken when the double-double margins exceed ``dn`` (and a few units of 2**-104),
  otherwise the system is flagged ``ambiguous`` for the Python/exact path. Returns
  (clip, norm, s, ambiguous) like ``decide_float32``.
  """
  with np.errstate(all="ignore"):
    amb = ~todo.copy()
    sh, e1 = two_sum(np, pieces["q1"], pieces["q2"])
    sh, e2 = two_sum(np, sh, pieces["qt"])
    sh, e3 = two_sum(np, sh, pieces["rest"])
    sh, sl = fast_two_sum(np, sh, e1 + e2 + e3)
    ds = pieces["bound"] + 2.0 ** -102 * np.abs(sh)  # |S - (sh + sl)| <= ds
    if p == 2:
      nh = np.sqrt(sh)
      ph, pl = two_prod(np, nh, nh)
      nl = (((sh - ph) - pl) + sl) / (2 * nh)
      nh, nl = fast_two_sum(np, nh, nl)
      dn = ds / (1.9 * nh) + 2.0 ** -100 * nh
    else:
      nh, nl, dn = sh, sl, ds
    amb |= ~(np.isfinite(nh) & (nh > 0) & np.isfinite(dn) & (dn < 2.0 ** -70 * nh))
    ok_e = (e > -900) & (e < 900)
    amb |= ~ok_e
    ee = np.where(ok_e, e, 0)
    cs = np.ldexp(c, -ee)  # the threshold in the scaled domain (exact: |e| < 900)
    amb |= ~np.isinf(c) & ~((cs > 2.0 ** -900) & (cs < 2.0 ** 900)) & (c > 0)
    # Clip: n_s vs c_s.
    d = (nh - cs) + nl
    far = (cs >= 2 * nh) | (cs <= nh / 2)
    clip = np.where(far, cs < nh, d > 0) & np.isfinite(c)
    decided = np.isinf(c) | (c == 0) | far | (np.abs(d) > 2 * dn + 2.0 ** -104 * nh)
    amb |= ~decided
    clip |= (c == 0) & todo
    # Reported norm: nh when n_s sits strictly between the midpoints around nh.
    up = np.spacing(nh)
    down = nh - np.nextafter(nh, 0.0)
    exact_r = (nl < up / 2 - dn - 2.0 ** -104 * nh) & (nl > -down / 2 + dn + 2.0 ** -104 * nh)
    norm = np.ldexp(nh, ee)
    amb |= ~exact_r | ~(np.abs(norm) >= 2.0 ** -1022) | ~np.isfinite(norm)
    # Factor: the largest P-bit s with s * n_s * (1 + w) <= c_s.
    w = np.where(prec == 24, 5.0 * 2.0 ** -26, 5.0 * 2.0 ** -55)
    work = clip & ~amb & (c > 0)
    q = np.where(work, cs / nh / (1 + w), 1.0)
    s = round_down_to_bits(q, prec)

    def margin(v):  # c_s - v * (1 + w) * n_s, and whether its sign is certain
      a1, a2 = two_prod(np, v, nh)
      f = ((cs - a1) - a2) - v * nl - (a1 * w + a2 * w)
      err = v * (1 + w) * dn + 2.0 ** -100 * cs
      return f, np.abs(f) > err

    s = np.where(work, s, 1.0)
    s = next_on_grid(next_on_grid(s, prec, True), prec, True)  # start above, then step down
    for _ in range(6):
      f, sure = margin(s)
      down_ = work & sure & (f < 0)
      s = np.where(down_, next_on_grid(np.where(down_, s, 1.0), prec, False), s)
    f, sure = margin(s)
    f2, sure2 = margin(next_on_grid(np.where(work, s, 1.0), prec, True))
    ok = sure & (f >= 0) & sure2 & (f2 < 0) & (s > 2.0 ** -1000)
    amb |= work & ~ok
    s = np.where(c == 0, 0.0, s)
  return clip, norm, s, amb
