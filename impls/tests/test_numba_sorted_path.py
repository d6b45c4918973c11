"""The numba kernels' sorted fast path at sizes the conformance cases do not reach.

The segment scan validates the ids and, in the same pass, records each system's row offsets
(SPEC rule 13 and the sorted fast path of issue 4); it works in sub-chunks of ``SCAN_SUB``
ids and goes parallel above ``SCAN_PARALLEL_MIN``, both far above the conformance batches.
These tests check the offsets against ``numpy.searchsorted`` across those boundaries, and
rule 11 end to end: sorted ids (offsets) and the same rows shuffled (gather) give the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")
# pylint: disable=wrong-import-position
from clipbench.impls.own.numba import api
from clipbench.impls.own.numba.segments import (SCAN_PARALLEL_MIN, SCAN_SUB,
                                                scan_segments)

SIZES = (1, 7, SCAN_SUB - 1, SCAN_SUB + 1, 5 * SCAN_SUB + 3, SCAN_PARALLEL_MIN + 12_345)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("num_systems", (1, 3, 700))
@pytest.mark.parametrize("dtype", (np.int64, np.int32, np.uint16))
def test_sorted_scan_offsets_match_searchsorted(size, num_systems, dtype):
  rng = np.random.default_rng(size + num_systems)
  # Leave some systems empty (at the start, in the middle and at the end).
  high = max(1, num_systems - 1)
  ids = np.sort(rng.integers(min(1, high - 1), high, size)).astype(dtype)
  lo, hi, offsets = scan_segments(ids, num_systems)
  assert (lo, hi) == (int(ids.min()), int(ids.max()))
  assert offsets is not None, "sorted ids reported as unsorted"
  np.testing.assert_array_equal(offsets, np.searchsorted(ids, np.arange(num_systems + 1)))


@pytest.mark.parametrize("size", SIZES[1:])
@pytest.mark.parametrize("where", ("first", "middle", "last"))
def test_one_descent_makes_ids_unsorted(size, where):
  ids = np.sort(np.random.default_rng(size).integers(0, 50, size))
  ids[-1] = 50
  j = {"first": 0, "middle": size // 2, "last": size - 2}[where]
  ids[j], ids[j + 1] = ids[j + 1] + 1, ids[j]  # one descent at j (ids[j] > ids[j + 1])
  lo, hi, offsets = scan_segments(ids, 52)
  assert offsets is None
  assert (lo, hi) == (int(ids.min()), int(ids.max()))


@pytest.mark.parametrize("op", ("clip_by_global_norm", "clip_by_max_step"))
def test_rule11_sorted_offsets_and_unsorted_gather_give_the_same_bits(op):
  rng = np.random.default_rng(11)
  num_systems = 3_000
  ids = np.sort(rng.integers(0, num_systems, SCAN_PARALLEL_MIN + 1000))
  positions = rng.standard_normal((ids.size, 3)).astype(np.float32)
  threshold = 5.0 if op == "clip_by_global_norm" else 2.0
  run = getattr(api, op)
  sorted_out, sorted_norms = run([positions], threshold, segments=[ids], num_systems=num_systems)
  order = rng.permutation(ids.size)
  shuffled_out, shuffled_norms = run([positions[order]], threshold, segments=[ids[order]],
                                     num_systems=num_systems)
  assert np.count_nonzero(sorted_out[0] != positions) > 0, "nothing was clipped"
  np.testing.assert_array_equal(sorted_norms, shuffled_norms)
  np.testing.assert_array_equal(shuffled_out[0], sorted_out[0][order])
