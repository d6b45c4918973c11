"""The ``clipbench`` command: which implementation to trust, which is fastest, and the evidence.

Subcommands (one module each):

* ``list`` (:mod:`clipbench.listing`): every implementation with its availability (and why
  not), version, framework, operations and declared capabilities (``--json`` for machines).
* ``conform`` (:mod:`clipbench.conform_command`): the conformance suite (``pytest`` over
  ``clipbench.conformance``); its exit status is pytest's, 0 exactly when every case passes or
  is a listed deviation.
* ``bench`` (:mod:`clipbench.bench_command`): the shared workloads under pytest-benchmark, then
  one table per workload with each timing's spread and conformance verdict.
* ``report`` (:mod:`clipbench.report_command`): runs both and the safe-range scan (or reuses
  fresh results) and writes ``reports/<stamp>/`` and ``reports/latest/``: index.html,
  REPORT.md and the raw tables.

``--device cpu[:N]|cuda[:N]`` (``conform``, ``bench``, ``report``) is where the calls run
(:mod:`clipbench.devices`); ``--jobs`` and ``--budget`` (``conform``, ``report``) run the
implementations side by side and bound each one's tests, which the GPU report
(``clipbench.benchmarks.gpu_check``) uses to fit a short run.

Raw results go to ``results/`` (relative to the working directory): ``conformance.csv``,
``safe_range.csv`` and ``benchmarks.json``, each staged beside its final path and swapped in
only once complete (:mod:`clipbench.outputs`); every output folder is checked for writability
before any work starts. The pytest runs (and the scan) are children of this process
(:mod:`clipbench.child_run`).

Exit status: 0 success; 1 a run failed (for ``conform``: pytest's own status, 1 = some case
fails); 2 a usage error: unknown implementation or workload, an operation an implementation
lacks, a library requested by name that is unavailable here, a bad option, a ``--device`` this
machine lacks (``cuda`` without an NVIDIA GPU) or that an implementation named cannot reach, an
output folder that cannot be written, reused results that lack a requested implementation, an
unreadable or corrupt results file; 130 interrupted (Ctrl-C).

An outside implementation is named ``package.module:attr``; the working directory is on the
import path (as with ``python -m``), for this process and the pytest runs it starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Sequence

from clipbench.bench_command import bench_command
from clipbench.conform_command import conform_command
from clipbench.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, RunFailed, UsageError, note
from clipbench.listing import list_command
from clipbench.options import PROFILES, QUICK_SCALE
from clipbench.outputs import BENCHMARK_FILE, CONFORMANCE_FILE, DEFAULT_RESULTS_DIR
from clipbench.report_command import DEFAULT_REUSE_HOURS, report_command

DEFAULT_REPORTS_DIR = "reports"
DEFAULT_ASV_RESULTS = os.path.join(".asv", "results")


def _add_impl(parser: argparse.ArgumentParser, help_text: str) -> None:
  parser.add_argument("--impl", action="append", default=[], metavar="NAME|module:attr",
                      help=help_text + " (repeatable; default: all)")


def _subcommand(sub: Any, formatter: Any, name: str, run: Callable[[argparse.Namespace], int],
                *, impl_help: str, passthrough: bool, **texts: str) -> argparse.ArgumentParser:
  """The parser of subcommand ``name`` (``texts``: its help and description), which ``run``
  runs, with its ``--impl``; ``passthrough``: it takes pytest arguments after ``--``."""
  parser = sub.add_parser(name, formatter_class=formatter, **texts)
  _add_impl(parser, impl_help)
  parser.set_defaults(func=run, passthrough=passthrough)
  return parser


def _add_suite_options(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--profile", choices=PROFILES, help="conformance hypothesis profile "
                                                          "(suite default: ci)")
  parser.add_argument("--deviations", action="append", default=[], metavar="FILE",
                      help="your own expected-deviation file (TOML), added to clipbench's list "
                           "(repeatable)")
  parser.add_argument("--timeout", type=float, metavar="SECONDS",
                      help="per call: a call still running after SECONDS is recorded as an "
                           "error naming its case, and the suite moves on")
  _add_device(parser, "where every call runs: inputs built on the host are moved there in "
                      "the implementation's framework, and its outputs must stay there")
  parser.add_argument("--budget", type=float, metavar="SECONDS",
                      help="per implementation: once its tests have taken SECONDS, its "
                           "remaining cases are not run (recorded as not applicable, saying "
                           "so); its cases run round-robin over the rules")
  parser.add_argument("--jobs", type=int, default=1, metavar="N",
                      help="run each implementation's suite in a process of its own, N at a "
                           "time (default: %(default)s, one process for all)")


def _add_device(parser: argparse.ArgumentParser, what: str) -> None:
  parser.add_argument("--device", default="cpu", metavar="cpu[:N]|cuda[:N]",
                      help=f"{what} (default: %(default)s; cuda is JAX's and TensorFlow's gpu; "
                           "cpu:1 is a second JAX host device)")


def _add_results_file(parser: argparse.ArgumentParser, option: str, file_name: str,
                      what: str) -> None:
  parser.add_argument(option, default=os.path.join(DEFAULT_RESULTS_DIR, file_name),
                      metavar="PATH", help=f"{what} (default: %(default)s)")


def _add_list(sub: Any, formatter: Any) -> None:
  """``clipbench list``."""
  p = _subcommand(sub, formatter, "list", list_command, passthrough=False,
                  impl_help="only these implementations",
                  help="implementations, availability, versions, capabilities")
  p.add_argument("--json", action="store_true", help="machine-readable output")


def _add_conform(sub: Any, formatter: Any) -> None:
  """``clipbench conform``."""
  p = _subcommand(
      sub, formatter, "conform", conform_command, passthrough=True,
      impl_help="implementation to check",
      help="run the conformance suite (exit 0 iff all pass or are listed deviations)",
      description="Runs the conformance suite; arguments after `--` go to pytest "
                  "(e.g. `clipbench conform -- -k rule3 -x`).")
  p.add_argument("--ops", metavar="OP[,OP]", help="only these operations")
  p.add_argument("--quick", action="store_true", help="short run: the ci profile")
  _add_suite_options(p)
  _add_results_file(p, "--results", CONFORMANCE_FILE, "results table (CSV)")


def _add_bench(sub: Any, formatter: Any) -> None:
  """``clipbench bench``."""
  p = _subcommand(
      sub, formatter, "bench", bench_command, passthrough=True,
      impl_help="implementation to time",
      help="time the shared workloads against the roofline (pytest-benchmark)",
      description="Runs the benchmark workloads; arguments after `--` go to pytest. Each "
                  "timing is shown with the conformance verdict of the last `clipbench "
                  f"conform` run ({os.path.join(DEFAULT_RESULTS_DIR, CONFORMANCE_FILE)}).")
  p.add_argument("--workload", action="append", default=[], metavar="NAME",
                 help="workload to run (repeatable; default: all)")
  p.add_argument("--ops", metavar="OP[,OP]", help="only the workloads of these operations")
  p.add_argument("--quick", action="store_true",
                 help=f"short run: workloads at scale {QUICK_SCALE}, fewer rounds")
  p.add_argument("--scale", type=float, help="workload scale (1.0 = the stated sizes)")
  p.add_argument("--device", default="cpu", metavar="cpu|cuda",
                 help="where the workloads are timed (default: %(default)s)")
  _add_results_file(p, "--json", BENCHMARK_FILE, "pytest-benchmark JSON output")


def _add_report(sub: Any, formatter: Any) -> None:
  """``clipbench report``."""
  p = _subcommand(
      sub, formatter, "report", report_command, passthrough=False,
      impl_help="implementation to include",
      help="run conform and bench (or reuse results) and write the report",
      description="Runs the conformance suite, the safe-range scan and the benchmarks (or "
                  "reuses fresh results with --reuse), then writes DIR/<date>/ and DIR/latest/ "
                  "(index.html, REPORT.md, "
                  "CSV tables). Exit status 0 once the report is written, even when an "
                  "implementation fails conformance (the report shows which); `clipbench "
                  "conform` is the CI gate.")
  p.add_argument("--quick", action="store_true",
                 help=f"short runs (ci profile, workloads at scale {QUICK_SCALE})")
  _add_suite_options(p)
  p.add_argument("--scale", type=float, help="benchmark workload scale (1.0 = stated sizes)")
  p.add_argument("--out", default=DEFAULT_REPORTS_DIR, metavar="DIR",
                 help="reports folder: DIR/<date>/ and DIR/latest/ (default: %(default)s)")
  p.add_argument("--latest", default="latest", metavar="NAME",
                 help="the folder in DIR that gets a copy of the newest report (default: "
                      "%(default)s; the GPU report: latest-gpu)")
  p.add_argument("--reuse", nargs="?", type=float, const=DEFAULT_REUSE_HOURS, metavar="HOURS",
                 help="reuse results files younger than HOURS (default "
                      f"{DEFAULT_REUSE_HOURS:g}) instead of running again")
  p.add_argument("--results-dir", default=DEFAULT_RESULTS_DIR, metavar="DIR",
                 help="raw results folder (default: %(default)s)")
  p.add_argument("--asv-results", default=DEFAULT_ASV_RESULTS, metavar="DIR",
                 help="asv results folder for the history (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
  """The whole command line; each subcommand sets ``func`` (what runs it) and ``passthrough``
  (whether it takes pytest arguments after ``--``)."""
  try:
    from rich_argparse import RichHelpFormatter as formatter
  except ImportError:
    formatter = argparse.RawDescriptionHelpFormatter
  parser = argparse.ArgumentParser(
      prog="clipbench", formatter_class=formatter,
      description="Conformance suite and benchmark for update-clipping operations.",
      epilog="Exit status: 0 ok, 1 a run failed (conform: pytest's status), 2 usage error, "
             "130 interrupted.")
  from clipbench import __version__
  parser.add_argument("--version", action="version", version=f"clipbench {__version__}")
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  _add_list(sub, formatter)
  _add_conform(sub, formatter)
  _add_bench(sub, formatter)
  _add_report(sub, formatter)
  return parser


def _run(func: Any, args: argparse.Namespace) -> int:
  """Runs a subcommand, turning how it ended into the exit status (and a one-line note)."""
  from clipbench.reports.results import ResultsError
  try:
    return func(args)
  except (UsageError, ResultsError) as e:
    note(f"error: {e}")
    return EXIT_USAGE
  except RunFailed as e:
    note(f"error: {e}")
    return e.code or EXIT_FAILED
  except KeyboardInterrupt:
    note("interrupted; results and reports left as they were")
    return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  own, passthrough = argv, []
  if "--" in argv:
    cut = argv.index("--")
    own, passthrough = argv[:cut], argv[cut + 1:]
  parser = build_parser()
  try:
    args = parser.parse_args(own)
  except SystemExit as e:  # argparse reports bad options itself (exit 2) and --help (exit 0)
    return e.code if isinstance(e.code, int) else EXIT_USAGE
  if passthrough and not args.passthrough:
    parser.print_usage(sys.stderr)
    note(f"error: {args.command} takes no pytest arguments after `--`")
    return EXIT_USAGE
  args.pytest_args = passthrough
  args.argv = argv
  return _run(args.func, args)


if __name__ == "__main__":
  sys.exit(main())
