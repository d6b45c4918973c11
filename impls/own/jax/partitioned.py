"""The FFI route's partitioning rule: a sharded call exchanges block results, not leaves.

XLA's SPMD partitioner does not partition a custom call: without a rule it gathers every
operand of :func:`.host_route.whole_call` onto every device, and every device clips the whole
model (SPEC rule 14 holds, at the cost of an all-gather of the model). With the rule below,
each device of the mesh clips its own rows, and the devices exchange what the numba kernels'
sharded route exchanges (:mod:`clipbench.impls.own.numba.sharded`): per-block results in the
unsharded fold order, and the elements of the few sub-blocks that straddle a shard boundary.
The bits are the unsharded call's.

Per device, the partitioned program is:

1. one custom call per exchange round before the decision (one; two for float64 leaves or
   p > 6, whose maxima come first): the device's rows reduced, its part of the round written
   into a static buffer;
2. an ``all_gather`` of that buffer over the mesh axes the leaves are split on;
3. a custom call that folds every device's block results in the unsharded order, decides and
   scales the device's own rows into XLA's result buffers;
4. in a ``lax.while_loop``, only while some system is a near-tie: an ``all_gather`` of the
   device's exact partials of the flagged systems (a rational power sum, a maximum, a sign:
   at most a few KB) and the same custom call again, deciding the tie exactly (once; for a
   non-integer p the partials are interval enclosures of the device's power sum, and a
   precision they do not decide takes one more round, up to one a precision, which only an
   exact tie takes: :mod:`clipbench.impls.own.shared_enclosures`). The rounds gathered so far
   are the loop's carry, a static stack the call replays.

The numba code runs as one ordinary call of the sharded route in each custom call: a call
*replays* the rounds already gathered (its collective returns them, and the device's own part
of them is not recomputed) and stops at the first round it has no data for, handing its own
part of it to XLA (:class:`ReplayedRounds`). Buffers are static, so their sizes come from the
layout alone: :func:`clipbench.impls.own.numba.shard_plan.exchange_bytes` per pass, and a bound
on the size of an exact partial for the tie round.

Where it applies: global clipping (``clip_grad_norm``, and the per-system operations without
segments: one system) for any p >= 1, +-inf, and max-step (calls with segments take
:mod:`.partitioned_segments`, whose rounds, sized by the ids, are streamed in chunks). A leaf
keeps its split of its rows and of one later axis (tensor parallelism's columns), over any
mesh axes, uneven splits and empty tiles included (:func:`.mesh_pieces.pieces`): each device
reads its own tile. XLA makes whole, before the program runs, the splits it cannot keep:
columns narrower than a sub-block a device, splits of two axes after the first, and
max-step's columns. Still the whole call on every device (no rule, XLA gathers every
operand): ``jax.vmap`` (custom partitioning has no batching rule: the batched call is the
whole one).
"""

from __future__ import annotations

import functools
import math
import pickle
import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from clipbench.impls.own import shared_enclosures
from clipbench.impls.own.exact import ENCLOSURE_PRECISIONS
from clipbench.impls.own.jax import host_route, mesh_pieces, xla_ffi
from clipbench.impls.own.jax.config import Threshold
from clipbench.impls.own.numba import shard_plan, sharded
from clipbench.impls.own.numba.buffers import LeavesAt, array_at, writing_into
from clipbench.impls.own.numba.layout import LeafLayout, leaf_layout_of
from clipbench.impls.own.numba.segments import NO_SEGMENTS

TARGET = "clipbench_numba_sharded"
_HEADER = 8  # int64 byte count at the head of every exchanged buffer
# (largest exponent + 1, smallest subnormal exponent, significand bits) of m * 2**e magnitudes.
_RANGE = {np.dtype(np.float16): (16, -24, 11), np.dtype(np.float32): (128, -149, 24),
          np.dtype(np.float64): (1024, -1074, 53)}
_BF16_RANGE = (128, -133, 8)


class Exchange(NamedTuple):
  """One all-gather of a pass (:meth:`clipbench.impls.own.numba.sharded.ShardedBlocks.run`)."""

  by_vectors: bool
  width: int  # bytes of one block's results
  kind: str  # shard_plan.PASS_KINDS
  sub_width: int = 0  # bytes of one sub-block's results (a split)


def exchanges(spec: host_route.CallSpec) -> list[Exchange]:
  """The exchanges before the decision, in order, as ``numba.general``'s passes make them."""
  f64 = any(d == np.float64 for d in spec.leaf_dtypes)
  if spec.op == "clip_by_max_step":
    return [Exchange(True, 25, "merge")]  # StepMaxima: k, hi, lo, flags
  if math.isinf(spec.p):
    return [Exchange(False, 9, "merge")]  # extremes: value, flags
  if not f64 and spec.p <= 6.0:  # sums, flags (and zero mode's sums without non-finite)
    return [Exchange(False, 9, "split", 17 if spec.nonfinite == "zero" else 9)]
  return [Exchange(False, 9, "merge"), Exchange(False, 16, "split", 16)]  # maxima, then hi/lo


def applies(spec: host_route.CallSpec) -> bool:
  """Whether a sharded call of ``spec`` can exchange partials (else the whole call)."""
  if spec.has_segments:
    return False
  return spec.op == "clip_by_max_step" or math.isinf(spec.p) or spec.p >= 1


def tie_rounds(spec: host_route.CallSpec) -> tuple[int, int]:
  """(bytes, rounds): a bound on a device's part of a near-tie round, and how many rounds a
  tie may take: one of exact partials, or for a non-integer p one of enclosures per
  precision (:mod:`clipbench.impls.own.shared_enclosures`)."""
  step = spec.op == "clip_by_max_step"
  if step or math.isinf(spec.p) or float(spec.p).is_integer():
    return tie_bytes(spec.leaf_dtypes, spec.p, step) + 64 + _HEADER, 1
  return shared_enclosures.exchange_bytes(1) + _HEADER, len(ENCLOSURE_PRECISIONS)


def tie_bytes(dtypes: tuple, p: float, step: bool) -> int:
  """A bound on the pickled exact partial of one system (:func:`sharded.tie_partial`) over
  leaves of ``dtypes``: a power sum of magnitudes m * 2**e is an integer over
  2**(p |e_min|) below n 2**(p (e_max - e_min)), at most 2**64 elements; a maximum is one
  such term; a sign is an int. A ``Fraction`` pickles as its decimal string; 96 bytes
  frame it, its element count and its place in a list."""
  if step:
    return 96
  top, bottom, _ = max((_BF16_RANGE if np.dtype(d).name == "bfloat16" else _RANGE[np.dtype(d)]
                        for d in dtypes), key=lambda r: r[0] - r[1])
  power = 1 if math.isinf(p) else int(p)
  bits = power * (top - bottom) + 64 + power * -bottom
  return math.ceil(bits * math.log10(2)) + 96


class Stage(NamedTuple):
  """One custom call of a partitioned call, looked up by the key it carries."""

  spec: host_route.CallSpec
  layout: LeafLayout  # the whole leaves, read as ``pieces.views``
  pieces: mesh_pieces.Pieces  # every device's tile of every leaf, and its buffer
  known: tuple  # sizes of the gathered buffers this call receives, by round
  record: int  # size of the buffer it hands back (its part of the next round)
  finishes: bool  # writes the outputs and norms (else only its part of a round)
  ties: int = 0  # near-tie rounds its stack of them holds (then operands: stack, count)


class Counts:
  """Custom calls of partitioned calls in this process, by what they handed to XLA (each
  device's call counts once): observable proof that a call exchanged, and settled a tie."""

  def __init__(self):
    self._lock = threading.Lock()
    self.rounds = 0  # parts of a round before the decision
    self.ties = 0  # parts of a near-tie round
    self.finished = 0  # outputs written
    self.passes = 0  # passes of a per-system call's chunk loop (:mod:`.partitioned_segments`)
    self.columns = 0  # leaves written from tiles split along a later axis than the rows

  def add(self, what: str, n: int = 1) -> None:
    with self._lock:
      setattr(self, what, getattr(self, what) + n)


COUNTS = Counts()
_STAGES: list[Stage] = []
_STAGES_LOCK = threading.Lock()


def _stage_key(stage: Stage) -> int:
  with _STAGES_LOCK:
    _STAGES.append(stage)
    return len(_STAGES) - 1


class Recorded(Exception):
  """Raised out of the sharded route at the first exchange this call has no data for."""

  def __init__(self, payload: np.ndarray):
    super().__init__("exchange recorded")
    self.payload = payload


class ReplayedRounds:
  """A :class:`clipbench.impls.own.numba.sharded.Collective` over rounds XLA gathered before
  this custom call ran; the next one is recorded (:class:`Recorded`) for XLA to gather."""

  def __init__(self, rank: int, size: int, known: list[np.ndarray]):
    self.rank, self.size = rank, size
    self._known = known  # (size, bytes) uint8 per round, each row headed by its length
    self._next = 0

  def holds_next_round(self) -> bool:
    return self._next < len(self._known)

  def _received(self) -> list[np.ndarray]:
    rows = self._known[self._next]
    self._next += 1
    lengths = rows[:, :_HEADER].copy().view(np.int64).reshape(-1)
    return [rows[g, _HEADER:_HEADER + int(n)] for g, n in enumerate(lengths)]

  def all_gather_bytes(self, payload: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    if not self.holds_next_round():
      raise Recorded(payload)
    every = self._received()
    if [x.size for x in every] != list(sizes):
      raise RuntimeError(f"a replayed exchange holds {[x.size for x in every]} bytes per "
                         f"rank, the layout says {list(sizes)}")
    return every

  def all_gather_objects(self, value: Any) -> list[Any]:
    if not self.holds_next_round():
      raise Recorded(np.frombuffer(pickle.dumps(value), np.uint8))
    return [pickle.loads(x.tobytes()) for x in self._received()]


def _write_round(address: int, size: int, payload: np.ndarray) -> None:
  out = array_at(address, (size,), np.dtype(np.uint8), False)
  if payload.size > size - _HEADER:
    raise RuntimeError(f"an exchange of {payload.size} bytes exceeds its static buffer of "
                       f"{size - _HEADER} (a bound in clipbench.impls.own.jax.partitioned)")
  out[:_HEADER] = np.array([payload.size], np.int64).view(np.uint8)
  out[_HEADER:_HEADER + payload.size] = payload
  out[_HEADER + payload.size:] = 0


class _Tiles:
  """A device's tiles in XLA's buffers, which pad short tiles: a tile short in its rows only
  is the buffer's first rows, read and written in place; one short in its second axis (an
  uneven split of the columns) is strided there, so it is copied out to be read, and its
  outputs are written beside and copied in (memory of the tile, not of the leaf)."""

  def __init__(self, shapes: tuple, buffers: tuple, dtypes: tuple):
    self._at = [(s, b, np.dtype(d)) for s, b, d in zip(shapes, buffers, dtypes)]
    self._strided = [h[1:] != b[1:] for h, b, _ in self._at]
    self._inputs: dict[int, np.ndarray] = {}
    self._outputs: dict[int, np.ndarray] = {}

  def _addresses(self, addresses, copies: dict[int, np.ndarray]) -> np.ndarray:
    out = np.array(addresses, np.int64)  # a copy: XLA's operand table is not ours to change
    for i, copy in copies.items():
      out[i] = copy.ctypes.data if copy.size else 0
    return out

  def read(self, addresses) -> np.ndarray:
    """The data address of each tile: in the operand buffer, or of its copy."""
    for i, (held, buffer, dtype) in enumerate(self._at):
      if self._strided[i]:
        tile = array_at(int(addresses[i]), buffer, dtype, True)[tuple(map(slice, held))]
        self._inputs[i] = np.ascontiguousarray(tile)
    return self._addresses(addresses, self._inputs)

  def write(self, addresses) -> np.ndarray:
    """Where each output tile is written: in the result buffer, or beside it."""
    for i, (held, _, dtype) in enumerate(self._at):
      if self._strided[i]:
        self._outputs[i] = np.empty(held, dtype)
    return self._addresses(addresses, self._outputs)

  def written(self, addresses) -> None:
    """Result buffers completed: tiles written beside copied in, and XLA's padding zeroed
    (never read back, but its buffers are not cleared)."""
    for i, (held, buffer, dtype) in enumerate(self._at):
      if held == buffer:
        continue
      result = array_at(int(addresses[i]), buffer, dtype, False)
      result[held[0]:] = 0
      if self._strided[i]:
        tile = tuple(map(slice, held))
        padding = np.ones(buffer, bool)
        padding[tile] = False
        result[tile] = self._outputs[i]
        result[padding] = 0


def _execute(key: int, args: np.ndarray, rets: np.ndarray) -> None:
  """The body of every stage: operands (rank, local leaves, threshold parts, gathered rounds)
  in place; results (the next round's buffer, or outputs, norms, a tie flag and the tie
  round's buffer) filled."""
  stage = _STAGES[key]
  spec, pieces = stage.spec, stage.pieces
  shards, nl = pieces.shards, len(pieces.buffers)
  rank = int(array_at(int(args[0]), (), np.dtype(np.int32), True))
  shapes = pieces.held_views[rank]
  tiles = _Tiles(pieces.held[rank], pieces.buffers, spec.leaf_dtypes)
  leaves = list(LeavesAt(tiles.read(args[1:1 + nl]), shapes, spec.leaf_dtypes, True))
  t = spec.threshold_size
  m, e, inf = (array_at(int(a), (t,), np.dtype(d), True)
               for a, d in zip(args[1 + nl:4 + nl], (np.float64, np.int32, np.bool_)))
  c = host_route.threshold_values(m, e, inf)
  c = np.where(np.isnan(c) | (c < 0), 0.0, c).reshape(-1)[:1]  # one system
  ranks = shards.counts.shape[0]
  known = [array_at(int(a), (ranks, n), np.dtype(np.uint8), True)
           for a, n in zip(args[4 + nl:], stage.known)]
  count = 0
  if stage.ties:  # the near-tie rounds gathered so far
    at = 4 + nl + len(stage.known)
    count = int(array_at(int(args[at + 1]), (), np.dtype(np.int32), True))
    known += list(array_at(int(args[at]), (stage.ties, ranks, stage.record), np.dtype(np.uint8),
                           True)[:count])
  rounds = ReplayedRounds(rank, ranks, known)
  run = functools.partial(sharded.run, leaves, stage.layout, c, NO_SEGMENTS, shards,
                          rounds, spec.p, spec.nonfinite, step=spec.op == "clip_by_max_step")
  if not stage.finishes:
    try:
      run()
    except Recorded as recorded:
      _write_round(int(rets[0]), stage.record, recorded.payload)
      COUNTS.add("rounds")
      return
    raise RuntimeError("the sharded route finished before its exchange")
  need = array_at(int(rets[nl + 1]), (), np.dtype(np.int32), False)
  try:
    with writing_into(LeavesAt(tiles.write(rets[:nl]), shapes, spec.leaf_dtypes, False)):
      _, norms = run()
  except Recorded as recorded:
    if stage.ties and count >= stage.ties:
      raise RuntimeError(f"a near-tie took more than the {stage.ties} rounds of its "
                         "bound") from None
    need[...] = 1
    _write_round(int(rets[nl + 2]), stage.record, recorded.payload)
    COUNTS.add("ties")
    return
  need[...] = 0
  tiles.written(rets[:nl])
  COUNTS.add("finished")
  COUNTS.add("columns", sum(pieces.by_columns))
  array_at(int(rets[nl]), (1,), spec.norms_dtype, False)[...] = np.asarray(norms).reshape(-1)
  if stage.record:
    _write_round(int(rets[nl + 2]), stage.record, np.zeros(0, np.uint8))


def _call(stage: Stage, results: list, rank, leaves, m, e, inf, gathered):
  return jax.ffi.ffi_call(TARGET, results)(jnp.full((), _stage_key(stage), jnp.int32), rank,
                                           *leaves, m, e, inf, *gathered)


def _lower(spec: host_route.CallSpec, layout: LeafLayout, pieces: mesh_pieces.Pieces,
           bounds: list[int], tie: int, rounds: int):
  """The per-device program (see the module docstring)."""
  u8 = lambda n: jax.ShapeDtypeStruct((n,), jnp.uint8)
  outs = [jax.ShapeDtypeStruct(s, d) for s, d in zip(pieces.buffers, spec.leaf_dtypes)]
  finish = outs + [jax.ShapeDtypeStruct((1,), spec.norms_dtype),
                   jax.ShapeDtypeStruct((), jnp.int32), u8(tie)]
  stage = functools.partial(Stage, spec, layout, pieces)
  axis = pieces.axes  # a device's rank: its linear index over them, as all_gather orders it

  def lower(m, e, inf, *leaves):
    with jax.enable_x64(True):
      rank = lax.axis_index(axis).astype(jnp.int32)
      gathered: list = []
      for r, size in enumerate(bounds):
        (part,) = _call(stage(tuple(bounds[:r]), size, False), [u8(size)], rank, leaves, m, e,
                        inf, gathered)
        gathered.append(lax.all_gather(part, axis))
      result = _call(stage(tuple(bounds), tie, True), finish, rank, leaves, m, e, inf, gathered)
      nl = len(leaves)
      settling = stage(tuple(bounds), tie, True, rounds)

      def settle(carry):  # one more near-tie round gathered, then the call again
        result, ties, count = carry
        ties = lax.dynamic_update_index_in_dim(ties, lax.all_gather(result[nl + 2], axis),
                                               count, 0)
        again = _call(settling, finish, rank, leaves, m, e, inf, gathered + [ties, count + 1])
        return tuple(again), ties, count + 1

      ties = jnp.zeros((rounds, pieces.shards.counts.shape[0], tie), jnp.uint8)
      result, _, _ = lax.while_loop(lambda carry: carry[0][nl + 1] != 0, settle,
                                    (tuple(result), ties, jnp.zeros((), jnp.int32)))
      return tuple(result[:nl]), result[nl]

  return lower


def _partition(spec: host_route.CallSpec, mesh, arg_shapes, result_shape):
  del result_shape
  whole = NamedSharding(mesh, P())
  pieces = mesh_pieces.pieces(mesh, arg_shapes[3:], rows_only=spec.op == "clip_by_max_step")
  arg_shardings = (whole,) * 3 + pieces.shardings
  result_shardings = (pieces.shardings, whole)
  if not pieces.axes:  # every leaf whole on every device: the whole call, nothing to exchange
    return mesh, functools.partial(_whole, spec), result_shardings, arg_shardings
  layout = leaf_layout_of(list(pieces.views), list(spec.leaf_dtypes))
  bounds = [int(shard_plan.exchange_bytes(pieces.shards, layout, *x).max()) + _HEADER
            for x in exchanges(spec)]
  return (mesh, _lower(spec, layout, pieces, bounds, *tie_rounds(spec)), result_shardings,
          arg_shardings)


def _whole(spec: host_route.CallSpec, m, e, inf, *leaves):
  with jax.enable_x64(True):
    return host_route.whole_call(spec, leaves, None, m, e, inf)


def _rule(spec: host_route.CallSpec) -> str:
  """Shardy's rule: every leaf's dimensions pass through to its output; the threshold's parts
  and the norms are per-system vectors."""
  dims = ", ".join(" ".join(f"l{i}d{j}" for j in range(len(s)))
                   for i, s in enumerate(spec.leaf_shapes))
  return f"t, t, t, {dims} -> {dims}, s"


def with_rule(whole, partition, rule: str):
  """``whole`` (the whole call) with the partitioning rule ``partition`` and Shardy's
  ``rule``, and the whole call under ``jax.vmap`` (custom partitioning has no batching rule).
  ``partition(mesh, arg_shapes, result_shape)`` returns the mesh, the per-device program, the
  result shardings and the argument shardings."""
  call = custom_partitioning(whole)
  call.def_partition(partition=partition,
                     infer_sharding_from_operands=lambda *a: partition(*a)[2],
                     propagate_user_sharding=None, sharding_rule=rule)

  @jax.custom_batching.custom_vmap
  def batchable(m, e, inf, *leaves):
    return call(m, e, inf, *leaves)

  @batchable.def_vmap
  def _batched(axis_size, in_batched, *operands):
    operands = [x if b else jnp.broadcast_to(x, (axis_size,) + x.shape)
                for x, b in zip(operands, in_batched)]
    out = jax.vmap(whole)(*operands)
    return out, jax.tree.map(lambda _: True, out)

  return batchable


@functools.cache
def _partitioned(spec: host_route.CallSpec):
  """The call of ``spec`` with its partitioning rule."""
  return with_rule(functools.partial(_whole, spec), functools.partial(_partition, spec),
                   _rule(spec))


def traced(op: str, p: float, nonfinite: str, num_systems: int, leaves, segments,
           threshold: Threshold):
  """(outputs, per-system norms) of a traced call: partitioned where :func:`applies`, else
  :func:`.host_route.traced` (call under x64)."""
  spec = host_route.call_spec(op, p, nonfinite, num_systems, leaves, segments, threshold)
  if not applies(spec) or not leaves:
    return host_route.traced(op, p, nonfinite, num_systems, leaves, segments, threshold)
  xla_ffi.register(TARGET, _execute)
  return _partitioned(spec)(*host_route.threshold_operands(threshold), *leaves)
