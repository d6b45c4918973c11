"""The layout of a call: leaf shapes and rows, and every system's runs cut into blocks.

A system's rows in one leaf form a run (its rows in row order; unsorted segments are
gathered into that order first). Each run is cut into fixed blocks of ``BLOCK`` elements
counted from the run's start; a system's block sums are added in leaf order, then block
order. Nothing depends on other systems, on where the run sits in memory, or on the thread
that ran it (SPEC rule 11); the sorted layout (row offsets from the segment scan) and the
unsorted one (a gathered copy) give the same blocks, so the same bits.

``leaf_layout`` is the one description of the leaves both routes start from: the fused route
takes it as it is, the general route builds :class:`Prepared` on it.
"""

from __future__ import annotations

import math

from typing import NamedTuple

import numpy as np
from numba import njit

from clipbench.impls.own.numba.buffers import address, new_outputs
from clipbench.impls.own.numba.decode import CODE_OF, F16_TABLE, ITEMSIZE
from clipbench.impls.own.numba.intrinsics import JIT
from clipbench.impls.own.numba.records import Blocks, Leaves
from clipbench.impls.own.numba.segments import CheckedSegments, counting_order

BLOCK = 8192  # elements per block of a run (the unit of parallel work and of summation order)
# Elements per sub-block: the power-sum block functions add a block's sub-block sums in order
# (:mod:`.power_sums`), the unit a sharded call splits a block at (:mod:`.sharded`).
SUB_BLOCK = 256
# Leaves up to this many elements are packed (one C-level concatenate per dtype) instead of
# being read through their own pointers: per-leaf Python work dominates many small leaves.
_PACK_MAX = 1 << 14
# ... when there are more than this many of them: packing copies them (a fresh buffer, page
# faults included), which costs more than a few hundred pointer lookups (W1: 61 small leaves).
_PACK_MIN_LEAVES = 256


class LeafLayout(NamedTuple):
  """Shapes and sizes of the leaves, one entry per leaf."""
  shapes: list[tuple[int, ...]]
  codes: np.ndarray  # int8 dtype codes
  sizes: np.ndarray  # int64 elements
  rows: np.ndarray  # int64 rows (1 for a 0-d leaf)
  rowsizes: np.ndarray  # int64 elements per row
  vecs: np.ndarray  # int64 length of the last axis of a leaf of 2 or more axes, else 1


def leaf_layout(leaves: list[np.ndarray]) -> LeafLayout:
  """The :class:`LeafLayout` of validated leaves (arrays, or a ``buffers.LeavesAt``)."""
  if hasattr(leaves, "addresses"):
    return leaf_layout_of(list(leaves.shapes), list(leaves.dtypes))
  return leaf_layout_of([x.shape for x in leaves], [x.dtype for x in leaves])


def leaf_layout_of(shapes: list[tuple[int, ...]], dtypes: list[np.dtype]) -> LeafLayout:
  """The :class:`LeafLayout` of leaves of these shapes and dtypes."""
  sizes = np.array([math.prod(s) for s in shapes], dtype=np.int64)
  rows = np.array([s[0] if s else 1 for s in shapes], dtype=np.int64)
  vecs = np.array([s[-1] if len(s) >= 2 else 1 for s in shapes], dtype=np.int64)
  return LeafLayout(shapes=shapes, codes=np.array([CODE_OF[d] for d in dtypes], dtype=np.int8),
                    sizes=sizes, rows=rows,
                    rowsizes=np.where(rows > 0, sizes // np.maximum(rows, 1), 0),
                    vecs=np.maximum(vecs, 1))


@njit(**JIT)
def build_blocks(offsets, rowsizes, vecs, block, by_vectors):
  """(leaf, system, start, length) of every block of every non-empty run, in (leaf, system,
  block) order; ``offsets[l]`` are the row offsets of the systems in leaf l. By vectors, a
  block holds whole vectors (max-step)."""
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


class Prepared:
  """The general route's view of a call: pointers, codes, sizes, and the runs of every system.

  Small leaves are packed per dtype, large ones read in place; leaves with unsorted ids are
  gathered into system order (a copy) for the norm passes only. Outputs live in one new
  buffer per dtype; each output leaf is a view of it.
  """

  def __init__(self, leaves: list[np.ndarray], layout: LeafLayout, segments: CheckedSegments):
    segs, num_systems, row_offsets = segments
    self.leaves = leaves
    self.layout = layout
    self._blocks: dict[bool, Blocks] = {}
    nl = len(leaves)
    self.num_systems = num_systems
    codes, sizes = layout.codes, layout.sizes
    # Input addresses: small leaves packed per dtype, large ones read in place. Leaves known
    # by address (``buffers.LeavesAt``) are all read in place: packing saves the per-leaf
    # Python work of finding an address, which they have already done.
    addressed = getattr(leaves, "addresses", None)  # C-contiguous by construction
    addrs = np.zeros(nl, dtype=np.int64)
    self._keep_alive = []
    small = (sizes <= _PACK_MAX) & (addressed is None)
    for code in range(4):
      idx = np.flatnonzero((codes == code) & small)
      if idx.size > _PACK_MIN_LEAVES:
        packed = np.concatenate([leaves[i] for i in idx.tolist()], axis=None)
        self._keep_alive.append(packed)
        starts = np.concatenate([[0], np.cumsum(sizes[idx])[:-1]])
        addrs[idx] = address(packed) + starts * ITEMSIZE[code]
      else:
        small[idx] = False
    if addressed is not None:
      addrs[~small] = addressed[~small]
    for i in np.flatnonzero(~small).tolist() if addressed is None else ():
      if not leaves[i].flags.c_contiguous:
        # np.ascontiguousarray would turn a 0-d leaf into shape (1,).
        self.leaves[i] = leaves[i] = leaves[i].copy(order="C")
      addrs[i] = address(leaves[i])
    # Unsorted segments: rows gathered into system order (a copy) for the norm pass only.
    self.gathered: list[np.ndarray | None] = [None] * nl
    self.row_segs: list[np.ndarray | None] = [None] * nl
    offsets = np.zeros((nl, num_systems + 1), dtype=np.int64)
    if segs is None:
      offsets[:, 1:] = layout.rows[:, None]
    else:
      for i, x in enumerate(self.leaves):
        seg = segs[i]
        if seg.size == 0:
          continue
        if row_offsets[i] is not None:
          offsets[i] = row_offsets[i]
        else:
          order, offsets[i] = counting_order(seg, num_systems)
          self.gathered[i] = np.ascontiguousarray(x[order])
          self.row_segs[i] = seg
    self.offsets = offsets
    norm_addrs = addrs.copy()
    for i, g in enumerate(self.gathered):
      if g is not None:
        norm_addrs[i] = address(g)
    self.inputs = Leaves(addrs, sizes, codes, layout.rowsizes, layout.vecs, F16_TABLE)
    """The leaves the apply pass reads (in place)."""
    self.norm_inputs = self.inputs._replace(addrs=norm_addrs)
    """The leaves the norm passes read (unsorted ones gathered into system order)."""

  def blocks(self, by_vectors: bool) -> Blocks:
    """The blocks of every run (:func:`build_blocks`), computed once per layout."""
    if by_vectors not in self._blocks:
      if not self.leaves:
        z = np.zeros(0, dtype=np.int64)
        self._blocks[by_vectors] = Blocks(z.astype(np.int32), z.astype(np.int32), z, z)
      else:
        self._blocks[by_vectors] = Blocks(*build_blocks(
            self.offsets, self.layout.rowsizes, self.layout.vecs, BLOCK, by_vectors))
    return self._blocks[by_vectors]

  def new_outputs(self) -> tuple[list[np.ndarray], np.ndarray]:
    """Fresh output leaves and their data addresses."""
    return new_outputs(self.layout.codes, self.layout.sizes, self.layout.shapes)

  def system_values(self, k: int) -> list[np.ndarray]:
    """The elements of system k, one float64 array per leaf (for the exact fallback)."""
    out = []
    for i, x in enumerate(self.leaves):
      src = self.gathered[i] if self.gathered[i] is not None else x
      lo, hi = self.offsets[i, k], self.offsets[i, k + 1]
      flat = src.reshape(int(self.layout.rows[i]), int(self.layout.rowsizes[i]))
      out.append(flat[lo:hi].astype(np.float64))
    return out

  def system_vectors(self, k: int) -> list[np.ndarray]:
    """``system_values`` with each leaf's elements as vectors along its last axis."""
    return [block.reshape(-1, int(d)) for block, d in zip(self.system_values(k),
                                                          self.layout.vecs)]
