"""A plain, inexact per-system clip beside ours: what per-system work costs on this machine.

The roofline (:mod:`~clipbench.benchmarks.bandwidth`) prices memory: three passes over the
leaves at the copy bandwidth of a buffer far larger than the caches. A call of many tiny
systems (W5: 100,000 systems of 2-8 atoms, 9.6 MB of leaves, which stay in the last-level
cache from call to call) is priced by its per-system work instead: finding each system's rows,
summing them, a square root and a division, and a scaled copy. Whether our exactness is what
keeps W5 from the roofline is a question of measurement, so this module times, in one process
and in alternating rounds, ``clipbench.numba``, the clip a user would write for speed without
any of SPEC's exactness (``plain_clip``), and a copy of the leaves, each against the roofline
of its round.

``plain_clip`` takes sorted ids on trust (no validation) and goes through blocks of
``BLOCK_SYSTEMS`` systems: each row's sum of squares in float64 added into its system's,
every system's factor ``min(1, c / norm)`` rounded to float32, every row multiplied by its
system's factor; chunks of systems are claimed in turn on the thread pool ``clipbench.numba``
uses. It keeps nothing bitwise at the threshold (rule 3), rounds to nearest (rule 4), sums in
an order that depends on the batch (rule 11) and checks nothing (rules 6-13). It is a point of
comparison, not a lower bound: other plain designs are possible, and the ones tried are in
docs/cpu-kernels.md.

``python -m clipbench.benchmarks.plain_clip [--workload W5-many-tiny] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import functools
import math
from typing import Callable

import numpy as np

from clipbench.benchmarks import bandwidth, timing, workloads

BLOCK_SYSTEMS = 1024  # systems summed, decided and scaled per pass (their rows stay in L2)
CHUNKS_PER_WORKER = 16  # as clipbench.numba's fused route claims them


@functools.cache
def _claimed_kernel() -> Callable[..., None]:
  """The compiled kernel: ``_clip_systems`` over chunks [cuts[t], cuts[t + 1]) claimed from a
  ``threads.new_counter()`` in turn. Built on first use, so that importing this module loads
  no framework (asv imports every module of this folder)."""
  # pylint: disable=import-outside-toplevel
  from numba import njit

  from clipbench.impls.own.numba import threads
  from clipbench.impls.own.numba.intrinsics import add_one, store_fence
  started, claim, finished = threads.STARTED, threads.NEXT, threads.FINISHED

  @njit(nogil=True, error_model="numpy")
  def clip_systems(k0, k1, starts, leaves, ids, c, outs, norms):
    """Systems [k0, k1), whose rows in leaf l start at ``starts[l]``, clipped plainly."""
    acc = np.empty(BLOCK_SYSTEMS)
    fac = np.empty(BLOCK_SYSTEMS, dtype=np.float32)
    cur = starts.copy()
    for g0 in range(k0, k1, BLOCK_SYSTEMS):
      g1 = min(g0 + BLOCK_SYSTEMS, k1)
      acc[:g1 - g0] = 0.0
      ends = cur.copy()
      for l in range(len(leaves)):
        x, seg = leaves[l], ids[l]
        r = cur[l]
        while r < seg.size and seg[r] < g1:
          r += 1
        ends[l] = r
        if x.shape[1] == 3:  # 3-vectors (positions): written out, so the row loop vectorizes
          for i in range(cur[l], r):
            a0, a1, a2 = np.float64(x[i, 0]), np.float64(x[i, 1]), np.float64(x[i, 2])
            acc[seg[i] - g0] += a0 * a0 + a1 * a1 + a2 * a2
        else:
          for i in range(cur[l], r):
            s = 0.0
            for e in range(x.shape[1]):
              v = np.float64(x[i, e])
              s += v * v
            acc[seg[i] - g0] += s
      for j in range(g1 - g0):
        norm = math.sqrt(acc[j])
        norms[g0 + j] = norm
        fac[j] = np.float32(min(1.0, c / norm))
      for l in range(len(leaves)):
        x, seg, out = leaves[l], ids[l], outs[l]
        if x.shape[1] == 3:
          for r in range(cur[l], ends[l]):
            f = fac[seg[r] - g0]
            out[r, 0], out[r, 1], out[r, 2] = x[r, 0] * f, x[r, 1] * f, x[r, 2] * f
        else:
          for r in range(cur[l], ends[l]):
            f = fac[seg[r] - g0]
            for e in range(x.shape[1]):
              out[r, e] = x[r, e] * f
      cur = ends

  @njit(nogil=True)
  def claimed(counter, cuts, starts, leaves, ids, c, outs, norms):
    add_one(counter, started)
    while True:
      t = add_one(counter, claim)
      if t >= cuts.size - 1:
        store_fence()
        add_one(counter, finished)
        return
      clip_systems(cuts[t], cuts[t + 1], starts[t], leaves, ids, c, outs, norms)

  return claimed


def plain_clip(leaves: list[np.ndarray], threshold: float, segments: list[np.ndarray],
               num_systems: int) -> tuple[list[np.ndarray], np.ndarray]:
  """Per-system L2 clipping of float32 leaves with sorted int64 ``segments``, plain and
  inexact (the module docstring): (outputs, float64 norms)."""
  for name, value in (("leaves", leaves), ("segments", segments)):
    if not isinstance(value, (list, tuple)) or not value:
      raise TypeError(f"{name}: expected a non-empty list of arrays, got {type(value).__name__}")
  if len(segments) != len(leaves):
    raise ValueError(f"segments: expected one id array per leaf ({len(leaves)}), "
                     f"got {len(segments)}")
  for x, seg in zip(leaves, segments):
    if (not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim < 1 or
        not isinstance(seg, np.ndarray) or seg.dtype != np.int64 or seg.shape != x.shape[:1]):
      raise TypeError("leaves, segments: expected float32 leaves with rows and an int64 id "
                      "per row")
  from clipbench.impls.own.numba import threads  # pylint: disable=import-outside-toplevel
  flat = tuple(np.ascontiguousarray(x).reshape(x.shape[0], -1) for x in leaves)
  ids = tuple(np.ascontiguousarray(s) for s in segments)
  outs = tuple(np.empty_like(x) for x in flat)
  norms = np.empty(num_systems)
  parts = max(1, min(num_systems, threads.WORKERS * CHUNKS_PER_WORKER))
  cuts = (np.arange(parts + 1, dtype=np.int64) * num_systems) // parts
  starts = np.stack([np.searchsorted(s, cuts) for s in ids], axis=1).astype(np.int64)
  kernel = _claimed_kernel()
  counter = threads.new_counter()
  threads.on_threads(
      lambda: kernel(counter, cuts, starts, flat, ids, float(threshold), outs, norms),
      min(threads.WORKERS, parts), lambda: threads.all_finished(counter))
  return [o.reshape(x.shape) for o, x in zip(outs, leaves)], norms


def compare(workload_name: str, rounds: int, scale: float = 1.0,
            calls: int = 300) -> dict[str, list[float]]:
  """Roofline ratios of each round: clipbench.numba, ``plain_clip`` and a copy of the
  leaves, timed in turn (medians of ``calls`` calls), each round against its own copy
  bandwidth."""
  workload = workloads.get(workload_name)
  if workload.op != "clip_by_global_norm" or not workload.per_system:
    raise ValueError(f"workload: expected a per-system L2 workload, got {workload_name!r}")
  inputs = workload.build(scale, "float32")
  from clipbench.impls import registry  # pylint: disable=import-outside-toplevel
  impl = registry.load("clipbench.numba")
  prepared = timing.prepare(impl, workload, inputs, "cpu")
  ours = timing.timed_runner(impl, prepared)
  leaves, segments = list(inputs.leaves), list(inputs.segments)
  candidates = {
      "clipbench.numba": lambda: ours(prepared),
      "plain clip": lambda: plain_clip(leaves, inputs.threshold, segments,
                                       inputs.num_systems),
      "copy of the leaves": lambda: [x.copy() for x in leaves],
  }
  ratios: dict[str, list[float]] = {name: [] for name in candidates}
  for _ in range(rounds):
    roofline = bandwidth.roofline_seconds(workloads.bytes_moved(inputs),
                                          bandwidth.measure_copy_bandwidth())
    for name, call in candidates.items():
      call()  # warm-up: compilation, first-touch allocations
      seconds = timing.median_call_seconds(call, min_calls=calls, max_calls=calls)
      ratios[name].append(seconds / roofline)
  return ratios


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workload", default="W5-many-tiny")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--scale", type=float, default=1.0)
  args = parser.parse_args(argv)
  if args.rounds < 1:
    parser.error(f"--rounds: expected at least 1, got {args.rounds}")
  try:
    ratios = compare(args.workload, args.rounds, args.scale)
  except ValueError as error:
    parser.error(str(error))
  print(f"{args.workload}, float32, scale {args.scale}: roofline ratio per round "
        "(1 = the roofline)")
  for name, values in ratios.items():
    rounds = " ".join(f"{v:.2f}" for v in values)
    print(f"  {name:20s} median {np.median(values):.2f}   rounds {rounds}")


if __name__ == "__main__":
  main()
