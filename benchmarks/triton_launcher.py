"""Triton's launcher on the host, per call of ``clipbench.triton``, measured without a GPU.

  python -m clipbench.benchmarks.triton_launcher [--workload NAME ...] [--scale 1.0]
                                                 [--arch 90] [--output launcher.csv]

A small call on a card is bound by its host (``docs/gpu.md``, sections 11 and 12: W2's kernels
keep the card busy some 60 us of a 0.5 ms call). Part of that host time is Triton's own
``JITFunction.run`` at each launch: it binds and specializes every argument, looks the
compiled kernel up in its cache, and compares every global the kernel reads with the value
it was compiled with, before the driver launches it. All of that is Python, the same on any
machine, and :mod:`.costs` leaves it out (it times the call with launches skipped).

This runs it. One call of ``clipbench.triton`` on the workload's CPU tensors records its
launches (nothing runs); each is then compiled for ``sm_<arch>`` by Triton's own compiler (its
bundled ``ptxas``) and passed through ``run`` with a host-only driver in place of CUDA's, up
to the launch itself, which does not happen (``warmup=True``). Per launch: its kernel, the
globals ``run`` compares each time, and the best time of ``run`` over :data:`REPEATS` rounds.
Not included: the driver's launch (``launch_metadata`` and the C launcher, a few us on a
card's host) and anything the card does. It is a timing, so a benchmark's figure, never a
test's; the test holds the launches' count and their globals. Run it with
``TRITON_INTERPRET`` unset (under the interpreter nothing is compiled).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import timeit
from typing import Any, Iterator, Sequence

from clipbench.benchmarks import script_args, timing, workloads
from clipbench.impls.registry import Implementation

DEFAULT_WORKLOADS: tuple[str, ...] = ("W2-relax", "W2-relax-max-step", "W1-model")
ROUNDS = 500  # calls of run per timing
REPEATS = 7  # timings; the best is kept


@dataclasses.dataclass(frozen=True)
class Launch:
  """One launch of the call: its kernel, the globals Triton compares at each launch, and the
  best time of Triton's ``run`` up to the driver's launch, in microseconds."""

  kernel: str
  checked_globals: int
  run_us: float


class _HostOnlyDriver:
  """What ``JITFunction.run`` asks of the active driver before it launches: a device, its
  stream and its compilation target. Anything more is refused by name."""

  def __init__(self, arch: int) -> None:
    from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel
    self.target = GPUTarget("cuda", arch, 32)

  def get_current_device(self) -> int:
    return 0

  def get_current_stream(self, device: int | None = None) -> int:  # pylint: disable=unused-argument
    return 0

  def get_current_target(self):
    return self.target

  def __getattr__(self, name: str):
    raise AttributeError(f"the host-only driver has no {name!r}: nothing is launched here")


def _triton_route() -> Any:
  """``clipbench.triton``'s object, taking CPU tensors as a card's (its kernels are recorded,
  never run)."""
  from clipbench.impls.own.torch.api import TorchClipping  # pylint: disable=C0415
  from clipbench.impls.own.triton.passes import TritonKernels  # pylint: disable=C0415

  class HostTensors(TritonKernels):
    def _check_device(self, batch) -> None:
      pass

  return TorchClipping(HostTensors(), "clipbench.triton, launches recorded",
                       devices=("cpu",), cpu_kernels=False)


@contextlib.contextmanager
def _recorded(launches: list) -> Iterator[None]:
  """Every ``kernel[grid](...)`` inside is recorded as (kernel, args, kwargs), not run."""
  from triton.runtime import jit  # pylint: disable=import-outside-toplevel
  run = jit.JITFunction.run

  def record(self, *args, grid, warmup, **kwargs):  # pylint: disable=unused-argument
    launches.append((self, args, kwargs))

  jit.JITFunction.run = record
  try:
    yield
  finally:
    jit.JITFunction.run = run


def check_runnable(workload_name: str, scale: float) -> None:
  """Raises ValueError, saying why, where this process cannot measure the workload: under the
  interpreter (nothing is compiled), or a GPU-sized workload whose leaves at this scale are
  too big to build on this host."""
  if os.environ.get("TRITON_INTERPRET") == "1":
    raise ValueError("TRITON_INTERPRET=1 is set: unset it (under the interpreter nothing is "
                     "compiled)")
  too_big = workloads.host_skip_reason(workloads.get(workload_name), "cpu", scale)
  if too_big:
    raise ValueError(f"workload: {too_big} (its leaves are built on this host: pass --scale)")


def launches_of(workload_name: str, dtype: str = "float32", scale: float = 1.0,
                arch: int = 90) -> list[Launch]:
  """The launches of one call on the workload, each through Triton's ``run`` (module doc)."""
  check_runnable(workload_name, scale)
  from triton.runtime.driver import driver  # pylint: disable=import-outside-toplevel
  workload = workloads.get(workload_name)
  inputs = workload.build(scale, dtype)
  impl = Implementation(name="clipbench.triton", target="", kind="own", library="",
                        available=True, obj=_triton_route(), framework="torch")
  prepared = timing.prepare(impl, workload, inputs, "cpu")
  recorded: list = []
  with _recorded(recorded):
    impl.function(prepared.op)(prepared.leaves, prepared.threshold, **prepared.kwargs)
  driver.set_active(_HostOnlyDriver(arch))
  out = []
  for kernel, args, kwargs in recorded:
    def run(kernel=kernel, args=args, kwargs=kwargs):
      return kernel.run(*args, grid=(1,), warmup=True, **kwargs)
    run()  # compiles, once
    best = min(timeit.repeat(run, number=ROUNDS, repeat=REPEATS)) / ROUNDS
    out.append(Launch(kernel.fn.__name__, len(kernel.used_global_vals), best * 1e6))
  return out


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m clipbench.benchmarks.triton_launcher",
      description="Triton's launcher per call of clipbench.triton, on the host (module doc).")
  script_args.add_workloads_and_scale(parser, DEFAULT_WORKLOADS)
  parser.add_argument("--dtype", default="float32", help="leaf dtype (default float32)")
  parser.add_argument("--arch", type=int, default=90, help="compute capability (90: sm_90)")
  parser.add_argument("--output", help="also write the table as CSV to this path")
  args = parser.parse_args(argv)
  names = script_args.checked_workloads(parser, args, DEFAULT_WORKLOADS)
  try:
    workloads.numpy_dtype(args.dtype)
    for name in names:  # before any compilation
      check_runnable(name, args.scale)
  except ValueError as e:
    parser.error(str(e))
  import pandas as pd  # pylint: disable=import-outside-toplevel
  records = []
  for name in names:
    for launch in launches_of(name, args.dtype, args.scale, args.arch):
      records.append({"workload": name, "kernel": launch.kernel,
                      "checked_globals": launch.checked_globals,
                      "run_us": round(launch.run_us, 1)})
  frame = pd.DataFrame.from_records(records)
  print(frame.to_string(index=False))
  print()
  print(frame.groupby("workload", sort=False).agg(
      launches=("kernel", "size"), run_us_per_call=("run_us", "sum")).to_string())
  if args.output:
    from clipbench import files  # pylint: disable=import-outside-toplevel
    files.write_text(args.output, frame.to_csv(index=False))
  return 0


if __name__ == "__main__":
  sys.exit(main())
