"""Which rank reads which block: the unsharded call's blocks laid over the shards.

A sharded call (:mod:`.sharded`) must reach the unsharded call's per-block results in its
fold order. This module says, from the shard layout alone (how many rows of each system each
rank holds, in which rank order, and which stretch of each row where ranks split the columns),
where every block of the whole leaves lies: wholly in one rank's rows, in every rank's (a
replicated leaf), or across ranks, in pieces; one level down,
the same for the ``SUB_BLOCK``-element sub-blocks of the blocks across ranks. Every rank
computes the same plan, so each knows what every other sends, and
:func:`exchange_bytes` says how many bytes that is before anything is read.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from clipbench.impls.own.numba.decode import ITEMSIZE
from clipbench.impls.own.numba.intrinsics import JIT
from clipbench.impls.own.numba.layout import BLOCK, SUB_BLOCK, LeafLayout
from clipbench.impls.own.numba.records import Blocks
from clipbench.impls.own.numba.short_sums import SHORT

# Owners of a block besides a rank index: every rank (a replicated leaf), pieces of several.
EVERY_RANK, STRADDLES = -2, -1


class ShardLayout(NamedTuple):
  """How the rows of the leaves are split among the ranks (the same on every rank)."""

  counts: np.ndarray  # int64 (ranks, leaves, systems): rows of each system each rank holds
  order: np.ndarray  # int64 (leaves, ranks): rank indices in the order of their rows
  replicated: np.ndarray  # bool (leaves,): every rank holds the whole leaf
  # int64 (leaves, ranks, 2): the elements [start, stop) of each row each rank holds (leaves
  # split by columns, tensor parallelism); None: whole rows. Ranks of one leaf holding the
  # same rows are next to each other in ``order``, by column; a rank whose piece is a copy
  # of another's counts no rows.
  columns: np.ndarray | None = None


class Units(NamedTuple):
  """Units of reduction (the blocks, or sub-blocks of blocks split across ranks) in fold
  order, and who reads each."""

  units: Blocks  # leaf, system, start within the run or block (unused), length
  owner: np.ndarray  # int64: the rank that holds it whole, EVERY_RANK or STRADDLES
  owner_start: np.ndarray  # int64: where it starts in its owner's (norm-order) leaf
  # Pieces of the straddling units, in unit order then row order:
  piece_unit: np.ndarray  # int64 index into units
  piece_rank: np.ndarray  # int64
  piece_start: np.ndarray  # int64 element in that rank's (norm-order) leaf
  piece_length: np.ndarray  # int64
  piece_at: np.ndarray  # int64 element offset within the unit

  def owned_by(self, rank: int) -> np.ndarray:
    return np.flatnonzero(self.owner == rank)

  def pieces_of(self, rank: int) -> np.ndarray:
    return np.flatnonzero(self.piece_rank == rank)


@njit(**JIT)
def _walk_blocks(counts, order, replicated, columns, rowsizes, vecs, block, by_vectors, fill,
                 out):
  """Counts (``fill`` False) or writes (into ``out``) the blocks and straddling pieces of every
  run, in ``layout.build_blocks``'s order; returns (blocks, pieces)."""
  ranks, nl, ns = counts.shape
  b_leaf, b_sys, b_start, b_len, owner, owner_start, p_block, p_rank, p_start, p_len, p_at = out
  nb = 0
  npieces = 0
  # Row offset of each system within each rank's leaf (systems in order, as Prepared lays
  # them out: sorted ids as they are, unsorted ones gathered).
  first = np.zeros((ranks, nl, ns), dtype=np.int64)
  most = 0
  for g in range(ranks):
    for l in range(nl):
      acc = 0
      for k in range(ns):
        first[g, l, k] = acc
        acc += counts[g, l, k]
  for l in range(nl):
    by_columns = False
    for g in range(ranks):
      by_columns |= columns[l, g, 1] - columns[l, g, 0] != rowsizes[l]
    if by_columns:  # a fragment a row and rank; else one a rank
      for k in range(ns):
        acc = 0
        for g in range(ranks):
          acc += counts[g, l, k]
        most = max(most, acc)
  # A run's fragments: stretches of it that one rank holds contiguously (a rank holding whole
  # rows: all its rows of the system; a rank holding some columns: one per row).
  begin = np.zeros(most + ranks, dtype=np.int64)
  end = np.zeros(most + ranks, dtype=np.int64)
  rank_of = np.zeros(most + ranks, dtype=np.int64)
  local = np.zeros(most + ranks, dtype=np.int64)
  for l in range(nl):
    r = rowsizes[l]
    step = max(1, block // vecs[l]) * vecs[l] if by_vectors else block
    for k in range(ns):
      nf = 0
      if replicated[l]:
        length = counts[0, l, k] * r
      else:
        length = 0
        i = 0
        while i < ranks:
          # A group: ranks holding the same rows, each some columns (a column start of 0 opens
          # the next group; a rank holding whole rows is a group of its own).
          j = i + 1
          while j < ranks and columns[l, order[l, j], 0] != 0:
            j += 1
          g = order[l, i]
          if j == i + 1 and columns[l, g, 1] - columns[l, g, 0] == r:
            begin[nf] = length
            length += counts[g, l, k] * r
            end[nf] = length
            rank_of[nf] = g
            local[nf] = first[g, l, k] * r
            nf += 1
          else:
            for row in range(counts[g, l, k]):
              for t in range(i, j):
                h = order[l, t]
                w = columns[l, h, 1] - columns[l, h, 0]
                begin[nf] = length
                length += w
                end[nf] = length
                rank_of[nf] = h
                local[nf] = (first[h, l, k] + row) * w
                nf += 1
          i = j
      pos = 0
      i = 0
      while pos < length:
        n = min(step, length - pos)
        if fill:
          b_leaf[nb] = l
          b_sys[nb] = k
          b_start[nb] = pos
          b_len[nb] = n
        if replicated[l]:
          if fill:
            owner[nb] = -2
            owner_start[nb] = first[0, l, k] * r + pos
        else:
          while end[i] <= pos:
            i += 1
          if pos + n <= end[i]:
            if fill:
              owner[nb] = rank_of[i]
              owner_start[nb] = local[i] + pos - begin[i]
          else:
            if fill:
              owner[nb] = -1
              owner_start[nb] = 0
            j = i
            while j < nf and begin[j] < pos + n:
              lo = max(begin[j], pos)
              hi = min(end[j], pos + n)
              if hi > lo:
                if fill:
                  p_block[npieces] = nb
                  p_rank[npieces] = rank_of[j]
                  p_start[npieces] = local[j] + lo - begin[j]
                  p_len[npieces] = hi - lo
                  p_at[npieces] = lo - pos
                npieces += 1
              j += 1
        nb += 1
        pos += n
  return nb, npieces


@njit(**JIT)
def _walk_sub_blocks(blocks, b_leaf, b_sys, b_len, p_block, p_rank, p_start, p_len, p_at, sub,
                     fill, out):
  """Counts or writes the sub-blocks of the straddling blocks ``blocks`` (each on its grid of
  ``sub`` elements from the block's start) and their straddling pieces, from the blocks'
  pieces; like ``_walk_blocks``, one level down. Returns (sub-blocks, pieces)."""
  s_leaf, s_sys, s_start, s_len, owner, owner_start, q_unit, q_rank, q_start, q_len, q_at, \
      s_block = out
  ns = 0
  nq = 0
  j0 = 0
  for b in blocks:
    while p_block[j0] != b:
      j0 += 1
    j1 = j0
    while j1 < p_block.size and p_block[j1] == b:
      j1 += 1
    pos = 0
    j = j0
    while pos < b_len[b]:
      n = min(sub, b_len[b] - pos)
      if fill:
        s_leaf[ns] = b_leaf[b]
        s_sys[ns] = b_sys[b]
        s_start[ns] = pos
        s_len[ns] = n
        s_block[ns] = b
      while p_at[j] + p_len[j] <= pos:
        j += 1
      if pos + n <= p_at[j] + p_len[j]:
        if fill:
          owner[ns] = p_rank[j]
          owner_start[ns] = p_start[j] + pos - p_at[j]
      else:
        if fill:
          owner[ns] = -1
          owner_start[ns] = 0
        i = j
        while i < j1 and p_at[i] < pos + n:
          lo = max(p_at[i], pos)
          hi = min(p_at[i] + p_len[i], pos + n)
          if hi > lo:
            if fill:
              q_unit[nq] = ns
              q_rank[nq] = p_rank[i]
              q_start[nq] = p_start[i] + lo - p_at[i]
              q_len[nq] = hi - lo
              q_at[nq] = lo - pos
            nq += 1
          i += 1
      ns += 1
      pos += n
    j0 = j1
  return ns, nq


def _arrays(nb: int, npieces: int, extra: int = 0) -> tuple:
  i64 = lambda n: np.zeros(n, dtype=np.int64)
  return ((np.zeros(nb, np.int32), np.zeros(nb, np.int32)) + tuple(i64(nb) for _ in range(4))
          + tuple(i64(npieces) for _ in range(5)) + tuple(i64(nb) for _ in range(extra)))


def plan(shards: ShardLayout, layout: LeafLayout, by_vectors: bool) -> Units:
  """The unsharded call's blocks, and who reads each."""
  columns = shards.columns
  if columns is None:
    columns = np.zeros((layout.rowsizes.size, shards.counts.shape[0], 2), np.int64)
    columns[:, :, 1] = layout.rowsizes[:, None]
  args = (shards.counts, shards.order, shards.replicated, np.ascontiguousarray(columns, np.int64),
          layout.rowsizes, layout.vecs, BLOCK, by_vectors)
  nb, npieces = _walk_blocks(*args, False, _arrays(0, 0))
  out = _arrays(nb, npieces)
  _walk_blocks(*args, True, out)
  return Units(Blocks(*out[:4]), *out[4:])


def split(plan: Units, blocks: np.ndarray) -> tuple[Units, np.ndarray]:
  """The sub-blocks of straddling ``blocks`` of ``plan``, and the block of each."""
  u = plan.units
  args = (blocks.astype(np.int64), u.leaf, u.system, u.length, plan.piece_unit, plan.piece_rank,
          plan.piece_start, plan.piece_length, plan.piece_at, SUB_BLOCK)
  ns, nq = _walk_sub_blocks(*args, False, _arrays(0, 0, 1))
  out = _arrays(ns, nq, 1)
  _walk_sub_blocks(*args, True, out)
  return Units(Blocks(*out[:4]), *out[4:11]), out[11]


def raw_bytes(units: Units, indices: np.ndarray, ranks: int, codes: np.ndarray) -> np.ndarray:
  """Bytes of each rank's pieces of the units ``indices`` (``codes``: the leaves' dtypes)."""
  pieces = np.flatnonzero(np.isin(units.piece_unit, indices))
  nbytes = units.piece_length[pieces] * ITEMSIZE[codes[units.units.leaf[units.piece_unit[
      pieces]]]]
  out = np.zeros(ranks, np.int64)
  np.add.at(out, units.piece_rank[pieces], nbytes)
  return out


def block_reducers(subs: Units, block_of: np.ndarray, blocks: np.ndarray, ranks: int,
                   dtypes: tuple, codes: np.ndarray) -> np.ndarray:
  """The rank that completes each of ``blocks`` (across a boundary, split into the sub-blocks
  ``subs``; ``block_of`` the block of each, ``dtypes`` a sub-block's results): the one that
  would send the most bytes of it (its sub-blocks' results and its pieces of the sub-blocks
  across a boundary), so the others send theirs; the first such rank on a tie."""
  weight = np.zeros((blocks.size, ranks), np.int64)
  held = subs.owner >= 0
  width = sum(np.dtype(d).itemsize for d in dtypes)
  np.add.at(weight, (np.searchsorted(blocks, block_of[held]), subs.owner[held]), width)
  unit = subs.piece_unit
  np.add.at(weight, (np.searchsorted(blocks, block_of[unit]), subs.piece_rank),
            subs.piece_length * ITEMSIZE[codes[subs.units.leaf[unit]]])
  return weight.argmax(1)


PASS_KINDS = ("merge", "split", "whole")


def exchange_bytes(shards: ShardLayout, layout: LeafLayout, by_vectors: bool, width: int,
                   kind: str, sub_width: int = 0) -> np.ndarray:
  """Bytes each rank hands to the all-gather of one pass
  (:meth:`.sharded.ShardedBlocks.run`), from the layout alone: ``kind`` "merge" (a ``merge``
  pass), "split" (a ``split`` pass) or "whole" (neither), ``width`` the bytes of one block's
  results, ``sub_width`` of one sub-block's (a split's). What a static buffer must hold (JAX's partitioned call,
  :mod:`clipbench.impls.own.jax.partitioned`)."""
  if kind not in PASS_KINDS:
    raise ValueError(f"kind: expected one of {PASS_KINDS}, got {kind!r}")
  units = plan(shards, layout, by_vectors)
  ranks = shards.counts.shape[0]
  straddling = np.flatnonzero(units.owner == STRADDLES)
  out = np.array([units.owned_by(g).size * width for g in range(ranks)], dtype=np.int64)
  if kind == "merge":
    out += [units.pieces_of(g).size * width for g in range(ranks)]
  elif kind == "whole":
    out += raw_bytes(units, straddling, ranks, layout.codes)
  else:
    short = units.units.length[straddling] < SHORT
    subs, _ = split(units, straddling[~short])
    across = np.flatnonzero(subs.owner == STRADDLES)
    out += (raw_bytes(units, straddling[short], ranks, layout.codes)
            + np.array([subs.owned_by(g).size * sub_width for g in range(ranks)], np.int64)
            + raw_bytes(subs, across, ranks, layout.codes))
  return out
