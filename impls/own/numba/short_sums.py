"""Sums of squares of short float32 blocks (fewer than ``SHORT`` elements): a fixed tree.

A W5 system's runs are 6-24 positions and 9 cell elements. Summed by the block function's
loop, a run that short costs more than its data: LLVM's vector loop and scalar tail have trip
counts that vary from run to run (mispredicted branches), and its four lanes add up in a chain
of up to a dozen dependent additions. A short block is therefore summed in an order of its
own, the same on every CPU: the squares (float64, exact) of the block padded with +0.0 to
``SHORT`` lanes, added as a balanced tree, lane j + 16 into lane j, then + 8, + 4, + 2 and +
1. A padded lane adds +0.0, which leaves a sum of squares unchanged, so the order is a fixed
function of the block's length and nothing else (SPEC rule 11). One masked load (lanes past
the block are neither read nor fault) and five levels of additions, with no branch.
``power_sums``' float32 block function calls it for every short block, so the general route's
blocks, the fused route's runs and the long runs' blocks all sum a short block this way.

Max-step's short runs of 3-vectors (``short_step_f32``) take the same masked load: each
vector's squares summed in order, as ``max_step.step_block_f32`` sums them, and the largest
sum taken on the bit patterns. A maximum does not depend on the order it is taken in, so this
gives ``step_block_f32``'s value without a loop whose trip count changes from run to run.

A caller that knows a run holds at most ``SHORT // 2`` elements (the fused route's groups,
where every run of a leaf is that short) takes ``half_squares_f32`` and ``half_step_f32``:
the same trees and maxima in half the lanes, the same bits (the full tree's first level
would only add padded +0.0 lanes). The lanes to load come from a shift of the run's length
(``intrinsics.lane_mask``), not from a vector compare of lane numbers.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from clipbench.impls.own.numba.intrinsics import lane_mask

SHORT = 32  # blocks with fewer elements are summed here

_I32 = ir.IntType(32)


def _masked_bits(b, addr, count, width):
  """The ``width`` float32 at ``addr`` as int32 bits: lanes j < count loaded, the others 0
  (never read)."""
  vi32 = ir.VectorType(_I32, width)
  mask = lane_mask(b, count, width)
  ptr = vi32.as_pointer()
  load = cgutils.get_or_insert_function(
      b.module, ir.FunctionType(vi32, [ptr, _I32, mask.type, vi32]),
      f"llvm.masked.load.v{width}i32.p0")
  return b.call(load, [b.inttoptr(addr, ptr), ir.Constant(_I32, 4), mask,
                       ir.Constant(vi32, None)])


def _squares(b, bits):
  """Squares in float64 (exact) of float32 given as a vector of int32 bits."""
  width = bits.type.count
  magnitude = b.and_(bits, ir.Constant(bits.type, [0x7FFFFFFF] * width))
  wide = b.fpext(b.bitcast(magnitude, ir.VectorType(ir.FloatType(), width)),
                 ir.VectorType(ir.DoubleType(), width))
  return b.fmul(wide, wide)


def _masked_squares(b, addr, count, width):
  """Squares in float64 of the ``width`` float32 at ``addr``: lanes j < count loaded, the
  others +0.0 (never read)."""
  return _squares(b, _masked_bits(b, addr, count, width))


def _lanes(b, vec, lanes):
  return b.shuffle_vector(vec, ir.Constant(vec.type, ir.Undefined),
                          ir.Constant(ir.VectorType(_I32, len(lanes)), lanes))


def _of_run(value):
  """An intrinsic ``f(addr, n) -> float64`` for the float32 run of n at ``addr``, whose
  code ``value(builder, addr, n)`` gives."""
  @intrinsic
  def of_run(typingctx, addr, n):
    sig = types.float64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
      return value(builder, args[0], args[1])
    return sig, codegen
  return of_run


def _tree_sum_intrinsic(width):
  """The tree sum of the module docstring over ``width`` lanes, for n <= ``width`` float32
  (n < SHORT when ``width`` is SHORT)."""
  def tree_sum(b, addr, n):
    lanes = _masked_squares(b, addr, n, width)
    w = width
    while w > 1:
      half = w // 2
      lanes = b.fadd(_lanes(b, lanes, list(range(half))), _lanes(b, lanes, list(range(half, w))))
      w = half
    return b.extract_element(lanes, ir.Constant(_I32, 0))
  return _of_run(tree_sum)


# The sum of squares (float64) of the n < SHORT float32 at ``addr``, in the tree of the
# module docstring.
short_squares_f32 = _tree_sum_intrinsic(SHORT)
# The same value for n <= SHORT // 2 with half the lanes: the tree's first level then adds
# only padded +0.0 lanes (x + 0.0 is x for a sum of squares), so the levels after it, which
# are this tree, give the same bits. For callers that know every run is that short.
half_squares_f32 = _tree_sum_intrinsic(SHORT // 2)


def _step_max_intrinsic(width):
  """``max_step.step_block_f32(xs, 3)`` for n <= ``width`` float32 (whole 3-vectors; n < SHORT
  when ``width`` is SHORT) in one masked load of ``width`` lanes. The vectors' x, y and z are
  picked out of the loaded bits (one permute each, in 32-bit lanes) before their squares are
  taken, each a power-of-two vector: lanes past the last vector pick the load's last lane,
  which is never loaded (n < ``width``), so they add +0.0 squares, which leave the maximum
  alone."""
  vectors = width // 3
  lanes = 1 << (vectors - 1).bit_length()
  pad = width - 1

  def step_max(b, addr, n):
    bits = _masked_bits(b, addr, n, width)
    x0, x1, x2 = (
        _squares(b, _lanes(b, bits, [3 * v + c if v < vectors else pad for v in range(lanes)]))
        for c in range(3))
    sums = b.bitcast(b.fadd(b.fadd(x0, x1), x2), ir.VectorType(ir.IntType(64), lanes))
    umax = cgutils.get_or_insert_function(
        b.module, ir.FunctionType(ir.IntType(64), [sums.type]),
        f"llvm.vector.reduce.umax.v{lanes}i64")
    best = b.call(umax, [sums])
    finite = b.icmp_unsigned("<", best, ir.Constant(ir.IntType(64), 0x7FF0000000000000))
    return b.select(finite, b.bitcast(best, ir.DoubleType()),
                    ir.Constant(ir.DoubleType(), float("inf")))
  return _of_run(step_max)


# ``max_step.step_block_f32(xs, 3)`` for the n < SHORT float32 at ``addr`` (whole 3-vectors):
# the largest vector sum of squares ``(x0 * x0 + x1 * x1) + x2 * x2``, inf when some element is
# not finite.
short_step_f32 = _step_max_intrinsic(SHORT)
# The same for n <= SHORT // 2 (five vectors at most) in half the lanes.
half_step_f32 = _step_max_intrinsic(SHORT // 2)
