"""One point of the asv grids (impl x workload x dtype x device), as asv's processes use it.

asv starts a process per grid point and metric (a fork of its server, which imported the
frameworks but ran nothing in them: ``preload_frameworks``) and re-runs ``setup`` around every
timed call (asv#966), so a point is loaded, its inputs built and converted and its call warmed
up once per process (``load``). Only the speed process of a point (``time_clip``) loads it:
after asv has read its time, it measures the Track figures, its peak memory first
(``record_figures``), and leaves them in the run's folder (``run_folder``); the Track processes
read them, or measure by themselves when they find none. Every reason a point cannot run
becomes asv's ``SkipNotImplemented``.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import math
import os
import sys
import traceback
from typing import Any, Callable

from clipbench.benchmarks import accuracy, bandwidth, grid, run_folder, timing, workloads
from clipbench.impls import calling, frameworks
from clipbench.impls.registry import Implementation

try:
  from asv_runner.benchmarks.mark import SkipNotImplemented
except ImportError:  # asv < 0.6: a NotImplementedError from setup is a skip too.
  SkipNotImplemented = NotImplementedError

SCALE_ENV = "CLIPBENCH_ASV_SCALE"
JAX_CACHE_ENV = "CLIPBENCH_JAX_CACHE_DIR"
ACCURACY_ELEMENTS = 4096
PARAM_NAMES = ("impl", "workload", "dtype", "device")
TIMEOUT_SECONDS = 1800.0 if grid.run_slow() else 600.0

# What setup_cache hands every benchmark of the run: {"bandwidth_bytes": float,
# "run_dir": str or None}.
Run = dict[str, Any]
Point = run_folder.Point


def start_run() -> Run:
  """The run's shared state: one copy-bandwidth probe and asv's working folder of the run."""
  return {"bandwidth_bytes": bandwidth.measure_copy_bandwidth(), "run_dir": os.getcwd()}


def asv_scale() -> float:
  """The workload scale of this run, from ``CLIPBENCH_ASV_SCALE`` (default 1.0)."""
  text = os.environ.get(SCALE_ENV, "1.0")
  try:
    scale = float(text)
  except ValueError:
    scale = math.nan
  if not (scale > 0 and math.isfinite(scale)):
    raise ValueError(f"{SCALE_ENV}: expected a positive number, got {text!r}")
  return scale


def jax_cache_dir() -> str:
  """Where JAX's persistent compilation cache lives: the env override, else the user cache."""
  override = os.environ.get(JAX_CACHE_ENV)
  if override:
    return os.path.abspath(os.path.expanduser(override))
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "clipbench", "jax")


def enable_jax_compilation_cache() -> str:
  """Turns on JAX's persistent compilation cache for every program, whatever its compile time.

  Must run before the process's first compilation: JAX opens the cache once, at that moment.
  Imports jax, so it is called only for JAX implementations.
  """
  import jax  # pylint: disable=import-outside-toplevel
  path = jax_cache_dir()
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  # -1: no minimum entry size and no backend override of it (0 would allow an override).
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return path


# What asv's forkserver imports before it forks a benchmark process (``preload_frameworks``),
# so that no process pays for it: the tracked implementations' frameworks and the compiler
# front ends our own kernels import (torch's dynamo, numba). Import only: none of them starts a
# thread or a process, or touches CUDA, when imported (benchmarks/tests/test_asv_suite.py).
PRELOADED_MODULES = ("numba", "torch", "torch._dynamo", "jax")
# asv starts its forkserver as `benchmark.py run_server DIR SOCKET` (asv.runner, ForkServer);
# its other processes that import the suite (discovery, `asv check`, setup_cache) fork nothing.
ASV_FORKSERVER_COMMAND = "run_server"


def in_asv_forkserver(argv: list[str] | None = None) -> bool:
  """Whether this process is asv's forkserver, the one whose imports every benchmark process
  inherits."""
  argv = sys.argv if argv is None else argv
  return argv[1:2] == [ASV_FORKSERVER_COMMAND]


def preload_frameworks() -> tuple[str, ...]:
  """Imports those of ``PRELOADED_MODULES`` that are installed; returns their names.

  Then moves every object imported so far out of the garbage collector's reach
  (``gc.freeze``): a forked process's collections would otherwise write to all of them and
  copy their pages from the server.
  """
  loaded = []
  for name in PRELOADED_MODULES:
    try:
      importlib.import_module(name)
    except ImportError:
      continue
    loaded.append(name)
  gc.freeze()
  return tuple(loaded)


def _run_dir(run: Run | None) -> str | None:
  return None if not run else run.get("run_dir")


# Per-process caches: asv runs one grid point per process and re-runs setup around each call.
_INPUTS: dict[tuple[str, float, str], workloads.WorkloadInputs] = {}


def _inputs(workload: workloads.Workload, scale: float, dtype: str,
            run_dir: str | None) -> workloads.WorkloadInputs:
  """The workload's inputs: from this process, else from the run's folder, else built."""
  key = (workload.name, scale, dtype)
  if key in _INPUTS:
    return _INPUTS[key]
  _INPUTS.clear()  # one workload at a time: W1 in float64 alone is 128 MiB
  path = run_dir and run_folder.inputs_path(run_dir, workload.name, dtype, scale)
  inputs = None
  if path and os.path.exists(path):
    try:
      inputs = run_folder.load_inputs(path, dtype)
    except (OSError, ValueError, KeyError) as e:
      print(f"clipbench: ignoring unreadable cached inputs {path}: {e}", file=sys.stderr)
  if inputs is None:
    inputs = workload.build(scale, dtype)
    if path:
      run_folder.save_inputs(path, inputs)
  _INPUTS[key] = inputs
  return inputs


def static_skip_reason(impl: str, workload: str, dtype: str, device: str) -> str | None:
  """A reason decidable without importing any framework, or None."""
  return (timing.early_skip_reason(device)
          or grid.static_skip_reason(impl, workload, dtype, device))


def load_or_skip(impl_name: str, workload_name: str, dtype: str,
                 device: str) -> tuple[Implementation, workloads.Workload]:
  """The loaded implementation and workload of a point (raises SkipNotImplemented)."""
  reason = static_skip_reason(impl_name, workload_name, dtype, device)
  if reason:
    raise SkipNotImplemented(reason)
  entry = grid.entry(impl_name)
  if entry is not None and entry.framework == "jax":
    enable_jax_compilation_cache()  # before the implementation's module can compile anything
  impl, workload, reason = timing.load_case(impl_name, workload_name, dtype, device)
  if reason:
    raise SkipNotImplemented(reason)
  return impl, workload


@dataclasses.dataclass
class Loaded:
  """One point, loaded and warmed up: what the timed call and the figures need."""

  impl: Implementation
  workload: workloads.Workload
  dtype: str
  device: str
  inputs: workloads.WorkloadInputs
  runner: Callable[[calling.Prepared], object]
  warm: calling.Prepared  # the warmed-up preparation (refilled before each in-place call)
  rss_after_import: int | None  # bytes, from ``reset_peak_rss``: where the peak memory starts

  @property
  def point(self) -> Point:
    return (self.impl.name, self.workload.name, self.dtype, self.device)

  def fresh(self) -> calling.Prepared:
    """Arguments for one call: the warm ones; when clipping in place, the same leaves refilled
    with the inputs' values (untimed), as a training loop's gradients are every step."""
    if self.impl.capabilities.in_place:
      timing.refill_in_place(self.warm, self.inputs)
    return self.warm


_LOADED: dict[tuple[str, str, str, str, float], Loaded] = {}


def load(impl_name: str, workload_name: str, dtype: str, device: str,
         run_dir: str | None = None) -> Loaded:
  """The point, loaded once per process (raises SkipNotImplemented)."""
  scale = asv_scale()
  key = (impl_name, workload_name, dtype, device, scale)
  case = _LOADED.get(key)
  if case is None:
    _LOADED.clear()
    impl, workload = load_or_skip(impl_name, workload_name, dtype, device)
    rss_after_import = reset_peak_rss()
    inputs = _inputs(workload, scale, dtype, run_dir)
    prepared = timing.prepare(impl, workload, inputs, device)
    runner = timing.timed_runner(impl, prepared)
    runner(prepared)  # jit compilation and first-touch allocations, untimed
    case = Loaded(impl, workload, dtype, device, inputs, runner, prepared, rss_after_import)
    _LOADED[key] = case
  return case


def load_for_speed(run: Run, *point: str) -> Loaded:
  """``load`` for a speed process; a reason to skip is left in the run's folder as well."""
  try:
    return load(*point, run_dir=_run_dir(run))
  except NotImplementedError as e:  # SkipNotImplemented subclasses it
    run_dir = _run_dir(run)
    if run_dir and run_folder.read_figures(run_dir, point, asv_scale()) is None:
      run_folder.write_figures(run_dir, point, asv_scale(), {"skip": str(e)})
    raise


def median_seconds(case: Loaded) -> float:
  """Median time of the timed call, every call on refilled inputs when clipping in place."""
  warm = case.warm
  reset = case.fresh if case.impl.capabilities.in_place else None
  return timing.median_call_seconds(lambda: case.runner(warm), reset)


def max_ulp_error(impl: Implementation, workload: workloads.Workload, dtype: str,
                  device: str) -> float:
  """Largest ulp error of the timed call against the exact reference, on a small input."""
  try:
    import clipbench.reference as reference  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise SkipNotImplemented(f"clipbench.reference not importable: {e}") from e
  op = timing.resolve_op(impl, workload)
  reference_function = getattr(reference, op or "", None)
  if reference_function is None:
    raise SkipNotImplemented(f"clipbench.reference has no {op}")
  inputs = workload.build(workloads.scale_for_elements(workload, ACCURACY_ELEMENTS), dtype)
  prepared = timing.prepare(impl, workload, inputs, device)
  out, _ = calling.result_to_numpy(timing.timed_runner(impl, prepared)(prepared))
  kwargs: dict[str, Any] = {}
  if inputs.segments is not None:
    kwargs.update(segments=list(inputs.segments), num_systems=inputs.num_systems)
  if op != "clip_by_max_step" and inputs.norm_type != 2.0:
    kwargs["norm_type"] = inputs.norm_type
  ref, _ = reference_function([x.copy() for x in inputs.leaves], inputs.threshold, **kwargs)
  return accuracy.max_ulp_error_leaves(out, [frameworks.to_numpy(r) for r in ref])


def read_figures(run: Run | None, *point: str) -> dict[str, Any] | None:
  """The figures a speed process of this run recorded for ``point``, or None."""
  return run_folder.read_figures(_run_dir(run), point, asv_scale())


def _status_bytes(field: str) -> int | None:
  """A memory field of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes; None without it."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1]) * 1024  # the kernel writes kB
  except OSError:
    pass
  return None


def reset_peak_rss() -> int | None:
  """Lowers this process's peak RSS (``VmHWM``) to its current RSS and returns that RSS in
  bytes; None where the kernel offers no such reset (``/proc/self/clear_refs``: Linux).

  The peak memory of a point starts here, after its implementation was imported: whether the
  import happened in this process or in asv's forkserver before the fork, it is left out.
  """
  try:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
      f.write("5")  # 5: reset the peak RSS (proc(5))
  except OSError:
    return None
  return _status_bytes("VmRSS")


def peak_rss_growth_bytes(rss_after_import: int | None) -> int | None:
  """How far this process's RSS rose above ``rss_after_import`` (``reset_peak_rss``) at its
  peak, in bytes, or None where it cannot be told."""
  peak = _status_bytes("VmHWM")
  if peak is None or rss_after_import is None:
    return None
  return max(0, peak - rss_after_import)


_RECORDED: set[Point] = set()  # points this process has recorded (or tried to)


def record_figures(run: Run | None, case: Loaded | None) -> None:
  """Measures the Track figures of a loaded point once per run, unless already recorded.

  The peak memory is read first: the calls that measure the other figures are not the point's.
  """
  run_dir = _run_dir(run)
  if case is None or not run_dir or case.point in _RECORDED:
    return
  _RECORDED.add(case.point)
  if read_figures(run, *case.point) is not None:
    return
  peak = peak_rss_growth_bytes(case.rss_after_import)
  try:
    figures = {"peak_rss_growth_bytes": peak, "median_seconds": median_seconds(case),
               "bytes_moved": workloads.bytes_moved(case.inputs),
               "max_ulp_error": max_ulp_error(case.impl, case.workload, case.dtype, case.device)}
  except Exception:  # pylint: disable=broad-except
    # Not this benchmark's failure: the Track processes measure by themselves and report it.
    print("clipbench: recording the track figures failed; the Track benchmarks will measure "
          "them:\n" + traceback.format_exc(), file=sys.stderr)
    return
  run_folder.write_figures(run_dir, case.point, asv_scale(), figures)


def recorded_or_skip(run: Run, *point: str) -> dict[str, Any]:
  """The recorded figures of ``point`` ({} when none); raises SkipNotImplemented for a point
  that cannot run, decided statically or recorded by its speed process."""
  reason = static_skip_reason(*point)
  if reason:
    raise SkipNotImplemented(reason)
  figures = read_figures(run, *point) or {}
  if "skip" in figures:
    raise SkipNotImplemented(figures["skip"])
  return figures


def roofline_ratio(run: Run, figures: dict[str, Any], *point: str) -> float:
  """Median call time over the roofline: from ``figures``, else measured here."""
  if "median_seconds" in figures:
    seconds, nbytes = figures["median_seconds"], figures["bytes_moved"]
  else:
    case = load(*point, run_dir=_run_dir(run))
    seconds, nbytes = median_seconds(case), workloads.bytes_moved(case.inputs)
  return bandwidth.roofline_ratio(seconds, nbytes, run["bandwidth_bytes"])


def peak_rss(run: Run, figures: dict[str, Any], *point: str) -> float:
  """Peak memory of the point's speed process above its RSS once the implementation was
  imported: from ``figures``, else of this process after loading the point and one call."""
  if "peak_rss_growth_bytes" in figures:
    peak = figures["peak_rss_growth_bytes"]
  else:
    case = load(*point, run_dir=_run_dir(run))
    case.runner(case.fresh())
    peak = peak_rss_growth_bytes(case.rss_after_import)
  if peak is None:
    raise SkipNotImplemented("no peak memory here: resetting the peak RSS needs Linux's "
                             "/proc/self/clear_refs")
  return float(peak)


def ulp_error(figures: dict[str, Any], *point: str) -> float:
  """The largest ulp error against the reference: from ``figures``, else measured here."""
  if "max_ulp_error" in figures:
    return float(figures["max_ulp_error"])
  impl, workload = load_or_skip(*point)
  return max_ulp_error(impl, workload, *point[2:])
