"""Pass 2 of the norm for float64 leaves and p > 6: scaled double-double power sums.

Each system's max |x| (:mod:`~clipbench.impls.own.numba.extremes`, exact) comes first; the
terms are then (|x| 2**-K)**p with the max in [0.5, 1) (or (|x| / max)**p when (1/2)**p would
underflow), so nothing overflows or underflows, summed in double-double: in order within each
``SUB_BLOCK``-element sub-block, then the sub-block sums in order, then the blocks. The
squares take their exact error from an FMA; other powers use the compiled twins of the shared
double-double functions. Correct, not tuned: no workload of the benchmark takes this path.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from clipbench.impls.own.numba.decode import block_views, load
from clipbench.impls.own.numba.double_double import COEFFS_HI, COEFFS_LO, dd_add, dd_pow
from clipbench.impls.own.numba.intrinsics import JIT, fma
from clipbench.impls.own.numba.layout import SUB_BLOCK
from clipbench.impls.own.numba.power_sums import ABS, INT, SQ
from clipbench.impls.own.numba.records import Split


@njit(inline="always", **JIT)
def dd_term(a, a_lo, kind, ip, p):
  """(hi, lo) of a**p for a >= 0: exact for p = 1, 2; double-double otherwise."""
  if kind == ABS:
    return a, 0.0
  if kind == SQ:
    h = a * a
    return h, fma(a, a, -h)
  if kind == INT:
    h = a * a
    lo = fma(a, a, -h)
    for _ in range(ip - 2):
      nh = h * a
      nlo = fma(h, a, -nh) + lo * a
      h = nh + nlo
      lo = nlo - (h - nh)
    return h, lo
  if a == 0.0:
    return 0.0, 0.0
  return dd_pow(a, a_lo, p, COEFFS_HI, COEFFS_LO)


@njit(inline="always", **JIT)
def _dd_run(code, a16, a32, a64, table, start, n, f, f2, divide, kind, ip, p):
  """Double-double sum, from (0, 0) and in order, of the terms of elements [start, start+n)."""
  hi = 0.0
  lo = 0.0
  for j in range(n):
    v = abs(load(code, a16, a32, a64, start + j, table))
    if not math.isfinite(v):
      continue
    if divide:  # a + a_lo = v / f (the FMA residual of the quotient)
      a = v / f
      a_lo = fma(-a, f, v) / f
    else:
      a = (v * f) * f2
      a_lo = 0.0
    t_hi, t_lo = dd_term(a, a_lo, kind, ip, p)
    hi, lo = dd_add(hi, lo, t_hi, t_lo)
  return hi, lo


@njit(**JIT)
def scaled_sum_blocks(i0, i1, hi_out, lo_out, leaves, blocks, scaling, power):
  """Blocks [i0, i1): double-double sum of (|x| 2**-K)**p (or (|x| / max)**p): each
  ``SUB_BLOCK``-element sub-block summed in order from (0, 0), the sub-block sums added in
  order (so a rank holding part of a block can send sub-block sums: :mod:`.sharded`).

  Non-finite elements are skipped (they only matter in zero mode, where they count as 0)."""
  table, divide = leaves.table, scaling.divide
  kind, ip, p = power.kind, power.ip, power.p
  for it in range(i0, i1):
    code, a16, a32, a64, start, n = block_views(leaves, blocks, it)
    k = blocks.system[it]
    f = scaling.inv[k]
    f2 = scaling.inv2[k]  # 2**-K = f * f2: two exact steps when 2**-K overflows
    hi = 0.0
    lo = 0.0
    for b in range(0, n, SUB_BLOCK):
      s_hi, s_lo = _dd_run(code, a16, a32, a64, table, start + b, min(SUB_BLOCK, n - b), f, f2,
                           divide, kind, ip, p)
      hi, lo = dd_add(hi, lo, s_hi, s_lo)
    hi_out[it] = hi
    lo_out[it] = lo


@njit(**JIT)
def scaled_sum_sub_blocks(i0, i1, hi_out, lo_out, leaves, blocks, scaling, power):
  """Sub-blocks [i0, i1) (each at most ``SUB_BLOCK`` elements on its block's grid): the
  double-double sums the blocks kernel folds."""
  table, divide = leaves.table, scaling.divide
  kind, ip, p = power.kind, power.ip, power.p
  for it in range(i0, i1):
    code, a16, a32, a64, start, n = block_views(leaves, blocks, it)
    k = blocks.system[it]
    hi_out[it], lo_out[it] = _dd_run(code, a16, a32, a64, table, start, n, scaling.inv[k],
                                     scaling.inv2[k], divide, kind, ip, p)


@njit(**JIT)
def fold_dd_sub_sums(block_of, sub_hi, sub_lo, hi, lo):
  """What the blocks kernel does with sub-block sums: double-double additions in order from
  (0, 0)."""
  for b in np.unique(block_of):
    hi[b] = 0.0
    lo[b] = 0.0
  for it in range(block_of.size):
    b = block_of[it]
    hi[b], lo[b] = dd_add(hi[b], lo[b], sub_hi[it], sub_lo[it])


SPLIT = Split(scaled_sum_sub_blocks, fold_dd_sub_sums, (np.float64, np.float64))
