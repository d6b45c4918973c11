"""pytest-benchmark runner behind ``clipbench bench``: workloads x implementations, side by side.

Not collected by the test suite (the name does not match ``test_*.py``); run it explicitly::

  pytest benchmarks/bench_workloads.py --bench-scale 0.01 --benchmark-json=bench.json \
      [--bench-impl NAME ...] [--bench-workload NAME ...] [--bench-dtype float32 ...]

Every workload is one pytest-benchmark group, so the table compares implementations on it.
``extra_info`` holds what the roofline needs: bytes moved (three passes), the copy bandwidth of
the device measured once in this session (the host's memory, or the card's for ``cuda``), and
the roofline time; ``roofline.summarize`` turns the JSON
into one row per (workload, implementation). The exact reference is never timed.
"""

from __future__ import annotations

import functools
from typing import Callable

import pytest

from clipbench.benchmarks import bandwidth, grid, timing, workloads
from clipbench.impls import registry


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
  if "case" not in metafunc.fixturenames:
    return
  config = metafunc.config
  impls = config.getoption("bench_impl", default=None) or grid.timed_impl_names()
  names = config.getoption("bench_workload", default=None) or workloads.NAMES
  dtypes = config.getoption("bench_dtype", default=None) or ["float32"]
  devices = config.getoption("bench_device", default=None) or ["cpu"]
  registered = registry.names()
  unknown = [i for i in impls if i not in registered and ":" not in i]
  if unknown:
    raise pytest.UsageError(f"--bench-impl: unknown {unknown}; registered: "
                            f"{', '.join(registered)}; an outside one is package.module:attr")
  for name in names:
    workloads.get(name)  # an unknown name fails collection with the list of known ones
  for dtype in dtypes:
    workloads.numpy_dtype(dtype)
  # Implementations innermost: one workload's inputs are built once and reused by all of them.
  combos = [(w, d, dev, i) for w in names for d in dtypes for dev in devices for i in impls]
  metafunc.parametrize("case", combos, ids=["-".join(c) for c in combos])


@pytest.fixture(scope="session")
def copy_bandwidth() -> Callable[[str], float]:
  """The copy bandwidth (bytes/s) of a device, measured once per session, with the timings:
  ``cpu`` the host's memory (numpy), ``cuda`` the card's (device to device)."""
  measured: dict[str, float] = {}

  def of(device: str) -> float:
    if device not in measured:
      if device == "cuda":
        from clipbench.benchmarks import gpu_check  # pylint: disable=import-outside-toplevel
        measured[device] = gpu_check.measure_cuda_copy_bandwidth()
      else:
        measured[device] = bandwidth.measure_copy_bandwidth()
    return measured[device]

  return of


@pytest.fixture(scope="session")
def bench_scale(pytestconfig: pytest.Config) -> float:
  return float(pytestconfig.getoption("bench_scale", default=1.0))


@functools.cache
def _load(name: str) -> registry.Implementation:
  return registry.load(name)


@functools.lru_cache(maxsize=1)
def _inputs(name: str, scale: float, dtype: str) -> workloads.WorkloadInputs:
  return workloads.get(name).build(scale, dtype)


def _pedantic_rounds(seconds_per_call: float) -> int:
  return max(5, min(100, int(1.0 / max(seconds_per_call, 1e-6))))


def test_clip(benchmark, case: tuple[str, str, str, str], bench_scale: float,
              request: pytest.FixtureRequest) -> None:
  workload_name, dtype, device, impl_name = case
  reason = timing.early_skip_reason(device)
  if reason:
    pytest.skip(reason)
  impl = _load(impl_name)
  workload = workloads.get(workload_name)
  reason = timing.skip_reason(impl, workload, dtype, device)
  if reason:
    pytest.skip(reason)
  # The grid asv uses: families an implementation is timed on, and the cases too slow to set up.
  reason = grid.static_skip_reason(impl_name, workload_name, dtype, device)
  if reason:
    pytest.skip(reason)
  reason = workloads.host_skip_reason(workload, device, bench_scale)
  if reason:
    pytest.skip(reason)
  inputs = _inputs(workload_name, bench_scale, dtype)
  prepared = timing.prepare(impl, workload, inputs, device)
  run = timing.timed_runner(impl, prepared)
  run(prepared)  # warm-up: jit compilation and first-touch allocations, untimed
  bw = request.getfixturevalue("copy_bandwidth")(device)
  nbytes = workloads.bytes_moved(inputs)
  benchmark.group = workload_name
  benchmark.extra_info.update(
      impl=impl.name, kind=impl.kind, version=impl.version, workload=workload_name,
      op=timing.resolve_op(impl, workload), dtype=dtype, device=device, scale=bench_scale,
      bytes_moved=nbytes, bandwidth_gbs=bw / 1e9,
      roofline_seconds=bandwidth.roofline_seconds(nbytes, bw))
  if impl.capabilities.in_place:
    # Each round clips the same leaves, refilled with the inputs' values (untimed), never
    # already-clipped data; the warm-up built whatever the implementation keeps per leaf.
    def refill():
      timing.refill_in_place(prepared, inputs)
      return (prepared,), {}

    one_call = timing.median_call_seconds(lambda: run(prepared), refill, min_calls=1,
                                          max_calls=1)
    benchmark.pedantic(run, setup=refill, rounds=_pedantic_rounds(one_call), iterations=1)
  else:
    benchmark(run, prepared)
