"""The thread pool the serial, GIL-free kernels run on.

Serial nogil kernels on a small pool of Python threads, rather than numba's prange: an OpenMP
barrier on a busy 2-core machine stalls far longer per parallel region than a pool hand-off
(docs/cpu-kernels.md has the measurement). Kernels that claim work in turn from a counter
(``new_counter``) let the calling thread spin for the last thread to finish
(``all_finished``) instead of sleeping on its future. Work below ``PARALLEL_MIN`` elements
runs in the calling thread. Callers read ``WORKERS`` and ``PARALLEL_MIN`` from this module at
call time (tests vary them).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
from numba import njit

from clipbench.impls.own.numba.intrinsics import JIT, add_one, load_acquire, spin_pause

WORKERS = max(1, min(os.cpu_count() or 1, 8))
PARALLEL_MIN = 1 << 18
_POOL: list[ThreadPoolExecutor] = []
# The slots of a claim counter (``new_counter``): the next item of work to claim, how many
# threads started claiming, how many of them are done.
NEXT, STARTED, FINISHED = 0, 1, 2
# The most pauses ``all_finished`` spins for (about a millisecond) before the caller sleeps on
# the futures instead.
SPINS = 1 << 14


_AT_MOST: contextvars.ContextVar[int | None] = contextvars.ContextVar("clipbench_workers",
                                                                    default=None)


@contextlib.contextmanager
def at_most(workers: int):
  """``parallel`` in this context splits work over at most ``workers`` threads (a process
  that shares the machine's cores with others, such as one rank of several)."""
  token = _AT_MOST.set(max(1, int(workers)))
  try:
    yield
  finally:
    _AT_MOST.reset(token)


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
  limit = _AT_MOST.get()
  parts = min(WORKERS if limit is None else min(WORKERS, limit), n)
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


def on_threads(work: Callable[[], None], count: int,
               finished: Callable[[], bool] | None = None) -> None:
  """work() on ``count`` threads at once, the calling thread one of them; returns when all end,
  or as soon as ``finished()``, called after the calling thread's work(), returns True (then
  the other threads' work is done, though they may not have returned from it yet)."""
  futures = [pool().submit(work) for _ in range(count - 1)]
  work()
  if finished is not None and finished():
    return
  for f in futures:
    f.result()


def new_counter() -> np.ndarray:
  """A claim counter: int64 slots NEXT, STARTED and FINISHED, all 0."""
  return np.zeros(3, dtype=np.int64)


@njit(**JIT)
def all_finished(counter):
  """Whether every thread that started claiming from ``counter`` has finished (each counts
  itself in STARTED before its first claim and in FINISHED after its last write), spinning
  up to SPINS pauses for it. The calling thread, done with its own work once every item is
  claimed, then sees the last thread end within a pause, where a wait on its future costs a
  wake-up of tens of microseconds (docs/cpu-kernels.md). A thread that starts later finds
  nothing left to claim."""
  for _ in range(SPINS):
    # FINISHED first: equal counts then mean that every thread that had started was done.
    done = load_acquire(counter, FINISHED)
    if done == load_acquire(counter, STARTED):
      return True
    spin_pause()
  return False
