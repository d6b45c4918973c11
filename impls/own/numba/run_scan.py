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
