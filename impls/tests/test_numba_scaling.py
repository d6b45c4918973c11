"""The numba kernels' float32 scaling routes agree bit for bit (SPEC rule 4's RTZ value).

``apply.scale_f32`` forms ``|x| * s`` exactly in float64 and rounds it toward zero;
``apply.scale_f32_fma`` and its streamed twin ``streaming.nt_scale_f32_fma`` stay in float32
and fix the round-to-nearest product up by the sign of its FMA error. The apply pass picks the
float32 route whenever the factor is a float32, so both must give the exact RTZ product for
every float32 input: normal, subnormal, zero, either sign, and products that underflow.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")
# pylint: disable=wrong-import-position
from numba import njit

from clipbench.impls.own.numba.apply import scale_f32, scale_f32_fma
from clipbench.impls.own.numba.intrinsics import store_fence
from clipbench.impls.own.numba.streaming import LANES, nt_scale_f32_fma


@njit
def _both_routes(bits, factor, via_f64, via_fma, streamed):
  scale_f32(bits, via_f64, np.float64(factor))
  scale_f32_fma(bits, via_fma, factor)
  body = bits.size - bits.size % LANES
  nt_scale_f32_fma(bits.ctypes.data, streamed.ctypes.data, body, factor)
  scale_f32_fma(bits[body:], streamed[body:], factor)
  store_fence()


def _inputs(rng, n):
  magnitudes = np.concatenate([
      rng.standard_normal(n).astype(np.float32),
      (rng.standard_normal(n) * 1e-38).astype(np.float32),  # near and below the normal range
      rng.integers(0, 1 << 23, n).astype(np.uint32).view(np.float32),  # subnormals
      np.array([0.0, -0.0, 1.0, -1.0, np.finfo(np.float32).max, np.finfo(np.float32).tiny,
                np.float32(1e-45)], dtype=np.float32)])
  return magnitudes.view(np.uint32)


@pytest.mark.parametrize("factor", (0.5, 0.75, 1.0 - 2.0 ** -24, 0.1, 3e-5, 2.0 ** -126,
                                    1e-40, 0.0, 0.3333333432674408))
def test_float32_fma_route_equals_float64_route(factor):
  rng = np.random.default_rng(7)
  factor = np.float32(factor)
  assert np.float64(factor) == np.float64(np.float32(factor))
  bits = _inputs(rng, 5000)
  buf = np.zeros(bits.size + 16, dtype=np.uint32)
  streamed = buf[(-buf.ctypes.data % 32) // 4:][:bits.size]  # aligned, as the apply pass's
  via_f64, via_fma = np.empty_like(bits), np.empty_like(bits)
  _both_routes(bits, factor, via_f64, via_fma, streamed)
  np.testing.assert_array_equal(via_fma, via_f64)
  np.testing.assert_array_equal(streamed, via_f64)


def test_routes_round_toward_zero_exactly():
  rng = np.random.default_rng(8)
  bits = _inputs(rng, 2000)
  factor = np.float32(0.7071067690849304)
  buf = np.zeros(bits.size + 16, dtype=np.uint32)
  streamed = buf[(-buf.ctypes.data % 32) // 4:][:bits.size]
  via_f64, via_fma = np.empty_like(bits), np.empty_like(bits)
  _both_routes(bits, factor, via_f64, via_fma, streamed)
  x = bits.view(np.float32).astype(np.float64)
  exact = x * np.float64(factor)  # 24 x 24 bits: exact in float64
  out = via_fma.view(np.float32).astype(np.float64)
  assert np.all(np.abs(out) <= np.abs(exact))
  nxt = np.nextafter(np.abs(via_fma.view(np.float32)), np.float32(np.inf)).astype(np.float64)
  assert np.all(nxt > np.abs(exact))  # the largest float32 not above |x * s|
