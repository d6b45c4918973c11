"""The group scan (``run_scan.scan_group``) against ``run_end`` system by system.

``scan_group`` finds the run ends of a group of systems a window of ids at a time where the
ids step by 0 or 1, and leaves everything else to ``run_end``. Its ends and its verdict on
unsorted ids must be exactly those of ``run_end`` called for each system in turn, on every
layout: runs of every length (empty, longer than a window), gaps, ids that go down, ids out
of range, the window at the scanned rows' end, and int32 ids near the top of their range.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")
# pylint: disable=wrong-import-position
from numba import njit

from clipbench.impls.own.numba.intrinsics import JIT
from clipbench.impls.own.numba.run_scan import SEG_CODE_OF, WINDOW, run_end, scan_group


@njit(**JIT)
def _one_by_one(addr, code, r, r_end, k0, n, ends):
  e = r
  for j in range(n):
    e = run_end(addr, code, e, r_end, k0 + j)
    if e < 0:
      return -1
    ends[j] = e
  return e


@njit(**JIT)
def _in_windows(addr, code, r, r_end, k0, n, ends):
  return scan_group(addr, code, r, r_end, k0, n, ends)


def _sorted_ids(rng, systems: int, longest: int) -> np.ndarray:
  rows = rng.integers(0, longest + 1, systems)
  short = rng.random(systems) < 0.7
  rows[short] = rng.integers(0, 9, int(short.sum()))
  return np.repeat(np.arange(systems), rows)


def _layouts(seed: int):
  rng = np.random.default_rng(seed)
  yield "tiny runs", np.repeat(np.arange(3000), rng.integers(1, 9, 3000)), 0
  yield "one row each", np.arange(3000), 0
  yield "mixed with empty and long runs", _sorted_ids(rng, 2000, 3 * WINDOW), 0
  ids = np.repeat(np.arange(3000), rng.integers(1, 9, 3000))
  for where in rng.integers(0, ids.size - 1, 5):
    down = ids.copy()
    down[where + 1:] -= 2  # goes down once
    yield f"down at {where}", down, 0
  gap = np.repeat(np.arange(3000), rng.integers(1, 9, 3000))
  gap[gap > 1500] += 3  # systems 1501-1503 have no rows
  yield "gap", gap, 0
  out = np.repeat(np.arange(3000), rng.integers(1, 9, 3000))
  out[-40:] = 5000  # beyond the group's systems
  yield "out of range", out, 0
  top = 2**31 - 1 - 300
  yield "int32 top", np.repeat(np.arange(top, 2**31 - 1), rng.integers(1, 4, 300)), top
  # As int32, these ids wrap past the top to negative values: unsorted for run_end.
  yield "int32 wrap", np.repeat(np.arange(top, top + 600), rng.integers(1, 4, 600)), top + 200


@pytest.mark.parametrize("dtype", (np.int64, np.int32))
@pytest.mark.parametrize("seed", range(3))
def test_group_scan_gives_run_end_system_by_system(dtype, seed):
  rng = np.random.default_rng(seed)
  used_windows = 0
  for name, ids, first in _layouts(seed):
    ids = np.ascontiguousarray(ids.astype(dtype))
    code = SEG_CODE_OF[ids.dtype]
    for _ in range(25):
      r_end = int(rng.integers(ids.size // 2, ids.size + 1))
      k0 = first + int(rng.integers(0, 120))
      r = int(np.searchsorted(ids[:r_end], k0)) if rng.random() < 0.9 else 0
      n = int(rng.choice([1, 7, 64, 256, 1000]))
      want = np.full(n, -7, dtype=np.int64)
      got = want.copy()
      w = _one_by_one(ids.ctypes.data, code, r, r_end, k0, n, want)
      g = _in_windows(ids.ctypes.data, code, r, r_end, k0, n, got)
      assert g == w, (name, r, r_end, k0, n)
      if w >= 0:
        np.testing.assert_array_equal(got, want, err_msg=f"{name} r={r} k0={k0} n={n}")
        used_windows += np.count_nonzero(np.diff(want) > 0) > n // 2
  # The windows must have been used, or this test would check only run_end against itself.
  assert used_windows > 10
