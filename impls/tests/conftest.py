"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest
from numba import njit

from clipbench.impls.own.numba.cache_guard import cache_dir_of, clear_if_stale


@njit(cache=True)
def _cached_here():
  return 0


# The kernel tests' own cached kernels inline the package's intrinsics: cleared as the
# package's are when a source changed (cache_guard).
clear_if_stale(cache_dir_of(_cached_here))


@pytest.fixture
def page_before_guard():
  """One page of float32 (writable, zeros) directly followed by a page that may not be
  touched (``PROT_NONE``): a kernel that reads or writes past the array's end faults, and the
  process dies, where it would otherwise read a neighbour's bytes unnoticed."""
  page = mmap.PAGESIZE
  region = mmap.mmap(-1, 2 * page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
  libc = ctypes.CDLL(None, use_errno=True)
  libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
  values = np.frombuffer(region, dtype=np.float32, count=page // 4)
  guard = values.ctypes.data + page
  assert libc.mprotect(guard, page, 0) == 0, ctypes.get_errno()
  try:
    yield values
  finally:
    libc.mprotect(guard, page, mmap.PROT_READ | mmap.PROT_WRITE)
    del values
