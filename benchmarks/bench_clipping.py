"""asv benchmarks of the clipping operations: one class per operation family and device, and
the counts of what a call dispatches on a GPU (:class:`CudaRouteCosts`).

Each class is a dense grid, impl x workload x dtype x device (``grid.params``, derived from
the registry; the tracked implementations unless ``CLIPBENCH_ASV_IMPLS`` says otherwise), its
``...Track`` twin records the peak memory, the roofline ratio and the ulp error of the same
points. asv starts one process per point and metric: only ``time_clip``'s loads a framework,
and hands the Track figures on through the run's folder (``grid_point``). The metrics, the
time budget and the environment switches are described in README.md (Benchmarks).
"""

from __future__ import annotations

from clipbench.benchmarks import costs, grid, grid_point
from clipbench.benchmarks.grid_point import PARAM_NAMES, Run


class _RunCache:
  """Base of every class: asv keys ``setup_cache`` by module and line, so all share one run
  state (one bandwidth probe, asv's working folder of the run)."""

  def setup_cache(self) -> Run:
    return grid_point.start_run()

  setup_cache.timeout = 300.0


class _Speed(_RunCache):
  """Time of one call; records the Track figures after the measurement."""

  param_names = PARAM_NAMES
  timeout = grid_point.TIMEOUT_SECONDS
  rounds = 1
  repeat = (3, 10, 20.0)

  def setup(self, run: Run, impl: str, workload: str, dtype: str, device: str) -> None:
    self.case = None  # until loaded: teardown must not record a previous point
    self.case = grid_point.load_for_speed(run, impl, workload, dtype, device)
    self.prepared = self.case.fresh()

  def time_clip(self, run: Run, impl: str, workload: str, dtype: str, device: str) -> None:
    self.case.runner(self.prepared)

  def teardown(self, run: Run, impl: str, workload: str, dtype: str, device: str) -> None:
    # After asv read the time, so the extra calls are not counted.
    grid_point.record_figures(run, getattr(self, "case", None))


class _Track(_RunCache):
  """Peak memory, roofline ratio and ulp error, read from the run's figures (measured here when
  missing)."""

  param_names = PARAM_NAMES
  timeout = grid_point.TIMEOUT_SECONDS

  def setup(self, run: Run, impl: str, workload: str, dtype: str, device: str) -> None:
    self.figures = grid_point.recorded_or_skip(run, impl, workload, dtype, device)

  def track_peak_rss(self, run: Run, impl: str, workload: str, dtype: str, device: str) -> float:
    return grid_point.peak_rss(run, self.figures, impl, workload, dtype, device)

  track_peak_rss.unit = "bytes"

  def track_roofline_ratio(self, run: Run, impl: str, workload: str, dtype: str,
                           device: str) -> float:
    return grid_point.roofline_ratio(run, self.figures, impl, workload, dtype, device)

  track_roofline_ratio.unit = "time / roofline"

  def track_max_ulp_error(self, run: Run, impl: str, workload: str, dtype: str,
                          device: str) -> float:
    return grid_point.ulp_error(self.figures, impl, workload, dtype, device)

  track_max_ulp_error.unit = "ulp"


# (class name, family, device, docstring): a speed class and its Track twin each.
CLASSES = (
    ("GlobalCpu", "global", "cpu", "Global L2 clipping on the CPU (W1-model, W4-many-small)."),
    ("GlobalCuda", "global", "cuda", "Global L2 clipping on a CUDA GPU."),
    ("PNormCpu", "pnorm", "cpu",
     "Global p-norm clipping, p = 1, 3, inf, on the CPU (implementations accepting any p)."),
    ("PNormCuda", "pnorm", "cuda", "Global p-norm clipping on a CUDA GPU."),
    ("PerSystemCpu", "per_system", "cpu",
     "Per-system L2 clipping with segments on the CPU (W2, W3, W5, W6)."),
    ("PerSystemCuda", "per_system", "cuda", "Per-system L2 clipping on a CUDA GPU."),
    ("MaxStepCpu", "max_step", "cpu", "Per-system max-step clipping on the CPU (W2, W3, W5, W6)."),
    ("MaxStepCuda", "max_step", "cuda", "Per-system max-step clipping on a CUDA GPU."),
)


def _define_classes() -> tuple[tuple[type, ...], tuple[type, ...]]:
  """The speed and Track classes of the grid, as module attributes for asv to discover.

  A class whose grid has no implementation (``CLIPBENCH_ASV_IMPLS`` named none of its
  family and device) is left out: asv cannot check a benchmark without parameter sets.
  """
  speed, track = [], []
  for name, family, device, doc in CLASSES:
    params = grid.params(family, device)
    if not params[0]:
      continue
    for base, cls_name, out in ((_Speed, name, speed), (_Track, name + "Track", track)):
      cls = type(cls_name, (base,), {"__doc__": doc, "params": params, "__module__": __name__})
      globals()[cls_name] = cls
      out.append(cls)
  return tuple(speed), tuple(track)


SPEED_CLASSES, TRACK_CLASSES = _define_classes()


class CudaRouteCosts:
  """What one call dispatches on a GPU, counted on any machine (``benchmarks/costs.py``): aten
  operators that launch work, Triton launches and host transfers, for our CUDA route (the
  eager torch route on its accelerator branches, Triton) and the torch peers it answers to.
  Exact counts, so a commit that adds a launch or a host round trip shows as a step, where
  times on a GPU-less machine would not show it. Triton's kernels need a GPU, or
  ``TRITON_INTERPRET=1`` in asv's environment (slow at these sizes: minutes a point); without
  either its points are skipped with that reason."""

  params = (list(costs.DEFAULT_IMPLS), list(costs.DEFAULT_WORKLOADS))
  param_names = ("impl", "workload")
  timeout = 1800.0

  def setup(self, impl: str, workload: str) -> None:
    reason = costs.cannot_count_here(impl)
    row = None if reason else costs.count_case(impl, workload)
    if reason or row.costs is None:
      raise NotImplementedError(reason or row.skip)  # asv: this point is skipped
    self.costs = row.costs

  def track_operators(self, impl: str, workload: str) -> int:
    return self.costs.operators

  track_operators.unit = "operators"

  def track_triton_launches(self, impl: str, workload: str) -> int:
    return self.costs.launches

  track_triton_launches.unit = "launches"

  def track_host_transfers(self, impl: str, workload: str) -> int:
    return self.costs.transfers

  track_host_transfers.unit = "transfers"


class Machine(_RunCache):
  """The copy bandwidth (bytes read + written per second) every roofline ratio used."""

  timeout = 300.0

  def track_bandwidth_gbs(self, run: Run) -> float:
    return run["bandwidth_bytes"] / 1e9

  track_bandwidth_gbs.unit = "GB/s"
