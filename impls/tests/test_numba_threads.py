"""The thread pool's claim counter (``threads.new_counter``, ``threads.all_finished``).

The fused route's threads claim chunks from one counter; the calling thread, once nothing is
left to claim, spins until every thread that started is done instead of sleeping on the
others' futures. Returning early must never return before a started thread's writes.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytest.importorskip("numba")
# pylint: disable=wrong-import-position
from numba import njit

from clipbench.impls.own.numba import threads
from clipbench.impls.own.numba.intrinsics import JIT, add_one


@njit(**JIT)
def _claim_all(counter, out, delay):
  """Claims items of ``out`` from ``counter`` until none is left, writing each one's number
  after about ``delay`` iterations of work, as ``fused.fused_claimed`` claims chunks."""
  add_one(counter, threads.STARTED)
  while True:
    t = add_one(counter, threads.NEXT)
    if t >= out.size:
      add_one(counter, threads.FINISHED)
      return
    acc = 0.0
    for i in range(delay):
      acc += np.sqrt(float(i + t))
    out[t] = t + 1 + 0.0 * acc


def test_all_finished_waits_for_a_started_thread_and_no_longer():
  counter = threads.new_counter()
  counter[threads.STARTED] = 2
  counter[threads.FINISHED] = 1
  start = time.perf_counter()
  assert not threads.all_finished(counter)  # spins its bounded number of pauses, then gives up
  assert time.perf_counter() - start < 5.0
  counter[threads.FINISHED] = 2
  assert threads.all_finished(counter)


def test_a_thread_finishing_during_the_spin_ends_it():
  counter = threads.new_counter()
  counter[threads.STARTED] = 2
  counter[threads.FINISHED] = 1
  finisher = threading.Timer(0.0005, lambda: counter.__setitem__(threads.FINISHED, 2))
  finisher.start()
  try:
    # The spin gives up after about a millisecond on this machine; a slower one may give up
    # first, and then the caller waits on the futures, which is also correct.
    done = threads.all_finished(counter)
  finally:
    finisher.join()
  assert done or counter[threads.FINISHED] == 2
  assert threads.all_finished(counter)


@pytest.mark.parametrize("delay", (0, 2_000))
def test_every_claimed_item_is_written_when_on_threads_returns(monkeypatch, delay):
  monkeypatch.setattr(threads, "WORKERS", 2)
  for _ in range(50):
    counter = threads.new_counter()
    out = np.zeros(97)
    threads.on_threads(lambda: _claim_all(counter, out, delay), 2,
                       lambda: threads.all_finished(counter))
    assert out.tolist() == list(range(1, 98))
