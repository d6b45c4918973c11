"""Per-system reductions of per-block results, in block order (leaf, then block).

A system's block sums are folded left in that order, so the order is a fixed function of the
layout (SPEC rule 11); maxima, minima and flags are exact in any order.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from clipbench.impls.own.numba.double_double import dd_add
from clipbench.impls.own.numba.intrinsics import JIT
from clipbench.impls.own.numba.max_step import exceeds


@njit(**JIT)
def combine_sum(it_sys, part, num_systems):
  """Per-system left fold of the block sums, in block order."""
  tot = np.zeros(num_systems)
  for it in range(it_sys.size):
    tot[it_sys[it]] += part[it]
  return tot


@njit(**JIT)
def combine_dd(it_sys, hi, lo, num_systems):
  """Per-system double-double fold of the block sums, in block order."""
  tot_hi = np.zeros(num_systems)
  tot_lo = np.zeros(num_systems)
  for it in range(it_sys.size):
    k = it_sys[it]
    tot_hi[k], tot_lo[k] = dd_add(tot_hi[k], tot_lo[k], hi[it], lo[it])
  return tot_hi, tot_lo


@njit(**JIT)
def combine_flags(it_sys, flags, num_systems):
  """Per-system union of the blocks' non-finite flags."""
  out = np.zeros(num_systems, dtype=np.int8)
  for it in range(it_sys.size):
    out[it_sys[it]] |= flags[it]
  return out


@njit(**JIT)
def combine_extreme(it_sys, part, num_systems, want_min):
  """Per-system min (``want_min``) or max of the blocks' extremes."""
  out = np.full(num_systems, np.inf if want_min else 0.0)
  for it in range(it_sys.size):
    k = it_sys[it]
    out[k] = min(out[k], part[it]) if want_min else max(out[k], part[it])
  return out


@njit(**JIT)
def combine_step(it_sys, ks, his, los, num_systems):
  """Per-system largest vector sum of squares, (hi + lo) * 4**k, of the blocks' largest."""
  out_k = np.zeros(num_systems, dtype=np.int64)
  out_hi = np.zeros(num_systems)
  out_lo = np.zeros(num_systems)
  for it in range(it_sys.size):
    j = it_sys[it]
    k, hi, lo = ks[it], his[it], los[it]
    if hi == 0.0:
      continue
    if exceeds(k, hi, lo, out_k[j], out_hi[j], out_lo[j]):
      out_k[j], out_hi[j], out_lo[j] = k, hi, lo
  return out_k, out_hi, out_lo


@njit(**JIT)
def count_per_system(it_sys, it_len, num_systems):
  """Per-system element count."""
  out = np.zeros(num_systems, dtype=np.int64)
  for it in range(it_sys.size):
    out[it_sys[it]] += it_len[it]
  return out
