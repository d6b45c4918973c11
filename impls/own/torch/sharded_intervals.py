"""The intervals way of a sharded call on the CUDA route: per-system measures exchanged, not
leaves (see :mod:`.sharded` for when it applies).

The CUDA route's outputs are a function of each system's *exact* norm: its certified passes
(:mod:`.measure`) bound the norm by an interval, and a decision the interval takes is the
exact one (:mod:`.certified`); a system the interval leaves open is decided exactly. So the
bits do not depend on how the sums were split, only the intervals' widths do, and a rank's
partial measures may be reduced across ranks in any order:

* float64 power sums of nonnegative terms are added (each rank's sum a tree of depth ``d_r``;
  their sum, ``ranks - 1`` more additions, one of depth ``max d_r + ranks - 1``, which the
  interval's ``gamma`` bound then covers);
* maxima (p = +inf, the scaling of a general p, max-step) by ``max``, minima (p = -inf) by
  ``min``: exact;
* element counts (for the underflow bounds and the roundings of the outputs) added exactly,
  and, when float64 leaves are mixed with narrower ones, the factor bits of float64 systems
  by ``min`` (24 when any rank holds a narrower element; 53 on every rank when every leaf is
  float64, and then not sent).

One rank's call:

1. its rows of each leaf (``to_local()``; a replicated leaf whole; a piece of a leaf split by
   columns or on a 2-D mesh, in place; a leaf of another placement made whole by
   ``full_tensor()``), checked as the unsharded call checks them. A replicated (or gathered)
   leaf is measured by the group's first rank alone, and a piece copied along a mesh
   dimension by the first rank along it, so that each element counts once;
2. the passes over its rows (the eager kernels, as on one device), and after each pass one
   exchange of its per-system float64 results (8 or 16 bytes per system), each value folded
   by one fold in rank order, so that every rank has the same bits (:class:`_Exchange`). The
   first also carries the element counts, and a word saying whether this rank's checks
   passed (ids in range are checked on the device: the word is a device value too). A
   float32 p = 1, 2, +-inf or max-step call makes one exchange; a general p two (the maxima
   first: they set the scaling). Beyond 1,024 per-system values an exchange goes by owners
   (:meth:`_Exchange._by_owners`): a rank sends only the rows of the systems it holds
   elements of, to the ranks that own them, and the owners' folded slices are all-gathered;
   with sorted ids (a batch of systems, each a run of rows) that is about ``(ranks - 1) /
   ranks`` of the values a system, against ``ranks - 1`` times them by an all-gather;
3. the decisions, identical on every rank (the same operators on the same reduced values),
   with the call's one host read. When any rank's checks failed, every rank raises
   :class:`AbandonedCall` there, together (the read is of a value every rank shares), and
   takes the gathering way, whose unsharded call raises the argument's error. A system the
   reduced interval leaves open (a near-tie) is decided on the host from every rank's exact
   partials of that system alone, one more all-gather (pickled: a rational power sum per
   system for an integer p, the largest exact step norm, or, for a non-integer p, an
   interval enclosure of the rank's power sum at 96 bits, a higher precision exchanged only
   for a system that one cannot decide: :func:`.oracles.shared_power_oracles`);
4. its own rows scaled (:meth:`EagerKernels.apply`), each output a DTensor placed like its
   leaf, with no communication.

The passes are the eager ones whatever the implementation (``clipbench.torch-compile`` and
``clipbench.triton`` too): every route computes the same exact function, so the bits are theirs.

float64 leaves: the power sums (p = 1, 2) are error-free extractions onto grids that the
reduced maxima and counts set, the same on every rank. A rank sends its four sums of pieces
as one double-double, and the ranks' double-doubles are added in double-double (:func:`dd_add`,
rank order); those roundings, below ``(ranks + 1) 2**-103`` of the pieces' magnitudes, join
the bound. With the count and the maximum that is four float64 values a system (32 bytes),
where four pieces added exactly made seven. A max-step and an integer p other than 1, 2 take
the exact path for every system (as on one device), from every rank's exact partials; so
does a non-integer p, from every rank's enclosures of its power sums (about 41 bytes a system,
pickled, beyond the passes' exchanges; no magnitude travels).

Not here (the gathering way, decided from metadata): calls of no system, and
``certified=False``.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from clipbench.impls.own.double_double import fast_two_sum, two_sum
from clipbench.impls.own.torch.arguments import (Threshold, check_leaves_and_dtypes,
                                                 check_nonfinite, check_norm_type,
                                                 check_segments, check_threshold)
from clipbench.impls.own.torch.decisions import Plan, decide
from clipbench.impls.own.torch.eager_passes import EagerKernels
from clipbench.impls.own.torch.host_read import HostRead
from clipbench.impls.own.torch.layout import Batch, make_batch, sanitize
from clipbench.impls.own.torch.measure import Measured, measure
from clipbench.impls.own.torch.oracles import SumOracle, exact_oracles, shared_power_oracles
from clipbench.impls.own.torch.sharded_partials import (TRAFFIC, AbandonedCall, _as_output,
                                                        _chunks, _local_segments, _MeshOrder,
                                                        _system_count, all_gather_objects,
                                                        full_tensor, geometry, like_input,
                                                        local_pieces, piece_extent)


def kind_of(op: str, norm_type: Any) -> str | None:
  """The pass kind of a call ("sum", "max", "min", "step"), None where ``norm_type`` is not a
  number (the unsharded call's check will say so)."""
  if op == "clip_by_max_step":
    return "step"
  try:
    p = check_norm_type(norm_type)
  except (TypeError, ValueError):
    return None
  return "max" if p == math.inf else "min" if p == -math.inf else "sum"


def applies(leaves: list[Any], call: Any, certified: bool) -> bool:
  """Whether a call on these (DTensor) leaves can take this way: from metadata and shared
  arguments only, so every rank answers alike."""
  kind = kind_of(call.op, call.norm_type)
  if kind is None or not certified:
    return False
  if call.segments is not None and call.num_systems == 0:
    return False
  return len({x.device.type for x in leaves}) == 1


# An exchange of at least this many per-system values is reduced by owners (systems cut into
# equal slices by rank): an all-gather hands every value to every rank, while the owners
# receive only the rows that differ from a rank's blank row (sorted ids: the few systems that
# cross a shard boundary) and all-gather their folded slices, ``(ranks - 1) / ranks`` of the
# values, for two more collectives' latency.
OWNERS_FROM = 1024


class _Exchange:
  """Per-system float64 results reduced across the rows' group, the same bits on every rank.

  Each value is folded by one fold in rank order (a float64 sum's bits depend on its order):
  at every rank alike after an all-gather of every rank's values, or, for large exchanges, at
  its owner, the folded slices then all-gathered (:meth:`_by_owners`).
  """

  def __init__(self, group: Any, device: torch.device):
    self.group = group
    self.ranks = dist.get_world_size(group)
    self.device = device

  def reduce(self, fields: list[tuple[torch.Tensor, str]],
             touched: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each float64 tensor reduced over the ranks by its operator ("sum", "max", "min"; "dd":
    a (K, 2) tensor of double-doubles). With ``touched`` (K booleans: the systems this rank
    holds an element of), the fields of K rows are per-system and the others scalars; a rank
    sends the owners the rows of its touched systems (and any other row that differs from an
    untouched one), so only systems held by several ranks travel twice."""
    if touched is not None and self._per_system_values(fields, touched) >= OWNERS_FROM:
      return self._by_owners(fields, touched)
    flat = [t.reshape(-1).to(torch.float64) for t, _ in fields]
    sizes = [t.numel() for t in flat]
    mine = torch.cat(flat) if len(flat) > 1 else flat[0]
    n = mine.numel()
    every = torch.empty(self.ranks * n, dtype=torch.float64, device=self.device)
    TRAFFIC.bytes_sent += n * 8
    dist.all_gather_single(every, mine.contiguous(), group=self.group)
    every = every.view(self.ranks, n)
    folded = torch.cat([_fold(part, op) for part, (_, op) in
                        zip(torch.split(every, sizes, dim=1), fields)])
    return [part.reshape(t.shape) for part, (t, _) in zip(torch.split(folded, sizes), fields)]

  def _per_system_values(self, fields, touched: torch.Tensor) -> int:
    """The per-system values of an exchange (0 with one rank: nothing to own)."""
    K = touched.numel()
    if self.ranks < 2 or K < 2:
      return 0
    return sum(t.numel() for t, _ in fields if t.dim() and t.shape[0] == K)

  def _by_owners(self, fields, touched: torch.Tensor) -> list[torch.Tensor]:
    """The exchange by owners: systems cut into equal slices, one per rank.

    1. an all-to-all of a header to every rank: this rank's blank row (an untouched system's
       values), its scalars, and how many rows it sends the rank (-1: the whole slice, where
       that is smaller than the rows with their indices);
    2. an all-to-all of the rows that differ from the blank row, each with its index in the
       owner's slice. The sizes are read on the host once (the all-to-all needs them there);
    3. the owner rebuilds every rank's slice (the blank row where a rank sent none) and folds
       it as :func:`_fold` folds an all-gather's values, so the bits are the all-gather way's;
    4. an all-gather of the folded slices; the scalars every rank folds from the headers.
    """
    K, ranks, me = touched.numel(), self.ranks, dist.get_rank(self.group)
    per_system = [t.dim() > 0 and t.shape[0] == K for t, _ in fields]
    rows = torch.cat([t.reshape(K, -1).to(torch.float64)
                      for (t, _), keep in zip(fields, per_system) if keep], 1)
    scalars = [t.reshape(-1).to(torch.float64) for (t, _), keep in zip(fields, per_system)
               if not keep]
    scalars = torch.cat(scalars) if scalars else rows.new_zeros(0)
    width, m = rows.shape[1], scalars.numel()
    # The blank row: an untouched system's (what every system this rank holds no element of
    # reduces to here; row 0 where it holds them all). Rows equal to it bit for bit stay
    # home, and the owner puts it back.
    blank = rows.index_select(0, (~touched).to(torch.uint8).argmax().reshape(1))[0]
    sent = (rows.view(torch.int64) != blank.view(torch.int64)).any(1)
    bounds = [o * K // ranks for o in range(ranks + 1)]
    lengths = torch.tensor(bounds[1:], device=rows.device) - torch.tensor(bounds[:-1],
                                                                          device=rows.device)
    owner = torch.bucketize(torch.arange(K, device=rows.device),
                            torch.tensor(bounds[1:-1], device=rows.device), right=True)
    counts = torch.zeros(ranks, dtype=torch.int64, device=rows.device).index_add_(
        0, owner, sent.to(torch.int64))
    # An owner gets the rows with their indices, or its whole slice where that is smaller
    # (ids interleaved: every rank holds some of every system): a count of -1 says so.
    whole = counts * (width + 1) >= lengths * width
    header = torch.cat([torch.where(whole, -1, counts).to(torch.float64)[:, None],
                        torch.cat([blank, scalars]).expand(ranks, width + m)], 1)
    headers = torch.empty_like(header)
    dist.all_to_all_single(headers, header.contiguous(), group=self.group)
    lo, hi = bounds[me], bounds[me + 1]
    # The exchange's one host read: the sizes (the all-to-all below needs them on the host).
    sizes = torch.cat([counts.to(torch.float64), header[:, 0], headers[:, 0]]).to(
        torch.int64).tolist()
    held, sizes = sizes[:ranks], sizes[ranks:]
    index = torch.nonzero_static(sent, size=sum(held))[:, 0]  # sorted: owners' runs in order
    parts, start = [], 0
    for o in range(ranks):
      if sizes[o] < 0:
        parts.append(rows[bounds[o]:bounds[o + 1]].reshape(-1))
      else:
        theirs = index[start:start + held[o]]
        parts.append(torch.cat([(theirs - bounds[o]).to(torch.float64)[:, None], rows[theirs]],
                               1).reshape(-1))
      start += held[o]
    sending = [part.numel() for part in parts]
    receiving = [(hi - lo) * width if n < 0 else n * (width + 1) for n in sizes[ranks:]]
    received = torch.empty(sum(receiving), dtype=torch.float64, device=self.device)
    # What leaves this rank: the header to every other rank, what other owners own.
    TRAFFIC.bytes_sent += ((ranks - 1) * header.shape[1] + sum(sending) - sending[me]) * 8
    dist.all_to_all_single(received, torch.cat(parts), receiving, sending, group=self.group)
    slices = headers[:, 1:1 + width, None].expand(ranks, width, hi - lo).transpose(1, 2).clone()
    for sender, part in enumerate(torch.split(received, receiving)):
      if sizes[ranks + sender] < 0:
        slices[sender] = part.view(hi - lo, width)
      else:
        part = part.view(-1, width + 1)
        slices[sender, part[:, 0].to(torch.int64)] = part[:, 1:]
    ops = [op for (_, op), keep in zip(fields, per_system) if keep]
    columns = [t.reshape(K, -1).shape[1] for (t, _), keep in zip(fields, per_system) if keep]
    folded = torch.cat([_fold(part, op).reshape(hi - lo, -1)
                        for part, op in zip(torch.split(slices, columns, 2), ops)], 1)
    most = -(-K // ranks)
    mine = rows.new_zeros(most, width)
    mine[:hi - lo] = folded
    every = torch.empty(ranks * most, width, dtype=torch.float64, device=self.device)
    TRAFFIC.bytes_sent += mine.numel() * 8
    dist.all_gather_single(every, mine, group=self.group)
    every = every.view(ranks, most, width)
    reduced_rows = torch.cat([every[o, :bounds[o + 1] - bounds[o]] for o in range(ranks)])
    every_scalars = headers[:, 1 + width:]
    scalar_ops = [op for (_, op), keep in zip(fields, per_system) if not keep]
    scalar_sizes = [t.numel() for (t, _), keep in zip(fields, per_system) if not keep]
    reduced_scalars = [_fold(part, op) for part, op in
                       zip(torch.split(every_scalars, scalar_sizes, 1), scalar_ops)]
    by_rows = iter(torch.split(reduced_rows, columns, 1))
    by_scalars = iter(reduced_scalars)
    return [(next(by_rows) if keep else next(by_scalars)).reshape(t.shape).contiguous()
            for (t, _), keep in zip(fields, per_system)]

  def gather_objects(self, value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order."""
    return all_gather_objects(value, self.group, self.ranks)


def _fold(every: torch.Tensor, op: str) -> torch.Tensor:
  """(ranks, n) values folded over the ranks: the same operator on the same values gives the
  same bits on every rank."""
  if op == "dd":
    pairs = every.reshape(every.shape[0], -1, 2)
    hi, lo = pairs[0, :, 0], pairs[0, :, 1]
    for rank in range(1, pairs.shape[0]):
      hi, lo = dd_add(hi, lo, pairs[rank, :, 0], pairs[rank, :, 1])
    return torch.stack([hi, lo], 1).reshape(-1)
  return every.sum(0) if op == "sum" else every.amax(0) if op == "max" else every.amin(0)


def dd_add(ah, al, bh, bl):
  """(ah + al) + (bh + bl) in double-double, within 3 u**2 / (1 - 4 u) of the exact sum
  relative, whatever the signs (Joldes, Muller, Popescu 2017, AccurateDWPlusDW)."""
  sh, sl = two_sum(torch, ah, bh)
  th, tl = two_sum(torch, al, bl)
  vh, vl = fast_two_sum(torch, sh, sl + th)
  return fast_two_sum(torch, vh, tl + vl)


class ReducingKernels(EagerKernels):
  """The eager passes over this rank's rows, each pass's results reduced across the ranks.

  The first exchange also carries what ``prepare`` found: the per-system element counts, the
  factor bits of float64 systems, and whether this rank's ids are in range; after it the
  batch holds the reduced counts and bits, and :attr:`invalid` whether any rank's checks
  failed.
  """

  def __init__(self, exchange: _Exchange, checks_passed: bool, factor_bits_vary: bool = True):
    self.exchange = exchange
    # A float64 system's factor bits are 24 when it holds a narrower element, which a rank
    # sees in its own rows only; with every leaf float64 they are 53 on every rank.
    self.factor_bits_vary = factor_bits_vary
    self.invalid = torch.zeros((), dtype=torch.float64, device=exchange.device)
    if not checks_passed:
      self.invalid = self.invalid + 1
    self._local_counts: torch.Tensor | None = None
    self._first: list[tuple[torch.Tensor, str]] | None = None
    self._batch: Batch | None = None

  def prepare(self, batch: Batch) -> Batch:
    batch = super().prepare(batch)
    K = batch.num_systems
    if batch.seg_range is not None:
      r = batch.seg_range
      self.invalid = torch.maximum(self.invalid, ((r[:, 0] < 0) | (r[:, 1] >= K)).any().to(
          torch.float64))
      batch.seg_range = None  # checked on every rank at once, with the decisions' read
    self._local_counts = batch.counts
    prec = batch.prec
    self._first = [(self.invalid, "max"), (batch.counts, "sum")]
    if batch.norm64 and self.factor_bits_vary:
      prec = prec.to(torch.float64) if isinstance(prec, torch.Tensor) else torch.full(
          (K,), float(prec), dtype=torch.float64, device=self.exchange.device)
      self._first.append((prec, "min"))
    self._batch = batch
    return batch

  def _reduce(self, fields: list[tuple[torch.Tensor, str]]) -> list[torch.Tensor]:
    first, self._first = self._first or [], None
    reduced = self.exchange.reduce(first + fields, touched=self._local_counts > 0)
    if first:
      self.invalid, self._batch.counts = reduced[0], reduced[1]
      if len(first) == 3:
        prec = reduced[2].to(torch.int64)
        self._batch.prec = prec if self._batch.per_system else int(prec[0])
    return reduced[len(first):]

  def _depth(self, depth: Any) -> torch.Tensor:
    """A rank's depth bound (a number, or per system) as one bound for every system, to be
    reduced by ``max``: the sums' tree across ranks is ``ranks - 1`` additions deeper than
    the deepest rank's, and one bound per call sends one value, not one per system (a small
    system's interval takes the largest system's relative width, still far inside the
    grids the decisions are taken on)."""
    if isinstance(depth, torch.Tensor):
      return depth.amax().reshape(1).to(torch.float64)
    return torch.full((1,), float(depth), dtype=torch.float64, device=self.exchange.device)

  def power_sums(self, batch: Batch, p: float, scale: torch.Tensor | None = None):
    total, depth = super().power_sums(batch, p, scale)
    total, depth = self._reduce([(total, "sum"), (self._depth(depth), "max")])
    return total, depth + (self.exchange.ranks - 1)

  def extremes(self, batch: Batch, want_min: bool):
    big, small = super().extremes(batch, want_min)
    if not want_min:
      return self._reduce([(big, "max")])[0], None
    # A rank holding no element of a system has no minimum: +inf, not the 0 of an empty one.
    if batch.per_system:
      small = torch.where(self._local_counts > 0, small, math.inf)
    elif batch.numel == 0:
      small = torch.full_like(small, math.inf)
    big, small = self._reduce([(big, "max"), (small, "min")])
    return big, torch.where(batch.counts > 0, small, 0.0)

  def step_sums(self, batch: Batch):
    best, longest = super().step_sums(batch)
    best, longest = self._reduce([(best, "max"), (self._depth(longest), "max")])
    return best, int(longest[0])

  def _accumulate_pieces(self, batch: Batch, p: int, params: torch.Tensor):
    # A rank's four sums travel as one double-double, two values a system, not four; they are
    # added across ranks in double-double, whose rounding :meth:`pieces_sharing_error` bounds.
    acc, depth = super()._accumulate_pieces(batch, p, params)
    q1, q2, qt, rest = acc.unbind(1)
    s, e1 = two_sum(torch, q1, q2)
    s, e2 = two_sum(torch, s, qt)
    s, e3 = two_sum(torch, s, rest)
    hi, lo = fast_two_sum(torch, s, (e1 + e2) + e3)
    summed, depth = self._reduce([(torch.stack([hi, lo], 1), "dd"), (self._depth(depth), "max")])
    acc = torch.zeros_like(acc)
    acc[:, :2] = summed
    return acc, depth + (self.exchange.ranks - 1)

  def pieces_sharing_error(self, pieces, n: torch.Tensor, params: torch.Tensor,
                           total_abs: torch.Tensor) -> torch.Tensor:
    # The terms are >= 0; of the pieces only q2 (each below the grid step sig1 2**-52) and
    # rest can be negative, so this bounds the sum of every rank's pieces' magnitudes:
    magnitudes = ((pieces.q1 + pieces.q2 + pieces.qt).abs()
                  + 2 * (n * params[:, 2] * 2.0 ** -52 + total_abs) + pieces.bound)
    # each rank's double-double rounds (e1 + e2) + e3 twice, each time within u of terms
    # within u of the pieces: 6 u**2 of their magnitudes; then ranks - 1 additions, each
    # within 3 u**2 / (1 - 4 u) of a partial sum (:func:`dd_add`), which the magnitudes bound
    # too. (4 ranks + 3) u**2, with room: (ranks + 1) 2**-103.
    return (self.exchange.ranks + 1) * 2.0 ** -103 * magnitudes


@dataclasses.dataclass
class _Agreement:
  """The decisions' read, checked first (every rank leaves together when any rank's checks
  failed: a value every rank shares), and the open systems' exact norms from every rank's."""

  kernels: ReducingKernels

  def add(self, reader: HostRead) -> None:
    reader.add("ranks_invalid", self.kernels.invalid.reshape(1))

  def check(self, read: dict[str, np.ndarray]) -> None:
    if read["ranks_invalid"][0]:
      raise AbandonedCall

  def oracles(self, batch: Batch, kind: str, p: float, systems: list[int]) -> dict[int, Any]:
    """Exact oracles of ``systems`` (the same list on every rank: it comes from reduced
    values) from every rank's exact partials of its own rows: exact power sums added (p = 1,
    2, any integer p), the largest exact step norm, or, for a non-integer p, enclosures of
    the power sums added (:func:`.oracles.shared_power_oracles`)."""
    if not systems:
      return {}
    mine = exact_oracles(batch, kind, p, systems)
    if kind == "sum" and not float(p).is_integer():
      shared = shared_power_oracles([mine[k] for k in systems], p,
                                    self.kernels.exchange.gather_objects)
      return dict(zip(systems, shared))
    if kind == "step" or p in (1.0, 2.0):
      partial = [mine[k].power_sum for k in systems]
    else:
      partial = [mine[k].exact_power_sum() for k in systems]
    every = self.kernels.exchange.gather_objects(partial)
    if kind == "step":
      return {k: SumOracle(max(e[i] for e in every), 2) for i, k in enumerate(systems)}
    return {k: SumOracle(sum((e[i] for e in every), Fraction(0)), int(p))
            for i, k in enumerate(systems)}


def _piece_rows(leaf: Any) -> tuple[int, int]:
  """(first row, rows) of this rank's piece of ``leaf``."""
  return piece_extent(leaf, 0, leaf.device_mesh.get_coordinate())


def _measured_here(leaf: Any, way: str, first_rank: bool) -> bool:
  """Whether this rank's piece of ``leaf`` counts in the reduced measures, so that every
  element counts once: split rows always; a piece where this rank is first along every mesh
  dimension that copies it; a whole leaf at the group's first rank."""
  if way == "rows":
    return True
  if way == "pieces":
    mesh = leaf.device_mesh
    return bool(geometry(leaf).measured[np.ravel_multi_index(mesh.get_coordinate(),
                                                              tuple(mesh.shape))])
  return first_rank


def clip(leaves: list[Any], call: Any, ways: list[str]):
  """(outputs, norms) by exchanged measures, or None where the call must gather instead
  (every rank returns None alike)."""
  from torch.distributed.tensor import DTensor  # pylint: disable=import-outside-toplevel
  pieces = local_pieces(leaves, ways)
  if pieces is None:
    return None
  split_at, group, local = pieces
  first_rank = dist.get_rank(group) == 0
  device = local[0].device
  segments = call.segments
  valid = True
  if segments is not None:
    # Whole ids are cut at this rank's chunk of rows; rows that are not its chunk (from_local
    # of other sizes) leave that cut unknown, and the call to the gathering way.
    local_rows = [t.shape[0] if t.dim() else 1 for t in local]
    order = _MeshOrder(group)
    me = dist.get_rank(group)
    starts = np.zeros(len(leaves), np.int64)
    for i in split_at:
      if ways[i] == "pieces":
        starts[i], rows = _piece_rows(leaves[i])
        valid = valid and rows == local_rows[i]
        continue
      start, rows = _chunks(np.array([leaves[i].shape[0]], np.int64),
                            order.coordinates(leaves[i].device_mesh)[None, :])
      starts[i] = start[0, me]
      valid = valid and int(rows[0, me]) == local_rows[i]
    segments = [_local_segments(x, w, s, int(o), n)
                for x, w, s, o, n in zip(leaves, ways, segments, starts, local_rows)]
  threshold = call.threshold
  if isinstance(threshold, DTensor):
    threshold = full_tensor(threshold)
  op = call.op
  kind = kind_of(op, call.norm_type)
  p = 2.0 if op == "clip_by_max_step" else check_norm_type(call.norm_type)
  try:
    checked_leaves, dtypes = check_leaves_and_dtypes([t.detach() for t in local])
    ids, K = check_segments(checked_leaves, segments, call.num_systems, ids_on_device=True)
    checked = check_threshold(threshold, call.threshold_name,
                              None if op == "clip_grad_norm" else K, device=device)
    nonfinite = check_nonfinite(call.nonfinite)
  except (TypeError, ValueError):
    if segments is None:
      return None  # the checks of a call without ids read what every rank shares: all fail
    valid = False
  if valid and K != _system_count(call):
    valid = False  # a count the exchanges cannot carry: every rank finds the same
  if not valid:
    # Take part in the exchanges with no rows, and say so: every rank then gathers.
    checked_leaves, ids = [], None
    K = _system_count(call)
    checked = check_threshold(math.inf, call.threshold_name, None, device=device)
    nonfinite = "propagate"
  exchange = _Exchange(group, device)
  kernels = ReducingKernels(exchange, valid, factor_bits_vary=any(
      x.dtype != torch.float64 for x in leaves))
  with torch.no_grad():
    batch = make_batch(checked_leaves, ids, K, dtypes)
    batch.device = device
    batch.norm64 = any(x.dtype == torch.float64 for x in leaves)
    batch.per_system = segments is not None
    if nonfinite == "zero":
      batch = sanitize(batch)
    counted = [_measured_here(x, w, first_rank) for x, w in zip(leaves, ways)] if valid else []
    measured_batch = batch.with_leaves([
        leaf if keep else dataclasses.replace(leaf, rows=0)
        for leaf, keep in zip(batch.leaves, counted)])
    measured_batch = kernels.prepare(measured_batch)
    for leaf, keep in zip(batch.leaves, counted):
      if not keep and leaf.seg is not None:  # measured by the first rank, which checks its ids
        leaf.seg = leaf.seg.clamp(0, K - 1)
    c = checked.on(device)
    measured = measure(kernels, measured_batch, kind, p)
    try:
      plan = decide_agreed(kernels, measured_batch, measured, checked, c, kind, p)
    except AbandonedCall:
      return None
    outs = kernels.apply(batch, plan)
  outputs = []
  for out, x, way in zip(outs, leaves, ways):
    outputs.append(like_input(out, x) if way == "gathered" else _as_output(out, x))
  norms = plan.norms.to(torch.float64 if measured_batch.norm64 else torch.float32)
  return outputs, norms


def decide_agreed(kernels: ReducingKernels, batch: Batch, measured: Measured,
                  threshold: Threshold, c: torch.Tensor, kind: str, p: float) -> Plan:
  """:func:`.decisions.decide` on the reduced measures, leaving with every rank
  (:class:`AbandonedCall`) when the agreement's read says so."""
  return decide(batch, measured, threshold, c, kind, p, hook=_Agreement(kernels))
