"""Options of the pytest-benchmark runner ``benchmarks/bench_workloads.py`` (``clipbench bench``),
and the card it times on, recorded with the machine.

Only declarations live here: asv imports every module of this folder while discovering
benchmarks, and this one must stay inert for it (nothing is imported until pytest calls a hook).
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
  group = parser.getgroup("clipbench-bench", "clipbench benchmarks (benchmarks/bench_workloads.py)")
  group.addoption("--bench-impl", action="append", default=None, metavar="NAME",
                  help="implementation to time (registered name or package.module:attr); "
                  "repeatable; default: every built-in one except the reference")
  group.addoption("--bench-workload", action="append", default=None, metavar="NAME",
                  help="workload to time (e.g. W1-model); repeatable; default: all")
  group.addoption("--bench-dtype", action="append", default=None, metavar="DTYPE",
                  help="leaf dtype (float32, bfloat16, float64); repeatable; default: float32")
  group.addoption("--bench-device", action="append", default=None, metavar="DEVICE",
                  help="device (cpu, cuda); repeatable; default: cpu")
  group.addoption("--bench-scale", type=float, default=1.0, metavar="FLOAT",
                  help="workload scale (1.0 = full size; e.g. 0.01 for a quick look)")


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
  """A run on ``cuda`` records its card (name, datasheet peak bandwidth, software) in the
  JSON's ``machine_info``; the report's GPU section reads it."""
  if "cuda" in (config.getoption("bench_device", default=None) or ()):
    from clipbench.benchmarks import gpu_check  # pylint: disable=import-outside-toplevel
    machine_info["cuda"] = gpu_check.card_facts()
