"""What the passes measured, per system, with rigorous bounds (the certified approximations).

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

import numpy as np

from clipbench.impls.own.decision import U64
from clipbench.impls.own.torch.layout import Batch

if TYPE_CHECKING:
  from clipbench.impls.own.torch.eager_passes import EagerKernels


def gamma(depth: np.ndarray) -> np.ndarray:
  """gamma_m = m u / (1 - m u): relative error bound of any float64 sum of m >= 0 terms."""
  d = np.asarray(depth, dtype=np.float64)
  return d * U64 / (1 - d * U64)


@dataclasses.dataclass
class Approx:
  """What the kernels measured, per system, with rigorous bounds.

  ``lo <= norm <= hi`` (float32 norm dtype, or exact values for p = +-inf), or for float64
  norm dtype the pieces of a scaled power sum (``pieces``) with ``norm = 2**e * S**(1/p)``.
  Systems with ``exact_only`` always take the exact oracle.
  """

  nan: np.ndarray
  inf: np.ndarray
  zero: np.ndarray
  lo: np.ndarray | None = None
  mid: np.ndarray | None = None
  hi: np.ndarray | None = None
  _: dataclasses.KW_ONLY
  pieces: dict[str, np.ndarray] | None = None
  e: np.ndarray | None = None
  exact_only: bool = False


def _flags(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  nan = np.isnan(values)
  return nan, np.isinf(values) & ~nan


def scale_exponents(big: np.ndarray) -> np.ndarray:
  """e with max |x| in [2**(e-1), 2**e) (0 for zero or non-finite systems)."""
  ok = np.isfinite(big) & (big > 0)
  e = np.frexp(np.where(ok, big, 1.0))[1]
  return np.where(ok, e, 0).astype(np.int64)


def pow2_pair(e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(a, b), both normal floats, with a * b == 2**-e exactly (for |e| up to ~2000)."""
  half = -(e // 2)
  return np.ldexp(1.0, half), np.ldexp(1.0, -e - half)


def _around(mid: np.ndarray, rel: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(lo, mid, hi): mid widened by the relative error ``rel``, rounded outward."""
  with np.errstate(over="ignore", invalid="ignore"):
    lo = np.nextafter(mid * (1 - rel), 0.0)
    hi = np.nextafter(mid * (1 + rel), np.inf)
  return np.maximum(lo, 0.0), mid, hi


def measure(kernels: EagerKernels, batch: Batch, kind: str, p: float) -> Approx:
  """Runs the kernels' passes for ``kind`` ("sum", "max", "min", "step")."""
  if kind in ("max", "min"):
    big, small = kernels.extremes(batch, want_min=kind == "min")
    nan, inf = _flags(big)
    value = big if kind == "max" else small
    return Approx(nan, inf, value == 0, value, value, value)
  if kind == "step":
    if batch.norm64:
      big, _ = kernels.extremes(batch, want_min=False)
      nan, inf = _flags(big)
      return Approx(nan, inf, big == 0, exact_only=True)
    best, longest = kernels.step_sums(batch)
    nan, inf = _flags(best)
    rel = gamma(np.full_like(best, longest + 1)) * 0.5001 + 4 * U64
    mid = np.sqrt(best)
    return Approx(nan, inf, best == 0, *_around(mid, rel))
  if p in (1.0, 2.0) and not batch.norm64:
    total, depth = kernels.power_sums(batch, p)
    nan, inf = _flags(total)
    g = gamma(depth)
    mid = np.sqrt(total) if p == 2 else total
    rel = g * (0.5001 if p == 2 else 1.0001) + 4 * U64
    return Approx(nan, inf, total == 0, *_around(mid, rel))
  big, _ = kernels.extremes(batch, want_min=False)
  nan, inf = _flags(big)
  zero = big == 0
  e = scale_exponents(big)
  if batch.norm64:
    if p not in (1.0, 2.0):
      return Approx(nan, inf, zero, exact_only=True)
    pieces = kernels.accurate_sums(batch, int(p), pow2_pair(e))
    return Approx(nan, inf, zero, pieces=pieces, e=e)
  total, depth = kernels.power_sums(batch, p, np.ldexp(1.0, -e))
  g = gamma(depth)
  pow_err = kernels.POW_REL_ERR
  underflow = batch.counts * kernels.POW_ABS_ERR
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    s_lo = (total - underflow) / ((1 + g) * (1 + pow_err)) * (1 - 4 * U64)
    s_hi = (total + underflow) / ((1 - g) * (1 - pow_err)) * (1 + 4 * U64)
    root_err = (np.abs(np.log(np.maximum(total, 1e-300))) + 4) * 2.0 ** -51
    lo = np.ldexp(np.power(np.maximum(s_lo, 0.0), 1.0 / p) * (1 - root_err), e)
    hi = np.ldexp(np.power(s_hi, 1.0 / p) * (1 + root_err), e)
    mid = np.ldexp(np.power(total, 1.0 / p), e)
  lo = np.where(s_lo > 0, lo, 0.0)
  return Approx(nan, inf, zero, lo, mid, hi)
