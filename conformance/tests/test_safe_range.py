"""The safe-range scan on implementations whose ranges are known: the reference conforms at
every norm; summing float16 squares in float16 breaks from a norm of 2**8 (65504 is float16's
largest value); an epsilon of 1e-6 in max / (norm + eps) is off by 1e-6 / norm: beyond rounding
below a norm of about 1 in float32, material below about 1e-3."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clipbench.conformance import measure, safe_range
from clipbench.conformance.running import Outcome
from clipbench.impls import registry

ONLY = {"ops": ("clip_grad_norm",), "norm_types": (2.0,)}
STEPS = {"float32": 8}


def _scan(spec: str, dtype: str) -> dict[int, dict]:
  impl = registry.load(spec)
  rows, skipped = safe_range.scan(impl, STEPS, dtypes=(dtype,), **ONLY)
  assert not skipped
  return {row["log2_norm"]: row for row in rows}


def test_a_budget_leaves_out_whole_scans_and_says_which():
  impl = registry.load("reference")
  rows, skipped = safe_range.scan(impl, STEPS, budget_s=0.0, dtypes=("float16", "float32"),
                                  ops=("clip_grad_norm",), norm_types=(2.0, 1.0))
  # Each dtype's first scan (p = 2) runs whatever the budget: every dtype gets a range. The
  # others' second call spends the budget, and each is left out whole.
  assert {(row["dtype"], row["norm_type"]) for row in rows} == {("float16", "2"),
                                                                ("float32", "2")}
  assert skipped == ["clip_grad_norm float16 p=1", "clip_grad_norm float32 p=1"]
  rows, skipped = safe_range.scan(impl, STEPS, budget_s=60.0, dtypes=("float16",), **ONLY)
  assert len(rows) > len(safe_range.exponents("float16", 2)) - 3 and not skipped


def test_exponents_span_subnormal_elements_to_the_largest_binade():
  exps = safe_range.exponents("float16", 2)
  assert exps[-1] == 15 and exps[0] <= -23 and all(b - a == 2 for a, b in zip(exps, exps[1:]))
  assert safe_range.exponents("float64", 32)[-1] == 1023


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_the_reference_conforms_at_every_norm(dtype):
  points = _scan("reference", dtype)
  assert len(points) > 10
  assert {(r["rounding"], r["material"]) for r in points.values()} == {("pass", "pass")}


def test_float16_accumulation_breaks_where_its_squares_overflow():
  points = _scan("clipbench.conformance.broken:float16_accumulation", "float16")
  for e in (1, 3, 5, 7):  # a float16 sum is 50 ulp off: beyond rounding, not material
    assert (points[e]["rounding"], points[e]["material"]) == ("fail", "pass"), points[e]
  for e in (9, 11, 13, 15):  # 512**2 overflows float16: an infinite norm zeroes the update
    assert (points[e]["rounding"], points[e]["material"]) == ("fail", "fail"), points[e]
    assert points[e]["check"] == "finite-outputs" and points[e]["rel_error"] == "inf"


def test_an_epsilon_in_the_denominator_is_material_only_at_small_norms():
  points = _scan("clipbench.conformance.broken:eps_in_norm", "float32")
  assert all(r["rounding"] == "fail" for e, r in points.items() if e <= -1)
  assert all(r["rounding"] == "pass" for e, r in points.items() if e >= 7)
  # 1e-6 / norm: 5e-4 at a norm of 2**-9, 0.1 at 2**-17.
  assert all(r["material"] == "pass" for e, r in points.items() if e >= -9)
  assert all(r["material"] == "fail" for e, r in points.items() if e <= -17)


def test_outputs_rounded_to_zero_from_the_smallest_subnormal_are_rounding_only():
  # float16's smallest subnormal is 2**-24. Max-step at a norm of 2**-23 clipped to 0.56 of it:
  # the reference rounds to nearest and keeps one element at 2**-24, our exact kernels round
  # toward zero (rule 4's bound) and give all zeros. One rounding apart, not a zeroed update.
  numba_impl = registry.load("clipbench.numba")
  rows, skipped = safe_range.scan(numba_impl, dtypes=("float16",), ops=("clip_by_max_step",))
  (point,) = [r for r in rows if r["log2_norm"] == -23]
  assert not skipped and point["rounding"] == point["material"] == "pass", point
  inputs, _, ref = safe_range._reference(  # pylint: disable=protected-access
      "clip_by_max_step", "float16", 2.0, -23)
  largest = [np.abs(x.astype(np.float64)).max() for x in ref.leaves]
  assert max(largest) == 2.0 ** -24, largest  # the case is the one described above
  zeros = Outcome([np.zeros_like(x) for x in ref.leaves], ref.norms)
  assert measure.relative_error("clip_by_max_step", inputs, zeros, ref) == 0.0
  # Zeroing two spacings is a zeroed update still: the relative error of a silent wrong value.
  doubled = Outcome([x * np.float16(2) for x in ref.leaves], ref.norms)
  assert measure.relative_error("clip_by_max_step", inputs, zeros, doubled) == math.inf
