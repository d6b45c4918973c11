"""Segment ids: their validation scan, the row offsets of sorted ids, the order of unsorted ones.

Validation (SPEC rule 13) runs before any other kernel; its one pass over each id array also
records the system row offsets of sorted ids, so the sorted layout (each system one run of
rows per leaf) needs no second pass. Unsorted ids get a stable counting-sort order instead,
and the norm passes read a gathered copy in that order (SPEC rule 11: the same blocks).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numba import njit

from clipbench.impls.own import validation
from clipbench.impls.own.numba import threads
from clipbench.impls.own.numba.intrinsics import JIT

SCAN_SUB = 2048  # ids per sub-chunk: checked, then (still in L1) searched for boundaries
# Below this many ids a serial scan beats a thread hand-off.
SCAN_PARALLEL_MIN = 1 << 20


@njit(**JIT)
def _record_offsets(seg, b, e, prev, off):
  """off[k] = the first row in [b, e) with id >= k, for ids k in (prev, seg[e - 1]] clipped to
  [0, len(off) - 2]; seg[b:e] is sorted and prev is the id before row b (-1 at row 0). Binary
  searches over ids the scan has just brought into L1, each from the previous result."""
  k = max(prev + 1, 0)
  top = min(np.int64(seg[e - 1]), off.size - 2)
  j = b
  while k <= top:
    lo, hi = j, e - 1  # seg[e - 1] >= top >= k: the answer is in [lo, hi]
    while lo < hi:
      mid = (lo + hi) // 2
      if seg[mid] < k:
        lo = mid + 1
      else:
        hi = mid
    j = lo
    # Every id in (seg[j - 1], seg[j]] starts at row j.
    k_end = min(np.int64(seg[j]), top)
    while k <= k_end:
      off[k] = j
      k += 1


@njit(**JIT)
def _scan_chunk(c0, c1, seg, mins, maxs, ok, nchunks, off):
  """Chunks [c0, c1) of an id array: sortedness (including the chunk's first element against
  the previous chunk's last), min and max (the end points of a sorted chunk; a second pass
  only over an unsorted one) and, while the chunk is sorted so far, the system offsets of its
  rows (``_record_offsets``; meaningful only if every chunk is sorted). The order check is
  branch-free, so it vectorises; the offsets cost one search per system boundary, on ids
  already in cache, instead of a second pass over the array."""
  n = seg.size
  for c in range(c0, c1):
    lo = c * n // nchunks
    hi = (c + 1) * n // nchunks
    descents = 0
    prev = np.int64(seg[lo - 1]) if lo > 0 else np.int64(-1)
    for b in range(lo, hi, SCAN_SUB):
      e = min(b + SCAN_SUB, hi)
      start = max(b, 1)
      cur = seg[start:e]
      before = seg[start - 1:e - 1]
      for j in range(cur.size):
        descents += np.int64(cur[j] < before[j])
      if descents == 0:
        _record_offsets(seg, b, e, prev, off)
        prev = np.int64(seg[e - 1])
    if descents == 0:
      mins[c] = seg[lo]
      maxs[c] = seg[hi - 1]
    else:
      mn = np.iinfo(np.int64).max
      mx = np.iinfo(np.int64).min
      part = seg[lo:hi]
      for j in range(part.size):
        mn = min(mn, np.int64(part[j]))
        mx = max(mx, np.int64(part[j]))
      mins[c] = mn
      maxs[c] = mx
    ok[c] = descents == 0


@njit(**JIT)
def counting_order(seg, num_systems):
  """Stable order of rows by system (counting sort) and the system row offsets."""
  off = np.zeros(num_systems + 1, dtype=np.int64)
  for i in range(seg.size):
    off[seg[i] + 1] += 1
  for k in range(num_systems):
    off[k + 1] += off[k]
  pos = off[:-1].copy()
  order = np.empty(seg.size, dtype=np.int64)
  for i in range(seg.size):
    k = seg[i]
    order[pos[k]] = i
    pos[k] += 1
  return order, off


def scan_segments(seg: np.ndarray, num_systems: int) -> tuple[int, int, np.ndarray | None]:
  """(min, max, system row offsets or None if the ids are not sorted) of an id array, in
  parallel chunks; offsets[k] is the first row of system k (offsets[num_systems] = rows)."""
  nchunks = 64 if seg.size >= 4096 else 1
  mins = np.empty(nchunks, dtype=np.int64)
  maxs = np.empty(nchunks, dtype=np.int64)
  ok = np.empty(nchunks, dtype=np.bool_)
  off = np.empty(num_systems + 1, dtype=np.int64)
  if seg.size < SCAN_PARALLEL_MIN:
    _scan_chunk(0, nchunks, seg, mins, maxs, ok, nchunks, off)
  else:
    threads.parallel(_scan_chunk, np.full(nchunks, seg.size // nchunks), seg, mins, maxs, ok,
                     nchunks, off)
  lo, hi = int(mins.min()), int(maxs.max())
  if not ok.all():
    return lo, hi, None
  # Systems after the largest id have no rows.
  off[max(hi + 1, 0):] = seg.size
  return lo, hi, off


class CheckedSegments(NamedTuple):
  """Validated segments: the id arrays (None for one system), the number of systems, and per
  leaf the system row offsets of sorted ids (None for unsorted ones)."""
  ids: list[np.ndarray] | None
  num_systems: int
  row_offsets: list[np.ndarray | None] | None


NO_SEGMENTS = CheckedSegments(None, 1, None)


def checked_segments(leaves: list[np.ndarray], segments: Any, num_systems: Any) -> CheckedSegments:
  """Rule 13 before any work, leaf by leaf: the count, then each id array's shape and dtype,
  then its range (scanned once, in parallel)."""
  count = validation.check_num_systems(segments, num_systems, len(leaves))
  if count is None:
    return NO_SEGMENTS
  segs, row_offsets = [], []
  for i, (leaf, seg) in enumerate(zip(leaves, segments)):
    seg = np.asarray(seg)
    validation.check_segment(i, leaf.shape, seg.shape, seg.dtype)
    offsets = np.zeros(count + 1, dtype=np.int64)
    if seg.size:
      seg = np.ascontiguousarray(seg)
      lo, hi, offsets = scan_segments(seg, count)
      validation.check_segment_range(i, lo, hi, count, seg if (lo < 0 or hi >= count) else None)
    segs.append(seg)
    row_offsets.append(offsets)
  return CheckedSegments(segs, count, row_offsets)


def rows_below_each(ids: np.ndarray, ks: np.ndarray) -> np.ndarray:
  """How many of the sorted ``ids`` are below system k, for each k of the int64 array ``ks``,
  in one search. The keys are given in the ids' own dtype: Python ints or int64 keys against
  int32 ids make NumPy cast the whole id array first, which costs more than a kernel pass."""
  limit = np.iinfo(ids.dtype).max
  below = np.searchsorted(ids, np.minimum(ks, limit).astype(ids.dtype))
  below[ks > limit] = ids.size
  return below


def rows_below(ids: np.ndarray, k: int) -> int:
  """``rows_below_each`` for one system ``k``."""
  return int(rows_below_each(ids, np.array([k], dtype=np.int64))[0])
