"""The plain clip does what it is timed as: per-system L2 clipping, to float32 rounding.

Its timings say what per-system work costs only if it does the whole job: every system's
norm, every system above its threshold scaled to it, every other one kept, every row of every
leaf written. Checked against numpy on W5 and W2 at a small scale, on one thread and on two.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")
# pylint: disable=wrong-import-position
from clipbench.benchmarks import plain_clip, workloads
from clipbench.impls.own.numba import threads


def _numpy_clip(inputs: workloads.WorkloadInputs):
  sq = np.zeros(inputs.num_systems)
  for leaf, seg in zip(inputs.leaves, inputs.segments):
    rows = np.sum(leaf.reshape(leaf.shape[0], -1).astype(np.float64) ** 2, axis=1)
    sq += np.bincount(seg, weights=rows, minlength=inputs.num_systems)
  norms = np.sqrt(sq)
  factors = np.minimum(1.0, inputs.threshold / norms)
  outs = [(leaf.astype(np.float64) * factors[seg].reshape((-1,) + (1,) * (leaf.ndim - 1)))
          for leaf, seg in zip(inputs.leaves, inputs.segments)]
  return outs, norms


@pytest.mark.parametrize("workers", (1, 2))
@pytest.mark.parametrize("name", ("W5-many-tiny", "W2-relax"))
def test_plain_clip_is_per_system_clipping(name, workers, monkeypatch):
  monkeypatch.setattr(threads, "WORKERS", workers)
  inputs = workloads.get(name).build(0.05, "float32")
  outs, norms = plain_clip.plain_clip(list(inputs.leaves), inputs.threshold,
                                           list(inputs.segments), inputs.num_systems)
  want_outs, want_norms = _numpy_clip(inputs)
  np.testing.assert_allclose(norms, want_norms, rtol=1e-12)
  clipped = want_norms > inputs.threshold
  assert 0 < clipped.sum() < clipped.size
  for out, want, leaf in zip(outs, want_outs, inputs.leaves):
    assert out.shape == leaf.shape and out.dtype == np.float32
    np.testing.assert_allclose(out, want, rtol=2.0 ** -22, atol=0)


def test_plain_clip_names_a_bad_argument():
  x = np.ones((4, 3), dtype=np.float32)
  with pytest.raises(TypeError, match="segments"):
    plain_clip.plain_clip([x], 1.0, [np.zeros(4, dtype=np.int32)], 1)
  with pytest.raises(ValueError, match="segments"):
    plain_clip.plain_clip([x, x], 1.0, [np.zeros(4, dtype=np.int64)], 1)


def test_compare_times_every_candidate_against_the_roofline(monkeypatch):
  monkeypatch.setattr(plain_clip.bandwidth, "measure_copy_bandwidth", lambda: 1e10)
  ratios = plain_clip.compare("W5-many-tiny", rounds=2, scale=0.01, calls=3)
  assert set(ratios) == {"clipbench.numba", "plain clip", "copy of the leaves"}
  assert all(len(v) == 2 and all(r > 0 for r in v) for v in ratios.values())
  with pytest.raises(ValueError, match="workload"):
    plain_clip.compare("W1-model", rounds=1, scale=0.01, calls=1)
