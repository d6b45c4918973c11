"""The max-step pass: each block's largest vector sum of squares (SPEC rule 2).

A block holds whole vectors (the last axis). Without float64 leaves each vector's squares are
summed in float64 in order (exact squares, one fixed order); with them each vector is scaled
by a power of two and its exact squares summed in double-double, as (hi + lo) * 4**k with
hi in [1, 4), so that vectors compare lexicographically on (k, hi, lo).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from clipbench.impls.own.numba.decode import F32, block_views, load
from clipbench.impls.own.numba.double_double import dd_add
from clipbench.impls.own.numba.intrinsics import JIT, f32, f64, fma, u64


@njit(inline="always", **JIT)
def exceeds(k, hi, lo, best_k, best_hi, best_lo):
  """Whether (hi + lo) * 4**k is above the best so far (none yet while best_hi is 0)."""
  return best_hi == 0.0 or k > best_k or (k == best_k and (hi > best_hi or (
      hi == best_hi and lo > best_lo)))


@njit(**JIT)
def step_block_f32(xs, d):
  """Largest vector sum of squares of a float32 block (each vector summed in order, float64);
  inf when some element is not finite. The max is taken on the bit patterns (sums are >= 0,
  NaN and inf have the largest patterns), an integer reduction that vectorises."""
  best = np.uint64(0)
  if d == 3:  # the same order as the general loop below (0.0 + a == a exactly)
    for v in range(xs.size // 3):
      x0 = np.float64(f32(xs[3 * v]))
      x1 = np.float64(f32(xs[3 * v + 1]))
      x2 = np.float64(f32(xs[3 * v + 2]))
      best = max(best, u64((x0 * x0 + x1 * x1) + x2 * x2))
  else:
    for v in range(xs.size // d):
      s = 0.0
      for j in range(d):
        x = np.float64(f32(xs[v * d + j]))
        s += x * x
      best = max(best, u64(s))
  if best >= np.uint64(0x7FF0000000000000):
    return np.inf
  return f64(best)


@njit(**JIT)
def step_blocks(i0, i1, out, leaves, blocks, zero_mode, dd):
  """Blocks [i0, i1) (whole vectors): the largest vector sum of squares as (k, hi, lo), value
  (hi + lo) 4**k, into the :class:`~clipbench.impls.own.numba.records.StepMaxima` ``out``.
  f32 mode sums each vector in float64 in order (k = 0); dd mode scales each vector by a
  power of two and sums its exact squares in double-double."""
  table = leaves.table
  for it in range(i0, i1):
    code, a16, a32, a64, start, n = block_views(leaves, blocks, it)
    d = leaves.vecs[blocks.leaf[it]]
    best_k, best_hi, best_lo = 0, 0.0, 0.0
    f = 0
    if code == F32 and not dd:
      best = step_block_f32(a32[start:start + n], d)
      if best < np.inf:  # all finite (a NaN or inf element makes its vector's sum non-finite)
        out.k[it], out.hi[it], out.lo[it] = 0, best, 0.0
        out.flags[it] = 0
        continue
    for v0 in range(start, start + n, d):
      if not dd:
        s = 0.0
        bad = False
        for j in range(d):
          x = load(code, a16, a32, a64, v0 + j, table)
          if not math.isfinite(x):
            f |= 1 if math.isnan(x) else 2
            bad = True
            continue
          s += x * x
        if bad and not zero_mode:
          continue
        best_hi = max(best_hi, s)
        continue
      amax = 0.0
      for j in range(d):
        x = abs(load(code, a16, a32, a64, v0 + j, table))
        if not math.isfinite(x):
          f |= 1 if math.isnan(x) else 2
        else:
          amax = max(amax, x)
      if amax == 0.0:
        continue
      e = math.frexp(amax)[1]
      inv = math.ldexp(1.0, min(-e, 1000))
      inv2 = math.ldexp(1.0, max(-e - 1000, 0))
      hi = 0.0
      lo = 0.0
      for j in range(d):
        x = abs(load(code, a16, a32, a64, v0 + j, table))
        if math.isfinite(x):
          a = (x * inv) * inv2
          t_hi = a * a
          hi, lo = dd_add(hi, lo, t_hi, fma(a, a, -t_hi))
      hi, lo = hi + lo, lo - ((hi + lo) - hi)
      # Normalise to [1, 4) * 4**k so that vectors compare lexicographically.
      k = e
      while hi >= 4.0:
        hi *= 0.25
        lo *= 0.25
        k += 1
      while hi < 1.0:
        hi *= 4.0
        lo *= 4.0
        k -= 1
      if exceeds(k, hi, lo, best_k, best_hi, best_lo):
        best_k, best_hi, best_lo = k, hi, lo
    out.k[it], out.hi[it], out.lo[it] = best_k, best_hi, best_lo
    out.flags[it] = f


@njit(**JIT)
def merge_step(block_of, piece_k, piece_hi, piece_lo, piece_flags, k, hi, lo, flags, zero_mode,
               dd):
  """Blocks from their pieces' ``step_blocks`` results (pieces of whole vectors, in element
  order): the first piece whose largest vector exceeds the earlier ones' is the whole block's
  first largest vector, as ``step_blocks`` keeps it; flags their union."""
  for it in range(block_of.size):
    b = block_of[it]
    k[b], hi[b], lo[b], flags[b] = 0, 0.0, 0.0, 0
  for it in range(block_of.size):
    b = block_of[it]
    flags[b] |= piece_flags[it]
    if piece_hi[it] != 0.0 and exceeds(piece_k[it], piece_hi[it], piece_lo[it], k[b], hi[b],
                                       lo[b]):
      k[b], hi[b], lo[b] = piece_k[it], piece_hi[it], piece_lo[it]
