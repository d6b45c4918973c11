"""Streaming (non-temporal) stores for the apply pass, written in LLVM IR.

An ordinary store first reads the destination line into the cache (read-for-ownership), so
writing the output costs two passes, and it evicts the input the next norm pass will read; a
streaming store writes the line without reading it (docs/cpu-kernels.md has the measurement).
LLVM emits them (vmovntps) only for aligned vector stores tagged ``!nontemporal``, so these
kernels are written in IR: ``LANES`` lanes per step, the output address 32-byte aligned. The
caller handles the unaligned head and the tail with the scalar code of
:mod:`~clipbench.impls.own.numba.apply`, which computes the same bits lane by lane; the store
fence (:func:`~clipbench.impls.own.numba.intrinsics.store_fence`) follows once per kernel call.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from clipbench.impls.own.numba.intrinsics import broadcast, splat

LANES = 8
STREAM_MIN = 1 << 12  # elements: runs at least this long are streamed (when aligned)

_VI32 = ir.VectorType(ir.IntType(32), LANES)
_VF32 = ir.VectorType(ir.FloatType(), LANES)


def _stream_loop(builder, args, body):
  """for i in range(0, n, LANES): out[i:i+LANES] = body(in[i:i+LANES]), aligned streaming
  stores; ``args`` are the intrinsic's (in address, out address, n, ...)."""
  i64 = ir.IntType(64)
  p32 = ir.IntType(32).as_pointer()
  in_ptr, out_ptr, n = builder.inttoptr(args[0], p32), builder.inttoptr(args[1], p32), args[2]
  vptr = _VI32.as_pointer()
  entry = builder.block
  loop = builder.append_basic_block("nt.loop")
  done = builder.append_basic_block("nt.done")
  builder.cbranch(builder.icmp_signed(">", n, ir.Constant(i64, 0)), loop, done)
  builder.position_at_end(loop)
  i = builder.phi(i64)
  i.add_incoming(ir.Constant(i64, 0), entry)
  src = builder.bitcast(builder.gep(in_ptr, [i]), vptr)
  dst = builder.bitcast(builder.gep(out_ptr, [i]), vptr)
  bits = builder.load(src, align=4)
  store = builder.store(body(builder, bits), dst, align=32)
  store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
  nxt = builder.add(i, ir.Constant(i64, LANES))
  i.add_incoming(nxt, builder.block)
  builder.cbranch(builder.icmp_signed("<", nxt, n), loop, done)
  builder.position_at_end(done)


@intrinsic
def nt_copy_f32(typingctx, in_addr, out_addr, n):
  """out[:n] = in[:n] (bits), n a multiple of 8, out 32-byte aligned; streaming stores."""
  sig = types.void(types.int64, types.int64, types.int64)

  def codegen(context, builder, signature, args):
    _stream_loop(builder, args, lambda b, bits: bits)
    return context.get_dummy_value()
  return sig, codegen


@intrinsic
def nt_scale_f32(typingctx, in_addr, out_addr, n, sv):
  """Streamed twin of ``apply.scale_f32``: out = sign | RTZ(|x| * sv) for float32 bits, n a
  multiple of 8, out 32-byte aligned. Each lane does what the scalar code does: the exact
  float64 product, rounded to nearest float32, one ulp down where that rounded up."""
  sig = types.void(types.int64, types.int64, types.int64, types.float64)

  def codegen(context, builder, signature, args):
    vd = ir.VectorType(ir.DoubleType(), LANES)
    sv = broadcast(builder, args[3], vd)

    def body(b, bits):
      sign = b.and_(bits, splat(0x80000000, _VI32))
      mag = b.bitcast(b.and_(bits, splat(0x7FFFFFFF, _VI32)), _VF32)
      y = b.fmul(b.fpext(mag, vd), sv)
      q = b.fptrunc(y, _VF32)
      up = b.fcmp_ordered(">", b.fpext(q, vd), y)
      rtz = b.sub(b.bitcast(q, _VI32), b.zext(up, _VI32))
      return b.or_(rtz, sign)

    _stream_loop(builder, args, body)
    return context.get_dummy_value()
  return sig, codegen


@intrinsic
def nt_scale_f32_fma(typingctx, in_addr, out_addr, n, sv):
  """Streamed twin of ``apply.scale_f32_fma`` (sv a float32): out = sign | RTZ(|x| * sv), n a
  multiple of 8, out 32-byte aligned. The float32 product, its exact error from an FMA and a
  one-ulp step down where the error is negative: no conversions to float64, which made the
  ``nt_scale_f32`` loop compute bound."""
  sig = types.void(types.int64, types.int64, types.int64, types.float32)

  def codegen(context, builder, signature, args):
    sv = broadcast(builder, args[3], _VF32)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF32, [_VF32] * 3),
                                         f"llvm.fma.v{LANES}f32")

    def body(b, bits):
      sign = b.and_(bits, splat(0x80000000, _VI32))
      mag = b.bitcast(b.and_(bits, splat(0x7FFFFFFF, _VI32)), _VF32)
      q = b.fmul(mag, sv)
      err = b.call(fma, [mag, sv, b.fneg(q)])
      below = b.lshr(b.bitcast(err, _VI32), splat(31, _VI32))  # the sign bit, -0.0 included
      return b.or_(b.sub(b.bitcast(q, _VI32), below), sign)

    _stream_loop(builder, args, body)
    return context.get_dummy_value()
  return sig, codegen
