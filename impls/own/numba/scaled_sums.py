"""Pass 2 of the norm for float64 leaves and p > 6: scaled double-double power sums.

Each system's max |x| (:mod:`~clipbench.impls.own.numba.extremes`, exact) comes first; the
terms are then (|x| 2**-K)**p with the max in [0.5, 1) (or (|x| / max)**p when (1/2)**p would
underflow), so nothing overflows or underflows, summed in double-double in block order. The
squares take their exact error from an FMA; other powers use the compiled twins of the shared
double-double functions. Correct, not tuned: no workload of the benchmark takes this path.
"""

from __future__ import annotations

import math

from numba import njit

from clipbench.impls.own.numba.decode import block_views, load
from clipbench.impls.own.numba.double_double import COEFFS_HI, COEFFS_LO, dd_add, dd_pow
from clipbench.impls.own.numba.intrinsics import JIT, fma
from clipbench.impls.own.numba.power_sums import ABS, INT, SQ


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


@njit(**JIT)
def scaled_sum_blocks(i0, i1, hi_out, lo_out, leaves, blocks, scaling, power):
  """Blocks [i0, i1): double-double sum of (|x| 2**-K)**p (or (|x| / max)**p), in order.

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
    hi_out[it] = hi
    lo_out[it] = lo
