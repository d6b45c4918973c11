"""asv benchmarks: dense grids, one class family per operation family and device.

Grids (``grid.py``): each operation family is run only by the implementations providing it,
on the devices they can run on, so almost every grid point is a case some machine can run:

================  ===================================  ============================
family (classes)  workloads                            implementations (cpu / cuda)
================  ===================================  ============================
global            W1-model, W4-many-small              15 / 6
pnorm             W1-model-p1, -p3, -pinf              8 / 6
per_system        W2-relax, W3-relax-large             6 / 3
max_step          W2-relax-max-step, W3-...-max-step   6 / 3
================  ===================================  ============================

Parameters: ``impl`` x ``workload`` x ``dtype`` x ``device``, the device fixed per class
(``GlobalCpu`` has ``device="cpu"`` only, ``GlobalCuda`` ``"cuda"`` only, so CPU-only
implementations make no CUDA points and the reverse). With the default dtype (float32) that is
78 CPU and 42 CUDA points per metric; with all three dtypes 234 and 126.

Metrics, for every point:

* ``<Family><Device>.time_clip`` / ``.peakmem_clip``: one call through ``cases.timed_runner``
  (JAX libraries under ``jax.jit`` as their users call them), device work synchronized inside
  the call. Inputs are built and converted in ``setup`` and the call is warmed up there (jit
  compilation untimed). Implementations that clip in place get freshly converted inputs before
  every timed call. ``peakmem`` is the process's peak RSS: it includes the framework.
* ``<Family><Device>Track.track_roofline_ratio``: median call time (same runner) over the
  three-pass roofline at the copy bandwidth measured once per run (``setup_cache``; lower is
  better).
* ``<Family><Device>Track.track_max_ulp_error``: largest output error in ulps of the same
  runner against the exact reference, on a small fixed input (about 4,096 elements of the
  workload).
* ``Machine.track_bandwidth_gbs``: the copy bandwidth every ratio used.

Skipping: a point that cannot run raises ``SkipNotImplemented`` in ``setup`` and asv records it
as skipped (n/a), with the reason in its output. Reasons known without importing anything
(``cases.early_skip_reason``: no CUDA device; ``grid.static_skip_reason``: JAX float64 without
``JAX_ENABLE_X64=1``, slow cases) cost only the process start (~0.3 s); the others (library
missing, dtype not declared, framework without a GPU) are found by loading the implementation
(``cases.load_case``).

Time budget and caches. asv runs the benchmarks one after the other with ``launch_method:
spawn``: a fresh process per method and grid point, each importing its framework (0.8 s for
JAX, 1.2 s for torch, 3 s for our torch kernels, which import torch._dynamo, 4.5 s for
TensorFlow, plus about 1 s of interpreter teardown for torch), so the cost of the suite is the
number of processes that load a framework. On a 2-core CPU machine ``asv run --quick`` must
stay under 15 minutes, hence:

* Only the ``time_`` and ``peakmem_`` processes load the case. The first of them to finish (asv
  runs benchmarks in name order: ``X.peakmem_clip``, ``X.time_clip``, then ``XTrack``) measures
  the median call time and the ulp error in its ``teardown``, after asv has read the peak
  memory, and writes them to the run's folder; the Track processes read them (~0.3 s each). A
  Track process that finds nothing (``asv run --bench Track``) measures by itself, the same way.
  A reason to skip found by loading is recorded there too.
* The run's folder is asv's ``setup_cache`` directory: every process of the run works in it and
  asv deletes it at the end. It also holds the built inputs of each workload and dtype, so W1
  and W3 (0.3-1.3 s to draw) are built once per run, not once per process.
* JAX's persistent compilation cache (``~/.cache/clipbench/jax``, or ``CLIPBENCH_JAX_CACHE_DIR``)
  is turned on before a JAX implementation is loaded, for every program whatever its size or
  compile time, so a jitted program is compiled once and then read from disk by the other
  processes of the case and by later runs. Inductor (torch.compile) keeps its own disk cache.
* Dimensions reduced by default, and why: the ``dtype`` grid is float32 only. Each case costs
  two framework-loading processes (5-15 s together); the 234 CPU points of all three dtypes
  would take about 30 minutes on this machine. ``CLIPBENCH_ASV_DTYPES=all`` (or a comma list)
  runs them, for a nightly or a bigger machine. The cases the table marks slow (a first call of
  more than ~10 s in every process: our JAX kernel on W1 and W4, kups and brainstate on W4) are
  skipped with the measured reason unless ``CLIPBENCH_ASV_SLOW=1``; they stay grid points, so
  the dashboard shows the gap.

``CLIPBENCH_ASV_SCALE`` (default 1.0) shrinks every workload for smoke runs, for example
``CLIPBENCH_ASV_SCALE=0.001 asv run --python=same --quick``.

asv quirk (asv_runner >= 0.3): with a ``setup`` present, asv re-runs ``setup`` (and
``teardown``) around every timed call (asv#966). Built inputs, framework conversions and the
warm-up are therefore cached per process; in-place implementations get fresh conversions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import traceback
from typing import Any, Callable

import numpy as np

from clipbench.benchmarks import accuracy, bandwidth, cases, grid, workloads
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

# What setup_cache hands every benchmark of the run: {"bandwidth_bytes": float,
# "run_dir": str or None}.
Run = dict[str, Any]


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


# ------------------------------------------------------------------------------- JAX cache


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


# ------------------------------------------------------------------------------ run folder


def _run_dir(run: Run | None) -> str | None:
  return None if not run else run.get("run_dir")


def _atomic_write(path: str, write: Callable[[Any], None]) -> None:
  """Writes ``path`` through a temporary file and a rename: readers see all of it or nothing.

  (Not ``clipbench.files``: it imports pandas, a cost in every spawned process, and fsyncs,
  which a scratch folder deleted at the end of the run does not need.)
  """
  folder = os.path.dirname(path)
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
  try:
    with os.fdopen(fd, "wb") as f:
      write(f)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)
    raise


def _case_file(run_dir: str, kind: str, *parts: Any, suffix: str) -> str:
  name = "--".join(str(p) for p in parts).replace(os.sep, "_")
  return os.path.join(run_dir, "clipbench", kind, name + suffix)


def save_inputs(path: str, inputs: workloads.Inputs) -> None:
  """Stores ``inputs`` bit for bit (bfloat16 too) as one .npz of a few flat arrays."""
  leaves = [np.ascontiguousarray(x) for x in inputs.leaves]
  itemsize = leaves[0].dtype.itemsize if leaves else 1
  arrays = {
      "bits": np.concatenate([x.reshape(-1).view(f"u{itemsize}") for x in leaves])
              if leaves else np.zeros(0, np.uint8),
      "ndim": np.array([x.ndim for x in leaves], np.int64),
      "shape": np.array([n for x in leaves for n in x.shape], np.int64),
      "scalars": np.array([inputs.threshold, inputs.norm_type], np.float64),
      "num_systems": np.array(-1 if inputs.num_systems is None else inputs.num_systems,
                              np.int64),
  }
  if inputs.segments is not None:
    arrays["segments"] = np.concatenate([np.asarray(s, np.int64) for s in inputs.segments])
    arrays["segment_sizes"] = np.array([len(s) for s in inputs.segments], np.int64)
  _atomic_write(path, lambda f: np.savez(f, **arrays))


def load_inputs(path: str, dtype: str) -> workloads.Inputs:
  """Reads what ``save_inputs`` wrote; the leaves are views of one buffer."""
  with np.load(path, allow_pickle=False) as data:
    bits, ndim, shape = data["bits"], data["ndim"], data["shape"]
    threshold, norm_type = (float(v) for v in data["scalars"])
    num_systems = int(data["num_systems"])
    segments = None
    if "segments" in data:
      cuts = np.cumsum(data["segment_sizes"])[:-1]
      segments = tuple(np.split(data["segments"], cuts))
  flat = bits.view(workloads.numpy_dtype(dtype))
  leaves, at, dim_at = [], 0, 0
  for n in ndim:
    dims = tuple(int(d) for d in shape[dim_at:dim_at + n])
    size = math.prod(dims)
    leaves.append(flat[at:at + size].reshape(dims))
    at, dim_at = at + size, dim_at + n
  return workloads.Inputs(tuple(leaves), threshold, segments,
                          None if num_systems < 0 else num_systems, norm_type)


# Per-process caches: asv runs one grid point per process and re-runs setup around each call.
_INPUTS: dict[tuple[str, float, str], workloads.Inputs] = {}


def _inputs(workload: workloads.Workload, scale: float, dtype: str,
            run_dir: str | None) -> workloads.Inputs:
  """The workload's inputs: from this process, else from the run's folder, else built."""
  key = (workload.name, scale, dtype)
  if key in _INPUTS:
    return _INPUTS[key]
  _INPUTS.clear()  # one workload at a time: W1 in float64 alone is 128 MiB
  path = run_dir and _case_file(run_dir, "inputs", workload.name, dtype, repr(scale),
                                suffix=".npz")
  inputs = None
  if path and os.path.exists(path):
    try:
      inputs = load_inputs(path, dtype)
    except (OSError, ValueError, KeyError) as e:
      print(f"clipbench: ignoring unreadable cached inputs {path}: {e}", file=sys.stderr)
  if inputs is None:
    inputs = workload.build(scale, dtype)
    if path:
      save_inputs(path, inputs)
  _INPUTS[key] = inputs
  return inputs


# ------------------------------------------------------------------------------ the cases


def static_skip_reason(impl: str, workload: str, dtype: str, device: str) -> str | None:
  """A reason decidable without importing any framework, or None."""
  return cases.early_skip_reason(device) or grid.static_skip_reason(impl, workload, dtype, device)


def _load_or_skip(impl_name: str, workload_name: str, dtype: str,
                  device: str) -> tuple[Implementation, workloads.Workload]:
  reason = static_skip_reason(impl_name, workload_name, dtype, device)
  if reason:
    raise SkipNotImplemented(reason)
  entry = grid.entry(impl_name)
  if entry is not None and entry.framework == "jax":
    enable_jax_compilation_cache()  # before the implementation's module can compile anything
  impl, workload, reason = cases.load_case(impl_name, workload_name, dtype, device)
  if reason:
    raise SkipNotImplemented(reason)
  return impl, workload


@dataclasses.dataclass
class Loaded:
  """One case, loaded and warmed up: what the timed call and the figures need."""

  impl: Implementation
  workload: workloads.Workload
  dtype: str
  device: str
  inputs: workloads.Inputs
  runner: Callable[[calling.Prepared], object]
  warm: calling.Prepared | None  # the warmed-up preparation, None for in-place clipping

  def fresh(self) -> calling.Prepared:
    """Arguments for one call: the warm ones, or new conversions when clipping in place."""
    if self.warm is not None:
      return self.warm
    return cases.prepare(self.impl, self.workload, self.inputs, self.device)


_LOADED: dict[tuple[str, str, str, str, float], Loaded] = {}


def load(impl_name: str, workload_name: str, dtype: str, device: str,
         run_dir: str | None = None) -> Loaded:
  """The case of this grid point, loaded once per process (raises SkipNotImplemented)."""
  scale = asv_scale()
  key = (impl_name, workload_name, dtype, device, scale)
  case = _LOADED.get(key)
  if case is None:
    _LOADED.clear()
    impl, workload = _load_or_skip(impl_name, workload_name, dtype, device)
    inputs = _inputs(workload, scale, dtype, run_dir)
    prepared = cases.prepare(impl, workload, inputs, device)
    runner = cases.timed_runner(impl, prepared)
    runner(prepared)  # jit compilation and first-touch allocations, untimed
    # The warm-up clipped in-place leaves: those are never timed again.
    warm = None if impl.capabilities.in_place else prepared
    case = Loaded(impl, workload, dtype, device, inputs, runner, warm)
    _LOADED[key] = case
  return case


def median_seconds(case: Loaded) -> float:
  """Median time of the timed call, every call on fresh inputs when clipping in place."""
  if case.warm is not None:
    warm = case.warm
    return cases.median_call_seconds(lambda: case.runner(warm))
  state: dict[str, calling.Prepared] = {}

  def reset() -> None:
    state["prepared"] = case.fresh()

  return cases.median_call_seconds(lambda: case.runner(state["prepared"]), reset)


def max_ulp_error(impl: Implementation, workload: workloads.Workload, dtype: str,
                  device: str) -> float:
  """Largest ulp error of the timed call against the exact reference, on a small input."""
  try:
    import clipbench.reference as reference  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise SkipNotImplemented(f"clipbench.reference not importable: {e}") from e
  op = cases.resolve_op(impl, workload)
  reference_function = getattr(reference, op or "", None)
  if reference_function is None:
    raise SkipNotImplemented(f"clipbench.reference has no {op}")
  inputs = workload.build(workloads.scale_for_elements(workload, ACCURACY_ELEMENTS), dtype)
  prepared = cases.prepare(impl, workload, inputs, device)
  out, _ = calling.result_to_numpy(cases.timed_runner(impl, prepared)(prepared))
  kwargs: dict[str, Any] = {}
  if inputs.segments is not None:
    kwargs.update(segments=list(inputs.segments), num_systems=inputs.num_systems)
  if op != "clip_by_max_step" and inputs.norm_type != 2.0:
    kwargs["norm_type"] = inputs.norm_type
  ref, _ = reference_function([x.copy() for x in inputs.leaves], inputs.threshold, **kwargs)
  return accuracy.max_ulp_error_leaves(out, [frameworks.to_numpy(r) for r in ref])


# ------------------------------------------------------- figures shared through the run folder


def _figures_path(run_dir: str, impl: str, workload: str, dtype: str, device: str) -> str:
  return _case_file(run_dir, "figures", impl, workload, dtype, device, repr(asv_scale()),
                    suffix=".json")


def read_figures(run: Run | None, impl: str, workload: str, dtype: str,
                 device: str) -> dict[str, Any] | None:
  """The figures a speed process of this run recorded for the case, or None."""
  run_dir = _run_dir(run)
  if not run_dir:
    return None
  try:
    with open(_figures_path(run_dir, impl, workload, dtype, device), encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _write_figures(run_dir: str, impl: str, workload: str, dtype: str, device: str,
                   figures: dict[str, Any]) -> None:
  text = json.dumps(figures).encode("utf-8")
  _atomic_write(_figures_path(run_dir, impl, workload, dtype, device), lambda f: f.write(text))


_RECORDED: set[tuple[str, ...]] = set()  # cases this process has recorded (or tried to)


def record_figures(run: Run | None, case: Loaded) -> None:
  """Measures the Track figures of a loaded case once per run, unless already recorded."""
  run_dir = _run_dir(run)
  names = (case.impl.name, case.workload.name, case.dtype, case.device)
  if not run_dir or names in _RECORDED:
    return
  _RECORDED.add(names)
  if read_figures(run, *names) is not None:
    return
  try:
    figures = {"median_seconds": median_seconds(case),
               "bytes_moved": workloads.bytes_moved(case.inputs),
               "max_ulp_error": max_ulp_error(case.impl, case.workload, case.dtype, case.device)}
  except Exception:  # pylint: disable=broad-except
    # Not this benchmark's failure: the Track processes measure by themselves and report it.
    print("clipbench: recording the track figures failed; the Track benchmarks will measure "
          "them:\n" + traceback.format_exc(), file=sys.stderr)
    return
  _write_figures(run_dir, *names, figures)


def _record_skip(run: Run | None, names: tuple[str, str, str, str], reason: str) -> None:
  run_dir = _run_dir(run)
  if run_dir and read_figures(run, *names) is None:
    _write_figures(run_dir, *names, {"skip": reason})


# ---------------------------------------------------------------------------- benchmarks


class _RunCache:
  """Base of every class: one ``setup_cache`` per run, shared by all of them.

  asv keys a ``setup_cache`` by its module and line, so every subclass shares this one: a
  single copy-bandwidth probe per run (the figure every ratio uses) and a single working folder
  (asv runs every benchmark of the run in it and deletes it at the end).
  """

  def setup_cache(self) -> Run:
    return {"bandwidth_bytes": bandwidth.measure_copy_bandwidth(), "run_dir": os.getcwd()}

  setup_cache.timeout = 300.0


class _Speed(_RunCache):
  """Time and peak memory of one call; records the Track figures after the measurement."""

  param_names = PARAM_NAMES
  timeout = 1800.0 if grid.run_slow() else 600.0
  rounds = 1
  repeat = (3, 10, 20.0)

  def setup(self, run: Run, impl: str, workload: str, dtype: str, device: str) -> None:
    self.case = None
    try:
      self.case = load(impl, workload, dtype, device, _run_dir(run))
    except NotImplementedError as e:  # SkipNotImplemented subclasses it
      _record_skip(run, (impl, workload, dtype, device), str(e))
      raise
    self.prepared = self.case.fresh()

  def time_clip(self, run: Run, impl: str, workload: str, dtype: str, device: str) -> None:
    self.case.runner(self.prepared)

  def peakmem_clip(self, run: Run, impl: str, workload: str, dtype: str, device: str) -> None:
    self.case.runner(self.prepared)

  def teardown(self, run: Run, impl: str, workload: str, dtype: str, device: str) -> None:
    # After asv read the result (peak memory included), so the extra calls are not counted.
    if getattr(self, "case", None) is not None:
      record_figures(run, self.case)


class _Track(_RunCache):
  """Roofline ratio and ulp error, read from the run's figures (measured here when missing)."""

  param_names = PARAM_NAMES
  timeout = 1800.0 if grid.run_slow() else 600.0

  def setup(self, run: Run, impl: str, workload: str, dtype: str, device: str) -> None:
    reason = static_skip_reason(impl, workload, dtype, device)
    if reason:
      raise SkipNotImplemented(reason)
    self.figures = read_figures(run, impl, workload, dtype, device) or {}
    if "skip" in self.figures:
      raise SkipNotImplemented(self.figures["skip"])

  def track_roofline_ratio(self, run: Run, impl: str, workload: str, dtype: str,
                           device: str) -> float:
    if "median_seconds" in self.figures:
      seconds, nbytes = self.figures["median_seconds"], self.figures["bytes_moved"]
    else:
      case = load(impl, workload, dtype, device, _run_dir(run))
      seconds, nbytes = median_seconds(case), workloads.bytes_moved(case.inputs)
    return bandwidth.roofline_ratio(seconds, nbytes, run["bandwidth_bytes"])

  track_roofline_ratio.unit = "time / roofline"

  def track_max_ulp_error(self, run: Run, impl: str, workload: str, dtype: str,
                          device: str) -> float:
    if "max_ulp_error" in self.figures:
      return float(self.figures["max_ulp_error"])
    loaded, wl = _load_or_skip(impl, workload, dtype, device)
    return max_ulp_error(loaded, wl, dtype, device)

  track_max_ulp_error.unit = "ulp"


class GlobalCpu(_Speed):
  """Global L2 clipping on the CPU (W1-model, W4-many-small)."""
  params = grid.params("global", "cpu")


class GlobalCpuTrack(_Track):
  params = grid.params("global", "cpu")


class GlobalCuda(_Speed):
  """Global L2 clipping on a CUDA GPU."""
  params = grid.params("global", "cuda")


class GlobalCudaTrack(_Track):
  params = grid.params("global", "cuda")


class PNormCpu(_Speed):
  """Global p-norm clipping, p = 1, 3, inf, on the CPU (implementations accepting any p)."""
  params = grid.params("pnorm", "cpu")


class PNormCpuTrack(_Track):
  params = grid.params("pnorm", "cpu")


class PNormCuda(_Speed):
  """Global p-norm clipping on a CUDA GPU."""
  params = grid.params("pnorm", "cuda")


class PNormCudaTrack(_Track):
  params = grid.params("pnorm", "cuda")


class PerSystemCpu(_Speed):
  """Per-system L2 clipping with segments on the CPU (W2-relax, W3-relax-large)."""
  params = grid.params("per_system", "cpu")


class PerSystemCpuTrack(_Track):
  params = grid.params("per_system", "cpu")


class PerSystemCuda(_Speed):
  """Per-system L2 clipping on a CUDA GPU."""
  params = grid.params("per_system", "cuda")


class PerSystemCudaTrack(_Track):
  params = grid.params("per_system", "cuda")


class MaxStepCpu(_Speed):
  """Per-system max-step clipping on the CPU (W2/W3-relax max-step)."""
  params = grid.params("max_step", "cpu")


class MaxStepCpuTrack(_Track):
  params = grid.params("max_step", "cpu")


class MaxStepCuda(_Speed):
  """Per-system max-step clipping on a CUDA GPU."""
  params = grid.params("max_step", "cuda")


class MaxStepCudaTrack(_Track):
  params = grid.params("max_step", "cuda")


SPEED_CLASSES: tuple[type, ...] = (GlobalCpu, GlobalCuda, PNormCpu, PNormCuda, PerSystemCpu,
                                   PerSystemCuda, MaxStepCpu, MaxStepCuda)
TRACK_CLASSES: tuple[type, ...] = (GlobalCpuTrack, GlobalCudaTrack, PNormCpuTrack,
                                   PNormCudaTrack, PerSystemCpuTrack, PerSystemCudaTrack,
                                   MaxStepCpuTrack, MaxStepCudaTrack)


class Machine(_RunCache):
  """The copy bandwidth (bytes read + written per second) every roofline ratio used."""

  timeout = 300.0

  def track_bandwidth_gbs(self, run: Run) -> float:
    return run["bandwidth_bytes"] / 1e9

  track_bandwidth_gbs.unit = "GB/s"
