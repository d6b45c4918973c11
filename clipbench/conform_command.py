"""``clipbench conform``: the conformance suite in a pytest child, its results table promoted.

The exit status is pytest's: 0 exactly when every case passes or is a listed deviation, so it
can gate a library's own CI. ``clipbench report`` runs the suite through :func:`run_conform`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, Sequence

from clipbench import child_run, loading, options, outputs
from clipbench.errors import EXIT_FAILED, note


@dataclasses.dataclass(frozen=True)
class SuiteOptions:
  """What ``conform`` and ``report`` pass on to the conformance suite besides ``--impl``."""

  ops: tuple[str, ...] = ()
  profile: str | None = None
  deviations: tuple[str, ...] = ()  # the user's own deviation files, added to the built-in list
  timeout_s: float | None = None  # per call


def suite_options(args: argparse.Namespace, ops: Sequence[str] = ()) -> SuiteOptions:
  """The suite's options from the command line, each checked (a usage error names it)."""
  return SuiteOptions(ops=tuple(ops), profile=options.profile(args.profile, args.quick),
                      deviations=options.deviation_files(args.deviations),
                      timeout_s=options.timeout(args.timeout))


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
  return cmd + ["--results", results_path, *extra]


def env_defaults() -> dict[str, str]:
  """Without a GPU the Triton kernels can only run through Triton's interpreter, as in
  ``make test``; with one they run compiled on CUDA tensors."""
  from clipbench.benchmarks import timing
  return {} if timing.cuda_device_node_present() else {"TRITON_INTERPRET": "1"}


def run_conform(impls: Sequence[str], suite: SuiteOptions, results_path: str,
                extra: Sequence[str]) -> int:
  """Runs the suite; promotes its results table over ``results_path`` only if it is sound."""
  from clipbench.reports import results
  with outputs.staged(results_path) as tmp:
    cmd = pytest_command(impls, suite, tmp, extra)
    rc = child_run.run_pytest(cmd, "conformance", outputs.log_path(results_path),
                              env_defaults=env_defaults(), shown_paths={tmp: results_path})
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
  check_ops_provided(loading.load_requested(args.impl, require_available=True), ops)
  outputs.check_writable(outputs.folder_of(args.results), "--results")
  return run_conform(args.impl, suite, args.results, args.pytest_args)
