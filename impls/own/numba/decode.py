"""Element decoding: the leaf dtypes as codes, and any element as an exact float64.

Kernels read leaves through raw addresses; a leaf is seen through three views (uint16,
uint32, uint64 bits), of which only the one of its dtype is non-empty, so one compiled loop
serves every dtype. Loops index zero-based slices so that numba can drop its negative-index
checks (they would otherwise block vectorisation).
"""

from __future__ import annotations

import math

import ml_dtypes
import numba
import numpy as np
from numba import njit

from clipbench.impls.own.numba.intrinsics import JIT, f32, f64, ptr_u16, ptr_u32, ptr_u64

F16, BF16, F32, F64 = 0, 1, 2, 3
DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32),
          np.dtype(np.float64))
CODE_OF = {dt: code for code, dt in enumerate(DTYPES)}
ITEMSIZE = np.array([2, 2, 4, 8], dtype=np.int64)
# Exact float16 -> float32 table (64K entries): decoding by lookup needs no float16 arithmetic.
F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(
    np.float32)


@njit(inline="always", **JIT)
def views(addr, size, code):
  """The uint16, uint32 and uint64 views of a leaf: only the one of its dtype is non-empty."""
  n16 = size if (code == F16 or code == BF16) else 0
  n32 = size if code == F32 else 0
  n64 = size if code == F64 else 0
  a16 = numba.carray(ptr_u16(addr if n16 else 0), n16)
  a32 = numba.carray(ptr_u32(addr if n32 else 0), n32)
  a64 = numba.carray(ptr_u64(addr if n64 else 0), n64)
  return a16, a32, a64


@njit(inline="always", **JIT)
def load(code, a16, a32, a64, i, table):
  """Element i of a leaf as an exact float64 (only the view of its dtype is non-empty)."""
  if code == F32:
    return np.float64(f32(a32[i]))
  if code == F64:
    return f64(a64[i])
  if code == BF16:
    return np.float64(f32(np.uint32(a16[i]) << np.uint32(16)))
  return np.float64(table[a16[i]])


@njit(inline="always", **JIT)
def bits_value(code, bits, table):
  """The float64 value of a magnitude's bit pattern in a leaf's dtype."""
  if code == F32:
    return np.float64(f32(np.uint32(bits)))
  if code == F64:
    return f64(bits)
  if code == BF16:
    return np.float64(f32(np.uint32(bits) << np.uint32(16)))
  return np.float64(table[np.uint16(bits)])


@njit(inline="always", **JIT)
def nonfinite_bits(code):
  """The smallest magnitude bit pattern of a non-finite value (inf) in a leaf's dtype."""
  if code == F32:
    return np.uint64(0x7F800000)
  if code == F64:
    return np.uint64(0x7FF0000000000000)
  if code == BF16:
    return np.uint64(0x7F80)
  return np.uint64(0x7C00)


@njit(inline="always", **JIT)
def block_flags(code, a16, a32, a64, table, start, n):
  """Non-finite flags of elements [start, start + n): 1 for a NaN, 2 for an infinity."""
  f = 0
  for j in range(n):
    v = load(code, a16, a32, a64, start + j, table)
    if math.isnan(v):
      f |= 1
    elif math.isinf(v):
      f |= 2
  return f


@njit(inline="always", **JIT)
def block_views(leaves, blocks, it):
  """Block ``it`` of a :class:`~clipbench.impls.own.numba.records.Blocks` in its ``Leaves``:
  (dtype code, the leaf's three views, start, length)."""
  leaf = blocks.leaf[it]
  code = leaves.codes[leaf]
  a16, a32, a64 = views(leaves.addrs[leaf], leaves.sizes[leaf], code)
  return code, a16, a32, a64, blocks.start[it], blocks.length[it]
