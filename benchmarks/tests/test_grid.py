"""The benchmark grid is derived from the registry, and the registry's facts are true.

``registry.Entry`` states, without importing anything, the framework, devices, timed
operation families and slow cases of every built-in implementation; the grid (and with it
every asv class) is built from those facts. Here they are held against what each loaded
implementation declares, and a toy library registered by one entry is shown to reach every
listing with nothing else edited.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types
from typing import Any

import numpy as np
import pytest

from clipbench.benchmarks import bench_clipping, grid, grid_point, timing, workloads
from clipbench.impls import registry


def test_grid_matches_workloads_and_registry() -> None:
  assert grid.ALL_DTYPES == workloads.DTYPES and grid.DEVICES == timing.DEVICES
  in_families = [w for f in grid.FAMILIES for w in f.workloads + f.gpu_workloads]
  assert sorted(in_families) == sorted(workloads.NAMES)  # each workload in exactly one family
  # The GPU-sized workloads (a CPU run needs a scale for them) are timed on CUDA only.
  assert sorted(w for f in grid.FAMILIES for w in f.gpu_workloads) == sorted(
      w.name for w in workloads.WORKLOADS if w.gpu_sized)
  assert grid.FAMILY_NAMES == registry.FAMILIES  # the registry names them, the grid fills them
  # Every built-in implementation is timed but the exact (and slow) reference and those whose
  # entry names no family (test_registry_facts_match_declared_capabilities: none they can run).
  assert list(grid.timed_impl_names()) == [
      e.name for e in registry.BUILTIN if e.kind != "reference" and e.families]
  assert [c.__name__ for c in bench_clipping.SPEED_CLASSES] == [
      name for name, *_ in bench_clipping.CLASSES]
  for speed, track in zip(bench_clipping.SPEED_CLASSES, bench_clipping.TRACK_CLASSES):
    assert track.__name__ == speed.__name__ + "Track" and track.params == speed.params
    impls, names, dtypes, devices = speed.params
    assert impls and names and dtypes == list(grid.dtypes()) and len(devices) == 1
    fam = grid.family_of(names[0])
    assert all(grid.family_of(w) == fam for w in names)
    for impl in impls:  # no dead points: the registry says each one can run on some machine
      entry = grid.entry(impl)
      assert fam in entry.families and devices[0] in entry.devices


@pytest.mark.parametrize("field,value", [("kind", "vendor"), ("framework", "mxnet"),
                                         ("devices", ("tpu",)),
                                         ("families", frozenset({"global", "sparse"})),
                                         ("tracked", True)])
def test_entry_rejects_unknown_facts(field: str, value: Any) -> None:
  entry = registry.Entry("toy", "toy:impl", "toy", "library", framework="numpy")
  with pytest.raises(ValueError, match=f"^{field}: .*toy"):
    dataclasses.replace(entry, **{field: value})


_ASV_ENV = (grid.IMPLS_ENV, grid.DTYPES_ENV, grid.SLOW_ENV, "JAX_ENABLE_X64")


@pytest.fixture
def default_asv_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
  """No switch of the asv grid set: the grid a plain ``asv run`` gets."""
  for name in _ASV_ENV:
    monkeypatch.delenv(name, raising=False)
  return monkeypatch


def test_default_asv_grid_is_the_tracked_entries(default_asv_env: pytest.MonkeyPatch) -> None:
  tracked = grid.tracked_impl_names()
  own = [e.name for e in registry.BUILTIN if e.kind == "own"]
  assert set(own) <= set(tracked)  # a tracker exists for our own regressions first
  # `clipbench bench` (and the report) keep the whole field: the default grid is a part of it.
  assert set(tracked) < set(grid.timed_impl_names())
  for family in grid.FAMILY_NAMES:
    for device in grid.DEVICES:
      impls = grid.params(family, device)[0]
      assert impls == [n for n in grid.impls_for(family, device) if n in tracked]


def test_asv_impls_switch(default_asv_env: pytest.MonkeyPatch) -> None:
  default_asv_env.setenv(grid.IMPLS_ENV, "all")
  assert grid.asv_impls() == grid.timed_impl_names()
  assert grid.params("global", "cpu")[0] == grid.impls_for("global", "cpu")
  default_asv_env.setenv(grid.IMPLS_ENV, " optax.clip_by_global_norm, clipbench.numba,,")
  assert grid.asv_impls() == ("clipbench.numba", "optax.clip_by_global_norm")  # registry order
  assert grid.params("global", "cpu")[0] == ["clipbench.numba", "optax.clip_by_global_norm"]
  assert grid.params("pnorm", "cpu")[0] == ["clipbench.numba"]
  assert grid.params("global", "cuda")[0] == []
  for text in ("clipbench.numba,toy.clip", ",", "reference"):
    default_asv_env.setenv(grid.IMPLS_ENV, text)
    with pytest.raises(ValueError, match=f"^{grid.IMPLS_ENV}: .*{text.split(',')[-1]}"):
      grid.asv_impls()


def test_asv_leaves_out_classes_without_points() -> None:
  # asv cannot check a class without parameter sets; the suite is imported in a process of its
  # own, as asv does, because the classes are made at import.
  code = ("from clipbench.benchmarks import bench_clipping as b\n"
          "print(' '.join(c.__name__ for c in b.SPEED_CLASSES + b.TRACK_CLASSES))\n"
          "print(hasattr(b, 'GlobalCuda'), hasattr(b, 'GlobalCudaTrack'))\n")
  env = dict(os.environ, **{grid.IMPLS_ENV: "optax.clip_by_global_norm"})
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       timeout=120, env=env)
  assert out.stdout.split("\n")[:2] == ["GlobalCpu GlobalCpuTrack", "False False"]


# What one asv run of the default grid may cost (issue 34): `asv check` plus `asv run
# --python=same --quick` within 10 minutes on 2 cores, from empty compilation caches (the
# measured run: README.md, Tracking across commits with asv). asv forks one process per point
# and metric from a server that imported the frameworks; those of a speed class load, compile
# and time the point, which is what a run costs; the others read what it recorded, and cost a
# fork. New metrics come out of this budget.
MAX_POINTS_PER_CLASS = 32
# CUDA: the GPU-sized workloads (W7, W8) add a point per tracked implementation of their
# family; a machine without a GPU skips every CUDA point statically (nothing loaded).
MAX_LOADING_PROCESSES = {"cpu": 100, "cuda": 64}
MAX_PROCESSES = 660  # the CUDA points of W7/W8 included: a static skip costs a fork


_ASV_PREFIXES = ("time_", "timeraw_", "mem_", "peakmem_", "track_")


def _metrics(cls: type) -> list[str]:
  """The asv benchmarks of a class: asv starts one process per point for each."""
  return [name for name in dir(cls) if name.startswith(_ASV_PREFIXES)]


def asv_run_size() -> tuple[dict[str, int], dict[str, int], int]:
  """Points per class, processes that load a point per device, and all processes of one
  ``asv run`` of this environment's grid, counted from the grid (asv is not run)."""
  speed_metrics = len(_metrics(bench_clipping.SPEED_CLASSES[0]))
  track_metrics = len(_metrics(bench_clipping.TRACK_CLASSES[0]))
  points_per_class: dict[str, int] = {}
  loading_processes = dict.fromkeys(grid.DEVICES, 0)
  processes = 1 + len(_metrics(bench_clipping.Machine))  # setup_cache and the machine's own
  for name, family, device, _ in bench_clipping.CLASSES:
    impls, names, dtypes, _ = grid.params(family, device)
    points = [(impl, w, dtype, device) for impl in impls for w in names for dtype in dtypes]
    points_per_class[name] = len(points)
    processes += len(points) * (speed_metrics + track_metrics)
    # A point skipped for a static reason loads nothing; the Track processes read the figures
    # its speed process recorded (test_benchmarks_smoke.test_asv_classes_run_once).
    loading = [p for p in points if grid.static_skip_reason(*p) is None]
    loading_processes[device] += len(loading) * speed_metrics
  return points_per_class, loading_processes, processes


def unpreloaded_frameworks() -> set[str]:
  """Frameworks of this run's implementations that asv's forkserver does not import: each of
  their processes pays for the import (numpy's implementations import numba, preloaded)."""
  chosen = set(grid.asv_impls())
  frameworks = {e.framework for e in grid.timed_entries() if e.name in chosen}
  return frameworks - {"numpy"} - set(grid_point.PRELOADED_MODULES)


def test_default_asv_grid_fits_a_ci_job(default_asv_env: pytest.MonkeyPatch) -> None:
  points_per_class, loading, processes = asv_run_size()
  assert max(points_per_class.values()) <= MAX_POINTS_PER_CLASS, points_per_class
  assert all(loading[d] <= MAX_LOADING_PROCESSES[d] for d in grid.DEVICES), loading
  assert processes <= MAX_PROCESSES
  assert unpreloaded_frameworks() == set()
  # The whole field is far beyond it: the budget is what keeps a new library out by default.
  default_asv_env.setenv(grid.IMPLS_ENV, "all")
  points_per_class, loading, processes = asv_run_size()
  assert max(points_per_class.values()) > MAX_POINTS_PER_CLASS
  assert loading["cpu"] > MAX_LOADING_PROCESSES["cpu"] and processes > MAX_PROCESSES
  assert "tensorflow" in unpreloaded_frameworks()


def _declared(name: str) -> Any:
  """The loaded implementation ``name``, or None when it cannot be loaded here.

  Triton needs a GPU or its interpreter; without a GPU it is loaded under the interpreter in a
  subprocess (the interpreter would leak into every other test here) and rebuilt from what it
  declares: framework, operations, capabilities.
  """
  impl = registry.load(name)
  if impl.available or name != "clipbench.triton":
    return impl if impl.available else None
  code = ("import dataclasses, json\n"
          "from clipbench.impls.registry import load\n"
          f"i = load({name!r})\n"
          "print(json.dumps([i.available, i.framework, i.ops,"
          " dataclasses.asdict(i.capabilities)]))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))
  if out.returncode != 0:
    return None
  available, framework, ops, caps = json.loads(out.stdout.strip().splitlines()[-1])
  if not available:
    return None
  from clipbench.protocol import as_capabilities
  obj = types.SimpleNamespace(**{op: (lambda *a, **k: None) for op in ops})
  return dataclasses.replace(impl, available=True, obj=obj, framework=framework,
                             capabilities=as_capabilities(caps))


def _families(impl: Any) -> set[str]:
  """The families whose every workload ``timing.skip_reason`` lets ``impl`` run.

  Asked for a dtype and a device the implementation declares: the entry states families;
  dtypes and devices are checked separately.
  """
  caps = impl.capabilities
  dtype = next(d for d in grid.ALL_DTYPES if d in caps.dtypes)
  device = "cpu" if "cpu" in caps.devices else caps.devices[0]
  return {fam.name for fam in grid.FAMILIES
          if all(timing.skip_reason(impl, workloads.get(w), dtype, device) is None
                 for w in fam.workloads)}


def check_entry_against_declared(entry: registry.Entry, impl: Any) -> None:
  """The entry's static facts agree with what the loaded ``impl`` declares."""
  framework, caps = impl.framework, impl.capabilities
  assert entry.framework == framework
  if impl.kind == "baseline":
    # A baseline is timed only where it is the bar (the baseline segment_sum: per-system).
    assert set(entry.families) <= _families(impl)
  else:
    assert set(entry.families) == _families(impl)
  devices = set(caps.devices)
  if entry.name == "clipbench.triton":
    devices.discard("cpu")  # the interpreter (tests only) is not a device to benchmark
  assert ("cpu" in devices) == ("cpu" in entry.devices)
  assert devices <= set(entry.devices)
  if "cuda" in entry.devices and "cuda" not in devices:
    assert not timing.cuda_device_node_present(), (
        f"{entry.name} declares no cuda on a GPU machine")
  # Every grid dtype is declared, but float64 for JAX, which declares it exactly with x64 on
  # (the static skip assumes so).
  expected = set(grid.ALL_DTYPES)
  if framework == "jax":
    import jax
    assert ("float64" in caps.dtypes) == bool(jax.config.jax_enable_x64)
    expected.discard("float64")
  # A grid dtype the implementation lacks must be a clean skip where the grid reaches it.
  for dtype in expected - set(caps.dtypes):
    for family in entry.families:
      for w in grid.family(family).workloads:
        assert timing.skip_reason(impl, workloads.get(w), dtype, "cpu") is not None
  assert entry.slow_workloads <= {w for f in entry.families for w in grid.family(f).workloads}


@pytest.mark.parametrize("name", [e.name for e in registry.BUILTIN if e.kind != "reference"])
def test_registry_facts_match_declared_capabilities(name: str) -> None:
  impl = _declared(name)
  if impl is None:
    pytest.skip(f"{name} cannot be loaded here")
  check_entry_against_declared(next(e for e in registry.BUILTIN if e.name == name), impl)


class _ToyClip:
  """A library's global clipping in plain numpy: as small as an adapter gets."""

  framework = "numpy"
  capabilities = {"dtypes": ("float32", "bfloat16", "float64")}

  def clip_grad_norm(self, leaves: list[np.ndarray], max_norm: float, *,
                     norm_type: float = 2.0) -> tuple[list[np.ndarray], np.ndarray]:
    total = np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in leaves))
    scale = min(1.0, max_norm / total) if total > 0 else 1.0
    return [(x * scale).astype(x.dtype) for x in leaves], np.asarray(total)


TOY = registry.Entry("toy.clip_grad_norm", "toy_clipping:implementation", "toy-clipping",
                     "library", "a toy library", framework="numpy",
                     families=frozenset({"global"}))


@pytest.fixture
def toy_registered(monkeypatch: pytest.MonkeyPatch, tmp_path) -> registry.Entry:
  """The toy adapter (a module) and its one registry entry; nothing else is touched."""
  module = types.ModuleType("toy_clipping")
  module.implementation = _ToyClip()
  monkeypatch.setitem(sys.modules, "toy_clipping", module)
  monkeypatch.setattr(registry, "BUILTIN", registry.BUILTIN + (TOY,))
  monkeypatch.setenv(grid_point.SCALE_ENV, "0.001")
  for cache in (grid_point._LOADED, grid_point._INPUTS, grid_point._RECORDED):
    cache.clear()
  return TOY


def test_one_entry_adds_a_library_everywhere(toy_registered: registry.Entry,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
  name = toy_registered.name
  assert name in [e.name for e in registry.all_entries()]  # what `clipbench list` walks
  listed = {impl.name: impl for impl in registry.load_many([name])}
  assert listed[name].available and listed[name].ops == ("clip_grad_norm",)
  assert registry.load(name).kind == "library" == registry.kind_of(name)
  assert name in grid.timed_impl_names()  # `clipbench bench` times it by default
  monkeypatch.delenv(grid.IMPLS_ENV, raising=False)
  assert name not in grid.params("global", "cpu")[0]  # asv's default grid: tracked entries
  monkeypatch.setenv(grid.IMPLS_ENV, "all")
  assert name in grid.params("global", "cpu")[0]
  assert all(name not in grid.params(f, d)[0] for f in grid.FAMILY_NAMES for d in grid.DEVICES
             if (f, d) != ("global", "cpu"))
  check_entry_against_declared(toy_registered, listed[name])
  # An asv grid point of it runs: loaded, timed, its figures recorded for the Track metrics.
  run = {"bandwidth_bytes": 1e10, "run_dir": None}
  speed = bench_clipping.GlobalCpu()
  speed.setup(run, name, "W4-many-small", "float32", "cpu")
  speed.time_clip(run, name, "W4-many-small", "float32", "cpu")
  assert speed.case.impl.name == name
  assert grid_point.ulp_error({}, name, "W4-many-small", "float32", "cpu") <= 1.0


def test_declared_facts_check_catches_a_wrong_entry(toy_registered: registry.Entry) -> None:
  impl = registry.load(toy_registered.name)
  for wrong in (dict(framework="torch"), dict(families=frozenset({"global", "pnorm"})),
                dict(devices=("cuda",)), dict(slow=(("W2-relax", "not its family"),))):
    with pytest.raises(AssertionError):
      check_entry_against_declared(dataclasses.replace(toy_registered, **wrong), impl)
