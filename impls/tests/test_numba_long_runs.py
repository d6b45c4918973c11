"""The fused route's blocks of long runs (``long_runs``) against the general route.

A call whose largest system holds most of the rows (one giant system) is cut into the general
route's blocks on both threads instead of going to one thread whole. It must give the bits of
the general route and of the whole-system kernel, check every id (unsorted and out-of-range
ids go back to the general route, which raises its errors), and be taken only when the
chunks of whole systems are unbalanced.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")
# pylint: disable=wrong-import-position
from clipbench.impls.own.numba import api, fused, long_runs, threads
from clipbench.impls.own.numba.layout import BLOCK

OPS = ("clip_by_global_norm", "clip_by_max_step")


def _giant(seed, atoms, tiny=0, id_dtype=np.int64):
  """One system of ``atoms`` rows (values over many binades) and ``tiny`` small systems after
  it, positions (n, 3) and cells (S, 3, 3), sorted ids."""
  rng = np.random.default_rng(seed)
  counts = np.concatenate([[atoms], rng.integers(0, 4, tiny)])
  ids = np.repeat(np.arange(counts.size), counts).astype(id_dtype)
  scale = 10.0 ** rng.uniform(-30, 3, counts.size)[ids]
  positions = (rng.standard_normal((ids.size, 3)) * scale[:, None]).astype(np.float32)
  cell = rng.standard_normal((counts.size, 3, 3)).astype(np.float32)
  return [positions, cell], [ids, np.arange(counts.size, dtype=id_dtype)], counts.size


def _call(monkeypatch, op, leaves, segments, num_systems, route, threshold=1.0, **kwargs):
  """The call on one route: "blocks" (long runs), "whole" (whole systems) or "general"."""
  with monkeypatch.context() as m:
    m.setattr(threads, "PARALLEL_MIN", 1)
    if route == "general":
      m.setattr(fused, "run", lambda *a, **k: None)
    m.setattr(long_runs, "UNBALANCED_SHARE", 1e9 if route == "whole" else 0.0)
    taken = []
    m.setattr(long_runs, "run", lambda *a, _run=long_runs.run: taken.append(1) or _run(*a))
    out = getattr(api, op)(leaves, threshold, segments=segments, num_systems=num_systems,
                           **kwargs)
    assert bool(taken) == (route == "blocks")
    return out


def _assert_same_bits(got, want):
  for g, w in zip(got[0], want[0]):
    np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))
  np.testing.assert_array_equal(got[1].view(np.uint32), want[1].view(np.uint32))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("atoms,tiny,id_dtype", [
    (3 * BLOCK + 5, 0, np.int64), (5 * BLOCK // 3, 40, np.int32), (1, 0, np.int64)])
def test_blocks_give_the_general_route_bits(monkeypatch, op, workers, atoms, tiny, id_dtype):
  monkeypatch.setattr(threads, "WORKERS", workers)
  leaves, segments, ns = _giant(atoms + tiny, atoms, tiny, id_dtype)
  for threshold in (1.0, 1e-20, np.inf, 0.0):
    want = _call(monkeypatch, op, leaves, segments, ns, "general", threshold)
    _assert_same_bits(_call(monkeypatch, op, leaves, segments, ns, "blocks", threshold), want)
    _assert_same_bits(_call(monkeypatch, op, leaves, segments, ns, "whole", threshold), want)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("mode", ["propagate", "zero"])
def test_nonfinite_elements_match_the_general_route(monkeypatch, op, value, mode):
  monkeypatch.setattr(threads, "WORKERS", 2)
  leaves, segments, ns = _giant(7, 2 * BLOCK, 3)
  leaves[0][BLOCK + 1, 2] = value
  want = _call(monkeypatch, op, leaves, segments, ns, "general", nonfinite=mode)
  _assert_same_bits(_call(monkeypatch, op, leaves, segments, ns, "blocks", nonfinite=mode), want)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bad_id", [-1, 1, 99])
def test_every_id_is_checked(monkeypatch, op, where, bad_id):
  # A wrong id anywhere in the giant run: unsorted (1 before the end of system 0), below 0 or
  # not below num_systems; the general route then raises its error or gives its bits.
  monkeypatch.setattr(threads, "WORKERS", 2)
  leaves, segments, ns = _giant(8, 3 * BLOCK, 2)
  row = {"first": 0, "middle": 3 * BLOCK // 2, "last": 3 * BLOCK - 1}[where]
  segments[0] = segments[0].copy()
  segments[0][row] = bad_id
  try:
    want = _call(monkeypatch, op, leaves, segments, ns, "general")
  except (ValueError, TypeError) as error:
    with pytest.raises(type(error), match="segments"):
      _call(monkeypatch, op, leaves, segments, ns, "blocks")
  else:
    _assert_same_bits(_call(monkeypatch, op, leaves, segments, ns, "blocks"), want)


def test_blocks_are_taken_only_for_unbalanced_chunks(monkeypatch):
  monkeypatch.setattr(threads, "WORKERS", 2)
  monkeypatch.setattr(threads, "PARALLEL_MIN", 1)
  from clipbench.impls.own.numba.layout import leaf_layout
  giant, giant_segments, ns = _giant(9, 4 * BLOCK, 10)
  layout = leaf_layout(giant)
  _, bounds = fused._chunks(layout, fused.ids_of(giant_segments), ns)
  assert long_runs.unbalanced(bounds, layout)
  even = [np.zeros((4000, 3), np.float32), np.zeros((40, 3, 3), np.float32)]
  even_segments = [np.repeat(np.arange(40), 100), np.arange(40)]
  layout = leaf_layout(even)
  _, bounds = fused._chunks(layout, fused.ids_of(even_segments), 40)
  assert not long_runs.unbalanced(bounds, layout)
