"""``python -m clipbench.benchmarks.in_step`` at a small scale: one line per implementation
with its time and page faults, and one for the step without clipping."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("jax")
# pylint: disable=wrong-import-position
from clipbench.benchmarks import in_step


def test_one_timed_line_per_implementation_and_the_bare_step(capsys) -> None:
  impls = ["clipbench.jax", "optax.clip_by_global_norm"]
  argv = ["--scale", "0.005", "--repeats", "2"]
  for name in impls:
    argv += ["--impl", name]
  assert in_step.main(argv) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  timed = re.compile(r"^(\S.*?)\s+(\d+\.\d\d) ms\s+([\d,]+) page faults a call$")
  rows = [timed.match(line) for line in lines[1:]]
  assert all(rows), lines
  assert [m.group(1) for m in rows] == impls + ["(the step without clipping)"]
  assert all(float(m.group(2)) > 0 for m in rows)


def test_bad_arguments_are_refused_naming_them(capsys) -> None:
  with pytest.raises(SystemExit):
    in_step.main(["--scale", "2"])
  assert "--scale" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    in_step.main(["--repeats", "0"])
  assert "--repeats" in capsys.readouterr().err
