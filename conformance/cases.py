"""The fixed edge-case table: named inputs, each tagged with the SPEC rules it exercises.

A case builds numpy inputs for one operation (``build(op)``); the conformance tests pick the
cases of their rule. Sizes of the ``large_*`` cases cross the block boundaries a kernel would
use (thousands of rows, hundreds of systems, unsorted and interleaved segments).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
GLOBAL_OPS = ("clip_by_global_norm", "clip_by_max_step", "clip_grad_norm")
PER_SYSTEM_OPS = ("clip_by_global_norm", "clip_by_max_step")
NORM_OPS = ("clip_by_global_norm", "clip_grad_norm")
P_VALUES = (1.0, 1.5, 2.0, 3.0, 7.0, math.inf, -math.inf)


@dataclasses.dataclass
class Inputs:
  """One canonical call's arguments, in numpy."""

  leaves: list[np.ndarray]
  threshold: Any
  segments: list[np.ndarray] | None = None
  num_systems: int | None = None
  norm_type: float = 2.0
  nonfinite: str = "propagate"

  @property
  def per_system(self) -> bool:
    return self.segments is not None

  @property
  def dtypes(self) -> set[str]:
    return {x.dtype.name for x in self.leaves}

  def kwargs(self, op: str) -> dict[str, Any]:
    kw: dict[str, Any] = {"nonfinite": self.nonfinite}
    if op != "clip_grad_norm":
      kw["segments"] = self.segments
      kw["num_systems"] = self.num_systems
    if op != "clip_by_max_step":
      kw["norm_type"] = self.norm_type
    return kw

  def copy(self) -> "Inputs":
    return dataclasses.replace(
        self, leaves=[x.copy() for x in self.leaves],
        segments=None if self.segments is None else [s.copy() for s in self.segments],
        threshold=self.threshold.copy() if isinstance(self.threshold, np.ndarray) else
        self.threshold)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  rules: tuple[int, ...]
  build: Callable[[str], Inputs]
  ops: tuple[str, ...] = GLOBAL_OPS
  description: str = ""


def _vec(values, dtype=np.float32, op="clip_grad_norm"):
  """A leaf holding ``values``: flat for the norm ops, one vector per row for max-step."""
  x = np.array(values, dtype=np.float64).astype(dtype)
  return x.reshape(1, -1) if op == "clip_by_max_step" else x


def _global(values, threshold, dtype=np.float32, **kw):
  return lambda op: Inputs([_vec(values, dtype, op)], threshold, **kw)


def _random_batch(seed: int, num_systems: int, rows: tuple[int, int], dtype=np.float32,
                  threshold=1.0, shuffle=True, scale=1.0, with_cell=True) -> Inputs:
  """Positions (n, 3) with shuffled (interleaved) system ids, plus a per-system (3, 3) leaf."""
  rng = np.random.default_rng(seed)
  sizes = rng.integers(rows[0], rows[1] + 1, size=num_systems)
  ids = np.repeat(np.arange(num_systems), sizes)
  if shuffle:
    rng.shuffle(ids)
  positions = (rng.standard_normal((ids.size, 3)) * scale).astype(dtype)
  leaves, segments = [positions], [ids]
  if with_cell:
    leaves.append((rng.standard_normal((num_systems, 3, 3)) * scale).astype(dtype))
    segments.append(np.arange(num_systems))
  return Inputs(leaves, threshold, segments, num_systems)


def _per_system(build_batch: Callable[[], Inputs]):
  return lambda op: build_batch()


def _own_norm_threshold(op: str, above: bool) -> Inputs:
  """max a rounding error away from the exact norm: just below (must clip) or at/above it."""
  from clipbench.reference import system_norm, system_step_norm  # pylint: disable=import-outside-toplevel
  from fractions import Fraction
  rng = np.random.default_rng(11)
  x = rng.standard_normal((40, 3)).astype(np.float32)
  leaves = [x if op == "clip_by_max_step" else x.ravel()]
  norm = system_step_norm(leaves) if op == "clip_by_max_step" else system_norm(leaves, 2.0)
  t = float(norm.approximate())  # float64 nearest
  while norm.compare(Fraction(t)) < 0 and not above:
    t = math.nextafter(t, 0.0)
  while norm.compare(Fraction(t)) > 0 and above:
    t = math.nextafter(t, math.inf)
  if not above and norm.compare(Fraction(t)) == 0:
    t = math.nextafter(t, 0.0)
  return Inputs(leaves, t)


def _mixed(dtypes, threshold=1.0):
  def build(op):
    rng = np.random.default_rng(5)
    leaves = [(rng.standard_normal((7, 3)) * 10).astype(d) for d in dtypes]
    if op != "clip_by_max_step":
      leaves = [x.ravel() for x in leaves]
    return Inputs(leaves, threshold)
  return build


def _random_global(seed, n, dtype, threshold=1.0, scale=1.0, norm_type=2.0, leaves=3):
  def build(op):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(leaves):
      x = rng.standard_normal((n, 3)) * scale * np.exp(rng.uniform(-2, 2))
      out.append(x.astype(dtype) if op == "clip_by_max_step" else x.ravel().astype(dtype))
    return Inputs(out, threshold, norm_type=norm_type)
  return build


def _nonfinite_batch(value: float, nonfinite: str = "propagate"):
  def build(op):
    inputs = _random_batch(21, 6, (1, 4), threshold=1.0, shuffle=True)
    target = inputs.segments[0] == 2
    rows = np.flatnonzero(target)
    inputs.leaves[0][rows[0], 1] = value
    inputs.nonfinite = nonfinite
    return inputs
  return build


def _empty_system():
  def build(op):
    inputs = _random_batch(3, 5, (2, 5), with_cell=False)
    inputs.segments[0] = np.where(inputs.segments[0] == 1, 0, inputs.segments[0])
    inputs.leaves.append(np.zeros((0, 3), np.float32))
    inputs.segments.append(np.zeros(0, np.int64))
    inputs.num_systems = 7  # systems 1, 5 and 6 have no rows
    return inputs
  return build


def _per_system_thresholds():
  def build(op):
    inputs = _random_batch(8, 12, (1, 6))
    rng = np.random.default_rng(9)
    thresholds = rng.uniform(0.1, 4.0, size=12)
    thresholds[3], thresholds[7] = math.inf, 0.0
    inputs.threshold = thresholds.astype(np.float32).astype(np.float64)
    return inputs
  return build


def _cross_leaf_system():
  def build(op):
    rng = np.random.default_rng(4)
    a = rng.standard_normal((5, 3)).astype(np.float32)
    b = rng.standard_normal((4, 3)).astype(np.float32)
    return Inputs([a, b], 0.5, [np.array([0, 1, 0, 2, 1]), np.array([2, 0, 0, 1])], 3)
  return build


def _one_d_max_step():
  return lambda op: Inputs([np.array([3.0, 0.1, -2.0, 0.5], np.float32)], 1.0,
                           [np.array([0, 1, 2, 2])], 3)


_SUBNORMAL = float(np.float32(1e-40))

CASES: tuple[Case, ...] = (
    # Rule 3: at or below the threshold, bitwise unchanged.
    Case("all_zeros", (3, 8), _global([0.0, -0.0, 0.0, 0.0], 1.0)),
    Case("tie_3_4", (3,), _global([3.0, 4.0], 5.0)),
    Case("tie_3_4_float16", (3,), _global([3.0, 4.0], 5.0, np.float16)),
    Case("tie_3_4_float64", (3,), _global([3.0, 4.0], 5.0, np.float64)),
    Case("tie_zero_zero", (3, 6), _global([0.0, 0.0], 0.0)),
    Case("tie_small_3e-7", (3,), _global([3e-7, 4e-7], float(np.float32(5e-7)), np.float64)),
    Case("norm_just_above_max", (3, 4), lambda op: _own_norm_threshold(op, above=False)),
    Case("max_just_above_norm", (3,), lambda op: _own_norm_threshold(op, above=True)),
    Case("below_threshold_41", (3,), _global([3.0, 4.0], 41.0)),
    Case("subnormals_only", (3, 5), _global([_SUBNORMAL] * 4, 1.0)),
    # Rule 4: strict bound, one factor.
    Case("clip_3_4_to_1", (4, 5), _global([3.0, 4.0], 1.0)),
    Case("one_element", (4, 5), _global([7.0], 2.0)),
    Case("random_float32", (4, 5, 9), _random_global(1, 60, np.float32)),
    Case("random_float64", (4, 5, 9), _random_global(2, 60, np.float64)),
    Case("random_float16", (4, 5, 9), _random_global(3, 60, np.float16)),
    Case("random_bfloat16", (4, 5, 9), _random_global(4, 60, BF16)),
    # Rule 5: no overflow or underflow on the way.
    Case("float32_1e20", (4, 5), _global([1e20, 1e20], 1.0)),
    Case("float32_3e38", (4, 5), _global([3e38, 3e38, 3e38], 1.0)),
    Case("float16_300", (4, 5), _global([300.0, 400.0], 1.0, np.float16)),
    Case("float16_6e4", (4, 5), _global([6e4, 6e4], 1.0, np.float16)),
    Case("bfloat16_large", (4, 5), _global([1e30, 2e30, 3e30, 4e30], 1.0, BF16)),
    Case("bfloat16_beyond_float32", (4, 5), _global([3e38, 3e38], 1.0, BF16)),
    Case("subnormals_clipped", (4, 5), _global([_SUBNORMAL] * 4, _SUBNORMAL)),
    Case("tiny_1e-20", (4, 5), _global([1e-20] * 4, float(np.float32(1e-20)))),
    # Rule 6: thresholds 0 and inf.
    Case("max_zero", (6,), _global([3.0, -4.0], 0.0)),
    Case("max_inf", (6,), _global([3.0, 4.0], math.inf)),
    Case("max_inf_huge_values", (6,), _global([3e38, 3e38], math.inf)),
    Case("per_system_thresholds", (3, 4, 6), _per_system_thresholds(), PER_SYSTEM_OPS),
    # Rule 7: non-finite input in one system of a batch.
    Case("nan_in_one_system", (7,), _nonfinite_batch(math.nan), PER_SYSTEM_OPS),
    Case("posinf_in_one_system", (7,), _nonfinite_batch(math.inf), PER_SYSTEM_OPS),
    Case("neginf_in_one_system", (7,), _nonfinite_batch(-math.inf), PER_SYSTEM_OPS),
    Case("nan_global", (7,), _global([math.nan, 1.0, 2.0], 1.0)),
    Case("posinf_global", (7,), _global([math.inf, 1.0], 1.0)),
    Case("neginf_global", (7,), _global([-math.inf, 1.0], 1.0)),
    Case("nan_zero_mode", (7,), _global([math.nan, 3.0, math.inf, 4.0], 1.0,
                                        nonfinite="zero")),
    Case("nonfinite_zero_mode_batch", (7,), _nonfinite_batch(math.inf, "zero"), PER_SYSTEM_OPS),
    # Rule 8: empty inputs.
    Case("no_leaves", (8,), lambda op: Inputs([], 1.0)),
    Case("zero_row_leaf", (8,), lambda op: Inputs(
        [np.zeros((0, 3), np.float32), _vec([3.0, 4.0], np.float32, op)], 10.0)),
    Case("empty_systems", (8, 11), _empty_system(), PER_SYSTEM_OPS),
    # Rule 9: dtypes.
    Case("mixed_float16_float32", (4, 5, 9), _mixed([np.float16, np.float32])),
    Case("mixed_float32_float64", (4, 5, 9), _mixed([np.float32, np.float64])),
    Case("mixed_bfloat16_float32", (4, 5, 9), _mixed([BF16, np.float32])),
    # Rules 1 and 2: the domain of the norm.
    Case("system_across_leaves", (1, 4), _cross_leaf_system(), PER_SYSTEM_OPS),
    Case("one_d_leaf_max_step", (2, 3), _one_d_max_step(), ("clip_by_max_step",)),
    # Large: crossing block boundaries.
    Case("large_batch_interleaved", (1, 3, 4, 5),
         _per_system(lambda: _random_batch(31, 300, (1, 20), threshold=3.0)), PER_SYSTEM_OPS),
    Case("large_leaf_global", (4, 5), _random_global(6, 3000, np.float32, threshold=10.0,
                                                     leaves=4)),
)

# Rule 10 (with rules 3-5 for every p): a clipping case and a no-op case per p.
P_CASES: tuple[Case, ...] = tuple(
    Case(f"p{p:g}_clipped", (4, 5, 10),
         _random_global(40 + i, 15, np.float32, threshold=2.0, norm_type=p), NORM_OPS)
    for i, p in enumerate(P_VALUES)) + tuple(
        Case(f"p{p:g}_below", (3, 10),
             _random_global(50 + i, 15, np.float32, threshold=1e4, norm_type=p), NORM_OPS)
        for i, p in enumerate(P_VALUES))

BAD_P_VALUES = (0.0, 0.5, math.nan)
ALL_CASES = CASES + P_CASES


def cases_for(rule: int, op: str) -> list[Case]:
  """The cases a test of ``rule`` runs for ``op``."""
  return [c for c in ALL_CASES if op in c.ops and rule in c.rules]


def case_named(name: str) -> Case:
  return next(c for c in ALL_CASES if c.name == name)
