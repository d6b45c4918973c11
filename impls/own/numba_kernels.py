"""Compiled CPU kernels (numba, parallel over blocks of systems) for the three operations.

Numerical design (SPEC rules 3-5 exactly, at memory speed):

* **Norm pass.** For float16/bfloat16/float32 leaves every ``|x|**p`` with ``p <= 6`` is
  formed in float64 (exact for p = 1, 2: a float32 square has 48 bits) and summed in float64:
  no float32 value can overflow or underflow there (``(3.4e38)**6 < 1e308``,
  ``(1.4e-45)**6 > 2.2e-308``), so no scaling pass is needed and one read suffices. Larger p,
  and any call with a float64 leaf, first take each system's max |x| (exact), scale by a power
  of two and accumulate double-double sums (TwoProd via a fused multiply-add).
* **Reduction order (rule 11, by construction).** A system's rows in one leaf form a run (its
  rows in row order; unsorted segments are gathered into that order first). Each run is cut
  into fixed blocks of ``BLOCK`` elements counted from the run's start; a block is summed by
  one compiled loop whose order is a fixed function of the block length (LLVM splits it into
  vector lanes under the ``reassoc`` flag alone; it never peels for alignment, and a test pins
  the bits at every offset), and a system's block sums are added in leaf order, then block
  order. Nothing depends on other systems, on where the run sits in memory, or on the thread
  that ran it; the sorted fast path (segment offsets, no scatter) and the unsorted path sum
  the same blocks, so they give the same bits. Max-step and p = inf take maxima (exact).
* **Decision and factor** (``decision.finalize``): the norm is known within a rigorous bound
  (``(n-1) 2**-53`` relative for n float32 squares); a threshold inside that bound is a
  near-tie settled exactly on the host (integer arithmetic); the factor s is the largest float
  with ``s * n_up <= c``. For calls without float64 leaves s keeps 24 bits (a float32, within
  rule 4's 4u): float32 leaves take the float32 product and its exact error from an FMA, one
  ulp down where the error is negative (``_scale_f32_fma``, no float64 conversions, so the
  pass stays memory bound); half-precision leaves (and factors below float32's range) form
  ``x * s`` exactly in float64 and round it toward zero with a one-ulp fix-up. With float64
  leaves s keeps 53 bits and the rounding uses the exact product error from an FMA. Every
  route gives the exact RTZ value. RTZ only shrinks magnitudes: the output norm is
  <= s * n <= c.
* **Apply pass.** Kept systems are copied bit for bit (never multiplied by 1.0), NaN-poisoned
  ones filled with NaN, the others scaled. Outputs are new arrays: views of one buffer per
  dtype, recycled (``_BufferPool``) once every view of an earlier result is gone, because
  first-touch page faults on fresh memory cost about one more pass. Long float32 runs (large
  leaves, whose outputs start on 64-byte boundaries) are written with streaming stores: no
  read-for-ownership of the output and no eviction of the input (``_nt_scale_f32_fma``; the
  same bits as the scalar code, lane by lane).

* **Fused route (sorted segments, float32, L2 and max-step).** The layout of batched
  simulations (each leaf's ids sorted, so every system is one run of rows per leaf, a few KB)
  takes one pass over each chunk of contiguous systems (``_fused_systems``; the threads
  claim chunks in turn with an atomic counter, so a vCPU the host slows does less of the
  work instead of holding up the call): it scans each run's ids (which validates them),
  sums the run with the same block function in the same block order, finalizes the system
  (``_finalize_one``, which ``_finalize_nb`` also runs) and scales the run while it is still
  in L1. The leaves come from memory once, not twice, and the ids are read in the same pass:
  W3 runs at about the roofline, which charges three passes. It gives the general route's
  bits (its sums are checked equal, not only its outputs); ties are settled exactly
  afterwards on the host; unsorted or out-of-range ids and non-finite elements in zero mode
  hand the call to the general route, which raises the same errors.

Execution: validation (rules 6, 9, 10, 13) runs before any other kernel; its one pass over
each segment array also records the system row offsets of sorted ids. Kernels are serial,
release the GIL and run over contiguous ranges of blocks on a small thread pool (an OpenMP
barrier on a busy 2-core machine stalled ~36 ms per parallel region); they read leaves in
place through their data pointers (hundreds of small leaves packed with one C-level
concatenate) and are compiled once (``cache=True``) per argument types. Float64 leaves and
p > 6 take the slower scaled double-double path (correct, not tuned).
"""

from __future__ import annotations

import math
import os
from fractions import Fraction
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import ml_dtypes
import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from clipbench.protocol import ANY_NORM_TYPE, DTYPES, Capabilities
from clipbench.impls.own import decision, double_double, exact, validation

framework = "numpy"
version = numba.__version__
description = "numba kernels over blocks of systems (thread pool); exact decisions, RTZ scaling"
capabilities = Capabilities(
    per_system=True, per_system_max=True, norm_types=ANY_NORM_TYPE, dtypes=DTYPES,
    nonfinite=("propagate", "zero"), returns_norm=True, in_place=False, transforms=(),
    devices=("cpu",), mixed_dtypes=True)

BLOCK = 8192  # elements per block of a run (the unit of parallel work and of summation order)
_F16, _BF16, _F32, _F64 = 0, 1, 2, 3
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
# Exact float16 -> float32 table (64K entries): decoding by lookup needs no float16 arithmetic.
_F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(
    np.float32)

_KIND_ABS, _KIND_SQ, _KIND_INT, _KIND_POW = 0, 1, 2, 3


# --------------------------------------------------------------------------------- intrinsics
def _pointer_intrinsic(elem):
  @intrinsic
  def as_pointer(typingctx, addr):
    sig = types.CPointer(elem)(types.int64)

    def codegen(context, builder, signature, args):
      return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
    return sig, codegen
  return as_pointer


_ptr_u16 = _pointer_intrinsic(types.uint16)
_ptr_u32 = _pointer_intrinsic(types.uint32)
_ptr_u64 = _pointer_intrinsic(types.uint64)


@intrinsic
def _f32(typingctx, bits):
  sig = types.float32(types.uint32)

  def codegen(context, builder, signature, args):
    return builder.bitcast(args[0], ir.FloatType())
  return sig, codegen


@intrinsic
def _u32(typingctx, value):
  sig = types.uint32(types.float32)

  def codegen(context, builder, signature, args):
    return builder.bitcast(args[0], ir.IntType(32))
  return sig, codegen


@intrinsic
def _f64(typingctx, bits):
  sig = types.float64(types.uint64)

  def codegen(context, builder, signature, args):
    return builder.bitcast(args[0], ir.DoubleType())
  return sig, codegen


@intrinsic
def _u64(typingctx, value):
  sig = types.uint64(types.float64)

  def codegen(context, builder, signature, args):
    return builder.bitcast(args[0], ir.IntType(64))
  return sig, codegen


def _fma_intrinsic(elem, ir_type):
  """fma(a, b, c) = a * b + c with one rounding, for one float type."""
  @intrinsic
  def fma(typingctx, a, b, c):
    sig = elem(elem, elem, elem)

    def codegen(context, builder, signature, args):
      fn = builder.module.declare_intrinsic("llvm.fma", [ir_type], ir.FunctionType(
          ir_type, [ir_type] * 3))
      return builder.call(fn, args)
    return sig, codegen
  return fma


_fma = _fma_intrinsic(types.float64, ir.DoubleType())
_fma32 = _fma_intrinsic(types.float32, ir.FloatType())


_JIT = dict(nogil=True, cache=True, fastmath=False)

# Streaming (non-temporal) stores for the apply pass. An ordinary store first reads the
# destination line into the cache (read-for-ownership), so writing the output costs two
# passes, and it evicts the input the next norm pass will read; a streaming store writes the
# line without reading it. Measured here (2 threads, 64 MB float32): 5.3 ms with ordinary
# vector stores, 2.6-3.3 ms streamed. LLVM emits them (vmovntps) only for aligned vector stores
# tagged !nontemporal, so these intrinsics are written in IR: 8 lanes per step, the output
# address 32-byte aligned (the caller handles the unaligned head and the tail with the scalar
# code, which computes the same bits).
_NT_LANES = 8
_NT_MIN = 1 << 12  # elements: runs at least this long are streamed (when aligned)


def _nt_f32_loop(builder, in_ptr, out_ptr, n, body):
  """for i in range(0, n, 8): out[i:i+8] = body(in[i:i+8]) with aligned streaming stores."""
  i64 = ir.IntType(64)
  vec = ir.VectorType(ir.IntType(32), _NT_LANES)
  vptr = vec.as_pointer()
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
  nxt = builder.add(i, ir.Constant(i64, _NT_LANES))
  i.add_incoming(nxt, builder.block)
  builder.cbranch(builder.icmp_signed("<", nxt, n), loop, done)
  builder.position_at_end(done)


_VI32 = ir.VectorType(ir.IntType(32), _NT_LANES)
_VF32 = ir.VectorType(ir.FloatType(), _NT_LANES)


def _splat(value, ty):
  """A constant vector of type ``ty`` with ``value`` in every lane."""
  return ir.Constant(ty, [value] * ty.count)


def _broadcast(builder, scalar, ty):
  """A vector of type ``ty`` with the SSA scalar in every lane."""
  undef = ir.Constant(ty, ir.Undefined)
  lane0 = builder.insert_element(undef, scalar, ir.Constant(ir.IntType(32), 0))
  return builder.shuffle_vector(lane0, undef, _splat(0, ir.VectorType(ir.IntType(32), ty.count)))


def _nt_f32_loop_at(builder, args, body):
  """``_nt_f32_loop`` over the intrinsic arguments (in address, out address, n, ...)."""
  p32 = ir.IntType(32).as_pointer()
  _nt_f32_loop(builder, builder.inttoptr(args[0], p32), builder.inttoptr(args[1], p32),
               args[2], body)


@intrinsic
def _store_fence(typingctx):
  """sfence: streaming stores before it are globally visible before any store after it (one
  per kernel call: a fence drains the write-combining buffers, ~2 us each)."""
  sig = types.void()

  def codegen(context, builder, signature, args):
    fence = builder.module.declare_intrinsic("llvm.x86.sse.sfence", [], ir.FunctionType(
        ir.VoidType(), []))
    builder.call(fence, [])
    return context.get_dummy_value()
  return sig, codegen


@intrinsic
def _claim_next(typingctx, counter):
  """An atomic fetch-and-add of 1 on ``counter[0]`` (an int64 array): the value before it.
  Threads claiming work from one counter each get a different number."""
  sig = types.int64(counter)

  def codegen(context, builder, signature, args):
    array = context.make_array(signature.args[0])(context, builder, args[0])
    return builder.atomic_rmw("add", array.data, ir.Constant(ir.IntType(64), 1), "seq_cst")
  return sig, codegen


@intrinsic
def _nt_copy_f32(typingctx, in_addr, out_addr, n):
  """out[:n] = in[:n] (bits), n a multiple of 8, out 32-byte aligned; streaming stores."""
  sig = types.void(types.int64, types.int64, types.int64)

  def codegen(context, builder, signature, args):
    _nt_f32_loop_at(builder, args, lambda b, bits: bits)
    return context.get_dummy_value()
  return sig, codegen


@intrinsic
def _nt_scale_f32(typingctx, in_addr, out_addr, n, sv):
  """Streamed twin of ``_scale_f32``: out = sign | RTZ(|x| * sv) for float32 bits, n a
  multiple of 8, out 32-byte aligned. Each lane does what the scalar code does: the exact
  float64 product, rounded to nearest float32, one ulp down where that rounded up."""
  sig = types.void(types.int64, types.int64, types.int64, types.float64)

  def codegen(context, builder, signature, args):
    vd = ir.VectorType(ir.DoubleType(), _NT_LANES)
    sv = _broadcast(builder, args[3], vd)

    def body(b, bits):
      sign = b.and_(bits, _splat(0x80000000, _VI32))
      mag = b.bitcast(b.and_(bits, _splat(0x7FFFFFFF, _VI32)), _VF32)
      y = b.fmul(b.fpext(mag, vd), sv)
      q = b.fptrunc(y, _VF32)
      up = b.fcmp_ordered(">", b.fpext(q, vd), y)
      rtz = b.sub(b.bitcast(q, _VI32), b.zext(up, _VI32))
      return b.or_(rtz, sign)

    _nt_f32_loop_at(builder, args, body)
    return context.get_dummy_value()
  return sig, codegen


@intrinsic
def _nt_scale_f32_fma(typingctx, in_addr, out_addr, n, sv):
  """Streamed twin of ``_scale_f32_fma`` (sv a float32): out = sign | RTZ(|x| * sv), n a
  multiple of 8, out 32-byte aligned. The float32 product, its exact error from an FMA and a
  one-ulp step down where the error is negative: no conversions to float64, which made the
  ``_nt_scale_f32`` loop compute bound (~17 cycles per 8 lanes here)."""
  sig = types.void(types.int64, types.int64, types.int64, types.float32)

  def codegen(context, builder, signature, args):
    sv = _broadcast(builder, args[3], _VF32)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF32, [_VF32] * 3),
                                         f"llvm.fma.v{_NT_LANES}f32")

    def body(b, bits):
      sign = b.and_(bits, _splat(0x80000000, _VI32))
      mag = b.bitcast(b.and_(bits, _splat(0x7FFFFFFF, _VI32)), _VF32)
      q = b.fmul(mag, sv)
      err = b.call(fma, [mag, sv, b.fneg(q)])
      below = b.lshr(b.bitcast(err, _VI32), _splat(31, _VI32))  # the sign bit, -0.0 included
      return b.or_(b.sub(b.bitcast(q, _VI32), below), sign)

    _nt_f32_loop_at(builder, args, body)
    return context.get_dummy_value()
  return sig, codegen


# ------------------------------------------------------------------------- element decoding
# Every kernel below is serial and releases the GIL; ``_parallel`` hands contiguous ranges of
# work items to a small thread pool. Loops index zero-based slices so that numba can drop its
# negative-index checks (they would otherwise block vectorisation).
@njit(inline="always", **_JIT)
def _views(addr, size, code):
  n16 = size if (code == _F16 or code == _BF16) else 0
  n32 = size if code == _F32 else 0
  n64 = size if code == _F64 else 0
  a16 = numba.carray(_ptr_u16(addr if n16 else 0), n16)
  a32 = numba.carray(_ptr_u32(addr if n32 else 0), n32)
  a64 = numba.carray(_ptr_u64(addr if n64 else 0), n64)
  return a16, a32, a64


@njit(inline="always", **_JIT)
def _load(code, a16, a32, a64, i, table):
  """Element i of a leaf as an exact float64 (only the view of its dtype is non-empty)."""
  if code == _F32:
    return np.float64(_f32(a32[i]))
  if code == _F64:
    return _f64(a64[i])
  if code == _BF16:
    return np.float64(_f32(np.uint32(a16[i]) << np.uint32(16)))
  return np.float64(table[a16[i]])


# ------------------------------------------------------------- pass 1: f32-mode power sums
# The fast block sums carry the ``reassoc`` fast-math flag and nothing else: LLVM may then
# split the sum into vector lanes (element j of the block -> lane j mod width, lanes added by
# a fixed tree at the end), which is what makes the pass memory-bound. The order is a fixed
# function of the compiled code and the block length, never of the data's address (LLVM does
# not peel loops for alignment on x86; a test pins the bits at every offset), the thread, or
# other systems. Squares of <= 32-bit floats are exact in float64, so only that order matters.
_REASSOC = dict(nogil=True, cache=True, fastmath={"reassoc"})


def _make_power_sum(kind: int, int_power: int = 0):
  """Items kernel summing |x|**p for one term kind (and integer power): compile-time
  constants, so the block loops carry no branches."""

  @njit(inline="always", **_JIT)
  def term(a, ip, p):
    if kind == _KIND_SQ:
      return a * a
    if kind == _KIND_ABS:
      return a
    if kind == _KIND_INT:
      t = a * a
      for _ in range(int_power - 2):
        t = t * a
      return t
    return a ** p

  @njit(**_REASSOC)
  def block_f32(xs, ip, p):
    s = 0.0
    for j in range(xs.size):
      s += term(abs(np.float64(_f32(xs[j]))), ip, p)
    return s

  @njit(**_REASSOC)
  def block_bf16(xs, ip, p):
    s = 0.0
    for j in range(xs.size):
      s += term(abs(np.float64(_f32(np.uint32(xs[j]) << np.uint32(16)))), ip, p)
    return s

  @njit(**_REASSOC)
  def block_f16(xs, table, ip, p):
    s = 0.0
    for j in range(xs.size):
      s += term(abs(np.float64(table[xs[j]])), ip, p)
    return s

  @njit(**_JIT)
  def block_skipping(code, a16, a32, a64, table, start, n, ip, p):
    """Zero mode, a block holding non-finite elements: they count as 0 (in order)."""
    s = 0.0
    for j in range(n):
      v = _load(code, a16, a32, a64, start + j, table)
      if math.isfinite(v):
        s += term(abs(v), ip, p)
    return s

  @njit(**_JIT)
  def items(i0, i1, part, flags, addrs, sizes, codes, it_leaf, it_start, it_len, table, ip, p,
            zero_mode):
    for it in range(i0, i1):
      leaf = it_leaf[it]
      code = codes[leaf]
      a16, a32, a64 = _views(addrs[leaf], sizes[leaf], code)
      start, n = it_start[it], it_len[it]
      # Blocks as arrays of their own (from the address), not slices: measured 1.5x faster.
      if code == _F32:
        total = block_f32(numba.carray(_ptr_u32(addrs[leaf] + 4 * start), n), ip, p)
      elif code == _BF16:
        total = block_bf16(numba.carray(_ptr_u16(addrs[leaf] + 2 * start), n), ip, p)
      else:
        total = block_f16(numba.carray(_ptr_u16(addrs[leaf] + 2 * start), n), table, ip, p)
      f = 0
      if not math.isfinite(total):
        # Only non-finite elements make a sum of p <= 6 powers of <= 32-bit floats non-finite.
        f = _block_flags(code, a16, a32, a64, table, start, n)
        if zero_mode:
          total = block_skipping(code, a16, a32, a64, table, start, n, ip, p)
      part[it] = total
      flags[it] = f

  return items, block_f32


@njit(inline="always", **_JIT)
def _block_flags(code, a16, a32, a64, table, start, n):
  f = 0
  for j in range(n):
    v = _load(code, a16, a32, a64, start + j, table)
    if math.isnan(v):
      f |= 1
    elif math.isinf(v):
      f |= 2
  return f


_POWER_SUM_KERNELS = {kind: _make_power_sum(kind) for kind in (_KIND_ABS, _KIND_SQ, _KIND_POW)}
_POWER_SUM_KERNELS.update({(_KIND_INT, k): _make_power_sum(_KIND_INT, k) for k in range(3, 7)})
_POWER_SUM = {key: kernels[0] for key, kernels in _POWER_SUM_KERNELS.items()}
# The fused kernels sum squares with the very block function the items kernel calls.
_SQUARES_F32 = _POWER_SUM_KERNELS[_KIND_SQ][1]


# ------------------------------------------------------------------- pass: max / min |x|
# Extremes of |x| are taken on the bit patterns (for nonnegative floats the integer order is
# the float order): integer min/max reductions vectorise without fast-math, and NaN/inf have
# the largest patterns, which flags them for a careful re-scan of the block.
@njit(**_JIT)
def _bits_extreme(code, a16, a32, a64, start, n, want_min):
  """Smallest and largest |x| bit patterns of a block (indexed integer reductions vectorise;
  the min is only taken when asked for)."""
  lo = np.uint64(0xFFFFFFFFFFFFFFFF)
  if code == _F32:
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
  if code == _F64:
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


@njit(inline="always", **_JIT)
def _bits_value(code, bits, table):
  if code == _F32:
    return np.float64(_f32(np.uint32(bits)))
  if code == _F64:
    return _f64(bits)
  if code == _BF16:
    return np.float64(_f32(np.uint32(bits) << np.uint32(16)))
  return np.float64(table[np.uint16(bits)])


@njit(inline="always", **_JIT)
def _nonfinite_bits(code):
  if code == _F32:
    return np.uint64(0x7F800000)
  if code == _F64:
    return np.uint64(0x7FF0000000000000)
  if code == _BF16:
    return np.uint64(0x7F80)
  return np.uint64(0x7C00)


@njit(**_JIT)
def _extreme_items(i0, i1, part, flags, addrs, sizes, codes, it_leaf, it_start, it_len, table,
                   want_min, zero_mode):
  """Items [i0, i1): max |x| (or min |x|) and non-finite flags; non-finite count as 0 in
  zero mode (and are skipped otherwise: such a system is poisoned anyway)."""
  for it in range(i0, i1):
    leaf = it_leaf[it]
    code = codes[leaf]
    a16, a32, a64 = _views(addrs[leaf], sizes[leaf], code)
    start, n = it_start[it], it_len[it]
    lo, hi = _bits_extreme(code, a16, a32, a64, start, n, want_min)
    if hi < _nonfinite_bits(code):
      part[it] = _bits_value(code, lo if want_min else hi, table)
      flags[it] = 0
      continue
    best = np.inf if want_min else 0.0
    f = 0
    for j in range(n):
      v = abs(_load(code, a16, a32, a64, start + j, table))
      if not math.isfinite(v):
        f |= 1 if math.isnan(v) else 2
        if not zero_mode:
          continue
        v = 0.0
      best = min(best, v) if want_min else max(best, v)
    part[it] = best
    flags[it] = f


# --------------------------------------------------- pass 2 (scaled, double-double) sums
@njit(inline="always", **_JIT)
def _dd_add(hi, lo, t_hi, t_lo):
  s = hi + t_hi
  bb = s - hi
  e = (hi - (s - bb)) + (t_hi - bb)
  return s, lo + (e + t_lo)


@njit(inline="always", **_JIT)
def _two_prod(a, b):
  p = a * b
  return p, _fma(a, b, -p)


@njit(inline="always", **_JIT)
def _two_sum(a, b):
  s = a + b
  bb = s - a
  return s, (a - (s - bb)) + (b - bb)


@njit(inline="always", **_JIT)
def _dd_mul(ah, al, bh, bl):
  p, e = _two_prod(ah, bh)
  e += ah * bl + al * bh
  s = p + e
  return s, e - (s - p)


@njit(inline="always", **_JIT)
def _dd_add_d(hi, lo, d):
  s, e = _two_sum(hi, d)
  e += lo
  t = s + e
  return t, e - (t - s)


@njit(**_JIT)
def _dd_exp(h, l, coeffs_hi, coeffs_lo):
  """Scalar twin of ``double_double.dd_exp`` (same reduction, Taylor terms and squarings)."""
  k = math.floor(h / double_double.LN2_HI + 0.5)
  p1, e1 = _two_prod(k, double_double.LN2_HI)
  r_hi, r_lo = _two_sum(h, -p1)
  r_lo += l - e1 - k * double_double.LN2_LO
  t = r_hi + r_lo
  r_lo = r_lo - (t - r_hi)
  r_hi = t * 0.0625
  r_lo = r_lo * 0.0625
  a_hi, a_lo = coeffs_hi[0], coeffs_lo[0]
  for i in range(1, coeffs_hi.size):
    a_hi, a_lo = _dd_mul(a_hi, a_lo, r_hi, r_lo)
    a_hi, a_lo = _dd_add_d(a_hi, a_lo + coeffs_lo[i], coeffs_hi[i])
  a_hi, a_lo = _dd_mul(a_hi, a_lo, r_hi, r_lo)
  a_hi, a_lo = _dd_add_d(a_hi, a_lo, 1.0)
  a_hi, a_lo = _dd_mul(a_hi, a_lo, r_hi, r_lo)
  for _ in range(4):
    t_hi, t_lo = _dd_add_d(a_hi, a_lo, 2.0)
    a_hi, a_lo = _dd_mul(a_hi, a_lo, t_hi, t_lo)
  e_hi, e_lo = _dd_add_d(a_hi, a_lo, 1.0)
  if k < -1000.0:
    return 0.0, 0.0  # far below the system's largest term (>= 2**-512): negligible
  s = math.ldexp(1.0, int(k))
  return e_hi * s, e_lo * s


@njit(**_JIT)
def _dd_pow(a, a_lo, p, coeffs_hi, coeffs_lo):
  """(a + a_lo)**p (0 < a <= 1) as a double-double, via dd log and dd exp."""
  m, e = math.frexp(a)
  ml = math.ldexp(a_lo, -e)
  y = math.log(m)
  x_hi, x_lo = _dd_exp(-y, 0.0, coeffs_hi, coeffs_lo)
  t_hi, t_lo = _dd_mul(m, ml, x_hi, x_lo)
  t_hi, t_lo = _dd_add_d(t_hi, t_lo, -1.0)
  y_hi = y + (t_hi + t_lo)
  y_lo = (t_hi + t_lo) - (y_hi - y)
  k_hi, k_lo = _two_prod(float(e), double_double.LN2_HI)
  k_lo += float(e) * double_double.LN2_LO
  s_hi, s_lo = _two_sum(k_hi, y_hi)
  s_lo += k_lo + y_lo
  z_hi, z_lo = _two_prod(s_hi, p)
  z_lo += s_lo * p
  if z_hi < -740.0:
    return 0.0, 0.0
  return _dd_exp(z_hi, z_lo, coeffs_hi, coeffs_lo)


_COEFFS_HI = np.array([c[0] for c in double_double.EXP_COEFFS])  # pylint: disable=protected-access
_COEFFS_LO = np.array([c[1] for c in double_double.EXP_COEFFS])  # pylint: disable=protected-access


@njit(inline="always", **_JIT)
def _dd_term(a, a_lo, kind, ip, p):
  """(hi, lo) of a**p for a >= 0: exact for p = 1, 2; double-double otherwise."""
  if kind == _KIND_ABS:
    return a, 0.0
  if kind == _KIND_SQ:
    h = a * a
    return h, _fma(a, a, -h)
  if kind == _KIND_INT:
    h = a * a
    lo = _fma(a, a, -h)
    for _ in range(ip - 2):
      nh = h * a
      nlo = _fma(h, a, -nh) + lo * a
      h = nh + nlo
      lo = nlo - (h - nh)
    return h, lo
  if a == 0.0:
    return 0.0, 0.0
  return _dd_pow(a, a_lo, p, _COEFFS_HI, _COEFFS_LO)


@njit(**_JIT)
def _scaled_sum_items(i0, i1, hi_out, lo_out, addrs, sizes, codes, it_leaf, it_sys, it_start,
                      it_len, table, inv_scale, inv_scale2, divide, kind, ip, p):
  """Items [i0, i1): double-double sum of (|x| 2**-K)**p (or (|x| / max)**p), in order.

  Non-finite elements are skipped (they only matter in zero mode, where they count as 0)."""
  for it in range(i0, i1):
    leaf = it_leaf[it]
    code = codes[leaf]
    a16, a32, a64 = _views(addrs[leaf], sizes[leaf], code)
    start, n = it_start[it], it_len[it]
    f = inv_scale[it_sys[it]]
    f2 = inv_scale2[it_sys[it]]  # 2**-K = f * f2: two exact steps when 2**-K overflows
    hi = 0.0
    lo = 0.0
    for j in range(n):
      v = abs(_load(code, a16, a32, a64, start + j, table))
      if not math.isfinite(v):
        continue
      if divide:  # a + a_lo = v / f (the FMA residual of the quotient)
        a = v / f
        a_lo = _fma(-a, f, v) / f
      else:
        a = (v * f) * f2
        a_lo = 0.0
      t_hi, t_lo = _dd_term(a, a_lo, kind, ip, p)
      hi, lo = _dd_add(hi, lo, t_hi, t_lo)
    hi_out[it] = hi
    lo_out[it] = lo


# ------------------------------------------------------------------------ max-step pass
@njit(**_JIT)
def _step_block_f32(xs, d):
  """Largest vector sum of squares of a float32 block (each vector summed in order, float64);
  inf when some element is not finite. The max is taken on the bit patterns (sums are >= 0,
  NaN and inf have the largest patterns), an integer reduction that vectorises."""
  best = np.uint64(0)
  if d == 3:  # the same order as the general loop below (0.0 + a == a exactly)
    for v in range(xs.size // 3):
      x0 = np.float64(_f32(xs[3 * v]))
      x1 = np.float64(_f32(xs[3 * v + 1]))
      x2 = np.float64(_f32(xs[3 * v + 2]))
      best = max(best, _u64((x0 * x0 + x1 * x1) + x2 * x2))
  else:
    for v in range(xs.size // d):
      s = 0.0
      for j in range(d):
        x = np.float64(_f32(xs[v * d + j]))
        s += x * x
      best = max(best, _u64(s))
  if best >= np.uint64(0x7FF0000000000000):
    return np.inf
  return _f64(best)


@njit(**_JIT)
def _step_items(i0, i1, out_k, out_hi, out_lo, flags, addrs, sizes, codes, vecs, it_leaf,
                it_start, it_len, table, zero_mode, dd):
  """Items [i0, i1) (whole vectors): the largest vector sum of squares as (k, hi, lo), value
  (hi + lo) 4**k. f32 mode sums each vector in float64 in order (k = 0); dd mode scales each
  vector by a power of two and sums its exact squares in double-double."""
  for it in range(i0, i1):
    leaf = it_leaf[it]
    code = codes[leaf]
    a16, a32, a64 = _views(addrs[leaf], sizes[leaf], code)
    start, n = it_start[it], it_len[it]
    d = vecs[leaf]
    best_k, best_hi, best_lo = 0, 0.0, 0.0
    f = 0
    if code == _F32 and not dd:
      best = _step_block_f32(a32[start:start + n], d)
      if best < np.inf:  # all finite (a NaN or inf element makes its vector's sum non-finite)
        out_k[it], out_hi[it], out_lo[it] = 0, best, 0.0
        flags[it] = 0
        continue
    for v0 in range(start, start + n, d):
      if not dd:
        s = 0.0
        bad = False
        for j in range(d):
          x = _load(code, a16, a32, a64, v0 + j, table)
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
        x = abs(_load(code, a16, a32, a64, v0 + j, table))
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
        x = abs(_load(code, a16, a32, a64, v0 + j, table))
        if math.isfinite(x):
          a = (x * inv) * inv2
          t_hi = a * a
          hi, lo = _dd_add(hi, lo, t_hi, _fma(a, a, -t_hi))
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
      if best_hi == 0.0 or k > best_k or (k == best_k and (hi > best_hi or (
          hi == best_hi and lo > best_lo))):
        best_k, best_hi, best_lo = k, hi, lo
    out_k[it], out_hi[it], out_lo[it] = best_k, best_hi, best_lo
    flags[it] = f


# ------------------------------------------------------------------------------ apply pass
@njit(inline="always", **_JIT)
def _rtz64(ax, s_m, s_e):
  """RTZ(ax * s_m * 2**s_e) in float64 for ax >= 0 (exact: the FMA gives the product error)."""
  if ax == 0.0:
    return 0.0
  shift = 0
  if ax < 2.0 ** -900:
    ax = ax * 2.0 ** 200
    shift = -200
  pr = ax * s_m
  err = _fma(ax, s_m, -pr)
  below = err < 0.0 or (err == 0.0 and math.copysign(1.0, err) < 0.0)
  e = s_e + shift
  pe = math.frexp(pr)[1]
  if pe + e >= -1021:
    y = math.ldexp(pr, e)  # exact: the result is normal
    if below:
      y = _f64(_u64(y) - np.uint64(1))
    return y
  if pe + e < -1080:
    return 0.0
  t = math.ldexp(pr, e + 1074)  # exact (normal), the result in units of 2**-1074
  units = math.floor(t)
  if below and units == t:
    units -= 1.0
  return _f64(np.uint64(units))


@njit(inline="always", **_JIT)
def _f32_rtz_bits(y):
  """Bits of the largest float32 <= y (y >= 0, below the float32 max)."""
  q = np.float32(y)
  return _u32(q) - np.uint32(np.float64(q) > y)


@njit(inline="always", **_JIT)
def _f16_from_f32_rtz(b):
  """RTZ float32 bits (positive, below 65520) -> float16 bits."""
  e = np.int32((b >> np.uint32(23)) & np.uint32(0xFF)) - 127
  if e >= -14:
    return np.uint16(((e + 15) << 10) | np.int32((b & np.uint32(0x7FFFFF)) >> np.uint32(13)))
  q = np.float64(_f32(b)) * 2.0 ** 24
  return np.uint16(math.floor(q))


@njit(inline="always", **_JIT)
def _scale_f32(xs, os, sv):
  """os = RTZ(xs * sv) for float32 bits, sv with <= 29 significant bits (x * sv is exact)."""
  for j in range(xs.size):
    b = xs[j]
    y = np.float64(_f32(b & np.uint32(0x7FFFFFFF))) * sv
    os[j] = _f32_rtz_bits(y) | (b & np.uint32(0x80000000))


@njit(inline="always", **_JIT)
def _scale_f32_fma(xs, os, s32):
  """os = RTZ(xs * s32) for float32 bits and a float32 factor: q = fl(|x| * s32) and its exact
  error e = fma(|x|, s32, -q); q rounded up exactly when e is below zero, and rounding keeps the
  sign of a non-zero error even when it underflows (-0.0), so the sign bit decides the fix-up
  and the result is the exact RTZ value, as ``_scale_f32`` computes it through float64."""
  for j in range(xs.size):
    b = xs[j]
    a = _f32(b & np.uint32(0x7FFFFFFF))
    q = a * s32
    e = _fma32(a, s32, -q)
    os[j] = (_u32(q) - (_u32(e) >> np.uint32(31))) | (b & np.uint32(0x80000000))


@njit(inline="always", **_JIT)
def _apply_range(addr, out_addr, size, code, start, n, table, act, sm, se, sv, zero_sys,
                 precise):
  a16, a32, a64 = _views(addr, size, code)
  o16, o32, o64 = _views(out_addr, size, code)
  end = start + n
  if act == decision.NAN_FILL:
    if code == _F32:
      o32[start:end] = np.uint32(0x7FC00000)
    elif code == _F64:
      o64[start:end] = np.uint64(0x7FF8000000000000)
    elif code == _BF16:
      o16[start:end] = np.uint16(0x7FC0)
    else:
      o16[start:end] = np.uint16(0x7E00)
    return
  if (code == _F32 and not zero_sys and n >= _NT_MIN and (out_addr + 4 * start) % 32 == 0 and
      (act == decision.KEEP or (act == decision.SCALE and not precise))):
    # Long aligned runs (the output layout aligns large leaves): streamed body, scalar tail.
    # Short or unaligned runs keep ordinary stores: an ordinary store next to streamed ones
    # was measured to cost ~2 us each time.
    body = n - n % _NT_LANES
    if act == decision.KEEP:
      _nt_copy_f32(addr + 4 * start, out_addr + 4 * start, body)
      o32[start + body:end] = a32[start + body:end]
    elif np.float64(np.float32(sv)) == sv:
      _nt_scale_f32_fma(addr + 4 * start, out_addr + 4 * start, body, np.float32(sv))
      _scale_f32_fma(a32[start + body:end], o32[start + body:end], np.float32(sv))
    else:
      _nt_scale_f32(addr + 4 * start, out_addr + 4 * start, body, sv)
      _scale_f32(a32[start + body:end], o32[start + body:end], sv)
    return
  if act == decision.SCALE and code == _F32 and not precise and not zero_sys:
    if np.float64(np.float32(sv)) == sv:
      _scale_f32_fma(a32[start:end], o32[start:end], np.float32(sv))
    else:
      _scale_f32(a32[start:end], o32[start:end], sv)
    return
  if act == decision.KEEP and not zero_sys:
    if code == _F32:
      o32[start:end] = a32[start:end]
    elif code == _F64:
      o64[start:end] = a64[start:end]
    else:
      o16[start:end] = a16[start:end]
    return
  for i in range(start, end):
    x = _load(code, a16, a32, a64, i, table)
    if not math.isfinite(x):  # zero mode only: a non-finite element becomes +0.0
      if code == _F32:
        o32[i] = np.uint32(0)
      elif code == _F64:
        o64[i] = np.uint64(0)
      else:
        o16[i] = np.uint16(0)
      continue
    if act == decision.KEEP:
      if code == _F32:
        o32[i] = a32[i]
      elif code == _F64:
        o64[i] = a64[i]
      else:
        o16[i] = a16[i]
      continue
    ax = abs(x)
    neg = math.copysign(1.0, x) < 0.0
    y = _rtz64(ax, sm, se) if precise else ax * sv  # the latter exact: <= 24 x 29 bits
    if code == _F64:
      o64[i] = _u64(y) | (np.uint64(1) << np.uint64(63) if neg else np.uint64(0))
      continue
    b = _f32_rtz_bits(y)
    if code == _F32:
      o32[i] = b | (np.uint32(0x80000000) if neg else np.uint32(0))
    elif code == _BF16:
      o16[i] = np.uint16(b >> np.uint32(16)) | (np.uint16(0x8000) if neg else np.uint16(0))
    else:
      o16[i] = _f16_from_f32_rtz(b) | (np.uint16(0x8000) if neg else np.uint16(0))


@njit(**_JIT)
def _apply_items(i0, i1, addrs, out_addrs, sizes, codes, it_leaf, it_sys, it_start, it_len,
                 table, action, s_m, s_e, s_val, zero_sys, precise):
  for it in range(i0, i1):
    leaf = it_leaf[it]
    k = it_sys[it]
    _apply_range(addrs[leaf], out_addrs[leaf], sizes[leaf], codes[leaf], it_start[it],
                 it_len[it], table, action[k], s_m[k], s_e[k], s_val[k], zero_sys[k], precise)
  _store_fence()


@njit(**_JIT)
def _apply_rows(r0, r1, addr, out_addr, size, code, rowsize, seg, table, action, s_m, s_e,
                s_val, zero_sys, precise):
  for r in range(r0, r1):
    k = seg[r]
    _apply_range(addr, out_addr, size, code, r * rowsize, rowsize, table, action[k], s_m[k],
                 s_e[k], s_val[k], zero_sys[k], precise)
  _store_fence()


# ------------------------------------------------------------------------- segment handling
_SCAN_SUB = 2048  # ids per sub-chunk: checked, then (still in L1) searched for boundaries
# Below this many ids a serial scan (about 0.3 ns per cached id) beats a thread hand-off.
_SCAN_PARALLEL_MIN = 1 << 20


@njit(**_JIT)
def _record_offsets(seg, b, e, prev, off):
  """off[k] = the first row in [b, e) with id >= k, for ids k in (prev, seg[e - 1]] clipped to
  [0, len(off) - 2]; seg[b:e] is sorted and prev is the id before row b (-1 at row 0). Binary
  searches over ids the scan has just brought into L1, each from the previous result."""
  k = max(prev + 1, 0)
  top = min(np.int64(seg[e - 1]), off.size - 2)
  j = b
  while k <= top:
    lo, hi = j, e - 1  # seg[e - 1] >= top >= k: the answer is in [lo, hi]
    while lo < hi:
      mid = (lo + hi) // 2
      if seg[mid] < k:
        lo = mid + 1
      else:
        hi = mid
    j = lo
    # Every id in (seg[j - 1], seg[j]] starts at row j.
    k_end = min(np.int64(seg[j]), top)
    while k <= k_end:
      off[k] = j
      k += 1


@njit(**_JIT)
def _scan_chunk(c0, c1, seg, mins, maxs, ok, nchunks, off):
  """Chunks [c0, c1) of an id array: sortedness (including the chunk's first element against
  the previous chunk's last), min and max (the end points of a sorted chunk; a second pass
  only over an unsorted one) and, while the chunk is sorted so far, the system offsets of its
  rows (``_record_offsets``; meaningful only if every chunk is sorted). The order check is
  branch-free, so it vectorises; the offsets cost one search per system boundary, on ids
  already in cache, instead of a second pass over the array."""
  n = seg.size
  for c in range(c0, c1):
    lo = c * n // nchunks
    hi = (c + 1) * n // nchunks
    descents = 0
    prev = np.int64(seg[lo - 1]) if lo > 0 else np.int64(-1)
    for b in range(lo, hi, _SCAN_SUB):
      e = min(b + _SCAN_SUB, hi)
      start = max(b, 1)
      cur = seg[start:e]
      before = seg[start - 1:e - 1]
      for j in range(cur.size):
        descents += np.int64(cur[j] < before[j])
      if descents == 0:
        _record_offsets(seg, b, e, prev, off)
        prev = np.int64(seg[e - 1])
    if descents == 0:
      mins[c] = seg[lo]
      maxs[c] = seg[hi - 1]
    else:
      mn = np.iinfo(np.int64).max
      mx = np.iinfo(np.int64).min
      part = seg[lo:hi]
      for j in range(part.size):
        mn = min(mn, np.int64(part[j]))
        mx = max(mx, np.int64(part[j]))
      mins[c] = mn
      maxs[c] = mx
    ok[c] = descents == 0


@njit(**_JIT)
def _counting_order(seg, num_systems):
  """Stable order of rows by system (counting sort) and the system row offsets."""
  off = np.zeros(num_systems + 1, dtype=np.int64)
  for i in range(seg.size):
    off[seg[i] + 1] += 1
  for k in range(num_systems):
    off[k + 1] += off[k]
  pos = off[:-1].copy()
  order = np.empty(seg.size, dtype=np.int64)
  for i in range(seg.size):
    k = seg[i]
    order[pos[k]] = i
    pos[k] += 1
  return order, off


@njit(**_JIT)
def _build_items(offsets, rowsizes, vecs, block, by_vectors):
  """Items (leaf, system, start, length) of every non-empty run, cut into blocks, in
  (leaf, system, block) order. ``offsets[l]`` are row offsets of systems in leaf l."""
  nl = offsets.shape[0]
  ns = offsets.shape[1] - 1
  count = 0
  for l in range(nl):
    r = rowsizes[l]
    step = max(1, block // vecs[l]) * vecs[l] if by_vectors else block
    for k in range(ns):
      length = (offsets[l, k + 1] - offsets[l, k]) * r
      if length > 0:
        count += (length + step - 1) // step
  it_leaf = np.empty(count, dtype=np.int32)
  it_sys = np.empty(count, dtype=np.int32)
  it_start = np.empty(count, dtype=np.int64)
  it_len = np.empty(count, dtype=np.int64)
  c = 0
  for l in range(nl):
    r = rowsizes[l]
    step = max(1, block // vecs[l]) * vecs[l] if by_vectors else block
    for k in range(ns):
      begin = offsets[l, k] * r
      end = offsets[l, k + 1] * r
      pos = begin
      while pos < end:
        it_leaf[c] = l
        it_sys[c] = k
        it_start[c] = pos
        it_len[c] = min(step, end - pos)
        pos += step
        c += 1
  return it_leaf, it_sys, it_start, it_len


@njit(**_JIT)
def _combine_sum(it_sys, part, num_systems):
  """Per-system left fold of the item sums, in item order (leaf, then block order)."""
  tot = np.zeros(num_systems)
  for it in range(it_sys.size):
    tot[it_sys[it]] += part[it]
  return tot


@njit(**_JIT)
def _combine_dd(it_sys, hi, lo, num_systems):
  tot_hi = np.zeros(num_systems)
  tot_lo = np.zeros(num_systems)
  for it in range(it_sys.size):
    k = it_sys[it]
    tot_hi[k], tot_lo[k] = _dd_add(tot_hi[k], tot_lo[k], hi[it], lo[it])
  return tot_hi, tot_lo


@njit(**_JIT)
def _combine_flags(it_sys, flags, num_systems):
  out = np.zeros(num_systems, dtype=np.int8)
  for it in range(it_sys.size):
    out[it_sys[it]] |= flags[it]
  return out


@njit(**_JIT)
def _combine_extreme(it_sys, part, num_systems, want_min):
  out = np.full(num_systems, np.inf if want_min else 0.0)
  for it in range(it_sys.size):
    k = it_sys[it]
    out[k] = min(out[k], part[it]) if want_min else max(out[k], part[it])
  return out


@njit(**_JIT)
def _combine_step(it_sys, ks, his, los, num_systems):
  out_k = np.zeros(num_systems, dtype=np.int64)
  out_hi = np.zeros(num_systems)
  out_lo = np.zeros(num_systems)
  for it in range(it_sys.size):
    j = it_sys[it]
    k, hi, lo = ks[it], his[it], los[it]
    if hi == 0.0:
      continue
    if out_hi[j] == 0.0 or k > out_k[j] or (k == out_k[j] and (hi > out_hi[j] or (
        hi == out_hi[j] and lo > out_lo[j]))):
      out_k[j], out_hi[j], out_lo[j] = k, hi, lo
  return out_k, out_hi, out_lo


@njit(**_JIT)
def _count_per_system(it_sys, it_len, num_systems):
  out = np.zeros(num_systems, dtype=np.int64)
  for it in range(it_sys.size):
    out[it_sys[it]] += it_len[it]
  return out


# ------------------------------------------------------------------------ finalize, compiled
@njit(**_JIT)
def _dd_int_power_nb(r, n):
  hi, lo = r, 0.0
  acc_hi, acc_lo = 1.0, 0.0
  first = True
  while n:
    if n & 1:
      if first:
        acc_hi, acc_lo = hi, lo
        first = False
      else:
        acc_hi, acc_lo = _dd_mul(acc_hi, acc_lo, hi, lo)
    n >>= 1
    if n:
      hi, lo = _dd_mul(hi, lo, hi, lo)
  return acc_hi, acc_lo


@njit(inline="always", **_JIT)
def _next_up(v):
  """np.nextafter(v, inf) on the bits (the libm call costs ~10 ns, 20,000 systems twice)."""
  if v != v or v == np.inf:
    return v
  if v == 0.0:
    return _f64(np.uint64(1))
  return _f64(_u64(v) + np.uint64(1)) if v > 0.0 else _f64(_u64(v) - np.uint64(1))


@njit(inline="always", **_JIT)
def _next_toward_zero(v):
  """np.nextafter(v, 0.0) on the bits."""
  if v != v:
    return v
  if v == 0.0:
    return 0.0
  return _f64(_u64(v) - np.uint64(1))


@njit(inline="always", **_JIT)
def _pow2(k):
  """2.0 ** k for a normal power, -1022 <= k <= 1023, from its exponent bits."""
  return _f64(np.uint64(k + 1023) << np.uint64(52))


# Factors of calls without float64 leaves keep 24 bits (decision.SHORT_SCALE_BITS is 29): a
# float32 factor, so the float32 apply needs no float64 (``_scale_f32_fma``). It stays within
# rule 4's 4u of c / n: truncation costs < 2**-23 = 2u of float32, the coarsest such dtype.
_SCALE_BITS = 24


@njit(inline="always", **_JIT)
def _finalize_one(s_hi, s_lo, sc_m, sc_e, rel_err, zero, nan, inf, c_m, c_e, c_inf, p, precise,
                  coeffs_hi, coeffs_lo):
  """One system of ``decision.finalize``: (norm_v, action, s_m, s_e, tie). The fused kernels
  call it per system; ``_finalize_nb`` over arrays, so both routes give the same bits."""
  if nan or inf or not math.isfinite(s_hi):
    # Poisoned (its sums are not finite): NaN outputs; the norm is set by the caller.
    return 0.0, decision.NAN_FILL, 0.0, 0, False
  # root: (r_hi, r_lo) = S ** (1/p), relative error eps
  if math.isinf(p):
    r_hi, r_lo, eps = 1.0, 0.0, 0.0
  elif p == 1.0:
    r_hi = s_hi + s_lo
    r_lo = s_lo - (r_hi - s_hi)
    eps = rel_err + 2.0 ** -80
  else:
    pos = s_hi > 0
    safe = s_hi if pos else 1.0
    q_err = 0.0
    if p == 2.0:
      r = math.sqrt(safe)
      q_hi, q_lo = _two_prod(r, r)
    elif p == math.floor(p) and p <= 64.0:
      r = safe ** (1.0 / p)
      q_hi, q_lo = _dd_int_power_nb(r, int(p))
    else:
      r = safe ** (1.0 / p)
      q_hi, q_lo = _dd_pow(r, 0.0, p, coeffs_hi, coeffs_lo)
      q_err = double_double.DD_POW_REL_ERR
    d_hi, d_lo = _two_sum(safe, -q_hi)
    delta = (d_hi + (d_lo + ((s_lo if pos else 0.0) - q_lo))) / (p * q_hi)
    r_hi = r + r * delta
    r_lo = r * delta - (r_hi - r)
    if not pos:
      r_hi, r_lo = 0.0, 0.0
    re = rel_err
    eps = re / p + re * re + q_err / p + 2.0 ** -80
  t_hi, t_lo = _two_prod(sc_m, r_hi)
  t_lo = t_lo + sc_m * r_lo
  t = t_hi + t_lo
  t_lo = t_lo - (t - t_hi)
  t_hi = t
  if eps == 0.0:
    up = lo = t_hi
  else:
    slack = t_hi * eps
    up = _next_up(t_hi + (t_lo + slack))
    lo = _next_toward_zero(t_hi + (t_lo - slack))
  norm_v = t_hi + t_lo
  d = np.int64(c_e) - np.int64(sc_e)
  c_pos = c_m > 0
  c_t = c_m * _pow2(min(max(d, -1000), 1000))
  keep = c_inf or zero or (c_pos and (d >= 1000 or (d > -1000 and c_t >= up)))
  clip = (not keep) and ((not c_pos) or d <= -1000 or c_t < lo)
  is_tie = (not keep) and (not clip)
  active = not (keep or zero)
  if precise:
    margin = t_lo + t_hi * (eps + 2.0 ** -100)
    q = c_m / (t_hi + margin) if active else c_m
    for _ in range(3):
      prod, err = _two_prod(q, t_hi)
      if (prod - c_m) + err + q * margin > 0:
        q = _next_toward_zero(q)
    for _ in range(2):
      nxt = _next_up(q)
      prod, err = _two_prod(nxt, t_hi)
      if (prod - c_m) + err + nxt * margin <= 0:
        q = nxt
  else:
    q = c_m / up if active else c_m
    q = q * (1.0 - 2.0 ** -50)
  q_m, q_e = math.frexp(q)
  if not precise:
    q_m = math.floor(q_m * 2.0 ** _SCALE_BITS) * 2.0 ** -_SCALE_BITS
  if c_m == 0:
    s_m, s_e = 0.0, 0
  else:
    s_m, s_e = q_m, q_e + d
  return norm_v, decision.KEEP if keep else decision.SCALE, s_m, s_e, is_tie


@njit(**_JIT)
def _finalize_nb(s_hi, s_lo, sc_m, sc_e, rel_err, zero, nan, inf, c_m, c_e, c_inf, p, precise,
                 coeffs_hi, coeffs_lo):
  """Scalar twin of ``decision.finalize`` (same steps, one system at a time, no array
  temporaries; ``nextafter`` and powers of two on the bits, as libm calls they took half the
  time): measured 0.8 ms for 20,000 systems on a loaded 2-core machine, 1.4 ms before."""
  s = s_hi.size
  norm_v = np.empty(s)
  action = np.empty(s, dtype=np.int8)
  s_m = np.empty(s)
  s_e = np.empty(s, dtype=np.int32)
  tie = np.zeros(s, dtype=np.bool_)
  for k in range(s):
    norm_v[k], action[k], s_m[k], s_e[k], tie[k] = _finalize_one(
        s_hi[k], s_lo[k], sc_m[k], sc_e[k], rel_err[k], zero[k], nan[k], inf[k], c_m[k],
        c_e[k], c_inf[k], p, precise, coeffs_hi, coeffs_lo)
  return norm_v, action, s_m, s_e, tie


# --------------------------------------------------- fused pass over sorted segments
# Sorted ids (the usual layout of batched simulations) put each system's rows of a leaf in one
# run, and a system (W3: ~3 KB) fits in L1. One pass over a chunk of systems (chunks claimed
# by the threads in turn) then does everything the separate passes do, system by system: it
# finds each run's end by scanning the ids (which validates them: every row of the chunk must
# be consumed, in id order, inside the chunk's systems), sums the run's blocks with the same
# block function and in the same order as the items kernel, finalizes the system and scales
# the run while it is still in L1. The data is read from memory once instead of twice, the ids
# once instead of in a separate scan, and no per-item arrays are built. Near-ties are settled
# exactly on the host afterwards (``_fused_run``); ids that turn out unsorted or out of range,
# and non-finite elements in zero mode, leave the whole call to the general path.
FUSED_OK, FUSED_UNSORTED, FUSED_NONFINITE = 0, 1, 2
_SEG_I64, _SEG_I32 = 0, 1
_ptr_i32 = _pointer_intrinsic(types.int32)
_ptr_i64 = _pointer_intrinsic(types.int64)


_RUN_LANES = 16  # ids compared per vector step of a run scan


def _equal_prefix_intrinsic(bits):
  """How many of the 16 ids of ``bits`` bits at ``addr`` equal ``k``, counted from the first
  (16 when all do): one vector compare, its lane mask and a count of trailing zeros."""
  @intrinsic
  def equal_prefix(typingctx, addr, k):
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
      i64, elem = ir.IntType(64), ir.IntType(bits)
      vec = ir.VectorType(elem, _RUN_LANES)
      ids = builder.load(builder.inttoptr(args[0], vec.as_pointer()), align=bits // 8)
      key = builder.trunc(args[1], elem) if bits < 64 else args[1]
      keys = _broadcast(builder, key, vec)
      differ = builder.bitcast(builder.icmp_unsigned("!=", ids, keys), ir.IntType(_RUN_LANES))
      mask = builder.or_(builder.zext(differ, i64), ir.Constant(i64, 1 << _RUN_LANES))
      cttz = builder.module.declare_intrinsic("llvm.cttz", [i64], ir.FunctionType(
          i64, [i64, ir.IntType(1)]))
      return builder.call(cttz, [mask, ir.Constant(ir.IntType(1), 1)])
    return sig, codegen
  return equal_prefix


_equal_prefix_i64 = _equal_prefix_intrinsic(64)
_equal_prefix_i32 = _equal_prefix_intrinsic(32)


@njit(inline="always", **_JIT)
def _scan_run(ids, addr, wide, r, k):
  """The first index >= r whose id is not k (ids.size if none); -1 when that id is below k,
  which sorted ids never have. ``ids`` is the int64 (``wide``) or int32 array at ``addr``.
  Vector steps of ``_RUN_LANES`` ids: the next step's address does not wait for this step's
  compare (the loop exit is predicted), so loads run ahead; 31 against 115 ns per W3 system
  (255 ids) with 8-id OR steps, whose ids were compared one by one. An int32 compare of a k
  beyond int32 would wrap, so such a k takes the one-by-one loop."""
  n = ids.size
  e = r
  if wide or k <= 0x7FFFFFFF:
    while e + _RUN_LANES <= n:
      if wide:
        same = _equal_prefix_i64(addr + 8 * e, k)
      else:
        same = _equal_prefix_i32(addr + 4 * e, k)
      if same < _RUN_LANES:
        e += same
        break
      e += _RUN_LANES
  while e < n and ids[e] == k:
    e += 1
  if e < n and ids[e] < k:
    return -1
  return e


@njit(inline="always", **_JIT)
def _run_end(seg_addr, seg_code, r, r_end, k):
  """``_scan_run`` over rows [r, r_end) of an int64 or int32 id array at ``seg_addr``."""
  if seg_code == _SEG_I64:
    return _scan_run(numba.carray(_ptr_i64(seg_addr), r_end), seg_addr, True, r, k)
  return _scan_run(numba.carray(_ptr_i32(seg_addr), r_end), seg_addr, False, r, k)


@njit(inline="always", **_JIT)
def _fused_rel_err(count):
  """``decision.sum_rel_err(count, 0.0)`` for one system (the same operations)."""
  k = max(np.float64(count) - 1.0, 0.0) * decision.U64
  acc = k / max(1.0 - k, 0.5)
  return 0.0 + acc * (1.0 + 0.0) + 2.0 ** -1000


@njit(**_JIT)
def _fused_systems(k0, k1, rows0, rows1, addrs, out_addrs, sizes, rowsizes, vecs, seg_addrs,
                   seg_codes, c_m, c_e, c_inf, step, step_rel_err, zero_mode, table, sums,
                   norms, action, s_m, s_e, tie):
  """Systems [k0, k1) of float32 leaves whose rows [rows0[l], rows1[l]) hold exactly those
  systems' ids, in order: L2 (``step`` False) or max-step norms, decisions and outputs, as
  the items, combine, finalize and apply kernels compute them (``sums``: each system's sum of
  squares, or largest vector sum for max-step, as the combine kernels give it, for the tests
  of that claim). Returns FUSED_OK, or
  FUSED_UNSORTED / FUSED_NONFINITE (then nothing it wrote is to be used)."""
  nl = addrs.size
  cur = rows0.copy()
  ends = rows0.copy()
  for k in range(k0, k1):
    total = 0.0
    count = 0
    flags = 0
    for l in range(nl):
      r = cur[l]
      e = _run_end(seg_addrs[l], seg_codes[l], r, rows1[l], k)
      if e < 0:
        return FUSED_UNSORTED
      ends[l] = e
      if e == r:
        continue
      start = r * rowsizes[l]
      end = e * rowsizes[l]
      count += end - start
      if step:
        a32 = numba.carray(_ptr_u32(addrs[l]), end)
        best = _step_block_f32(a32[start:end], vecs[l])
        if best == np.inf:
          a16, a32v, a64 = _views(addrs[l], sizes[l], _F32)
          flags |= _block_flags(_F32, a16, a32v, a64, table, start, end - start)
        else:
          total = max(total, best)
        continue
      for b in range(start, end, BLOCK):
        n = min(BLOCK, end - b)
        part = _SQUARES_F32(numba.carray(_ptr_u32(addrs[l] + 4 * b), n), np.int64(2), 2.0)
        if not math.isfinite(part):
          a16, a32v, a64 = _views(addrs[l], sizes[l], _F32)
          flags |= _block_flags(_F32, a16, a32v, a64, table, b, n)
        total += part
    if flags and zero_mode:  # non-finite elements count as 0: the general path's case
      return FUSED_NONFINITE
    nan = (flags & 1) != 0
    inf = (flags & 2) != 0 and not nan
    rel = step_rel_err if step else _fused_rel_err(count)
    zero = total == 0.0
    norm_v, act, sm, se, is_tie = _finalize_one(
        total, 0.0, 0.5, np.int64(1), rel, zero, nan, inf, c_m[k], np.int64(c_e[k]),
        c_inf[k], 2.0, False, _COEFFS_HI, _COEFFS_LO)
    # decision.compose_norm: ldexp(norm_v, 1), then zero, inf and NaN, rounded to float32.
    v = norm_v * 2.0
    if zero:
      v = 0.0
    if inf:
      v = np.inf
    if nan:
      v = np.nan
    norms[k] = np.float32(v)
    sums[k] = total
    action[k] = act
    s_m[k] = sm
    s_e[k] = se
    tie[k] = is_tie
    sv = math.ldexp(sm, se)
    for l in range(nl):
      r = cur[l]
      e = ends[l]
      if e > r:
        _apply_range(addrs[l], out_addrs[l], sizes[l], _F32, r * rowsizes[l],
                     (e - r) * rowsizes[l], table, act, sm, np.int64(se), sv, False, False)
      cur[l] = e
  for l in range(nl):
    if cur[l] != rows1[l]:
      return FUSED_UNSORTED
  return FUSED_OK


@njit(**_JIT)
def _fused_claimed(counter, cuts, bounds, status, addrs, out_addrs, sizes, rowsizes, vecs,
                   seg_addrs, seg_codes, c_m, c_e, c_inf, step, step_rel_err, zero_mode, table,
                   sums, norms, action, s_m, s_e, tie):
  """``_fused_systems`` over chunks t of systems [cuts[t], cuts[t + 1]) (rows
  [bounds[t], bounds[t + 1])), each claimed from ``counter`` by whichever thread is free;
  status[t] is the chunk's return value."""
  parts = cuts.size - 1
  while True:
    t = _claim_next(counter)
    if t >= parts:
      _store_fence()  # once per thread, not per chunk: each fence costs ~2 us
      return
    status[t] = _fused_systems(cuts[t], cuts[t + 1], bounds[t], bounds[t + 1], addrs,
                               out_addrs, sizes, rowsizes, vecs, seg_addrs, seg_codes, c_m,
                               c_e, c_inf, step, step_rel_err, zero_mode, table, sums, norms,
                               action, s_m, s_e, tie)


# ----------------------------------------------------------------------------- thread pool
# Serial nogil kernels on a small pool of Python threads, rather than numba's prange: an
# OpenMP barrier on a busy 2-core machine was measured to stall for ~36 ms per parallel
# region (median), against ~0.1 ms for a pool hand-off. Work below _PARALLEL_MIN elements
# runs in the calling thread.
_WORKERS = max(1, min(os.cpu_count() or 1, 8))
_PARALLEL_MIN = 1 << 18
_POOL: list[ThreadPoolExecutor] = []


def _pool() -> ThreadPoolExecutor:
  if not _POOL:
    _POOL.append(ThreadPoolExecutor(max_workers=_WORKERS - 1, thread_name_prefix="clipbench"))
  return _POOL[0]


# The fused route cuts its systems into chunks that the threads claim in turn: up to this
# many per thread, each of at least _CHUNK_MIN_BYTES of leaves. Measured on W3 (one process,
# calls alternated, 2,400-12,800 rounds): 16 per thread cost 0.6-2% of the median call
# against one fixed share per thread, 64 cost 4-6% and 256 14-17% (each chunk restarts its
# streams); in the rounds where fixed shares took over 1.4x the roofline, 16 per thread took
# 1.08-1.13x (docs/cpu-kernels.md).
_CHUNKS_PER_WORKER = 16
_CHUNK_MIN_BYTES = 1 << 18


def _parallel(kernel, weights: np.ndarray, *args) -> None:
  """kernel(i0, i1, *args) over [0, len(weights)), split into ranges of equal total weight."""
  n = int(weights.size)
  if n == 0:
    return
  cum = np.cumsum(weights)
  total = int(cum[-1])
  parts = min(_WORKERS, n)
  if parts == 1 or total < _PARALLEL_MIN:
    kernel(0, n, *args)
    return
  cuts = np.searchsorted(cum, total * np.arange(1, parts) / parts, side="right")
  bounds = np.concatenate([[0], cuts, [n]]).astype(np.int64)
  futures = [_pool().submit(kernel, int(bounds[i]), int(bounds[i + 1]), *args)
             for i in range(1, parts) if bounds[i + 1] > bounds[i]]
  if bounds[1] > 0:
    kernel(0, int(bounds[1]), *args)
  for f in futures:
    f.result()


# ------------------------------------------------------------------------------- host side
_ITEMSIZE = np.array([2, 2, 4, 8], dtype=np.int64)
_DTYPES = (np.dtype(np.float16), _BFLOAT16, np.dtype(np.float32), np.dtype(np.float64))
_CODE_OF = {dt: code for code, dt in enumerate(_DTYPES)}
# Leaves up to this many elements are packed (one C-level concatenate per dtype) instead of
# being read through their own pointers: per-leaf Python work dominates many small leaves.
_PACK_MAX = 1 << 14
# ... when there are more than this many of them: packing copies them (a fresh buffer, page
# faults included), which costs more than a few hundred pointer lookups (W1: 61 small leaves).
_PACK_MIN_LEAVES = 256


class _BufferPool:
  """Recycles large output buffers once no output view of them is alive.

  A fresh multi-megabyte buffer costs the kernel a page fault and a zero fill per page, about
  one more pass over the data (measured: np.copy into new memory takes 1.7-2x np.copyto). A
  buffer handed out earlier is reused only when its reference count shows that nothing but
  this pool holds it, so a returned leaf never shares memory with another live result; it
  behaves like any allocator's free list (torch's caching allocator works the same way).
  ``release_buffers()`` empties it.
  """

  MIN_BYTES = 1 << 20
  MAX_FREE_PER_SIZE = 2
  MAX_BYTES = 1 << 31

  def __init__(self):
    self._lock = threading.Lock()
    self._buffers: dict[tuple[np.dtype, int], list[np.ndarray]] = {}

  def empty(self, n: int, dtype: np.dtype) -> np.ndarray:
    if n * dtype.itemsize < self.MIN_BYTES:
      return np.empty(n, dtype=dtype)
    key = (dtype, n)
    with self._lock:
      entries = self._buffers.setdefault(key, [])
      # Held by the list and by getrefcount's argument only: every view of it is gone.
      free = [i for i in range(len(entries)) if sys.getrefcount(entries[i]) == 2]
      if free:
        return entries[free[0]]
      buf = np.empty(n, dtype=dtype)
      if self._total() + buf.nbytes <= self.MAX_BYTES:
        entries.append(buf)
      return buf

  def _total(self) -> int:
    # Entries whose views are all gone beyond MAX_FREE_PER_SIZE per size are dropped first.
    for entries in self._buffers.values():
      free = [i for i in range(len(entries)) if sys.getrefcount(entries[i]) == 2]
      for i in reversed(free[self.MAX_FREE_PER_SIZE:]):
        del entries[i]
    return sum(b.nbytes for v in self._buffers.values() for b in v)

  def clear(self) -> None:
    with self._lock:
      self._buffers.clear()


_BUFFERS = _BufferPool()


def release_buffers() -> None:
  """Drops the recycled output buffers (memory of live results is unaffected)."""
  _BUFFERS.clear()


@njit(nogil=True, cache=True)
def _data_address(x):
  return x.ctypes.data


_NUMBA_TYPED = frozenset((np.dtype(np.float32), np.dtype(np.float64)))


def _address(x: np.ndarray) -> int:
  # A compiled call costs ~0.6 us against ~2.8 us for the array interface, and W1 asks for
  # hundreds of addresses per call; numba does not type bfloat16 (nor, fully, float16).
  if x.dtype in _NUMBA_TYPED:
    return _data_address(x)
  return x.__array_interface__["data"][0]


class _Prepared:
  """Leaves as kernels see them: pointers, codes, sizes, and the runs of every system.

  Outputs live in one new buffer per dtype; each output leaf is a view of it.
  """

  def __init__(self, leaves: list[np.ndarray], segs: list[np.ndarray] | None,
               row_offsets: list[np.ndarray | None] | None, num_systems: int):
    self.leaves = leaves
    self._items = {}
    nl = len(leaves)
    self.shapes = [x.shape for x in leaves]
    self.codes = np.array([_CODE_OF[x.dtype] for x in leaves], dtype=np.int8)
    self.sizes = np.array([x.size for x in leaves], dtype=np.int64)
    self.num_systems = num_systems
    self.rows = np.array([s[0] if s else 1 for s in self.shapes], dtype=np.int64)
    self.rowsizes = np.where(self.rows > 0, self.sizes // np.maximum(self.rows, 1), 0)
    self.vecs = np.array([s[-1] if len(s) >= 2 else 1 for s in self.shapes], dtype=np.int64)
    self.vecs = np.maximum(self.vecs, 1)
    # Input addresses: small leaves packed per dtype, large ones read in place.
    self.addrs = np.zeros(nl, dtype=np.int64)
    self._keep_alive = []
    small = self.sizes <= _PACK_MAX
    for code in range(4):
      idx = np.flatnonzero((self.codes == code) & small)
      if idx.size > _PACK_MIN_LEAVES:
        packed = np.concatenate([leaves[i] for i in idx.tolist()], axis=None)
        self._keep_alive.append(packed)
        starts = np.concatenate([[0], np.cumsum(self.sizes[idx])[:-1]])
        self.addrs[idx] = _address(packed) + starts * _ITEMSIZE[code]
      else:
        small[idx] = False
    for i in np.flatnonzero(~small).tolist():
      if not leaves[i].flags.c_contiguous:
        # np.ascontiguousarray would turn a 0-d leaf into shape (1,).
        self.leaves[i] = leaves[i] = leaves[i].copy(order="C")
      self.addrs[i] = _address(leaves[i])
    # Unsorted segments: rows gathered into system order (a copy) for the norm pass only.
    self.gathered: list[np.ndarray | None] = [None] * nl
    self.row_segs: list[np.ndarray | None] = [None] * nl
    offsets = np.zeros((nl, num_systems + 1), dtype=np.int64)
    if segs is None:
      offsets[:, 1:] = self.rows[:, None]
    else:
      for i, x in enumerate(self.leaves):
        seg = segs[i]
        if seg.size == 0:
          continue
        if row_offsets[i] is not None:
          offsets[i] = row_offsets[i]
        else:
          order, offsets[i] = _counting_order(seg, num_systems)
          self.gathered[i] = np.ascontiguousarray(x[order])
          self.row_segs[i] = seg
    self.offsets = offsets
    self.norm_addrs = self.addrs.copy()
    for i, g in enumerate(self.gathered):
      if g is not None:
        self.norm_addrs[i] = _address(g)

  def items(self, by_vectors: bool):
    """(leaf, system, start, length) of every block, computed once per layout."""
    if by_vectors not in self._items:
      if not self.leaves:
        z = np.zeros(0, dtype=np.int64)
        self._items[by_vectors] = (z.astype(np.int32), z.astype(np.int32), z, z)
      else:
        self._items[by_vectors] = _build_items(self.offsets, self.rowsizes, self.vecs, BLOCK,
                                               by_vectors)
    return self._items[by_vectors]

  def new_outputs(self) -> tuple[list[np.ndarray], np.ndarray]:
    return _new_outputs(self.codes, self.sizes, self.shapes)

  def system_values(self, k: int) -> list[np.ndarray]:
    """The elements of system k, one float64 array per leaf (for the exact fallback)."""
    out = []
    for i, x in enumerate(self.leaves):
      src = self.gathered[i] if self.gathered[i] is not None else x
      lo, hi = self.offsets[i, k], self.offsets[i, k + 1]
      flat = src.reshape(int(self.rows[i]), int(self.rowsizes[i]))
      out.append(flat[lo:hi].astype(np.float64))
    return out

  def system_vectors(self, k: int) -> list[np.ndarray]:
    out = []
    for block, d in zip(self.system_values(k), self.vecs):
      out.append(block.reshape(-1, int(d)))
    return out


def _new_outputs(codes: np.ndarray, sizes: np.ndarray,
                 shapes: list[tuple[int, ...]]) -> tuple[list[np.ndarray], np.ndarray]:
  """Fresh output leaves (views of one buffer per dtype) and their data addresses."""
  nl = codes.size
  outs: list[Any] = [None] * nl
  out_addrs = np.zeros(nl, dtype=np.int64)
  for code in range(4):
    idx = np.flatnonzero(codes == code)
    if not idx.size:
      continue
    # Leaves long enough to be streamed come first, each starting on a 64-byte boundary
    # (so are all their blocks); the others follow, packed.
    code_sizes = sizes[idx]
    large = code_sizes >= _NT_MIN
    idx = np.concatenate([idx[large], idx[~large]])
    code_sizes = np.concatenate([code_sizes[large], code_sizes[~large]])
    align = 64 // int(_ITEMSIZE[code])
    slots = np.where(np.arange(code_sizes.size) < np.count_nonzero(large),
                     -(-code_sizes // align) * align, code_sizes)
    starts = np.concatenate([[0], np.cumsum(slots)[:-1]]).astype(np.int64)
    raw = _BUFFERS.empty(int(slots.sum()) + align, _DTYPES[code])
    buf = raw[(-_address(raw) % 64) // int(_ITEMSIZE[code]):]
    out_addrs[idx] = _address(buf) + starts * _ITEMSIZE[code]
    _split_views(buf, idx.tolist(), starts.tolist(), code_sizes.tolist(), shapes, outs)
  return outs, out_addrs


def _split_views(buf, idx, starts, sizes, shapes, outs) -> None:
  """outs[i] = buf[start:start+size].reshape(shape); a run of equal shapes is cut at C speed."""
  j = 0
  n = len(idx)
  while j < n:
    shape = shapes[idx[j]]
    k = j + 1
    while k < n and shapes[idx[k]] == shape and starts[k] == starts[k - 1] + sizes[k - 1]:
      k += 1
    if k - j > 1 and len(shape) >= 1:
      block = buf[starts[j]:starts[j] + sizes[j] * (k - j)].reshape((k - j,) + shape)
      for i, view in zip(idx[j:k], block):
        outs[i] = view
    else:
      for t in range(j, k):
        outs[idx[t]] = buf[starts[t]:starts[t] + sizes[t]].reshape(shapes[idx[t]])
    j = k


def _extreme(prep: _Prepared, it_leaf, it_start, it_len, want_min: bool, zero_mode: bool):
  part = np.empty(it_leaf.size)
  flags = np.zeros(it_leaf.size, dtype=np.int8)
  _parallel(_extreme_items, it_len, part, flags, prep.norm_addrs, prep.sizes, prep.codes,
            it_leaf, it_start, it_len, _F16_TABLE, want_min, zero_mode)
  return part, flags


def _scan_segments(seg: np.ndarray, num_systems: int) -> tuple[int, int, np.ndarray | None]:
  """(min, max, system row offsets or None if the ids are not sorted) of an id array, in
  parallel chunks; offsets[k] is the first row of system k (offsets[num_systems] = rows)."""
  nchunks = 64 if seg.size >= 4096 else 1
  mins = np.empty(nchunks, dtype=np.int64)
  maxs = np.empty(nchunks, dtype=np.int64)
  ok = np.empty(nchunks, dtype=np.bool_)
  off = np.empty(num_systems + 1, dtype=np.int64)
  if seg.size < _SCAN_PARALLEL_MIN:
    _scan_chunk(0, nchunks, seg, mins, maxs, ok, nchunks, off)
  else:
    _parallel(_scan_chunk, np.full(nchunks, seg.size // nchunks), seg, mins, maxs, ok, nchunks,
              off)
  lo, hi = int(mins.min()), int(maxs.max())
  if not ok.all():
    return lo, hi, None
  # Systems after the largest id have no rows.
  off[max(hi + 1, 0):] = seg.size
  return lo, hi, off


def _kind(p: float) -> tuple[int, int]:
  if p == 1.0:
    return _KIND_ABS, 1
  if p == 2.0:
    return _KIND_SQ, 2
  if float(p).is_integer() and p <= 64:
    return _KIND_INT, int(p)
  return _KIND_POW, 0


def _term_rel_err(p: float, kind: int) -> float:
  if kind in (_KIND_ABS, _KIND_SQ):
    return 0.0
  if kind == _KIND_INT:
    return (p - 1.0) * 1.01 * decision.U64  # the first product is exact; p - 2 roundings
  return decision.POW_REL_ERR


def _global_stats(prep: _Prepared, p: float, zero_mode: bool, f64_mode: bool):
  """Per-system finalize inputs for the p-norm (rule 1)."""
  s = prep.num_systems
  it_leaf, it_sys, it_start, it_len = prep.items(False)
  count = _count_per_system(it_sys, it_len, s)
  table = _F16_TABLE
  if math.isinf(p):
    part, flags = _extreme(prep, it_leaf, it_start, it_len, p < 0, zero_mode)
    mx = _combine_extreme(it_sys, part, s, p < 0)
    mx = np.where(count == 0, 0.0, mx)
    flags = _combine_flags(it_sys, flags, s)
    sc_m, sc_e = np.frexp(np.where(mx > 0, mx, 1.0))
    return dict(s_hi=np.ones(s), s_lo=np.zeros(s), sc_m=sc_m, sc_e=sc_e, rel_err=np.zeros(s),
                zero=mx == 0, flags=flags)
  kind, ip = _kind(p)
  if not f64_mode and p <= 6.0:
    part = np.empty(it_leaf.size)
    flags = np.zeros(it_leaf.size, dtype=np.int8)
    kernel = _POWER_SUM[(kind, ip) if kind == _KIND_INT else kind]
    _parallel(kernel, it_len, part, flags, prep.norm_addrs, prep.sizes, prep.codes,
              it_leaf, it_start, it_len, table, ip, p, zero_mode)
    tot = _combine_sum(it_sys, part, s)
    flags = _combine_flags(it_sys, flags, s)
    rel = decision.sum_rel_err(count, _term_rel_err(p, kind))
    return dict(s_hi=tot, s_lo=np.zeros(s), sc_m=np.full(s, 0.5), sc_e=np.ones(s, np.int32),
                rel_err=rel, zero=tot == 0, flags=flags)
  # Scaled double-double sums: max |x| first, then (|x| / 2**K)**p with max in [0.5, 1).
  part, flags = _extreme(prep, it_leaf, it_start, it_len, False, zero_mode)
  mx = _combine_extreme(it_sys, part, s, False)
  flags = _combine_flags(it_sys, flags, s)
  zero = mx == 0
  divide = p > 512.0  # (1/2)**p would underflow: scale by the max itself (max term = 1)
  if divide:
    inv = np.where(zero, 1.0, mx)
    inv2 = np.ones_like(inv)
    sc_m, sc_e = np.frexp(inv)
    term_err = double_double.DD_POW_REL_ERR + 2.0 ** -400
  else:
    k = np.frexp(np.where(zero, 1.0, mx))[1].astype(np.int64)
    sc_m, sc_e = np.full(s, 0.5), (k + 1).astype(np.int32)  # scale 2**k
    inv = np.ldexp(1.0, np.minimum(-k, 1000).astype(np.int32))
    inv2 = np.ldexp(1.0, np.maximum(-k - 1000, 0).astype(np.int32))
    term_err = 0.0 if kind in (_KIND_ABS, _KIND_SQ) else (
        2.0 ** -100 * p if kind == _KIND_INT else double_double.DD_POW_REL_ERR) + 2.0 ** -400
  hi = np.empty(it_leaf.size)
  lo = np.empty(it_leaf.size)
  _parallel(_scaled_sum_items, it_len, hi, lo, prep.norm_addrs, prep.sizes, prep.codes,
            it_leaf, it_sys, it_start, it_len, table, inv, inv2, divide, kind, ip, p)
  tot_hi, tot_lo = _combine_dd(it_sys, hi, lo, s)
  rel = decision.sum_rel_err(count, term_err, dd=True)
  return dict(s_hi=tot_hi, s_lo=tot_lo, sc_m=sc_m, sc_e=sc_e, rel_err=rel, zero=zero,
              flags=flags)


def _step_stats(prep: _Prepared, zero_mode: bool, f64_mode: bool):
  """Per-system finalize inputs for the step norm (rule 2): the largest vector's squares."""
  s = prep.num_systems
  it_leaf, it_sys, it_start, it_len = prep.items(True)
  m = it_leaf.size
  ks, his, los = np.zeros(m, dtype=np.int64), np.zeros(m), np.zeros(m)
  flags = np.zeros(m, dtype=np.int8)
  _parallel(_step_items, it_len, ks, his, los, flags, prep.norm_addrs, prep.sizes, prep.codes,
            prep.vecs, it_leaf, it_start, it_len, _F16_TABLE, zero_mode, f64_mode)
  k, hi, lo = _combine_step(it_sys, ks, his, los, s)
  flags = _combine_flags(it_sys, flags, s)
  d = float(prep.vecs.max()) if prep.vecs.size else 1.0
  rel = decision.sum_rel_err(np.full(s, d), 0.0, dd=f64_mode)
  return dict(s_hi=hi, s_lo=lo, sc_m=np.full(s, 0.5), sc_e=(k + 1).astype(np.int32),
              rel_err=rel, zero=hi == 0, flags=flags)


def _run(leaves, threshold, segs, row_offsets, num_systems, p, nonfinite, step):
  prep = _Prepared(leaves, segs, row_offsets, num_systems)
  f64_mode = bool(np.any(prep.codes == _F64))
  zero_mode = nonfinite == "zero"
  st = _step_stats(prep, zero_mode, f64_mode) if step else _global_stats(
      prep, p, zero_mode, f64_mode)
  flags = st["flags"]
  nan = (flags & 1) != 0
  inf = ((flags & 2) != 0) & ~nan
  if zero_mode:
    zero_sys = flags != 0
    nan = inf = np.zeros_like(nan)
  else:
    zero_sys = np.zeros(num_systems, dtype=np.bool_)
  c = np.broadcast_to(np.asarray(threshold, dtype=np.float64), (num_systems,))
  c_m, c_e, c_inf = exact.exact_frexp(c)
  sc_m, sc_e = st["sc_m"], st["sc_e"]
  norm_v, action, s_m, s_e, tie = _finalize_nb(
      np.ascontiguousarray(st["s_hi"], np.float64), np.ascontiguousarray(st["s_lo"], np.float64),
      np.ascontiguousarray(sc_m, np.float64), np.ascontiguousarray(sc_e, np.int64),
      np.ascontiguousarray(st["rel_err"], np.float64), np.ascontiguousarray(st["zero"], np.bool_),
      nan, inf, c_m, c_e.astype(np.int64), c_inf.astype(np.bool_), 2.0 if step else float(p),
      f64_mode, _COEFFS_HI, _COEFFS_LO)
  for k in np.flatnonzero(tie).tolist():
    vectors = prep.system_vectors(k) if step else prep.system_values(k)
    if _tie_is_kept(vectors, float(c[k]), p, step):
      action[k] = decision.KEEP
  norm_dtype = np.float64 if f64_mode else np.float32
  norms = decision.compose_norm(norm_v, sc_e, st["zero"], nan, inf, norm_dtype)
  with np.errstate(all="ignore"):
    s_val = np.ldexp(s_m, s_e)
  outs = _apply(prep, action, s_m, s_e, s_val, zero_sys, f64_mode)
  return outs, norms


def _tie_is_kept(values: list[np.ndarray], c: float, p: float, step: bool) -> bool:
  """The exact decision of a near-tie: is the system's norm at or below c (rule 3)?
  ``values`` holds its elements as float64, one array per leaf (vectors along the last axis
  for max-step)."""
  c_k = Fraction(c)
  if step:
    signs = [exact.exact_step_compare(*exact.magnitudes_of(v), c_k)
             for v in values if v.size]
    return max(signs, default=-1) <= 0
  parts = [exact.magnitudes_of(v.ravel()) for v in values]
  m = np.concatenate([pm for pm, _ in parts]) if parts else np.zeros(0, np.int64)
  e = np.concatenate([pe_ for _, pe_ in parts]) if parts else np.zeros(0, np.int64)
  return exact.exact_compare(m, e, p, c_k) <= 0


def _apply(prep: _Prepared, action, s_m, s_e, s_val, zero_sys, precise) -> list[np.ndarray]:
  outs, out_addrs = prep.new_outputs()
  if not outs:
    return outs
  s_e64 = s_e.astype(np.int64)
  unsorted = [i for i, g in enumerate(prep.gathered) if g is not None]
  if len(unsorted) < len(outs):
    it_leaf, it_sys, it_start, it_len = prep.items(False)
    keep = np.ones(it_leaf.size, dtype=np.bool_)
    for i in unsorted:
      keep &= it_leaf != i
    if unsorted:
      it_leaf, it_sys, it_start, it_len = (it_leaf[keep], it_sys[keep], it_start[keep],
                                           it_len[keep])
    _parallel(_apply_items, it_len, prep.addrs, out_addrs, prep.sizes, prep.codes, it_leaf,
              it_sys, it_start, it_len, _F16_TABLE, action, s_m, s_e64, s_val, zero_sys,
              precise)
  for i in unsorted:
    rows = prep.row_segs[i].size
    _parallel(_apply_rows, np.full(rows, prep.rowsizes[i]), prep.addrs[i], out_addrs[i],
              prep.sizes[i], prep.codes[i], prep.rowsizes[i], prep.row_segs[i], _F16_TABLE,
              action, s_m, s_e64, s_val, zero_sys, precise)
  return outs


_SEG_CODE_OF = {np.dtype(np.int64): _SEG_I64, np.dtype(np.int32): _SEG_I32}


def _rows_below_each(ids: np.ndarray, ks: np.ndarray) -> np.ndarray:
  """How many of the sorted ``ids`` are below system k, for each k of the int64 array ``ks``,
  in one search. The keys are given in the ids' own dtype: Python ints or int64 keys against
  int32 ids make NumPy cast the whole id array first (7.8 ms for W3's 5.1M ids, more than
  the kernel's whole pass)."""
  limit = np.iinfo(ids.dtype).max
  below = np.searchsorted(ids, np.minimum(ks, limit).astype(ids.dtype))
  below[ks > limit] = ids.size
  return below


def _rows_below(ids: np.ndarray, k: int) -> int:
  """``_rows_below_each`` for one system ``k``."""
  return int(_rows_below_each(ids, np.array([k], dtype=np.int64))[0])


def _fused_run(leaves: Any, threshold: Any, name: str, segments: Any, num_systems: Any,
               nonfinite: Any, step: bool, sums: np.ndarray | None = None):
  """The fused route for one call (``_fused_systems``), or None when the call does not
  qualify or the kernel hands it back: then the general path runs it from the start and
  raises whatever error applies, so errors are the same on both routes.

  It qualifies when every leaf is a C-contiguous float32 array with rows, every segment a
  contiguous int64 or int32 array of the leaf's rows, and the threshold valid; the kernel
  then checks the ids are sorted and in range as it goes. ``sums`` (float64, one per system)
  receives the per-system sums the decisions were made from.
  """
  if (not isinstance(leaves, (list, tuple)) or not leaves or
      not isinstance(segments, (list, tuple)) or len(segments) != len(leaves) or
      not isinstance(num_systems, (int, np.integer)) or
      isinstance(num_systems, (bool, np.bool_)) or num_systems < 1 or
      nonfinite not in ("propagate", "zero")):
    return None
  for x, seg in zip(leaves, segments):
    if (type(x) is not np.ndarray or x.dtype != np.float32 or x.ndim < 1 or
        not x.flags.c_contiguous or type(seg) is not np.ndarray or seg.ndim != 1 or
        seg.dtype not in _SEG_CODE_OF or not seg.flags.c_contiguous or
        seg.shape[0] != x.shape[0]):
      return None
  try:
    threshold = validation.check_threshold(threshold, name, num_systems)
  except (TypeError, ValueError):
    return None
  leaves, segments = list(leaves), list(segments)
  ns, nl = int(num_systems), len(leaves)
  rows = np.array([x.shape[0] for x in leaves], dtype=np.int64)
  sizes = np.array([x.size for x in leaves], dtype=np.int64)
  shapes = [x.shape for x in leaves]
  rowsizes = np.where(rows > 0, sizes // np.maximum(rows, 1), 0)
  vecs = np.array([max(1, sh[-1]) if len(sh) >= 2 else 1 for sh in shapes], dtype=np.int64)
  addrs = np.array([_data_address(x) for x in leaves], dtype=np.int64)
  seg_addrs = np.array([_address(g) for g in segments], dtype=np.int64)
  seg_codes = np.array([_SEG_CODE_OF[g.dtype] for g in segments], dtype=np.int64)
  c = np.broadcast_to(np.asarray(threshold, dtype=np.float64), (ns,))
  c_m, c_e, c_inf = exact.exact_frexp(c)
  c_e = c_e.astype(np.int64)
  zero_mode = nonfinite == "zero"
  step_rel_err = float(decision.sum_rel_err(float(vecs.max()), 0.0)) if step else 0.0
  outs, out_addrs = _new_outputs(np.full(nl, _F32, dtype=np.int8), sizes, shapes)
  norms = np.empty(ns, dtype=np.float32)
  if sums is None:
    sums = np.empty(ns)
  action = np.empty(ns, dtype=np.int8)
  s_m = np.empty(ns)
  s_e = np.empty(ns, dtype=np.int64)
  tie = np.empty(ns, dtype=np.bool_)
  # Chunks of contiguous systems, cut where the largest leaf's rows split evenly, which the
  # threads claim in turn (a vCPU the host slows takes fewer of them instead of holding up
  # the call); each leaf's rows are cut at the same systems (a binary search, checked by
  # the kernels: if the ids are not sorted, some chunk is not consumed exactly).
  total = int(sizes.sum())
  parts = 1 if total < _PARALLEL_MIN else min(
      ns, _WORKERS * _CHUNKS_PER_WORKER, max(_WORKERS, 4 * total // _CHUNK_MIN_BYTES))
  big = int(np.argmax(sizes))
  cuts = np.empty(parts + 1, dtype=np.int64)
  cuts[0], cuts[parts] = 0, ns
  cuts[1:parts] = segments[big][rows[big] * np.arange(1, parts, dtype=np.int64) // parts]
  np.maximum.accumulate(cuts, out=cuts)  # unchecked ids may go down or out of range
  np.minimum(cuts, ns, out=cuts)
  bounds = np.empty((parts + 1, nl), dtype=np.int64)
  for l, g in enumerate(segments):
    bounds[:, l] = _rows_below_each(g, cuts)
  bounds[0], bounds[parts] = 0, rows  # every row is scanned, ids out of range included
  np.maximum.accumulate(bounds, axis=0, out=bounds)
  status = np.full(parts, FUSED_OK, dtype=np.int64)
  counter = np.zeros(1, dtype=np.int64)

  def work():
    _fused_claimed(counter, cuts, bounds, status, addrs, out_addrs, sizes, rowsizes, vecs,
                   seg_addrs, seg_codes, c_m, c_e, c_inf, step, step_rel_err, zero_mode,
                   _F16_TABLE, sums, norms, action, s_m, s_e, tie)

  futures = [_pool().submit(work) for _ in range(min(_WORKERS, parts) - 1)]
  work()
  for f in futures:
    f.result()
  if np.any(status != FUSED_OK):
    return None
  ties = np.flatnonzero(tie).tolist()
  flat = [(x.reshape(int(n), int(r)), out.reshape(int(n), int(r)))
          for x, out, n, r in zip(leaves, outs, rows, rowsizes)] if ties else []
  for k in ties:
    spans = [(_rows_below(g, k), _rows_below(g, k + 1)) for g in segments]
    values = [x[lo:hi].astype(np.float64) for (x, _), (lo, hi) in zip(flat, spans)]
    if step:
      values = [v.reshape(-1, int(d)) for v, d in zip(values, vecs)]
    if _tie_is_kept(values, float(c[k]), 2.0, step):
      for (x, out), (lo, hi) in zip(flat, spans):
        out[lo:hi] = x[lo:hi]
  return outs, norms


def _is_l2(norm_type: Any) -> bool:
  """Whether ``norm_type`` is a valid p of 2 in any real type (2, 2.0, np.float32(2), ...);
  an invalid one is left to the general route, which raises its error in rule order."""
  try:
    return validation.check_norm_type(norm_type) == 2.0
  except (TypeError, ValueError):
    return False


# ------------------------------------------------------------------------------- public API
def _validate(leaves, segments, num_systems, per_system: bool):
  """Rules 9 and 13 before any work: leaves, then segments (range and sortedness scanned
  once, in parallel). Returns (leaves, segments or None, num_systems, row offsets), the row
  offsets per leaf the system offsets of sorted ids or None for unsorted ones."""
  if isinstance(leaves, (list, tuple)):
    leaves = [np.asarray(x) if isinstance(x, np.generic) else x for x in leaves]
  leaves = validation.check_leaves(leaves, lambda a: isinstance(a, np.ndarray))
  if not per_system:
    return leaves, None, 1, None
  count = validation.check_num_systems(segments, num_systems, len(leaves))
  if count is None:
    return leaves, None, 1, None
  segs, row_offsets = [], []
  for i, (leaf, seg) in enumerate(zip(leaves, segments)):
    seg = np.asarray(seg)
    validation.check_segment(i, leaf.shape, seg.shape, seg.dtype)
    offsets = np.zeros(count + 1, dtype=np.int64)
    if seg.size:
      seg = np.ascontiguousarray(seg)
      lo, hi, offsets = _scan_segments(seg, count)
      validation.check_segment_range(i, lo, hi, count, seg if (lo < 0 or hi >= count) else None)
    segs.append(seg)
    row_offsets.append(offsets)
  return leaves, segs, count, row_offsets


def clip_by_global_norm(leaves: Sequence[np.ndarray], max_norm: Any, *, segments: Any = None,
                        num_systems: Any = None, norm_type: Any = 2.0,
                        nonfinite: str = "propagate") -> tuple[list[np.ndarray], np.ndarray]:
  """Per-system p-norm clipping (numpy in, numpy out); see the module docstring."""
  if _is_l2(norm_type):
    fused = _fused_run(leaves, max_norm, "max_norm", segments, num_systems, nonfinite, False)
    if fused is not None:
      return fused
  leaves, segs, count, row_offsets = _validate(leaves, segments, num_systems, True)
  threshold = validation.check_threshold(max_norm, "max_norm", count)
  p = validation.check_norm_type(norm_type)
  nonfinite = validation.check_nonfinite(nonfinite)
  return _run(leaves, threshold, segs, row_offsets, count, p, nonfinite, False)


def clip_by_max_step(leaves: Sequence[np.ndarray], max_step: Any, *, segments: Any = None,
                     num_systems: Any = None,
                     nonfinite: str = "propagate") -> tuple[list[np.ndarray], np.ndarray]:
  """Per-system max-step clipping: the largest last-axis vector norm is at most max_step."""
  fused = _fused_run(leaves, max_step, "max_step", segments, num_systems, nonfinite, True)
  if fused is not None:
    return fused
  leaves, segs, count, row_offsets = _validate(leaves, segments, num_systems, True)
  threshold = validation.check_threshold(max_step, "max_step", count)
  nonfinite = validation.check_nonfinite(nonfinite)
  return _run(leaves, threshold, segs, row_offsets, count, 2.0, nonfinite, True)


def clip_grad_norm(leaves: Sequence[np.ndarray], max_norm: Any, *, norm_type: Any = 2.0,
                   nonfinite: str = "propagate") -> tuple[list[np.ndarray], np.ndarray]:
  """Global p-norm clipping of all leaves together; returns the leaves and the 0-d norm."""
  leaves, _, _, _ = _validate(leaves, None, None, False)
  threshold = validation.check_threshold(max_norm, "max_norm", None)
  p = validation.check_norm_type(norm_type)
  nonfinite = validation.check_nonfinite(nonfinite)
  outs, norms = _run(leaves, threshold, None, None, 1, p, nonfinite, False)
  return outs, norms.reshape(())


class _Implementation:
  """The registry object (``clipbench.impls.own.numba_kernels:implementation``)."""

  framework = framework
  version = version
  description = description
  capabilities = capabilities
  clip_by_global_norm = staticmethod(clip_by_global_norm)
  clip_by_max_step = staticmethod(clip_by_max_step)
  clip_grad_norm = staticmethod(clip_grad_norm)


implementation = _Implementation()
