"""``clipbench bench``: the shared workloads under pytest-benchmark, then one table per workload.

The benchmark JSON is promoted over the previous one only after a clean run that timed
something; the tables (:mod:`clipbench.bench_table`) put each timing beside the conformance
verdict of its implementation. ``clipbench report`` times through :func:`run_bench`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Sequence

from clipbench import bench_table, child_run, devices, loading, options, outputs
from clipbench.errors import EXIT_FAILED, EXIT_OK, UsageError, note

QUICK_BENCH_OPTIONS = ("--benchmark-max-time=0.2", "--benchmark-min-rounds=3")
DEFAULT_CONFORMANCE_RESULTS = os.path.join(outputs.DEFAULT_RESULTS_DIR, outputs.CONFORMANCE_FILE)


def bench_module() -> str:
  """The installed pytest-benchmark module that times the workloads."""
  import clipbench.benchmarks
  path = os.path.join(os.path.dirname(os.path.abspath(clipbench.benchmarks.__file__)),
                      "bench_workloads.py")
  if not os.path.isfile(path):
    raise UsageError(f"benchmark module not found: {path} (is clipbench fully installed?)")
  return path


def pytest_command(impls: Sequence[str], workload_names: Sequence[str], scale: float | None,
                   quick: bool, json_path: str, extra: Sequence[str],
                   device: devices.Device = devices.HOST) -> list[str]:
  """The pytest command line of a benchmark run writing its JSON to ``json_path``."""
  cmd = [sys.executable, "-m", "pytest", bench_module(), "-p", "no:cacheprovider", "-q",
         "--benchmark-quiet", f"--benchmark-json={json_path}"]
  for spec in impls:
    cmd += ["--bench-impl", spec]
  for name in workload_names:
    cmd += ["--bench-workload", name]
  if scale is not None:
    cmd += ["--bench-scale", repr(scale)]
  if device != devices.HOST:
    cmd += ["--bench-device", str(device)]
  if quick:
    cmd += list(QUICK_BENCH_OPTIONS)
  return cmd + list(extra)


def bench_device(text: str) -> devices.Device:
  """``bench --device``: the first device of a kind (the workloads are timed on ``cpu`` or
  ``cuda``, as the asv grid's classes are)."""
  device = options.device(text)
  if device.index:
    raise UsageError(f"--device {device}: the benchmarks run on cpu or cuda (the first device "
                     "of each kind)")
  return device


def run_bench(impls: Sequence[str], workload_names: Sequence[str], scale: float | None,
              quick: bool, json_path: str, extra: Sequence[str], *,
              conformance_path: str = DEFAULT_CONFORMANCE_RESULTS,
              device: devices.Device = devices.HOST) -> int:
  """Runs the benchmarks; promotes the JSON over ``json_path`` only after a clean run, then
  prints the tables with the verdicts of the results table at ``conformance_path``."""
  from clipbench.reports import results
  with outputs.staged(json_path) as tmp:
    cmd = pytest_command(impls, workload_names, scale, quick, tmp, extra, device)
    env = {} if device.is_host else devices.environment(device, dict(os.environ))
    rc = child_run.run_pytest(cmd, "benchmarks", outputs.log_path(json_path),
                              env_defaults=env, shown_paths={tmp: json_path})
    if rc != 0:
      note(f"benchmark run failed (pytest exit status {rc}); {json_path} left as it was")
      return rc
    try:
      run = results.read_benchmarks(tmp)
    except results.ResultsError as e:
      note(f"the new benchmark file is unreadable, {json_path} left as it was: {e}")
      return EXIT_FAILED
    if run.frame.empty:
      note(f"no benchmark ran (every case was skipped); {json_path} left as it was")
      return EXIT_FAILED
    os.replace(tmp, json_path)
  bench_table.print_performance(run, bench_table.conformance_verdicts(conformance_path))
  print(f"results: {json_path} ({len(run.frame)} benchmarks)")
  return EXIT_OK


def workloads_of_ops(names: Sequence[str], ops: Sequence[str],
                     impls: Sequence[Any]) -> list[str]:
  """The workloads to run: those named (or all) that exercise one of ``ops``. Each op needs a
  workload, and each implementation named must run every op's workloads: with the op itself,
  or as the benchmarks do (``clip_grad_norm`` workloads through a global
  ``clip_by_global_norm``)."""
  if not ops:
    return list(names)
  from clipbench.benchmarks import timing, workloads
  selected = [workloads.get(name) for name in (names or workloads.NAMES)]
  for op in ops:
    of_op = [w for w in selected if w.op == op]
    if not of_op:
      raise UsageError(f"--ops: no {'--workload given' if names else 'workload'} exercises {op}")
    for impl in impls:
      if not any(timing.resolve_op(impl, w) for w in of_op):
        raise options.lacking_operations(impl, [op])
  return [w.name for w in selected if w.op in ops]


def bench_command(args: argparse.Namespace) -> int:
  """``clipbench bench [--impl NAME]... [--workload NAME]... [options] [-- pytest args]``."""
  scale = options.scale(args.scale, args.quick)
  ops = options.operations(args.ops)
  device = bench_device(args.device)
  impls = loading.load_requested(args.impl, require_available=True)
  options.device_reachable(impls, device)
  names = workloads_of_ops(options.workload_names(args.workload), ops, impls)
  outputs.check_writable(outputs.folder_of(args.json), "--json")
  return run_bench(args.impl, names, scale, args.quick, args.json, args.pytest_args,
                   device=device)
