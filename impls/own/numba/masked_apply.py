"""Tiny runs applied in masked vector steps: the fused route's systems of a few atoms.

A W5 system's runs are 6-24 float32 of positions and 9 of cell. ``apply.apply_run_f32``
copies or scales them with a keep-or-scale branch that is unpredictable (about half of the
systems are clipped) and loops whose trip counts vary from run to run, so a tiny system paid
more for its branches than for its data. Here a run of up to 32 elements is two 16-lane
steps whose loads and stores are masked to the run (``llvm.masked.load``/``store``: lanes
past the run are neither read nor written, so nothing outside it can fault or change), and a
kept run is scaled by exactly 1.0, which the scaling's arithmetic returns bit for bit: for a
finite x, |x| * 1 is exact and its FMA error +0, so no step down is taken and the sign is put
back (a kept system of the fused route has only finite elements: a NaN or an infinity
poisons it, and zero mode hands the call back). Each lane computes what
``apply.scale_f32_fma`` computes for that element. A run of at most 16 elements takes one
step (``scale_half_run_masked``), for a caller that knows every run of a leaf is that short.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from clipbench.impls.own import decision
from clipbench.impls.own.numba.apply import apply_run_f32
from clipbench.impls.own.numba.intrinsics import JIT, broadcast, lane_mask, splat

MASK_LANES = 16

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_VI32 = ir.VectorType(_I32, MASK_LANES)
_VF32 = ir.VectorType(ir.FloatType(), MASK_LANES)


@intrinsic
def masked_scale_f32_fma(typingctx, in_addr, out_addr, m, s32):
  """out[j] = sign | RTZ(|x[j]| * s32) for the float32 bits x at ``in_addr``, lanes
  j < m of 16 (m <= 0: nothing); the other lanes are neither loaded nor stored."""
  sig = types.void(types.int64, types.int64, types.int64, types.float32)

  def codegen(context, builder, signature, args):
    b = builder
    lanes = ir.Constant(_I64, MASK_LANES)
    m = b.select(b.icmp_signed("<", args[2], lanes), args[2], lanes)
    mask = lane_mask(b, b.select(b.icmp_signed(">", m, ir.Constant(_I64, 0)), m,
                                 ir.Constant(_I64, 0)), MASK_LANES)
    ptr = _VI32.as_pointer()
    load = cgutils.get_or_insert_function(
        b.module, ir.FunctionType(_VI32, [ptr, _I32, mask.type, _VI32]),
        f"llvm.masked.load.v{MASK_LANES}i32.p0")
    store = cgutils.get_or_insert_function(
        b.module, ir.FunctionType(ir.VoidType(), [_VI32, ptr, _I32, mask.type]),
        f"llvm.masked.store.v{MASK_LANES}i32.p0")
    fma = cgutils.get_or_insert_function(b.module, ir.FunctionType(_VF32, [_VF32] * 3),
                                         f"llvm.fma.v{MASK_LANES}f32")
    bits = b.call(load, [b.inttoptr(args[0], ptr), ir.Constant(_I32, 4), mask,
                         ir.Constant(_VI32, None)])
    sv = broadcast(b, args[3], _VF32)
    sign = b.and_(bits, splat(0x80000000, _VI32))
    mag = b.bitcast(b.and_(bits, splat(0x7FFFFFFF, _VI32)), _VF32)
    q = b.fmul(mag, sv)
    err = b.call(fma, [mag, sv, b.fneg(q)])
    below = b.lshr(b.bitcast(err, _VI32), splat(31, _VI32))  # the sign bit, -0.0 included
    b.call(store, [b.or_(b.sub(b.bitcast(q, _VI32), below), sign), b.inttoptr(args[1], ptr),
                   ir.Constant(_I32, 4), mask])
    return context.get_dummy_value()
  return sig, codegen


@njit(inline="always", **JIT)
def scale_run_masked(in_addr, out_addr, n, s32):
  """n float32 of ``in_addr`` scaled into ``out_addr`` as ``apply.scale_f32_fma`` does, 32
  lanes per step (two masked steps: a run of up to 32 takes no branch on its length)."""
  for i in range(0, n, 2 * MASK_LANES):
    masked_scale_f32_fma(in_addr + 4 * i, out_addr + 4 * i, n - i, s32)
    masked_scale_f32_fma(in_addr + 4 * (i + MASK_LANES), out_addr + 4 * (i + MASK_LANES),
                         n - i - MASK_LANES, s32)


@njit(inline="always", **JIT)
def scale_half_run_masked(in_addr, out_addr, n, s32):
  """``scale_run_masked`` for a run of at most MASK_LANES (16) elements: one masked step."""
  masked_scale_f32_fma(in_addr, out_addr, n, s32)


@njit(inline="always", **JIT)
def apply_tiny_run_f32(addr, out_addr, size, table, start, n, how):
  """``apply.apply_run_f32`` for a run of a tiny system of the fused route: kept and scaled
  runs (a factor that is a float32) in masked steps, the rest by ``apply_run_f32``."""
  act, sm, se, sv, zero_sys, precise = how
  if (not zero_sys and not precise and
      (act == decision.KEEP or (act == decision.SCALE and np.float64(np.float32(sv)) == sv))):
    s32 = np.float32(1.0) if act == decision.KEEP else np.float32(sv)
    scale_run_masked(addr + 4 * start, out_addr + 4 * start, n, s32)
    return
  apply_run_f32(addr, out_addr, size, table, start, n, how)
