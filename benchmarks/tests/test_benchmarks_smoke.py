"""Smoke tests of the benchmark suite: workloads, bandwidth probe, asv classes, pytest runner.

Fast (tiny scales) so the suite cannot rot unnoticed; full benchmark runs are not tests.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from clipbench.benchmarks import (accuracy, bandwidth, bench_clipping, grid, grid_point,
                                  roofline, run_folder, timing, workloads)

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = 0.001


def _system_norms(inputs: workloads.WorkloadInputs) -> np.ndarray:
  sq = np.zeros(inputs.num_systems)
  for leaf, seg in zip(inputs.leaves, inputs.segments):
    rows = np.sum(leaf.reshape(leaf.shape[0], -1).astype(np.float64) ** 2, axis=1)
    sq += np.bincount(seg, weights=rows, minlength=inputs.num_systems)
  return np.sqrt(sq)


# Atoms per system of the per-system workloads other than W2/W3's 10-500.
_ATOMS_PER_SYSTEM = {"W5": (2, 8), "W6": (1, 4_000_000)}


@pytest.mark.parametrize("dtype", workloads.DTYPES)
@pytest.mark.parametrize("name", workloads.NAMES)
def test_workload_builds_valid_inputs(name: str, dtype: str) -> None:
  workload = workloads.get(name)
  inputs = workload.build(TINY, dtype)
  assert inputs.leaves and all(x.dtype == workloads.numpy_dtype(dtype) for x in inputs.leaves)
  assert all(np.all(np.isfinite(x.astype(np.float64))) for x in inputs.leaves)
  assert math.isfinite(inputs.threshold) and inputs.threshold > 0
  assert inputs.norm_type == workload.norm_type
  assert workloads.bytes_moved(inputs) == 3 * sum(x.nbytes for x in inputs.leaves)
  if workload.per_system:
    positions, cell = inputs.leaves
    seg_pos, seg_cell = inputs.segments
    s = inputs.num_systems
    assert positions.ndim == 2 and positions.shape[1] == 3 and cell.shape == (s, 3, 3)
    assert seg_pos.shape == (positions.shape[0],) and seg_pos.dtype.kind == "i"
    assert seg_pos.min() == 0 and seg_pos.max() == s - 1 and np.all(np.diff(seg_pos) >= 0)
    counts = np.bincount(seg_pos, minlength=s)
    low, high = _ATOMS_PER_SYSTEM.get(name.split("-")[0], (10, 500))
    assert counts.min() >= low and counts.max() <= high
    np.testing.assert_array_equal(seg_cell, np.arange(s))
  else:
    assert inputs.segments is None and inputs.num_systems is None
    assert all(x.ndim == 1 for x in inputs.leaves)
  again = workload.build(TINY, dtype)  # fixed seeds: same bits every time
  for a, b in zip(inputs.leaves, again.leaves):
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
  assert again.threshold == inputs.threshold


def test_global_thresholds_clip_and_per_system_thresholds_split() -> None:
  model = workloads.get("W1-model").build(TINY)
  norm = math.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in model.leaves))
  assert model.threshold == pytest.approx(norm / 2)
  relax = workloads.get("W2-relax").build(0.01)
  norms = _system_norms(relax)
  assert 0 < np.sum(norms > relax.threshold) < relax.num_systems
  tiny = workloads.get("W5-many-tiny").build(0.01)
  assert 0.4 < np.mean(_system_norms(tiny) > tiny.threshold) < 0.6
  giant = workloads.get("W6-one-giant").build(TINY)
  assert giant.num_systems == 1 and not giant.segments[0].any()
  assert giant.threshold == pytest.approx(_system_norms(giant)[0] / 2)
  step = workloads.get("W6-one-giant-max-step").build(TINY)
  steps = max(float(np.max(np.linalg.norm(x.astype(np.float64), axis=-1))) for x in step.leaves)
  assert step.threshold == pytest.approx(steps / 2)


def test_full_size_shapes() -> None:
  model = workloads.get("W1-model").build(1.0)
  assert len(model.leaves) == 200 and model.num_elements == 2**24
  sizes = sorted(x.size for x in model.leaves)
  assert sizes[-1] > 20 * sizes[len(sizes) // 2]  # log-normal: a long tail of large leaves
  small = workloads.get("W4-many-small").build(1.0)
  assert len(small.leaves) == 10_000 and {x.shape for x in small.leaves} == {(100,)}
  assert workloads.get("W3-relax-large").builder(TINY, "float32", 3).num_systems == 20
  assert workloads.get("W2-relax-max-step").op == "clip_by_max_step"
  tiny = workloads.get("W5-many-tiny").build(1.0)
  assert tiny.num_systems == 100_000 and tiny.leaves[1].shape == (100_000, 3, 3)
  giant = workloads.get("W6-one-giant-max-step").build(1.0)
  assert giant.leaves[0].shape == (4_000_000, 3) and giant.num_systems == 1


def test_unknown_names_are_rejected() -> None:
  with pytest.raises(ValueError, match="W1-model"):
    workloads.get("W9")
  with pytest.raises(ValueError, match="dtype"):
    workloads.numpy_dtype("int8")
  with pytest.raises(ValueError, match="scale"):
    workloads.get("W4-many-small").build(0.0)


def test_read_bandwidth_probe() -> None:
  for threads in (1, 2):
    read = bandwidth.measure_read_bandwidth(nbytes=1 << 20, repeats=2, threads=threads)
    assert math.isfinite(read) and read > 0
  with pytest.raises(ValueError, match="threads"):
    bandwidth.measure_read_bandwidth(nbytes=1 << 20, threads=0)
  with pytest.raises(ValueError, match="repeats"):
    bandwidth.measure_read_bandwidth(nbytes=1 << 20, repeats=0)


def test_memory_floor_ratio() -> None:
  floor = bandwidth.memory_floor_ratio
  # Reads as fast as copies, no ids, one read pass: the floor is the roofline itself.
  assert floor(1e9, 0.0, 20e9, 20e9, leaf_reads=1) == pytest.approx(1.0)
  # Reads at half the copy bandwidth: the norm pass costs two roofline passes of three.
  assert floor(1e9, 0.0, 20e9, 10e9, leaf_reads=1) == pytest.approx(4 / 3)
  # W3's ids (two thirds of the leaf bytes) at the copy bandwidth: 1 + (2/3) / 3.
  assert floor(3e9, 2e9, 20e9, 20e9, leaf_reads=1) == pytest.approx(11 / 9)
  # Systems that fit in cache are read from memory once: the ids and the scaling pass only.
  assert floor(3e9, 2e9, 20e9, 20e9, leaf_reads=0) == pytest.approx(8 / 9)
  with pytest.raises(ValueError, match="read_bandwidth"):
    floor(1e9, 0.0, 20e9, 0.0, leaf_reads=1)
  with pytest.raises(ValueError, match="id_bytes"):
    floor(1e9, -1.0, 20e9, 20e9, leaf_reads=1)
  with pytest.raises(ValueError, match="leaf_reads"):
    floor(1e9, 0.0, 20e9, 20e9, leaf_reads=2)


def test_bandwidth_probe_and_roofline() -> None:
  bw = bandwidth.measure_copy_bandwidth(nbytes=1 << 20, repeats=2)
  assert math.isfinite(bw) and bw > 0
  assert bandwidth.roofline_seconds(3e9, 1e9) == pytest.approx(3.0)
  assert bandwidth.roofline_ratio(6.0, 3e9, 1e9) == pytest.approx(2.0)
  with pytest.raises(ValueError, match="bandwidth"):
    bandwidth.roofline_seconds(1.0, 0.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_ulp_error(dtype: str) -> None:
  np_dtype = workloads.numpy_dtype(dtype)
  ref = np.array([1.0, -3.0, 0.0, np.nan], dtype=np_dtype)
  assert accuracy.max_ulp_error(ref.copy(), ref) == 0.0
  off = ref.copy()
  off[1] = np.nextafter(off[1:2], np.zeros(1, np_dtype))[0]  # one ulp toward zero
  assert accuracy.max_ulp_error(off, ref) == 1.0
  nan_where_finite = ref.copy()
  nan_where_finite[0] = np.nan
  assert accuracy.max_ulp_error(nan_where_finite, ref) == math.inf
  assert accuracy.max_ulp_error_leaves([ref], [ref, ref]) == math.inf


def test_summarize(tmp_path: pathlib.Path) -> None:
  def bench(impl: str, kind: str, median: float) -> dict:
    info = dict(impl=impl, kind=kind, workload="W1-model", dtype="float32", device="cpu",
                bytes_moved=3e9, bandwidth_gbs=10.0, roofline_seconds=0.3)
    return {"group": "W1-model", "stats": {"median": median}, "extra_info": info}
  path = tmp_path / "b.json"
  path.write_text(json.dumps({"benchmarks": [
      bench("lib.a", "library", 0.9), bench("lib.b", "library", 0.6), bench("own", "own", 0.4)]}))
  frame = roofline.summarize(path)
  assert list(frame["impl"]) == ["own", "lib.b", "lib.a"]
  own = frame.iloc[0]
  assert own["roofline_ratio"] == pytest.approx(0.4 / 0.3)
  assert own["gbs"] == pytest.approx(3e9 / 0.4 / 1e9)
  assert own["speedup_vs_best_library"] == pytest.approx(1.5)


# One CPU case per family, quick to compile (W1's 200 leaves take seconds to minutes of XLA
# compile under jax.jit); implementations not available here are skipped.
ASV_CASES = [
    ("global", "torch.clip_grad_norm_.foreach", "W4-many-small"),
    ("pnorm", "torch.clip_grad_norm_.foreach", "W1-model-p3"),
    ("max_step", "clipbench.numba", "W3-relax-large-max-step"),
    ("max_step", "clipbench.torch", "W2-relax-max-step"),
    ("per_system", "clipbench.jax", "W2-relax"),
    ("per_system", "baseline.jax-segment-sum", "W3-relax-large"),
    ("max_step", "baseline.torch-index-add", "W2-relax-max-step"),
]

_CPU_CLASSES = {
    "global": (bench_clipping.GlobalCpu, bench_clipping.GlobalCpuTrack),
    "pnorm": (bench_clipping.PNormCpu, bench_clipping.PNormCpuTrack),
    "per_system": (bench_clipping.PerSystemCpu, bench_clipping.PerSystemCpuTrack),
    "max_step": (bench_clipping.MaxStepCpu, bench_clipping.MaxStepCpuTrack),
}


def _setup_or_skip(instance, *args) -> None:
  try:
    instance.setup(*args)
  except NotImplementedError as e:  # SkipNotImplemented subclasses it
    pytest.skip(str(e))


@pytest.fixture
def tiny_run(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> dict:
  """What asv's setup_cache hands the benchmarks, at a tiny scale, in a scratch folder."""
  monkeypatch.setenv(grid_point.SCALE_ENV, str(TINY))
  # JAX opens its persistent cache once per process: keep the tests' programs out of ~/.cache.
  monkeypatch.setenv(grid_point.JAX_CACHE_ENV, str(tmp_path / "jax-cache"))
  # asv gives each grid point a fresh process; here the process caches must be emptied.
  for cache in (grid_point._LOADED, grid_point._INPUTS, grid_point._RECORDED):
    cache.clear()
  bw = bandwidth.measure_copy_bandwidth(nbytes=1 << 22, repeats=2)
  return {"bandwidth_bytes": bw, "run_dir": str(tmp_path / "run")}


@pytest.mark.parametrize("family,impl,workload", ASV_CASES)
def test_asv_classes_run_once(family: str, impl: str, workload: str, tiny_run: dict,
                              monkeypatch: pytest.MonkeyPatch) -> None:
  speed_cls, track_cls = _CPU_CLASSES[family]
  params = (impl, workload, "float32", "cpu")
  assert all(p in values for p, values in zip(params, speed_cls.params))
  speed = speed_cls()
  _setup_or_skip(speed, tiny_run, *params)
  speed.time_clip(tiny_run, *params)
  growth_after_call = grid_point.peak_rss_growth_bytes(speed.case.rss_after_import)
  speed.teardown(tiny_run, *params)  # records the Track figures, as after asv's reading
  speed.setup(tiny_run, *params)  # asv re-runs setup before each timed call
  speed.time_clip(tiny_run, *params)
  speed.teardown(tiny_run, *params)
  figures = grid_point.read_figures(tiny_run, *params)
  assert figures is not None and figures["median_seconds"] > 0 and figures["bytes_moved"] > 0
  assert figures["max_ulp_error"] >= 0
  # The peak memory is this process's above its RSS once the implementation was imported, read
  # once, after the timed call (memory this test process freed before may be reused: >= 0).
  growth_now = grid_point.peak_rss_growth_bytes(speed.case.rss_after_import)
  assert 0 <= growth_after_call <= figures["peak_rss_growth_bytes"] <= growth_now

  # The Track processes read the recorded figures without loading the implementation.
  track = track_cls()
  with monkeypatch.context() as m:
    m.setattr(grid_point, "load", None)
    m.setattr(grid_point, "load_or_skip", None)
    track.setup(tiny_run, *params)
    ratio = track.track_roofline_ratio(tiny_run, *params)
    ulp = track.track_max_ulp_error(tiny_run, *params)
    peak = track.track_peak_rss(tiny_run, *params)
  assert ratio == pytest.approx(bandwidth.roofline_ratio(
      figures["median_seconds"], figures["bytes_moved"], tiny_run["bandwidth_bytes"]))
  assert ulp == figures["max_ulp_error"]
  assert peak == figures["peak_rss_growth_bytes"]

  # Without recorded figures (no run folder) they measure by themselves, the same way.
  alone = {"bandwidth_bytes": tiny_run["bandwidth_bytes"], "run_dir": None}
  track = track_cls()
  track.setup(alone, *params)
  assert track.track_peak_rss(alone, *params) >= 0
  assert track.track_roofline_ratio(alone, *params) > 0
  assert track.track_max_ulp_error(alone, *params) == ulp  # fixed input: same bits
  machine = bench_clipping.Machine()
  assert machine.track_bandwidth_gbs(tiny_run) == pytest.approx(tiny_run["bandwidth_bytes"] / 1e9)


def test_speed_and_track_skips_are_shared(tiny_run: dict, monkeypatch: pytest.MonkeyPatch) -> None:
  # A reason found by loading (here: a dtype the implementation does not declare) is recorded
  # by the speed process, so the Track processes skip without loading anything.
  params = ("torch.clip_grad_norm_", "W4-many-small", "float32", "cpu")
  monkeypatch.setattr(timing, "load_case", lambda *a: (None, None, "not declared here"))
  with pytest.raises(NotImplementedError, match="not declared here"):
    bench_clipping.GlobalCpu().setup(tiny_run, *params)
  monkeypatch.setattr(timing, "load_case", None)
  with pytest.raises(NotImplementedError, match="not declared here"):
    bench_clipping.GlobalCpuTrack().setup(tiny_run, *params)


def test_asv_skips_cuda_without_gpu(tiny_run: dict, monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setattr(timing, "cuda_device_node_present", lambda: False)
  monkeypatch.setattr(timing, "load_case", None)  # decided without loading anything
  params = ("torch.clip_grad_norm_", "W1-model", "float32", "cuda")
  for cls in (bench_clipping.GlobalCuda, bench_clipping.GlobalCudaTrack):
    with pytest.raises(NotImplementedError, match="CUDA"):
      cls().setup(tiny_run, *params)


def test_static_skips(tiny_run: dict, monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setattr(timing, "load_case", None)  # every reason here is decided statically
  monkeypatch.delenv("JAX_ENABLE_X64", raising=False)
  monkeypatch.delenv(grid.SLOW_ENV, raising=False)
  with pytest.raises(NotImplementedError, match="JAX_ENABLE_X64"):
    bench_clipping.GlobalCpu().setup(
        tiny_run, "optax.clip_by_global_norm", "W1-model", "float64", "cpu")
  with pytest.raises(NotImplementedError, match=grid.SLOW_ENV):
    bench_clipping.GlobalCpuTrack().setup(
        tiny_run, "kups.ClipByGlobalNorm", "W4-many-small", "float32", "cpu")
  monkeypatch.setenv(grid.SLOW_ENV, "1")
  monkeypatch.setenv("JAX_ENABLE_X64", "true")
  assert grid.static_skip_reason("kups.ClipByGlobalNorm", "W4-many-small", "float64",
                                 "cpu") is None
  assert "cuda" in grid.static_skip_reason("clipbench.numba", "W2-relax", "float32", "cuda")


def test_grid_env_switches(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.delenv(grid.DTYPES_ENV, raising=False)
  assert grid.dtypes() == ("float32",)
  monkeypatch.setenv(grid.DTYPES_ENV, "all")
  assert grid.dtypes() == workloads.DTYPES
  monkeypatch.setenv(grid.DTYPES_ENV, "float64, float32")
  assert grid.dtypes() == ("float32", "float64")
  assert grid.params("max_step", "cpu")[2] == ["float32", "float64"]
  monkeypatch.setenv(grid.DTYPES_ENV, "int8")
  with pytest.raises(ValueError, match=grid.DTYPES_ENV):
    grid.dtypes()
  monkeypatch.setenv(grid.SLOW_ENV, "maybe")
  with pytest.raises(ValueError, match=grid.SLOW_ENV):
    grid.run_slow()
  for text, value in (("1", True), ("Yes", True), ("0", False), ("false", False)):
    monkeypatch.setenv("JAX_ENABLE_X64", text)
    assert grid.jax_x64_from_env() is value


@pytest.mark.parametrize("name,dtype", [("W2-relax", "bfloat16"), ("W1-model-pinf", "float64"),
                                        ("W4-many-small", "float32")])
def test_cached_inputs_round_trip(name: str, dtype: str, tmp_path: pathlib.Path) -> None:
  inputs = workloads.get(name).build(TINY, dtype)
  path = str(tmp_path / "inputs.npz")
  run_folder.save_inputs(path, inputs)
  again = run_folder.load_inputs(path, dtype)
  assert len(again.leaves) == len(inputs.leaves)
  for a, b in zip(inputs.leaves, again.leaves):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), np.ascontiguousarray(b).view(np.uint8))
  assert (again.threshold, again.norm_type, again.num_systems) == (
      inputs.threshold, inputs.norm_type, inputs.num_systems)
  if inputs.segments is None:
    assert again.segments is None
  else:
    for a, b in zip(inputs.segments, again.segments):
      np.testing.assert_array_equal(a, b)


def test_jax_compilation_cache_switch(tmp_path: pathlib.Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
  jax = pytest.importorskip("jax")
  monkeypatch.setenv(grid_point.JAX_CACHE_ENV, str(tmp_path / "jax"))
  assert grid_point.enable_jax_compilation_cache() == str(tmp_path / "jax")
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "jax")
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
  assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
  monkeypatch.delenv(grid_point.JAX_CACHE_ENV)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert grid_point.jax_cache_dir() == str(tmp_path / "xdg" / "clipbench" / "jax")


def test_asv_scale_switch(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.delenv(grid_point.SCALE_ENV, raising=False)
  assert grid_point.asv_scale() == 1.0
  monkeypatch.setenv(grid_point.SCALE_ENV, "nope")
  with pytest.raises(ValueError, match=grid_point.SCALE_ENV):
    grid_point.asv_scale()


def test_suite_import_loads_no_framework() -> None:
  # asv imports every module here to discover benchmarks (and its forkserver forks from that
  # process): no framework, hence no CUDA context, may be loaded before a benchmark's setup.
  code = ("import sys\n"
          "import clipbench.benchmarks.bench_clipping, clipbench.benchmarks.bench_workloads\n"
          "import clipbench.benchmarks.grid, clipbench.benchmarks.grid_point\n"
          "import clipbench.benchmarks.conftest, clipbench.benchmarks.roofline\n"
          "import clipbench.benchmarks.plain_clip\n"
          "print(','.join(m for m in ('torch', 'jax', 'tensorflow', 'triton', 'numba')"
          " if m in sys.modules))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == ""


def _venv_tool(name: str) -> str | None:
  local = pathlib.Path(sys.executable).parent / name
  return str(local) if local.exists() else shutil.which(name)


@pytest.mark.skipif(_venv_tool("asv") is None, reason="asv is not installed")
@pytest.mark.skipif(not (REPO / "asv.conf.json").exists(), reason="no asv.conf.json (installed)")
def test_asv_check_passes() -> None:
  out = subprocess.run([_venv_tool("asv"), "check", "--python=same"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "No problems found" in out.stdout


def test_pytest_benchmark_runner(tmp_path: pathlib.Path) -> None:
  json_path = tmp_path / "bench.json"
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(REPO / "benchmarks" / "bench_workloads.py"), "--bench-scale", str(TINY),
         "--bench-workload", "W4-many-small", "--bench-impl", "torch.clip_grad_norm_",
         "--bench-impl", "clipbench.torch", "--benchmark-min-rounds=2",
         "--benchmark-max-time=0.05", f"--benchmark-json={json_path}"]
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  data = json.loads(json_path.read_text())
  for bench in data["benchmarks"]:
    assert bench["group"] == "W4-many-small"
    assert {"impl", "workload", "dtype", "bytes_moved", "bandwidth_gbs",
            "roofline_seconds"} <= set(bench["extra_info"])
  if data["benchmarks"]:
    frame = roofline.summarize(json_path)
    assert set(frame["workload"]) == {"W4-many-small"}
