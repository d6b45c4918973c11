"""The catalogue's reproducers run on their own and end in an assertion against the reference.

Each is run as a fresh Python process in an empty folder, as someone pasting it from an issue
would run it: it must fail with AssertionError while the implementation departs from SPEC.md
and pass for the reference itself.
"""

from __future__ import annotations

import ast
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from clipbench.conformance import reproducer
from clipbench.conformance.cases import Inputs

BROKEN = "clipbench.conformance.broken"
TIE = Inputs(leaves=[np.array([3.0, 4.0], np.float32)], threshold=5.0)  # norm == max


def run(text: str, folder) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", text], capture_output=True, text=True,
                        cwd=folder, timeout=600, check=False)


def test_ends_in_an_assertion():
  text = reproducer.snippet(f"{BROKEN}:eps_in_norm", "scales by max/(norm+1e-6)",
                            "clip_grad_norm", TIE, rule=3)
  last = ast.parse(text).body[-1]
  assert isinstance(last, ast.Assert)
  assert "np.load" not in text and ".npz" not in text


def test_fails_against_the_reference_on_a_divergent_case(tmp_path):
  text = reproducer.snippet(f"{BROKEN}:eps_in_norm", "", "clip_grad_norm", TIE, rule=3)
  done = run(text, tmp_path)
  assert done.returncode == 1, done.stderr
  assert "AssertionError: rule 3:" in done.stderr and "leaves[0] changed" in done.stderr


def test_passes_for_the_reference_itself(tmp_path):
  done = run(reproducer.snippet("reference", "", "clip_grad_norm", TIE, rule=3), tmp_path)
  assert done.returncode == 0, done.stderr


def test_invalid_input_must_be_rejected_like_the_reference(tmp_path):
  negative = Inputs(leaves=[np.array([3.0, 4.0], np.float32)], threshold=-1.0)
  done = run(reproducer.snippet(f"{BROKEN}:accepts_negative_max", "", "clip_grad_norm",
                                negative, rule=6), tmp_path)
  assert done.returncode == 1 and "the reference raises ValueError" in done.stderr
  done = run(reproducer.snippet("reference", "", "clip_grad_norm", negative, rule=6), tmp_path)
  assert done.returncode == 0, done.stderr


def test_large_input_is_inline_and_exact(tmp_path):
  rng = np.random.default_rng(1)
  leaves = [rng.standard_normal((70, 3)).astype(ml_dtypes.bfloat16),
            rng.standard_normal(90).astype(np.float32)]
  segments = [rng.integers(0, 4, 70), rng.integers(0, 4, 90)]
  inputs = Inputs(leaves=leaves, threshold=0.5, segments=segments, num_systems=4)
  text = reproducer.snippet("reference", "", "clip_by_global_norm", inputs, rule=1)
  namespace: dict = {}
  exec(text.split("\ntry:")[0], namespace)  # pylint: disable=exec-used  # the input part
  for got, want in zip(namespace["leaves"] + namespace["segments"], leaves + segments):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()
  done = run(text, tmp_path)
  assert done.returncode == 0, done.stderr


def test_a_library_call_that_raises_still_reaches_the_assertion(tmp_path):
  text = reproducer.snippet(f"{BROKEN}:eps_in_norm", "", "clip_grad_norm", TIE,
                            library_call="raise RuntimeError('the library refused')", rule=3)
  done = run(text, tmp_path)
  assert "RuntimeError the library refused" in done.stdout
  assert done.returncode == 1 and "AssertionError: rule 3:" in done.stderr


def test_departure_from_reference_checks_its_arguments():
  from clipbench.impls import registry
  with pytest.raises(TypeError, match="impl: expected an Implementation"):
    reproducer.departure_from_reference("reference", "clip_grad_norm", TIE.leaves, 5.0)
  with pytest.raises(ValueError, match="op: expected one of"):
    reproducer.departure_from_reference(registry.load("reference"), "clip", TIE.leaves, 5.0)
