"""Sharded against unsharded, in numpy: identical bits, or how far apart and what it changed.

Rule 14 asks for identical bits. Where they differ, a reader wants to know whether it matters:
the largest difference in ulp (of the leaf dtype for outputs, of the norm dtype for norms),
whether some system's clip decision changed (clipped in one run, kept bitwise in the other),
and whether the sharded output broke the strict bound (rule 4) where the unsharded one held it.
The runners of every engine share this comparison, so a row means the same for JAX and torch.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import numpy as np

from clipbench.conformance import rules
from clipbench.conformance.cases import Inputs


@dataclasses.dataclass
class Comparison:
  """How a sharded call's result relates to the unsharded call's.

  Attributes:
    identical: every output bit and every norm bit equal.
    max_ulp: largest output difference, in ulps of the leaf dtype at the unsharded value.
    norm_ulp: largest norm difference, in ulps of the norm dtype (NaN when no norm returned).
    decision_changed: a system clipped in one run is kept bitwise in the other.
    bound_broken: a clipped system's sharded output has exact norm above the threshold while
      the unsharded output's is at or below it.
    detail: the first difference, in words ("" when identical).
  """

  identical: bool
  max_ulp: float = 0.0
  norm_ulp: float = math.nan
  decision_changed: bool = False
  bound_broken: bool = False
  detail: str = ""

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def compare(op: str, inputs: Inputs, unsharded: tuple[list[np.ndarray], np.ndarray | None],
            sharded: tuple[list[np.ndarray], np.ndarray | None]) -> Comparison:
  """Compares two results of ``op`` on ``inputs`` (each ``(leaves, norms)``, numpy)."""
  base_leaves, base_norms = unsharded
  got_leaves, got_norms = sharded
  if len(base_leaves) != len(got_leaves):
    return Comparison(False, math.inf, detail=f"{len(got_leaves)} leaves sharded, "
                      f"{len(base_leaves)} unsharded")
  detail = ""
  max_ulp = 0.0
  for i, (a, b) in enumerate(zip(base_leaves, got_leaves)):
    if a.shape != b.shape or a.dtype != b.dtype:
      return Comparison(False, math.inf, detail=f"leaves[{i}]: {b.dtype.name}{list(b.shape)} "
                        f"sharded, {a.dtype.name}{list(a.shape)} unsharded")
    if a.tobytes() != b.tobytes():
      max_ulp = max(max_ulp, rules.ulp_distance(b, a))
      if not detail:
        j = rules.first_difference(a, b)
        detail = (f"leaves[{i}] element {j}: {b.ravel()[j]!r} sharded, {a.ravel()[j]!r} "
                  "unsharded")
  norm_ulp, norms_identical = _norm_difference(base_norms, got_norms)
  if not norms_identical and not detail:
    detail = f"norms {_show(got_norms)} sharded, {_show(base_norms)} unsharded"
  if not detail:
    return Comparison(True, 0.0, norm_ulp=0.0 if base_norms is not None else math.nan)
  systems = rules.systems_of(op, inputs)
  return Comparison(
      False, max_ulp, norm_ulp,
      decision_changed=_decisions(base_leaves, systems) != _decisions(got_leaves, systems),
      bound_broken=_bound_broken(op, inputs, systems, base_leaves, got_leaves), detail=detail)


def _show(norms: np.ndarray | None) -> str:
  return "None" if norms is None else np.array2string(np.asarray(norms).ravel()[:4],
                                                      precision=9, separator=", ")


def _norm_difference(a: np.ndarray | None, b: np.ndarray | None) -> tuple[float, bool]:
  if a is None and b is None:
    return math.nan, True
  if a is None or b is None:
    return math.inf, False
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape or a.dtype != b.dtype:
    return math.inf, False
  if a.tobytes() == b.tobytes():
    return 0.0, True
  return rules.ulp_distance(b, a), False


def _decisions(leaves: list[np.ndarray], systems: list[rules.System]) -> list[str]:
  """Per system: ``kept`` (its input bits returned), ``nan`` (all NaN) or ``clipped``."""
  out = []
  for s in systems:
    got = rules.blocks(leaves, s.masks)
    if all(x.tobytes() == y.tobytes() for x, y in zip(s.inputs, got)):
      out.append("kept")
    elif all(np.isnan(y.astype(np.float64)).all() for y in got if y.size):
      out.append("nan")
    else:
      out.append("clipped")
  return out


def _bound_broken(op: str, inputs: Inputs, systems: list[rules.System],
                  base_leaves: list[np.ndarray], got_leaves: list[np.ndarray]) -> bool:
  for s in systems:
    if s.norm is None or s.unchanged:
      continue
    if _over(op, inputs, rules.blocks(got_leaves, s.masks), s.threshold) and not _over(
        op, inputs, rules.blocks(base_leaves, s.masks), s.threshold):
      return True
  return False


def _over(op: str, inputs: Inputs, blocks: list[np.ndarray], threshold: float) -> bool:
  """The exact norm of a clipped system's output is above its threshold (non-finite: yes)."""
  if not rules.is_finite_system(blocks):
    return True
  return rules.output_norm(op, inputs, blocks).compare(Fraction(threshold)) > 0
