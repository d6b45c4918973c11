"""The fused route: one pass per chunk of systems for sorted segments (float32, L2, max-step).

Sorted ids (the usual layout of batched simulations) put each system's rows of a leaf in one
run, and a system (W3: ~3 KB) fits in L1. One pass over a chunk of contiguous systems then does
everything the general route's separate passes do, system by system: it finds each run's end by
scanning the ids (which validates them: every row of the chunk must be consumed, in id order,
inside the chunk's systems), sums the run's blocks with the same block function and in the same
order as the general route's power sums (a short run in the tree of
:mod:`~clipbench.impls.own.numba.short_sums`, as the block function sums it), finalizes the
system (``finalize.finalize_one``, which the general route runs too) and scales the run while it
is still in L1. The data comes from memory once instead of twice, the ids in the same pass
instead of a separate scan, and no per-block arrays are built. It gives the general route's bits
(its sums are checked equal, not only its outputs).

The threads claim chunks in turn from an atomic counter, so a vCPU the host slows does less of
the work instead of holding up the call. A system's decision takes and returns scalars
(:mod:`~clipbench.impls.own.numba.fused_decision`) and its short runs are applied through
pointers (``apply.apply_run_f32``). Tens of thousands of tiny systems are per-system work, not
bandwidth, and a scalar decision (~30 ns) and an unpredictable keep-or-scale branch cost more
than their data: chunks of tiny systems go in groups (``_in_groups``), decided in vector lanes
(:mod:`~clipbench.impls.own.numba.lane_decisions`, which also give each system's float32 factor,
so that keeping and scaling take the same branch-free path) and applied in masked steps
(:mod:`~clipbench.impls.own.numba.masked_apply`) leaf by leaf (``scale_group_masked``: a
leaf's addresses stay in registers from run to run), prefetching each run's leaf and output a
fixed distance ahead (``READ_AHEAD``, ``WRITE_AHEAD``). A leaf whose runs in a group all hold
at most ``HALF`` elements (W5's cells) is summed and applied in half the lanes, with the same
bits. A short run's non-finite elements are looked for only when its system's total is not
finite, once per system. One threshold for every system (the usual call) is read by every
system rather than copied per system. A call whose chunks cannot be balanced (a
system larger than a thread's share) goes to :mod:`~clipbench.impls.own.numba.long_runs`, which
cuts runs into blocks. Near-ties are settled exactly on the host afterwards; ids that turn out
unsorted or out of range, and non-finite elements in zero mode, hand the whole call back to the
general route, which raises the same errors.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
from numba import njit

from clipbench.impls.own import decision, exact
from clipbench.impls.own.numba import long_runs, threads
from clipbench.impls.own.numba.apply import apply_run_f32
from clipbench.impls.own.numba.buffers import address, new_outputs
from clipbench.impls.own.numba.decode import F16_TABLE
from clipbench.impls.own.numba.fused_decision import (FUSED_NONFINITE, FUSED_OK, FUSED_UNSORTED,
                                                      decide, nonfinite_flags, run_action,
                                                      threshold_of)
from clipbench.impls.own.numba.intrinsics import (JIT, add_one, prefetch_read, prefetch_write,
                                                  ptr_i32, ptr_i64, ptr_u32, store_fence)
from clipbench.impls.own.numba.lane_decisions import decide_group
from clipbench.impls.own.numba.layout import BLOCK, LeafLayout
from clipbench.impls.own.numba.masked_apply import (MASK_LANES, apply_tiny_run_f32,
                                                    scale_half_run_masked, scale_run_masked)
from clipbench.impls.own.numba.max_step import step_block_f32
from clipbench.impls.own.numba.power_sums import SQUARES_F32
from clipbench.impls.own.numba.records import FusedOutputs, FusedRule, Ids, Leaves, Threshold
from clipbench.impls.own.numba.run_scan import SEG_CODE_OF, SEG_I64, run_end, scan_group
from clipbench.impls.own.numba.short_sums import (SHORT, half_squares_f32, half_step_f32,
                                                  short_squares_f32, short_step_f32)
from clipbench.impls.own.numba.segments import rows_below
from clipbench.impls.own.numba.ties import tie_is_kept

# The systems are cut into chunks that the threads claim in turn: up to this many per thread,
# each of at least CHUNK_MIN_BYTES of leaves. More chunks balance a slowed vCPU better, but
# each chunk restarts its streams (docs/cpu-kernels.md, "Chunks claimed in turn").
CHUNKS_PER_WORKER = 16
CHUNK_MIN_BYTES = 1 << 18
# Chunks whose systems hold at most TINY_ELEMENTS elements on average are decided and applied
# GROUP systems at a time, fewer when there are many leaves (a group's run bounds, leaves x
# systems, stay within GROUP_BOUNDS; docs/cpu-kernels.md, "Many tiny systems").
TINY_ELEMENTS = 64
GROUP = 2048
GROUP_MIN = 64
GROUP_BOUNDS = 8192
# In groups, each run's sums prefetch its leaf READ_AHEAD bytes ahead, and each masked step
# prefetches its output WRITE_AHEAD bytes ahead (for ownership). A tiny system's loads and
# masked stores are too few and too irregular for the hardware prefetchers to run ahead of
# them from memory (docs/cpu-kernels.md, "Prefetching the groups' streams").
READ_AHEAD = 2048
WRITE_AHEAD = 1024
# A leaf whose runs in a group all hold at most HALF elements (W5's cells: 9) is summed and
# applied in half the lanes (short_sums.half_squares_f32, masked_apply.scale_half_run_masked),
# which give the same bits.
HALF = MASK_LANES


def _make_systems_loop(grouped: bool):
  """The loop of ``fused_systems`` over systems [k0, k1): one system at a time (``grouped``
  False: each decided by ``decide`` and applied while in L1), or GROUP at a time for tiny
  systems (the group scanned, then summed with the same blocks, decided together in vector
  lanes and applied in masked steps). Each group is scanned before it is summed: no branch of
  the scan then interrupts the sums, whose chains of additions overlap from system to system.
  ``grouped`` is a compile-time constant: each loop is compiled without the other's branches
  (one loop with the choice at run time took W3 402 ns and W5 83 ns a system, against 380
  and 56 for the two loops; docs/cpu-kernels.md)."""

  @njit(**JIT)
  def systems_loop(k0, k1, rows0, rows1, leaves, ids, rule, out):
    nl = leaves.addrs.size
    group = max(GROUP_MIN, min(GROUP, GROUP_BOUNDS // nl)) if grouped else 1
    cur = rows0.copy()
    bounds = np.empty((nl, group + 1), dtype=np.int64)
    counts = np.empty(group, dtype=np.int64)
    flags = np.empty(group, dtype=np.int64)
    usual = np.empty(group, dtype=np.bool_)
    factors = np.empty(group, dtype=np.float32)
    in_steps = np.empty(group, dtype=np.bool_)
    half = np.zeros(nl, dtype=np.bool_)
    for g0 in range(k0, k1, group):
      ng = min(group, k1 - g0)
      for l in range(nl):
        bounds[l, 0] = cur[l]
        if grouped:
          e = scan_group(ids.addrs[l], ids.codes[l], cur[l], rows1[l], g0, ng, bounds[l, 1:])
        else:
          e = run_end(ids.addrs[l], ids.codes[l], cur[l], rows1[l], g0)
          bounds[l, 1] = e
        if e < 0:
          return FUSED_UNSORTED
        cur[l] = e
        if grouped:
          half[l] = longest_run(bounds[l, :ng + 1]) * leaves.rowsizes[l] <= HALF
      for j in range(ng):
        k = g0 + j
        total = 0.0
        count = 0
        flag = 0
        for l in range(nl):
          r = bounds[l, j]
          e = bounds[l, j + 1]
          if e == r:
            continue
          start = r * leaves.rowsizes[l]
          end = e * leaves.rowsizes[l]
          count += end - start
          if grouped:
            prefetch_read(leaves.addrs[l] + 4 * start + READ_AHEAD)
          if rule.step:
            if leaves.vecs[l] == 3 and half[l]:
              best = half_step_f32(leaves.addrs[l] + 4 * start, end - start)
            elif leaves.vecs[l] == 3 and end - start < SHORT:
              best = short_step_f32(leaves.addrs[l] + 4 * start, end - start)
            else:
              a32 = numba.carray(ptr_u32(leaves.addrs[l]), end)
              best = step_block_f32(a32[start:end], leaves.vecs[l])
            if best == np.inf:
              flag |= nonfinite_flags(leaves, l, start, end - start)
            else:
              total = max(total, best)
            continue
          if end - start < SHORT:  # what SQUARES_F32 does for a short block, without the call
            if half[l]:
              part = half_squares_f32(leaves.addrs[l] + 4 * start, end - start)
            else:
              part = short_squares_f32(leaves.addrs[l] + 4 * start, end - start)
            total += part  # a non-finite part makes the total non-finite: flagged below
            continue
          for b in range(start, end, BLOCK):
            n = min(BLOCK, end - b)
            part = SQUARES_F32(numba.carray(ptr_u32(leaves.addrs[l] + 4 * b), n),
                               np.int64(2), 2.0)
            if not math.isfinite(part):
              flag |= nonfinite_flags(leaves, l, b, n)
            total += part
        if not rule.step and not math.isfinite(total):
          # Squares of float32 sum to finite float64 values, so a short run has a non-finite
          # element exactly when the total is not finite: its flags are looked for only then,
          # not after every run (the check sat at the end of each run's chain of additions).
          for l in range(nl):
            start = bounds[l, j] * leaves.rowsizes[l]
            n = bounds[l, j + 1] * leaves.rowsizes[l] - start
            if 0 < n < SHORT:
              flag |= nonfinite_flags(leaves, l, start, n)
        if flag and rule.zero_mode:  # non-finite elements count as 0: the general route's
          return FUSED_NONFINITE
        out.sums[k] = total
        counts[j] = count
        flags[j] = flag
        if not grouped:
          c_m, c_e, c_inf = threshold_of(rule, k)
          out.norms[k], out.action[k], out.s_m[k], out.s_e[k], out.tie[k] = decide(
              total, count, flag, c_m, c_e, c_inf, rule)
      if grouped:
        decide_group(g0, ng, counts, flags, usual, factors, in_steps, rule, out)
        for l in range(nl):  # no branch on keep or scale, which is a coin toss here
          scale_group_masked(leaves.addrs[l], out.out_addrs[l], leaves.rowsizes[l], bounds[l],
                             ng, in_steps, factors, half[l])
      for j in range(ng):
        k = g0 + j
        if grouped and in_steps[j]:
          continue
        how = run_action(out.action[k], out.s_m[k], out.s_e[k])
        for l in range(nl):
          r = bounds[l, j]
          e = bounds[l, j + 1]
          if e > r:
            if grouped:
              apply_tiny_run_f32(leaves.addrs[l], out.out_addrs[l], leaves.sizes[l],
                                 leaves.table, r * leaves.rowsizes[l],
                                 (e - r) * leaves.rowsizes[l], how)
            else:
              apply_run_f32(leaves.addrs[l], out.out_addrs[l], leaves.sizes[l], leaves.table,
                            r * leaves.rowsizes[l], (e - r) * leaves.rowsizes[l], how)
    for l in range(nl):
      if cur[l] != rows1[l]:
        return FUSED_UNSORTED
    return FUSED_OK
  return systems_loop


_one_by_one = _make_systems_loop(False)
_in_groups = _make_systems_loop(True)


@njit(inline="always", **JIT)
def scale_group_masked(addr, out_addr, rowsize, bounds, ng, in_steps, factors, half):
  """A group's runs in one leaf that go to the masked steps (``in_steps[j]``), rows
  [bounds[j], bounds[j + 1]) of ``rowsize`` elements of the float32 leaf at ``addr``, scaled
  by ``factors[j]`` into ``out_addr`` (in half the lanes when ``half``: every run at most HALF
  elements). Leaf by leaf, the leaf's addresses stay in registers from run to run."""
  for j in range(ng):
    if in_steps[j]:
      start = bounds[j] * rowsize
      n = bounds[j + 1] * rowsize - start
      prefetch_write(out_addr + 4 * start + WRITE_AHEAD)
      if half:
        scale_half_run_masked(addr + 4 * start, out_addr + 4 * start, n, factors[j])
      else:
        scale_run_masked(addr + 4 * start, out_addr + 4 * start, n, factors[j])


@njit(inline="always", **JIT)
def longest_run(bounds):
  """The most rows between consecutive entries of ``bounds`` (a group's run bounds in a leaf)."""
  longest = 0
  for j in range(bounds.size - 1):
    longest = max(longest, bounds[j + 1] - bounds[j])
  return longest


@njit(inline="always", **JIT)
def in_groups(elements, systems):
  """Whether a chunk of ``systems`` systems holding ``elements`` elements goes in groups."""
  return elements <= TINY_ELEMENTS * systems


@njit(**JIT)
def fused_systems(k0, k1, rows0, rows1, leaves, ids, rule, out):
  """Systems [k0, k1) of float32 leaves whose rows [rows0[l], rows1[l]) hold exactly those
  systems' ids, in order: L2 (``rule.step`` False) or max-step norms, decisions and outputs,
  as the general route's blocks, combine, finalize and apply kernels compute them
  (``out.sums``: each system's sum of squares, or largest vector sum for max-step, as the
  combine kernels give it, for the tests of that claim). Returns FUSED_OK, or
  FUSED_UNSORTED / FUSED_NONFINITE (then nothing it wrote is to be used).

  Systems go one at a time, each in L1 from its sums to its scaling, except in chunks of
  tiny systems (at most ``TINY_ELEMENTS`` elements a system on average), which go in groups
  (``_in_groups``)."""
  elements = 0
  for l in range(leaves.addrs.size):
    elements += (rows1[l] - rows0[l]) * leaves.rowsizes[l]
  if in_groups(elements, k1 - k0):
    return _in_groups(k0, k1, rows0, rows1, leaves, ids, rule, out)
  return _one_by_one(k0, k1, rows0, rows1, leaves, ids, rule, out)


@njit(**JIT)
def fused_claimed(counter, cuts, bounds, status, leaves, ids, rule, out):
  """``fused_systems`` over chunks t of systems [cuts[t], cuts[t + 1]) (rows
  [bounds[t], bounds[t + 1])), each claimed from ``counter`` (``threads.new_counter``) by
  whichever thread is free; status[t] is the chunk's return value."""
  parts = cuts.size - 1
  add_one(counter, threads.STARTED)
  while True:
    t = add_one(counter, threads.NEXT)
    if t >= parts:
      store_fence()  # once per thread, not per chunk: each fence drains the store buffers
      add_one(counter, threads.FINISHED)
      return
    status[t] = fused_systems(cuts[t], cuts[t + 1], bounds[t], bounds[t + 1], leaves, ids,
                              rule, out)


def qualifies(leaves: list[np.ndarray], segments: Any, num_systems: Any, nonfinite: Any) -> bool:
  """Whether a call with checked leaves can take the fused route: every leaf a C-contiguous
  float32 array with rows, every segment a contiguous int64 or int32 array of its leaf's rows,
  at least one system and a valid non-finite mode. The kernel checks that the ids are sorted
  and in range as it goes."""
  if (not leaves or not isinstance(segments, (list, tuple)) or len(segments) != len(leaves) or
      not isinstance(num_systems, (int, np.integer)) or
      isinstance(num_systems, (bool, np.bool_)) or num_systems < 1 or
      nonfinite not in ("propagate", "zero")):
    return False
  for x, seg in zip(leaves, segments):
    if (type(x) is not np.ndarray or x.dtype != np.float32 or x.ndim < 1 or
        not x.flags.c_contiguous or type(seg) is not np.ndarray or seg.ndim != 1 or
        seg.dtype not in SEG_CODE_OF or not seg.flags.c_contiguous or
        seg.shape[0] != x.shape[0]):
      return False
  return True


def ids_of(segments: list[np.ndarray]) -> Ids:
  """The :class:`~clipbench.impls.own.numba.records.Ids` of a call's segment id arrays."""
  return Ids(np.array([address(g) for g in segments], dtype=np.int64),
             np.array([SEG_CODE_OF[g.dtype] for g in segments], dtype=np.int64))


def _chunks(layout: LeafLayout, ids: Ids, num_systems: int):
  """(cuts, bounds): chunk t holds systems [cuts[t], cuts[t + 1]) and, in leaf l, rows
  [bounds[t, l], bounds[t + 1, l]). Cut where the largest leaf's rows split evenly; each
  leaf's rows are cut at the same systems (a binary search, checked by the kernels: if the
  ids are not sorted, some chunk is not consumed exactly)."""
  ns, sizes, rows = num_systems, layout.sizes, layout.rows
  total = int(sizes.sum())
  parts = 1 if total < threads.PARALLEL_MIN else min(
      ns, threads.WORKERS * CHUNKS_PER_WORKER, max(threads.WORKERS,
                                                   4 * total // CHUNK_MIN_BYTES))
  return _cut_chunks(ids.addrs, ids.codes, rows, int(np.argmax(sizes)), ns, parts)


@njit(inline="always", **JIT)
def _id_at(seg_addr, seg_code, r):
  """Id r of the int64 (SEG_I64) or int32 id array at ``seg_addr``."""
  if seg_code == SEG_I64:
    return np.int64(numba.carray(ptr_i64(seg_addr), r + 1)[r])
  return np.int64(numba.carray(ptr_i32(seg_addr), r + 1)[r])


@njit(**JIT)
def _cut_chunks(seg_addrs, seg_codes, rows, big, ns, parts):
  """``_chunks``' cuts and bounds: the ids at the largest leaf's even splits (made
  non-decreasing and at most ns), and in every leaf the rows whose ids are below each cut
  (a binary search, as ``segments.rows_below_each``; unsorted ids give some bounds, which the
  kernels then reject). The first chunk starts at row 0, the last ends at the last row."""
  nl = rows.size
  cuts = np.empty(parts + 1, dtype=np.int64)
  cuts[0] = 0
  for t in range(1, parts):
    cuts[t] = min(max(_id_at(seg_addrs[big], seg_codes[big], rows[big] * t // parts),
                      cuts[t - 1]), ns)
  cuts[parts] = ns
  bounds = np.empty((parts + 1, nl), dtype=np.int64)
  for l in range(nl):
    bounds[0, l] = 0
    for t in range(1, parts):
      lo, hi = 0, rows[l]
      while lo < hi:
        mid = (lo + hi) >> 1
        if _id_at(seg_addrs[l], seg_codes[l], mid) < cuts[t]:
          lo = mid + 1
        else:
          hi = mid
      bounds[t, l] = max(lo, bounds[t - 1, l])
    bounds[parts, l] = rows[l]
  return cuts, bounds


def run(leaves: list[np.ndarray], layout: LeafLayout, threshold: Any,
        segments: list[np.ndarray], num_systems: int, zero_mode: bool, step: bool, *,
        sums: np.ndarray | None = None):
  """The fused route for a call that ``qualifies`` with a checked threshold: (outputs,
  norms), or None when the kernel hands the call back (ids unsorted or out of range,
  non-finite elements in zero mode). ``sums`` (float64, one per system) receives the
  per-system sums the decisions were made from."""
  ns = int(num_systems)
  c = np.asarray(threshold, dtype=np.float64)
  # One threshold for every system (the usual call) is split once and read by every system:
  # per-system copies of it cost the host ~0.1 ms and the kernel 17 bytes a system (W5).
  one = c.ndim == 0
  c_m, c_e, c_inf = exact.exact_frexp(c.reshape(-1))
  step_rel_err = float(decision.sum_rel_err(float(layout.vecs.max()), 0.0)) if step else 0.0
  rule = FusedRule(Threshold(c_m, c_e.astype(np.int64), c_inf), step, step_rel_err, zero_mode,
                   one)
  outs, out_addrs = new_outputs(layout.codes, layout.sizes, layout.shapes)
  out = FusedOutputs(out_addrs, np.empty(ns) if sums is None else sums,
                     np.empty(ns, dtype=np.float32), np.empty(ns, dtype=np.int8), np.empty(ns),
                     np.empty(ns, dtype=np.int64), np.empty(ns, dtype=np.bool_))
  fused_leaves = Leaves(np.array([address(x) for x in leaves], dtype=np.int64), layout.sizes,
                        layout.codes, layout.rowsizes, layout.vecs, F16_TABLE)
  ids = ids_of(segments)
  cuts, bounds = _chunks(layout, ids, ns)
  if long_runs.unbalanced(bounds, layout):
    if long_runs.run(fused_leaves, layout, ids, segments, rule, out) != FUSED_OK:
      return None
  else:
    parts = cuts.size - 1
    status = np.full(parts, FUSED_OK, dtype=np.int64)
    counter = threads.new_counter()
    threads.on_threads(
        lambda: fused_claimed(counter, cuts, bounds, status, fused_leaves, ids, rule, out),
        min(threads.WORKERS, parts), lambda: threads.all_finished(counter))
    if np.any(status != FUSED_OK):
      return None
  ties = np.flatnonzero(out.tie).tolist()
  flat = [(x.reshape(int(n), int(r)), o.reshape(int(n), int(r)))
          for x, o, n, r in zip(leaves, outs, layout.rows, layout.rowsizes)] if ties else []
  for k in ties:
    spans = [(rows_below(g, k), rows_below(g, k + 1)) for g in segments]
    values = [x[lo:hi].astype(np.float64) for (x, _), (lo, hi) in zip(flat, spans)]
    if step:
      values = [v.reshape(-1, int(d)) for v, d in zip(values, layout.vecs)]
    if tie_is_kept(values, float(c if one else c[k]), 2.0, step):
      for (x, o), (lo, hi) in zip(flat, spans):
        o[lo:hi] = x[lo:hi]
  return outs, out.norms
