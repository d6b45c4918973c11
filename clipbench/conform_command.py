"""``clipbench conform``: the conformance suite in a pytest child, its results table promoted.

The exit status is pytest's: 0 exactly when every case passes or is a listed deviation, so it
can gate a library's own CI. ``clipbench report`` runs the suite through :func:`run_conform`.
With ``--jobs N`` each implementation runs in a child of its own, N at a time (many cores, one
card), and their tables are joined into one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, Sequence

from clipbench import child_run, devices, loading, options, outputs
from clipbench.errors import EXIT_FAILED, note


@dataclasses.dataclass(frozen=True)
class SuiteOptions:
  """What ``conform`` and ``report`` pass on to the conformance suite besides ``--impl``."""

  ops: tuple[str, ...] = ()
  profile: str | None = None
  deviations: tuple[str, ...] = ()  # the user's own deviation files, added to the built-in list
  timeout_s: float | None = None  # per call
  device: devices.Device = devices.HOST  # where every call runs
  budget_s: float | None = None  # seconds of tests per implementation
  jobs: int = 1  # pytest children at once, one implementation each when more than one


def suite_options(args: argparse.Namespace, ops: Sequence[str] = ()) -> SuiteOptions:
  """The suite's options from the command line, each checked (a usage error names it)."""
  return SuiteOptions(ops=tuple(ops), profile=options.profile(args.profile, args.quick),
                      deviations=options.deviation_files(args.deviations),
                      timeout_s=options.timeout(args.timeout),
                      device=options.device(args.device),
                      budget_s=options.seconds("--budget", args.budget),
                      jobs=options.jobs(args.jobs))


def conformance_dir() -> str:
  """The installed conformance suite (what pytest is pointed at)."""
  import clipbench.conformance
  return os.path.dirname(os.path.abspath(clipbench.conformance.__file__))


def check_ops_provided(impls: Sequence[Any], ops: Sequence[str]) -> None:
  """Each operation of ``--ops`` must be one that every implementation named by ``--impl``
  provides: a run that would silently test nothing for one of them is a usage error."""
  for impl in impls:
    lacking = [op for op in ops if op not in impl.ops]
    if lacking:
      raise options.lacking_operations(impl, lacking)


def pytest_command(impls: Sequence[str], suite: SuiteOptions, results_path: str,
                   extra: Sequence[str]) -> list[str]:
  """The pytest command line of a suite run writing its table to ``results_path``."""
  cmd = [sys.executable, "-m", "pytest", conformance_dir(), "-p", "no:cacheprovider", "-q"]
  for spec in impls:
    cmd += ["--impl", spec]
  if suite.ops:
    cmd += ["--ops", ",".join(suite.ops)]
  if suite.profile:
    cmd += ["--profile", suite.profile]
  for path in suite.deviations:
    cmd += ["--deviations", os.path.abspath(path)]
  if suite.timeout_s is not None:
    # The suite's own name for it: --timeout belongs to pytest-timeout where that is installed.
    cmd += ["--clipbench-timeout", f"{suite.timeout_s:g}"]
  if suite.device != devices.HOST:
    cmd += ["--device", str(suite.device)]
  if suite.budget_s is not None:
    cmd += ["--budget", f"{suite.budget_s:g}"]
  return cmd + ["--results", results_path, *extra]


def env_defaults(device: devices.Device = devices.HOST) -> dict[str, str]:
  """On the host the Triton kernels can only run through Triton's interpreter, as in
  ``make test``; on a GPU they run compiled, and the frameworks share the card
  (``devices.environment``)."""
  if device.is_host:
    return {"TRITON_INTERPRET": "1"}
  return devices.environment(device, dict(os.environ))


def side_by_side_impls(impls: Sequence[str], device: devices.Device) -> list[str]:
  """The implementations of a ``--jobs`` run, one child each: those named, else every
  available one whose framework reaches ``device``."""
  if impls:
    return list(impls)
  every = loading.load_all(progress=False)
  loading.mark_off_device(every, device)
  return [impl.name for impl in every if impl.available]


def _run_children(impls: Sequence[str], suite: SuiteOptions, tmp: str, results_path: str,
                  extra: Sequence[str], incomplete: list[str]) -> int:
  """The suite in one child, or one child per implementation (``suite.jobs`` > 1) whose tables
  are joined at ``tmp``. Side by side, a child that did not complete (a crash, an internal
  error) is named in ``incomplete`` and fails the run (status 1) without losing the others'
  results; alone, its own exit status is returned."""
  if suite.jobs == 1:
    return child_run.run_pytest(pytest_command(impls, suite, tmp, extra), "conformance",
                                outputs.log_path(results_path),
                                env_defaults=env_defaults(suite.device),
                                shown_paths={tmp: results_path})
  import pandas as pd
  names = side_by_side_impls(impls, suite.device)
  folder = os.path.dirname(tmp)
  tables = [os.path.join(folder, f"part-{i}.csv") for i in range(len(names))]
  logs = [f"{os.path.splitext(results_path)[0]}-{name.replace(':', '_')}.log" for name in names]
  statuses = child_run.run_side_by_side(
      [pytest_command([name], suite, table, extra) for name, table in zip(names, tables)], logs,
      suite.jobs, env_defaults=env_defaults(suite.device),
      shown_paths={table: results_path for table in tables})
  for name, rc, log in zip(names, statuses, logs):
    if rc not in (0, 1):
      incomplete.append(f"{name} (pytest exit status {rc}; {log})")
      note(f"the conformance run of {name} did not complete (pytest exit status {rc}); its "
           f"results are left out: see {log}")
  written = [t for t in tables if os.path.exists(t)]
  if written:
    joined = pd.concat([pd.read_csv(t, dtype=str, keep_default_na=False) for t in written])
    from clipbench import files
    files.write_csv(tmp, joined)
  return 1 if incomplete else max(statuses, default=0)


def run_conform(impls: Sequence[str], suite: SuiteOptions, results_path: str,
                extra: Sequence[str], incomplete: list[str] | None = None) -> int:
  """Runs the suite; promotes its results table over ``results_path`` only if it is sound.
  ``incomplete`` receives the implementations whose side-by-side run did not complete."""
  from clipbench.reports import results
  with outputs.staged(results_path) as tmp:
    rc = _run_children(impls, suite, tmp, results_path, extra,
                       [] if incomplete is None else incomplete)
    if rc not in (0, 1):
      note(f"conformance run did not complete (pytest exit status {rc}); "
           f"{results_path} left as it was")
      return rc
    if not os.path.exists(tmp):
      note(f"the conformance suite wrote no results table; {results_path} left as it was")
      return rc if rc else EXIT_FAILED
    try:
      table = results.read_conformance(tmp)
    except results.ResultsError as e:
      note(f"the new results table is unreadable, {results_path} left as it was: {e}")
      return EXIT_FAILED
    os.replace(tmp, results_path)
  counts = table["outcome"].value_counts()
  print(f"results: {results_path} ({len(table)} rows: " +
        ", ".join(f"{n} {o}" for o, n in counts.items()) + ")")
  return rc


def conform_command(args: argparse.Namespace) -> int:
  """``clipbench conform [--impl NAME]... [options] [-- pytest args]``."""
  ops = options.operations(args.ops)
  suite = suite_options(args, ops)
  requested = loading.load_requested(args.impl, require_available=True)
  check_ops_provided(requested, ops)
  options.device_reachable(requested, suite.device)
  outputs.check_writable(outputs.folder_of(args.results), "--results")
  return run_conform(args.impl, suite, args.results, args.pytest_args)
