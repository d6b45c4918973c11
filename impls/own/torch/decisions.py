"""Per-system actions, factors and reported norms: certified where possible, else exact.

The vectorized certified decisions (:mod:`clipbench.impls.own.torch.certified`) settle almost
every system; float64 systems they leave open go through Python rationals on the certified
pieces; whatever is still open (a near-tie) is decided from an exact oracle
(:mod:`clipbench.impls.own.torch.oracles`). All routes compute the same exact function, so
they give the same bits.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Callable, NamedTuple

import numpy as np

from clipbench.impls.own.decision import KEEP, NAN_FILL, SCALE
from clipbench.impls.own.torch.apply import Plan
from clipbench.impls.own.torch.certified import decide_float32, decide_float64
from clipbench.impls.own.torch.formats import (FMT32, FMT64, Ambiguous, Format, fraction_root,
                                               largest_scale, round_norm)
from clipbench.impls.own.torch.layout import Batch
from clipbench.impls.own.torch.measure import Approx
from clipbench.impls.own.torch.oracles import ValueOracle, exact_oracles


class Request(NamedTuple):
  """What is decided against: thresholds ``c`` (K,), the norm's p, format and factor bits."""

  c: np.ndarray
  p: float
  fmt: Format
  prec: np.ndarray  # (K,) bits of each system's factor: 24 or 53


@dataclasses.dataclass
class Outcome:
  """The decisions being filled in, per system."""

  action: np.ndarray
  norms: np.ndarray
  exact_scales: dict[int, Fraction]

  def record(self, k: int, clip: bool, norm: float, s: Fraction | None) -> None:
    self.norms[k] = norm
    if clip:
      self.action[k] = SCALE
      self.exact_scales[k] = s


def _interval_compare(pieces: dict[str, np.ndarray], k: int, e: int, p: int):
  """compare(t) from the certified float64 pieces of system k, or raise Ambiguous."""
  mid = (Fraction(float(pieces["q1"][k])) + Fraction(float(pieces["q2"][k]))
         + Fraction(float(pieces["qt"][k])) + Fraction(float(pieces["rest"][k])))
  bound = Fraction(float(pieces["bound"][k]))
  s_lo, s_hi = mid - bound, mid + bound
  scale = Fraction(2) ** -e

  def compare(t: Fraction) -> int:
    target = (t * scale) ** p
    if s_hi < target:
      return -1
    if s_lo > target:
      return 1
    raise Ambiguous()

  approx = fraction_root(max(mid, Fraction(0)), p) * Fraction(2) ** e
  return compare, approx


def decide_one(compare: Callable[[Fraction], int], approx: Fraction, c: float, fmt: Format,
               prec: int):
  """(clip, norm, s) for one nonzero finite system from ``compare(t) = sign(norm - t)``."""
  clip = c != math.inf and compare(Fraction(c)) > 0
  norm = round_norm(compare, approx, fmt)
  s = largest_scale(compare, c, prec, approx) if clip else None
  return clip, norm, s


def decide(batch: Batch, approx: Approx, c: np.ndarray, kind: str, p: float,
           certified: bool = True) -> Plan:
  """Per-system actions, factors and reported norms (host side).

  ``certified=False`` (a test mode) sends every system to the exact oracle; the bits must
  not change.
  """
  K = batch.num_systems
  action = np.full(K, KEEP, np.int8)
  scale = np.zeros(K)
  norms = np.zeros(K)
  host_scale: dict[int, Fraction] = {}
  nonfinite = approx.nan | approx.inf
  action[nonfinite] = NAN_FILL
  norms[approx.inf] = math.inf
  norms[approx.nan] = math.nan
  todo = ~nonfinite & ~approx.zero
  request = Request(c, p, FMT64 if batch.norm64 else FMT32, np.where(batch.has_low, 24, 53))
  outcome = Outcome(action, norms, {})
  if not certified or approx.exact_only:
    ambiguous = list(np.flatnonzero(todo))
  elif approx.lo is not None and not batch.norm64 or approx.pieces is not None:
    if approx.pieces is not None:
      clip, norm, s, amb = decide_float64(approx.pieces, approx.e, int(p), c, request.prec,
                                          todo)
    else:
      clip, norm, s, amb = decide_float32(approx.lo, approx.mid, approx.hi, c, todo)
    done = todo & ~amb
    action[done & clip] = SCALE
    norms[done] = norm[done]
    scale[done & clip] = s[done & clip]
    ambiguous = list(np.flatnonzero(todo & amb))
    if approx.pieces is not None:  # the Python interval path may still decide them
      ambiguous = _decide_intervals(approx, request, ambiguous, outcome)
  else:
    ambiguous = _decide_intervals(approx, request, np.flatnonzero(todo).tolist(), outcome)
  ambiguous = [int(k) for k in ambiguous]
  oracles = exact_oracles(batch, kind, p, ambiguous, approx)
  for k in ambiguous:
    oracle = oracles[k]
    if oracle.compare(Fraction(0)) == 0:
      continue  # zero norm (e.g. an all-zero system)
    outcome.record(k, *decide_one(oracle.compare, oracle.approx(), float(c[k]), request.fmt,
                                  int(request.prec[k])))
  for k, s_k in outcome.exact_scales.items():
    scale[k] = float(s_k)
    host_scale[k] = s_k
  with np.errstate(over="ignore"):
    trivial = c == 0  # s = 0: x * 0 is exact
    rn32 = ((scale >= 2.0 ** -126) & (np.ldexp(c, 123) >= batch.counts)) | trivial
    rn64 = ((scale >= 2.0 ** -1022) & (np.ldexp(c, 1019) >= batch.counts)) | trivial
  for k in np.flatnonzero((action == SCALE) & ~rn64).tolist():
    host_scale.setdefault(k, Fraction(float(scale[k])))  # vectorized s: exact normal floats
  return Plan(action, scale, rn32, rn64, norms, host_scale)


def _decide_intervals(approx: Approx, request: Request, systems, outcome: Outcome) -> list[int]:
  """Per-system Python decisions from certified intervals; returns the undecided systems."""
  ambiguous = []
  for k in [int(v) for v in systems]:
    try:
      if approx.pieces is not None:
        compare, est = _interval_compare(approx.pieces, k, int(approx.e[k]), int(request.p))
      else:  # exact values (p = +-inf)
        oracle = ValueOracle(float(approx.mid[k]))
        compare, est = oracle.compare, oracle.approx()
      decided = decide_one(compare, est, float(request.c[k]), request.fmt,
                           int(request.prec[k]))
    except Ambiguous:
      ambiguous.append(k)
      continue
    outcome.record(k, *decided)
  return ambiguous
