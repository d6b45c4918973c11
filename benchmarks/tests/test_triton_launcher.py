"""Our Triton launches pass through Triton's own launcher, and it compares no global at each.

``benchmarks/triton_launcher.py`` runs a call's launches through ``JITFunction.run`` with the
kernels compiled for sm_90 and a host-only driver (no GPU). Here: a W2 call and a W1 call
each make the three launches the cost counter counts, Triton's binder takes their arguments
(the constants' tuples included, as the defaults of constexpr arguments), and no kernel reads
a global that ``run`` compares with its compiled value at each launch: the decision kernel
read some 45 of them, over a microsecond each (``scratch.Words``). Times are printed by the
module, never asserted. Compiling needs a process without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_SCRIPT = """
import json
from clipbench.benchmarks import triton_launcher
triton_launcher.ROUNDS, triton_launcher.REPEATS = 5, 1
out = {w: [(l.kernel, l.checked_globals, l.run_us)
           for l in triton_launcher.launches_of(w, scale=0.01)]
       for w in ("W2-relax", "W1-model")}
print(json.dumps(out))
"""


def test_a_calls_launches_pass_through_tritons_launcher_comparing_no_global():
  env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
  done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                        text=True, timeout=600, check=False)
  assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
  launches = json.loads(done.stdout.strip().splitlines()[-1])
  for workload, rows in launches.items():
    assert [kernel for kernel, _, _ in rows] == ["measure_items", "decide_systems",
                                                 "apply_items"], workload
    assert all(checked == 0 for _, checked, _ in rows), (workload, rows)
    assert all(us > 0 for _, _, us in rows), (workload, rows)


def test_the_launcher_benchmark_refuses_the_interpreter(monkeypatch):
  from clipbench.benchmarks import triton_launcher
  monkeypatch.setenv("TRITON_INTERPRET", "1")
  with pytest.raises(ValueError, match="TRITON_INTERPRET"):
    triton_launcher.launches_of("W2-relax", scale=0.01)
