"""Under the interpreter the kernels' segmented scans run as a log-step scan
(:mod:`clipbench.impls.own.triton.interpreter_scan`): where the combine is exact it gives what
Triton's own loop gives, bit for bit; where it rounds (the compensated run totals) both orders
stay within the certified bound; and every other scan is still Triton's own."""

from __future__ import annotations

import os
from fractions import Fraction

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the log-step scan replaces the interpreter's only")

# pylint: disable=wrong-import-position
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import ScanOps  # noqa: E402

from clipbench.impls.own.triton import interpreter_scan, passes  # noqa: E402,F401
from clipbench.impls.own.triton.kernels import (RUN_COMBINES, _max_runs,  # noqa: E402
                                                _pieces_runs, _sum_runs_compensated)

SIZES = (1, 2, 32, 512)


@triton.jit
def _scan_max_runs(flags, a, b, n, out, N: tl.constexpr):
  i = tl.arange(0, N)
  _, x, y, c = tl.associative_scan((tl.load(flags + i), tl.load(a + i), tl.load(b + i),
                                    tl.load(n + i)), 0, _max_runs)
  tl.store(out + i, x)
  tl.store(out + N + i, y)
  tl.store(out + 2 * N + i, c.to(tl.int64))


@triton.jit
def _scan_pieces_runs(flags, q, out, N: tl.constexpr):
  i = tl.arange(0, N)
  _, a, b, c, d = tl.associative_scan(
      (tl.load(flags + i), tl.load(q + i), tl.load(q + N + i), tl.load(q + 2 * N + i),
       tl.load(q + 3 * N + i)), 0, _pieces_runs)
  tl.store(out + i, a)
  tl.store(out + N + i, b)
  tl.store(out + 2 * N + i, c)
  tl.store(out + 3 * N + i, d)


@triton.jit
def _scan_sum_runs(flags, v, out, N: tl.constexpr):
  i = tl.arange(0, N)
  x = tl.load(v + i)
  ones = tl.full([N], 1, tl.int32)
  _, h, lo, c = tl.associative_scan((tl.load(flags + i), x, tl.zeros_like(x), ones), 0,
                                    _sum_runs_compensated)
  tl.store(out + i, h)
  tl.store(out + N + i, lo)
  tl.store(out + 2 * N + i, c.to(tl.float64))


@triton.jit
def _scan_max_runs_2d(flags, a, out, R: tl.constexpr, C: tl.constexpr, AXIS: tl.constexpr):
  i = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
  x = tl.load(a + i)
  _, y, _, _ = tl.associative_scan((tl.load(flags + i), x, x, tl.load(flags + i)), AXIS,
                                   _max_runs)
  tl.store(out + i, y)


def _discount(a, b):
  return a * 0.5 + b


_discount_jit = triton.jit(_discount)


@triton.jit
def _scan_discounted(v, out, N: tl.constexpr):
  i = tl.arange(0, N)
  tl.store(out + i, tl.associative_scan(tl.load(v + i), 0, _discount_jit))


def _both_ways(monkeypatch, run):
  """``run()`` with the log-step scan, then with Triton's own loop."""
  ours = run()
  with monkeypatch.context() as m:
    m.setattr(ScanOps, "generic_scan", interpreter_scan.triton_generic_scan())
    theirs = run()
  return ours, theirs


def _flags(rng, n):
  return torch.tensor(rng.integers(0, 2, n) * (rng.random(n) < 0.3), dtype=torch.int32)


def test_the_kernels_scans_take_the_log_step_scan():
  # Importing the passes under the interpreter installs it, for the kernels' combines only.
  assert ScanOps.generic_scan is interpreter_scan._log_step_scan  # pylint: disable=protected-access
  assert set(RUN_COMBINES) <= interpreter_scan._installed  # pylint: disable=protected-access
  assert _discount_jit not in interpreter_scan._installed  # pylint: disable=protected-access


def test_an_interpreter_without_the_loop_keeps_its_own(monkeypatch):
  # A Triton whose interpreter moved its scan: nothing is taken over, and install says so.
  monkeypatch.setattr(interpreter_scan, "ScanOps", None)
  monkeypatch.setattr(interpreter_scan, "_installed", set())
  assert interpreter_scan.install(RUN_COMBINES) is False
  assert not interpreter_scan._installed  # pylint: disable=protected-access


@pytest.mark.parametrize("n", SIZES)
def test_exact_run_scans_equal_tritons_loop_bit_for_bit(monkeypatch, n):
  # Maxima of float64 bits, counts, and sums of small integers (the extracted pieces are exact
  # sums too): any order gives the same bits, so the two scans must agree exactly.
  rng = np.random.default_rng(n)
  flags = _flags(rng, n)
  a = torch.tensor(rng.integers(0, 1 << 62, n), dtype=torch.int64)
  b = torch.tensor(rng.integers(0, 1 << 62, n), dtype=torch.int64)
  units = torch.tensor(rng.integers(0, 9, n), dtype=torch.int32)
  pieces = torch.tensor(rng.integers(-1000, 1000, 4 * n).astype(np.float64) * 2.0 ** -20)
  values = torch.tensor(rng.integers(0, 1 << 40, n).astype(np.float64))

  def run():
    out_max = torch.empty(3 * n, dtype=torch.int64)
    out_pieces = torch.empty(4 * n, dtype=torch.float64)
    out_sums = torch.empty(3 * n, dtype=torch.float64)
    _scan_max_runs[(1,)](flags, a, b, units, out_max, N=n)
    _scan_pieces_runs[(1,)](flags, pieces, out_pieces, N=n)
    _scan_sum_runs[(1,)](flags, values, out_sums, N=n)
    return out_max, out_pieces, out_sums

  ours, theirs = _both_ways(monkeypatch, run)
  for x, y in zip(ours, theirs):
    assert torch.equal(x, y)
  # Not vacuous: a run's running maximum and sum, checked against a plain loop.
  start = 0
  for i in range(n):
    start = i if i == 0 or flags[i] else start
    assert int(ours[0][i]) == int(a[start:i + 1].max())
    assert float(ours[2][i]) == float(values[start:i + 1].sum())
    assert float(ours[2][n + i]) == 0.0 and int(ours[2][2 * n + i]) == i - start + 1


@pytest.mark.parametrize("shape,axis", [((4, 32), 1), ((32, 4), 0), ((8, 8), 0)])
def test_two_dimensional_scans_equal_tritons_loop(monkeypatch, shape, axis):
  rng = np.random.default_rng(shape[0] * 10 + axis)
  flags = _flags(rng, shape[0] * shape[1])
  a = torch.tensor(rng.integers(0, 1 << 62, shape[0] * shape[1]), dtype=torch.int64)

  def run():
    out = torch.empty_like(a)
    _scan_max_runs_2d[(1,)](flags, a, out, R=shape[0], C=shape[1], AXIS=axis)
    return out

  ours, theirs = _both_ways(monkeypatch, run)
  assert torch.equal(ours, theirs)
  grid, f = a.view(shape).numpy(), flags.view(shape).numpy()
  lines = grid if axis == 1 else grid.T
  line_flags = f if axis == 1 else f.T
  expected = np.empty_like(lines)
  for r, (line, fl) in enumerate(zip(lines, line_flags)):
    for i, v in enumerate(line):
      expected[r, i] = v if i == 0 or fl[i] else max(expected[r, i - 1], v)
  assert np.array_equal(ours.view(shape).numpy(), expected if axis == 1 else expected.T)


@pytest.mark.parametrize("n", (32, 512))
def test_compensated_run_totals_stay_within_the_bound_in_either_order(monkeypatch, n):
  # Terms of every magnitude: the two orders round differently, and each keeps the run's
  # total h + l within (units * 2**-53)**2 of exact (the certified bound of kernels).
  rng = np.random.default_rng(40 + n)
  flags = _flags(rng, n)
  values = torch.tensor(np.ldexp(rng.uniform(1, 2, n), rng.integers(-60, 60, n)))

  def run():
    out = torch.empty(3 * n, dtype=torch.float64)
    _scan_sum_runs[(1,)](flags, values, out, N=n)
    return out

  ours, theirs = _both_ways(monkeypatch, run)
  differ = 0
  start = 0
  for i in range(n):
    start = i if i == 0 or flags[i] else start
    exact = sum(Fraction(float(v)) for v in values[start:i + 1])
    units = i - start + 1
    for out in (ours, theirs):
      total = Fraction(float(out[i])) + Fraction(float(out[n + i]))
      assert abs(total - exact) <= exact * Fraction(units, 2 ** 53) ** 2
      assert int(out[2 * n + i]) == units
    differ += float(ours[i]) != float(theirs[i]) or float(ours[n + i]) != float(theirs[n + i])
  assert differ  # the orders did differ: the bound was tested on two trees, not one


def test_other_scans_stay_tritons_own_loop():
  # A combine that is not associative shows the order: Triton's loop is left to right.
  n = 16
  v = torch.arange(1, n + 1, dtype=torch.float64)
  out = torch.empty_like(v)
  _scan_discounted[(1,)](v, out, N=n)
  expected, acc = [], 0.0
  for i, x in enumerate(v.tolist()):
    acc = x if i == 0 else acc * 0.5 + x
    expected.append(acc)
  assert out.tolist() == expected
