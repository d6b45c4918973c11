"""The FFI route's partitioning rule for per-system calls: each round streamed in fixed chunks.

A per-system call (segment ids) exchanges what the numba kernels' sharded route exchanges
(:mod:`clipbench.impls.own.numba.sharded`), as the calls without segments do
(:mod:`.partitioned`): block results in the unsharded fold order, the pieces of the blocks
that straddle a boundary between devices, and exact partials of near-ties. But how many bytes
a device sends depends on the ids: a system whose rows lie in one run per leaf (sorted ids,
the usual batched layout) sends a few block results, while systems interleaved across devices
make every block straddle, and their elements travel. XLA's buffers are static, and a buffer
sized for the worst case would be as large as the rows. So every round travels in a
``lax.while_loop`` of fixed-size chunks, as many passes as the largest device's part needs:
one pass for the usual layout (the chunk is sized for it from the call's shapes), more only
for interleaved systems or many near-ties.

Per device, the partitioned program is:

1. a custom call that checks the device's ids (in range) and counts its rows of each system
   in each leaf, over the span of systems it holds in that leaf (int32, headed by where an id
   is out of range); that table is streamed as the rounds below are (4 bytes per leaf and
   system of the span: an even share of the systems for sorted ids). Every device then knows
   the call's :class:`~clipbench.impls.own.numba.shard_plan.ShardLayout`, and an id out of
   range on one device raises the unsharded call's ``ValueError`` on every device;
2. per round before the decision (one; two for float64 leaves or p > 6): a custom call that
   runs the device's part of the call up to that round (the earlier rounds replayed from what
   the device received, as :class:`.partitioned.ReplayedRounds` does) and hands the first
   chunk of its part; then the loop: all-gather every device's chunk, append it, hand the
   next, until every device's part has arrived;
3. a custom call that folds every device's block results in the unsharded order, decides and
   scales the device's own rows into XLA's result buffers;
4. in a ``lax.while_loop``, only while a system is a near-tie: the flagged systems' exact
   partials streamed the same way, and the call of 3 again (once; a non-integer p's partials
   are enclosures, and a precision they do not decide takes one more pass, which only an
   exact tie takes to the last: :mod:`clipbench.impls.own.shared_enclosures`).

What a device has received lives on the host between the custom calls of one execution
(:class:`_Execution`, found by a number the first call hands out and every later call takes as
an operand, so executions running side by side do not mix): block results, not rows, for the
usual layout. The loop's passes are counted (``partitioned.COUNTS.passes``).

Where it applies: per-system calls whose ids are one int32 array of rows per leaf, any p and
max-step. Leaves and their ids are placed as :func:`.mesh_pieces.placements` says (rows over one
mesh axis, or whole). Still the whole call: ``jax.vmap`` (no batching rule).
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from clipbench.impls.own import validation
from clipbench.impls.own.jax import host_route, mesh_pieces, partitioned, xla_ffi
from clipbench.impls.own.jax.config import Threshold
from clipbench.impls.own.numba import shard_plan, sharded
from clipbench.impls.own.numba.buffers import LeavesAt, array_at, writing_into
from clipbench.impls.own.numba.layout import BLOCK, SUB_BLOCK, LeafLayout, leaf_layout_of
from clipbench.impls.own.numba.segments import checked_segments

TARGET = "clipbench_numba_sharded_segments"
_CHUNK_HEADER = 16  # int64 bytes of the device's whole part, int64 offset of this chunk
_TABLE_HEADER = 24  # int64 leaf of an id out of range (-1: none), its lowest and highest id
MIN_CHUNK, MAX_CHUNK = 4096, 1 << 20


class Plan(NamedTuple):
  """What every custom call of one partitioned call knows from shapes alone."""

  spec: host_route.CallSpec
  layout: LeafLayout  # the whole leaves
  split: np.ndarray  # bool (leaves,): rows split over the axis (else whole on every device)
  held: np.ndarray  # int64 (ranks, leaves): rows each device holds
  local_shapes: tuple  # each leaf's buffer on a device (uneven splits padded)
  rounds: int  # exchanges before the decision
  chunk: int  # bytes of a device's part of a round per pass of the loop
  table_chunk: int  # the same for the tables of row counts

  @property
  def ranks(self) -> int:
    return self.held.shape[0]


class Stage(NamedTuple):
  plan: Plan
  kind: str  # "begin", "round", "feed", "finish", "settle"
  first: bool = False  # the first round: the tables have arrived before it


def chunk_bytes(spec: host_route.CallSpec, local_shapes: tuple, split: np.ndarray,
                ranks: int) -> int:
  """A pass's chunk: a device's part of a round when each system's rows lie in one run per
  leaf (an even share of the systems per split leaf, each a block or more, the blocks of its
  rows, and the sub-blocks and pieces of a block across each of its two boundaries), rounded
  up to 4 KiB, within [``MIN_CHUNK``, ``MAX_CHUNK``]."""
  exchanges = partitioned.exchanges(spec)
  width = max(x.width for x in exchanges)
  sub_width = max(max(x.sub_width, x.width) for x in exchanges)
  share = -(-spec.num_systems // ranks)
  total = 0
  for shape, dtype, cut in zip(local_shapes, spec.leaf_dtypes, split):
    if cut:
      blocks = share + -(-math.prod(shape) // BLOCK) + 2
      across = 2 * (SUB_BLOCK * np.dtype(dtype).itemsize + (BLOCK // SUB_BLOCK) * sub_width)
      total += blocks * width + across
  return int(min(max(-(-total // 4096) * 4096, MIN_CHUNK), MAX_CHUNK))


def table_chunk_bytes(spec: host_route.CallSpec, split: np.ndarray, ranks: int) -> int:
  """A pass's chunk of the tables: a device's table when each system's rows lie in one run
  per leaf (a share of the systems per split leaf, with an eighth more for systems of unequal
  sizes, every system per whole leaf), rounded up to 4 KiB, within [``MIN_CHUNK``,
  ``MAX_CHUNK``]."""
  share = -(-spec.num_systems // ranks)
  spans = sum(share + share // 8 + 2 if cut else spec.num_systems for cut in split)
  total = _TABLE_HEADER + 16 * len(split) + 4 * spans
  return int(min(max(-(-total // 4096) * 4096, MIN_CHUNK), MAX_CHUNK))


class _Execution:
  """One device's part of one execution of a partitioned call, between its custom calls."""

  def __init__(self, plan: Plan, rank: int):
    self.plan, self.rank = plan, rank
    self.chunk = plan.table_chunk  # the stream under way's chunk
    self.shards: shard_plan.ShardLayout | None = None
    self.segments: tuple | None = None  # (id addresses, CheckedSegments of the held rows)
    self.rounds: list[list[np.ndarray]] = []  # every device's part of each finished round
    self.outgoing = np.zeros(0, np.uint8)
    self.sent = 0
    self.incoming: list[bytearray] = []

  def start_round(self, payload: np.ndarray, chunk: int) -> None:
    self.outgoing, self.sent, self.chunk = payload, 0, chunk
    self.incoming = [bytearray() for _ in range(self.plan.ranks)]

  def write_chunk(self, address: int) -> None:
    size = self.chunk
    out = array_at(address, (size + _CHUNK_HEADER,), np.dtype(np.uint8), False)
    piece = self.outgoing[self.sent:self.sent + size]
    out[:_CHUNK_HEADER] = np.array([self.outgoing.size, self.sent], np.int64).view(np.uint8)
    out[_CHUNK_HEADER:_CHUNK_HEADER + piece.size] = piece
    out[_CHUNK_HEADER + piece.size:] = 0
    self.sent += piece.size

  def receive(self, rows: np.ndarray) -> bool:
    """Appends every device's chunk; whether a device's part is still to come."""
    heads = rows[:, :_CHUNK_HEADER].copy().view(np.int64)
    more = False
    for g, ((total, offset), got) in enumerate(zip(heads, self.incoming)):
      if offset != len(got):
        raise RuntimeError(f"device {g}'s chunk starts at byte {offset}, {len(got)} arrived")
      n = max(0, min(self.chunk, int(total) - int(offset)))
      got.extend(rows[g, _CHUNK_HEADER:_CHUNK_HEADER + n].tobytes())
      more |= len(got) < total
    if not more:
      self.rounds.append([np.frombuffer(bytes(got), np.uint8) for got in self.incoming])
    return more


_EXECUTIONS: dict[int, _Execution] = {}
_NUMBERS = itertools.count(1)
_LOCK = threading.Lock()
_STAGES: list[Stage] = []


def executions_under_way() -> int:
  """Executions whose host state is held (none once every call has returned or failed)."""
  with _LOCK:
    return len(_EXECUTIONS)


def _stage_key(stage: Stage) -> int:
  with _LOCK:
    _STAGES.append(stage)
    return len(_STAGES) - 1


def _scalar(address: int, dtype) -> int:
  return int(array_at(int(address), (), np.dtype(dtype), True))


def _local_ids(plan: Plan, rank: int, addresses) -> list[np.ndarray]:
  return [array_at(int(a), (int(n),), np.dtype(np.int32), True)
          for a, n in zip(addresses, plan.held[rank])]


def _begin(plan: Plan, args: np.ndarray, rets: np.ndarray) -> None:
  """The device's table (its part of the first streamed exchange) and its first chunk."""
  rank = _scalar(args[0], np.int32)
  nl, k = len(plan.spec.leaf_shapes), plan.spec.num_systems
  head = np.array([-1, 0, 0], np.int64)
  spans = np.zeros((nl, 2), np.int64)  # per leaf: first system of the span, its length
  counts = []
  for i, ids in enumerate(_local_ids(plan, rank, args[1:1 + nl])):
    if ids.size:
      lo, hi = int(ids.min()), int(ids.max())
      if lo < 0 or hi >= k:
        head[:] = (i, lo, hi)
        spans[:] = 0
        counts = []
        break
      spans[i] = (lo, hi - lo + 1)
      counts.append(np.bincount(ids - lo, minlength=hi - lo + 1).astype(np.int32))
  number = next(_NUMBERS)
  ex = _Execution(plan, rank)
  with _LOCK:
    _EXECUTIONS[number] = ex
  array_at(int(rets[0]), (), np.dtype(np.int64), False)[...] = number
  ex.start_round(np.concatenate([head.view(np.uint8), spans.reshape(-1).view(np.uint8)]
                                + [c.view(np.uint8) for c in counts]), plan.table_chunk)
  ex.write_chunk(int(rets[1]))


def _shard_layout(plan: Plan, tables: list[np.ndarray]) -> shard_plan.ShardLayout:
  """The call's layout from every device's table; an id out of range on any device raises
  the unsharded call's error (the lowest leaf's, from the first such device) on every one."""
  nl, k = len(plan.spec.leaf_shapes), plan.spec.num_systems
  heads = [t[:_TABLE_HEADER].copy().view(np.int64) for t in tables]
  for leaf, lo, hi in heads:
    if leaf >= 0:
      validation.check_segment_range(int(leaf), int(lo), int(hi), k)
  counts = np.zeros((plan.ranks, nl, k), np.int64)
  for g, table in enumerate(tables):
    spans = table[_TABLE_HEADER:_TABLE_HEADER + 16 * nl].copy().view(np.int64).reshape(nl, 2)
    every = table[_TABLE_HEADER + 16 * nl:].copy().view(np.int32)
    cursor = 0
    for i, (first, length) in enumerate(spans):
      counts[g, i, first:first + length] = every[cursor:cursor + length]
      cursor += int(length)
  order = np.tile(np.arange(plan.ranks, dtype=np.int64), (nl, 1))
  return shard_plan.ShardLayout(counts, order, ~plan.split)


def _run(ex: _Execution, args: np.ndarray):
  """The device's part of the call (operands: rank, number, leaves, ids, threshold parts)."""
  plan, spec, nl = ex.plan, ex.plan.spec, len(ex.plan.spec.leaf_shapes)
  shapes = [(int(n),) + s[1:] for n, s in zip(plan.held[ex.rank], plan.local_shapes)]
  leaves = list(LeavesAt(args[2:2 + nl], tuple(shapes), spec.leaf_dtypes, True))
  addresses = tuple(int(a) for a in args[2 + nl:2 + 2 * nl])
  if ex.segments is None or ex.segments[0] != addresses:
    ids = _local_ids(plan, ex.rank, addresses)
    ex.segments = (addresses, checked_segments(leaves, ids, spec.num_systems))
  t = spec.threshold_size
  m, e, inf = (array_at(int(a), (t,), np.dtype(d), True)
               for a, d in zip(args[2 + 2 * nl:5 + 2 * nl], (np.float64, np.int32, np.bool_)))
  c = host_route.threshold_values(m, e, inf)
  c = np.where(np.isnan(c) | (c < 0), 0.0, c).reshape(-1)  # as the whole call reads it
  rounds = _Arrived(ex.rank, plan.ranks, ex.rounds)
  return shapes, functools.partial(sharded.run, leaves, plan.layout, c, ex.segments[1],
                                   ex.shards, rounds, spec.p, spec.nonfinite,
                                   step=spec.op == "clip_by_max_step")


class _Arrived(partitioned.ReplayedRounds):
  """Rounds replayed from what the loop appended: every device's part, by device."""

  def _received(self) -> list[np.ndarray]:
    every = self._known[self._next]
    self._next += 1
    return every


def _round(stage: Stage, ex: _Execution, args: np.ndarray, rets: np.ndarray) -> None:
  if stage.first:
    ex.shards = _shard_layout(stage.plan, ex.rounds.pop(0))
  _, run = _run(ex, args)
  try:
    run()
  except partitioned.Recorded as recorded:
    ex.start_round(recorded.payload, stage.plan.chunk)
    ex.write_chunk(int(rets[0]))
    partitioned.COUNTS.add("rounds")
    return
  raise RuntimeError("the sharded route finished before its exchange")


def _feed(stage: Stage, ex: _Execution, args: np.ndarray, rets: np.ndarray) -> None:
  rows = array_at(int(args[2]), (stage.plan.ranks, ex.chunk + _CHUNK_HEADER),
                  np.dtype(np.uint8), True)
  more = ex.receive(rows)
  ex.write_chunk(int(rets[0]))
  array_at(int(rets[1]), (), np.dtype(np.int32), False)[...] = int(more)
  partitioned.COUNTS.add("passes")


def _finish(stage: Stage, ex: _Execution, args: np.ndarray, rets: np.ndarray) -> bool:
  """Outputs and norms written (True), or a near-tie round begun (False)."""
  spec, nl = stage.plan.spec, len(stage.plan.spec.leaf_shapes)
  shapes, run = _run(ex, args)
  for i, (s, full, d) in enumerate(zip(shapes, stage.plan.local_shapes, spec.leaf_dtypes)):
    if s != full:  # rows XLA pads an uneven shard with: zeros, never read back
      array_at(int(rets[i]), full, d, False)[s[0]:] = 0
  try:
    with writing_into(LeavesAt(rets[:nl], tuple(shapes), spec.leaf_dtypes, False)):
      _, norms = run()
  except partitioned.Recorded as recorded:
    array_at(int(rets[nl + 1]), (), np.dtype(np.int32), False)[...] = 1
    ex.start_round(recorded.payload, stage.plan.chunk)
    ex.write_chunk(int(rets[nl + 2]))
    partitioned.COUNTS.add("ties")
    return False
  array_at(int(rets[nl]), (spec.num_systems,), spec.norms_dtype, False)[...] = (
      np.asarray(norms).reshape(-1))
  array_at(int(rets[nl + 1]), (), np.dtype(np.int32), False)[...] = 0
  ex.start_round(np.zeros(0, np.uint8), stage.plan.chunk)
  ex.write_chunk(int(rets[nl + 2]))
  partitioned.COUNTS.add("finished")
  return True


def _execute(key: int, args: np.ndarray, rets: np.ndarray) -> None:
  """Every stage's body: operands (rank, the execution's number, ...) in place, results
  filled; an execution's host state is dropped when it ends or fails."""
  stage = _STAGES[key]
  if stage.kind == "begin":
    _begin(stage.plan, args, rets)
    return
  number = _scalar(args[1], np.int64)
  with _LOCK:
    ex = _EXECUTIONS.get(number)
  if ex is None:
    raise RuntimeError(f"no execution {number} of a partitioned per-system call is under way")
  try:
    if stage.kind == "round":
      _round(stage, ex, args, rets)
    elif stage.kind == "feed":
      _feed(stage, ex, args, rets)
    elif _finish(stage, ex, args, rets):
      with _LOCK:
        _EXECUTIONS.pop(number, None)
  except BaseException:
    with _LOCK:
      _EXECUTIONS.pop(number, None)
    raise


def _lower(plan: Plan, axis: str):
  """The per-device program (see the module docstring)."""
  spec, nl = plan.spec, len(plan.spec.leaf_shapes)
  u8 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.uint8)
  flag = jax.ShapeDtypeStruct((), jnp.int32)
  chunk = u8(plan.chunk + _CHUNK_HEADER)
  table_chunk = u8(plan.table_chunk + _CHUNK_HEADER)
  outs = [jax.ShapeDtypeStruct(s, d) for s, d in zip(plan.local_shapes, spec.leaf_dtypes)]
  norms = jax.ShapeDtypeStruct((spec.num_systems,), spec.norms_dtype)

  def call(kind: str, results: list, *operands, first: bool = False):
    key = jnp.full((), _stage_key(Stage(plan, kind, first)), jnp.int32)
    return jax.ffi.ffi_call(TARGET, results, has_side_effect=True)(key, *operands)

  def lower(m, e, inf, *operands):
    leaves, ids = operands[:nl], operands[nl:]
    with jax.enable_x64(True):
      rank = lax.axis_index(axis).astype(jnp.int32)
      number, table = call("begin", [jax.ShapeDtypeStruct((), jnp.int64), table_chunk], rank,
                           *ids)
      call_operands = (rank, number, *leaves, *ids, m, e, inf)

      def stream(part):
        def one_pass(carry):
          every = lax.all_gather(carry[0], axis)
          return tuple(call("feed", [jax.ShapeDtypeStruct(part.shape, jnp.uint8), flag], rank,
                            number, every))
        return lax.while_loop(lambda carry: carry[1] != 0, one_pass,
                              (part, jnp.ones((), jnp.int32)))[0]

      arrived = stream(table)
      for r in range(plan.rounds):
        (part,) = call("round", [chunk], *call_operands, arrived, first=r == 0)
        arrived = stream(part)
      ending = outs + [norms, flag, chunk]
      result = call("finish", ending, *call_operands, arrived)

      def settle(result):  # one more round of a near-tie's partials, then the call again
        return tuple(call("settle", ending, *call_operands, stream(result[nl + 2])))

      result = lax.while_loop(lambda result: result[nl + 1] != 0, settle, tuple(result))
      return tuple(result[:nl]), result[nl]

  return lower


def _whole(spec: host_route.CallSpec, m, e, inf, *operands):
  nl = len(spec.leaf_shapes)
  with jax.enable_x64(True):
    return host_route.whole_call(spec, operands[:nl], operands[nl:], m, e, inf)


def _partition(spec: host_route.CallSpec, mesh, arg_shapes, result_shape):
  del result_shape
  nl = len(spec.leaf_shapes)
  whole = NamedSharding(mesh, P())
  axis, leaf_shardings = mesh_pieces.placements(mesh, arg_shapes[3:3 + nl])
  split = np.array([s.spec != P() for s in leaf_shardings])
  id_shardings = tuple(NamedSharding(mesh, P(axis)) if cut else whole for cut in split)
  arg_shardings = (whole,) * 3 + leaf_shardings + id_shardings
  result_shardings = (leaf_shardings, whole)
  if axis is None:  # every leaf whole on every device: the whole call, nothing to exchange
    return mesh, functools.partial(_whole, spec), result_shardings, arg_shardings
  ranks = mesh.shape[axis]
  rows = [s[0] for s in spec.leaf_shapes]
  held = np.array([[mesh_pieces.shard_rows(n, ranks)[g] if cut else n
                    for n, cut in zip(rows, split)] for g in range(ranks)], dtype=np.int64)
  local_shapes = tuple(mesh_pieces.local_shape(s, ranks) if cut else s
                       for s, cut in zip(spec.leaf_shapes, split))
  plan = Plan(spec, leaf_layout_of(list(spec.leaf_shapes), list(spec.leaf_dtypes)), split,
              held, local_shapes, len(partitioned.exchanges(spec)),
              chunk_bytes(spec, local_shapes, split, ranks),
              table_chunk_bytes(spec, split, ranks))
  return mesh, _lower(plan, axis), result_shardings, arg_shardings


def _rule(spec: host_route.CallSpec) -> str:
  """Shardy's rule: every leaf's dimensions pass through to its output, its ids share its
  rows; the threshold's parts and the norms are per-system vectors."""
  dims = ", ".join(" ".join(f"l{i}d{j}" for j in range(len(s)))
                   for i, s in enumerate(spec.leaf_shapes))
  ids = ", ".join(f"l{i}d0" for i in range(len(spec.leaf_shapes)))
  return f"t, t, t, {dims}, {ids} -> {dims}, s"


def applies(spec: host_route.CallSpec) -> bool:
  """Whether a sharded per-system call of ``spec`` can exchange partials: one int32 id per row
  of every leaf, and leaves with rows."""
  return (spec.has_segments and len(spec.segment_shapes) == len(spec.leaf_shapes) > 0
          and all(len(s) >= 1 and g == s[:1]
                  for s, g in zip(spec.leaf_shapes, spec.segment_shapes)))


@functools.cache
def _partitioned(spec: host_route.CallSpec):
  return partitioned.with_rule(functools.partial(_whole, spec),
                               functools.partial(_partition, spec), _rule(spec))


def traced(op: str, p: float, nonfinite: str, num_systems: int, leaves, segments,
           threshold: Threshold):
  """(outputs, per-system norms) of a traced per-system call: partitioned where
  :func:`applies`, else :func:`.host_route.traced` (call under x64)."""
  spec = host_route.call_spec(op, p, nonfinite, num_systems, leaves, segments, threshold)
  if not applies(spec):
    return host_route.traced(op, p, nonfinite, num_systems, leaves, segments, threshold)
  xla_ffi.register(TARGET, _execute)
  return _partitioned(spec)(*host_route.threshold_operands(threshold), *leaves, *segments)
