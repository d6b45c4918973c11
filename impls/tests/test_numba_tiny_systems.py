"""The fused route's pieces for tiny systems against the code they stand in for, bit for bit.

Groups of tiny systems (``fused._in_groups``) are decided in vector lanes
(``lane_decisions.decide_group``, which also gives each system's float32 factor for the masked
steps) and applied in masked vector steps (``masked_apply.scale_run_masked``). Each must give,
lane by lane, what the one-system code gives: ``fused_decision.decide`` for every decision,
``apply.scale_f32_fma`` for every scaled element, and the input's own bits for a kept one. The
whole route is checked against the general route in ``test_numba_fused_path``.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")
# pylint: disable=wrong-import-position
from numba import njit

from clipbench.impls.own.numba.apply import scale_f32_fma
from clipbench.impls.own.numba.fused_decision import decide
from clipbench.impls.own.numba.intrinsics import JIT
from clipbench.impls.own.numba.lane_decisions import decide_group
from clipbench.impls.own.numba.masked_apply import (MASK_LANES, scale_half_run_masked,
                                                    scale_run_masked)
from clipbench.impls.own.numba.records import FusedOutputs, FusedRule, Threshold


@njit(**JIT)
def _decide_each(totals, counts, flags, rule, out):
  c_m, c_e, c_inf = rule.threshold
  for k in range(totals.size):
    out.norms[k], out.action[k], out.s_m[k], out.s_e[k], out.tie[k] = decide(
        totals[k], counts[k], flags[k], c_m[k], c_e[k], c_inf[k], rule)


@njit(**JIT)
def _decide_in_groups(group, counts, flags, rule, out, usual_count, factors, in_steps):
  n_all = out.sums.size
  usual = np.empty(group, dtype=np.bool_)
  group_factors = np.empty(group, dtype=np.float32)
  group_in_steps = np.empty(group, dtype=np.bool_)
  for g0 in range(0, n_all, group):
    n = min(group, n_all - g0)
    decide_group(g0, n, counts[g0:g0 + n], flags[g0:g0 + n], usual, group_factors,
                 group_in_steps, rule, out)
    for j in range(n):
      usual_count[0] += usual[j] and not flags[g0 + j]
      factors[g0 + j] = group_factors[j]
      in_steps[g0 + j] = group_in_steps[j]


def _outputs(totals):
  n = totals.size
  return FusedOutputs(np.zeros(0, dtype=np.int64), totals.copy(), np.empty(n, np.float32),
                      np.empty(n, np.int8), np.empty(n), np.empty(n, np.int64),
                      np.empty(n, np.bool_))


def _decision_inputs(seed: int, n: int = 50_000):
  """Sums over many binades, thresholds near their norms (ties and near-ties among them),
  and every case outside the vector lanes: zero, subnormal, infinite and NaN sums, flagged
  systems, zero and infinite thresholds, exponents beyond the bit tricks' range."""
  rng = np.random.default_rng(seed)
  totals = 10.0 ** rng.uniform(-300, 300, n)
  counts = rng.integers(1, 5_000, n)
  norms = np.sqrt(totals)
  near = norms * rng.choice([1.0, 1 + 2.0 ** -52, 1 - 2.0 ** -53, 1 + 1e-9, 0.5, 2.0], n)
  c_m, c_e = np.frexp(near)
  c_e = c_e.astype(np.int64)
  far = rng.random(n) < 0.3
  c_e[far] += rng.integers(-80, 80, int(far.sum()))
  flags = np.zeros(n, dtype=np.int64)
  c_inf = np.zeros(n, dtype=np.bool_)
  totals[::97] = 0.0
  totals[::101] = np.inf
  totals[::103] = np.nan
  totals[::107] = 1e-310
  c_e[::109] = 3_000
  c_e[::113] = -3_000
  c_m[::127] = 0.0
  flags[::131] = 1
  flags[::137] = 2
  c_inf[::139] = True
  return totals, counts, flags, (c_m, c_e, c_inf)


def _check_group_decisions(totals, counts, flags, threshold, step, group, one_threshold,
                           mostly_usual=True):
  """Groups decided in lanes against ``decide`` system by system; a ``one_threshold`` rule
  holds one threshold for every system (``decide`` then sees it copied per system)."""
  each = tuple(np.ascontiguousarray(np.broadcast_to(part, totals.shape)) for part in threshold)
  rule_each = FusedRule(Threshold(*each), step, 2.0 ** -50 if step else 0.0, False)
  rule = FusedRule(Threshold(*threshold), step, 2.0 ** -50 if step else 0.0, False,
                   one_threshold)
  want, got = _outputs(totals), _outputs(totals)
  _decide_each(totals, counts, flags, rule_each, want)
  usual = np.zeros(1, dtype=np.int64)
  factors = np.empty(totals.size, dtype=np.float32)
  in_steps = np.empty(totals.size, dtype=np.bool_)
  _decide_in_groups(group, counts, flags, rule, got, usual, factors, in_steps)
  if mostly_usual:
    # Most lanes must be decided in the vector lanes, or this test would check only decide.
    assert usual[0] > 0.8 * totals.size
    assert in_steps.sum() > 0.5 * totals.size
  # A system applied in masked steps has the factor run_action gives it: 1.0 when kept,
  # else ldexp(s_m, s_e), a float32; and only kept or scaled systems go there.
  kept = want.action[in_steps] == 0
  assert set(np.unique(want.action[in_steps])) <= {0, 1}
  with np.errstate(over="ignore"):  # kept systems: their s_m, s_e are not a factor
    sv = np.ldexp(want.s_m[in_steps], want.s_e[in_steps])
  expected = np.where(kept, 1.0, sv)
  np.testing.assert_array_equal(factors[in_steps].astype(np.float64), expected)
  assert not in_steps[flags != 0].any()
  for field in ("norms", "action", "s_m", "s_e", "tie"):
    w, g = getattr(want, field), getattr(got, field)
    kept = want.action != 2  # NaN-filled systems: their factor is not used
    if field in ("s_m", "s_e"):
      w, g = w[kept], g[kept]
    np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=field)


@pytest.mark.parametrize("step", (False, True))
@pytest.mark.parametrize("group", (1, 7, 64, 256))
def test_group_decisions_are_decide_bit_for_bit(step, group):
  totals, counts, flags, threshold = _decision_inputs(int(step) + group)
  _check_group_decisions(totals, counts, flags, threshold, step, group, False)


@pytest.mark.parametrize("step", (False, True))
@pytest.mark.parametrize("threshold", ((0.6, 0, False), (0.75, 40, False), (0.0, 0, False),
                                       (1.0, 0, True), (0.5, 3_000, False),
                                       (0.5, -3_000, False)),
                         ids=("usual", "large", "zero", "inf", "beyond-above", "beyond-below"))
def test_group_decisions_with_one_threshold_for_all(step, threshold):
  """One threshold for every system (the usual call) is read once by the lanes: the same bits
  as that threshold copied per system, in and outside the lanes' usual case."""
  totals, counts, flags, _ = _decision_inputs(7 + int(step), n=5_000)
  totals = np.where(np.arange(totals.size) % 2 == 0, totals,
                    10.0 ** np.random.default_rng(1).uniform(-2, 2, totals.size))
  c_m, c_e, c_inf = threshold
  parts = (np.array([c_m]), np.array([c_e], dtype=np.int64), np.array([c_inf]))
  _check_group_decisions(totals, counts, flags, parts, step, 64, True,
                         mostly_usual=threshold[0] > 0 and not threshold[2] and
                         abs(threshold[1]) < 1000)


@njit(**JIT)
def _scale_each(xs, os, s32):
  scale_f32_fma(xs, os, s32)


def _edge_values(n: int) -> np.ndarray:
  rng = np.random.default_rng(n)
  x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-45, 38, n)).astype(np.float32)
  x[::5] = 0.0
  x[::7] = -0.0
  x[::11] = np.float32(1e-44)
  x[::13] = -np.float32(3.4e38)
  return x


@pytest.mark.parametrize("half", (False, True), ids=("runs", "half runs"))
@pytest.mark.parametrize("s32", (0.3, 0.99999994, 2.0 ** -100, 1e-30, 0.5))
def test_masked_steps_scale_as_scale_f32_fma(s32, half):
  s32 = np.float32(s32)
  x = _edge_values(200).view(np.uint32)
  lengths = range(MASK_LANES + 1) if half else list(range(0, 2 * MASK_LANES + 3)) + [64, 65, 150]
  scale = scale_half_run_masked if half else scale_run_masked
  for start in (0, 1, 5):
    for n in lengths:
      got = np.full(210, 0xDEADBEEF, dtype=np.uint32)
      want = got.copy()
      scale(x.ctypes.data + 4 * start, got.ctypes.data + 4 * start, n, s32)
      _scale_each(x[start:start + n], want[start:start + n], s32)
      # Only the run is written: the masked lanes past it store nothing.
      np.testing.assert_array_equal(got, want, err_msg=f"start {start}, n {n}")


def test_masked_steps_keep_a_run_bit_for_bit_at_factor_one():
  x = _edge_values(100).view(np.uint32)
  for n in range(0, 100):
    got = np.zeros(100, dtype=np.uint32)
    scale_run_masked(x.ctypes.data, got.ctypes.data, n, np.float32(1.0))
    np.testing.assert_array_equal(got[:n], x[:n])
    assert not got[n:].any()
