"""The fused route's id scan: where a system's run of rows ends, validating the ids.

``ids[r:]`` starts a run of system k; its end is the first index whose id is not k, found in
vector steps of ``RUN_LANES`` ids (one vector compare, its lane mask and a count of trailing
zeros). The next step's address does not wait for this step's compare (the loop exit is
predicted), so loads run ahead. An id below k there means the ids are not sorted.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from clipbench.impls.own.numba.intrinsics import JIT, broadcast, ptr_i32, ptr_i64

SEG_I64, SEG_I32 = 0, 1
SEG_CODE_OF = {np.dtype(np.int64): SEG_I64, np.dtype(np.int32): SEG_I32}
RUN_LANES = 16  # ids compared per vector step of a run scan
WINDOW = 64  # rows whose run ends one window step of a group scan finds


def _equal_prefix_intrinsic(bits):
  """How many of the 16 ids of ``bits`` bits at ``addr`` equal ``k``, counted from the first
  (16 when all do): one vector compare, its lane mask and a count of trailing zeros."""
  @intrinsic
  def equal_prefix(typingctx, addr, k):
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
      i64, elem = ir.IntType(64), ir.IntType(bits)
      vec = ir.VectorType(elem, RUN_LANES)
      ids = builder.load(builder.inttoptr(args[0], vec.as_pointer()), align=bits // 8)
      key = builder.trunc(args[1], elem) if bits < 64 else args[1]
      keys = broadcast(builder, key, vec)
      differ = builder.bitcast(builder.icmp_unsigned("!=", ids, keys), ir.IntType(RUN_LANES))
      mask = builder.or_(builder.zext(differ, i64), ir.Constant(i64, 1 << RUN_LANES))
      cttz = builder.module.declare_intrinsic("llvm.cttz", [i64], ir.FunctionType(
          i64, [i64, ir.IntType(1)]))
      return builder.call(cttz, [mask, ir.Constant(ir.IntType(1), 1)])
    return sig, codegen
  return equal_prefix


_equal_prefix_i64 = _equal_prefix_intrinsic(64)
_equal_prefix_i32 = _equal_prefix_intrinsic(32)


def _run_ends_intrinsic(bits):
  """(ends, ok) for the WINDOW + 1 ids of ``bits`` bits at ``addr``: bit i of ``ends`` set
  when id i differs from id i + 1 (row i ends a run), and ``ok`` 1 when id 0 is ``k`` and
  every id is the one before it or one more (then the runs are of k, k + 1, ... in turn)."""
  @intrinsic
  def run_ends(typingctx, addr, k):
    sig = types.UniTuple(types.int64, 2)(types.int64, types.int64)

    def codegen(context, builder, signature, args):
      b = builder
      i64, elem = ir.IntType(64), ir.IntType(bits)
      vec = ir.VectorType(elem, WINDOW)
      here = b.load(b.inttoptr(args[0], vec.as_pointer()), align=bits // 8)
      after = b.load(b.inttoptr(b.add(args[0], ir.Constant(i64, bits // 8)), vec.as_pointer()),
                     align=bits // 8)
      ends = b.bitcast(b.icmp_unsigned("!=", after, here), i64)
      steps = b.bitcast(b.icmp_unsigned("<=", b.sub(after, here), broadcast(
          b, ir.Constant(elem, 1), vec)), i64)
      key = b.trunc(args[1], elem) if bits < 64 else args[1]
      first = b.icmp_unsigned("==", b.extract_element(here, ir.Constant(ir.IntType(32), 0)), key)
      ok = b.and_(b.icmp_unsigned("==", steps, ir.Constant(i64, -1)), first)
      return context.make_tuple(b, signature.return_type, [ends, b.zext(ok, i64)])
    return sig, codegen
  return run_ends


_run_ends_i64 = _run_ends_intrinsic(64)
_run_ends_i32 = _run_ends_intrinsic(32)


@intrinsic
def _trailing_zeros(typingctx, v):
  sig = types.int64(types.int64)

  def codegen(context, builder, signature, args):
    i64 = ir.IntType(64)
    cttz = builder.module.declare_intrinsic("llvm.cttz", [i64], ir.FunctionType(
        i64, [i64, ir.IntType(1)]))
    return builder.call(cttz, [args[0], ir.Constant(ir.IntType(1), 0)])
  return sig, codegen


@njit(inline="always", **JIT)
def _scan_run(ids, addr, wide, r, k):
  """The first index >= r whose id is not k (ids.size if none); -1 when that id is below k,
  which sorted ids never have. ``ids`` is the int64 (``wide``) or int32 array at ``addr``.
  An int32 compare of a k beyond int32 would wrap, so such a k takes the one-by-one loop."""
  n = ids.size
  e = r
  if wide or k <= 0x7FFFFFFF:
    while e + RUN_LANES <= n:
      if wide:
        same = _equal_prefix_i64(addr + 8 * e, k)
      else:
        same = _equal_prefix_i32(addr + 4 * e, k)
      if same < RUN_LANES:
        e += same
        break
      e += RUN_LANES
  while e < n and ids[e] == k:
    e += 1
  if e < n and ids[e] < k:
    return -1
  return e


@njit(inline="always", **JIT)
def run_end(seg_addr, seg_code, r, r_end, k):
  """The end of system k's run from row r among rows [0, r_end) of the int64 (SEG_I64) or
  int32 (SEG_I32) id array at ``seg_addr``: the first index >= r whose id is not k (r_end if
  none), or -1 when that id is below k (the ids are not sorted)."""
  if seg_code == SEG_I64:
    return _scan_run(numba.carray(ptr_i64(seg_addr), r_end), seg_addr, True, r, k)
  return _scan_run(numba.carray(ptr_i32(seg_addr), r_end), seg_addr, False, r, k)


@njit(inline="always", **JIT)
def scan_group(seg_addr, seg_code, r, r_end, k0, n, ends):
  """``run_end`` for systems k0, ..., k0 + n - 1 in turn from row r (``ends[j]``: the end of
  system k0 + j's run); the last end, or -1 when ``run_end`` would give -1. Where the next
  WINDOW + 1 ids are k, k or k + 1, ... (the usual layout), one window step finds every run
  that ends in it, whose ends are exactly what ``run_end`` gives: the runs' ends no longer
  wait each on the one before (a load, a compare and a count per system). Anything else
  (a run longer than the window, a system with no rows, ids out of order, the chunk's last
  rows, an int32 k near the top of its range) goes to ``run_end`` one system at a time."""
  e = r
  j = 0
  while j < n:
    k = k0 + j
    if e + WINDOW + 1 <= r_end and (seg_code == SEG_I64 or k + WINDOW < 0x7FFFFFFF):
      if seg_code == SEG_I64:
        mask, ok = _run_ends_i64(seg_addr + 8 * e, k)
      else:
        mask, ok = _run_ends_i32(seg_addr + 4 * e, k)
      if ok and mask != 0:
        base = e + 1
        while mask != 0 and j < n:
          e = base + _trailing_zeros(mask)
          ends[j] = e
          j += 1
          mask &= mask - 1
        continue
    e = run_end(seg_addr, seg_code, e, r_end, k)
    if e < 0:
      return -1
    ends[j] = e
    j += 1
  return e
