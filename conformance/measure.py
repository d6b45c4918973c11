"""What a case's data shows, pass or fail: how large its inputs are and how far the result is.

The results table records these for every case (``clipbench.schema``'s ``input_class``,
``result``, ``input_min_abs``... ``rel_error``), so a deviation's class and whether everyday
inputs show it are derived from the case, not written by hand. Extents use float64 and a
scaled norm: they place a case against float16's normal range, far coarser than any rounding.
"""

from __future__ import annotations

import math

import numpy as np

from clipbench.conformance.cases import Inputs
from clipbench.conformance.running import Outcome
from clipbench.reference.formats import Format, format_of


def _spacing(a: np.ndarray, fmt: Format) -> np.ndarray:
  """The distance from each |value| ``a`` to the next float of ``fmt``, subnormals included."""
  e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
  e = np.maximum(np.where(a > 0, e, fmt.emin), fmt.emin)
  return np.exp2(e - fmt.prec + 1)


def _as_float64(x: np.ndarray) -> np.ndarray:
  return np.asarray(x).astype(np.float64)


def _row_masks(op: str, inputs: Inputs, k: int) -> list[np.ndarray]:
  if op == "clip_grad_norm" or inputs.segments is None:
    return [np.ones(x.shape[0] if x.ndim else 1, bool) for x in inputs.leaves]
  return [np.asarray(seg) == k for seg in inputs.segments]


def _systems(op: str, inputs: Inputs, leaves: list[np.ndarray]) -> list[list[np.ndarray]]:
  """Each system's rows of ``leaves`` (shaped like the inputs), as float64."""
  count = 1 if op == "clip_grad_norm" or inputs.segments is None else int(inputs.num_systems)
  out = []
  for k in range(count):
    masks = _row_masks(op, inputs, k)
    out.append([_as_float64(x).reshape(1) if np.ndim(x) == 0 else _as_float64(x)[m]
                for x, m in zip(leaves, masks)])
  return out


def _norm(op: str, inputs: Inputs, system: list[np.ndarray]) -> float:
  """The system's norm in float64, scaled by its largest |x| so no square overflows."""
  flat = np.concatenate([b.ravel() for b in system]) if system else np.zeros(0)
  scale = float(np.max(np.abs(flat))) if flat.size else 0.0
  if scale == 0:
    return 0.0
  if op == "clip_by_max_step":
    rows = [b.reshape(b.shape[0], -1) if b.ndim > 1 else b.reshape(-1, 1) for b in system]
    return scale * max((float(np.max(np.linalg.norm(r / scale, axis=1))) for r in rows
                        if r.size), default=0.0)
  p = float(inputs.norm_type)
  if math.isinf(p):
    return scale if p > 0 else float(np.min(np.abs(flat)))
  return scale * float(np.sum(np.abs(flat / scale) ** p) ** (1 / p))


def input_facts(op: str, inputs: Inputs, *, invalid: bool = False) -> dict[str, object]:
  """``input_class`` and the extents: smallest and largest nonzero |x| and system norm."""
  facts: dict[str, object] = {"input_class": "invalid" if invalid else "finite"}
  try:
    values = [_as_float64(x).ravel() for x in inputs.leaves]
  except (TypeError, ValueError):
    return facts
  flat = np.concatenate(values) if values else np.zeros(0)
  if not np.isfinite(flat).all():
    facts["input_class"] = "invalid" if invalid else "non-finite"
    return facts
  nonzero = np.abs(flat[flat != 0])
  if nonzero.size:
    facts.update(input_min_abs=float(nonzero.min()), input_max_abs=float(nonzero.max()))
  try:
    norms = [n for n in (_norm(op, inputs, s) for s in _systems(op, inputs, inputs.leaves))
             if n > 0]
  except (TypeError, ValueError, IndexError, ZeroDivisionError):
    return facts  # a spoiled argument (bad segments) has no systems to measure
  if norms:
    facts.update(norm_min=min(norms), norm_max=max(norms))
  return facts


def relative_error(op: str, inputs: Inputs, out: Outcome, ref: Outcome,
                   norms_reported: bool = True) -> float:
  """The largest relative error of a system's outputs (normwise: over its largest reference
  element) or of a reported norm, against the reference; inf for NaN or infinity where the
  reference is finite, a flipped sign, or a system zeroed whose reference is not. Elements
  where the reference itself is not finite (a non-finite input) are left out."""
  if out.leaves is None or len(out.leaves) != len(ref.leaves) or any(
      np.shape(y) != np.shape(r) for y, r in zip(out.leaves, ref.leaves)):
    return math.nan
  worst = 0.0
  # The coarsest leaf dtype's spacing: a mixed system may round each leaf to its own.
  dtypes = sorted((format_of(x.dtype) for x in ref.leaves), key=lambda f: f.prec, reverse=True)
  if not dtypes:
    return 0.0
  for got, want in zip(_systems(op, inputs, out.leaves), _systems(op, inputs, ref.leaves)):
    y = np.concatenate([b.ravel() for b in got]) if got else np.zeros(0)
    r = np.concatenate([b.ravel() for b in want]) if want else np.zeros(0)
    keep = np.isfinite(r)
    y, r = y[keep], r[keep]
    if not np.isfinite(y).all() or np.any(np.sign(y) * np.sign(r) < 0):
      return math.inf
    scale = float(np.max(np.abs(r))) if r.size else 0.0
    if scale == 0:
      if np.any(y != 0):
        return math.inf
      continue
    # Each output rounds once to its dtype (rule 4): one spacing at the reference value is
    # rounding, not error, which matters where outputs are subnormal.
    spacing = _spacing(np.abs(r), dtypes[-1])
    if not np.any(y) and np.any(np.abs(r) > spacing):
      # A zeroed update: no tolerance makes it close, unless each reference element is
      # one spacing from zero (the smallest subnormal), which one rounding may take to zero.
      return math.inf
    excess = np.maximum(np.abs(y - r) - spacing, 0.0)
    worst = max(worst, float(np.max(excess)) / scale)
  if norms_reported and out.norms is not None and ref.norms is not None:
    got_norms = _as_float64(out.norms).ravel()
    want_norms = _as_float64(ref.norms).ravel()
    if got_norms.size == want_norms.size:
      for n, e in zip(got_norms, want_norms):
        if math.isnan(e) or (math.isinf(e) and n == e):
          continue
        if not math.isfinite(n):
          return math.inf
        if math.isinf(e):
          continue  # a finite norm reported beyond the norm dtype: the outputs judge it
        worst = max(worst, abs(n - e) / e if e else (0.0 if n == 0 else math.inf))
  return worst


def call_facts(op: str, inputs: Inputs, out: Outcome, ref: Outcome | None,
               norms_reported: bool = True) -> dict[str, object]:
  """Whether the call returned or raised, and, when it returned, its ``rel_error`` (the
  reported norm counts only where the implementation declares it returns one)."""
  if out.error is not None:
    return {"result": "raised"}
  facts: dict[str, object] = {"result": "returned"}
  if ref is not None:
    facts["rel_error"] = relative_error(op, inputs, out, ref, norms_reported)
  return facts
