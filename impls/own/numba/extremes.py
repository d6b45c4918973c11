"""The max (or min) |x| of every block: the p = +-inf norms and the scale of scaled sums.

Extremes of |x| are taken on the bit patterns (for nonnegative floats the integer order is
the float order): integer min/max reductions vectorise without fast-math, and NaN/inf have
the largest patterns, which flags them for a careful re-scan of the block. Maxima are exact,
so their order does not matter (SPEC rule 11).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from clipbench.impls.own.numba.decode import (F32, F64, bits_value, block_views, load,
                                              nonfinite_bits)
from clipbench.impls.own.numba.intrinsics import JIT


@njit(**JIT)
def bits_extreme(code, a16, a32, a64, start, n, want_min):
  """Smallest and largest |x| bit patterns of a block (indexed integer reductions vectorise;
  the min is only taken when asked for)."""
  lo = np.uint64(0xFFFFFFFFFFFFFFFF)
  if code == F32:
    xs = a32[start:start + n]
    hi32 = np.uint32(0)
    for j in range(n):
      hi32 = max(hi32, xs[j] & np.uint32(0x7FFFFFFF))
    if want_min:
      lo32 = np.uint32(0xFFFFFFFF)
      for j in range(n):
        lo32 = min(lo32, xs[j] & np.uint32(0x7FFFFFFF))
      lo = np.uint64(lo32)
    return lo, np.uint64(hi32)
  hi = np.uint64(0)
  if code == F64:
    ys = a64[start:start + n]
    for j in range(n):
      v = ys[j] & np.uint64(0x7FFFFFFFFFFFFFFF)
      lo = min(lo, v)
      hi = max(hi, v)
  else:
    hs = a16[start:start + n]
    for j in range(n):
      v = np.uint64(hs[j] & np.uint16(0x7FFF))
      lo = min(lo, v)
      hi = max(hi, v)
  return lo, hi


@njit(**JIT)
def extreme_blocks(i0, i1, part, flags, leaves, blocks, want_min, zero_mode):
  """Blocks [i0, i1): max |x| (or min |x|) and non-finite flags; non-finite count as 0 in
  zero mode (and are skipped otherwise: such a system is poisoned anyway)."""
  table = leaves.table
  for it in range(i0, i1):
    code, a16, a32, a64, start, n = block_views(leaves, blocks, it)
    lo, hi = bits_extreme(code, a16, a32, a64, start, n, want_min)
    if hi < nonfinite_bits(code):
      part[it] = bits_value(code, lo if want_min else hi, table)
      flags[it] = 0
      continue
    best = np.inf if want_min else 0.0
    f = 0
    for j in range(n):
      v = abs(load(code, a16, a32, a64, start + j, table))
      if not math.isfinite(v):
        f |= 1 if math.isnan(v) else 2
        if not zero_mode:
          continue
        v = 0.0
      best = min(best, v) if want_min else max(best, v)
    part[it] = best
    flags[it] = f


@njit(**JIT)
def merge_extremes(block_of, piece_part, piece_flags, part, flags, want_min, zero_mode):
  """Blocks from their pieces' ``extreme_blocks`` results (``block_of``: each piece's block,
  pieces in element order): what ``extreme_blocks`` gives for the whole block, since a max or
  min over the elements is the max or min over any split of them, flags their union."""
  for it in range(block_of.size):
    b = block_of[it]
    part[b] = np.inf if want_min else 0.0
    flags[b] = 0
  for it in range(block_of.size):
    b = block_of[it]
    part[b] = min(part[b], piece_part[it]) if want_min else max(part[b], piece_part[it])
    flags[b] |= piece_flags[it]
