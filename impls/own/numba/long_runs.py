"""The fused route's blocks of long runs: calls whose work is a few systems (one giant one).

The fused route hands whole systems to the threads, so a call whose largest system holds most
of the rows (W6: one system of 4M atoms) ran on one thread. Here the runs are cut into the
general route's blocks (:func:`~clipbench.impls.own.numba.layout.build_blocks`: ``BLOCK``
elements counted from each run's start, or whole vectors for max-step) and the threads take
ranges of blocks twice: first each block's ids are checked (every row of the block must hold
its system's id, the ``run_scan`` vector compare) and its sum of squares (or largest vector
sum) taken with the same block function; then, after each system's block sums are added in
leaf order and block order and decided (``fused_decision.decide``, as the fused kernel does),
each block is applied. The same sums in the same order, so the same bits as both other
routes; the ids are read once, in the first pass. The threads claim ranges of blocks in turn
from an atomic counter, as the fused route's chunks, so a slowed thread does less of the
work. Two hand-offs per call instead of one: on a machine whose cores are taken by other
processes, each waits for a thread to be scheduled, and one thread on the whole system can
then be faster (docs/cpu-kernels.md).

Row offsets come from a binary search that assumes sorted ids; the block check then proves
them: every row lies in some system's blocks, and every block's rows hold its system's id,
exactly when the ids are sorted and in range. Otherwise, or with non-finite elements in zero
mode, the call goes back to the general route.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit

from clipbench.impls.own.numba import threads
from clipbench.impls.own.numba.apply import apply_run_f32
from clipbench.impls.own.numba.fused_decision import (FUSED_NONFINITE, FUSED_OK, FUSED_UNSORTED,
                                                      decide, nonfinite_flags, run_action,
                                                      threshold_of)
from clipbench.impls.own.numba.intrinsics import JIT, add_one, ptr_u32, store_fence
from clipbench.impls.own.numba.layout import BLOCK, LeafLayout, build_blocks
from clipbench.impls.own.numba.max_step import step_block_f32
from clipbench.impls.own.numba.power_sums import SQUARES_F32
from clipbench.impls.own.numba.records import Blocks
from clipbench.impls.own.numba.run_scan import run_end
from clipbench.impls.own.numba.segments import rows_below_each

# Whole systems per thread leave a thread idle when one chunk holds more than this share of
# one thread's rows; cutting runs into blocks reads the leaves twice instead of once, which
# pays only when the imbalance is larger.
UNBALANCED_SHARE = 1.4
# Blocks per claim: the threads take ranges of this many blocks in turn (1 MB of float32), so
# that a thread the machine slows takes fewer of them; each claim restarts the streams.
CLAIM_BLOCKS = 32


def unbalanced(bounds: np.ndarray, layout: LeafLayout) -> bool:
  """Whether the fused route's chunks (row ``bounds`` per leaf, from ``fused._chunks``) leave
  a thread with more than ``UNBALANCED_SHARE`` times its share of the largest leaf's rows."""
  if threads.WORKERS < 2 or int(layout.sizes.sum()) < threads.PARALLEL_MIN:
    return False
  big = int(np.argmax(layout.sizes))
  rows = np.diff(bounds[:, big])
  return int(rows.max()) * threads.WORKERS > UNBALANCED_SHARE * int(layout.rows[big])


@njit(**JIT)
def sum_blocks(i0, i1, part, flags, bad, leaves, ids, blocks, step):
  """Blocks [i0, i1): bad[b] when some row of block b does not hold its system's id, else its
  sum of squares (or largest vector sum, 0.0 when not finite) and non-finite flags."""
  for it in range(i0, i1):
    l = blocks.leaf[it]
    k = blocks.system[it]
    start = blocks.start[it]
    n = blocks.length[it]
    rs = leaves.rowsizes[l]
    r0 = start // rs
    r1 = (start + n + rs - 1) // rs
    if run_end(ids.addrs[l], ids.codes[l], r0, r1, k) != r1:
      bad[it] = True
      continue
    xs = numba.carray(ptr_u32(leaves.addrs[l] + 4 * start), n)
    if step:
      best = step_block_f32(xs, leaves.vecs[l])
      if best == np.inf:
        flags[it] = nonfinite_flags(leaves, l, start, n)
        best = 0.0
      part[it] = best
    else:
      s = SQUARES_F32(xs, np.int64(2), 2.0)
      if not math.isfinite(s):
        flags[it] = nonfinite_flags(leaves, l, start, n)
      part[it] = s


@njit(**JIT)
def decide_systems(blocks, part, flags, rule, out):
  """Each system's block sums added (or maxima taken) in block order, which is leaf order then
  run order, and the system decided; FUSED_NONFINITE for non-finite elements in zero mode."""
  ns = out.norms.size
  total = np.zeros(ns)
  count = np.zeros(ns, dtype=np.int64)
  system_flags = np.zeros(ns, dtype=np.int64)
  for it in range(blocks.leaf.size):
    k = blocks.system[it]
    if rule.step:
      total[k] = max(total[k], part[it])
    else:
      total[k] += part[it]
    count[k] += blocks.length[it]
    system_flags[k] |= flags[it]
  for k in range(ns):
    if system_flags[k] and rule.zero_mode:
      return FUSED_NONFINITE
    c_m, c_e, c_inf = threshold_of(rule, k)
    norm, act, sm, se, tie = decide(total[k], count[k], system_flags[k], c_m, c_e, c_inf, rule)
    out.norms[k] = norm
    out.sums[k] = total[k]
    out.action[k] = act
    out.s_m[k] = sm
    out.s_e[k] = se
    out.tie[k] = tie
  return FUSED_OK


@njit(**JIT)
def apply_blocks(i0, i1, leaves, blocks, out):
  """Blocks [i0, i1) kept, filled with NaN or scaled as their system's decision says."""
  for it in range(i0, i1):
    k = blocks.system[it]
    l = blocks.leaf[it]
    how = run_action(out.action[k], out.s_m[k], out.s_e[k])
    apply_run_f32(leaves.addrs[l], out.out_addrs[l], leaves.sizes[l], leaves.table,
                  blocks.start[it], blocks.length[it], how)


@njit(**JIT)
def sum_claimed(counter, part, flags, bad, leaves, ids, blocks, step):
  """``sum_blocks`` over ranges of CLAIM_BLOCKS blocks, each claimed from ``counter``."""
  m = blocks.leaf.size
  while True:
    i0 = add_one(counter, 0) * CLAIM_BLOCKS
    if i0 >= m:
      return
    sum_blocks(i0, min(i0 + CLAIM_BLOCKS, m), part, flags, bad, leaves, ids, blocks, step)


@njit(**JIT)
def apply_claimed(counter, leaves, blocks, out):
  """``apply_blocks`` over ranges of CLAIM_BLOCKS blocks, each claimed from ``counter``."""
  m = blocks.leaf.size
  while True:
    i0 = add_one(counter, 0) * CLAIM_BLOCKS
    if i0 >= m:
      store_fence()  # once per thread: each fence drains the store buffers
      return
    apply_blocks(i0, min(i0 + CLAIM_BLOCKS, m), leaves, blocks, out)


def run(leaves, layout: LeafLayout, ids, segments: list[np.ndarray], rule, out) -> int:
  """The call of ``fused.run`` (its records) by blocks: FUSED_OK, or FUSED_UNSORTED /
  FUSED_NONFINITE when it must go to the general route."""
  ns = out.norms.size
  if np.any(layout.rowsizes == 0):
    return FUSED_UNSORTED  # rows without elements have no blocks to check their ids
  keys = np.arange(ns + 1, dtype=np.int64)
  offsets = np.empty((len(segments), ns + 1), dtype=np.int64)
  for l, g in enumerate(segments):
    offsets[l] = rows_below_each(g, keys)
    if offsets[l, 0] != 0 or offsets[l, ns] != g.size:
      return FUSED_UNSORTED  # ids below 0 or not below num_systems
  norm_blocks = Blocks(*build_blocks(offsets, layout.rowsizes, layout.vecs, BLOCK, rule.step))
  m = norm_blocks.leaf.size
  part = np.zeros(m)
  flags = np.zeros(m, dtype=np.int64)
  bad = np.zeros(m, dtype=np.bool_)
  counter = np.zeros(1, dtype=np.int64)
  threads.on_threads(
      lambda: sum_claimed(counter, part, flags, bad, leaves, ids, norm_blocks, rule.step),
      threads.WORKERS)
  if bad.any():
    return FUSED_UNSORTED
  status = decide_systems(norm_blocks, part, flags, rule, out)
  if status != FUSED_OK:
    return status
  apply = norm_blocks if not rule.step else Blocks(
      *build_blocks(offsets, layout.rowsizes, layout.vecs, BLOCK, False))
  counter[0] = 0
  threads.on_threads(lambda: apply_claimed(counter, leaves, apply, out), threads.WORKERS)
  return FUSED_OK
