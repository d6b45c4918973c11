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
``benchmarks.json``. Each run writes into a hidden temporary folder beside them whose result
replaces the previous file only once the run completed and the new file reads back correctly;
the folder goes, whatever happens (Ctrl-C included): an interrupted or crashed run never spoils
good results nor leaves temporary files behind. Every output folder is checked for writability
before any work starts.

Exit status: 0 success; 1 a run failed (for ``conform``: pytest's own status, 1 = some case
fails); 2 a usage error: unknown implementation or workload, an operation an implementation
lacks, a library requested by name that is unavailable here, a bad option, an output folder
that cannot be written, reused results that lack a requested implementation, an unreadable or
corrupt results file; 130 interrupted (Ctrl-C).

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
import re
import shlex
import signal
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
EXIT_INTERRUPTED = 130  # the shell's convention: 128 + SIGINT
# After Ctrl-C: how long the pytest child gets to stop by itself (the terminal sent it the same
# SIGINT), then after our own SIGINT, then after SIGTERM, before it is killed.
CHILD_STOP_GRACE_S = (3.0, 20.0, 5.0)
SUMMARY_LINES = 60
# Sections of pytest's output that repeat each failure at length; the log keeps them.
LONG_SECTIONS = ("FAILURES", "ERRORS", "warnings summary", "PASSES", "XFAILURES", "XPASSES")


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


# A section's separator: pytest's own are "=" lines, a plugin's "-" lines; "_" lines (one per
# failing test) and "- Captured ... -" lines sit within a section.
_SEPARATOR = re.compile(r"^(?P<rule>[=-])(?P=rule){2,} (?P<title>.+?) (?P=rule){3,}$")


def _summary_tail(log: str, limit: int = SUMMARY_LINES) -> str:
  """The end of a pytest log as a terminal summary: the sections from the first ``=== ... ===``
  separator on (the conformance plugin's one-line-per-failure summary, pytest's short summary,
  the final counts), without the sections that print every failure at length (the log has
  them); at most ``limit`` lines, the last ones."""
  lines = log.rstrip().splitlines()
  kept: list[str] = []
  skipping = False
  seen_separator = False
  for line in lines:
    match = _SEPARATOR.match(line)
    if match and not match["title"].startswith("Captured "):
      seen_separator = True
      skipping = match["title"].strip() in LONG_SECTIONS
    if seen_separator and not skipping:
      kept.append(line)
  kept = kept or lines
  if len(kept) > limit:
    kept = [f"... ({len(kept) - limit} more lines in the log)", *kept[-limit:]]
  return "\n".join(kept)


def _stop_child(proc: subprocess.Popen) -> None:
  """Ends a pytest run after Ctrl-C and waits for its exit, so that nothing it writes outlives
  the clean-up of its temporary files.

  Ctrl-C at a terminal reaches the child too; pytest then stops after the current test. A SIGINT
  sent to this process alone is passed on. A child that still runs is terminated, then killed;
  a second Ctrl-C kills it at once.
  """
  escalation = (None, signal.SIGINT, signal.SIGTERM)
  try:
    for sig, grace in zip(escalation, CHILD_STOP_GRACE_S):
      if proc.poll() is not None:
        return
      if sig is not None:
        proc.send_signal(sig)
      with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def _wait(proc: subprocess.Popen, on_tick: Any = None) -> int:
  """The child's exit status once it ended, calling ``on_tick()`` every 0.2 s meanwhile."""
  try:
    while True:
      try:
        rc = proc.wait(0.2)
      except subprocess.TimeoutExpired:
        rc = None
      if on_tick is not None:
        on_tick()
      if rc is not None:
        return rc
  except BaseException:
    _stop_child(proc)
    raise


def _relay(proc: subprocess.Popen, shown_paths: dict[str, str]) -> int:
  """Copies the child's output to ours line by line, naming paths as ``shown_paths`` says."""
  assert proc.stdout is not None
  try:
    for line in proc.stdout:
      sys.stdout.write(_show_paths(line, shown_paths))
      sys.stdout.flush()
    return proc.wait()
  except BaseException:
    proc.stdout.close()  # a child blocked writing to a full pipe would never stop
    _stop_child(proc)
    raise


def _show_paths(text: str, shown_paths: dict[str, str]) -> str:
  for staged, final in shown_paths.items():
    text = text.replace(staged, final)
  return text


def run_pytest(cmd: Sequence[str], label: str, log_path: str, *,
               progress: bool | None = None, env_defaults: dict[str, str] | None = None,
               shown_paths: dict[str, str] | None = None) -> int:
  """Runs ``cmd``; with a terminal, behind a progress bar (full output to ``log_path``).

  ``env_defaults`` are set in the run's environment unless the caller's already sets them.
  ``shown_paths`` maps paths the run writes to what the user should read in their place (a
  staged results file to its final path) in what is printed.
  """
  progress = _interactive() if progress is None else progress
  env = _child_env(env_defaults)
  shown_paths = shown_paths or {}
  if not progress:
    print("$ " + shlex.join(cmd), flush=True)
    if not shown_paths:
      return _wait(subprocess.Popen(cmd, env=env))
    return _relay(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace"),
                  shown_paths)
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

      def tick() -> None:
        nonlocal offset
        offset = _advance(bar, task, label, events, offset)

      rc = _wait(proc, tick)
    with open(log_path, encoding="utf-8", errors="replace") as f:
      print(_show_paths(_summary_tail(f.read()), shown_paths))
  print(f"full output: {log_path}")
  return rc


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


OWN_KINDS = ("own", "reference")  # shipped by clipbench: their version is clipbench's


def display_version(impl: Any) -> str:
  """The version a reader should quote: the library's for an adapter, clipbench's for our own
  kernels and the reference (then the framework's in brackets, when it differs)."""
  if impl.kind not in OWN_KINDS:
    return impl.version or ""
  from clipbench import __version__
  own = f"clipbench {__version__}"
  if impl.library and impl.library != "clipbench" and impl.version:
    return f"{own} ({impl.library} {impl.version})"
  return own


def describe(impl: Any) -> dict[str, Any]:
  """An implementation as plain JSON-able data (p = inf as the string "inf": strict JSON).

  ``version`` is :func:`display_version`; ``library_version`` the version of ``library``.
  """
  caps = dataclasses.asdict(impl.capabilities)
  if isinstance(caps["norm_types"], (list, tuple)):
    caps["norm_types"] = [p if math.isfinite(p) else str(p) for p in caps["norm_types"]]
  return {"name": impl.name, "target": impl.target, "kind": impl.kind, "library": impl.library,
          "available": impl.available, "reason": impl.reason, "version": display_version(impl),
          "library_version": impl.version,
          "framework": impl.framework, "ops": list(impl.ops),
          "capabilities": caps if impl.available else None,
          "capabilities_summary": impl.capabilities.summary() if impl.available else "",
          "description": impl.description}


def _console() -> Any:
  from rich.console import Console
  # rich follows the terminal, or COLUMNS where set; piped output without COLUMNS is read by
  # people in logs too: do not squeeze tables into 80 columns there.
  wide = not _interactive() and not os.environ.get("COLUMNS", "").isdigit()
  return Console(width=200 if wide else None, highlight=False)


def cmd_list(args: argparse.Namespace) -> int:
  impls = (load_requested(args.impl, require_available=False) if args.impl else load_all())
  rows = [describe(i) for i in impls]
  if args.json:
    print(json.dumps(rows, indent=2, default=str))
    return EXIT_OK
  from rich.markup import escape
  from rich.table import Table
  # Four columns, each fact on its own line within a cell, so the table folds into 80 columns
  # (a min_width makes rich overrun the width; a max_width does not).
  table = Table(title="clipbench implementations", show_lines=True)
  table.add_column("implementation", overflow="fold")
  table.add_column("version", overflow="fold", max_width=len("clipbench 0.1.0"))
  table.add_column("ops", overflow="fold")
  table.add_column("capabilities", overflow="fold")
  for r in rows:
    name = f"{escape(r['name'])}\n[dim]{r['kind']}, {r['framework'] or '-'}[/]"
    if r["available"]:
      capabilities = escape(r["capabilities_summary"] or "-").replace("; ", "\n")
    else:
      capabilities = f"[red]unavailable[/]: {escape(r['reason'] or '')}"
    version = escape(r["version"] or "-").replace(" (", "\n(")
    table.add_row(name, version, "\n".join(r["ops"]) or "-", capabilities)
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


def check_ops_provided(impls: Sequence[Any], ops: Sequence[str]) -> None:
  """Each operation of ``--ops`` must be one that every implementation named by ``--impl``
  provides: a run that would silently test nothing for one of them is a usage error."""
  for impl in impls:
    lacking = [op for op in ops if op not in impl.ops]
    if lacking:
      raise UsageError(f"--ops: implementation {impl.name!r} has no {', '.join(lacking)} "
                       f"(it provides: {', '.join(impl.ops) or 'no operation'})")


def check_writable(folder: str, what: str) -> None:
  """Usage error unless files can be created in ``folder`` (checked before any work)."""
  from clipbench import files
  try:
    files.check_writable(folder or ".")
  except files.UnwritableFolderError as e:
    raise UsageError(f"{what}: {e}") from None


def _folder_of(path: str) -> str:
  if os.path.isdir(path):
    raise UsageError(f"{path} is a folder; expected a file path")
  return os.path.dirname(os.path.abspath(path))


def _deviation_files(paths: Sequence[str]) -> list[str]:
  for path in paths:
    if not os.path.isfile(path):
      raise UsageError(f"--deviations: no such file: {path}")
  return list(paths)


def _timeout(seconds: float | None) -> float | None:
  if seconds is not None and not (seconds > 0 and math.isfinite(seconds)):
    raise UsageError(f"--timeout: expected a positive number of seconds, got {seconds}")
  return seconds


def conformance_dir() -> str:
  import clipbench.conformance
  return os.path.dirname(os.path.abspath(clipbench.conformance.__file__))


@dataclasses.dataclass(frozen=True)
class SuiteOptions:
  """What ``conform`` and ``report`` pass on to the conformance suite besides ``--impl``."""

  ops: tuple[str, ...] = ()
  profile: str | None = None
  deviations: tuple[str, ...] = ()  # the user's own deviation files, added to the built-in list
  timeout_s: float | None = None  # per call


def conform_command(impls: Sequence[str], options: SuiteOptions, results_path: str,
                    extra: Sequence[str]) -> list[str]:
  cmd = [sys.executable, "-m", "pytest", conformance_dir(), "-p", "no:cacheprovider", "-q"]
  for spec in impls:
    cmd += ["--impl", spec]
  if options.ops:
    cmd += ["--ops", ",".join(options.ops)]
  if options.profile:
    cmd += ["--profile", options.profile]
  for path in options.deviations:
    cmd += ["--deviations", os.path.abspath(path)]
  if options.timeout_s is not None:
    # The suite's own name for it: --timeout belongs to pytest-timeout where that is installed.
    cmd += ["--clipbench-timeout", f"{options.timeout_s:g}"]
  return cmd + ["--results", results_path, *extra]


@contextlib.contextmanager
def _staged(final_path: str) -> Iterator[str]:
  """A path for a run's output in a hidden folder beside ``final_path``; the folder goes with
  anything in it (the child's own temporary files included) unless its file was promoted."""
  from clipbench import files
  with files.staging_dir(final_path) as folder:
    yield os.path.join(folder, os.path.basename(final_path))


def _profile(args: argparse.Namespace) -> str | None:
  if args.quick and args.profile == "thorough":
    raise UsageError("--quick runs the ci profile; it contradicts --profile thorough")
  return "ci" if args.quick else args.profile


def _conformance_env_defaults() -> dict[str, str]:
  """Without a GPU the Triton kernels can only run through Triton's interpreter, as in
  ``make test``; with one they run compiled on CUDA tensors."""
  from clipbench.benchmarks import timing
  return {} if timing.cuda_device_node_present() else {"TRITON_INTERPRET": "1"}


def run_conform(impls: Sequence[str], options: SuiteOptions, results_path: str,
                extra: Sequence[str]) -> int:
  """Runs the suite; promotes its results table over ``results_path`` only if it is sound."""
  from clipbench.reports import results
  with _staged(results_path) as tmp:
    cmd = conform_command(impls, options, tmp, extra)
    log = os.path.splitext(results_path)[0] + ".log"
    rc = run_pytest(cmd, "conformance", log, env_defaults=_conformance_env_defaults(),
                    shown_paths={tmp: results_path})
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


def _suite_options(args: argparse.Namespace, ops: Sequence[str] = ()) -> SuiteOptions:
  return SuiteOptions(ops=tuple(ops), profile=_profile(args),
                      deviations=tuple(_deviation_files(args.deviations)),
                      timeout_s=_timeout(args.timeout))


def cmd_conform(args: argparse.Namespace) -> int:
  ops = _ops(args.ops)
  options = _suite_options(args, ops)
  check_ops_provided(load_requested(args.impl, require_available=True), ops)
  check_writable(_folder_of(args.results), "--results")
  return run_conform(args.impl, options, args.results, args.pytest_args)


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
  from clipbench.reports import results
  with _staged(json_path) as tmp:
    cmd = bench_command(impls, workload_names, scale, quick, tmp, extra)
    rc = run_pytest(cmd, "benchmarks", os.path.splitext(json_path)[0] + ".log",
                    shown_paths={tmp: json_path})
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


def _workloads_of_ops(names: Sequence[str], ops: Sequence[str],
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
        raise UsageError(f"--ops: implementation {impl.name!r} has no {op} "
                         f"(it provides: {', '.join(impl.ops) or 'no operation'})")
  return [w.name for w in selected if w.op in ops]


def cmd_bench(args: argparse.Namespace) -> int:
  scale = _scale(args)
  ops = _ops(args.ops)
  impls = load_requested(args.impl, require_available=True)
  names = _workloads_of_ops(_workloads(args.workload), ops, impls)
  check_writable(_folder_of(args.json), "--json")
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
  options = _suite_options(args)
  scale = _scale(args)
  requested = load_requested(args.impl, require_available=True)
  conf_path = os.path.join(args.results_dir, CONFORMANCE_FILE)
  bench_path = os.path.join(args.results_dir, BENCHMARK_FILE)
  facts = [("Command", "`" + shlex.join(["clipbench", *args.argv]) + "`")]
  reuse_conformance = _fresh(conf_path, args.reuse)
  reuse_bench = _fresh(bench_path, args.reuse)
  check_writable(args.out, "--out")
  if not (reuse_conformance and reuse_bench):
    check_writable(args.results_dir, "--results-dir")

  if reuse_conformance:
    print(f"reusing {conf_path} ({_age_hours(conf_path):.1f} h old)")
  else:
    rc = run_conform(args.impl, options, conf_path, [])
    if rc not in (0, 1):
      raise RunFailed("conformance", rc)
  conformance = results.read_conformance(conf_path)
  _check_results_cover(requested, conformance, conf_path, reused=reuse_conformance)
  facts.append(("Conformance results", _file_fact(conf_path, f"{len(conformance)} cases")))

  if reuse_bench:
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
    untimed = [i.name for i in requested if i.name not in set(bench.frame["impl"])]
    if untimed:
      _note(f"no timings for {', '.join(untimed)} in {bench_path} (never timed, or skipped)")
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


def _listing_frame(impls: Sequence[Any]) -> Any:
  import pandas as pd
  rows = [describe(i) for i in impls]
  return pd.DataFrame([{**r, "capabilities": r["capabilities_summary"]} for r in rows],
                      columns=["name", "kind", "available", "reason", "version", "framework",
                               "ops", "capabilities"])


class RunFailed(Exception):
  """A run behind the report failed; no report is written. Exit status ``code``."""

  def __init__(self, what: str, code: int, why: str = "") -> None:
    super().__init__(f"the {what} run failed ({why or f'exit status {code}'}); "
                     "no report written")
    self.code = code


# --- argument parsing ------------------------------------------------------------------------

def _note(message: str) -> None:
  print(f"clipbench: {message}", file=sys.stderr, flush=True)


def _add_impl(parser: argparse.ArgumentParser, help_text: str) -> None:
  parser.add_argument("--impl", action="append", default=[], metavar="NAME|module:attr",
                      help=help_text + " (repeatable; default: all)")


def _add_suite_options(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--deviations", action="append", default=[], metavar="FILE",
                      help="your own expected-deviation file (TOML), added to clipbench's list "
                           "(repeatable)")
  parser.add_argument("--timeout", type=float, metavar="SECONDS",
                      help="per call: a call still running after SECONDS is recorded as an "
                           "error naming its case, and the suite moves on")


def build_parser() -> argparse.ArgumentParser:
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
  _add_suite_options(p)
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
  p.add_argument("--ops", metavar="OP[,OP]", help="only the workloads of these operations")
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
  _add_suite_options(p)
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
    _note("interrupted; results and reports left as they were")
    return EXIT_INTERRUPTED


if __name__ == "__main__":
  sys.exit(main())
