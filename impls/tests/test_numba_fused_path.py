"""The numba kernels' fused route for sorted segments against their general route.

Per-system calls on float32 leaves with sorted int32/int64 ids take one fused pass over each
chunk of systems (``fused.fused_systems``; the threads claim the chunks in turn): ids
scanned, squares summed, systems finalized and scaled while in cache. It must give the bits of
the general route (separate scan, blocks, combine, finalize and apply kernels) on every input,
however the systems are cut into chunks, hand back what it does not handle (unsorted or
out-of-range ids, non-finite elements in zero mode) and raise the general route's errors.
The general route is forced by disabling the fused one (``fused.run`` returning None).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("numba")
# pylint: disable=wrong-import-position
from numba import njit

from clipbench.impls.own import decision
from clipbench.impls.own.numba import api, fused, general, threads
from clipbench.impls.own.numba.finalize import sum_rel_err_of_squares
from clipbench.impls.own.numba.intrinsics import add_one
from clipbench.impls.own.numba.layout import BLOCK, Prepared, leaf_layout
from clipbench.impls.own.numba.run_scan import RUN_LANES, SEG_CODE_OF, SEG_I32, run_end
from clipbench.impls.own.numba.segments import checked_segments, rows_below, rows_below_each

OPS = ("clip_by_global_norm", "clip_by_max_step")


def _general(monkeypatch, op, *args, **kwargs):
  with monkeypatch.context() as m:
    m.setattr(fused, "run", lambda *a, **k: None)
    return getattr(api, op)(*args, **kwargs)


def _fused(leaves, segments, num_systems, step, sums=None):
  """The fused route alone, threshold 1.0, propagate mode: (outputs, norms) or None."""
  return fused.run(leaves, leaf_layout(leaves), 1.0, segments, num_systems, False, step,
                   sums=sums)


def _general_sums(leaves, segments, num_systems, step):
  """The general route's per-system sums (of squares, or largest vector sums)."""
  segs = checked_segments(leaves, segments, num_systems)
  prep = general.LocalBlocks(Prepared(list(leaves), leaf_layout(leaves), segs))
  stats = (general.step_stats(prep, False, False) if step else
           general.global_stats(prep, 2.0, False, False))
  return stats["s_hi"]


def _assert_same_bits(got, want):
  (got_leaves, got_norms), (want_leaves, want_norms) = got, want
  assert len(got_leaves) == len(want_leaves)
  for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
    assert g.shape == w.shape and g.dtype == w.dtype, f"leaves[{i}]"
    np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32), err_msg=f"leaves[{i}]")
  assert got_norms.dtype == want_norms.dtype
  np.testing.assert_array_equal(got_norms.view(np.uint32), want_norms.view(np.uint32))


def _batch(seed: int, num_systems: int, mean_rows: int, id_dtype=np.int64):
  """Leaves of every kind the fused route takes: (n, 3) rows, per-system (3, 3) cells, a 1-D
  leaf, a wide leaf whose systems span several summation blocks, and empty systems; values
  over many binades (subnormals included), sorted ids."""
  rng = np.random.default_rng(seed)
  leaves, segments = [], []
  for width, empty_share in ((3, 0.1), (None, 0.3), (1 + BLOCK // 16, 0.9)):
    counts = rng.poisson(mean_rows, num_systems)
    counts[rng.random(num_systems) < empty_share] = 0
    ids = np.repeat(np.arange(num_systems), counts).astype(id_dtype)
    shape = (ids.size,) if width is None else (ids.size, width)
    scale = 10.0 ** rng.uniform(-40, 3, num_systems)[ids]
    values = rng.standard_normal(shape) * (scale if width is None else scale[:, None])
    leaves.append(values.astype(np.float32))
    segments.append(ids)
  leaves.append(rng.standard_normal((num_systems, 3, 3)).astype(np.float32))
  segments.append(np.arange(num_systems, dtype=id_dtype))
  return leaves, segments


def _tiny_batch(seed: int, num_systems: int, id_dtype=np.int64):
  """Systems of a few atoms, as W5 batches small molecules: positions (n, 3) of 0-8 atoms a
  system (some systems empty) and a (3, 3) cell each; values over many binades, subnormals
  and signed zeros included. Every chunk of it goes in groups (``fused.in_groups``)."""
  rng = np.random.default_rng(seed)
  atoms = rng.integers(0, 9, num_systems)
  ids = np.repeat(np.arange(num_systems), atoms).astype(id_dtype)
  scale = 10.0 ** rng.uniform(-40, 3, num_systems)
  positions = (rng.standard_normal((ids.size, 3)) * scale[ids, None]).astype(np.float32)
  positions[rng.random(positions.shape) < 0.02] = 0.0
  positions[rng.random(positions.shape) < 0.02] *= -0.0
  cell = (rng.standard_normal((num_systems, 3, 3)) * scale[:, None, None]).astype(np.float32)
  return [positions, cell], [ids, np.arange(num_systems, dtype=id_dtype)]


def _elements_per_system_fit_groups(leaves, num_systems):
  return fused.in_groups(sum(x.size for x in leaves), num_systems)


def _thresholds(rng, num_systems):
  per_system = 10.0 ** rng.uniform(-42, 4, num_systems)
  per_system[rng.random(num_systems) < 0.1] = 0.0
  per_system[rng.random(num_systems) < 0.1] = np.inf
  return (1.0, 1e-30, per_system)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("seed,num_systems,mean_rows,id_dtype", [
    (0, 1, 20, np.int64), (1, 7, 3, np.int32), (2, 300, 40, np.int64),
    (3, 2_000, 80, np.int32)])  # the last one exceeds _PARALLEL_MIN: two threads
def test_fused_route_gives_the_general_route_bits(monkeypatch, op, seed, num_systems, mean_rows,
                                                  id_dtype):
  leaves, segments = _batch(seed, num_systems, mean_rows, id_dtype)
  for threshold in _thresholds(np.random.default_rng(seed), num_systems):
    for nonfinite in ("propagate", "zero"):
      args = (leaves, threshold)
      kwargs = dict(segments=segments, num_systems=num_systems, nonfinite=nonfinite)
      _assert_same_bits(getattr(api, op)(*args, **kwargs), _general(monkeypatch, op, *args,
                                                                   **kwargs))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("seed,num_systems,id_dtype", [
    (20, 1, np.int64), (21, 300, np.int32), (22, 5_000, np.int64),
    (23, 40_000, np.int32)])  # the last ones span several groups; the last, threads
def test_tiny_systems_in_groups_give_the_general_route_bits(monkeypatch, op, seed,
                                                            num_systems, id_dtype):
  # Groups of tiny systems are decided in vector lanes and applied in masked steps: every
  # bit must still be the general route's, at thresholds that clip some, all or none of the
  # systems, zero and infinite ones among them.
  leaves, segments = _tiny_batch(seed, num_systems, id_dtype)
  assert _elements_per_system_fit_groups(leaves, num_systems)
  step = op == "clip_by_max_step"
  sums = np.full(num_systems, np.nan)
  assert _fused(leaves, segments, num_systems, step, sums=sums) is not None
  np.testing.assert_array_equal(sums.view(np.uint64),
                                _general_sums(leaves, segments, num_systems, step).view(np.uint64))
  rng = np.random.default_rng(seed)
  median = float(np.median(np.sqrt(sums)))
  for threshold in _thresholds(rng, num_systems) + (median, median * (1 + 2.0 ** -20)):
    kwargs = dict(segments=segments, num_systems=num_systems)
    _assert_same_bits(getattr(api, op)(leaves, threshold, **kwargs),
                      _general(monkeypatch, op, leaves, threshold, **kwargs))


@pytest.mark.parametrize("op", OPS)
def test_tiny_systems_over_many_leaves_give_the_general_route_bits(monkeypatch, op):
  # With many leaves a group holds fewer systems (its run bounds, leaves x systems, stay
  # within fused.GROUP_BOUNDS): 300 leaves of rows of 3, most systems with no row in most
  # leaves, go in groups of fused.GROUP_MIN systems.
  rng = np.random.default_rng(25)
  num_systems = 1_000
  leaves, segments = [], []
  for _ in range(300):
    ids = np.sort(rng.choice(num_systems, int(rng.integers(0, 60)), replace=False))
    leaves.append((rng.standard_normal((ids.size, 3)) *
                   10.0 ** rng.uniform(-20, 3)).astype(np.float32))
    segments.append(ids.astype(np.int64))
  assert _elements_per_system_fit_groups(leaves, num_systems)
  assert fused.GROUP_BOUNDS // len(leaves) < fused.GROUP_MIN
  sums = np.full(num_systems, np.nan)
  step = op == "clip_by_max_step"
  assert _fused(leaves, segments, num_systems, step, sums=sums) is not None
  np.testing.assert_array_equal(sums.view(np.uint64),
                                _general_sums(leaves, segments, num_systems, step).view(np.uint64))
  for threshold in (1.0, float(np.median(np.sqrt(sums[sums > 0])))):
    kwargs = dict(segments=segments, num_systems=num_systems)
    _assert_same_bits(getattr(api, op)(leaves, threshold, **kwargs),
                      _general(monkeypatch, op, leaves, threshold, **kwargs))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("mode", ("propagate", "zero"))
def test_tiny_systems_with_nonfinite_elements_match_the_general_route(monkeypatch, op, mode):
  leaves, segments = _tiny_batch(24, 3_000)
  leaves[0][5, 1] = np.nan
  leaves[0][400, 0] = np.inf
  leaves[1][7, 2, 2] = -np.inf
  kwargs = dict(segments=segments, num_systems=3_000, nonfinite=mode)
  _assert_same_bits(getattr(api, op)(leaves, 1e-3, **kwargs),
                    _general(monkeypatch, op, leaves, 1e-3, **kwargs))


def test_the_test_batches_take_both_paths():
  # The other tests' batches must reach both loops of the fused kernel: systems one by one
  # and tiny systems in groups.
  leaves, _ = _batch(2, 300, 40)
  assert not _elements_per_system_fit_groups(leaves, 300)
  tiny, _ = _tiny_batch(22, 5_000)
  assert _elements_per_system_fit_groups(tiny, 5_000)
  assert 5_000 > fused.GROUP


@pytest.mark.parametrize("op,norm_type", [
    ("clip_by_max_step", None), ("clip_by_global_norm", None), ("clip_by_global_norm", 2),
    ("clip_by_global_norm", 2.0), ("clip_by_global_norm", np.float32(2)),
    ("clip_by_global_norm", np.int64(2))])
def test_fused_route_is_taken_for_sorted_float32(monkeypatch, op, norm_type):
  leaves, segments = _batch(5, 3_000, 60)

  def general_path(*args, **kwargs):
    raise AssertionError("the general route ran")

  monkeypatch.setattr(general, "run", general_path)
  kwargs = {} if norm_type is None else {"norm_type": norm_type}
  out, norms = getattr(api, op)(leaves, 1.0, segments=segments, num_systems=3_000, **kwargs)
  assert norms.shape == (3_000,)
  assert any(np.count_nonzero(o != x) for o, x in zip(out, leaves)), "nothing was clipped"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("mode", ("propagate", "zero"))
def test_nonfinite_systems_match_the_general_route(monkeypatch, op, mode):
  leaves, segments = _batch(6, 2_000, 80)
  rng = np.random.default_rng(6)
  for x in leaves:
    flat = x.reshape(-1)
    flat[rng.integers(0, flat.size, 5)] = np.nan
    flat[rng.integers(0, flat.size, 5)] = -np.inf
  args = (leaves, 0.5)
  kwargs = dict(segments=segments, num_systems=2_000, nonfinite=mode)
  got = getattr(api, op)(*args, **kwargs)
  _assert_same_bits(got, _general(monkeypatch, op, *args, **kwargs))
  if mode == "propagate":
    assert np.isnan(got[1]).any(), "no system was poisoned"


@pytest.mark.parametrize("op", OPS)
def test_exact_ties_are_kept_bitwise(monkeypatch, op):
  # Norm (and step norm) exactly 5 = the threshold: a near-tie settled exactly, kept (rule 3).
  num_systems = 400
  rng = np.random.default_rng(7)
  ids = np.repeat(np.arange(num_systems), 2)
  pos = (rng.standard_normal((ids.size, 3)) * 10).astype(np.float32)
  tie_rows = np.flatnonzero(ids == 17)
  pos[tie_rows] = [[3.0, 4.0, 0.0], [0.0, 0.0, 0.0]]
  cell = np.zeros((num_systems, 3, 3), np.float32)
  args = ([pos, cell], 5.0)
  kwargs = dict(segments=[ids, np.arange(num_systems)], num_systems=num_systems)
  got = getattr(api, op)(*args, **kwargs)
  np.testing.assert_array_equal(got[0][0][tie_rows].view(np.uint32), pos[tie_rows].view(np.uint32))
  assert got[1][17] == np.float32(5.0)
  _assert_same_bits(got, _general(monkeypatch, op, *args, **kwargs))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("where", ("start", "middle", "end"))
def test_unsorted_ids_fall_back_with_the_same_bits(monkeypatch, op, where):
  leaves, segments = _batch(8, 2_000, 80)
  ids = segments[0].copy()
  j = {"start": 0, "middle": ids.size // 2, "end": ids.size - 2}[where]
  ids[j], ids[j + 1] = ids[j + 1], ids[j]
  if ids[j] == ids[j + 1]:
    ids[j + 1] = max(0, ids[j] - 1)
  segments[0] = ids
  kwargs = dict(segments=segments, num_systems=2_000)
  _assert_same_bits(getattr(api, op)(leaves, 1.0, **kwargs),
                    _general(monkeypatch, op, leaves, 1.0, **kwargs))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bad_id", (-1, 2_000, 10**9))
@pytest.mark.parametrize("where", (0, 1, -1))
def test_out_of_range_ids_raise_the_general_route_error(monkeypatch, op, bad_id, where):
  leaves, segments = _batch(9, 2_000, 80)
  segments[1] = segments[1].copy()
  segments[1][where] = bad_id
  kwargs = dict(segments=segments, num_systems=2_000)
  with pytest.raises(ValueError, match=r"segments\[1\]: system id") as fused:
    getattr(api, op)(leaves, 1.0, **kwargs)
  with pytest.raises(ValueError) as general:
    _general(monkeypatch, op, leaves, 1.0, **kwargs)
  assert str(fused.value) == str(general.value)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("seed,num_systems,mean_rows", [(10, 5, 300), (11, 2_000, 80)])
def test_fused_sums_are_the_general_route_sums(op, seed, num_systems, mean_rows):
  # The outputs hardly show a changed summation order (decisions are exact, factors keep 24
  # bits), so rule 11's "same order" claim is checked on the sums themselves.
  leaves, segments = _batch(seed, num_systems, mean_rows)
  step = op == "clip_by_max_step"
  sums = np.full(num_systems, np.nan)
  assert _fused(leaves, segments, num_systems, step, sums=sums) is not None
  want = _general_sums(leaves, segments, num_systems, step)
  np.testing.assert_array_equal(sums.view(np.uint64), want.view(np.uint64))


def test_fused_rel_err_is_numerics_sum_rel_err():
  # The kernel's scalar twin of the bound the general route takes from numerics: the same
  # bits for every count (a different bound moves near-tie decisions, which outputs rarely show).
  counts = np.concatenate([np.arange(0, 5000), 10 ** np.arange(4, 16), [2**53, 2**60]])
  want = decision.sum_rel_err(counts.astype(np.float64), 0.0)
  got = np.array([sum_rel_err_of_squares(np.int64(n)) for n in counts.tolist()])
  np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))


def _run_end_by_definition(ids, r, k):
  """``run_end``'s rule, one id at a time: the first index >= r whose id is not k
  (len(ids) if none), or -1 when that id is below k."""
  e = r
  while e < len(ids) and int(ids[e]) == k:
    e += 1
  return -1 if e < len(ids) and int(ids[e]) < k else e


@pytest.mark.parametrize("id_dtype", [np.int64, np.int32])
def test_run_scan_follows_its_rule(id_dtype):
  # Runs longer than a vector step, ending at every lane of a step, and unsorted ids.
  scan = njit(lambda ids, r, k, code: run_end(ids.ctypes.data, code, r, ids.size, k))
  code = SEG_CODE_OF[np.dtype(id_dtype)]
  rng = np.random.default_rng(7)
  for trial in range(400):
    ids = np.repeat(np.arange(6), rng.integers(0, 3 * RUN_LANES + 2, 6)).astype(id_dtype)
    if trial % 3 == 0 and ids.size:
      ids[rng.integers(0, ids.size, 2)] = rng.integers(0, 6, 2)
    for r in range(0, ids.size + 1, 1 + trial % 5):
      for k in range(-1, 7):
        assert scan(ids, r, k, code) == _run_end_by_definition(ids, r, k), (ids, r, k)


def test_run_scan_of_int32_ids_never_wraps_a_large_k():
  # Compared in int32 lanes, k = 2**32 + 5 would equal the ids 5: no run of it exists.
  scan = njit(lambda ids, r, k: run_end(ids.ctypes.data, SEG_I32, r, ids.size, k))
  ids = np.full(4 * RUN_LANES, 5, dtype=np.int32)
  assert scan(ids, 0, 2**32 + 5) == -1
  assert scan(ids, 0, 5) == ids.size


@pytest.mark.parametrize("id_dtype", [np.int64, np.int32])
def test_rows_below_counts_ids_below_k(id_dtype):
  ids = np.repeat(np.array([0, 3, 2**31 - 1]), 4).astype(id_dtype)
  for k in (0, 1, 3, 4, 2**31 - 1, 2**31, 2**40):
    assert rows_below(ids, k) == int(np.sum(ids.astype(np.int64) < k)), k


@pytest.mark.parametrize("id_dtype", [np.int64, np.int32])
def test_rows_below_each_counts_ids_below_every_key(id_dtype):
  ids = np.repeat(np.array([0, 3, 2**31 - 1]), 4).astype(id_dtype)
  keys = np.array([0, 1, 3, 4, 2**31 - 1, 2**31, 2**40], dtype=np.int64)
  got = rows_below_each(ids, keys)
  assert got.tolist() == [int(np.sum(ids.astype(np.int64) < k)) for k in keys]


@pytest.mark.parametrize("id_dtype", [np.int64, np.int32])
@pytest.mark.parametrize("ids", ("sorted", "empty systems", "out of range", "unsorted"))
def test_chunk_cuts_split_the_largest_leaf_and_search_the_others(id_dtype, ids):
  # Chunk t: systems [cuts[t], cuts[t+1]), rows [bounds[t, l], bounds[t+1, l]) of leaf l;
  # what a binary search of the ids at the largest leaf's even splits gives (numpy's).
  rng = np.random.default_rng(3)
  big = np.sort(rng.integers(0, 50, 997))
  small = np.arange(50)
  if ids == "empty systems":
    big, small = big[(big < 10) | (big > 30)], small[small % 3 != 0]
  elif ids == "out of range":
    big[:5], big[-5:], small[-1] = -7, 80, 2**31 - 1
  elif ids == "unsorted":
    rng.shuffle(big)
  segments = [big.astype(id_dtype), small.astype(id_dtype)]
  layout = leaf_layout([np.zeros((big.size, 3), np.float32),
                        np.zeros((small.size, 3, 3), np.float32)])
  parts = 7
  cuts, bounds = fused._cut_chunks(fused.ids_of(segments).addrs, fused.ids_of(segments).codes,
                                   layout.rows, 0, 50, parts)
  want_cuts = np.empty(parts + 1, dtype=np.int64)
  want_cuts[0], want_cuts[parts] = 0, 50
  want_cuts[1:parts] = segments[0][big.size * np.arange(1, parts) // parts]
  want_cuts = np.minimum(np.maximum.accumulate(want_cuts), 50)
  want_bounds = np.stack([np.searchsorted(g.astype(np.int64), want_cuts) for g in segments], 1)
  want_bounds[0], want_bounds[parts] = 0, layout.rows
  want_bounds = np.maximum.accumulate(want_bounds, axis=0)
  assert cuts.tolist() == want_cuts.tolist()
  if ids != "unsorted":  # a binary search of unsorted ids depends on its probes
    assert bounds.tolist() == want_bounds.tolist()
  assert (np.diff(bounds, axis=0) >= 0).all() and bounds[-1].tolist() == layout.rows.tolist()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("chunks", ("one", "some", "one per system"))
def test_chunking_never_changes_bits(monkeypatch, op, chunks):
  # Which systems share a chunk, and which thread claims it, must not show in any bit: the
  # outputs, the norms and the sums equal the general route's however the systems are cut.
  num_systems = 300
  leaves, segments = _batch(12, num_systems, 40)
  monkeypatch.setattr(threads, "PARALLEL_MIN", 1)
  monkeypatch.setattr(fused, "CHUNK_MIN_BYTES", 1)
  monkeypatch.setattr(fused, "CHUNKS_PER_WORKER",
                      {"one": 1, "some": 5, "one per system": num_systems}[chunks])
  if chunks == "one":
    monkeypatch.setattr(threads, "WORKERS", 1)
  step = op == "clip_by_max_step"
  sums = np.full(num_systems, np.nan)
  got = _fused(leaves, segments, num_systems, step, sums=sums)
  assert got is not None
  want = _general_sums(leaves, segments, num_systems, step)
  np.testing.assert_array_equal(sums.view(np.uint64), want.view(np.uint64))
  kwargs = dict(segments=segments, num_systems=num_systems)
  _assert_same_bits(got, _general(monkeypatch, op, leaves, 1.0, **kwargs))
  # Unsorted and out-of-range ids are caught in whichever chunk they fall.
  for j in (0, segments[0].size // 2, segments[0].size - 2):
    bad = [g.copy() for g in segments]
    bad[0][j], bad[0][j + 1] = bad[0][j + 1] + 1, bad[0][j]
    assert _fused(leaves, bad, num_systems, step) is None
  for bad_id in (-1, num_systems):
    for j in (0, segments[1].size // 2, -1):
      bad = [g.copy() for g in segments]
      bad[1][j] = bad_id
      assert _fused(leaves, bad, num_systems, step) is None, (bad_id, j)


def test_claims_give_every_number_to_exactly_one_thread():
  # The chunk counter's fetch-and-add must be atomic: two threads claiming as fast as they
  # can from one counter must never both get a number (a plain load, add and store would).
  @njit(nogil=True)
  def claim_all(counter, limit):
    n = 0
    total = 0
    while True:
      t = add_one(counter, 0)
      if t >= limit:
        return n, total
      n += 1
      total += t

  limit = 20_000_000
  claim_all(np.zeros(1, dtype=np.int64), 1)  # compiled before the race

  def race():
    counter = np.zeros(1, dtype=np.int64)
    barrier = threading.Barrier(2)
    results = [(0, 0), (0, 0)]

    def run(i):
      barrier.wait()
      results[i] = claim_all(counter, limit)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    return results

  for _ in range(5):  # a busy machine may run one thread to the end before the other starts
    results = race()
    if min(n for n, _ in results) > 0:
      break
  assert min(n for n, _ in results) > 0, f"the threads never overlapped: {results}"
  assert sum(n for n, _ in results) == limit
  assert sum(total for _, total in results) == limit * (limit - 1) // 2
