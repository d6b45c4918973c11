"""The exact reference of the three clipping operations: it is the spec (see SPEC.md).

For every system k with elements x (every element of every row assigned to k, across all
leaves) and threshold c_k:

* the norm ``n_k`` is exact (``norms.ExactNorm``); it is reported correctly rounded into the
  norm dtype (float32, or float64 when any leaf is float64);
* if ``n_k <= c_k`` exactly, the system's elements are returned bitwise unchanged (rule 3);
* otherwise ``s`` is the largest 53-bit float with ``s * n_k <= c_k`` and every element becomes
  ``x * s`` rounded toward zero into its leaf dtype (rule 4). Rounding toward zero can only
  shrink magnitudes, so the output norm is at most ``s * n_k <= c_k`` for every p and for the
  step norm alike, and each element is within 1 ulp of ``x * s``.

Non-finite elements follow rule 7 and empty inputs rule 8. Nothing here is fast; each step
can be checked by hand.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Callable, Sequence

import numpy as np

from clipbench.reference import validation
from clipbench.reference.formats import FORMATS, Format, format_of, round_to_format
from clipbench.reference.norms import ExactNorm, exact_power_sum, largest_scale_within


def norm_format(leaves: Sequence[np.ndarray]) -> Format:
  """Norm dtype: float64 if any leaf is float64, else float32 (SPEC, canonical API)."""
  if any(leaf.dtype == np.float64 for leaf in leaves):
    return FORMATS["float64"]
  return FORMATS["float32"]


def system_norm(blocks: Sequence[np.ndarray], norm_type: float) -> ExactNorm:
  """Rule 1: the p-norm of every element of the system's rows, across all leaves."""
  if not blocks:
    return ExactNorm(np.zeros(0), norm_type)
  return ExactNorm(np.concatenate([b.astype(np.float64).ravel() for b in blocks]), norm_type)


def system_step_norm(blocks: Sequence[np.ndarray]) -> ExactNorm:
  """Rule 2: the largest L2 norm of the system's vectors (last axis; 1-D: 1-vectors)."""
  largest, largest_square = np.zeros(0), Fraction(-1)
  for block in blocks:
    vectors = block.astype(np.float64)
    vectors = vectors.reshape(-1, 1) if vectors.ndim <= 1 else vectors.reshape(
        -1, vectors.shape[-1])
    for vector in vectors:
      square = exact_power_sum(np.abs(vector), 2)
      if square > largest_square:
        largest, largest_square = vector, square
  return ExactNorm(largest, 2.0)


def scale_toward_zero(block: np.ndarray, s: Fraction) -> np.ndarray:
  """Rule 4: x * s rounded toward zero into the block's dtype; zeros keep the sign of x."""
  fmt = format_of(block.dtype)
  values = [
      math.copysign(round_to_format(Fraction(v) * s, fmt, "toward_zero"), v) if s else
      math.copysign(0.0, v) for v in block.astype(np.float64).ravel().tolist()
  ]
  return np.array(values, dtype=np.float64).reshape(block.shape).astype(block.dtype)


def _clip_systems(leaves: list[np.ndarray], thresholds: list, segments: list[np.ndarray],
                  num_systems: int, nonfinite: str,
                  measure: Callable[[list[np.ndarray]], ExactNorm]) -> tuple[list, np.ndarray]:
  fmt = norm_format(leaves)
  out = [leaf.copy() for leaf in leaves]
  norms = np.zeros(num_systems, dtype=fmt.dtype)
  rows = [[seg == k for seg in segments] for k in range(num_systems)]
  for k in range(num_systems):
    blocks = [_rows(leaf, mask) for leaf, mask in zip(leaves, rows[k])]
    finite = all(np.isfinite(b.astype(np.float64)).all() for b in blocks)
    if not finite and nonfinite == "propagate":
      # Rule 7: the system's norm is NaN if any element is NaN, else +inf; its output all NaN.
      has_nan = any(np.isnan(b.astype(np.float64)).any() for b in blocks)
      norms[k] = math.nan if has_nan else math.inf
      for leaf, mask in zip(out, rows[k]):
        _assign(leaf, mask, np.full(_rows(leaf, mask).shape, np.nan, dtype=leaf.dtype))
      continue
    if not finite:  # nonfinite == "zero": non-finite elements count as 0 and are 0 in the output.
      blocks = [np.where(np.isfinite(b.astype(np.float64)), b, np.zeros((), b.dtype))
                for b in blocks]
      for leaf, mask, block in zip(out, rows[k], blocks):
        _assign(leaf, mask, block)
    norm = measure(blocks)
    norms[k] = norm.rounded(fmt)
    c = thresholds[k]
    if c == math.inf or norm.compare(c) <= 0:
      continue  # Rule 3: at or below the threshold, bitwise unchanged.
    s = largest_scale_within(c, norm)
    for leaf, mask, block in zip(out, rows[k], blocks):
      _assign(leaf, mask, scale_toward_zero(block, s))
  return out, norms


def _rows(leaf: np.ndarray, mask: np.ndarray) -> np.ndarray:
  return leaf.reshape(1) if leaf.ndim == 0 else leaf[mask]


def _assign(leaf: np.ndarray, mask: np.ndarray, values: np.ndarray) -> None:
  if leaf.ndim == 0:
    leaf[()] = values.reshape(())
  else:
    leaf[mask] = values


def clip_by_global_norm(leaves: Sequence[np.ndarray], max_norm: Any, *, segments: Any = None,
                        num_systems: Any = None, norm_type: Any = 2.0,
                        nonfinite: str = "propagate") -> tuple[list[np.ndarray], np.ndarray]:
  """Per-system global-norm clipping: each system scaled so its p-norm is at most max_norm.

  Returns the clipped leaves and the exact norms of shape ``(num_systems,)`` (``(1,)`` when
  ``segments`` is None), correctly rounded into the norm dtype.
  """
  leaves = validation.check_leaves(leaves)
  segs, count = validation.check_segments(leaves, segments, num_systems)
  thresholds = validation.check_threshold(max_norm, "max_norm", count)
  p = validation.check_norm_type(norm_type)
  nonfinite = validation.check_nonfinite(nonfinite)
  return _clip_systems(leaves, thresholds, segs, count, nonfinite,
                       lambda blocks: system_norm(blocks, p))


def clip_by_max_step(leaves: Sequence[np.ndarray], max_step: Any, *, segments: Any = None,
                     num_systems: Any = None,
                     nonfinite: str = "propagate") -> tuple[list[np.ndarray], np.ndarray]:
  """Per-system max-step clipping: each system scaled so its largest vector norm is <= max_step.

  Vectors lie along the last axis; a 1-D leaf holds 1-vectors. Returns the clipped leaves and
  the exact step norms (largest vector L2 norm per system), correctly rounded.
  """
  leaves = validation.check_leaves(leaves)
  segs, count = validation.check_segments(leaves, segments, num_systems)
  thresholds = validation.check_threshold(max_step, "max_step", count)
  nonfinite = validation.check_nonfinite(nonfinite)
  return _clip_systems(leaves, thresholds, segs, count, nonfinite, system_step_norm)


def clip_grad_norm(leaves: Sequence[np.ndarray], max_norm: Any, *, norm_type: Any = 2.0,
                   nonfinite: str = "propagate") -> tuple[list[np.ndarray], np.ndarray]:
  """Global p-norm clipping of all leaves together; returns the leaves and the 0-d total norm."""
  leaves = validation.check_leaves(leaves)
  thresholds = validation.check_threshold(max_norm, "max_norm", None)
  p = validation.check_norm_type(norm_type)
  nonfinite = validation.check_nonfinite(nonfinite)
  segs, _ = validation.check_segments(leaves, None, None)
  out, norms = _clip_systems(leaves, thresholds, segs, 1, nonfinite,
                             lambda blocks: system_norm(blocks, p))
  return out, norms.reshape(())
