"""asv benchmarks: every implementation x workload x dtype x device, timed and checked.

* ``Clip.time_clip`` / ``Clip.peakmem_clip``: one canonical call, device work synchronized
  inside the call (``calling.run`` blocks until ready); inputs are built and converted to the
  framework in ``setup`` and the call is warmed up there once (jit compilation untimed).
  ``peakmem`` is the process's peak RSS, so it includes the inputs and the framework.
* ``Roofline.track_roofline_ratio``: median call time over the three-pass roofline at the copy
  bandwidth measured in the same run (lower is better, as asv assumes for every metric).
* ``Accuracy.track_max_ulp_error``: largest output error in ulps against the exact reference,
  on a small fixed input (about 4,096 elements of the workload), so accuracy is tracked over
  commits like speed.
* ``Machine.track_bandwidth_gbs``: the copy bandwidth the ratios were computed with (the same
  ``setup_cache`` value: asv shares a cache between classes through the function's line).

A case that cannot run here (unavailable library, op/p/dtype/device not declared, no GPU)
raises ``SkipNotImplemented`` in ``setup``: asv reports it as skipped (n/a), not failed.

``CLIPBENCH_ASV_SCALE`` (default 1.0) shrinks every workload for smoke runs, for example
``CLIPBENCH_ASV_SCALE=0.001 asv run --python=same --quick``.

asv quirk (asv_runner >= 0.3): with a ``setup`` present, asv re-runs ``setup`` before every
timed call (asv#966). Built inputs, framework conversions and the warm-up are therefore cached
per process, except for in-place implementations, whose leaves are converted afresh each time
so every call clips unclipped data.
"""

from __future__ import annotations

import math
import os
from typing import Any

from clipbench.benchmarks import accuracy, bandwidth, cases, workloads
from clipbench.impls import calling, frameworks
from clipbench.impls.registry import Implementation

try:
  from asv_runner.benchmarks.mark import SkipNotImplemented
except ImportError:  # asv < 0.6: a NotImplementedError from setup is a skip too.
  SkipNotImplemented = NotImplementedError

SCALE_ENV = "CLIPBENCH_ASV_SCALE"
ACCURACY_ELEMENTS = 4096

IMPLS = cases.timed_impl_names()
PARAMS = (list(IMPLS), list(workloads.NAMES), list(workloads.DTYPES), list(cases.DEVICES))
PARAM_NAMES = ("impl", "workload", "dtype", "device")


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


# Per-process caches: asv runs one parameter combination per process, and re-runs setup
# before each timed call.
_INPUTS: dict[tuple[str, float, str], workloads.Inputs] = {}
_PREPARED: dict[tuple[str, str, float, str, str], calling.Prepared] = {}


def _inputs(workload: workloads.Workload, scale: float, dtype: str) -> workloads.Inputs:
  key = (workload.name, scale, dtype)
  if key not in _INPUTS:
    _INPUTS.clear()  # one workload at a time: W1 in float64 alone is 128 MiB
    _INPUTS[key] = workload.build(scale, dtype)
  return _INPUTS[key]


def _load_or_skip(impl_name: str, workload_name: str, dtype: str,
                  device: str) -> tuple[Implementation, workloads.Workload]:
  impl, workload, reason = cases.load_case(impl_name, workload_name, dtype, device)
  if reason:
    raise SkipNotImplemented(reason)
  return impl, workload


def _prepared(impl: Implementation, workload: workloads.Workload, scale: float, dtype: str,
              device: str) -> tuple[calling.Prepared, int]:
  """Framework inputs of the case (warmed up once) and its roofline bytes."""
  inputs = _inputs(workload, scale, dtype)
  key = (impl.name, workload.name, scale, dtype, device)
  cached = _PREPARED.get(key)
  if cached is None:
    _PREPARED.clear()
    cached = cases.prepare(impl, workload, inputs, device)
    calling.run(impl, cached)  # jit compilation and first-touch allocations, untimed
    _PREPARED[key] = cached
  if impl.capabilities.in_place:
    # The warm-up clipped these leaves in place: time fresh copies, never clipped data.
    cached = cases.prepare(impl, workload, inputs, device)
  return cached, workloads.bytes_moved(inputs)


class _MeasuredBandwidth:
  """Base of the classes needing this run's copy bandwidth (bytes/s).

  asv keys a ``setup_cache`` by its module and line, so the subclasses share one probe per run
  and environment, and the saved ``track_bandwidth_gbs`` is the figure every ratio used.
  """

  def setup_cache(self) -> float:
    return bandwidth.measure_copy_bandwidth()


class Clip:
  """Time and peak memory of one call."""

  params = PARAMS
  param_names = PARAM_NAMES
  timeout = 600.0
  rounds = 1
  repeat = (3, 10, 20.0)

  def setup(self, impl: str, workload: str, dtype: str, device: str) -> None:
    self.impl, wl = _load_or_skip(impl, workload, dtype, device)
    self.prepared, _ = _prepared(self.impl, wl, asv_scale(), dtype, device)

  def time_clip(self, impl: str, workload: str, dtype: str, device: str) -> None:
    calling.run(self.impl, self.prepared)

  def peakmem_clip(self, impl: str, workload: str, dtype: str, device: str) -> None:
    calling.run(self.impl, self.prepared)


class Roofline(_MeasuredBandwidth):
  """Median call time over the three-pass roofline at this run's copy bandwidth."""

  params = PARAMS
  param_names = PARAM_NAMES
  timeout = 600.0

  def setup(self, bandwidth_bytes: float, impl: str, workload: str, dtype: str,
            device: str) -> None:
    self.impl, self.workload = _load_or_skip(impl, workload, dtype, device)

  def track_roofline_ratio(self, bandwidth_bytes: float, impl: str, workload: str, dtype: str,
                           device: str) -> float:
    scale = asv_scale()
    prepared, nbytes = _prepared(self.impl, self.workload, scale, dtype, device)
    reset = None
    if self.impl.capabilities.in_place:
      state: dict[str, Any] = {"prepared": prepared}

      def reset() -> None:
        state["prepared"], _ = _prepared(self.impl, self.workload, scale, dtype, device)

      seconds = cases.median_call_seconds(lambda: calling.run(self.impl, state["prepared"]),
                                          reset)
    else:
      seconds = cases.median_call_seconds(lambda: calling.run(self.impl, prepared))
    return bandwidth.roofline_ratio(seconds, nbytes, bandwidth_bytes)

  track_roofline_ratio.unit = "time / roofline"


class Accuracy:
  """Largest output error in ulps against the exact reference on a small fixed input."""

  params = PARAMS
  param_names = PARAM_NAMES
  timeout = 600.0

  def setup(self, impl: str, workload: str, dtype: str, device: str) -> None:
    self.impl, self.workload = _load_or_skip(impl, workload, dtype, device)
    try:
      import clipbench.reference as reference
    except ImportError as e:
      raise SkipNotImplemented(f"clipbench.reference not importable: {e}") from e
    op = cases.resolve_op(self.impl, self.workload)
    self.reference_function = getattr(reference, op, None)
    if self.reference_function is None:
      raise SkipNotImplemented(f"clipbench.reference has no {op}")

  def track_max_ulp_error(self, impl: str, workload: str, dtype: str, device: str) -> float:
    wl = self.workload
    inputs = wl.build(workloads.scale_for_elements(wl, ACCURACY_ELEMENTS), dtype)
    out, _ = calling.result_to_numpy(
        calling.run(self.impl, cases.prepare(self.impl, wl, inputs, device)))
    kwargs: dict[str, Any] = {}
    if inputs.segments is not None:
      kwargs.update(segments=list(inputs.segments), num_systems=inputs.num_systems)
    if cases.resolve_op(self.impl, wl) != "clip_by_max_step" and inputs.norm_type != 2.0:
      kwargs["norm_type"] = inputs.norm_type
    ref, _ = self.reference_function([x.copy() for x in inputs.leaves], inputs.threshold,
                                     **kwargs)
    return accuracy.max_ulp_error_leaves(out, [frameworks.to_numpy(r) for r in ref])

  track_max_ulp_error.unit = "ulp"


class Machine(_MeasuredBandwidth):
  """The copy bandwidth (bytes read + written per second) every roofline ratio used."""

  timeout = 300.0

  def track_bandwidth_gbs(self, bandwidth_bytes: float) -> float:
    return bandwidth_bytes / 1e9

  track_bandwidth_gbs.unit = "GB/s"
