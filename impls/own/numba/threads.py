"""The thread pool the serial, GIL-free kernels run on.

Serial nogil kernels on a small pool of Python threads, rather than numba's prange: an OpenMP
barrier on a busy 2-core machine stalls far longer per parallel region than a pool hand-off
(docs/cpu-kernels.md has the measurement). Work below ``PARALLEL_MIN`` elements runs in the
calling thread. Callers read ``WORKERS`` and ``PARALLEL_MIN`` from this module at call time
(tests vary them).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

WORKERS = max(1, min(os.cpu_count() or 1, 8))
PARALLEL_MIN = 1 << 18
_POOL: list[ThreadPoolExecutor] = []


def pool() -> ThreadPoolExecutor:
  """The shared pool (created on first use) of ``WORKERS - 1`` threads; the caller is the last."""
  if not _POOL:
    _POOL.append(ThreadPoolExecutor(max_workers=WORKERS - 1, thread_name_prefix="clipbench"))
  return _POOL[0]


def parallel(kernel: Callable[..., None], weights: np.ndarray, *args: Any) -> None:
  """kernel(i0, i1, *args) over [0, len(weights)), split into ranges of equal total weight."""
  n = int(weights.size)
  if n == 0:
    return
  cum = np.cumsum(weights)
  total = int(cum[-1])
  parts = min(WORKERS, n)
  if parts == 1 or total < PARALLEL_MIN:
    kernel(0, n, *args)
    return
  cuts = np.searchsorted(cum, total * np.arange(1, parts) / parts, side="right")
  bounds = np.concatenate([[0], cuts, [n]]).astype(np.int64)
  futures = [pool().submit(kernel, int(bounds[i]), int(bounds[i + 1]), *args)
             for i in range(1, parts) if bounds[i + 1] > bounds[i]]
  if bounds[1] > 0:
    kernel(0, int(bounds[1]), *args)
  for f in futures:
    f.result()


def on_threads(work: Callable[[], None], count: int) -> None:
  """work() on ``count`` threads at once, the calling thread one of them; returns when all end."""
  futures = [pool().submit(work) for _ in range(count - 1)]
  work()
  for f in futures:
    f.result()
