"""What the passes measured, per system, with rigorous bounds: device tensors of shape (K,).

float16/bfloat16/float32 leaves (norm dtype float32): squares and |x| are exact in float64,
and any float64 summation tree of m nonnegative terms is within ``gamma_m = m u / (1 - m u)``
(u = 2**-53) of the exact sum, so a bound needs only the depth. float64 leaves: the pieces of
an error-free extraction (see ``EagerKernels.accurate_sums``). General p: per-system
power-of-two scaling by the largest magnitude, ``pow`` with a per-term error bound. p = +-inf:
exact maxima and minima.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from clipbench.impls.own.torch.certified import Pieces, exact_value_pieces
from clipbench.impls.own.torch.floats import U64, exponent, gamma, pow2_normal
from clipbench.impls.own.torch.layout import Batch

if TYPE_CHECKING:
  from clipbench.impls.own.torch.eager_passes import EagerKernels


@dataclasses.dataclass
class Measured:
  """What the kernels measured, per system (device tensors of shape (K,)).

  ``lo <= norm <= hi`` (float32 norm dtype; exact values for p = +-inf), or for float64 norm
  dtype the ``pieces`` of a scaled power sum. With ``exact_only`` every system with a nonzero
  finite norm takes the exact path. ``values`` keeps the exact max or min |x| (p = +-inf) for
  that path.
  """

  nan: torch.Tensor
  inf: torch.Tensor
  zero: torch.Tensor
  lo: torch.Tensor | None = None
  mid: torch.Tensor | None = None
  hi: torch.Tensor | None = None
  _: dataclasses.KW_ONLY
  pieces: Pieces | None = None
  values: torch.Tensor | None = None
  exact_only: bool = False


def _flags(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
  nan = torch.isnan(values)
  return nan, torch.isinf(values) & ~nan


def scale_exponents(big: torch.Tensor) -> torch.Tensor:
  """e with max |x| in [2**(e-1), 2**e) (0 for zero or non-finite systems)."""
  ok = torch.isfinite(big) & (big > 0)
  return torch.where(ok, exponent(torch.where(ok, big, 1.0)), 0)


def _around(mid: torch.Tensor, rel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
  """(lo, mid, hi): mid widened by the relative error ``rel``, rounded outward."""
  lo = torch.nextafter(mid * (1 - rel), torch.zeros_like(mid))
  hi = torch.nextafter(mid * (1 + rel), torch.full_like(mid, torch.inf))
  return lo.clamp(min=0.0), mid, hi


def measure(kernels: EagerKernels, batch: Batch, kind: str, p: float) -> Measured:
  """Runs the kernels' passes for ``kind`` ("sum", "max", "min", "step")."""
  if kind in ("max", "min"):
    big, small = kernels.extremes(batch, want_min=kind == "min")
    nan, inf = _flags(big)
    value = big if kind == "max" else small
    if batch.norm64:
      return Measured(nan, inf, value == 0, pieces=exact_value_pieces(value), values=value)
    return Measured(nan, inf, value == 0, value, value, value, values=value)
  if kind == "step":
    if batch.norm64:
      big, _ = kernels.extremes(batch, want_min=False)
      nan, inf = _flags(big)
      return Measured(nan, inf, big == 0, exact_only=True)
    best, longest = kernels.step_sums(batch)
    nan, inf = _flags(best)
    rel = gamma(longest + 1) * 0.5001 + 4 * U64
    return Measured(nan, inf, best == 0, *_around(torch.sqrt(best), rel))
  if p in (1.0, 2.0) and not batch.norm64:
    total, depth = kernels.power_sums(batch, p)
    nan, inf = _flags(total)
    mid = torch.sqrt(total) if p == 2 else total
    rel = gamma(depth) * (0.5001 if p == 2 else 1.0001) + 4 * U64
    return Measured(nan, inf, total == 0, *_around(mid, rel))
  big, _ = kernels.extremes(batch, want_min=False)
  nan, inf = _flags(big)
  zero = big == 0
  e = scale_exponents(big)
  if batch.norm64:
    if p not in (1.0, 2.0):
      return Measured(nan, inf, zero, exact_only=True)
    return Measured(nan, inf, zero, pieces=kernels.accurate_sums(batch, int(p), e))
  total, depth = kernels.power_sums(batch, p, pow2_normal(-e))  # float32 data: |e| <= 149
  return Measured(nan, inf, zero, *power_interval(total, depth, batch.counts, e, p,
                                                  kernels.POW_REL_ERR, kernels.POW_ABS_ERR))


def power_interval(total, depth, counts, e, p: float, pow_rel_err: float, pow_abs_err: float):
  """(lo, mid, hi) of ``2**e * S**(1/p)`` from a scaled power sum ``total`` of computed terms.

  Each term ``(|x| 2**-e)**p <= 1`` is within ``pow_rel_err`` relative plus ``pow_abs_err``
  absolute of the exact one; their float64 sum is within gamma(depth) of theirs; the p-th root
  (``pow``, within a few ulps, and a rounded 1/p) adds ``root_err``.
  """
  g = gamma(depth)
  underflow = counts * pow_abs_err
  s_lo = (total - underflow) / ((1 + g) * (1 + pow_rel_err)) * (1 - 4 * U64)
  s_hi = (total + underflow) / ((1 - g) * (1 - pow_rel_err)) * (1 + 4 * U64)
  root_err = (torch.log(total.clamp(min=1e-300)).abs() + 4) * 2.0 ** -51
  scale = pow2_normal(e)  # float32 data (norm dtype float32): exact products, |e| <= 149
  lo = torch.pow(s_lo.clamp(min=0.0), 1.0 / p) * (1 - root_err) * scale
  hi = torch.pow(s_hi, 1.0 / p) * (1 + root_err) * scale
  mid = torch.pow(total, 1.0 / p) * scale
  return torch.where(s_lo > 0, lo, 0.0), mid, hi
