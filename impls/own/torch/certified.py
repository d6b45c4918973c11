"""Certified decisions as tensor operations, vectorized over systems, on the data's device.

Each system's clip decision, reported norm and factor (the canonical definitions in
:mod:`clipbench.impls.own.torch`) are taken from its certified interval when the interval
decides them (the rule for random data: ~2**-37 wide against grids of 2**-24..2**-26); the
others are flagged *ambiguous* for the exact path (:mod:`clipbench.impls.own.torch.decisions`).
A fixed sequence of operators whatever the number of systems: on a GPU the decisions cost a
few dozen launches and no host round trip. The Triton route runs the same steps in one kernel
(:mod:`clipbench.impls.own.triton.decision_kernel`); a test holds the two to the same bits.

The shared decision (:func:`clipbench.impls.own.decision.finalize`) does not apply: it defines
the factor differently (a 29-bit cut and rounding toward zero of every element), so its bits
are not these. Its double-double pieces do (they only add and multiply): every operator here
rounds once, with no contraction into fused multiply-adds (eager torch has none to make).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from clipbench.impls.own.double_double import fast_two_sum, two_prod, two_sum
from clipbench.impls.own.torch.floats import (exponent, grid_step, ldexp, on_grid, pow2_normal,
                                              spacing_up, truncate_to_grid)
from clipbench.impls.own.torch.formats import FMT32

W24 = 5.0 * 2.0 ** -26  # the factor's margin w for P = 24 (and 5 * 2**-55 for P = 53)
W53 = 5.0 * 2.0 ** -55
FLOAT32_OVERFLOW = float(FMT32.overflow)  # rounding to float32 sends this and above to inf
STEP24 = 1 << 29  # the bit pattern's step between neighbours of the 24-bit grid
# The factor is looked for among grid neighbours of a first estimate s0 (its truncation to the
# grid), all tried at once: s0 is at most one step high for float32 norms (the interval is far
# narrower than the grid), a few steps either way for float64 (three roundings of q on a grid
# as fine as float64). A factor outside the candidates, or one they cannot certify, leaves the
# system open (the exact path), never wrong.
CANDIDATES_FLOAT32 = (-1, 0, 1)
CANDIDATES_FLOAT64 = (-4, -3, -2, -1, 0, 1, 2, 3)


class Decided(NamedTuple):
  """Per system: clipped, the reported norm, the factor, and whether the interval left the
  system open (only systems to do: nonzero, finite)."""

  clip: torch.Tensor
  norm: torch.Tensor
  scale: torch.Tensor
  ambiguous: torch.Tensor


def _best_candidate(cand: torch.Tensor, fits: torch.Tensor, overshoots: torch.Tensor):
  """The largest candidate that certainly ``fits``, and whether the next one certainly
  ``overshoots`` (which certifies it as the largest of the grid); (K, n) inputs."""
  n = cand.shape[1]
  index = torch.where(fits, torch.arange(n, device=cand.device), -1).amax(1, keepdim=True)
  chosen = cand.gather(1, index.clamp(min=0)).squeeze(1)
  above = overshoots.gather(1, (index + 1).clamp(max=n - 1)).squeeze(1)
  return chosen, (index.squeeze(1) >= 0) & (index.squeeze(1) < n - 1) & above


def decide_float32(lo: torch.Tensor, mid: torch.Tensor, hi: torch.Tensor, c: torch.Tensor,
                   todo: torch.Tensor) -> Decided:
  """Decisions for norm dtype float32 (P = 24) from ``lo <= norm <= hi``, thresholds ``c``."""
  finite_c = torch.isfinite(c)
  clip = finite_c & (lo > c)
  keep = ~finite_c | (hi <= c)
  # Reported norm: correctly rounded to float32 when the interval avoids both midpoints.
  r = mid.to(torch.float32)
  prev = torch.nextafter(r, torch.zeros_like(r)).to(torch.float64)
  nxt = torch.nextafter(r, torch.full_like(r, torch.inf)).to(torch.float64)
  r64 = r.to(torch.float64)
  m_lo = (r64 + prev) / 2
  m_hi = torch.where(torch.isinf(nxt), FLOAT32_OVERFLOW, (r64 + nxt) / 2)
  exact_r = (lo > m_lo) & (hi < m_hi) & torch.isfinite(r64) & (r64 > 0)
  inf_r = torch.isinf(r64) & (lo >= FLOAT32_OVERFLOW)
  decided = todo & (clip | keep) & (exact_r | inf_r)
  norm = torch.where(inf_r, torch.inf, r64)
  # Factor: the largest 24-bit s with s * n * (1 + w) <= c, certified from [lo, hi].
  work = clip & decided & (c > 0)
  q = c / (torch.where(lo > 0, lo, 1.0) * (1 + W24))
  in_range = (q > 2.0 ** -1000) & (q < 2.0 ** 1000)
  s0 = truncate_to_grid(torch.where(in_range, q, 1.0), STEP24)
  offsets = torch.tensor(CANDIDATES_FLOAT32, device=s0.device)
  cand = on_grid(s0.unsqueeze(1), STEP24, offsets)
  grown = cand + cand * W24
  fits = hi.unsqueeze(1) * grown * (1 + 2.0 ** -50) <= c.unsqueeze(-1)
  overshoots = lo.unsqueeze(1) * grown * (1 - 2.0 ** -50) > c.unsqueeze(-1)
  s, ok = _best_candidate(cand, fits, overshoots)
  ambiguous = todo & ~(decided & ~(work & ~(in_range & ok)))
  return Decided(clip, norm, torch.where(work, s, 0.0), ambiguous)


class Pieces(NamedTuple):
  """A float64 system's scaled power sum ``S = q1 + q2 + qt + rest`` (exact to ``bound``).

  ``norm = 2**e * S**(1/p)`` (p = 1, 2): the pieces of the error-free extraction
  (:meth:`clipbench.impls.own.torch.eager_passes.EagerKernels.accurate_sums`), or an exactly
  known value (``q1`` alone, ``bound`` 0: max and min |x|).
  """

  q1: torch.Tensor
  q2: torch.Tensor
  qt: torch.Tensor
  rest: torch.Tensor
  bound: torch.Tensor
  e: torch.Tensor


def decide_float64(pieces: Pieces, p: int, c: torch.Tensor, prec: int | torch.Tensor,
                   todo: torch.Tensor) -> Decided:
  """Decisions for norm dtype float64 (p = 1, 2) in double-double, in the scaled domain.

  ``n_s = nh + nl`` with an absolute error bound ``dn`` (norm = 2**e * n_s, n_s near 1); each
  decision is taken when the double-double margins exceed ``dn`` (and a few units of
  2**-104), otherwise the system is left open. ``prec`` is each system's factor bits, 24 or
  53.
  """
  sh, e1 = two_sum(torch, pieces.q1, pieces.q2)
  sh, e2 = two_sum(torch, sh, pieces.qt)
  sh, e3 = two_sum(torch, sh, pieces.rest)
  sh, sl = fast_two_sum(torch, sh, e1 + e2 + e3)
  ds = pieces.bound + 2.0 ** -102 * sh.abs()  # |S - (sh + sl)| <= ds
  if p == 2:
    nh = torch.sqrt(sh)
    ph, pl = two_prod(torch, nh, nh)
    nl = (((sh - ph) - pl) + sl) / (2 * nh)
    nh, nl = fast_two_sum(torch, nh, nl)
    dn = ds / (1.9 * nh) + 2.0 ** -100 * nh
  else:
    nh, nl, dn = sh, sl, ds
  valid = torch.isfinite(nh) & (nh > 0) & torch.isfinite(dn) & (dn < 2.0 ** -70 * nh)
  ok_e = (pieces.e > -900) & (pieces.e < 900)
  ee = torch.where(ok_e, pieces.e, 0)
  cs = c * pow2_normal(-ee)  # the threshold in the scaled domain (exact: |e| < 900)
  valid = valid & ok_e & (torch.isinf(c) | ((cs > 2.0 ** -900) & (cs < 2.0 ** 900)) | (c == 0))
  # Clip: n_s against c_s.
  d = (nh - cs) + nl
  far = (cs >= 2 * nh) | (cs <= nh / 2)
  clip = (torch.where(far, cs < nh, d > 0) & torch.isfinite(c)) | (c == 0)
  decided = valid & (torch.isinf(c) | (c == 0) | far | (d.abs() > 2 * dn + 2.0 ** -104 * nh))
  # Reported norm: nh when n_s sits strictly between the midpoints around nh.
  up = spacing_up(nh)
  down = nh - torch.nextafter(nh, torch.zeros_like(nh))
  exact_r = ((nl < up / 2 - dn - 2.0 ** -104 * nh) & (nl > -down / 2 + dn + 2.0 ** -104 * nh))
  norm = nh * pow2_normal(ee)
  decided = todo & decided & exact_r & (norm.abs() >= 2.0 ** -1022) & torch.isfinite(norm)
  # Factor: the largest P-bit s with s * n_s * (1 + w) <= c_s.
  w = (W24 if prec == 24 else W53) if isinstance(prec, int) else torch.where(prec == 24, W24, W53)
  work = clip & decided & (c > 0)
  q = torch.where(work, cs / nh / (1 + w), 1.0)
  in_range = (q > 2.0 ** -990) & (q < 2.0 ** 990)
  step = grid_step(prec)
  s0 = truncate_to_grid(torch.where(in_range, q, 1.0), step)
  offsets = torch.tensor(CANDIDATES_FLOAT64, device=s0.device)
  cand = on_grid(s0.unsqueeze(1), step if isinstance(step, int) else step.unsqueeze(1), offsets)
  nh_, nl_, dn_, cs_ = (t.unsqueeze(-1) for t in (nh, nl, dn, cs))
  w_ = w if isinstance(w, float) else w.unsqueeze(1)
  a1, a2 = two_prod(torch, cand, nh_)
  f = ((cs_ - a1) - a2) - cand * nl_ - (a1 * w_ + a2 * w_)  # c_s - s (1 + w) n_s
  sure = f.abs() > cand * (1 + w_) * dn_ + 2.0 ** -100 * cs_
  s, ok = _best_candidate(cand, sure & (f >= 0), sure & (f < 0))
  ambiguous = todo & ~(decided & ~(work & ~(in_range & ok)))
  return Decided(clip, norm, torch.where(work, s, 0.0), ambiguous)


def exact_value_pieces(value: torch.Tensor) -> Pieces:
  """An exactly known float64 norm (max or min |x|) as pieces of p = 1 with no error."""
  ok = torch.isfinite(value) & (value > 0)
  e = torch.where(ok, exponent(torch.where(ok, value, 1.0)), 0)
  zero = torch.zeros_like(value)
  return Pieces(torch.where(ok, ldexp(value, -e), 0.0), zero, zero, zero, zero, e)
