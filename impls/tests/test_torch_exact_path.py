"""The exact path of our torch routes: a near-tie's systems found and summed exactly, with their
rows found by binary search where each leaf's ids are sorted and by a whole read where not."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
# pylint: disable=wrong-import-position
from clipbench.impls.own.torch import api, branches, decisions
from clipbench.impls.own.torch.eager_passes import EagerKernels
from clipbench.impls.own.torch.layout import make_batch
from clipbench.impls.own.torch.oracles import gather_values, on_host_if_small


def _batch(seg: np.ndarray | None, vec: int = 3, num_systems: int = 6, seed: int = 0):
  rng = np.random.default_rng(seed)
  rows = 1 if seg is None else len(seg)
  x = torch.from_numpy(rng.normal(size=(rows, vec)).astype(np.float32))
  segs = None if seg is None else [torch.from_numpy(seg)]
  return make_batch([x], segs, num_systems if seg is not None else 1)


def _expected(batch, systems, vectors):
  """Per system of ``systems`` (by index), the multiset of its values, read row by row."""
  out = {j: [] for j in range(len(systems))}
  for leaf in batch.leaves:
    ids = np.zeros(leaf.rows, int) if leaf.seg is None else leaf.seg.numpy()
    m = leaf.matrix().double().numpy()
    for r, k in enumerate(ids):
      if k in systems:
        values = m[r].reshape(-1, leaf.vec) if vectors else m[r]
        out[list(systems).index(k)].extend(map(tuple, values) if vectors else values.tolist())
  return {j: sorted(v) for j, v in out.items()}


def _found(parts, systems, vectors):
  out = {j: [] for j in range(len(systems))}
  for values, owner in parts:
    for v, j in zip(values.numpy(), owner.numpy()):
      out[int(j)].append(tuple(v) if vectors else float(v))
  return {j: sorted(v) for j, v in out.items()}


SORTED = np.array([0, 0, 1, 1, 1, 3, 3, 5], np.int64)
UNSORTED = np.array([3, 0, 1, 5, 1, 0, 3, 1], np.int64)


@pytest.mark.parametrize("seg", [SORTED, UNSORTED, None], ids=["sorted", "unsorted", "no-ids"])
@pytest.mark.parametrize("systems", [[1], [3, 0], [5, 2, 1], [4]], ids=str)
@pytest.mark.parametrize("vectors", [False, True], ids=["elements", "vectors"])
def test_gathered_values_are_each_systems_own(seg, systems, vectors):
  batch = _batch(seg)
  if seg is None:
    systems = [0]
  with branches.accelerator_branches():  # the accelerator's branches, read back to the host
    parts, read = on_host_if_small(gather_values(batch, systems, vectors=vectors))
  assert read or not parts
  assert _found(parts, systems, vectors) == _expected(batch, systems, vectors)


def _tie_call(order: np.ndarray):
  """A per-system call whose system 1 has norm exactly 5 (the threshold): a tie, decided on
  the exact path; ``order`` permutes the rows (their ids go with them)."""
  rows = np.array([[1, 0, 0], [3, 4, 0], [0, 0, 2], [0.5, 0, 0], [0, 7, 0]], np.float32)
  ids = np.array([0, 1, 2, 2, 3], np.int64)
  clip = api.TorchClipping(EagerKernels(), "probe", cpu_kernels=False)
  leaves, norms = clip.clip_by_global_norm(
      [torch.from_numpy(rows[order])], 5.0, segments=[torch.from_numpy(ids[order])],
      num_systems=4)
  return leaves[0].numpy()[np.argsort(order)], norms.numpy()


def test_the_exact_path_gives_the_same_bits_whatever_the_rows_order(monkeypatch):
  opened = []
  resolve = decisions.resolve_exactly

  def spy(batch, measured, c, kind, p, certified, open_, *args, **kwargs):
    opened.append(torch.nonzero(open_).squeeze(1).tolist())
    return resolve(batch, measured, c, kind, p, certified, open_, *args, **kwargs)

  monkeypatch.setattr(decisions, "resolve_exactly", spy)
  sorted_rows, sorted_norms = _tie_call(np.arange(5))
  assert opened == [[1]]  # the tie, and only it, took the exact path
  assert sorted_norms[1] == 5.0 and sorted_rows[1].tolist() == [3, 4, 0]  # kept: norm = max
  for seed in range(4):
    order = np.random.default_rng(seed).permutation(5)
    rows, norms = _tie_call(order)
    assert rows.view(np.uint32).tolist() == sorted_rows.view(np.uint32).tolist()
    assert norms.view(np.uint64).tolist() == sorted_norms.view(np.uint64).tolist()
