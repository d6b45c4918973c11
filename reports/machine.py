"""The machine a report was made on and the version of every library it compares.

The CPU is taken from the benchmark run's own record when there is one (pytest-benchmark
stores py-cpuinfo's description), so a report built later from reused results still names the
machine the timings came from. The memory bandwidth is the copy bandwidth the benchmark run
measured on the CPU (``extra_info.bandwidth_gbs``), the figure every CPU roofline ratio was
computed with; a card's is in the report's GPU section.
"""

from __future__ import annotations

import glob
import importlib.metadata
import math
import os
import platform
import shutil
import subprocess
from typing import Any, Iterable

import pandas as pd

# Every distribution whose version bears on a result; reported even when absent.
LIBRARIES: tuple[str, ...] = (
    "clipbench", "numpy", "ml_dtypes", "jax", "jaxlib", "optax", "torch", "triton", "numba",
    "tensorflow-cpu", "kups", "brainstate", "jax-privacy", "declearn", "pytest-benchmark", "asv")


def _cpuinfo_field(name: str) -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == name:
          return value.strip()
  except OSError:
    pass
  return ""


def _memory_total() -> str:
  try:
    with open("/proc/meminfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("MemTotal:"):
          return f"{int(line.split()[1]) / 2**20:.1f} GiB"
  except (OSError, ValueError, IndexError):
    pass
  return "unknown"


def gpu_description() -> str:
  """NVIDIA GPUs as ``nvidia-smi -L`` lists them, without importing any framework."""
  if shutil.which("nvidia-smi"):
    try:
      out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20,
                           check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
      out = ""
    if out:
      return "; ".join(line.strip() for line in out.splitlines())
  if os.path.exists("/dev/nvidiactl") or glob.glob("/dev/nvidia[0-9]*"):
    return "NVIDIA device present (nvidia-smi unavailable)"
  return "none"


def machine_description(bench_machine: dict[str, Any] | None,
                        bandwidths_gbs: Iterable[float]) -> list[tuple[str, str]]:
  """(label, value) pairs: CPU, cores, memory, measured bandwidth, GPU, OS, Python."""
  bench_machine = bench_machine or {}
  cpu = bench_machine.get("cpu") if isinstance(bench_machine.get("cpu"), dict) else {}
  model = (cpu.get("brand_raw") or _cpuinfo_field("model name") or platform.processor()
           or "unknown")
  logical = cpu.get("count") or os.cpu_count()
  usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
  cores = f"{logical} logical"
  if usable and usable != logical:
    cores += f" ({usable} usable by this process)"
  bandwidth = [b for b in bandwidths_gbs if b > 0 and math.isfinite(b)]
  if bandwidth:
    low, high = min(bandwidth), max(bandwidth)
    measured = f"{sorted(bandwidth)[len(bandwidth) // 2]:.1f} GB/s (copy, read + write)"
    if high > 1.05 * low:
      measured += f"; {low:.1f}-{high:.1f} over the run"
  else:
    measured = "not measured (no benchmark ran on the CPU)"
  system = (f"{bench_machine.get('system', '')} {bench_machine.get('release', '')}".strip()
            or platform.platform())
  python = bench_machine.get("python_version") or platform.python_version()
  return [("CPU", model), ("Cores", cores), ("Vector extensions", vector_extensions()),
          ("Memory", _memory_total()), ("Measured memory bandwidth", measured),
          ("GPU", gpu_description()), ("OS", system), ("Python", python)]


# The extensions libraries pick code paths by (torch's and numpy's kernels, MKL, XLA), widest
# first, as /proc/cpuinfo spells them.
_EXTENSIONS = (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("fma", "FMA"), ("sse4_2", "SSE4.2"),
               ("asimd", "NEON"), ("sve", "SVE"))


def vector_extensions(flags: str | None = None, mkl_cbwr: str | None = None) -> str:
  """The CPU's vector extensions and MKL's code-path setting: a case at a rule's limit can
  change verdict with them (the same libraries gave 23 other rows on an AMD EPYC than on an
  Intel Xeon; some of them MKL_CBWR=COMPATIBLE reproduces, reports/README.md)."""
  if flags is None:
    flags = _cpuinfo_field("flags") or _cpuinfo_field("Features")
  if mkl_cbwr is None:
    mkl_cbwr = os.environ.get("MKL_CBWR", "")
  present = set(flags.split())
  found = ", ".join(name for flag, name in _EXTENSIONS if flag in present) or "unknown"
  mkl = (f"MKL_CBWR={mkl_cbwr}" if mkl_cbwr else
         "MKL_CBWR unset (MKL picks its code path by the CPU)")
  return f"{found}; {mkl}"


def installed_version(distribution: str) -> str:
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return ""


def library_versions(conformance: pd.DataFrame | None) -> pd.DataFrame:
  """Installed version of each library in :data:`LIBRARIES` and any library the results
  name, beside the version recorded in the results when that differs (a reused, older run)."""
  recorded: dict[str, set[str]] = {}
  if conformance is not None and len(conformance):
    for library, version in conformance[["library", "version"]].drop_duplicates().itertuples(
        index=False):
      if library and version:
        recorded.setdefault(str(library), set()).add(str(version))
  names = list(LIBRARIES) + sorted(set(recorded) - set(LIBRARIES))
  rows = []
  for name in names:
    installed = installed_version(name)
    in_results = ", ".join(sorted(recorded.get(name, ())))
    rows.append({"library": name, "installed": installed or "not installed",
                 "in_results": in_results})
  return pd.DataFrame(rows, columns=["library", "installed", "in_results"])
