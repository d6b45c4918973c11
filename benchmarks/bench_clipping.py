"""asv benchmarks of the clipping operations: one class per operation family and device.

Each class is a dense grid, impl x workload x dtype x device (``grid.params``, derived from
the registry), its ``...Track`` twin records the roofline ratio and the ulp error of the same
points. Loading a point and sharing its figures between asv's processes is ``grid_point``'s;
the metrics, the time budget and the environment switches are described in README.md
(Benchmarks).
"""

from __future__ import annotations

from clipbench.benchmarks import grid, grid_point
from clipbench.benchmarks.grid_point import PARAM_NAMES, Run


class _RunCache:
  """Base of every class: asv keys ``setup_cache`` by module and line, so all share one run
  state (one bandwidth probe, asv's working folder of the run)."""

  def setup_cache(self) -> Run:
    return grid_point.start_run()

  setup_cache.timeout = 300.0


class _Speed(_RunCache):
  """Time and peak memory of one call; records the Track figures after the measurement."""

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

  def peakmem_clip(self, run: Run, impl: str, workload: str, dtype: str, device: str) -> None:
    self.case.runner(self.prepared)

  def teardown(self, run: Run, impl: str, workload: str, dtype: str, device: str) -> None:
    # After asv read the result (peak memory included), so the extra calls are not counted.
    grid_point.record_figures(run, getattr(self, "case", None))


class _Track(_RunCache):
  """Roofline ratio and ulp error, read from the run's figures (measured here when missing)."""

  param_names = PARAM_NAMES
  timeout = grid_point.TIMEOUT_SECONDS

  def setup(self, run: Run, impl: str, workload: str, dtype: str, device: str) -> None:
    self.figures = grid_point.recorded_or_skip(run, impl, workload, dtype, device)

  def track_roofline_ratio(self, run: Run, impl: str, workload: str, dtype: str,
                           device: str) -> float:
    return grid_point.roofline_ratio(run, self.figures, impl, workload, dtype, device)

  track_roofline_ratio.unit = "time / roofline"

  def track_max_ulp_error(self, run: Run, impl: str, workload: str, dtype: str,
                          device: str) -> float:
    return grid_point.ulp_error(self.figures, impl, workload, dtype, device)

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
