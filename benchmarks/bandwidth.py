"""This machine's memory bandwidth and the three-pass roofline derived from it.

Clipping is memory bound: the best any implementation can do is read every leaf once for the
norm, then read and write it once to scale it, three passes over the data. At a copy bandwidth
``B`` (bytes read plus bytes written per second, as ``numpy.copyto`` achieves on a buffer far
larger than the caches) the roofline time is ``bytes_moved / B`` and an implementation's
roofline ratio is ``measured_seconds / roofline_seconds`` (1.0 is the bound; lower is better).

The probe is the one function both asv and ``clipbench bench`` call, in the same run as the
timings they relate it to, so every ratio can be recomputed from the saved figure.
"""

from __future__ import annotations

import time

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
