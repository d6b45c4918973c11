"""The general route: any dtypes, p, layout and non-finite mode, in separate passes.

Per call: the norm passes over every block (power sums, extremes, scaled double-double sums
or max-step maxima) on the thread pool, the per-system combine in block order, the compiled
finalize, the exact decision of near-ties on the host, and the apply pass. The fused route
(:mod:`~clipbench.impls.own.numba.fused`) hands every call it does not take to ``run``.

The norm passes reach the blocks through a *block source*: :class:`LocalBlocks` reads every
block from this process's leaves; :class:`~clipbench.impls.own.numba.sharded.ShardedBlocks`
reads the blocks its shard holds and receives the others' results from the other ranks, so
that a sharded call folds the same block results in the same order (SPEC rule 14).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from clipbench.impls.own import decision, exact
from clipbench.impls.own import double_double as shared
from clipbench.impls.own.numba import threads
from clipbench.impls.own.numba.apply import apply_blocks, apply_rows
from clipbench.impls.own.numba.combine import (combine_dd, combine_extreme, combine_flags,
                                               combine_step, combine_sum, count_per_system)
from clipbench.impls.own.numba.decode import F64
from clipbench.impls.own.numba.extremes import extreme_blocks, merge_extremes
from clipbench.impls.own.numba.finalize import finalize_systems
from clipbench.impls.own.numba.layout import LeafLayout, Prepared
from clipbench.impls.own.numba.max_step import merge_step, step_blocks
from clipbench.impls.own.numba.power_sums import (ABS, INT, SQ, power_sum_kernel,
                                                  sub_block_split, term_of, term_rel_err)
from clipbench.impls.own.numba.records import (Decisions, PowerTerm, Scaling, StepMaxima,
                                               SystemSums, Threshold)
from clipbench.impls.own.numba.scaled_sums import SPLIT as SCALED_SPLIT
from clipbench.impls.own.numba.scaled_sums import scaled_sum_blocks
from clipbench.impls.own.numba.segments import CheckedSegments
from clipbench.impls.own.numba.ties import tie_is_kept


class LocalBlocks:
  """Every block read from this process's leaves (the unsharded call)."""

  def __init__(self, prep: Prepared):
    self.prep = prep
    self.num_systems = prep.num_systems
    self.vecs = prep.layout.vecs

  def blocks(self, by_vectors: bool):
    """The blocks of every run, in the order their results are folded."""
    return self.prep.blocks(by_vectors)

  def run(self, kernel, outputs: tuple, by_vectors: bool, *args: Any, split=None,
          merge=None) -> None:
    """``kernel`` over every block, writing each block's results into ``outputs`` (``split``
    and ``merge`` serve sources that hold parts of blocks: :class:`.sharded.ShardedBlocks`)."""
    del split, merge
    blocks = self.prep.blocks(by_vectors)
    threads.parallel(kernel, blocks.length, *outputs, self.prep.norm_inputs, blocks, *args)

  def ties_kept(self, systems: list[int], c: np.ndarray, p: float, step: bool) -> list[bool]:
    """The exact decisions of near-ties: is each system's norm at or below its threshold?"""
    return [tie_is_kept(self.prep.system_vectors(k) if step else self.prep.system_values(k),
                        float(c[k]), p, step) for k in systems]


def _extreme(prep, want_min: bool, zero_mode: bool):
  """Per-system max |x| (or min) and non-finite flags."""
  blocks = prep.blocks(False)
  part = np.empty(blocks.leaf.size)
  flags = np.zeros(blocks.leaf.size, dtype=np.int8)
  prep.run(extreme_blocks, (part, flags), False, want_min, zero_mode, merge=merge_extremes)
  s = prep.num_systems
  return (combine_extreme(blocks.system, part, s, want_min),
          combine_flags(blocks.system, flags, s))


def global_stats(prep, p: float, zero_mode: bool, f64_mode: bool) -> dict[str, Any]:
  """Per-system finalize inputs for the p-norm (rule 1)."""
  s = prep.num_systems
  blocks = prep.blocks(False)
  count = count_per_system(blocks.system, blocks.length, s)
  if math.isinf(p):
    mx, flags = _extreme(prep, p < 0, zero_mode)
    mx = np.where(count == 0, 0.0, mx)
    sc_m, sc_e = np.frexp(np.where(mx > 0, mx, 1.0))
    return dict(s_hi=np.ones(s), s_lo=np.zeros(s), sc_m=sc_m, sc_e=sc_e, rel_err=np.zeros(s),
                zero=mx == 0, flags=flags)
  kind, ip = term_of(p)
  power = PowerTerm(kind, ip, p)
  if not f64_mode and p <= 6.0:
    part = np.empty(blocks.leaf.size)
    flags = np.zeros(blocks.leaf.size, dtype=np.int8)
    prep.run(power_sum_kernel(kind, ip), (part, flags), False, power, zero_mode,
             split=sub_block_split(kind, ip, zero_mode))
    tot = combine_sum(blocks.system, part, s)
    flags = combine_flags(blocks.system, flags, s)
    rel = decision.sum_rel_err(count, term_rel_err(p, kind))
    return dict(s_hi=tot, s_lo=np.zeros(s), sc_m=np.full(s, 0.5), sc_e=np.ones(s, np.int32),
                rel_err=rel, zero=tot == 0, flags=flags)
  # Scaled double-double sums: max |x| first, then (|x| / 2**K)**p with max in [0.5, 1).
  mx, flags = _extreme(prep, False, zero_mode)
  zero = mx == 0
  divide = p > 512.0  # (1/2)**p would underflow: scale by the max itself (max term = 1)
  if divide:
    inv = np.where(zero, 1.0, mx)
    inv2 = np.ones_like(inv)
    sc_m, sc_e = np.frexp(inv)
    term_err = shared.DD_POW_REL_ERR + 2.0 ** -400
  else:
    k = np.frexp(np.where(zero, 1.0, mx))[1].astype(np.int64)
    sc_m, sc_e = np.full(s, 0.5), (k + 1).astype(np.int32)  # scale 2**k
    inv = np.ldexp(1.0, np.minimum(-k, 1000).astype(np.int32))
    inv2 = np.ldexp(1.0, np.maximum(-k - 1000, 0).astype(np.int32))
    term_err = 0.0 if kind in (ABS, SQ) else (
        2.0 ** -100 * p if kind == INT else shared.DD_POW_REL_ERR) + 2.0 ** -400
  hi = np.empty(blocks.leaf.size)
  lo = np.empty(blocks.leaf.size)
  prep.run(scaled_sum_blocks, (hi, lo), False, Scaling(inv, inv2, divide), power,
           split=SCALED_SPLIT)
  tot_hi, tot_lo = combine_dd(blocks.system, hi, lo, s)
  rel = decision.sum_rel_err(count, term_err, dd=True)
  return dict(s_hi=tot_hi, s_lo=tot_lo, sc_m=sc_m, sc_e=sc_e, rel_err=rel, zero=zero,
              flags=flags)


def step_stats(prep, zero_mode: bool, f64_mode: bool) -> dict[str, Any]:
  """Per-system finalize inputs for the step norm (rule 2): the largest vector's squares."""
  s = prep.num_systems
  blocks = prep.blocks(True)
  m = blocks.leaf.size
  maxima = StepMaxima(np.zeros(m, dtype=np.int64), np.zeros(m), np.zeros(m),
                      np.zeros(m, dtype=np.int8))
  prep.run(step_blocks, (maxima,), True, zero_mode, f64_mode, merge=merge_step)
  k, hi, lo = combine_step(blocks.system, maxima.k, maxima.hi, maxima.lo, s)
  flags = combine_flags(blocks.system, maxima.flags, s)
  vecs = prep.vecs
  d = float(vecs.max()) if vecs.size else 1.0
  rel = decision.sum_rel_err(np.full(s, d), 0.0, dd=f64_mode)
  return dict(s_hi=hi, s_lo=lo, sc_m=np.full(s, 0.5), sc_e=(k + 1).astype(np.int32),
              rel_err=rel, zero=hi == 0, flags=flags)


def run(leaves: list[np.ndarray], layout: LeafLayout, threshold: Any, segments: CheckedSegments,
        p: float, nonfinite: str, step: bool = False):
  """One call of validated arguments: (output leaves, per-system norms)."""
  prep = Prepared(leaves, layout, segments)
  decisions, norms = decide(LocalBlocks(prep), layout, threshold, p, nonfinite, step)
  return apply(prep, decisions), norms


def decide(source, layout: LeafLayout, threshold: Any, p: float, nonfinite: str,
           step: bool = False) -> tuple[Decisions, np.ndarray]:
  """Per-system decisions and norms from the blocks of ``source`` (a block source, above);
  ``layout`` describes the whole leaves (their dtypes decide the precision)."""
  num_systems = source.num_systems
  f64_mode = bool(np.any(layout.codes == F64))
  zero_mode = nonfinite == "zero"
  st = step_stats(source, zero_mode, f64_mode) if step else global_stats(
      source, p, zero_mode, f64_mode)
  flags = st["flags"]
  nan = (flags & 1) != 0
  inf = ((flags & 2) != 0) & ~nan
  if zero_mode:
    zero_sys = flags != 0
    nan = inf = np.zeros_like(nan)
  else:
    zero_sys = np.zeros(num_systems, dtype=np.bool_)
  c = np.broadcast_to(np.asarray(threshold, dtype=np.float64), (num_systems,))
  c_m, c_e, c_inf = exact.exact_frexp(c)
  sc_e = st["sc_e"]
  sums = SystemSums(
      np.ascontiguousarray(st["s_hi"], np.float64), np.ascontiguousarray(st["s_lo"], np.float64),
      np.ascontiguousarray(st["sc_m"], np.float64), np.ascontiguousarray(sc_e, np.int64),
      np.ascontiguousarray(st["rel_err"], np.float64), np.ascontiguousarray(st["zero"], np.bool_),
      nan, inf)
  norm_v, action, s_m, s_e, tie = finalize_systems(
      sums, Threshold(c_m, c_e.astype(np.int64), c_inf.astype(np.bool_)),
      2.0 if step else float(p), f64_mode)
  tied = np.flatnonzero(tie).tolist()
  for k, kept in zip(tied, source.ties_kept(tied, c, p, step)):
    if kept:
      action[k] = decision.KEEP
  norm_dtype = np.float64 if f64_mode else np.float32
  norms = decision.compose_norm(norm_v, sc_e, st["zero"], nan, inf, norm_dtype)
  with np.errstate(all="ignore"):
    s_val = np.ldexp(s_m, s_e)
  return Decisions(action, s_m, s_e.astype(np.int64), s_val, zero_sys, f64_mode), norms


def apply(prep: Prepared, decisions: Decisions) -> list[np.ndarray]:
  """The apply pass: blocks of leaves read in place, rows of leaves with unsorted ids."""
  outs, out_addrs = prep.new_outputs()
  if not outs:
    return outs
  unsorted = [i for i, g in enumerate(prep.gathered) if g is not None]
  if len(unsorted) < len(outs):
    blocks = prep.blocks(False)
    if unsorted:
      keep = np.ones(blocks.leaf.size, dtype=np.bool_)
      for i in unsorted:
        keep &= blocks.leaf != i
      blocks = type(blocks)(*(field[keep] for field in blocks))
    threads.parallel(apply_blocks, blocks.length, prep.inputs, out_addrs, blocks, decisions)
  for i in unsorted:
    rows = prep.row_segs[i].size
    threads.parallel(apply_rows, np.full(rows, prep.layout.rowsizes[i]), prep.inputs, out_addrs,
                     i, prep.row_segs[i], decisions)
  return outs
