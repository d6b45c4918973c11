"""Pass 1 of the norm for half and single precision leaves: float64 sums of |x|**p, p <= 6.

Every ``|x|**p`` with ``p <= 6`` of a float16/bfloat16/float32 value is formed in float64
(exact for p = 1, 2: a float32 square has 48 bits) and summed in float64: no such value can
overflow or underflow there (``(3.4e38)**6 < 1e308``, ``(1.4e-45)**6 > 2.2e-308``), so no
scaling pass is needed and one read suffices.

A block is summed as ``SUB_BLOCK``-element sub-blocks (counted from the block's start) whose
sums are added in order. A sub-block's sum carries the ``reassoc`` fast-math flag and nothing
else: LLVM may then split it into vector lanes (element j -> lane j mod width, lanes added by a
fixed tree at the end), which is what makes the pass memory-bound. The order is a fixed
function of the compiled code and the block length, never of the data's address (LLVM does not
peel loops for alignment on x86; a test pins the bits at every offset), the thread, or other
systems (SPEC rule 11). Squares of <= 32-bit floats are exact in float64, so only that order
matters. Why sub-blocks: a sharded call (:mod:`.sharded`) must reproduce the sum of a block
whose elements lie on two ranks; with sub-blocks, each rank sums the sub-blocks it holds whole
and only the one sub-block across the boundary travels as elements (at most 1 KB of float32),
where a block of one vector reduction would send all of a rank's part of it (up to 32 KB, per
leaf and per boundary). The extra fold costs one horizontal add per sub-block (no cost seen at
256 elements against 512 or 8,192: ``docs/sharding.md``).
A float32 block of squares shorter than ``short_sums.SHORT`` is summed in that module's fixed
tree instead (no branches for a tiny system's runs; the fused route calls it directly).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit

from clipbench.impls.own import decision
from clipbench.impls.own.numba.decode import BF16, F32, block_flags, load, views
from clipbench.impls.own.numba.intrinsics import JIT, f32, ptr_u16, ptr_u32
from clipbench.impls.own.numba.layout import SUB_BLOCK
from clipbench.impls.own.numba.records import Split
from clipbench.impls.own.numba.short_sums import SHORT, short_squares_f32

ABS, SQ, INT, POW = 0, 1, 2, 3  # the kinds of term: |x|, x * x, |x|**n (n <= 64), |x|**p
_REASSOC = dict(nogil=True, cache=True, fastmath={"reassoc"})


def term_of(p: float) -> tuple[int, int]:
  """(kind, integer power) of the term |x|**p."""
  if p == 1.0:
    return ABS, 1
  if p == 2.0:
    return SQ, 2
  if float(p).is_integer() and p <= 64:
    return INT, int(p)
  return POW, 0


def term_rel_err(p: float, kind: int) -> float:
  """Relative error bound of one float64 term |x|**p of a <= 32-bit float."""
  if kind in (ABS, SQ):
    return 0.0
  if kind == INT:
    return (p - 1.0) * 1.01 * decision.U64  # the first product is exact; p - 2 roundings
  return decision.POW_REL_ERR


def _make_power_sum(kind: int, int_power: int = 0):
  """The blocks kernel summing |x|**p for one term kind (and integer power), and its float32
  block function: compile-time constants, so the block loops carry no branches."""

  @njit(inline="always", **JIT)
  def term(a, ip, p):
    if kind == SQ:
      return a * a
    if kind == ABS:
      return a
    if kind == INT:
      t = a * a
      for _ in range(int_power - 2):
        t = t * a
      return t
    return a ** p

  @njit(**_REASSOC)
  def run_f32(xs, ip, p):
    s = 0.0
    for j in range(xs.size):
      s += term(abs(np.float64(f32(xs[j]))), ip, p)
    return s

  @njit(**_REASSOC)
  def run_bf16(xs, ip, p):
    s = 0.0
    for j in range(xs.size):
      s += term(abs(np.float64(f32(np.uint32(xs[j]) << np.uint32(16)))), ip, p)
    return s

  @njit(**_REASSOC)
  def run_f16(xs, table, ip, p):
    s = 0.0
    for j in range(xs.size):
      s += term(abs(np.float64(table[xs[j]])), ip, p)
    return s

  # The folds below carry no fast-math flag: sub-block sums are added one after another.
  @njit(**JIT)
  def block_f32(xs, ip, p):
    if kind == SQ and xs.size < SHORT:
      return short_squares_f32(np.int64(xs.ctypes.data), np.int64(xs.size))
    s = 0.0
    for b in range(0, xs.size, SUB_BLOCK):
      s += run_f32(xs[b:b + SUB_BLOCK], ip, p)
    return s

  @njit(**JIT)
  def block_bf16(xs, ip, p):
    s = 0.0
    for b in range(0, xs.size, SUB_BLOCK):
      s += run_bf16(xs[b:b + SUB_BLOCK], ip, p)
    return s

  @njit(**JIT)
  def block_f16(xs, table, ip, p):
    s = 0.0
    for b in range(0, xs.size, SUB_BLOCK):
      s += run_f16(xs[b:b + SUB_BLOCK], table, ip, p)
    return s

  @njit(**JIT)
  def run_skipping(leaves, leaf, start, n, ip, p):
    """Elements [start, start + n) of a leaf, non-finite ones counted as 0 (in order)."""
    code = leaves.codes[leaf]
    a16, a32, a64 = views(leaves.addrs[leaf], leaves.sizes[leaf], code)
    s = 0.0
    for j in range(n):
      v = load(code, a16, a32, a64, start + j, leaves.table)
      if math.isfinite(v):
        s += term(abs(v), ip, p)
    return s

  @njit(**JIT)
  def block_skipping(leaves, leaf, start, n, ip, p):
    """Zero mode, a block holding non-finite elements: they count as 0; each sub-block summed
    in order, the sub-block sums added in order (as the other sums fold)."""
    s = 0.0
    for b in range(0, n, SUB_BLOCK):
      s += run_skipping(leaves, leaf, start + b, min(SUB_BLOCK, n - b), ip, p)
    return s

  @njit(**JIT)
  def sum_blocks(i0, i1, part, flags, leaves, blocks, power, zero_mode):
    """Blocks [i0, i1): part = the block's sum of terms, flags its non-finite flags."""
    ip, p, table = power.ip, power.p, leaves.table
    for it in range(i0, i1):
      leaf = blocks.leaf[it]
      code = leaves.codes[leaf]
      addr = leaves.addrs[leaf]
      a16, a32, a64 = views(addr, leaves.sizes[leaf], code)
      start, n = blocks.start[it], blocks.length[it]
      # Blocks as arrays of their own (from the address), not slices: measurably faster.
      if code == F32:
        total = block_f32(numba.carray(ptr_u32(addr + 4 * start), n), ip, p)
      elif code == BF16:
        total = block_bf16(numba.carray(ptr_u16(addr + 2 * start), n), ip, p)
      else:
        total = block_f16(numba.carray(ptr_u16(addr + 2 * start), n), table, ip, p)
      f = 0
      if not math.isfinite(total):
        # Only non-finite elements make a sum of p <= 6 powers of <= 32-bit floats non-finite.
        f = block_flags(code, a16, a32, a64, table, start, n)
        if zero_mode:
          total = block_skipping(leaves, leaf, start, n, ip, p)
      part[it] = total
      flags[it] = f

  @njit(inline="always", **JIT)
  def sub_block_sum(leaves, leaf, start, n, ip, p):
    """(sum, flags) of a sub-block as the block functions sum it."""
    code = leaves.codes[leaf]
    addr = leaves.addrs[leaf]
    if code == F32:
      total = run_f32(numba.carray(ptr_u32(addr + 4 * start), n), ip, p)
    elif code == BF16:
      total = run_bf16(numba.carray(ptr_u16(addr + 2 * start), n), ip, p)
    else:
      total = run_f16(numba.carray(ptr_u16(addr + 2 * start), n), leaves.table, ip, p)
    f = 0
    if not math.isfinite(total):
      a16, a32, a64 = views(addr, leaves.sizes[leaf], code)
      f = block_flags(code, a16, a32, a64, leaves.table, start, n)
    return total, f

  @njit(**JIT)
  def sum_sub_blocks(i0, i1, part, flags, leaves, blocks, power, zero_mode):
    """Sub-blocks [i0, i1) (each at most ``SUB_BLOCK`` elements of one block, on the block's
    sub-block grid): the sums the block functions fold, whatever the length (a short block's
    tree is not a fold of sub-blocks: such a block is never split), and their non-finite
    flags."""
    for it in range(i0, i1):
      part[it], flags[it] = sub_block_sum(leaves, blocks.leaf[it], blocks.start[it],
                                          blocks.length[it], power.ip, power.p)

  @njit(**JIT)
  def sum_sub_blocks_skipping(i0, i1, part, flags, skipping, leaves, blocks, power, zero_mode):
    """``sum_sub_blocks``, and each sub-block's sum with non-finite elements counted as 0 (what
    a zero-mode block holding non-finite elements folds instead)."""
    for it in range(i0, i1):
      leaf, start, n = blocks.leaf[it], blocks.start[it], blocks.length[it]
      part[it], flags[it] = sub_block_sum(leaves, leaf, start, n, power.ip, power.p)
      skipping[it] = run_skipping(leaves, leaf, start, n, power.ip, power.p)

  return sum_blocks, block_f32, sum_sub_blocks, sum_sub_blocks_skipping


_KERNELS = {kind: _make_power_sum(kind) for kind in (ABS, SQ, POW)}
_KERNELS.update({(INT, k): _make_power_sum(INT, k) for k in range(3, 7)})
# The fused route sums squares with the very block function the blocks kernel calls.
SQUARES_F32 = _KERNELS[SQ][1]


def power_sum_kernel(kind: int, ip: int):
  """The blocks kernel (``sum_blocks``) for the term of ``term_of(p)``."""
  return _KERNELS[(kind, ip) if kind == INT else kind][0]


@njit(**JIT)
def fold_sub_sums(block_of, sums, flags, part, part_flags):
  """What the block functions do with sub-block sums: added in order from 0.0 (no fast-math:
  one rounding per addition, in this order); the flags of a block whose sum is not finite."""
  for b in np.unique(block_of):
    part[b] = 0.0
    part_flags[b] = 0
  for it in range(block_of.size):
    b = block_of[it]
    part[b] += sums[it]
    part_flags[b] |= flags[it]
  for b in np.unique(block_of):
    if math.isfinite(part[b]):
      part_flags[b] = 0


@njit(**JIT)
def fold_sub_sums_skipping(block_of, sums, flags, skipping, part, part_flags):
  """``fold_sub_sums``; a block whose sum is not finite then takes the in-order sum of its
  sub-blocks' sums without their non-finite elements (zero mode's ``block_skipping``)."""
  fold_sub_sums(block_of, sums, flags, part, part_flags)
  bad = np.zeros(part.size, dtype=np.bool_)
  for b in np.unique(block_of):
    if not math.isfinite(part[b]):
      bad[b] = True
      part[b] = 0.0
  for it in range(block_of.size):
    b = block_of[it]
    if bad[b]:
      part[b] += skipping[it]


def sub_block_split(kind: int, ip: int, zero_mode: bool = False) -> Split:
  """The sub-blocks kernel for the term of ``term_of(p)`` and its fold: what a rank computes
  of a block it holds only part of (:mod:`.sharded`)."""
  kernels = _KERNELS[(kind, ip) if kind == INT else kind]
  if zero_mode:
    return Split(kernels[3], fold_sub_sums_skipping, (np.float64, np.int8, np.float64))
  return Split(kernels[2], fold_sub_sums, (np.float64, np.int8))
