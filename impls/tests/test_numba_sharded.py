"""The numba kernels' sharded call (``numba/sharded.py``) gives the unsharded call's bits.

Ranks are threads of this process exchanging through :class:`ThreadGroup` (the same calls a
gloo group makes, checked for the sizes every rank predicts), so every layout the blocks can
meet is cheap to try: uneven and empty shards, blocks straddling one or several boundaries,
sorted and unsorted ids, replicated leaves, rows in another rank order, every pass (power sums,
extremes, scaled double-double sums in two exchanges, max-step) and near-ties. Each case is
compared bit for bit with the public unsharded call (the fused route where it applies).
"""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

from clipbench.impls.own.numba import api, general, sharded
from clipbench.impls.own.numba.decode import F64
from clipbench.impls.own.numba.layout import BLOCK, SUB_BLOCK, Prepared, leaf_layout
from clipbench.impls.own.numba.segments import NO_SEGMENTS, checked_segments


class ThreadGroup:
  """An all-gather among ``size`` threads (one per rank) that checks each payload's size, and
  with ``point_to_point`` an all-to-all too (as gloo; JAX's replayed rounds have none)."""

  def __init__(self, size: int, point_to_point: bool = True):
    self.size = size
    self.point_to_point = point_to_point
    self.barrier = threading.Barrier(size)
    self.slots: list = [None] * size
    self.sent = [0] * size  # all-gather payloads
    self.sent_point_to_point = [0] * size

  def member(self, rank: int) -> "Member":
    return (PointToPointMember if self.point_to_point else Member)(self, rank)


def on_every_rank(group: ThreadGroup, body) -> None:
  """``body(rank)`` on a thread per rank of ``group``; then the first error any raised (a rank
  that fails aborts the group's barrier, so the others stop waiting for it)."""
  errors: list = []

  def run(g: int):
    try:
      body(g)
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)
      group.barrier.abort()

  workers = [threading.Thread(target=run, args=(g,)) for g in range(group.size)]
  for w in workers:
    w.start()
  for w in workers:
    w.join()
  if errors:
    raise errors[0]


class Member:
  """One rank's view of a :class:`ThreadGroup` (``sharded.Collective``)."""

  def __init__(self, group: ThreadGroup, rank: int):
    self.group, self.rank, self.size = group, rank, group.size

  def _gather(self, value):
    self.group.barrier.wait()
    self.group.slots[self.rank] = value
    self.group.barrier.wait()
    out = list(self.group.slots)
    self.group.barrier.wait()
    return out

  def all_gather_bytes(self, payload, sizes):
    assert payload.dtype == np.uint8 and payload.size == sizes[self.rank], (
        f"rank {self.rank}: payload {payload.size} bytes, every rank expects {sizes[self.rank]}")
    self.group.sent[self.rank] += payload.size
    return [np.array(x, copy=True) for x in self._gather(payload)]

  def all_gather_objects(self, value):
    return self._gather(value)

  def holds_next_round(self):
    return False


class PointToPointMember(Member):
  """A :class:`Member` that can also send each rank its own bytes."""

  def all_to_all_bytes(self, payloads, sizes):
    assert len(payloads) == self.size and not payloads[self.rank].size
    self.group.sent_point_to_point[self.rank] += sum(x.size for x in payloads)
    every = self._gather([np.array(x, copy=True) for x in payloads])
    received = [every[g][self.rank] for g in range(self.size)]
    assert [x.size for x in received] == list(sizes), (
        f"rank {self.rank}: received {[x.size for x in received]} bytes, expected {sizes}")
    return received


def _split_rows(rows: int, ranks: int, rng) -> list[int]:
  """Row counts per rank, uneven, some possibly empty."""
  cuts = np.sort(rng.integers(0, rows + 1, size=ranks - 1))
  return np.diff(np.concatenate([[0], cuts, [rows]])).tolist()


def sharded_call(op: str, leaves, threshold, *, ranks: int, rng, segments=None,
                 num_systems=None, replicated=(), reorder=False, point_to_point=True, grid=None,
                 column_split=None, **kwargs):
  """Every rank's (outputs, norms) of the sharded call, and the bytes each rank sent (by
  all-gather, point to point). ``grid`` (row groups, column groups; their product ``ranks``):
  each leaf of two axes or more split both ways (tensor parallelism on a 2-D mesh), a rank's
  piece its row group's rows of its columns, unevenly (``column_split``: these columns per
  column group)."""
  p = 2.0 if op == "clip_by_max_step" else kwargs.get("norm_type", 2.0)
  nonfinite = kwargs.get("nonfinite", "propagate")
  K = num_systems if segments is not None else 1
  nl = len(leaves)
  # A 0-d leaf has no rows to split: every rank holds it.
  replicated = tuple(replicated) + tuple(i for i, x in enumerate(leaves) if x.ndim == 0)
  counts = np.zeros((ranks, nl, K), dtype=np.int64)
  pieces = [[None] * nl for _ in range(ranks)]
  ids = [[None] * nl for _ in range(ranks)]
  columns = np.zeros((nl, ranks, 2), dtype=np.int64)
  orders = []
  for i, x in enumerate(leaves):
    rows = x.shape[0] if x.ndim else 1
    rowsize = int(np.prod(x.shape[1:], dtype=np.int64))
    if grid is not None and x.ndim >= 2 and i not in replicated:
      row_groups, column_groups = grid
      row_cuts = np.cumsum([0] + _split_rows(rows, row_groups, rng))
      column_cuts = np.cumsum([0] + (column_split or _split_rows(x.shape[1], column_groups,
                                                                  rng)))
      at = [(row_cuts[g // column_groups], row_cuts[g // column_groups + 1],
             column_cuts[g % column_groups], column_cuts[g % column_groups + 1])
            for g in range(ranks)]
      order = np.array(sorted(range(ranks), key=lambda g: (g // column_groups, at[g][2])))
    else:
      split = [rows] * ranks if i in replicated else _split_rows(rows, ranks, rng)
      order = rng.permutation(ranks) if reorder else np.arange(ranks)
      starts = np.zeros(ranks, np.int64)
      starts[order] = np.cumsum([0] + [split[g] for g in order.tolist()])[:-1]
      at = [(0 if i in replicated else starts[g], (0 if i in replicated else starts[g]) + split[g],
             0, x.shape[1] if x.ndim >= 2 else 1) for g in range(ranks)]
    orders.append(order)
    inner = rowsize // max(x.shape[1], 1) if x.ndim >= 2 else 1
    for g, (r0, r1, c0, c1) in enumerate(at):
      piece = x[r0:r1, c0:c1] if x.ndim >= 2 else x[r0:r1] if x.ndim else x
      pieces[g][i] = np.array(piece, order="C")  # keeps a 0-d leaf 0-d
      columns[i, g] = (c0 * inner, c1 * inner) if x.ndim >= 2 else (0, rowsize)
      if segments is not None:
        ids[g][i] = np.ascontiguousarray(segments[i][r0:r1])
        counts[g, i] = np.bincount(ids[g][i], minlength=K)
      else:
        counts[g, i, 0] = r1 - r0
  shards = sharded.ShardLayout(counts, np.array(orders, dtype=np.int64).reshape(nl, ranks),
                               np.array([i in replicated for i in range(nl)], dtype=np.bool_),
                               columns)
  layout = leaf_layout(leaves)
  group = ThreadGroup(ranks, point_to_point)
  results: list = [None] * ranks
  stats: list = [None] * ranks
  sent = np.zeros((ranks, 2), np.int64)  # by the call (the check of its sums sends again)

  def rank_main(g: int):
    segs = NO_SEGMENTS if segments is None else checked_segments(pieces[g], ids[g], K)
    results[g] = sharded.run(pieces[g], layout, threshold, segs, shards, group.member(g), p,
                             nonfinite, step=op == "clip_by_max_step")
    sent[g] = group.sent[g], group.sent_point_to_point[g]
    # The folded sums themselves, which few outputs would show: a float32 norm and a
    # factor of 24 bits rarely reveal a changed last bit of a float64 sum.
    source = sharded.ShardedBlocks(Prepared(pieces[g], leaf_layout(pieces[g]), segs), layout,
                                   shards, group.member(g))
    stats[g] = _stats(source, op, p, nonfinite, layout)

  on_every_rank(group, rank_main)
  whole = NO_SEGMENTS if segments is None else checked_segments(leaves, segments, K)
  want = _stats(general.LocalBlocks(Prepared(list(leaves), layout, whole)), op, p, nonfinite,
                layout)
  for g in range(ranks):
    for name, value in want.items():
      np.testing.assert_array_equal(np.asarray(stats[g][name]), np.asarray(value),
                                    err_msg=f"{name} on rank {g}", strict=True)
  return results, orders, replicated, sent


def _stats(source, op, p, nonfinite, layout):
  f64_mode = bool(np.any(layout.codes == F64))
  if op == "clip_by_max_step":
    return general.step_stats(source, nonfinite == "zero", f64_mode)
  return general.global_stats(source, p, nonfinite == "zero", f64_mode)


def assert_unsharded_bits(op, leaves, threshold, *, ranks, seed, replicated=(), reorder=False,
                          point_to_point=True, grid=None, column_split=None, **kwargs):
  rng = np.random.default_rng(seed)
  want_out, want_norms = getattr(api, op)(leaves, threshold, **kwargs)
  results, orders, replicated, sent = sharded_call(
      op, leaves, threshold, ranks=ranks, rng=rng, replicated=replicated, reorder=reorder,
      point_to_point=point_to_point, grid=grid, column_split=column_split, **kwargs)
  for g, (out, norms) in enumerate(results):
    np.testing.assert_array_equal(np.asarray(norms).reshape(-1).view(np.uint8),
                                  np.asarray(want_norms).reshape(-1).view(np.uint8),
                                  err_msg=f"norms on rank {g}")
  for i, want in enumerate(want_out):
    if i in replicated:
      got = [results[g][0][i] for g in range(ranks)]
    elif grid is not None and want.ndim >= 2:  # row groups, each its ranks' columns in order
      groups = np.split(orders[i], grid[0])
      got = [np.concatenate([np.concatenate([results[g][0][i] for g in group], axis=1)
                             for group in groups])]
    else:
      got = [np.concatenate([results[g][0][i] for g in orders[i].tolist()])]
    for x in got:
      assert x.shape == want.shape and x.dtype == want.dtype, f"leaves[{i}]"
      np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8),
                                    err_msg=f"leaves[{i}]")
  return sent


def _model(rng, dtype=np.float32):
  """A few leaves: one of several blocks, rows of several elements, a small one, a scalar."""
  return [rng.standard_normal((3 * BLOCK + 77,)).astype(dtype),
          rng.standard_normal((2500, 7)).astype(dtype),
          rng.standard_normal((13, 2)).astype(dtype),
          np.asarray(rng.standard_normal(), dtype=dtype)]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, 2.5, np.inf, -np.inf, 8.0])
def test_clip_grad_norm_every_pass(norm_type):
  rng = np.random.default_rng(3)
  leaves = _model(rng)
  assert_unsharded_bits("clip_grad_norm", leaves, 3.0, ranks=3, seed=3, norm_type=norm_type)


@pytest.mark.parametrize("dtype", [np.float64, np.float16, ml_dtypes.bfloat16])
def test_dtypes_and_a_replicated_leaf(dtype):
  rng = np.random.default_rng(5)
  leaves = _model(rng, dtype) + [rng.standard_normal((9000,)).astype(np.float32)]
  assert_unsharded_bits("clip_grad_norm", leaves, 2.0, ranks=4, seed=11, replicated=(1,))


def test_rows_in_another_rank_order_and_tiny_shards():
  rng = np.random.default_rng(6)
  leaves = [rng.standard_normal((BLOCK // 2 + 3, 4)).astype(np.float32),
            rng.standard_normal((40,)).astype(np.float32)]
  # Four ranks on a leaf of a few blocks: blocks straddle several boundaries at once.
  assert_unsharded_bits("clip_grad_norm", leaves, 1.0, ranks=4, seed=3, reorder=True)


@pytest.mark.parametrize("sorted_ids", [True, False])
@pytest.mark.parametrize("op", ["clip_by_global_norm", "clip_by_max_step"])
def test_per_system_segments(op, sorted_ids):
  rng = np.random.default_rng(7)
  K = 40
  leaves = [rng.standard_normal((6000, 3)).astype(np.float32),
            rng.standard_normal((2 * BLOCK + 5,)).astype(np.float32)]
  segments = [rng.integers(0, K - 1, size=6000), rng.integers(0, K, size=2 * BLOCK + 5)]
  if sorted_ids:
    segments = [np.sort(s) for s in segments]
    segments[1] = np.where(segments[1] < 3, 0, segments[1])  # one long run of several blocks
  threshold = rng.uniform(0.5, 30.0, size=K)
  assert_unsharded_bits(op, leaves, threshold, ranks=3, seed=8, segments=segments,
                        num_systems=K)


@pytest.mark.parametrize("nonfinite", ["propagate", "zero"])
@pytest.mark.parametrize("op", ["clip_by_global_norm", "clip_by_max_step"])
def test_non_finite_elements(op, nonfinite):
  rng = np.random.default_rng(9)
  K = 5
  leaves = [rng.standard_normal((3000, 3)), rng.standard_normal((BLOCK + 9, 2)).astype(np.float32)]
  leaves[0][17, 1] = np.nan
  leaves[1][BLOCK - 1, 0] = np.inf
  segments = [np.sort(rng.integers(0, K, size=3000)), np.sort(rng.integers(0, K, size=BLOCK + 9))]
  assert_unsharded_bits(op, leaves, 1.5, ranks=2, seed=10, segments=segments, num_systems=K,
                        nonfinite=nonfinite)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_zero_mode_blocks_across_boundaries_skip_their_non_finite_elements(dtype):
  """Zero mode, every block holding a NaN and an inf: each block across a shard boundary is
  the fold of its sub-blocks' sums without them (``power_sums.fold_sub_sums_skipping``; the
  float64 sums skip them in every block)."""
  rng = np.random.default_rng(21)
  x = rng.standard_normal(3 * BLOCK + 77).astype(dtype)
  x[::1000] = np.nan
  x[500::1000] = np.inf
  assert_unsharded_bits("clip_grad_norm", [x, x[:SUB_BLOCK + 3].copy()], 1.5, ranks=3,
                        seed=22, nonfinite="zero")


@pytest.mark.parametrize("norm_type", [2.0, 1.0, np.inf, 2.5])
def test_near_ties_are_decided_exactly_across_ranks(norm_type):
  """A threshold equal to a system's exact norm (kept, rule 3), its rows on several ranks."""
  rows = np.tile(np.array([[3.0, 4.0]], dtype=np.float32), (BLOCK, 1))
  rows[::2] = [[4.0, 3.0]]
  ids = np.repeat(np.arange(2), [BLOCK // 4, BLOCK - BLOCK // 4])
  m = {1.0: 7.0, 2.0: 5.0, np.inf: 4.0}.get(norm_type)
  counts = np.bincount(ids, minlength=2)
  if m is None:  # p = 2.5: no exact threshold in floats; near it, the exact path still decides
    exact_norm = (counts * (3.0 ** 2.5 + 4.0 ** 2.5)) ** (1 / 2.5)
  elif norm_type == np.inf:
    exact_norm = np.full(2, m)
  else:
    exact_norm = m * counts ** (1 / norm_type)
  assert_unsharded_bits("clip_by_global_norm", [rows], exact_norm, ranks=3, seed=12,
                        segments=[ids], num_systems=2, norm_type=norm_type)


def test_max_step_near_tie():
  rows = np.tile(np.array([[3.0, 4.0], [0.0, 1.0]], dtype=np.float32), (BLOCK, 1))
  assert_unsharded_bits("clip_by_max_step", [rows], 5.0, ranks=3, seed=13, segments=[
      np.zeros(2 * BLOCK, np.int64)], num_systems=1)


@pytest.mark.parametrize("seed", range(4))
def test_bytes_sent_are_block_results_not_leaves(seed):
  """A rank sends its whole blocks' sums, the sums of its whole sub-blocks of the block across
  the boundary and its elements of the one sub-block across it: for a leaf of many blocks, a
  small fraction of its shard (the counts are exact, so this can be tested)."""
  rng = np.random.default_rng(14 + seed)
  leaves = [rng.standard_normal((64 * BLOCK,)).astype(np.float32)]
  sent = assert_unsharded_bits("clip_grad_norm", leaves, 1.0, ranks=2, seed=15 + seed)
  blocks_and_sub_blocks = (64 + BLOCK // SUB_BLOCK) * 9
  assert sent.sum(1).max() <= blocks_and_sub_blocks + SUB_BLOCK * 4, sent


@pytest.mark.parametrize("nonfinite", ["propagate", "zero"])
@pytest.mark.parametrize("norm_type", [2.0, 8.0])
def test_every_piece_all_gathered_where_the_collective_has_no_all_to_all(norm_type, nonfinite):
  """JAX's replayed rounds have no all-to-all: beyond two ranks the sub-blocks across a
  boundary are then reduced by every rank from pieces all-gathered, with the same bits."""
  rng = np.random.default_rng(23)
  leaves = _model(rng, np.float64 if norm_type == 8.0 else np.float32)
  assert_unsharded_bits("clip_grad_norm", leaves, 2.0, ranks=4, seed=24, norm_type=norm_type,
                        nonfinite=nonfinite, point_to_point=False)


def test_beyond_two_ranks_blocks_across_a_boundary_are_completed_at_one_rank():
  """Four ranks: each block across a boundary is completed at the rank that would send the
  most of it; the others send it their sub-blocks' results and pieces (the smaller side
  travels), and the all-gather carries block results only, not each rank's pieces to every
  rank."""
  rng = np.random.default_rng(25)
  leaves = [rng.standard_normal((64 * BLOCK + 333,)).astype(np.float32) for _ in range(3)]
  sent = assert_unsharded_bits("clip_grad_norm", leaves, 1.0, ranks=4, seed=26)
  gathered = assert_unsharded_bits("clip_grad_norm", leaves, 1.0, ranks=4, seed=26,
                                   point_to_point=False)
  # Every block's result (9 bytes: sum and flags) all-gathered once, by its owner or the rank
  # that completed it, and nothing else.
  assert sent[:, 0].sum() == 9 * len(leaves) * -(-leaves[0].size // BLOCK), sent
  # Sent point to point: at most half of what the all-gather way carries beyond results.
  assert 0 < 2 * sent[:, 1].sum() <= gathered[:, 0].sum() - sent[:, 0].sum(), (sent, gathered)


@pytest.mark.parametrize("grid,norm_type", [
    (grid, p) for grid in ((1, 3), (2, 2)) for p in (2.0, 1.0, 3.0, np.inf, -np.inf, 8.0)]
                         + [((1, 2), 2.0), ((3, 1), 2.0)])
def test_leaves_split_by_columns(grid, norm_type):
  """Tensor parallelism: each rank holds some columns of its row group's rows (uneven, some
  empty), so a block, even a sub-block, holds a stretch of every rank's columns, row after
  row; rows of any width, narrower than a sub-block too."""
  rng = np.random.default_rng(27)
  leaves = [rng.standard_normal((40, 700)).astype(np.float32),
            rng.standard_normal((BLOCK // 3, 5)).astype(np.float32),
            rng.standard_normal((7, 9, SUB_BLOCK)).astype(ml_dtypes.bfloat16),
            rng.standard_normal((3 * BLOCK + 77,)).astype(np.float32)]
  assert_unsharded_bits("clip_grad_norm", leaves, 3.0, ranks=grid[0] * grid[1], seed=28,
                        grid=grid, norm_type=norm_type)


@pytest.mark.parametrize("nonfinite", ["propagate", "zero"])
@pytest.mark.parametrize("sorted_ids", [True, False])
def test_leaves_split_by_columns_per_system(sorted_ids, nonfinite):
  rng = np.random.default_rng(29)
  K = 9
  leaves = [rng.standard_normal((300, 600)), rng.standard_normal((2000, 6)).astype(np.float32)]
  leaves[0][17, 301] = np.nan
  leaves[1][1000, 2] = np.inf
  segments = [rng.integers(0, K, size=300), rng.integers(0, K, size=2000)]
  if sorted_ids:
    segments = [np.sort(s) for s in segments]
  threshold = rng.uniform(0.5, 30.0, size=K)
  assert_unsharded_bits("clip_by_global_norm", leaves, threshold, ranks=4, seed=30, grid=(2, 2),
                        segments=segments, num_systems=K, nonfinite=nonfinite)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 2.5])
def test_near_ties_of_leaves_split_by_columns(norm_type):
  """A threshold at a system's exact norm, its rows' columns on every rank."""
  rows = np.tile(np.array([[3.0, 4.0] * 150], dtype=np.float32), (64, 1))
  ids = np.repeat(np.arange(2), [20, 44])
  counts = np.bincount(ids, minlength=2) * 150
  m = {1.0: 7.0, 2.0: 5.0}.get(norm_type)
  exact_norm = ((counts * (3.0 ** 2.5 + 4.0 ** 2.5)) ** (1 / 2.5) if m is None
                else m * counts ** (1 / norm_type))
  assert_unsharded_bits("clip_by_global_norm", [rows], exact_norm, ranks=3, seed=31,
                        grid=(1, 3), segments=[ids], num_systems=2, norm_type=norm_type)


@pytest.mark.parametrize("split", [[SUB_BLOCK, 3 * SUB_BLOCK], [2 * SUB_BLOCK, 2 * SUB_BLOCK]])
def test_bytes_sent_for_columns_on_the_sub_block_grid_are_sub_block_results(split):
  """Each rank's stretch of a row a multiple of ``SUB_BLOCK`` elements from a multiple of it:
  no sub-block is shared, so no element travels, only the results of sub-blocks (9 bytes)."""
  rng = np.random.default_rng(32)
  leaves = [rng.standard_normal((64, 4 * SUB_BLOCK)).astype(np.float32)]
  sent = assert_unsharded_bits("clip_grad_norm", leaves, 1.0, ranks=2, seed=33, grid=(1, 2),
                               column_split=split)
  assert sent.sum(1).max() <= 9 * leaves[0].size // SUB_BLOCK, sent


def test_columns_off_the_sub_block_grid_send_the_smaller_side_of_each_shared_sub_block():
  """Half a sub-block off the grid, two ranks: a sub-block a row is shared, 128 elements on
  each side. Its elements are more than 1% of a rank's leaves, so the blocks are completed
  at one rank, point to point: one side of each shared sub-block travels, once (the
  all-gather way sends both sides, every rank completing every block)."""
  rng = np.random.default_rng(34)
  rows, half = 64, SUB_BLOCK // 2
  leaves = [rng.standard_normal((rows, 4 * SUB_BLOCK)).astype(np.float32)]
  split = [SUB_BLOCK + half, 3 * SUB_BLOCK - half]
  sent = assert_unsharded_bits("clip_grad_norm", leaves, 1.0, ranks=2, seed=35, grid=(1, 2),
                               column_split=split)
  gathered = assert_unsharded_bits("clip_grad_norm", leaves, 1.0, ranks=2, seed=35,
                                   grid=(1, 2), column_split=split, point_to_point=False)
  one_side = rows * half * 4
  results = 9 * rows * 4 + 9 * leaves[0].size // BLOCK  # every sub-block's, every block's
  assert one_side <= sent.sum() <= one_side + results, sent
  assert 2 * one_side <= gathered.sum() <= 2 * (one_side + results), gathered
