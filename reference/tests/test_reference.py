"""Tests of the reference itself: one test per SPEC rule, plus an independent mpmath check.

The independent check recomputes norms and output norms with mpmath at 400 bits, a route that
shares no code with the reference's exact rational / interval arithmetic, on hypothesis inputs
spanning the whole exponent range of each dtype.
"""

from __future__ import annotations

import math

import hypothesis
import hypothesis.extra.numpy as hnp
import ml_dtypes
import mpmath
import numpy as np
import pytest
from hypothesis import strategies as st

from clipbench import reference
from clipbench.reference.formats import FORMATS, format_of

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
F32 = FORMATS["float32"]

settings = hypothesis.settings(max_examples=60, deadline=None, derandomize=True,
                               suppress_health_check=[hypothesis.HealthCheck.too_slow])


# ----------------------------------------------------------------------------- independent math
def mp_norm(values: np.ndarray, p: float) -> mpmath.mpf:
  xs = [abs(mpmath.mpf(float(v))) for v in np.asarray(values, np.float64).ravel()]
  if not xs:
    return mpmath.mpf(0)
  if p == math.inf:
    return max(xs)
  if p == -math.inf:
    return min(xs)
  s = mpmath.fsum(x ** p for x in xs if x)
  return s ** (1 / mpmath.mpf(p)) if s else mpmath.mpf(0)


def mp_ulp(v: mpmath.mpf, dtype) -> mpmath.mpf:
  fmt = format_of(dtype)
  e = fmt.emin if v == 0 else max(int(mpmath.floor(mpmath.log(abs(v), 2))), fmt.emin)
  return mpmath.mpf(2) ** (e - fmt.prec + 1)


def leaves_strategy(dtype, max_leaves=3, max_size=12):
  if dtype == BF16:
    elements = st.floats(width=32, allow_nan=False, allow_infinity=False).map(
        lambda v: float(np.float32(v).astype(BF16))).filter(math.isfinite)
    base = np.float32
  else:
    elements = st.floats(width=dtype.itemsize * 8, allow_nan=False, allow_infinity=False)
    base = dtype
  one = hnp.arrays(base, st.integers(0, max_size), elements=elements).map(
      lambda a: a.astype(dtype))
  return st.lists(one, min_size=0, max_size=max_leaves)


# ------------------------------------------------------------------------ independent check
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, 1.5, math.inf, -math.inf], ids=str)
def test_independent_mpmath_check(dtype, p):
  """Rules 3, 4, 5 and 10 against mpmath at 400 bits over the whole exponent range."""

  @settings
  @hypothesis.given(leaves=leaves_strategy(dtype), c=st.floats(0, 1e30) | st.just(0.0))
  def check(leaves, c):
    with mpmath.workprec(400):
      out, norm = reference.clip_grad_norm(leaves, c, norm_type=p)
      values = np.concatenate([x.astype(np.float64).ravel() for x in leaves]) if leaves else (
          np.zeros(0))
      exact = mp_norm(values, p)
      nfmt = reference.norm_format(leaves)
      # Rule 5: the reported norm is the exact norm correctly rounded (within half an ulp).
      if exact > mpmath.mpf(float(nfmt.max_finite)):
        assert float(norm) == math.inf or abs(exact - mpmath.mpf(float(norm))) <= mp_ulp(
            exact, nfmt.dtype) / 2
      else:
        assert abs(mpmath.mpf(float(norm)) - exact) <= mp_ulp(exact, nfmt.dtype) / 2 * (
            1 + mpmath.mpf(2) ** -300)
      out_values = np.concatenate([x.astype(np.float64).ravel() for x in out]) if out else (
          np.zeros(0))
      if exact <= c:  # Rule 3
        for x, y in zip(leaves, out):
          assert x.tobytes() == y.tobytes()
        return
      # Rule 4: strict bound, and one factor s within 4u below c/n.
      assert mp_norm(out_values, p) <= mpmath.mpf(c)
      ratio = mpmath.mpf(c) / exact
      coarsest = max(format_of(x.dtype).unit_roundoff for x in leaves)
      for x, y in zip(values, out_values):
        if x == 0:
          assert y == 0
          continue
        target = mpmath.mpf(float(x)) * ratio
        low = target * (1 - 4 * mpmath.mpf(coarsest.numerator) / coarsest.denominator)
        leaf_dtype = next(l.dtype for l in leaves)
        assert abs(mpmath.mpf(float(y))) <= abs(target)
        assert abs(mpmath.mpf(float(y))) >= abs(low) - mp_ulp(low, _dtype_of(x, leaves))

  check()


def _dtype_of(value, leaves):
  # The coarsest dtype in the call bounds every element's rounding error from above.
  return max((l.dtype for l in leaves), key=lambda d: format_of(d).unit_roundoff)


# --------------------------------------------------------------------------- rule by rule
def test_rule1_domain_spans_every_row_of_every_leaf():
  a = np.array([[3.0, 0.0], [0.0, 0.0]], np.float32)
  b = np.array([[4.0], [5.0]], np.float32)
  out, norms = reference.clip_by_global_norm([a, b], math.inf, segments=[np.array([0, 1]),
                                                                          np.array([0, 1])],
                                             num_systems=2)
  assert norms.tolist() == [5.0, 5.0]


def test_rule2_step_norm_is_largest_vector_norm_along_last_axis():
  x = np.array([[3.0, 4.0], [0.0, 12.0], [1.0, 0.0]], np.float32)
  out, step = reference.clip_by_max_step([x], 6.0, segments=[np.array([0, 0, 1])], num_systems=2)
  assert step.tolist() == [12.0, 1.0]
  assert np.all(np.abs(out[0][:2]) <= np.abs(x[:2]) / 2 + 1e-7)
  assert out[0][2].tobytes() == x[2].tobytes()


def test_rule2_one_dimensional_leaf_holds_one_vectors():
  out, step = reference.clip_by_max_step([np.array([3.0, 0.1], np.float32)], 1.0,
                                         segments=[np.array([0, 1])], num_systems=2)
  assert step.tolist() == [3.0, np.float32(0.1)]
  assert out[0][1] == np.float32(0.1)  # kups scales this system by 1/3 (rule 2 departure)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_rule3_tie_is_bitwise_unchanged(dtype):
  x = np.array([3.0, 4.0], dtype)
  out, norm = reference.clip_grad_norm([x], 5.0)
  assert out[0].tobytes() == x.tobytes() and float(norm) == 5.0
  zeros = np.array([0.0, -0.0], dtype)
  out, _ = reference.clip_grad_norm([zeros], 0.0)
  assert out[0].tobytes() == zeros.tobytes()


def test_rule3_subnormals_are_not_flushed():
  x = np.array([1e-40] * 4, np.float32)
  out, _ = reference.clip_grad_norm([x], 1.0)
  assert out[0].tobytes() == x.tobytes()


def test_rule3_near_tie_decided_exactly():
  x = np.array([3.0, 4.0], np.float32)
  below = np.nextafter(5.0, 0.0)
  out, _ = reference.clip_grad_norm([x], below)
  assert out[0].tobytes() != x.tobytes()


def test_rule4_strict_bound_where_rounding_to_nearest_overshoots():
  out, _ = reference.clip_grad_norm([np.array([3.0, 4.0], np.float32)], 1.0)
  y = out[0].astype(np.float64)
  assert mpmath.sqrt(mpmath.fsum(mpmath.mpf(v) ** 2 for v in y)) <= 1
  # Rounding 0.6 to nearest float32 gives 0.6000000238 whose norm with 0.8 exceeds 1.
  assert out[0][0] < np.float32(0.6)


@pytest.mark.parametrize("x,expected", [
    (np.array([1e20, 1e20], np.float32), np.float32(float(np.float32(1e20)) * math.sqrt(2))),
    (np.array([300.0, 400.0], np.float16), np.float32(500.0)),
    (np.array([1e-40] * 4, np.float32), np.float32(2 * float(np.float32(1e-40)))),
], ids=["float32_1e20", "float16_300", "subnormal"])
def test_rule5_no_overflow_or_underflow(x, expected):
  out, norm = reference.clip_grad_norm([x], 1e-45 if x.dtype == np.float32 and x[0] < 1 else 1.0)
  assert norm == expected
  assert np.all(np.isfinite(out[0].astype(np.float64)))


def test_rule5_norm_beyond_range_is_inf_yet_clipped_exactly():
  x = np.array([3e38] * 3, np.float32)
  out, norm = reference.clip_grad_norm([x], 1.0)
  assert float(norm) == math.inf
  assert np.all(out[0] > np.float32(0.577)) and np.all(out[0] <= np.float32(0.5773503))


def test_rule6_zero_and_inf_thresholds():
  x = np.array([3.0, -4.0], np.float32)
  zeroed, _ = reference.clip_grad_norm([x], 0.0)
  assert zeroed[0].tolist() == [0.0, 0.0] and np.signbit(zeroed[0]).tolist() == [False, True]
  same, _ = reference.clip_grad_norm([x], math.inf)
  assert same[0].tobytes() == x.tobytes()


@pytest.mark.parametrize("value,error,message", [
    (-1.0, ValueError, r"^max_norm: must be >= 0"),
    (math.nan, ValueError, r"^max_norm: must not be NaN"),
    (True, TypeError, r"^max_norm: expected a float"),
    ("1", TypeError, r"^max_norm: expected a float"),
    (np.array([1.0, -1.0]), ValueError, r"^max_norm\[1\]: must be >= 0"),
    (np.array([1.0]), ValueError, r"^max_norm: expected a scalar or an array of shape \(2,\)"),
])
def test_rule6_bad_threshold_raises_naming_it(value, error, message):
  x = np.array([[3.0], [4.0]], np.float32)
  with pytest.raises(error, match=message):
    reference.clip_by_global_norm([x], value, segments=[np.array([0, 1])], num_systems=2)


def test_rule6_bad_max_step_names_max_step():
  with pytest.raises(ValueError, match=r"^max_step: must be >= 0"):
    reference.clip_by_max_step([np.ones((2, 3), np.float32)], -0.5)


def test_rule7_nonfinite_system_is_nan_and_others_untouched():
  x = np.array([[1.0], [np.inf], [3.0], [4.0]], np.float32)
  seg = [np.array([0, 0, 1, 1])]
  out, norms = reference.clip_by_global_norm([x], 1.0, segments=seg, num_systems=2)
  assert math.isinf(norms[0]) and np.isnan(out[0][:2]).all()
  alone, alone_norm = reference.clip_by_global_norm([x[2:]], 1.0)
  assert out[0][2:].tobytes() == alone[0].tobytes() and norms[1] == alone_norm[0]
  x[0] = np.nan
  _, norms = reference.clip_by_global_norm([x], 1.0, segments=seg, num_systems=2)
  assert math.isnan(norms[0])


def test_rule7_zero_mode_counts_nonfinite_as_zero():
  x = np.array([np.nan, 3.0, -np.inf, 4.0], np.float32)
  out, norm = reference.clip_grad_norm([x], 10.0, nonfinite="zero")
  assert float(norm) == 5.0 and out[0].tolist() == [0.0, 3.0, 0.0, 4.0]


def test_rule8_empty_inputs():
  out, norm = reference.clip_grad_norm([], 1.0)
  assert out == [] and float(norm) == 0.0 and norm.dtype == np.float32
  empty = np.zeros((0, 3), np.float32)
  out, norms = reference.clip_by_global_norm([empty], 1.0, segments=[np.zeros(0, int)],
                                             num_systems=3)
  assert norms.tolist() == [0.0, 0.0, 0.0] and out[0].shape == (0, 3)
  out, norm = reference.clip_grad_norm([empty], 1.0, norm_type=-math.inf)
  assert float(norm) == 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_rule9_dtype_preserved_and_norm_dtype(dtype):
  out, norm = reference.clip_grad_norm([np.array([3.0, 4.0], dtype)], 1.0)
  assert out[0].dtype == dtype
  assert norm.dtype == (np.float64 if dtype == np.float64 else np.float32)


def test_rule9_mixed_dtypes_keep_their_own():
  leaves = [np.array([300.0], np.float16), np.array([400.0], np.float32)]
  out, norm = reference.clip_grad_norm(leaves, 1.0)
  assert [o.dtype for o in out] == [np.float16, np.float32] and float(norm) == 500.0


@pytest.mark.parametrize("leaf", [np.array([1, 2], np.int32), np.array([True]),
                                  np.array([1 + 2j])], ids=["int32", "bool", "complex"])
def test_rule9_other_dtypes_raise_type_error_naming_leaf(leaf):
  with pytest.raises(TypeError, match=r"^leaves\[1\]: dtype .* is not supported"):
    reference.clip_grad_norm([np.ones(2, np.float32), leaf], 1.0)


def test_rule9_non_list_leaves_raise():
  with pytest.raises(TypeError, match=r"^leaves: expected a list"):
    reference.clip_grad_norm({"a": np.ones(2)}, 1.0)
  with pytest.raises(TypeError, match=r"^leaves\[0\]: expected a numpy.ndarray"):
    reference.clip_grad_norm([[1.0, 2.0]], 1.0)


@pytest.mark.parametrize("p,expected", [(1, 19.0), (2, 13.0), (math.inf, 12.0),
                                        (-math.inf, 0.0), (3, np.float32(12.207055))])
def test_rule10_p_norm_values(p, expected):
  _, norm = reference.clip_grad_norm(
      [np.array([3.0, -4.0, 0.0], np.float32), np.array([0.0, 12.0], np.float32)], 100.0,
      norm_type=p)
  assert norm == np.float32(expected)


@pytest.mark.parametrize("p,error", [(0.0, ValueError), (0.5, ValueError), (math.nan, ValueError),
                                     (-1.0, ValueError), ("fro", TypeError), (None, TypeError)])
def test_rule10_bad_norm_type_raises_naming_it(p, error):
  with pytest.raises(error, match=r"^norm_type: "):
    reference.clip_grad_norm([np.ones(2, np.float32)], 1.0, norm_type=p)


def test_rule11_system_alone_equals_system_in_batch():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((7, 3)).astype(np.float32)
  seg = np.array([0, 1, 0, 2, 1, 0, 2])
  out, norms = reference.clip_by_global_norm([x], 1.0, segments=[seg], num_systems=3)
  for k in range(3):
    alone, alone_norm = reference.clip_by_global_norm([x[seg == k]], 1.0)
    assert out[0][seg == k].tobytes() == alone[0].tobytes() and norms[k] == alone_norm[0]


def test_rule12_inputs_not_modified():
  x = np.array([3.0, 4.0], np.float32)
  before = x.copy()
  reference.clip_grad_norm([x], 1.0)
  assert x.tobytes() == before.tobytes()


@pytest.mark.parametrize("segments,num_systems,message", [
    ([np.array([0, 1, 0])], 2, r"^segments\[0\]: expected shape \(2,\) to match the rows of leaves\[0\]"),
    ([np.array([0, 2])], 2, r"^segments\[0\]: system id 2 of leaves\[0\] is outside \[0, 2\)"),
    ([np.array([0, -1])], 2, r"^segments\[0\]: system id -1"),
    ([np.array([0.0, 1.0])], 2, r"^segments\[0\]: expected an integer array for leaves\[0\]"),
    ([np.array([0, 1])], None, r"^num_systems: required when segments is given"),
    ([np.array([0, 1]), np.array([0])], 2, r"^segments: expected 1 arrays"),
    (np.array([0, 1]), 2, r"^segments: expected None or a list"),
    ([np.array([0, 1])], -1, r"^num_systems: expected an integer >= 0"),
])
def test_rule13_bad_segments_raise_value_error_naming_leaf(segments, num_systems, message):
  x = np.ones((2, 3), np.float32)
  with pytest.raises(ValueError, match=message):
    reference.clip_by_global_norm([x], 1.0, segments=segments, num_systems=num_systems)
  with pytest.raises(ValueError, match=message):
    reference.clip_by_max_step([x], 1.0, segments=segments, num_systems=num_systems)


def test_rule13_zero_d_leaf_with_segments():
  with pytest.raises(ValueError, match=r"^leaves\[0\]: a 0-d leaf has no rows"):
    reference.clip_by_global_norm([np.array(1.0, np.float32)], 1.0,
                                  segments=[np.zeros((), int)], num_systems=1)


def test_nonfinite_mode_is_validated():
  with pytest.raises(ValueError, match=r"^nonfinite: "):
    reference.clip_grad_norm([np.ones(2, np.float32)], 1.0, nonfinite="raise")
