"""The apply pass: every run kept bit for bit, filled with NaN, or scaled toward zero.

Kept systems are copied bit for bit (never multiplied by 1.0), NaN-poisoned ones filled with
NaN, the others scaled by s and rounded toward zero, which only shrinks magnitudes: the
output norm is <= s * n <= c (SPEC rule 4). Every route gives the exact RTZ value:

* float32 leaves and a float32 factor (no float64 leaf: factors keep 24 bits): the float32
  product and its exact error from an FMA, one ulp down where the error is negative
  (``scale_f32_fma``; no float64 conversions, so the pass stays memory bound);
* half-precision leaves (and factors below float32's range): ``x * s`` exactly in float64,
  rounded toward zero with a one-ulp fix-up (``scale_f32`` and the scalar loop);
* float64 leaves: a 53-bit factor, rounded with the exact product error from an FMA
  (``rtz64``).

Long float32 runs (large leaves, whose outputs start on 64-byte boundaries) are written with
streaming stores (:mod:`~clipbench.impls.own.numba.streaming`), lane for lane the same bits.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit

from clipbench.impls.own import decision
from clipbench.impls.own.numba.decode import BF16, F32, F64, load, views
from clipbench.impls.own.numba.intrinsics import (JIT, f32, f64, fma, fma32, ptr_u32, store_fence,
                                                  u32, u64)
from clipbench.impls.own.numba.records import RunAction
from clipbench.impls.own.numba.streaming import (LANES, STREAM_MIN, nt_copy_f32, nt_scale_f32,
                                                 nt_scale_f32_fma)


@njit(inline="always", **JIT)
def rtz64(ax, s_m, s_e):
  """RTZ(ax * s_m * 2**s_e) in float64 for ax >= 0 (exact: the FMA gives the product error)."""
  if ax == 0.0:
    return 0.0
  shift = 0
  if ax < 2.0 ** -900:
    ax = ax * 2.0 ** 200
    shift = -200
  pr = ax * s_m
  err = fma(ax, s_m, -pr)
  below = err < 0.0 or (err == 0.0 and math.copysign(1.0, err) < 0.0)
  e = s_e + shift
  pe = math.frexp(pr)[1]
  if pe + e >= -1021:
    y = math.ldexp(pr, e)  # exact: the result is normal
    if below:
      y = f64(u64(y) - np.uint64(1))
    return y
  if pe + e < -1080:
    return 0.0
  t = math.ldexp(pr, e + 1074)  # exact (normal), the result in units of 2**-1074
  units = math.floor(t)
  if below and units == t:
    units -= 1.0
  return f64(np.uint64(units))


@njit(inline="always", **JIT)
def f32_rtz_bits(y):
  """Bits of the largest float32 <= y (y >= 0, below the float32 max)."""
  q = np.float32(y)
  return u32(q) - np.uint32(np.float64(q) > y)


@njit(inline="always", **JIT)
def f16_from_f32_rtz(b):
  """RTZ float32 bits (positive, below 65520) -> float16 bits."""
  e = np.int32((b >> np.uint32(23)) & np.uint32(0xFF)) - 127
  if e >= -14:
    return np.uint16(((e + 15) << 10) | np.int32((b & np.uint32(0x7FFFFF)) >> np.uint32(13)))
  q = np.float64(f32(b)) * 2.0 ** 24
  return np.uint16(math.floor(q))


@njit(inline="always", **JIT)
def scale_f32(xs, os, sv):
  """os = RTZ(xs * sv) for float32 bits, sv with <= 29 significant bits (x * sv is exact)."""
  for j in range(xs.size):
    b = xs[j]
    y = np.float64(f32(b & np.uint32(0x7FFFFFFF))) * sv
    os[j] = f32_rtz_bits(y) | (b & np.uint32(0x80000000))


@njit(inline="always", **JIT)
def scale_f32_fma(xs, os, s32):
  """os = RTZ(xs * s32) for float32 bits and a float32 factor: q = fl(|x| * s32) and its exact
  error e = fma(|x|, s32, -q); q rounded up exactly when e is below zero, and rounding keeps the
  sign of a non-zero error even when it underflows (-0.0), so the sign bit decides the fix-up
  and the result is the exact RTZ value, as ``scale_f32`` computes it through float64."""
  for j in range(xs.size):
    b = xs[j]
    a = f32(b & np.uint32(0x7FFFFFFF))
    q = a * s32
    e = fma32(a, s32, -q)
    os[j] = (u32(q) - (u32(e) >> np.uint32(31))) | (b & np.uint32(0x80000000))


@njit(inline="always", **JIT)
def run_action(decisions, k):
  """System k's entries of the :class:`~clipbench.impls.own.numba.records.Decisions`."""
  return RunAction(decisions.action[k], decisions.s_m[k], decisions.s_e[k],
                   decisions.s_val[k], decisions.zero_sys[k], decisions.precise)


@njit(inline="always", **JIT)
def apply_range(addr, out_addr, size, code, table, start, n, how):
  """Elements [start, start + n) of one leaf (at ``addr``, output at ``out_addr``), all of one
  system, as its :class:`~clipbench.impls.own.numba.records.RunAction` ``how`` says."""
  act, sm, se, sv, zero_sys, precise = how
  a16, a32, a64 = views(addr, size, code)
  o16, o32, o64 = views(out_addr, size, code)
  end = start + n
  if act == decision.NAN_FILL:
    if code == F32:
      o32[start:end] = np.uint32(0x7FC00000)
    elif code == F64:
      o64[start:end] = np.uint64(0x7FF8000000000000)
    elif code == BF16:
      o16[start:end] = np.uint16(0x7FC0)
    else:
      o16[start:end] = np.uint16(0x7E00)
    return
  if (code == F32 and not zero_sys and n >= STREAM_MIN and (out_addr + 4 * start) % 32 == 0 and
      (act == decision.KEEP or (act == decision.SCALE and not precise))):
    # Long aligned runs (the output layout aligns large leaves): streamed body, scalar tail.
    # Short or unaligned runs keep ordinary stores: an ordinary store next to streamed ones
    # costs more than it saves.
    body = n - n % LANES
    if act == decision.KEEP:
      nt_copy_f32(addr + 4 * start, out_addr + 4 * start, body)
      o32[start + body:end] = a32[start + body:end]
    elif np.float64(np.float32(sv)) == sv:
      nt_scale_f32_fma(addr + 4 * start, out_addr + 4 * start, body, np.float32(sv))
      scale_f32_fma(a32[start + body:end], o32[start + body:end], np.float32(sv))
    else:
      nt_scale_f32(addr + 4 * start, out_addr + 4 * start, body, sv)
      scale_f32(a32[start + body:end], o32[start + body:end], sv)
    return
  if act == decision.SCALE and code == F32 and not precise and not zero_sys:
    if np.float64(np.float32(sv)) == sv:
      scale_f32_fma(a32[start:end], o32[start:end], np.float32(sv))
    else:
      scale_f32(a32[start:end], o32[start:end], sv)
    return
  if act == decision.KEEP and not zero_sys:
    if code == F32:
      o32[start:end] = a32[start:end]
    elif code == F64:
      o64[start:end] = a64[start:end]
    else:
      o16[start:end] = a16[start:end]
    return
  for i in range(start, end):
    x = load(code, a16, a32, a64, i, table)
    if not math.isfinite(x):  # zero mode only: a non-finite element becomes +0.0
      if code == F32:
        o32[i] = np.uint32(0)
      elif code == F64:
        o64[i] = np.uint64(0)
      else:
        o16[i] = np.uint16(0)
      continue
    if act == decision.KEEP:
      if code == F32:
        o32[i] = a32[i]
      elif code == F64:
        o64[i] = a64[i]
      else:
        o16[i] = a16[i]
      continue
    ax = abs(x)
    neg = math.copysign(1.0, x) < 0.0
    y = rtz64(ax, sm, se) if precise else ax * sv  # the latter exact: <= 24 x 29 bits
    if code == F64:
      o64[i] = u64(y) | (np.uint64(1) << np.uint64(63) if neg else np.uint64(0))
      continue
    b = f32_rtz_bits(y)
    if code == F32:
      o32[i] = b | (np.uint32(0x80000000) if neg else np.uint32(0))
    elif code == BF16:
      o16[i] = np.uint16(b >> np.uint32(16)) | (np.uint16(0x8000) if neg else np.uint16(0))
    else:
      o16[i] = f16_from_f32_rtz(b) | (np.uint16(0x8000) if neg else np.uint16(0))


@njit(**JIT)
def apply_range_apart(addr, out_addr, size, code, table, start, n, how):
  """``apply_range`` compiled once as a function of its own, for the fused routes, which
  reach it only for runs of at least STREAM_MIN elements or for rare decisions (NaN fill, a
  factor that needs float64): beside such a run a call costs nothing, while inlining every
  branch of ``apply_range`` into each fused kernel took most of their compilation
  (docs/cpu-kernels.md, "Compilation time"). The same loops, so the same bits."""
  apply_range(addr, out_addr, size, code, table, start, n, how)


@njit(inline="always", **JIT)
def apply_run_f32(addr, out_addr, size, table, start, n, how):
  """``apply_range`` for a float32 run of the fused routes (no zero mode, 24-bit factors):
  short kept or scaled runs straight through pointers, the rest by ``apply_range_apart``.
  The same loops on the same elements, so the same bits; a tiny system (W5: 2-8 atoms) costs
  about half as much without ``apply_range``'s six views, slices and overlap-checked copy."""
  act, sm, se, sv, zero_sys, precise = how
  if (n >= STREAM_MIN or zero_sys or precise or act == decision.NAN_FILL or
      (act == decision.SCALE and np.float64(np.float32(sv)) != sv)):
    apply_range_apart(addr, out_addr, size, F32, table, start, n, how)
    return
  xs = numba.carray(ptr_u32(addr + 4 * start), n)
  os = numba.carray(ptr_u32(out_addr + 4 * start), n)
  if act == decision.KEEP:
    for j in range(n):
      os[j] = xs[j]
  else:
    scale_f32_fma(xs, os, np.float32(sv))


@njit(**JIT)
def apply_blocks(i0, i1, leaves, out_addrs, blocks, decisions):
  """Blocks [i0, i1) of leaves read in place (sorted or global layouts)."""
  for it in range(i0, i1):
    leaf = blocks.leaf[it]
    apply_range(leaves.addrs[leaf], out_addrs[leaf], leaves.sizes[leaf], leaves.codes[leaf],
                leaves.table, blocks.start[it], blocks.length[it],
                run_action(decisions, blocks.system[it]))
  store_fence()


@njit(**JIT)
def apply_rows(r0, r1, leaves, out_addrs, leaf, seg, decisions):
  """Rows [r0, r1) of one leaf with unsorted ids ``seg``, row by row in place."""
  rowsize = leaves.rowsizes[leaf]
  for r in range(r0, r1):
    apply_range(leaves.addrs[leaf], out_addrs[leaf], leaves.sizes[leaf], leaves.codes[leaf],
                leaves.table, r * rowsize, rowsize, run_action(decisions, seg[r]))
  store_fence()
