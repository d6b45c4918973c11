"""The partials way of a sharded call on CPU DTensors: each rank clips its own rows from block
results exchanged over the leaves' process group (see :mod:`.sharded` for when it applies).

One rank's call:

1. its piece of each leaf (``to_local()``: its rows, or its rows' columns; a replicated leaf
   whole; a leaf of another placement made whole by ``full_tensor()``), its rows' segment
   ids, the checks of the unsharded call applied to them;
2. every rank's piece of each split leaf, from metadata (DTensor's chunks: rows, and columns
   as stretches of each row; a copy along a ``Replicate`` mesh dimension counts no rows). A
   rank whose piece is other (``from_local`` of other sizes) says so with the first exchange
   of block results, taking part with zeros, and every rank then leaves for the gathering way.
   A per-system call first all-gathers whether each rank's checks passed (ids in range in its
   rows) and the span of systems it holds, then its rows per system over those spans
   (:meth:`GlooCollective.all_gather_layout`). A failed check sends every rank the gathering
   way, whose unsharded call raises its error on every rank;
3. the numba kernels' sharded general route (:mod:`clipbench.impls.own.numba.sharded`): block
   results exchanged, folded in the unsharded order, each rank scaling its own rows;
4. each output back as a DTensor with its leaf's mesh, placements, shape and stride (its
   local rows are this rank's piece already: no communication).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import pickle
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from clipbench.impls.own.numba import sharded as numba_sharded
from clipbench.impls.own.numba import threads
from clipbench.impls.own.numba.decode import DTYPES
from clipbench.impls.own.numba.layout import SUB_BLOCK, leaf_layout_of
from clipbench.impls.own.numba.segments import NO_SEGMENTS, checked_segments
from clipbench.impls.own.torch import host_route
from clipbench.impls.own.torch.arguments import (check_leaves, check_nonfinite, check_norm_type,
                                                 check_segments, check_threshold)

_NUMPY_DTYPE = {torch.float16: DTYPES[0], torch.bfloat16: DTYPES[1], torch.float32: DTYPES[2],
                torch.float64: DTYPES[3]}


@dataclasses.dataclass
class Traffic:
  """Bytes this process handed to the collectives of sharded calls, and the calls made."""

  bytes_sent: int = 0
  calls: int = 0
  gathered_calls: int = 0  # calls that took the gathering way

  def snapshot(self) -> "Traffic":
    return dataclasses.replace(self)


TRAFFIC = Traffic()


def full_tensor(value: Any) -> Any:
  """``value.full_tensor()``, this rank's local bytes counted as sent (a replicated value is
  whole on every rank already: nothing moves)."""
  local = value.to_local()
  if all(p.is_replicate() for p in value.placements):
    return local
  TRAFFIC.bytes_sent += local.numel() * local.element_size()
  return value.full_tensor()


def all_gather_objects(value: Any, group: Any, ranks: int) -> list[Any]:
  """Every rank's picklable ``value``, in rank order; its pickle is counted as sent."""
  TRAFFIC.bytes_sent += len(pickle.dumps(value))
  every: list[Any] = [None] * ranks
  dist.all_gather_object(every, value, group=group)
  return every


def like_input(output: Any, leaf: Any) -> Any:
  """``output`` (whole, the same on every rank) as a DTensor with ``leaf``'s mesh and placements.

  ``from_local`` with ``Replicate`` states a fact (every rank holds the same whole value),
  checked by nothing (``run_check=False``); ``redistribute`` to ``Shard`` then keeps this
  rank's chunk, a local slice with no communication.
  """
  from torch.distributed.tensor import DTensor, Replicate  # pylint: disable=import-outside-toplevel
  mesh = leaf.device_mesh
  placements = [Replicate() if p.is_partial() else p for p in leaf.placements]
  replicated = DTensor.from_local(output, mesh, [Replicate()] * mesh.ndim, run_check=False)
  return replicated.redistribute(mesh, placements)


class AbandonedCall(Exception):
  """Raised on every rank by the exchange that carried a rank's word that its rows are not
  where the others assumed (:meth:`GlooCollective.vouch`)."""


class GlooCollective:
  """:class:`clipbench.impls.own.numba.sharded.Collective` over a process group."""

  def __init__(self, group: Any):
    self.group = group
    self.rank = dist.get_rank(group)
    self.size = dist.get_world_size(group)
    self._vouch: bool | None = None

  def vouch(self, valid: bool) -> None:
    """Sends ``valid`` (this rank's rows are where every rank assumes) with the next
    all-gather, which then raises :class:`AbandonedCall` on every rank if any rank's is false:
    a call whose layout every rank knows from metadata agrees on it without a round of its
    own."""
    self._vouch = valid

  def all_gather_bytes(self, payload: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    vouch, self._vouch = self._vouch, None
    if vouch is None:
      return self._all_gather(payload, sizes)
    word = np.array([int(vouch)], np.int64).view(np.uint8)
    every = self._all_gather(np.concatenate([word, payload]), [n + word.size for n in sizes])
    if not all(e[:word.size].view(np.int64)[0] == 1 for e in every):
      raise AbandonedCall
    return [e[word.size:] for e in every]

  def _all_gather(self, payload: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    width = max(sizes)
    if width == 0:  # every rank knows every size: all skip alike
      return [np.zeros(0, np.uint8) for _ in sizes]
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[:payload.size] = torch.from_numpy(payload)
    every = [torch.empty(width, dtype=torch.uint8) for _ in range(self.size)]
    TRAFFIC.bytes_sent += width
    dist.all_gather(every, mine, group=self.group)
    return [t[:n].numpy() for t, n in zip(every, sizes)]

  def all_to_all_bytes(self, payloads: list[np.ndarray], sizes: list[int]) -> list[np.ndarray]:
    send = np.concatenate(payloads) if payloads else np.zeros(0, np.uint8)
    received = torch.empty(sum(sizes), dtype=torch.uint8)
    TRAFFIC.bytes_sent += send.size
    dist.all_to_all_single(received, torch.from_numpy(send), list(sizes),
                           [p.size for p in payloads], group=self.group)
    return np.split(received.numpy(), np.cumsum(sizes)[:-1])

  def all_gather_objects(self, value: Any) -> list[Any]:
    return all_gather_objects(value, self.group, self.size)

  def holds_next_round(self) -> bool:
    return False

  def all_gather_layout(self, header: np.ndarray, counts: np.ndarray):
    """Every rank's int64 ``header`` (equally long on every rank) and int32 per-system
    ``counts`` (leaves, systems), as (headers, counts) with rows by rank.

    Each leaf's counts travel only over the span of systems the rank holds rows of (sorted ids
    put a rank's systems in one run): the spans go in the header, the counts in a second
    all-gather of known sizes, so a rank sends its own systems' counts, not every system's."""
    nl, systems = counts.shape
    held = counts != 0
    first = np.where(held.any(1), held.argmax(1), 0)
    last = np.where(held.any(1), systems - held[:, ::-1].argmax(1), 0)
    spans = np.stack([first, last], 1).reshape(-1)
    mine = np.concatenate([header.astype(np.int64), spans]).view(np.uint8)
    every = [e.view(np.int64) for e in self.all_gather_bytes(mine, [mine.size] * self.size)]
    every_spans = [e[header.size:].reshape(nl, 2) for e in every]
    payload = np.concatenate([counts[i, a:b] for i, (a, b) in enumerate(spans.reshape(nl, 2))]
                             + [np.zeros(0, np.int32)]).astype(np.int32)
    sizes = [int((sp[:, 1] - sp[:, 0]).sum()) * 4 for sp in every_spans]
    received = self.all_gather_bytes(payload.view(np.uint8), sizes)
    every_counts = np.zeros((self.size, nl, systems), np.int32)
    for g, (sp, data) in enumerate(zip(every_spans, received)):
      cursor = 0
      for i, (a, b) in enumerate(sp):
        every_counts[g, i, a:b] = data[cursor * 4:(cursor + b - a) * 4].view(np.int32)
        cursor += b - a
    return np.stack([e[:header.size] for e in every]), every_counts


def _chunks(rows: np.ndarray, coordinates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(starts, rows) of each rank's ``Shard(0)`` chunk of leaves of ``rows`` rows on 1-D meshes
  (``coordinates``: leaves by group rank): DTensor's chunking (``torch.chunk``:
  ``ceil(rows / ranks)`` rows per rank in mesh order, the last ones short or empty)."""
  chunk = -(-rows // coordinates.shape[1])
  starts = np.minimum(coordinates * chunk[:, None], rows[:, None])
  return starts, np.minimum(chunk[:, None], rows[:, None] - starts)


class _MeshOrder:
  """Each group rank's coordinate on each of the leaves' 1-D meshes (the meshes may order
  their ranks differently; :func:`.sharded._partial_ways` admits meshes of the same members
  only, so one group's ranks are on all of them)."""

  def __init__(self, group: Any):
    self.ranks = np.array(dist.get_process_group_ranks(group))
    self._of: dict[int, np.ndarray] = {}

  def coordinates(self, mesh: Any) -> np.ndarray:
    """Mesh coordinate by group rank (its flat index on a larger mesh)."""
    if id(mesh) not in self._of:
      members = mesh.mesh.reshape(-1).tolist()
      self._of[id(mesh)] = np.array([members.index(r) for r in self.ranks.tolist()])
    return self._of[id(mesh)]


def piece_extent(leaf: Any, dim: int, coordinate: Any) -> tuple[int, int]:
  """(start, size) along ``dim`` of the piece of ``leaf`` at mesh ``coordinate``."""
  return _extent(tuple(leaf.placements), tuple(leaf.shape), tuple(leaf.device_mesh.shape),
                 dim, tuple(int(c) for c in coordinate))


def _extent(placements: tuple, shape: tuple, mesh_shape: tuple, dim: int,
            coordinate: tuple) -> tuple[int, int]:
  """DTensor's chunking (``torch.chunk``: ``ceil(n / ranks)`` a rank, the last short or
  empty) of axis ``dim`` by every mesh dimension that splits it, in mesh order."""
  size = shape[dim] if shape else 1
  start = 0
  for mesh_dim, placement in enumerate(placements):
    if placement.is_shard(dim):
      chunk = -(-size // mesh_shape[mesh_dim])
      first = min(coordinate[mesh_dim] * chunk, size)
      start, size = start + first, min(chunk, size - first)
  return start, size


class _Geometry(NamedTuple):
  """Every mesh position's piece of a leaf (positions in the mesh's flat order)."""

  starts: np.ndarray  # first row
  rows: np.ndarray
  columns: np.ndarray  # (positions, 2): the elements [start, stop) of each row it holds
  measured: np.ndarray  # bool: the first of its copies (along ``Replicate`` mesh dimensions)


@functools.lru_cache(maxsize=4096)
def _geometry(placements: tuple, shape: tuple, mesh_shape: tuple) -> _Geometry:
  inner = math.prod(shape[2:])
  places = list(np.ndindex(*mesh_shape))
  rows = np.array([_extent(placements, shape, mesh_shape, 0, c) for c in places], np.int64)
  columns = np.array([_extent(placements, shape, mesh_shape, 1, c) if len(shape) > 1
                      else (0, 1) for c in places], np.int64)
  columns = np.stack([columns[:, 0], columns.sum(1)], 1) * inner
  measured = np.array([all(c == 0 for c, p in zip(place, placements) if p.is_replicate())
                       for place in places])
  return _Geometry(rows[:, 0], rows[:, 1], columns, measured)


def geometry(leaf: Any) -> _Geometry:
  return _geometry(tuple(leaf.placements), tuple(leaf.shape), tuple(leaf.device_mesh.shape))


def column_pieces(leaf: Any) -> bool:
  """Whether the numba route reads ``leaf``'s pieces in place. Its bits come from sub-blocks
  of ``SUB_BLOCK`` elements in the order of the rows, and a sub-block two ranks share travels
  as its elements: so only pieces split along the rows and the second axis (a rank's elements
  of a row are one stretch), each stretch whole rows or at least ``SUB_BLOCK`` elements (at
  most two shared sub-blocks a row, and the plan's pieces few). Narrower columns (a
  relaxation's 3-vectors) are made whole instead: in place, every sub-block would travel,
  in pieces of one or two elements."""
  if not all(not p.is_shard() or p.dim in (0, 1) for p in leaf.placements):
    return False
  geo = geometry(leaf)
  width = geo.columns[:, 1] - geo.columns[:, 0]
  rowsize = math.prod(leaf.shape[1:])
  return bool(np.all((width == 0) | (width == rowsize) | (width >= SUB_BLOCK)))


def _to_local(x: Any) -> torch.Tensor:
  """``x.to_local()``, without the autograd node that costs most of its time (about 2.5 us a
  leaf): the rows are only read, and the call's outputs carry no graph."""
  local = getattr(x, "_local_tensor", None)
  return local if isinstance(local, torch.Tensor) else x.to_local()


@functools.lru_cache(maxsize=1024)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
  strides, step = [], 1
  for n in reversed(shape):
    strides.append(step)
    step *= max(n, 1)
  return tuple(reversed(strides))


def _as_output(local: torch.Tensor, leaf: Any) -> Any:
  """This rank's output rows as a DTensor placed like ``leaf`` (a local piece: nothing moves).

  The output has the leaf's spec (mesh, placements, shape, dtype, contiguous stride), so it is
  built on that spec directly: ``from_local`` costs ~15 us a leaf, most of a 200-leaf call's
  Python time; it remains the way where the spec differs (a non-contiguous leaf).
  """
  from torch.distributed.tensor import DTensor  # pylint: disable=import-outside-toplevel
  spec = getattr(leaf, "_spec", None)
  if spec is not None and leaf.stride() == _contiguous_strides(leaf.shape):
    try:
      return DTensor(local, spec, requires_grad=False)
    except TypeError:  # another torch's constructor
      pass
  return DTensor.from_local(local, leaf.device_mesh, leaf.placements, run_check=False,
                            shape=leaf.shape)


def _system_count(call: Any) -> int:
  """The systems the exchanged counts describe: from the arguments alone, so that every rank
  sends a message of one length even where its checks fail."""
  if call.segments is None:
    return 1
  try:
    count = operator.index(call.num_systems)
  except TypeError:
    return 1
  return count if 0 < count < 1 << 31 else 1


def _local_segments(leaf: Any, way: str, seg: Any, offset: int, local_rows: int) -> Any:
  """This rank's ids of ``leaf``'s rows it holds (a DTensor placed like the leaf keeps its
  piece; anything else is made whole, then cut)."""
  from torch.distributed.tensor import DTensor  # pylint: disable=import-outside-toplevel
  if isinstance(seg, DTensor):
    if (way in ("rows", "pieces") and seg.device_mesh == leaf.device_mesh
        and tuple(seg.placements) == _rows_placements(leaf)
        and seg.shape[:1] == leaf.shape[:1]):
      return seg.to_local()
    seg = full_tensor(seg)
  if isinstance(seg, (list, tuple)):
    try:
      seg = np.asarray(seg)
    except (TypeError, ValueError):
      return seg  # the checks below refuse it as the unsharded call does
  if way not in ("rows", "pieces") or not isinstance(seg, (torch.Tensor, np.ndarray)) or (
      seg.ndim != 1 or seg.shape[0] != leaf.shape[0]):
    return seg  # whole (or unusable: the checks below say so)
  return seg[offset:offset + local_rows]


def _rows_placements(leaf: Any) -> tuple:
  """The placements of ids that hold the ids of ``leaf``'s local rows: split where the leaf's
  rows are, whole elsewhere."""
  from torch.distributed.tensor import Replicate  # pylint: disable=import-outside-toplevel
  return tuple(p if p.is_shard(0) else Replicate() for p in leaf.placements)


def local_pieces(leaves: list[Any], ways: list[str]):
  """(indices of the split leaves (``"rows"``, ``"pieces"``), the group that holds every
  piece, this rank's tensor of every leaf), or None when no leaf is split (every leaf whole
  on every rank already: the unsharded call moves nothing). The group: the 1-D mesh's, or
  every rank (``sharded._disjoint_pieces`` admits larger meshes only over every rank)."""
  split_at = [i for i, w in enumerate(ways) if w in ("rows", "pieces")]
  if not split_at:
    return None
  mesh = leaves[split_at[0]].device_mesh
  group = mesh.get_group(0) if mesh.ndim == 1 else dist.group.WORLD
  local = [_to_local(x) if w != "gathered" else full_tensor(x) for x, w in zip(leaves, ways)]
  return split_at, group, local


class _Pieces(NamedTuple):
  """Every group rank's piece of every leaf, from metadata (leaves by group rank)."""

  starts: np.ndarray  # first row
  rows: np.ndarray
  columns: np.ndarray  # (leaves, ranks, 2): the elements [start, stop) of each row it holds
  measured: np.ndarray  # bool: its piece counts (the first of its copies)
  shapes: list  # this rank's expected local shape of each leaf


def _pieces(leaves: list[Any], ways: list[str], local: list[torch.Tensor], group: Any,
            me: int) -> _Pieces:
  """Where every rank's rows and columns of each leaf are: ``"rows"`` leaves by DTensor's
  chunks of a 1-D mesh, ``"pieces"`` by its chunks along rows and second axis on their mesh,
  anything else whole on every rank."""
  order = _MeshOrder(group)
  ranks, nl = order.ranks.size, len(leaves)
  local_rows = np.array([t.shape[0] if t.dim() else 1 for t in local], np.int64)
  rows = np.repeat(local_rows[:, None], ranks, 1)
  starts = np.zeros_like(rows)
  rowsizes = np.array([math.prod(x.shape[1:]) for x in leaves], np.int64)
  columns = np.zeros((nl, ranks, 2), np.int64)
  columns[:, :, 1] = rowsizes[:, None]
  measured = np.ones((nl, ranks), bool)
  shapes = [tuple(t.shape) for t in local]
  rows_at = [i for i, w in enumerate(ways) if w == "rows"]
  if rows_at:
    starts[rows_at], rows[rows_at] = _chunks(
        np.array([leaves[i].shape[0] for i in rows_at], np.int64),
        np.stack([order.coordinates(leaves[i].device_mesh) for i in rows_at]))
  for i in rows_at:
    shapes[i] = (int(rows[i, me]),) + tuple(leaves[i].shape[1:])
  for i in (i for i, w in enumerate(ways) if w == "pieces"):
    leaf, geo = leaves[i], geometry(leaves[i])
    at = order.coordinates(leaf.device_mesh)
    starts[i], rows[i], measured[i] = geo.starts[at], geo.rows[at], geo.measured[at]
    # A copy keeps whole rows: a group of its own in the plan's order, of no rows.
    columns[i, measured[i]] = geo.columns[at][measured[i]]
    mine = np.unravel_index(at[me], tuple(leaf.device_mesh.shape))
    shapes[i] = (int(rows[i, me]),) + tuple(
        piece_extent(leaf, d, mine)[1] for d in range(1, min(leaf.dim(), 2))) + tuple(
            leaf.shape[2:])
  return _Pieces(starts, rows, columns, measured, shapes)


def clip(leaves: list[Any], call: Any, ways: list[str]):
  """(outputs, norms) by exchanged partials, or None where the call must gather instead
  (every rank returns None alike)."""
  from torch.distributed.tensor import DTensor  # pylint: disable=import-outside-toplevel
  pieces = local_pieces(leaves, ways)
  if pieces is None:
    return None
  _, group, local = pieces
  collective = GlooCollective(group)
  me, nl = collective.rank, len(leaves)
  # Every rank's piece of each leaf by DTensor's chunking; a rank whose piece is other
  # (``from_local`` of other sizes) takes part with zeros and vouches against the call.
  where = _pieces(leaves, ways, local, group, me)
  chunked = all(tuple(t.shape) == shape for t, shape in zip(local, where.shapes))
  segments = call.segments
  if segments is not None:
    segments = [_local_segments(x, w, s, o, n) for x, w, s, o, n in zip(
        leaves, ways, segments, where.starts[:, me], where.rows[:, me])]
  threshold = call.threshold
  if isinstance(threshold, DTensor):
    threshold = full_tensor(threshold)
  op = call.op
  K = _system_count(call)
  try:
    checked_leaves = check_leaves([t.detach() for t in local])
    ids, num_systems = check_segments(checked_leaves, segments, call.num_systems)
    checked = check_threshold(threshold, call.threshold_name,
                              None if op == "clip_grad_norm" else num_systems)
    p = 2.0 if op == "clip_by_max_step" else check_norm_type(call.norm_type)
    nonfinite = check_nonfinite(call.nonfinite)
    host = [host_route.to_numpy(t) for t in checked_leaves]
    host_ids = None if ids is None else [g.numpy() for g in ids]
    segs = NO_SEGMENTS if ids is None else checked_segments(host, host_ids, num_systems)
    if num_systems != K:
      raise ValueError("the exchanged counts would not describe this call")
    valid = True
  except (TypeError, ValueError):
    valid = False
  if call.segments is None:
    # No ids: every rank's rows are known from metadata, the checks above read arguments every
    # rank shares (so fail on every rank alike), and whether the rows are the chunks travels
    # with the first exchange of block results.
    if not valid:
      return None
    if not chunked:
      host = [np.zeros(shape, _NUMPY_DTYPE[x.dtype]) if w in ("rows", "pieces") else h
              for x, w, h, shape in zip(leaves, ways, host, where.shapes)]
    collective.vouch(chunked)
    every_counts = np.where(where.measured, where.rows, 0).T[:, :, None]
  else:
    # Per-system counts, ``int32`` (rows below 2**31 per leaf): half the bytes of the exchange
    # that per-system calls pay per system, gathered with whether every rank's checks (ids in
    # range in its rows) passed. A copy of another rank's piece counts no rows.
    counts = np.zeros((nl, K), dtype=np.int32)
    valid = valid and chunked and max(t.shape[0] if t.dim() else 1 for t in local) < 1 << 31
    if valid:
      if host_ids is None:
        counts[:, 0] = [t.shape[0] if t.dim() else 1 for t in local]
      else:
        for i, g in enumerate(host_ids):
          counts[i] = np.bincount(g, minlength=K)
      counts[~where.measured[:, me]] = 0
    agreed, every_counts = collective.all_gather_layout(np.array([valid], np.int64), counts)
    if not agreed[:, 0].all():
      return None
  shards = _shard_layout(ways, where, every_counts)
  layout = leaf_layout_of([tuple(x.shape) for x in leaves], [_NUMPY_DTYPE[x.dtype]
                                                             for x in leaves])
  # Ranks share the machine's cores: the kernels take torch's intra-op thread count (torchrun
  # sets 1 per rank), as torch's own clipping on these tensors does.
  with threads.at_most(torch.get_num_threads()):
    try:
      outs, norms = numba_sharded.run(host, layout, checked.values, segs, shards, collective,
                                      p, nonfinite, step=op == "clip_by_max_step")
    except AbandonedCall:
      return None
  outputs = []
  for out, x, way in zip(outs, leaves, ways):
    t = host_route.to_tensor(out)
    if way == "gathered":
      outputs.append(like_input(t, x))
    else:
      outputs.append(_as_output(t, x))
  return outputs, torch.from_numpy(np.ascontiguousarray(np.asarray(norms).reshape(-1)))


def _shard_layout(ways: list[str], where: _Pieces,
                  every_counts: np.ndarray) -> numba_sharded.ShardLayout:
  """The :class:`~clipbench.impls.own.numba.sharded.ShardLayout` of each leaf's pieces
  (``where``) and every rank's per-system counts."""
  split = np.array([w in ("rows", "pieces") for w in ways])
  # Each leaf's ranks in the order of their rows, then columns (a rank holding none first at
  # its place); copies last.
  order = np.lexsort((where.rows, where.columns[:, :, 0], where.starts, ~where.measured))
  order = np.where(split[:, None], order, np.arange(where.rows.shape[1]))
  return numba_sharded.ShardLayout(np.ascontiguousarray(every_counts, np.int64),
                                   order.astype(np.int64), ~split, where.columns)
