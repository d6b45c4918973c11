"""``clipbench report``: runs the suite and the benchmarks (or reuses fresh results), then
writes ``OUT/<stamp>/`` and ``OUT/latest/`` (index.html, REPORT.md and the raw tables).

A report never leaves out an implementation the user named: results without it stop the
command before anything is written. The exit status is 0 once the report is written, even when
an implementation fails conformance (the report shows which); ``clipbench conform`` is the gate.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import time
from typing import Any, Sequence

from clipbench import (bench_command, conform_command, listing, loading, options, outputs,
                       safe_range_run)
from clipbench.errors import EXIT_FAILED, EXIT_OK, RunFailed, UsageError, note

DEFAULT_REUSE_HOURS = 24.0


def _age_hours(path: str) -> float:
  return (time.time() - os.path.getmtime(path)) / 3600.0


def _fresh(path: str, reuse_hours: float | None) -> bool:
  return reuse_hours is not None and os.path.isfile(path) and _age_hours(path) <= reuse_hours


def _file_fact(path: str, what: str) -> str:
  stamp = datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc)
  return f"`{path}` ({what}, written {stamp:%Y-%m-%d %H:%M UTC})"


def _check_results_cover(requested: Sequence[Any], conformance: Any, path: str, *,
                         reused: bool) -> None:
  """A report never leaves out an implementation the user named: results without it stop the
  report (a usage error when they were reused, saying what to run) before anything is written."""
  missing = [i.name for i in requested if i.name not in set(conformance["impl"])]
  if not missing:
    return
  names = ", ".join(missing)
  if reused:
    impl_args = " ".join(f"--impl {shlex.quote(name)}" for name in missing)
    raise UsageError(f"--reuse: {path} has no conformance results for {names}; run "
                     f"`clipbench report {impl_args}` without --reuse, or give --results-dir "
                     f"a folder whose results include it")
  raise RunFailed("conformance", EXIT_FAILED, f"it wrote no results for {names}")


def report_command(args: argparse.Namespace) -> int:
  """``clipbench report [--impl NAME]... [--reuse [HOURS]] [options]``."""
  from clipbench.reports import build, results
  if args.reuse is not None and not args.reuse >= 0:
    raise UsageError(f"--reuse: expected a number of hours >= 0, got {args.reuse}")
  if not args.latest or os.sep in args.latest or args.latest in (".", "..") or (
      args.latest[0].isdigit()):
    raise UsageError(f"--latest: expected a folder name (not a path, not starting with a "
                     f"digit, as the dated folders do), got {args.latest!r}")
  suite = conform_command.suite_options(args)
  if suite.device.index:
    raise UsageError(f"--device {suite.device}: a report runs on cpu or cuda (the first device "
                     "of each kind), where the benchmarks are timed; conform takes any device")
  scale = options.scale(args.scale, args.quick)
  requested = loading.load_requested(args.impl, require_available=True)
  options.device_reachable(requested, suite.device)
  conf_path = os.path.join(args.results_dir, outputs.CONFORMANCE_FILE)
  bench_path = os.path.join(args.results_dir, outputs.BENCHMARK_FILE)
  range_path = os.path.join(args.results_dir, outputs.SAFE_RANGE_FILE)
  facts = [("Command", "`" + shlex.join(["clipbench", *args.argv]) + "`"),
           ("Device", str(suite.device))]
  reuse_conformance = _fresh(conf_path, args.reuse)
  reuse_bench = _fresh(bench_path, args.reuse)
  reuse_ranges = _fresh(range_path, args.reuse)
  outputs.check_writable(args.out, "--out")
  if not (reuse_conformance and reuse_bench and reuse_ranges):
    outputs.check_writable(args.results_dir, "--results-dir")

  if reuse_conformance:
    print(f"reusing {conf_path} ({_age_hours(conf_path):.1f} h old)")
  else:
    incomplete: list[str] = []
    rc = conform_command.run_conform(args.impl, suite, conf_path, [], incomplete)
    if rc not in (0, 1):
      raise RunFailed("conformance", rc)
    if incomplete:  # side by side: the others' results stand, and the report says which not
      facts.append(("Conformance runs that did not complete", "; ".join(incomplete)))
  conformance = results.read_conformance(conf_path)
  _check_results_cover(requested, conformance, conf_path, reused=reuse_conformance)
  facts.append(("Conformance results", _file_fact(conf_path, f"{len(conformance)} cases")))

  if reuse_ranges:
    print(f"reusing {range_path} ({_age_hours(range_path):.1f} h old)")
  else:
    rc = safe_range_run.run_safe_range(
        conform_command.side_by_side_impls(args.impl, suite.device) if suite.jobs > 1
        else args.impl, suite.profile, range_path, conform_command.env_defaults(suite.device),
        device=suite.device, jobs=suite.jobs)
    if rc != 0:
      raise RunFailed("safe-range scan", rc)
  safe_range = results.read_safe_range(range_path)
  facts.append(("Safe-range scan", _file_fact(range_path, f"{len(safe_range)} points")))

  if reuse_bench:
    print(f"reusing {bench_path} ({_age_hours(bench_path):.1f} h old)")
  else:
    rc = bench_command.run_bench(args.impl, [], scale, args.quick, bench_path, [],
                                 conformance_path=conf_path, device=suite.device)
    if rc != 0:
      raise RunFailed("benchmark", rc)
  bench = results.read_benchmarks(bench_path)
  facts.append(("Benchmark results", _file_fact(bench_path, f"{len(bench.frame)} benchmarks")))

  history = results.read_asv_history(args.asv_results)
  if not history.empty:
    facts.append(("asv results", f"`{args.asv_results}` ({history['commit'].nunique()} commits)"))
  listed = requested if args.impl else loading.load_all()
  loading.mark_off_device(listed, suite.device)  # the listing says which could not run there
  sources = build.Sources(conformance=conformance, conformance_path=conf_path, benchmarks=bench,
                          asv_history=history, implementations=listing.listing_frame(listed),
                          safe_range=safe_range,
                          run_facts=tuple(facts))
  if args.impl:
    sources = build.only_impls(sources, [i.name for i in requested])
    untimed = [i.name for i in requested if i.name not in set(bench.frame["impl"])]
    if untimed:
      note(f"no timings for {', '.join(untimed)} in {bench_path} (never timed, or skipped)")
  now = datetime.datetime.now(datetime.timezone.utc)
  report = build.build(sources, generated=now)
  folder = build.write(report, args.out, now.strftime(build.STAMP_FORMAT), args.latest)
  latest = os.path.join(args.out, args.latest)
  print(f"report: {os.path.join(folder, 'index.html')}")
  print(f"        {os.path.join(latest, 'index.html')} and REPORT.md (latest)")
  failing = int(sources.conformance["outcome"].isin(["fail", "error", "unexpected-pass"]).sum())
  if failing:
    note(f"{failing} conformance case(s) fail; see the report's matrix and catalogue")
  return EXIT_OK
