"""The adapters' shared refusals (``impls/adapters/_common.py``): an option the wrapped library
cannot express raises ``NotImplementedError`` naming the argument; what it can express passes."""

from __future__ import annotations

import math

import pytest

from clipbench.impls.adapters import _common


@pytest.mark.parametrize("norm_type", [1.0, 3.0, math.inf, -math.inf, math.nan])
def test_require_l2_refuses_every_other_p(norm_type: float) -> None:
  with pytest.raises(NotImplementedError, match=r"^norm_type: lib clips by the L2 norm only"):
    _common.require_l2(norm_type, "lib")


def test_require_l2_accepts_two() -> None:
  assert _common.require_l2(2.0, "lib") is None


def test_require_mode_refuses_a_mode_not_listed() -> None:
  with pytest.raises(NotImplementedError, match=r"^nonfinite: lib implements propagate only"):
    _common.require_mode("zero", ("propagate",), "lib")


@pytest.mark.parametrize("mode", ["propagate", "zero"])
def test_require_mode_accepts_a_listed_mode(mode: str) -> None:
  assert _common.require_mode(mode, ("propagate", "zero"), "lib") is None
