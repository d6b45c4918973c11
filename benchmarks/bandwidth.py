"""This machine's memory bandwidth and the three-pass roofline derived from it.

Clipping is memory bound: the best any implementation can do is read every leaf once for the
norm, then read and write it once to scale it, three passes over the data. At a copy bandwidth
``B`` (bytes read plus bytes written per second, as ``numpy.copyto`` achieves on a buffer far
larger than the caches) the roofline time is ``bytes_moved / B`` and an implementation's
roofline ratio is ``measured_seconds / roofline_seconds`` (1.0 is the bound; lower is better).

The probe is the one function both asv and ``clipbench bench`` call, in the same run as the
timings they relate it to, so every ratio can be recomputed from the saved figure.

The roofline charges the norm's read pass at the copy bandwidth too, and leaves out the
segment ids a per-system call must read to validate them. ``memory_floor_ratio`` adds both
facts: read passes (the ids once, the leaves as often as they must come from memory before
the scaling pass) at the read bandwidth all cores reach (``measure_read_bandwidth``), the
scale pass at the copy bandwidth. A global call reads its leaves once before scaling (its one
system is far larger than the caches); a per-system call whose systems each fit in cache
needs no such pass (each system is scaled while its rows are still cached), so its floor
can sit below the roofline. ``python -m clipbench.benchmarks.bandwidth`` prints every
workload's floor.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

DEFAULT_NBYTES = 256 * 2**20  # well beyond the last-level cache of any current CPU
DEFAULT_REPEATS = 7


def measure_copy_bandwidth(nbytes: int = DEFAULT_NBYTES, repeats: int = DEFAULT_REPEATS) -> float:
  """Best copy bandwidth over ``repeats`` copies of an ``nbytes`` buffer, in bytes per second.

  A copy moves ``2 * nbytes`` (one read, one write). Both buffers are written before timing,
  so page faults of first touch are not measured.

  Args:
    nbytes: buffer size in bytes (rounded down to whole float64 elements, at least one).
    repeats: number of timed copies; the fastest counts (noise only slows a copy down).

  Returns:
    Bytes read plus written per second.
  """
  if repeats < 1:
    raise ValueError(f"repeats: expected >= 1, got {repeats}")
  n = max(1, int(nbytes) // 8)
  src = np.ones(n, dtype=np.float64)
  dst = np.zeros_like(src)
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    np.copyto(dst, src)
    best = min(best, time.perf_counter() - start)
  # A timer tick below the clock resolution would give an infinite bandwidth.
  best = max(best, 1e-9)
  return 2.0 * src.nbytes / best


def roofline_seconds(bytes_moved: float, bandwidth: float) -> float:
  """Time to move ``bytes_moved`` bytes at ``bandwidth`` bytes per second."""
  if not bandwidth > 0:
    raise ValueError(f"bandwidth: expected a positive number, got {bandwidth!r}")
  return float(bytes_moved) / float(bandwidth)


def roofline_ratio(seconds: float, bytes_moved: float, bandwidth: float) -> float:
  """Measured time over the roofline time (1.0 is the bound; lower is better)."""
  return float(seconds) / roofline_seconds(bytes_moved, bandwidth)


def measure_read_bandwidth(nbytes: int = DEFAULT_NBYTES, repeats: int = DEFAULT_REPEATS,
                           threads: int | None = None) -> float:
  """Best read bandwidth over ``repeats`` passes, ``threads`` threads (default: one per core)
  each summing its own part of an ``nbytes`` float64 buffer, in bytes read per second.

  numpy's reductions release the GIL and are pairwise sums of float64, cheap enough per byte
  that the pass is bound by memory, not by arithmetic.
  """
  if repeats < 1:
    raise ValueError(f"repeats: expected >= 1, got {repeats}")
  if threads is None:
    threads = os.cpu_count() or 1
  if threads < 1:
    raise ValueError(f"threads: expected >= 1, got {threads}")
  buf = np.ones(max(threads, int(nbytes) // 8), dtype=np.float64)
  parts = np.array_split(buf, threads)
  best = float("inf")
  with ThreadPoolExecutor(max_workers=threads) as pool:
    for _ in range(repeats):
      start = time.perf_counter()
      list(pool.map(np.add.reduce, parts))
      best = min(best, time.perf_counter() - start)
  return buf.nbytes / max(best, 1e-9)


def memory_floor_ratio(leaf_bytes: float, id_bytes: float, copy_bandwidth: float,
                       read_bandwidth: float, *, leaf_reads: int) -> float:
  """Least time of a call over the roofline time (see the module docstring):
  ``((leaf_reads leaf_bytes + id_bytes) / read + 2 leaf_bytes / copy) / (3 leaf_bytes / copy)``,
  ``leaf_reads`` the passes that read the leaves from memory before the scaling pass (1 for a
  global call, 0 for a per-system call whose systems fit in cache)."""
  for name, value in (("copy_bandwidth", copy_bandwidth), ("read_bandwidth", read_bandwidth),
                      ("leaf_bytes", leaf_bytes)):
    if not value > 0:
      raise ValueError(f"{name}: expected a positive number, got {value!r}")
  if not id_bytes >= 0:
    raise ValueError(f"id_bytes: expected a number >= 0, got {id_bytes!r}")
  if leaf_reads not in (0, 1):
    raise ValueError(f"leaf_reads: expected 0 or 1, got {leaf_reads!r}")
  floor = (leaf_reads * leaf_bytes + id_bytes) / read_bandwidth + (
      2.0 * leaf_bytes / copy_bandwidth)
  return floor / roofline_seconds(3.0 * leaf_bytes, copy_bandwidth)


def main() -> None:
  """Prints both bandwidths and every workload's memory floor (scale 1, float32)."""
  from clipbench.benchmarks import workloads  # pylint: disable=import-outside-toplevel
  copy = measure_copy_bandwidth()
  read = measure_read_bandwidth()
  print(f"copy bandwidth {copy / 1e9:.1f} GB/s (numpy.copyto, one thread); read bandwidth "
        f"{read / 1e9:.1f} GB/s ({os.cpu_count()} threads)")
  print("memory floor, in roofline units (the roofline is 1):")
  for workload in workloads.WORKLOADS:
    if workloads.host_skip_reason(workload, "cpu", 1.0):
      print(f"  {workload.name:26s} -     (sized for a GPU)")
      continue
    inputs = workload.build(1.0, "float32")
    ids = sum(int(s.nbytes) for s in inputs.segments or ())
    reads = 0 if workload.per_system else 1
    floor = memory_floor_ratio(inputs.nbytes, ids, copy, read, leaf_reads=reads)
    what = "ids + one pass (systems fit in cache)" if reads == 0 else "two passes"
    print(f"  {workload.name:26s} {floor:.2f}  ({what})")


if __name__ == "__main__":
  main()
