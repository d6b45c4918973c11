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
* a block that straddles a boundary between ranks: a power-sum block (:mod:`.power_sums`) and
  a scaled double-double block (:mod:`.scaled_sums`: float64 leaves, p > 6) are in-order folds
  of their ``SUB_BLOCK``-element sub-blocks' sums, so each rank reduces the sub-blocks of it
  that it holds whole and sends their sums, and only the elements of the one sub-block across
  the boundary travel (at most 1 KB of float32 per rank, leaf and boundary); every rank
  reduces that sub-block alike and folds (zero mode's power sums send, per sub-block, its sum
  without non-finite elements too, which a block holding them folds instead). Beyond two
  ranks, where the collective has an all-to-all, such a block is instead completed at one rank
  (the one that would send the most of it): the others send it their sub-blocks' sums and
  pieces point to point, and only the block's result is all-gathered. Maxima and
  max-step blocks follow from their pieces' results in any split (``merge``): each rank sends
  its pieces'. A pass with neither (none of the kernels' today) sends the ranks' elements of
  the whole block (up to 32 KB), once per call;
* a replicated leaf is whole on every rank: every rank reduces its blocks itself, nothing moves.

Every rank then folds, finalizes and decides as the unsharded call does (:func:`.general.decide`,
deterministic code on equal inputs) and scales its own rows (:func:`.general.apply`). What a
rank holds beyond its rows is per-block and per-system vectors and the straddling blocks.
Near-ties (:meth:`ShardedBlocks.ties_kept`) are decided from exact per-rank partials of the
flagged systems only: rational power sums for integer p (exact, so any order of addition
gives the same total), signs for max-step, maxima for p = +-inf; for a non-integer p, interval
enclosures of each rank's power sum, added (:mod:`clipbench.impls.own.shared_enclosures`:
about 41 bytes a system, and one more exchange per higher precision a system needs, which
only an exact tie takes to the last).

Costs: one all-gather of every rank's block and sub-block results and elements (two when a
first pass takes the maxima); beyond two ranks an all-to-all before each, and the all-gather
carries block results only. Rows of a system that are interleaved across ranks (unsorted ids
whose systems each hold rows on several ranks) make every such system's run straddle, and its
elements travel; the bits stay right, the bytes approach the rows'. The ranks must run the
same compiled kernels (one machine type), as the unsharded call's bits already assume.

The communication is the caller's (:class:`Collective`): torch passes gloo's all-gather and
all-to-all (:mod:`clipbench.impls.own.torch.sharded`); JAX's replayed rounds
(:mod:`clipbench.impls.own.jax.partitioned`) all-gather only.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, NamedTuple, Protocol

import numba
import numpy as np
from numba import njit

from clipbench.impls.own import exact
from clipbench.impls.own.numba import general, shard_plan, threads
from clipbench.impls.own.numba.decode import ITEMSIZE
from clipbench.impls.own.numba.intrinsics import JIT, ptr_u16
from clipbench.impls.own.numba.layout import LeafLayout, Prepared, leaf_layout
from clipbench.impls.own.numba.records import Blocks, Leaves
from clipbench.impls.own.numba.segments import CheckedSegments
from clipbench.impls.own.numba.shard_plan import ShardLayout
from clipbench.impls.own.numba.short_sums import SHORT
from clipbench.impls.own.shared_enclosures import SharedEnclosures

_ALIGN = 64  # bytes: each assembled straddling block starts on a cache line


# At two ranks, the elements of shared sub-blocks below which a call keeps one round (an
# all-gather of them) rather than two (:meth:`ShardedBlocks._point_to_point`).
_SHARED_BYTES = 1 << 14


class Collective(Protocol):
  """The exchanges of one call among the ranks of a group (every rank makes the same calls).

  A collective may also have ``all_to_all_bytes(payloads, sizes)``: ``payloads[h]`` (uint8)
  to rank h, returning what each rank g sent this one (``sizes[g]`` bytes). Beyond two ranks
  the blocks across a boundary are then completed at one rank; without it (JAX's replayed
  rounds) their pieces are all-gathered."""

  rank: int  # this rank's index in the group
  size: int

  def all_gather_bytes(self, payload: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """Every rank's uint8 ``payload`` (rank g's holds ``sizes[g]`` bytes), by rank index."""

  def all_gather_objects(self, value: Any) -> list[Any]:
    """Every rank's picklable ``value``, by rank index."""

  def holds_next_round(self) -> bool:
    """Whether every rank's payload of the next all-gather is known here already (a call
    replayed after its exchange: JAX's partitioned custom calls); this rank's part of that
    round then need not be computed."""


def _fields(outputs: tuple) -> list[np.ndarray]:
  """The per-block arrays of a pass's outputs (arrays, or records of arrays), in order."""
  return [a for o in outputs for a in (o if isinstance(o, tuple) else (o,))]


def _like(outputs: tuple, n: int) -> tuple:
  """Outputs of the same structure for ``n`` blocks."""
  return tuple(type(o)(*(np.zeros(n, a.dtype) for a in o)) if isinstance(o, tuple)
               else np.zeros(n, o.dtype) for o in outputs)


@njit(**JIT)
def _copy_bytes(sources, destinations, nbytes):
  """Copies ``nbytes[i]`` bytes (an even count: every dtype here has 2 bytes or more) from
  address ``sources[i]`` to ``destinations[i]``."""
  for i in range(nbytes.size):
    n = nbytes[i] // 2
    if n:
      numba.carray(ptr_u16(destinations[i]), n)[:] = numba.carray(ptr_u16(sources[i]), n)


class _Assembled(NamedTuple):
  """Straddling units made whole on this rank: extra leaves after its own, one per unit."""

  leaves: Leaves
  units: Blocks
  indices: np.ndarray  # which units of their plan
  buffer: np.ndarray  # keeps the bytes alive


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
    self._plans: dict[bool, shard_plan.Units] = {}
    self._assembled: dict[tuple, _Assembled] = {}
    self._addresses: np.ndarray | None = None

  def _plan_of(self, by_vectors: bool) -> shard_plan.Units:
    if by_vectors not in self._plans:
      self._plans[by_vectors] = shard_plan.plan(self.shards, self.layout, by_vectors)
    return self._plans[by_vectors]

  def blocks(self, by_vectors: bool) -> Blocks:
    """Every block of the whole leaves, in fold order."""
    return self._plan_of(by_vectors).units

  def _itemsize(self, units: shard_plan.Units, pieces: np.ndarray) -> np.ndarray:
    return ITEMSIZE[self.layout.codes[units.units.leaf[units.piece_unit[pieces]]]]

  def _held_addresses(self) -> np.ndarray:
    """The data address of each leaf as this rank's pieces are counted in it (the rows in
    system order: a gathered copy for unsorted ids)."""
    if self._addresses is None:
      prep = self.prep
      self._held = [np.ascontiguousarray(g if g is not None else x)
                    for g, x in zip(prep.gathered, prep.leaves)]
      self._addresses = np.array([h.ctypes.data for h in self._held], dtype=np.int64)
    return self._addresses

  def _raw(self, units: shard_plan.Units, indices: np.ndarray) -> np.ndarray:
    """This rank's pieces of the units ``indices``, concatenated in piece order."""
    pieces = units.pieces_of(self.collective.rank)
    pieces = pieces[np.isin(units.piece_unit[pieces], indices)]
    if pieces.size == 0:
      return np.zeros(0, np.uint8)
    sizes = self._itemsize(units, pieces)
    nbytes = units.piece_length[pieces] * sizes
    out = np.empty(int(nbytes.sum()), np.uint8)
    leaf = units.units.leaf[units.piece_unit[pieces]]
    _copy_bytes(self._held_addresses()[leaf] + units.piece_start[pieces] * sizes,
                out.ctypes.data + np.cumsum(nbytes) - nbytes, nbytes)
    return out

  def _assemble(self, units: shard_plan.Units, indices: np.ndarray,
                raw: list[np.ndarray]) -> _Assembled:
    """The units ``indices`` made whole from every rank's pieces (``raw[g]``: rank g's, in
    piece order), in one aligned buffer."""
    lay, nl = self.layout, self.layout.codes.size
    leaf = units.units.leaf[indices]
    nbytes = units.units.length[indices] * ITEMSIZE[lay.codes[leaf]]
    padded = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    offsets = np.cumsum(padded) - padded
    buffer = np.zeros(int(padded.sum()) + _ALIGN, np.uint8)
    shift = (-buffer.ctypes.data) % _ALIGN
    where = np.full(units.units.leaf.size, -1, np.int64)
    where[indices] = np.arange(indices.size)
    for rank, payload in enumerate(raw):
      pieces = units.pieces_of(rank)
      pieces = pieces[where[units.piece_unit[pieces]] >= 0]
      if pieces.size == 0:
        continue
      payload = np.ascontiguousarray(payload)
      sizes = self._itemsize(units, pieces)
      nbytes = units.piece_length[pieces] * sizes
      if int(nbytes.sum()) > payload.size:
        raise ValueError(f"rank {rank} sent {payload.size} bytes of pieces, the layout says "
                         f"{int(nbytes.sum())}")
      _copy_bytes(payload.ctypes.data + np.cumsum(nbytes) - nbytes,
                  buffer.ctypes.data + shift + offsets[where[units.piece_unit[pieces]]]
                  + units.piece_at[pieces] * sizes, nbytes)
    inputs = self.prep.norm_inputs
    extra = Leaves(
        np.concatenate([inputs.addrs, buffer.ctypes.data + shift + offsets]).astype(np.int64),
        np.concatenate([inputs.sizes, units.units.length[indices]]).astype(np.int64),
        np.concatenate([inputs.codes, lay.codes[leaf]]).astype(np.int8),
        np.concatenate([inputs.rowsizes, lay.rowsizes[leaf]]).astype(np.int64),
        np.concatenate([inputs.vecs, lay.vecs[leaf]]).astype(np.int64),
        inputs.table)
    whole = Blocks((nl + np.arange(indices.size)).astype(np.int32), units.units.system[indices],
                   np.zeros(indices.size, np.int64), units.units.length[indices])
    return _Assembled(extra, whole, indices, buffer)

  def _reduce(self, kernel, outputs: tuple, units: shard_plan.Units, indices: np.ndarray,
              args) -> list:
    """``kernel``'s results (fields) for the units ``indices`` this rank holds whole."""
    local = _like(outputs, indices.size)
    if indices.size:
      u = units.units
      blocks = Blocks(u.leaf[indices], u.system[indices], units.owner_start[indices],
                      u.length[indices])
      threads.parallel(kernel, blocks.length, *local, self.prep.norm_inputs, blocks, *args)
    return _fields(local)

  def run(self, kernel, outputs: tuple, by_vectors: bool, *args: Any, split=None,
          merge=None) -> None:
    """``kernel`` over every block: this rank's whole blocks and replicated leaves read here,
    the other ranks' results received, straddling blocks reduced here from their pieces.

    ``split`` (a :class:`~.records.Split`: ``power_sums.sub_block_split``,
    ``scaled_sums.SPLIT``) says that a block's result is the fold of its sub-blocks' results: a
    straddling block then travels as the results of the sub-blocks each rank holds whole, plus
    the elements of the one sub-block across each boundary. ``merge`` (``extremes.merge_extremes``,
    ``max_step.merge_step``) says that a block's result follows from its pieces' results, in
    any split: each rank sends its pieces' results. Without either a straddling block travels
    as its elements (kept for the call's later passes).
    """
    plan = self._plan_of(by_vectors)
    me, ranks = self.collective.rank, self.collective.size
    targets = _fields(outputs)
    # A replayed round receives this rank's results with the others': only replicated leaves
    # are reduced here.
    replayed = self.collective.holds_next_round()
    here = np.flatnonzero((plan.owner == shard_plan.EVERY_RANK) if replayed else
                          (plan.owner == me) | (plan.owner == shard_plan.EVERY_RANK))
    for target, values in zip(targets, self._reduce(kernel, outputs, plan, here, args)):
      target[here] = values
    owned = [plan.owned_by(g) for g in range(ranks)]
    straddling = np.flatnonzero(plan.owner == shard_plan.STRADDLES)
    # Assembled blocks are kept for later passes that would send the same ones.
    kind = "merge" if merge is not None else "split" if split is not None else "whole"
    key = (by_vectors, kind)
    whole = straddling if merge is None else straddling[:0]
    if merge is not None:
      piece_fields = _like(outputs, plan.piece_unit.size)
      my_pieces = plan.pieces_of(me)
      if my_pieces.size and not replayed:
        u = plan.units
        blocks = Blocks(u.leaf[plan.piece_unit[my_pieces]], u.system[plan.piece_unit[my_pieces]],
                        plan.piece_start[my_pieces], plan.piece_length[my_pieces])
        mine_fields = _like(outputs, my_pieces.size)
        threads.parallel(kernel, blocks.length, *mine_fields, self.prep.norm_inputs, blocks,
                         *args)
        for field, values in zip(_fields(piece_fields), _fields(mine_fields)):
          field[my_pieces] = values
    if split is not None:
      whole = straddling[plan.units.length[straddling] < SHORT]  # a short block's own tree
      split_blocks = straddling[plan.units.length[straddling] >= SHORT]
      subs, block_of = shard_plan.split(plan, split_blocks)
      if split_blocks.size and self._point_to_point(replayed, subs):
        # Each block across a boundary is completed at one rank and sent as its result.
        reducer = shard_plan.block_reducers(subs, block_of, split_blocks, ranks, split.dtypes,
                                            self.layout.codes)
        self._complete_at_reducers(split, subs, block_of, split_blocks, reducer, targets, args)
        owned = [np.sort(np.concatenate([owned[g], split_blocks[reducer == g]]))
                 for g in range(ranks)]
        split = None
    if split is not None:
      sub_owned = [subs.owned_by(g) for g in range(ranks)]
      sub_straddling = np.flatnonzero(subs.owner == shard_plan.STRADDLES)
      sub_fields = [np.zeros(block_of.size, d) for d in split.dtypes]
    assemble = key not in self._assembled
    width = sum(t.dtype.itemsize for t in targets)
    sub_width = sum(np.dtype(d).itemsize for d in split.dtypes) if split is not None else 0
    raw_whole_sizes = shard_plan.raw_bytes(plan, whole, ranks, self.layout.codes)
    sizes = [owned[g].size * width for g in range(ranks)]
    for g in range(ranks):
      if merge is not None:
        sizes[g] += plan.pieces_of(g).size * width
      if assemble:
        sizes[g] += int(raw_whole_sizes[g])
    if split is not None:
      raw_sub_sizes = shard_plan.raw_bytes(subs, sub_straddling, ranks, self.layout.codes)
      for g in range(ranks):
        sizes[g] += sub_owned[g].size * sub_width + int(raw_sub_sizes[g])

    mine = []
    if not replayed:
      mine = [np.ascontiguousarray(t[owned[me]]).view(np.uint8) for t in targets]
      if merge is not None:
        mine += [np.ascontiguousarray(f[my_pieces]).view(np.uint8)
                 for f in _fields(piece_fields)]
      if assemble:
        mine.append(self._raw(plan, whole))
      if split is not None:
        for field, values in zip(sub_fields, self._reduce(split.kernel, tuple(sub_fields), subs,
                                                          sub_owned[me], args)):
          field[sub_owned[me]] = values
        mine += [f[sub_owned[me]].view(np.uint8) for f in sub_fields]
        mine.append(self._raw(subs, sub_straddling))
    received = self.collective.all_gather_bytes(
        np.concatenate(mine) if mine else np.zeros(0, np.uint8), sizes)
    raw_whole, raw_subs = [], []
    for g, payload in enumerate(received):
      theirs_too = g != me or replayed  # this rank's own results are already in place
      cursor = 0
      for target in targets:
        n = owned[g].size * target.dtype.itemsize
        if theirs_too:
          target[owned[g]] = payload[cursor:cursor + n].view(target.dtype)
        cursor += n
      if merge is not None:
        theirs = plan.pieces_of(g)
        for field in _fields(piece_fields):
          n = theirs.size * field.dtype.itemsize
          if theirs_too:
            field[theirs] = payload[cursor:cursor + n].view(field.dtype)
          cursor += n
      if assemble:
        n = int(raw_whole_sizes[g])
        raw_whole.append(payload[cursor:cursor + n])
        cursor += n
      if split is not None:
        for field in sub_fields:
          n = sub_owned[g].size * field.dtype.itemsize
          if theirs_too:
            field[sub_owned[g]] = payload[cursor:cursor + n].view(field.dtype)
          cursor += n
        raw_subs.append(payload[cursor:sizes[g]])
    if assemble:
      self._assembled[key] = self._assemble(plan, whole, raw_whole)
    done = self._assembled[key]
    if done.indices.size:
      reduced = _like(outputs, done.indices.size)
      threads.parallel(kernel, done.units.length, *reduced, done.leaves, done.units, *args)
      for target, values in zip(targets, _fields(reduced)):
        target[done.indices] = values
    if merge is not None:
      merge(plan.piece_unit, *_fields(piece_fields), *targets, *args)
    if split is not None:
      if sub_straddling.size:
        across = self._assemble(subs, sub_straddling, raw_subs)
        reduced = _like(tuple(sub_fields), sub_straddling.size)
        threads.parallel(split.kernel, across.units.length, *reduced, across.leaves,
                         across.units, *args)
        for field, values in zip(sub_fields, reduced):
          field[sub_straddling] = values
      split.fold(block_of, *sub_fields, *targets)

  def _point_to_point(self, replayed: bool, subs: shard_plan.Units) -> bool:
    """Whether blocks across a boundary are completed at one rank from what the others send
    it (two exchanges) rather than by every rank from sub-block results and pieces
    all-gathered (one). Beyond two ranks an all-gather hands everything to every rank (a rank
    writes ``ranks - 1`` times its payload, padded to the largest rank's): most of a call's
    bytes. At two ranks, where the elements of the sub-blocks ranks share would be more than
    1% of the leaves' bytes a rank and more than ``_SHARED_BYTES`` (leaves split by columns
    off the sub-block grid: a shared sub-block or two a row): only the smaller side of each
    then travels, and is held, once. A small call keeps its one round."""
    if replayed or not hasattr(self.collective, "all_to_all_bytes"):
      return False
    ranks = self.collective.size
    if ranks > 2:
      return True
    lay = self.layout
    across = np.flatnonzero(subs.owner == shard_plan.STRADDLES)
    shared = int(shard_plan.raw_bytes(subs, across, ranks, lay.codes).sum())
    return shared > _SHARED_BYTES and 100 * shared > int(
        (lay.sizes * ITEMSIZE[lay.codes]).sum()) // ranks

  def _complete_at_reducers(self, split, subs: shard_plan.Units, block_of: np.ndarray,
                            blocks: np.ndarray, reducer: np.ndarray, targets: list, args) -> None:
    """The point-to-point round of a ``split`` pass: for each block of ``blocks`` (across a
    boundary; ``subs`` its sub-blocks, ``block_of`` the block of each) that rank
    ``reducer`` completes, every other rank sends that rank the results of its whole
    sub-blocks and its pieces of the sub-blocks across a boundary; this rank folds the blocks
    it completes into ``targets``."""
    me, ranks = self.collective.rank, self.collective.size
    completes = reducer[np.searchsorted(blocks, block_of)]  # per sub-block
    fields = [np.zeros(block_of.size, d) for d in split.dtypes]
    held = subs.owned_by(me)
    for field, values in zip(fields, self._reduce(split.kernel, tuple(fields), subs, held, args)):
      field[held] = values
    across = np.flatnonzero(subs.owner == shard_plan.STRADDLES)
    here = across[completes[across] == me]

    def results(g: int, h: int) -> np.ndarray:  # what rank g sends rank h of its sub-blocks
      return np.flatnonzero((subs.owner == g) & (completes == h))

    sends = [np.zeros(0, np.uint8) if h == me else np.concatenate(
        [f[results(me, h)].view(np.uint8) for f in fields]
        + [self._raw(subs, across[completes[across] == h])]) for h in range(ranks)]
    raw_sizes = shard_plan.raw_bytes(subs, here, ranks, self.layout.codes)
    width = sum(f.dtype.itemsize for f in fields)
    sizes = [0 if g == me else results(g, me).size * width + int(raw_sizes[g])
             for g in range(ranks)]
    received = self.collective.all_to_all_bytes(sends, sizes)
    raw = []
    for g, payload in enumerate(received):
      if g == me:
        raw.append(self._raw(subs, here))
        continue
      theirs, cursor = results(g, me), 0
      for field in fields:
        n = theirs.size * field.dtype.itemsize
        field[theirs] = payload[cursor:cursor + n].view(field.dtype)
        cursor += n
      raw.append(payload[cursor:])
    if here.size:
      done = self._assemble(subs, here, raw)
      reduced = _like(tuple(fields), here.size)
      threads.parallel(split.kernel, done.units.length, *reduced, done.leaves, done.units,
                       *args)
      for field, values in zip(fields, reduced):
        field[here] = values
    mine = completes == me
    if mine.any():
      split.fold(block_of[mine], *[f[mine] for f in fields], *targets)

  def ties_kept(self, systems: list[int], c: np.ndarray, p: float, step: bool) -> list[bool]:
    """The exact decisions of near-ties from every rank's exact partials of those systems."""
    if not systems:
      return []
    # A replicated leaf counts once: on rank 0; a piece other ranks hold copies of, where the
    # layout counts its rows.
    me = self.collective.rank
    counted = [i for i in range(self.layout.codes.size)
               if (me == 0 if self.shards.replicated[i] else self.shards.counts[me, i].any())]
    thresholds = [Fraction(float(c[k])) for k in systems]
    if not step and not math.isinf(p) and not float(p).is_integer():
      parts = [exact.PowerSumTerms(*_tie_magnitudes(self.prep, counted, k), p) for k in systems]
      shared = SharedEnclosures(parts, p, self.collective.all_gather_objects)
      return [s <= 0 for s in shared.signs(thresholds)]
    partials = [_tie_partial(self.prep, counted, k, p, step, c_k)
                for k, c_k in zip(systems, thresholds)]
    every = self.collective.all_gather_objects(partials)
    return [_tie_sign([of_rank[i] for of_rank in every], p, step, c_k) <= 0
            for i, c_k in enumerate(thresholds)]


def _tie_magnitudes(prep: Prepared, counted: list[int], k: int):
  """(m, e) of system k's elements in the leaves ``counted``."""
  values = [v.ravel() for i, v in enumerate(prep.system_values(k)) if i in counted]
  return exact.magnitudes_of(np.concatenate(values) if values else np.zeros(0))


def _tie_partial(prep: Prepared, counted: list[int], k: int, p: float, step: bool,
                 c: Fraction) -> Any:
  """One rank's exact summary of system k's elements in the leaves ``counted`` (an integer
  p, +-inf, max-step): what :func:`_tie_sign` combines across ranks (each kind is exact and
  order-free)."""
  if step:
    signs = [exact.exact_step_compare(*exact.magnitudes_of(v), c)
             for i, v in enumerate(prep.system_vectors(k)) if i in counted and v.size]
    return max(signs, default=-1)
  m, e = _tie_magnitudes(prep, counted, k)
  if math.isinf(p):
    if m.size == 0:
      return None
    exact_values = [Fraction(int(a)) * Fraction(2) ** int(b) for a, b in zip(m, e)]
    return max(exact_values) if p > 0 else min(exact_values)
  return exact.power_sum(m, e, int(p)), int(m.size)


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
  total = sum(s for s, _ in partials)
  bound = c ** int(p)
  return (total > bound) - (total < bound)


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
