"""The software prefetches of ``intrinsics`` (``prefetch_read``, ``prefetch_write``).

The fused route's grouped loop prefetches a fixed distance past each run, so it prefetches
past the end of its leaves and outputs near the end of a chunk. That is only safe because a
prefetch never faults and never changes memory: checked here on an unmapped page, on address
0 and on data whose bytes must stay as they were. The compiled code must also hold the
prefetch instructions, or the loop would be silently back to waiting on memory.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("numba")
# pylint: disable=wrong-import-position
from numba import njit

from clipbench.impls.own.numba.intrinsics import JIT, prefetch_read, prefetch_write


@njit(**JIT)
def _prefetch_both(addr):
  prefetch_read(addr)
  prefetch_write(addr)


def test_prefetches_compile_to_prefetch_instructions():
  # Compiled here, not loaded from the cache: a cached function has no assembly to inspect.
  fresh = njit(**dict(JIT, cache=False))(_prefetch_both.py_func)
  fresh(np.zeros(16, dtype=np.float32).ctypes.data)
  asm = "\n".join(fresh.inspect_asm().values())
  # x86: prefetcht0 and prefetchw (prefetcht0 for both without PRFCHW); Arm: prfm.
  assert len(re.findall(r"\b(?:prefetch\w*|prfm)\s", asm)) >= 2, asm


def test_prefetches_never_fault_and_change_nothing(page_before_guard):
  """A prefetch of an unreadable page, of address 0 and of data: no fault (which would kill
  the process), and the data's bits unchanged."""
  values = page_before_guard
  values[:] = np.arange(values.size, dtype=np.float32) * np.float32(1.5) - 7
  before = values.copy()
  base, end = values.ctypes.data, values.ctypes.data + values.nbytes
  for addr in (base, base + 64, end - 4, end, end + 1024, 0):
    _prefetch_both(addr)
  np.testing.assert_array_equal(values.view(np.uint32), before.view(np.uint32))
