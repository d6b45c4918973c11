"""The ``clipbench`` command: which implementation to trust, which is fastest, and the evidence.

Subcommands:

* ``list``: every implementation with its availability (and why not), version, framework,
  operations and declared capabilities (``--json`` for machines).
* ``conform``: the conformance suite (``pytest`` over ``clipbench.conformance``); its exit
  status is pytest's, 0 exactly when every case passes or is a listed deviation.
* ``bench``: the shared workloads under pytest-benchmark, then the roofline summary.
* ``report``: runs both (or reuses fresh results) and writes ``reports/<stamp>/`` and
  ``reports/latest/``: index.html, REPORT.md and the raw tables as CSV.

Raw results go to ``results/`` (relative to the working directory): ``conformance.csv`` and
``benchmarks.json``. Each run writes to a temporary file that replaces the previous results only
once the run completed and the new file reads back correctly: a crashed run never spoils good
results.

Exit status: 0 success; 1 a run failed (for ``conform``: pytest's own status, 1 = some case
fails); 2 a usage error: unknown implementation or workload, a library requested by name that
is unavailable here, a bad option, an unreadable or corrupt results file.

An outside implementation is named ``package.module:attr``; the working directory is on the
import path (as with ``python -m``), for this process and the pytest runs it starts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator, Sequence

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
PROFILES = ("ci", "thorough")
QUICK_SCALE = 0.02  # of every workload (W1: 335k elements; W3: 400 systems)
QUICK_BENCH_OPTIONS = ("--benchmark-max-time=0.2", "--benchmark-min-rounds=3")
DEFAULT_RESULTS_DIR = "results"
DEFAULT_REPORTS_DIR = "reports"
DEFAULT_ASV_RESULTS = os.path.join(".asv", "results")
CONFORMANCE_FILE = "conformance.csv"
BENCHMARK_FILE = "benchmarks.json"
DEFAULT_REUSE_HOURS = 24.0
PROGRESS_ENV = "CLIPBENCH_PROGRESS_FILE"


class UsageError(Exception):
  """A problem with what the user asked for; reported as ``clipbench: error: ...``, exit 2."""


# --- pytest progress plugin ------------------------------------------------------------------
# The pytest runs this command starts load this module as a plugin (``-p clipbench.cli``);
# these hooks append one line per collected session and finished test to the file named by
# CLIPBENCH_PROGRESS_FILE, which the parent turns into a progress bar. Inert without it.

def _progress_line(line: str) -> None:
  path = os.environ.get(PROGRESS_ENV)
  if path:
    with open(path, "a", encoding="utf-8") as f:
      f.write(line + "\n")


def pytest_collection_finish(session: Any) -> None:
  _progress_line(f"total {len(session.items)}")


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:  # pylint: disable=unused-argument
  _progress_line("done " + nodeid)


# --- running pytest --------------------------------------------------------------------------

def _interactive() -> bool:
  return sys.stdout.isatty()


def _child_env(defaults: dict[str, str] | None = None) -> dict[str, str]:
  """The environment of a pytest run: the working directory on PYTHONPATH (outside impls),
  and ``defaults`` where the caller's environment does not set them."""
  env = {**(defaults or {}), **os.environ}
  paths = [os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
  env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
  return env


def _summary_tail(log: str, limit: int = 40) -> str:
  """What pytest printed after its short summary header (or its last lines)."""
  lines = log.rstrip().splitlines()
  for i, line in enumerate(lines):
    if "short test summary info" in line:
      lines = lines[i:]
      break
  return "\n".join(lines[-limit:])


def run_pytest(cmd: Sequence[str], label: str, log_path: str, *,
               progress: bool | None = None, env_defaults: dict[str, str] | None = None) -> int:
  """Runs ``cmd``; with a terminal, behind a progress bar (full output to ``log_path``).

  ``env_defaults`` are set in the run's environment unless the caller's already sets them.
  """
  progress = _interactive() if progress is None else progress
  env = _child_env(env_defaults)
  if not progress:
    print("$ " + shlex.join(cmd), flush=True)
    return subprocess.run(cmd, env=env, check=False).returncode
  from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                             TextColumn, TimeElapsedColumn)
  os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
  with tempfile.TemporaryDirectory() as tmp:
    events = os.path.join(tmp, "progress")
    env[PROGRESS_ENV] = events
    cmd = [*cmd, "-p", "clipbench.cli"]
    with open(log_path, "w", encoding="utf-8") as log, Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), transient=False) as bar:
      task = bar.add_task(f"{label} (collecting)", total=None)
      log.write("$ " + shlex.join(cmd) + "\n")
      log.flush()
      proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
      offset = 0
      while True:
        finished = proc.poll() is not None
        offset = _advance(bar, task, label, events, offset)
        if finished:
          break
        time.sleep(0.2)
    with open(log_path, encoding="utf-8", errors="replace") as f:
      print(_summary_tail(f.read()))
  print(f"full output: {log_path}")
  return proc.returncode


def _advance(bar: Any, task: Any, label: str, events: str, offset: int) -> int:
  try:
    with open(events, "rb") as f:
      f.seek(offset)
      chunk = f.read()
  except FileNotFoundError:
    return offset
  complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits for next time
  for line in complete.decode("utf-8", errors="replace").splitlines():
    kind, _, value = line.partition(" ")
    if kind == "total":
      bar.update(task, total=int(value), description=label)
    elif kind == "done":
      bar.advance(task)
  return offset + len(complete)


# --- implementations -------------------------------------------------------------------------

def _with_cwd_on_path() -> None:
  # The console script's sys.path lacks the working directory, unlike `python -m`; outside
  # implementations named module:attr must resolve the same way in both.
  if os.getcwd() not in sys.path and "" not in sys.path:
    sys.path.insert(0, os.getcwd())


def load_requested(specs: Sequence[str], *, require_available: bool) -> list[Any]:
  """Loads each ``--impl``; unknown ones (and unavailable ones, if required) are usage errors."""
  from clipbench.impls import registry
  _with_cwd_on_path()
  impls = []
  for spec in specs:
    try:
      impl = registry.load(spec)
    except ValueError as e:
      raise UsageError(str(e)) from None
    except Exception as e:  # pylint: disable=broad-except
      # An outside module that raises on import is the user's to fix; say so plainly.
      raise UsageError(f"impl {spec!r}: loading failed: {type(e).__name__}: {e}") from None
    if require_available and not impl.available:
      raise UsageError(f"impl {spec!r} is unavailable here: {impl.reason}")
    impls.append(impl)
  return impls


def load_all(progress: bool | None = None) -> list[Any]:
  """Every registered implementation (unavailable ones with their reason), with a progress bar."""
  from clipbench.impls import registry
  entries = registry.all_entries()
  progress = _interactive() if progress is None else progress
  iterator: Any = entries
  if progress:
    from rich.progress import track
    iterator = track(entries, description="loading implementations", transient=True)
  impls = []
  for entry in iterator:
    try:
      impls.append(registry.load_entry(entry))
    except ValueError as e:  # a registered object that does not speak the protocol
      impls.append(registry.Implementation(name=entry.name, target=entry.target,
                                           kind=entry.kind, library=entry.library,
                                           reason=str(e)))
  return impls


def describe(impl: Any) -> dict[str, Any]:
  """An implementation as plain JSON-able data (p = inf as the string "inf": strict JSON)."""
  caps = dataclasses.asdict(impl.capabilities)
  if isinstance(caps["norm_types"], (list, tuple)):
    caps["norm_types"] = [p if math.isfinite(p) else str(p) for p in caps["norm_types"]]
  return {"name": impl.name, "target": impl.target, "kind": impl.kind, "library": impl.library,
          "available": impl.available, "reason": impl.reason, "version": impl.version,
          "framework": impl.framework, "ops": list(impl.ops),
          "capabilities": caps if impl.available else None,
          "capabilities_summary": impl.capabilities.summary() if impl.available else "",
          "description": impl.description}


def _console() -> Any:
  from rich.console import Console
  # Piped output is read by people in logs too: do not squeeze tables into 80 columns.
  return Console(width=None if _interactive() else 200, highlight=False)


def cmd_list(args: argparse.Namespace) -> int:
  impls = (load_requested(args.impl, require_available=False) if args.impl else load_all())
  rows = [describe(i) for i in impls]
  if args.json:
    print(json.dumps(rows, indent=2, default=str))
    return EXIT_OK
  from rich.table import Table
  table = Table(title="clipbench implementations", show_lines=False)
  for column in ("implementation", "kind", "available", "version", "framework", "ops",
                 "capabilities"):
    table.add_column(column, overflow="fold")
  for r in rows:
    available = "[green]yes[/]" if r["available"] else f"[red]no[/]: {r['reason']}"
    table.add_row(r["name"], r["kind"], available, r["version"] or "-", r["framework"] or "-",
                  ", ".join(r["ops"]) or "-", r["capabilities_summary"] or "-")
  _console().print(table)
  return EXIT_OK


# --- conform ---------------------------------------------------------------------------------

def _ops(text: str | None) -> list[str]:
  if not text:
    return []
  from clipbench.protocol import OPS
  ops = [op.strip() for op in text.split(",") if op.strip()]
  unknown = [op for op in ops if op not in OPS]
  if unknown or not ops:
    raise UsageError(f"--ops: unknown operation(s) {', '.join(unknown) or repr(text)}; "
                     f"expected a comma-separated subset of {', '.join(OPS)}")
  return ops


def conformance_dir() -> str:
  import clipbench.conformance
  return os.path.dirname(os.path.abspath(clipbench.conformance.__file__))


def conform_command(impls: Sequence[str], ops: Sequence[str], profile: str | None,
                    results_path: str, extra: Sequence[str]) -> list[str]:
  cmd = [sys.executable, "-m", "pytest", conformance_dir(), "-p", "no:cacheprovider", "-q"]
  for spec in impls:
    cmd += ["--impl", spec]
  if ops:
    cmd += ["--ops", ",".join(ops)]
  if profile:
    cmd += ["--profile", profile]
  return cmd + ["--results", results_path, *extra]


@contextlib.contextmanager
def _staged(final_path: str, suffix: str) -> Iterator[str]:
  """A temporary path beside ``final_path`` for a run's output; removed unless promoted."""
  folder = os.path.dirname(os.path.abspath(final_path)) or "."
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(final_path) + ".", suffix=suffix,
                             dir=folder)
  os.close(fd)
  os.unlink(tmp)  # the run must create it: an empty leftover would look like a result
  try:
    yield tmp
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)


def _profile(args: argparse.Namespace) -> str | None:
  if args.quick and args.profile == "thorough":
    raise UsageError("--quick runs the ci profile; it contradicts --profile thorough")
  return "ci" if args.quick else args.profile


def _conformance_env_defaults() -> dict[str, str]:
  """Without a GPU the Triton kernels can only run through Triton's interpreter, as in
  ``make test``; with one they run compiled on CUDA tensors."""
  from clipbench.benchmarks import cases
  return {} if cases.cuda_device_node_present() else {"TRITON_INTERPRET": "1"}


def run_conform(impls: Sequence[str], ops: Sequence[str], profile: str | None,
                results_path: str, extra: Sequence[str]) -> int:
  """Runs the suite; promotes its results table over ``results_path`` only if it is sound."""
  from clipbench import files
  from clipbench.reports import results
  with _staged(results_path, ".csv.tmp") as tmp:
    cmd = conform_command(impls, ops, profile, tmp, extra)
    log = os.path.splitext(results_path)[0] + ".log"
    rc = run_pytest(cmd, "conformance", log, env_defaults=_conformance_env_defaults())
    if rc not in (0, 1):
      _note(f"conformance run did not complete (pytest exit status {rc}); "
            f"{results_path} left as it was")
      return rc
    if not os.path.exists(tmp):
      _note(f"the conformance suite wrote no results table; {results_path} left as it was")
      return rc if rc else EXIT_FAILED
    try:
      table = results.read_conformance(tmp)
    except results.ResultsError as e:
      _note(f"the new results table is unreadable, {results_path} left as it was: {e}")
      return EXIT_FAILED
    os.replace(tmp, results_path)
  counts = table["outcome"].value_counts()
  print(f"results: {results_path} ({len(table)} rows: " +
        ", ".join(f"{n} {o}" for o, n in counts.items()) + ")")
  return rc


def cmd_conform(args: argparse.Namespace) -> int:
  ops = _ops(args.ops)
  profile = _profile(args)
  load_requested(args.impl, require_available=True)
  return run_conform(args.impl, ops, profile, args.results, args.pytest_args)


# --- bench -----------------------------------------------------------------------------------

def bench_module() -> str:
  import clipbench.benchmarks
  path = os.path.join(os.path.dirname(os.path.abspath(clipbench.benchmarks.__file__)),
                      "bench_workloads.py")
  if not os.path.isfile(path):
    raise UsageError(f"benchmark module not found: {path} (is clipbench fully installed?)")
  return path


def _workloads(names: Sequence[str]) -> list[str]:
  if not names:
    return []
  from clipbench.benchmarks import workloads
  for name in names:
    try:
      workloads.get(name)
    except ValueError as e:
      raise UsageError(str(e)) from None
  return list(names)


def _scale(args: argparse.Namespace) -> float | None:
  if args.scale is not None:
    if not (args.scale > 0 and args.scale < float("inf")):
      raise UsageError(f"--scale: expected a positive number, got {args.scale}")
    return args.scale
  return QUICK_SCALE if args.quick else None


def bench_command(impls: Sequence[str], workload_names: Sequence[str], scale: float | None,
                  quick: bool, json_path: str, extra: Sequence[str]) -> list[str]:
  cmd = [sys.executable, "-m", "pytest", bench_module(), "-p", "no:cacheprovider", "-q",
         "--benchmark-quiet", f"--benchmark-json={json_path}"]
  for spec in impls:
    cmd += ["--bench-impl", spec]
  for name in workload_names:
    cmd += ["--bench-workload", name]
  if scale is not None:
    cmd += ["--bench-scale", repr(scale)]
  if quick:
    cmd += list(QUICK_BENCH_OPTIONS)
  return cmd + list(extra)


def run_bench(impls: Sequence[str], workload_names: Sequence[str], scale: float | None,
              quick: bool, json_path: str, extra: Sequence[str]) -> int:
  """Runs the benchmarks; promotes the JSON over ``json_path`` only after a clean run."""
  from clipbench import files
  from clipbench.reports import results
  with _staged(json_path, ".json.tmp") as tmp:
    cmd = bench_command(impls, workload_names, scale, quick, tmp, extra)
    rc = run_pytest(cmd, "benchmarks", os.path.splitext(json_path)[0] + ".log")
    if rc != 0:
      _note(f"benchmark run failed (pytest exit status {rc}); {json_path} left as it was")
      return rc
    try:
      run = results.read_benchmarks(tmp)
    except results.ResultsError as e:
      _note(f"the new benchmark file is unreadable, {json_path} left as it was: {e}")
      return EXIT_FAILED
    if run.frame.empty:
      _note(f"no benchmark ran (every case was skipped); {json_path} left as it was")
      return EXIT_FAILED
    os.replace(tmp, json_path)
  print_performance(run.summary)
  print(f"results: {json_path} ({len(run.frame)} benchmarks)")
  return EXIT_OK


def print_performance(performance: Any) -> None:
  from rich.table import Table
  from clipbench.reports.build import fmt_number, fmt_seconds
  table = Table(title="median time and roofline ratio (1 = memory bound; lower is better)")
  for column in ("workload", "dtype", "device", "implementation", "kind", "median", "GB/s",
                 "roofline ratio", "vs fastest library"):
    table.add_column(column, justify="right" if column in (
        "median", "GB/s", "roofline ratio", "vs fastest library") else "left")
  previous = None
  for r in performance.itertuples():
    if previous is not None and (r.workload, r.dtype, r.device) != previous:
      table.add_section()
    previous = (r.workload, r.dtype, r.device)
    table.add_row(r.workload, r.dtype, r.device, r.impl, r.kind, fmt_seconds(r.median_s),
                  fmt_number(r.gbs), fmt_number(r.roofline_ratio),
                  fmt_number(r.speedup_vs_best_library, 3, "x"))
  _console().print(table)


def cmd_bench(args: argparse.Namespace) -> int:
  scale = _scale(args)
  names = _workloads(args.workload)
  load_requested(args.impl, require_available=True)
  return run_bench(args.impl, names, scale, args.quick, args.json, args.pytest_args)


# --- report ----------------------------------------------------------------------------------

def _age_hours(path: str) -> float:
  return (time.time() - os.path.getmtime(path)) / 3600.0


def _fresh(path: str, reuse_hours: float | None) -> bool:
  return reuse_hours is not None and os.path.isfile(path) and _age_hours(path) <= reuse_hours


def _file_fact(path: str, what: str) -> str:
  stamp = datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc)
  return f"`{path}` ({what}, written {stamp:%Y-%m-%d %H:%M UTC})"


def cmd_report(args: argparse.Namespace) -> int:
  from clipbench.reports import build, results
  if args.reuse is not None and not args.reuse >= 0:
    raise UsageError(f"--reuse: expected a number of hours >= 0, got {args.reuse}")
  profile = _profile(args)
  scale = _scale(args)
  requested = load_requested(args.impl, require_available=True)
  conf_path = os.path.join(args.results_dir, CONFORMANCE_FILE)
  bench_path = os.path.join(args.results_dir, BENCHMARK_FILE)
  facts = [("Command", "`" + shlex.join(["clipbench", *args.argv]) + "`")]

  if _fresh(conf_path, args.reuse):
    print(f"reusing {conf_path} ({_age_hours(conf_path):.1f} h old)")
  else:
    rc = run_conform(args.impl, [], profile, conf_path, [])
    if rc not in (0, 1):
      raise RunFailed("conformance", rc)
  conformance = results.read_conformance(conf_path)
  facts.append(("Conformance results", _file_fact(conf_path, f"{len(conformance)} cases")))

  if _fresh(bench_path, args.reuse):
    print(f"reusing {bench_path} ({_age_hours(bench_path):.1f} h old)")
  else:
    rc = run_bench(args.impl, [], scale, args.quick, bench_path, [])
    if rc != 0:
      raise RunFailed("benchmark", rc)
  bench = results.read_benchmarks(bench_path)
  facts.append(("Benchmark results", _file_fact(bench_path, f"{len(bench.frame)} benchmarks")))

  history = results.read_asv_history(args.asv_results)
  if not history.empty:
    facts.append(("asv results", f"`{args.asv_results}` ({history['commit'].nunique()} commits)"))
  listing = requested if args.impl else load_all()
  listing_frame = _listing_frame(listing)
  sources = build.Sources(conformance=conformance, conformance_path=conf_path, benchmarks=bench,
                          asv_history=history, implementations=listing_frame,
                          run_facts=tuple(facts))
  if args.impl:
    sources = build.only_impls(sources, [i.name for i in requested])
  missing = [i.name for i in requested if i.name not in set(sources.conformance["impl"])]
  if missing:
    _note(f"no conformance results for {', '.join(missing)} in {conf_path}")
  now = datetime.datetime.now(datetime.timezone.utc)
  report = build.build(sources, generated=now)
  folder = build.write(report, args.out, now.strftime(build.STAMP_FORMAT))
  latest = os.path.join(args.out, build.LATEST)
  print(f"report: {os.path.join(folder, 'index.html')}")
  print(f"        {os.path.join(latest, 'index.html')} and REPORT.md (latest)")
  failing = int(sources.conformance["outcome"].isin(["fail", "error", "unexpected-pass"]).sum())
  if failing:
    _note(f"{failing} conformance case(s) fail; see the report's matrix and catalogue")
  return EXIT_OK


def _listing_frame(impls: Sequence[Any]) -> Any:
  import pandas as pd
  rows = [describe(i) for i in impls]
  return pd.DataFrame([{**r, "capabilities": r["capabilities_summary"]} for r in rows],
                      columns=["name", "kind", "available", "reason", "version", "framework",
                               "ops", "capabilities"])


class RunFailed(Exception):
  def __init__(self, what: str, code: int) -> None:
    super().__init__(f"the {what} run failed (exit status {code}); no report written")
    self.code = code


# --- argument parsing ------------------------------------------------------------------------

def _note(message: str) -> None:
  print(f"clipbench: {message}", file=sys.stderr, flush=True)


def _add_impl(parser: argparse.ArgumentParser, help_text: str) -> None:
  parser.add_argument("--impl", action="append", default=[], metavar="NAME|module:attr",
                      help=help_text + " (repeatable; default: all)")


def build_parser() -> argparse.ArgumentParser:
  try:
    from rich_argparse import RichHelpFormatter as formatter
  except ImportError:
    formatter = argparse.RawDescriptionHelpFormatter
  parser = argparse.ArgumentParser(
      prog="clipbench", formatter_class=formatter,
      description="Conformance suite and benchmark for update-clipping operations.",
      epilog="Exit status: 0 ok, 1 a run failed (conform: pytest's status), 2 usage error.")
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

  p = sub.add_parser("list", help="implementations, availability, versions, capabilities",
                     formatter_class=formatter)
  _add_impl(p, "only these implementations")
  p.add_argument("--json", action="store_true", help="machine-readable output")
  p.set_defaults(func=cmd_list, passthrough=False)

  p = sub.add_parser(
      "conform", formatter_class=formatter,
      help="run the conformance suite (exit 0 iff all pass or are listed deviations)",
      description="Runs the conformance suite; arguments after `--` go to pytest "
                  "(e.g. `clipbench conform -- -k rule3 -x`).")
  _add_impl(p, "implementation to check")
  p.add_argument("--ops", metavar="OP[,OP]", help="only these operations")
  p.add_argument("--profile", choices=PROFILES, help="hypothesis profile (suite default: ci)")
  p.add_argument("--quick", action="store_true", help="short run: the ci profile")
  p.add_argument("--results", default=os.path.join(DEFAULT_RESULTS_DIR, CONFORMANCE_FILE),
                 metavar="PATH", help="results table (CSV; default: %(default)s)")
  p.set_defaults(func=cmd_conform, passthrough=True)

  p = sub.add_parser(
      "bench", formatter_class=formatter,
      help="time the shared workloads against the roofline (pytest-benchmark)",
      description="Runs the benchmark workloads; arguments after `--` go to pytest.")
  _add_impl(p, "implementation to time")
  p.add_argument("--workload", action="append", default=[], metavar="NAME",
                 help="workload to run (repeatable; default: all)")
  p.add_argument("--quick", action="store_true",
                 help=f"short run: workloads at scale {QUICK_SCALE}, fewer rounds")
  p.add_argument("--scale", type=float, help="workload scale (1.0 = the stated sizes)")
  p.add_argument("--json", default=os.path.join(DEFAULT_RESULTS_DIR, BENCHMARK_FILE),
                 metavar="PATH", help="pytest-benchmark JSON output (default: %(default)s)")
  p.set_defaults(func=cmd_bench, passthrough=True)

  p = sub.add_parser(
      "report", formatter_class=formatter,
      help="run conform and bench (or reuse results) and write the report",
      description="Runs the conformance suite and the benchmarks (or reuses fresh results with "
                  "--reuse), then writes DIR/<date>/ and DIR/latest/ (index.html, REPORT.md, "
                  "CSV tables). Exit status 0 once the report is written, even when an "
                  "implementation fails conformance (the report shows which); `clipbench "
                  "conform` is the CI gate.")
  _add_impl(p, "implementation to include")
  p.add_argument("--quick", action="store_true",
                 help=f"short runs (ci profile, workloads at scale {QUICK_SCALE})")
  p.add_argument("--profile", choices=PROFILES, help="conformance hypothesis profile")
  p.add_argument("--scale", type=float, help="benchmark workload scale (1.0 = stated sizes)")
  p.add_argument("--out", default=DEFAULT_REPORTS_DIR, metavar="DIR",
                 help="reports folder: DIR/<date>/ and DIR/latest/ (default: %(default)s)")
  p.add_argument("--reuse", nargs="?", type=float, const=DEFAULT_REUSE_HOURS, metavar="HOURS",
                 help="reuse results files younger than HOURS (default "
                      f"{DEFAULT_REUSE_HOURS:g}) instead of running again")
  p.add_argument("--results-dir", default=DEFAULT_RESULTS_DIR, metavar="DIR",
                 help="raw results folder (default: %(default)s)")
  p.add_argument("--asv-results", default=DEFAULT_ASV_RESULTS, metavar="DIR",
                 help="asv results folder for the history (default: %(default)s)")
  p.set_defaults(func=cmd_report, passthrough=False)
  return parser


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
    _note(f"error: {args.command} takes no pytest arguments after `--`")
    return EXIT_USAGE
  args.pytest_args = passthrough
  args.argv = argv
  from clipbench.reports.results import ResultsError
  try:
    return args.func(args)
  except (UsageError, ResultsError) as e:
    _note(f"error: {e}")
    return EXIT_USAGE
  except RunFailed as e:
    _note(f"error: {e}")
    return e.code or EXIT_FAILED
  except KeyboardInterrupt:
    _note("interrupted")
    return 130


if __name__ == "__main__":
  sys.exit(main())
