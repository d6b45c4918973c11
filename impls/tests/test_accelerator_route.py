"""What a GPU runs of our eager torch implementation conforms, checked on CPU tensors.

``clipbench.torch`` sends CPU tensors to the numba kernels, so the conformance suite over the
registry never reaches its CUDA route; ``accelerator_route.eager`` runs that route on CPU
tensors, cut as on a GPU. The whole suite runs on it in a process of its own, against the
exact reference, with no deviation listed for it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def test_cuda_route_conforms_on_cpu_tensors(tmp_path):
  results = tmp_path / "conformance.csv"
  command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--pyargs",
             "clipbench.conformance", "--impl", "clipbench.impls.tests.accelerator_route:eager",
             "--results", str(results)]
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
  done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=900, check=False)
  tail = (done.stdout + done.stderr)[-4000:]
  assert done.returncode == 0, tail
  assert " pass" in tail and "fail" not in tail.split("clipbench conformance")[-1], tail
