"""A sharded call of the general route: each rank reads its own rows, and the ranks exchange
block results instead of leaves (SPEC rule 14 at the communication cost of partial sums).

The unsharded call's bits come from its blocks (:mod:`.layout`): each system's run of rows in
a leaf is cut into blocks of ``BLOCK`` elements counted from the run's start, each block is
reduced by one compiled function of its elements, and a system's block results are folded in
(leaf, block) order. A float64 fold is not associative, so adding per-rank partial sums would
move bits; here every rank instead reaches the *same* per-block results, in the same order:

* a block that lies wholly in one rank's rows is reduced by that rank (the same function of the
  same elements, wherever they sit in memory), and its results (8 to 25 bytes per block of up
  to 8,192 elements) go to every rank;
* a block that straddles a boundary between ranks is assembled from the ranks' raw pieces of
  it (at most one block per run per boundary: with sorted ids, one per leaf per boundary) and
  reduced by every rank alike;
* a replicated leaf is whole on every rank: every rank reduces its blocks itself, nothing moves.

Every rank then folds, finalizes and decides as the unsharded call does (:func:`.general.decide`,
deterministic code on equal inputs) and scales its own rows (:func:`.general.apply`). What a
rank holds beyond its rows is per-block and per-system vectors and the straddling blocks.
Near-ties (:meth:`ShardedBlocks.ties_kept`) are decided from exact per-rank partials of the
flagged systems only: rational power sums for integer p (exact, so any order of addition
gives the same total), signs for max-step, maxima for p = +-inf; a non-integer p sends the
flagged systems' magnitudes (near-ties only happen where a test builds them).

Costs: rows of a system that are interleaved across ranks (unsorted ids whose systems each hold
rows on several ranks) make every such system's run straddle, and its raw pieces travel; the
bits stay right, the bytes approach the rows'. The ranks must run the same compiled kernels
(one machine type), as the unsharded call's bits already assume.

The communication is the caller's (:class:`Collective`): torch passes gloo's all-gather
(:mod:`clipbench.impls.own.torch.sharded`).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, NamedTuple, Protocol

import numpy as np
from numba import njit

from clipbench.impls.own import exact
from clipbench.impls.own.numba import general, threads
from clipbench.impls.own.numba.decode import ITEMSIZE
from clipbench.impls.own.numba.intrinsics import JIT
from clipbench.impls.own.numba.layout import BLOCK, LeafLayout, Prepared, leaf_layout
from clipbench.impls.own.numba.records import Blocks, Leaves
from clipbench.impls.own.numba.segments import CheckedSegments

# Owners of a block besides a rank index: every rank (a replicated leaf), pieces of several.
EVERY_RANK, STRADDLES = -2, -1
_ALIGN = 64  # bytes: each assembled straddling block starts on a cache line


class Collective(Protocol):
  """The exchanges of one call among the ranks of a group (every rank makes the same calls)."""

  rank: int  # this rank's index in the group
  size: int

  def all_gather_bytes(self, payload: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """Every rank's uint8 ``payload`` (rank g's holds ``sizes[g]`` bytes), by rank index."""

  def all_gather_objects(self, value: Any) -> list[Any]:
    """Every rank's picklable ``value``, by rank index."""


class ShardLayout(NamedTuple):
  """How the rows of the leaves are split among the ranks (the same on every rank)."""

  counts: np.ndarray  # int64 (ranks, leaves, systems): rows of each system each rank holds
  order: np.ndarray  # int64 (leaves, ranks): rank indices in the order of their rows
  replicated: np.ndarray  # bool (leaves,): every rank holds the whole leaf


class _Plan(NamedTuple):
  """The unsharded call's blocks, and who reads each."""

  blocks: Blocks  # every block in fold order (start: within its run)
  owner: np.ndarray  # int64: the rank that reads it whole, EVERY_RANK or STRADDLES
  owner_start: np.ndarray  # int64: where it starts in its owner's (norm-order) leaf
  # Pieces of straddling blocks, in block order then row order:
  piece_block: np.ndarray  # int64 index into blocks
  piece_rank: np.ndarray  # int64
  piece_start: np.ndarray  # int64 element in that rank's (norm-order) leaf
  piece_length: np.ndarray  # int64
  piece_at: np.ndarray  # int64 element offset within the block


@njit(**JIT)
def _walk_blocks(counts, order, replicated, rowsizes, vecs, block, by_vectors, fill, out):
  """Counts (``fill`` False) or writes (into ``out``) the blocks and straddling pieces of every
  run, in ``layout.build_blocks``'s order; returns (blocks, pieces)."""
  ranks, nl, ns = counts.shape
  b_leaf, b_sys, b_start, b_len, owner, owner_start, p_block, p_rank, p_start, p_len, p_at = out
  nb = 0
  npieces = 0
  # Row offset of each system within each rank's leaf (systems in order, as Prepared lays
  # them out: sorted ids as they are, unsorted ones gathered).
  first = np.zeros((ranks, nl, ns), dtype=np.int64)
  for g in range(ranks):
    for l in range(nl):
      acc = 0
      for k in range(ns):
        first[g, l, k] = acc
        acc += counts[g, l, k]
  begin = np.zeros(ranks, dtype=np.int64)
  end = np.zeros(ranks, dtype=np.int64)
  for l in range(nl):
    r = rowsizes[l]
    step = max(1, block // vecs[l]) * vecs[l] if by_vectors else block
    for k in range(ns):
      if replicated[l]:
        length = counts[0, l, k] * r
      else:
        length = 0
        for i in range(ranks):
          g = order[l, i]
          begin[i] = length
          length += counts[g, l, k] * r
          end[i] = length
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
            g = order[l, i]
            if fill:
              owner[nb] = g
              owner_start[nb] = first[g, l, k] * r + pos - begin[i]
          else:
            if fill:
              owner[nb] = -1
              owner_start[nb] = 0
            j = i
            while j < ranks and begin[j] < pos + n:
              lo = max(begin[j], pos)
              hi = min(end[j], pos + n)
              if hi > lo:
                if fill:
                  g = order[l, j]
                  p_block[npieces] = nb
                  p_rank[npieces] = g
                  p_start[npieces] = first[g, l, k] * r + lo - begin[j]
                  p_len[npieces] = hi - lo
                  p_at[npieces] = lo - pos
                npieces += 1
              j += 1
        nb += 1
        pos += n
  return nb, npieces


def _plan(shards: ShardLayout, layout: LeafLayout, by_vectors: bool) -> _Plan:
  args = (shards.counts, shards.order, shards.replicated, layout.rowsizes, layout.vecs, BLOCK,
          by_vectors)
  i64 = lambda n: np.zeros(n, dtype=np.int64)
  nb, npieces = _walk_blocks(*args, False, tuple(i64(0) for _ in range(11)))
  out = (np.zeros(nb, np.int32), np.zeros(nb, np.int32)) + tuple(i64(nb) for _ in range(4)) + \
      tuple(i64(npieces) for _ in range(5))
  _walk_blocks(*args, True, out)
  return _Plan(Blocks(*out[:4]), *out[4:])


def _fields(outputs: tuple) -> list[np.ndarray]:
  """The per-block arrays of a pass's outputs (arrays, or records of arrays), in order."""
  return [a for o in outputs for a in (o if isinstance(o, tuple) else (o,))]


def _like(outputs: tuple, n: int) -> tuple:
  """Outputs of the same structure for ``n`` blocks."""
  return tuple(type(o)(*(np.zeros(n, a.dtype) for a in o)) if isinstance(o, tuple)
               else np.zeros(n, o.dtype) for o in outputs)


class ShardedBlocks:
  """The block source of a sharded call (for :func:`.general.decide`), on one rank.

  ``prep`` is this rank's :class:`Prepared` of its own rows (its segment ids checked, all
  ``num_systems`` systems), ``layout`` the :class:`LeafLayout` of the whole leaves.
  """

  def __init__(self, prep: Prepared, layout: LeafLayout, shards: ShardLayout,
               collective: Collective):
    self.prep = prep
    self.layout = layout
    self.shards = shards
    self.collective = collective
    self.num_systems = prep.num_systems
    self.vecs = layout.vecs
    self._plans: dict[bool, _Plan] = {}
    self._straddling: dict[bool, tuple[Leaves, Blocks]] = {}

  def _plan_of(self, by_vectors: bool) -> _Plan:
    if by_vectors not in self._plans:
      self._plans[by_vectors] = _plan(self.shards, self.layout, by_vectors)
    return self._plans[by_vectors]

  def blocks(self, by_vectors: bool) -> Blocks:
    """Every block of the whole leaves, in fold order."""
    return self._plan_of(by_vectors).blocks

  def _norm_bytes(self, leaf: int) -> np.ndarray:
    """This rank's leaf as the norm passes read it (unsorted rows gathered), as bytes."""
    prep = self.prep
    held = prep.gathered[leaf] if prep.gathered[leaf] is not None else prep.leaves[leaf]
    return np.ascontiguousarray(held).reshape(-1).view(np.uint8)

  def _pieces_of(self, plan: _Plan, rank: int) -> np.ndarray:
    return np.flatnonzero(plan.piece_rank == rank)

  def _piece_bytes(self, plan: _Plan) -> np.ndarray:
    """Bytes of each piece of a straddling block."""
    leaf = plan.blocks.leaf[plan.piece_block]
    return plan.piece_length * ITEMSIZE[self.layout.codes[leaf]]

  def _raw_payload(self, plan: _Plan) -> np.ndarray:
    """This rank's pieces of straddling blocks, concatenated in plan order."""
    mine = self._pieces_of(plan, self.collective.rank)
    if mine.size == 0:
      return np.zeros(0, np.uint8)
    parts = []
    for j in mine.tolist():
      leaf = int(plan.blocks.leaf[plan.piece_block[j]])
      size = int(ITEMSIZE[self.layout.codes[leaf]])
      start = int(plan.piece_start[j]) * size
      parts.append(self._norm_bytes(leaf)[start:start + int(plan.piece_length[j]) * size])
    return np.concatenate(parts)

  def _assemble(self, plan: _Plan, raw: list[np.ndarray], by_vectors: bool) -> None:
    """The straddling blocks, whole, from every rank's pieces: extra leaves after this
    rank's own, one per block, in one aligned buffer."""
    straddling = np.flatnonzero(plan.owner == STRADDLES)
    lay, nl = self.layout, self.layout.codes.size
    leaf = plan.blocks.leaf[straddling]
    nbytes = plan.blocks.length[straddling] * ITEMSIZE[lay.codes[leaf]]
    offsets = np.cumsum((nbytes + _ALIGN - 1) // _ALIGN * _ALIGN) - (
        nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    buffer = np.zeros(int(offsets[-1] + nbytes[-1]) + _ALIGN if straddling.size else _ALIGN,
                      np.uint8)
    shift = (-buffer.ctypes.data) % _ALIGN
    where = np.full(plan.blocks.leaf.size, -1, np.int64)
    where[straddling] = np.arange(straddling.size)
    piece_bytes = self._piece_bytes(plan)
    for rank, payload in enumerate(raw):
      cursor = 0
      for j in self._pieces_of(plan, rank).tolist():
        b = int(plan.piece_block[j])
        size = int(ITEMSIZE[lay.codes[plan.blocks.leaf[b]]])
        at = shift + int(offsets[where[b]]) + int(plan.piece_at[j]) * size
        n = int(piece_bytes[j])
        buffer[at:at + n] = payload[cursor:cursor + n]
        cursor += n
    inputs = self.prep.norm_inputs
    base = buffer.ctypes.data + shift
    extra = Leaves(
        np.concatenate([inputs.addrs, base + offsets]).astype(np.int64),
        np.concatenate([inputs.sizes, plan.blocks.length[straddling]]).astype(np.int64),
        np.concatenate([inputs.codes, lay.codes[leaf]]).astype(np.int8),
        np.concatenate([inputs.rowsizes, lay.rowsizes[leaf]]).astype(np.int64),
        np.concatenate([inputs.vecs, lay.vecs[leaf]]).astype(np.int64),
        inputs.table)
    blocks = Blocks((nl + np.arange(straddling.size)).astype(np.int32),
                    plan.blocks.system[straddling], np.zeros(straddling.size, np.int64),
                    plan.blocks.length[straddling])
    self._straddling[by_vectors] = (extra, blocks, buffer)

  def run(self, kernel, outputs: tuple, by_vectors: bool, *args: Any) -> None:
    """``kernel`` over every block: this rank's whole blocks and replicated leaves read here,
    the other ranks' results received, straddling blocks assembled and reduced here."""
    plan = self._plan_of(by_vectors)
    me, ranks = self.collective.rank, self.collective.size
    here = np.flatnonzero((plan.owner == me) | (plan.owner == EVERY_RANK))
    local = _like(outputs, here.size)
    if here.size:
      blocks = Blocks(plan.blocks.leaf[here], plan.blocks.system[here], plan.owner_start[here],
                      plan.blocks.length[here])
      threads.parallel(kernel, blocks.length, *local, self.prep.norm_inputs, blocks, *args)
    targets = _fields(outputs)
    for target, values in zip(targets, _fields(local)):
      target[here] = values
    owned = [np.flatnonzero(plan.owner == g) for g in range(ranks)]
    width = sum(t.dtype.itemsize for t in targets)
    first = by_vectors not in self._straddling
    piece_bytes = self._piece_bytes(plan)
    raw_sizes = [int(piece_bytes[self._pieces_of(plan, g)].sum()) if first else 0
                 for g in range(ranks)]
    mine = np.flatnonzero(plan.owner[here] == me)
    payload = np.concatenate(
        [np.ascontiguousarray(v[mine]).view(np.uint8) for v in _fields(local)] +
        ([self._raw_payload(plan)] if first else []))
    received = self.collective.all_gather_bytes(
        payload, [int(owned[g].size) * width + raw_sizes[g] for g in range(ranks)])
    for g in range(ranks):
      if g == me or owned[g].size == 0:
        continue
      cursor = 0
      for target in targets:
        n = owned[g].size * target.dtype.itemsize
        target[owned[g]] = received[g][cursor:cursor + n].view(target.dtype)
        cursor += n
    if first:
      self._assemble(plan, [r[owned[g].size * width:] for g, r in enumerate(received)],
                     by_vectors)
    extra, blocks, _ = self._straddling[by_vectors]
    if blocks.leaf.size:
      straddled = _like(outputs, blocks.leaf.size)
      threads.parallel(kernel, blocks.length, *straddled, extra, blocks, *args)
      where = np.flatnonzero(plan.owner == STRADDLES)
      for target, values in zip(targets, _fields(straddled)):
        target[where] = values

  def ties_kept(self, systems: list[int], c: np.ndarray, p: float, step: bool) -> list[bool]:
    """The exact decisions of near-ties from every rank's exact partials of those systems."""
    if not systems:
      return []
    # A replicated leaf counts once: on rank 0.
    counted = [i for i in range(self.layout.codes.size)
               if self.collective.rank == 0 or not self.shards.replicated[i]]
    thresholds = [Fraction(float(c[k])) for k in systems]
    partials = [_tie_partial(self.prep, counted, k, p, step, c_k)
                for k, c_k in zip(systems, thresholds)]
    every = self.collective.all_gather_objects(partials)
    return [_tie_sign([of_rank[i] for of_rank in every], p, step, c_k) <= 0
            for i, c_k in enumerate(thresholds)]


def _tie_partial(prep: Prepared, counted: list[int], k: int, p: float, step: bool,
                 c: Fraction) -> Any:
  """One rank's exact summary of system k's elements in the leaves ``counted``: what
  :func:`_tie_sign` combines across ranks (each kind is exact and order-free)."""
  if step:
    signs = [exact.exact_step_compare(*exact.magnitudes_of(v), c)
             for i, v in enumerate(prep.system_vectors(k)) if i in counted and v.size]
    return max(signs, default=-1)
  values = [v.ravel() for i, v in enumerate(prep.system_values(k)) if i in counted]
  m, e = exact.magnitudes_of(np.concatenate(values) if values else np.zeros(0))
  if math.isinf(p):
    if m.size == 0:
      return None
    exact_values = [Fraction(int(a)) * Fraction(2) ** int(b) for a, b in zip(m, e)]
    return max(exact_values) if p > 0 else min(exact_values)
  if float(p).is_integer():
    return exact.power_sum(m, e, int(p)), int(m.size)
  return m, e


def _tie_sign(partials: list, p: float, step: bool, c: Fraction) -> int:
  """-1, 0, 1 as the exact norm is <, ==, > c, from every rank's :func:`_tie_partial` (the
  unsharded ``exact.exact_compare`` / ``exact_step_compare`` on all the elements)."""
  if step:
    return max(partials)
  if math.isinf(p):
    held = [x for x in partials if x is not None]
    if not held:
      return -1 if c > 0 else 0
    extreme = max(held) if p > 0 else min(held)
    return (extreme > c) - (extreme < c)
  if float(p).is_integer():
    total = sum(s for s, _ in partials)
    bound = c ** int(p)
    return (total > bound) - (total < bound)
  return exact.exact_compare(np.concatenate([m for m, _ in partials]),
                             np.concatenate([e for _, e in partials]), p, c)


def run(leaves: list[np.ndarray], layout: LeafLayout, threshold: Any, segments: CheckedSegments,
        shards: ShardLayout, collective: Collective, p: float, nonfinite: str,
        step: bool = False) -> tuple[list[np.ndarray], np.ndarray]:
  """One rank's part of a sharded call of validated arguments: (its output rows, the norms).

  ``leaves`` are this rank's rows of each leaf (C-contiguous; a replicated leaf whole),
  ``segments`` their checked ids (all systems), ``layout`` the whole leaves'. Every rank of
  ``collective`` calls with the same ``layout``, ``shards``, threshold and options.
  """
  prep = Prepared(leaves, leaf_layout(leaves), segments)
  source = ShardedBlocks(prep, layout, shards, collective)
  decisions, norms = general.decide(source, layout, threshold, p, nonfinite, step)
  return general.apply(prep, decisions), norms
