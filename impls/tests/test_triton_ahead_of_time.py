"""The Triton kernels compile for a GPU (sm_90) here, without one, as a card would compile them.

The interpreter (how CI runs the kernels) accepts programs the compiler rejects and shows none
of its choices; ``ahead_of_time`` compiles a representative set of launches with Triton's own
compiler and checks the decision kernel's PTX (no fused multiply-add, exact float64
constants). It runs in a process without ``TRITON_INTERPRET``: under the interpreter there is
nothing to compile.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_kernels_compile_for_sm90_without_a_gpu():
  env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
  done = subprocess.run([sys.executable, "-m", "clipbench.impls.own.triton.ahead_of_time"],
                        env=env, capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
  assert "no fused multiply-add and its float64 constants" in done.stdout
