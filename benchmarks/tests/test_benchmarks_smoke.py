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

from clipbench.benchmarks import accuracy, bandwidth, bench_clipping, cases, roofline, workloads

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = 0.001


def _system_norms(inputs: workloads.Inputs) -> np.ndarray:
  sq = np.zeros(inputs.num_systems)
  for leaf, seg in zip(inputs.leaves, inputs.segments):
    rows = np.sum(leaf.reshape(leaf.shape[0], -1).astype(np.float64) ** 2, axis=1)
    sq += np.bincount(seg, weights=rows, minlength=inputs.num_systems)
  return np.sqrt(sq)


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
    assert counts.min() >= 10 and counts.max() <= 500
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


def test_full_size_shapes() -> None:
  model = workloads.get("W1-model").build(1.0)
  assert len(model.leaves) == 200 and model.num_elements == 2**24
  sizes = sorted(x.size for x in model.leaves)
  assert sizes[-1] > 20 * sizes[len(sizes) // 2]  # log-normal: a long tail of large leaves
  small = workloads.get("W4-many-small").build(1.0)
  assert len(small.leaves) == 10_000 and {x.shape for x in small.leaves} == {(100,)}
  assert workloads.get("W3-relax-large").builder(TINY, "float32", 3).num_systems == 20
  assert workloads.get("W2-relax-max-step").op == "clip_by_max_step"


def test_unknown_names_are_rejected() -> None:
  with pytest.raises(ValueError, match="W1-model"):
    workloads.get("W9")
  with pytest.raises(ValueError, match="dtype"):
    workloads.numpy_dtype("int8")
  with pytest.raises(ValueError, match="scale"):
    workloads.get("W4-many-small").build(0.0)


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


# Cases that compile quickly (W1 has 200 leaves: minutes of XLA compile for jitted JAX);
# implementations not available yet are skipped.
ASV_CASES = [
    ("torch.clip_grad_norm_", "W4-many-small"),
    ("clipbench.numba", "W3-relax-large-max-step"),
    ("clipbench.torch", "W2-relax-max-step"),
    ("clipbench.jax", "W2-relax"),
]


def _setup_or_skip(instance, *args) -> None:
  try:
    instance.setup(*args)
  except NotImplementedError as e:  # SkipNotImplemented subclasses it
    pytest.skip(str(e))


@pytest.mark.parametrize("impl,workload", ASV_CASES)
def test_asv_classes_run_once(impl: str, workload: str, monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setenv(bench_clipping.SCALE_ENV, str(TINY))
  params = (impl, workload, "float32", "cpu")
  clip = bench_clipping.Clip()
  _setup_or_skip(clip, *params)
  clip.time_clip(*params)
  clip.peakmem_clip(*params)
  bw = bandwidth.measure_copy_bandwidth(nbytes=1 << 22, repeats=2)
  ratio = bench_clipping.Roofline()
  ratio.setup(bw, *params)
  assert ratio.track_roofline_ratio(bw, *params) > 0
  acc = bench_clipping.Accuracy()
  _setup_or_skip(acc, *params)
  assert acc.track_max_ulp_error(*params) >= 0
  assert bench_clipping.Machine().track_bandwidth_gbs(bw) == pytest.approx(bw / 1e9)


def test_asv_skips_cuda_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setattr(cases, "cuda_device_node_present", lambda: False)
  with pytest.raises(NotImplementedError, match="CUDA"):
    bench_clipping.Clip().setup("torch.clip_grad_norm_", "W1-model", "float32", "cuda")


def test_asv_scale_switch(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.delenv(bench_clipping.SCALE_ENV, raising=False)
  assert bench_clipping.asv_scale() == 1.0
  monkeypatch.setenv(bench_clipping.SCALE_ENV, "nope")
  with pytest.raises(ValueError, match=bench_clipping.SCALE_ENV):
    bench_clipping.asv_scale()


def test_suite_import_loads_no_framework() -> None:
  # asv imports every module here to discover benchmarks (and its forkserver forks from that
  # process): no framework, hence no CUDA context, may be loaded before a benchmark's setup.
  code = ("import sys\n"
          "import clipbench.benchmarks.bench_clipping, clipbench.benchmarks.bench_workloads\n"
          "import clipbench.benchmarks.conftest, clipbench.benchmarks.roofline\n"
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
