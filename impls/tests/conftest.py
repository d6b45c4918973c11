"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import ctypes
import mmap
import pathlib

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
  """This folder's tests marked ``slow`` run in the thorough profile only (``--profile
  thorough``): the ci profile, what ``make test`` runs, stays within CI's time budget."""
  if config.getoption("profile", default="ci") == "thorough":
    return
  skip = pytest.mark.skip(reason="slow: runs with --profile thorough")
  here = pathlib.Path(__file__).parent
  for item in items:
    if item.get_closest_marker("slow") is not None and here in item.path.parents:
      item.add_marker(skip)
