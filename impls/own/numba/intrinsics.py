"""LLVM intrinsics the kernels need and numba does not expose.

Raw pointers from addresses (leaves are read in place through their data pointers), bit
casts between floats and their integer patterns (comparisons and ulp steps on the bits), a
fused multiply-add for one float type (exact product errors), the x86 store fence that
streamed stores need, atomic fetch-and-adds and acquire loads with a spin-wait pause (threads
claiming chunks of work, and waiting for each other without sleeping), software prefetches
(loops whose loads and stores the hardware prefetchers do not run far enough ahead of) and
the mask of a vector's first lanes (masked loads and stores of short runs).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

# Options of every compiled kernel: serial code that releases the GIL (the thread pool runs
# it), cached on disk per argument types, IEEE semantics (no fast-math).
JIT = dict(nogil=True, cache=True, fastmath=False)


def pointer_intrinsic(elem):
  """An intrinsic ``as_pointer(addr)``: the int64 address as a pointer to ``elem``."""
  @intrinsic
  def as_pointer(typingctx, addr):
    sig = types.CPointer(elem)(types.int64)

    def codegen(context, builder, signature, args):
      return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
    return sig, codegen
  return as_pointer


ptr_u16 = pointer_intrinsic(types.uint16)
ptr_u32 = pointer_intrinsic(types.uint32)
ptr_u64 = pointer_intrinsic(types.uint64)
ptr_i32 = pointer_intrinsic(types.int32)
ptr_i64 = pointer_intrinsic(types.int64)


def _bitcast_intrinsic(from_type, to_type, ir_type):
  """An intrinsic reinterpreting a ``from_type`` value's bits as ``to_type``."""
  @intrinsic
  def bitcast(typingctx, value):
    sig = to_type(from_type)

    def codegen(context, builder, signature, args):
      return builder.bitcast(args[0], ir_type)
    return sig, codegen
  return bitcast


f32 = _bitcast_intrinsic(types.uint32, types.float32, ir.FloatType())
u32 = _bitcast_intrinsic(types.float32, types.uint32, ir.IntType(32))
f64 = _bitcast_intrinsic(types.uint64, types.float64, ir.DoubleType())
u64 = _bitcast_intrinsic(types.float64, types.uint64, ir.IntType(64))


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


fma = _fma_intrinsic(types.float64, ir.DoubleType())
fma32 = _fma_intrinsic(types.float32, ir.FloatType())


def splat(value, ty):
  """A constant vector of type ``ty`` with ``value`` in every lane."""
  return ir.Constant(ty, [value] * ty.count)


def broadcast(builder, scalar, ty):
  """A vector of type ``ty`` with the SSA scalar in every lane."""
  undef = ir.Constant(ty, ir.Undefined)
  lane0 = builder.insert_element(undef, scalar, ir.Constant(ir.IntType(32), 0))
  return builder.shuffle_vector(lane0, undef, splat(0, ir.VectorType(ir.IntType(32), ty.count)))


def lane_mask(b, count, width):
  """The <width x i1> mask of lanes j < count, for 0 <= count <= width <= 32: the low
  ``count`` bits of an integer (one shift, where a vector compare of lane numbers would take
  a broadcast and one compare per 16 lanes)."""
  i64 = ir.IntType(64)
  bits = b.sub(b.shl(ir.Constant(i64, 1), count), ir.Constant(i64, 1))
  return b.bitcast(b.trunc(bits, ir.IntType(width)), ir.VectorType(ir.IntType(1), width))


def _x86_instruction(name: str):
  """An intrinsic of no arguments and no result: the x86 instruction LLVM calls ``name``."""
  @intrinsic
  def instruction(typingctx):
    sig = types.void()

    def codegen(context, builder, signature, args):
      fn = builder.module.declare_intrinsic(name, [], ir.FunctionType(ir.VoidType(), []))
      builder.call(fn, [])
      return context.get_dummy_value()
    return sig, codegen
  return instruction


# sfence: streaming stores before it are globally visible before any store after it. One per
# kernel call, never per run: a fence drains the write-combining buffers.
store_fence = _x86_instruction("llvm.x86.sse.sfence")
# pause: the hint a spin-wait loop gives the core between two reads.
spin_pause = _x86_instruction("llvm.x86.sse2.pause")


def _prefetch_intrinsic(write: int):
  """A prefetch of the cache line at an address into all cache levels, for a read (``write``
  0: prefetcht0) or a write (1: prefetchw). A prefetch never faults: an address past the end
  of an array, or not mapped at all, is allowed and ignored."""

  @intrinsic
  def prefetch(typingctx, addr):
    sig = types.void(types.int64)

    def codegen(context, builder, signature, args):
      i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
      fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
          ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0")
      # Operands: read or write, locality 3 (keep in every level), data cache.
      builder.call(fn, [builder.inttoptr(args[0], i8p), ir.Constant(i32, write),
                        ir.Constant(i32, 3), ir.Constant(i32, 1)])
      return context.get_dummy_value()
    return sig, codegen
  return prefetch


prefetch_read = _prefetch_intrinsic(0)
prefetch_write = _prefetch_intrinsic(1)


@intrinsic
def add_one(typingctx, counter, i):
  """An atomic fetch-and-add of 1 on ``counter[i]`` (an int64 array): the value before it.
  Threads claiming work from one counter each get a different number."""
  sig = types.int64(counter, types.int64)

  def codegen(context, builder, signature, args):
    array = context.make_array(signature.args[0])(context, builder, args[0])
    slot = builder.gep(array.data, [args[1]])
    return builder.atomic_rmw("add", slot, ir.Constant(ir.IntType(64), 1), "seq_cst")
  return sig, codegen


@intrinsic
def load_acquire(typingctx, counter, i):
  """``counter[i]`` (an int64 array) loaded atomically with acquire ordering: loads after it
  see every write another thread made before its atomic update of that value, and a loop
  reading it sees each new value (a plain load may be hoisted out of the loop)."""
  sig = types.int64(counter, types.int64)

  def codegen(context, builder, signature, args):
    array = context.make_array(signature.args[0])(context, builder, args[0])
    return builder.load_atomic(builder.gep(array.data, [args[1]]), "acquire", 8)
  return sig, codegen
