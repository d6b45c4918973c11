"""The partials way of a sharded call on CPU DTensors: each rank clips its own rows from block
results exchanged over the leaves' process group (see :mod:`.sharded` for when it applies).

One rank's call:

1. its rows of each leaf (``to_local()``; a replicated leaf whole; a leaf of another placement
   made whole by ``full_tensor()``), its rows' segment ids, the checks of the unsharded call
   applied to them;
2. an all-gather of a few integers per leaf: whether the rank's checks passed, its rows'
   place in each leaf and, per-system, the span of systems it holds rows of; then one of its
   rows per system over those spans (:meth:`GlooCollective.all_gather_layout`); any failed
   check on any rank sends every rank the gathering way, whose unsharded call raises its
   error on every rank;
3. the numba kernels' sharded general route (:mod:`clipbench.impls.own.numba.sharded`): block
   results exchanged, folded in the unsharded order, each rank scaling its own rows;
4. each output back as a DTensor with its leaf's mesh, placements, shape and stride (its
   local rows are this rank's piece already: no communication).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from clipbench.impls.own.numba import sharded as numba_sharded
from clipbench.impls.own.numba import threads
from clipbench.impls.own.numba.decode import DTYPES
from clipbench.impls.own.numba.layout import leaf_layout_of
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
  """``value.full_tensor()``, this rank's local bytes counted as sent."""
  local = value.to_local()
  TRAFFIC.bytes_sent += local.numel() * local.element_size()
  return value.full_tensor()


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


class GlooCollective:
  """:class:`clipbench.impls.own.numba.sharded.Collective` over a process group."""

  def __init__(self, group: Any):
    self.group = group
    self.rank = dist.get_rank(group)
    self.size = dist.get_world_size(group)

  def all_gather_bytes(self, payload: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    width = max(sizes)
    if width == 0:  # every rank knows every size: all skip alike
      return [np.zeros(0, np.uint8) for _ in sizes]
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[:payload.size] = torch.from_numpy(payload)
    every = [torch.empty(width, dtype=torch.uint8) for _ in range(self.size)]
    TRAFFIC.bytes_sent += width
    dist.all_gather(every, mine, group=self.group)
    return [t[:n].numpy() for t, n in zip(every, sizes)]

  def all_gather_objects(self, value: Any) -> list[Any]:
    every: list[Any] = [None] * self.size
    dist.all_gather_object(every, value, group=self.group)
    return every

  def holds_next_round(self) -> bool:
    return False

  def all_gather_layout(self, header: np.ndarray, counts: np.ndarray):
    """Every rank's int64 ``header`` (equally long on every rank) and int32 per-system
    ``counts`` (leaves, systems), as (headers, counts) with rows by rank.

    One all-gather when there is one system (the counts are the header's rows). Otherwise
    each leaf's counts travel only over the span of systems the rank holds rows of (sorted ids
    put a rank's systems in one run): the spans go in the header, the counts in a second
    all-gather of known sizes, so a rank sends its own systems' counts, not every system's."""
    nl, systems = counts.shape
    if systems == 1:
      every = self.all_gather_bytes(header.astype(np.int64).view(np.uint8),
                                    [header.size * 8] * self.size)
      headers = np.stack([e.view(np.int64) for e in every])
      return headers, headers[:, 1:1 + 2 * nl:2].astype(np.int32)[:, :, None]
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


def _row_offset(x: Any, local_rows: int, coordinates: dict[int, tuple[int, int]]) -> int:
  """Where this rank's rows start in a ``Shard(0)`` leaf of a 1-D mesh, by DTensor's chunking
  (``torch.chunk``: ``ceil(rows / ranks)`` rows per rank in mesh order, the last ones short or
  empty), or -1 when its ``local_rows`` are not that chunk (``from_local`` of other sizes).
  ``coordinates`` caches this rank's coordinate and the mesh's size, per mesh."""
  mesh = x.device_mesh
  if id(mesh) not in coordinates:
    coordinates[id(mesh)] = (mesh.get_coordinate()[0], mesh.size())
  coordinate, ranks = coordinates[id(mesh)]
  rows = x.shape[0]
  chunk = -(-rows // ranks)
  start = min(coordinate * chunk, rows)
  return start if local_rows == min(chunk, rows - start) else -1


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
    if (way == "rows" and seg.device_mesh == leaf.device_mesh
        and tuple(seg.placements) == tuple(leaf.placements) and seg.shape[:1] == leaf.shape[:1]):
      return seg.to_local()
    seg = full_tensor(seg)
  if isinstance(seg, (list, tuple)):
    try:
      seg = np.asarray(seg)
    except (TypeError, ValueError):
      return seg  # the checks below refuse it as the unsharded call does
  if way != "rows" or not isinstance(seg, (torch.Tensor, np.ndarray)) or seg.ndim != 1 or (
      seg.shape[0] != leaf.shape[0]):
    return seg  # whole (or unusable: the checks below say so)
  return seg[offset:offset + local_rows]


def clip(leaves: list[Any], call: Any, ways: list[str]):
  """(outputs, norms) by exchanged partials, or None where the call must gather instead
  (every rank returns None alike)."""
  from torch.distributed.tensor import DTensor  # pylint: disable=import-outside-toplevel
  rows_at = [i for i, w in enumerate(ways) if w == "rows"]
  if not rows_at:
    return None  # every leaf whole on every rank already: the unsharded call moves nothing
  collective = GlooCollective(leaves[rows_at[0]].device_mesh.get_group(0))
  local = [x.to_local() if w != "gathered" else full_tensor(x) for x, w in zip(leaves, ways)]
  local_rows = [t.shape[0] if t.dim() else 1 for t in local]
  coordinates: dict[int, tuple[int, int]] = {}
  offsets = [_row_offset(x, n, coordinates) if w == "rows" else 0
             for x, w, n in zip(leaves, ways, local_rows)]
  segments = call.segments
  if segments is not None:
    segments = [_local_segments(x, w, s, o, n)
                for x, w, s, o, n in zip(leaves, ways, segments, offsets, local_rows)]
  threshold = call.threshold
  if isinstance(threshold, DTensor):
    threshold = full_tensor(threshold)
  op = call.op
  K = _system_count(call)
  nl = len(leaves)
  # Per-system counts as int32 (rows below 2**31 per leaf): half the bytes of the exchange
  # that per-system calls pay per system.
  header = np.zeros(1 + 2 * nl, dtype=np.int64)
  counts = np.zeros((nl, K), dtype=np.int32)
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
    if num_systems != K or min(offsets) < 0:
      raise ValueError("the exchanged counts would not describe this call")
    if max(local_rows) >= 1 << 31:
      raise ValueError("more rows than int32 counts hold")
    header[1::2] = local_rows
    header[2::2] = offsets
    if host_ids is None:
      counts[:, 0] = local_rows
    else:
      for i, g in enumerate(host_ids):
        counts[i] = np.bincount(g, minlength=K)
    header[0] = 1
  except (TypeError, ValueError):
    header[:] = 0
  headers, every_counts = collective.all_gather_layout(header, counts)
  if not headers[:, 0].all():
    return None
  shards = _shard_layout(leaves, ways, headers, every_counts, K)
  if shards is None:
    return None
  layout = leaf_layout_of([tuple(x.shape) for x in leaves], [_NUMPY_DTYPE[x.dtype]
                                                             for x in leaves])
  # Ranks share the machine's cores: the kernels take torch's intra-op thread count (torchrun
  # sets 1 per rank), as torch's own clipping on these tensors does.
  with threads.at_most(torch.get_num_threads()):
    outs, norms = numba_sharded.run(host, layout, checked.values, segs, shards, collective, p,
                                    nonfinite, step=op == "clip_by_max_step")
  outputs = []
  for out, x, way in zip(outs, leaves, ways):
    t = host_route.to_tensor(out)
    if way == "gathered":
      outputs.append(like_input(t, x))
    else:
      outputs.append(_as_output(t, x))
  return outputs, torch.from_numpy(np.ascontiguousarray(np.asarray(norms).reshape(-1)))


def _shard_layout(leaves: list[Any], ways: list[str], every: np.ndarray, every_counts: np.ndarray,
                  K: int):
  """The :class:`~clipbench.impls.own.numba.sharded.ShardLayout` of the gathered messages, or
  None when some leaf's rows are not contiguous chunks covering it in some rank order."""
  ranks, nl = every.shape[0], len(leaves)
  rows = every[:, 1:1 + 2 * nl:2].T  # (leaves, ranks)
  starts = every[:, 2:2 + 2 * nl:2].T
  counts = every_counts.astype(np.int64).reshape(ranks, nl, K)
  split = np.array([w == "rows" for w in ways])
  # Each leaf's ranks in the order of their rows (a rank holding none first at its place).
  order = np.where(split[:, None], np.lexsort((rows, starts)), np.arange(ranks))
  held = np.take_along_axis(rows, order, 1)
  ends = np.cumsum(held, 1)
  placed = np.take_along_axis(starts, order, 1) == ends - held
  whole = ends[:, -1] == np.array([x.shape[0] if x.dim() else 1 for x in leaves])
  if not (placed.all(1) & whole)[split].all():
    return None
  return numba_sharded.ShardLayout(np.ascontiguousarray(counts), order.astype(np.int64),
                                   ~split)
