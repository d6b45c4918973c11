"""Short float32 blocks' sums of squares (``short_sums``): the documented tree, bit for bit.

Every route sums a block of fewer than ``SHORT`` float32 through ``short_squares_f32`` (the
block function of ``power_sums`` calls it, the fused route calls it directly), so its order
is part of every norm's bits: it must be the tree the module documents, computed here in
NumPy, at every length and offset, and it must read nothing past the block.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")
# pylint: disable=wrong-import-position
from numba import njit

from clipbench.impls.own.numba.intrinsics import JIT
from clipbench.impls.own.numba.power_sums import SQUARES_F32
from clipbench.impls.own.numba.max_step import step_block_f32
from clipbench.impls.own.numba.short_sums import (SHORT, half_squares_f32, half_step_f32,
                                                  short_squares_f32, short_step_f32)


@njit(**JIT)
def _short_sum(addr, n):
  return short_squares_f32(addr, n)


@njit(**JIT)
def _half_sum(addr, n):
  return half_squares_f32(addr, n)


@njit(**JIT)
def _half_step(addr, n):
  return half_step_f32(addr, n)


def _tree(x: np.ndarray) -> float:
  """The module's order in NumPy: squares in float64, padded with +0.0 to SHORT lanes, lane
  j + half added into lane j until one is left."""
  lanes = np.zeros(SHORT)
  lanes[:x.size] = np.abs(x.astype(np.float64)) ** 2
  while lanes.size > 1:
    half = lanes.size // 2
    lanes = lanes[:half] + lanes[half:]
  return float(lanes[0])


def _values(seed: int, n: int) -> np.ndarray:
  """Magnitudes over 20 binades, so that most blocks' sums round (squares of float32 are
  exact in float64, and sums of squares of nearby magnitudes too), and so depend on the
  order; then zeros, a subnormal and the largest float32."""
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal(n) * 2.0 ** rng.uniform(-10, 10, n)).astype(np.float32)
  x[::7] = 0.0
  x[::11] = -0.0
  x[::13] = np.float32(1e-45)
  x[::61] = np.float32(3.4e38)
  return x


def _bits(v: float) -> int:
  return int(np.float64(v).view(np.uint64))


@pytest.mark.parametrize("seed", range(4))
def test_short_sums_are_the_documented_tree(seed):
  x = _values(seed, 4 * SHORT)
  order_matters = 0
  for offset in range(4):
    for n in range(SHORT):
      block = x[offset:offset + n]
      got = _short_sum(x.ctypes.data + 4 * offset, n)
      assert _bits(got) == _bits(_tree(block)), (offset, n)
      in_turn = float(np.cumsum(np.abs(block.astype(np.float64)) ** 2)[-1]) if n else 0.0
      order_matters += _bits(in_turn) != _bits(got)
  # The data must tell orders apart, or this test would pass for any order.
  assert order_matters > SHORT // 2


def test_short_sums_of_non_finite_blocks_are_not_finite():
  for bad in (np.inf, -np.inf, np.nan):
    for n in range(1, SHORT):
      x = np.ones(n, dtype=np.float32)
      x[n // 2] = bad
      got = _short_sum(x.ctypes.data, n)
      assert (np.isnan(got) if np.isnan(bad) else got == np.inf), (bad, n)


@pytest.mark.parametrize("seed", range(2))
def test_the_block_function_sums_short_blocks_with_the_tree(seed):
  x = _values(100 + seed, 3 * SHORT).view(np.uint32)
  for offset in (0, 1, 3):
    for n in range(SHORT):
      block = x[offset:offset + n]
      want = _short_sum(x.ctypes.data + 4 * offset, n)
      assert _bits(SQUARES_F32(block, np.int64(2), 2.0)) == _bits(want), (offset, n)


def test_short_sums_read_nothing_past_the_block(page_before_guard):
  """Blocks that end where an unreadable page begins: a read past the block would fault."""
  values = page_before_guard
  values[:] = np.arange(values.size, dtype=np.float32) % 5
  end = values.ctypes.data + values.nbytes
  for n in range(SHORT):
    got = _short_sum(end - 4 * n, n)
    assert _bits(got) == _bits(_tree(values[values.size - n:])), n


@njit(**JIT)
def _short_step(addr, n):
  return short_step_f32(addr, n)


@pytest.mark.parametrize("seed", range(3))
def test_short_steps_are_step_block_f32(seed):
  x = _values(200 + seed, 4 * SHORT)
  x[5 * seed + 3] = (np.inf, np.nan, -np.inf)[seed]
  bits = x.view(np.uint32)
  for offset in range(0, 12):
    for n in range(0, SHORT, 3):
      want = step_block_f32(bits[offset:offset + n], 3)
      got = _short_step(x.ctypes.data + 4 * offset, n)
      assert _bits(got) == _bits(want), (offset, n)


@pytest.mark.parametrize("seed", range(3))
def test_half_width_sums_and_steps_give_the_full_trees_bits(seed):
  """Runs of at most SHORT // 2 elements in half the lanes (the fused route's groups whose
  runs are all that short): the same bits as the full tree and the full step, non-finite
  elements included."""
  x = _values(300 + seed, 4 * SHORT)
  x[7 * seed + 2] = (np.inf, np.nan, -np.inf)[seed]
  for offset in range(8):
    addr = x.ctypes.data + 4 * offset
    for n in range(SHORT // 2 + 1):
      want, got = _short_sum(addr, n), _half_sum(addr, n)
      assert _bits(got) == _bits(want) or (np.isnan(got) and np.isnan(want)), (offset, n)
    for n in range(0, SHORT // 2, 3):
      assert _bits(_half_step(addr, n)) == _bits(_short_step(addr, n)), (offset, n)


def test_half_width_sums_and_steps_read_nothing_past_the_run(page_before_guard):
  values = page_before_guard
  values[:] = np.arange(values.size, dtype=np.float32) % 7
  end = values.ctypes.data + values.nbytes
  for n in range(SHORT // 2 + 1):
    assert _bits(_half_sum(end - 4 * n, n)) == _bits(_tree(values[values.size - n:])), n
  for n in range(0, SHORT // 2, 3):
    want = step_block_f32(values[values.size - n:].view(np.uint32), 3)
    assert _bits(_half_step(end - 4 * n, n)) == _bits(want), n
