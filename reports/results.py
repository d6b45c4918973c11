"""Reading the raw results the report is built from, with errors that name the file and why.

Three sources, each written by another part of clipbench:

* the conformance results table (CSV, one row per implementation x op x rule x case x dtype),
  written by the conformance suite's ``--results`` option;
* a pytest-benchmark JSON file written by ``benchmarks/bench_workloads.py`` with
  ``--benchmark-json``; each benchmark's ``extra_info`` names the implementation, workload and
  dtype, the bytes the three-pass roofline moves and the copy bandwidth measured in that run;
* an asv results folder (``.asv/results``), for the history across commits.

Everything returned is a plain :class:`pandas.DataFrame` (or a small record holding one).
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import itertools
import json
import math
import os
from typing import Any

import pandas as pd

from clipbench.schema import (BENCHMARK_COLUMNS, CONFORMANCE_COLUMNS, INPUT_CLASSES, OUTCOMES,
                              RESULTS, SAFE_RANGE_CHECKS, SAFE_RANGE_COLUMNS, SEVERITIES)


class ResultsError(Exception):
  """A results file is missing, unreadable or malformed; the message names the file and why."""


# Without these a row cannot be placed in the matrix; the other columns may be absent (an older
# or an outside writer) and are then read as empty.
_ESSENTIAL_CONFORMANCE = ("impl", "rule", "outcome")
_NUMERIC_CONFORMANCE = ("max_ulp_error", "norm_ulp_error", "input_min_abs", "input_max_abs",
                        "norm_min", "norm_max", "rel_error", "duration_s")


def _missing(path: str, what: str, hint: str) -> ResultsError:
  return ResultsError(f"{path}: no such file ({what}; {hint})")


def read_conformance(path: str | os.PathLike[str]) -> pd.DataFrame:
  """The conformance results table, validated; numeric columns as floats (NaN when empty).

  ``path`` may be gzip-compressed (``.gz``), as the committed report keeps its raw table.
  Results written before deviations had a severity read with an empty ``severity``.

  Raises:
    ResultsError: the file is missing, not a CSV, lacks the essential columns, or holds an
      unknown outcome or a non-numeric ulp error (the message gives the row).
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise _missing(path, "conformance results", "run `clipbench conform` first")
  try:
    frame = pd.read_csv(path, dtype=str, keep_default_na=False, na_filter=False,
                        compression="infer")
  except pd.errors.EmptyDataError:
    raise ResultsError(f"{path}: empty file, not a conformance results table") from None
  except (OSError, EOFError, UnicodeDecodeError, pd.errors.ParserError) as e:
    raise ResultsError(f"{path}: not a readable CSV file: {e}") from None
  missing = [c for c in _ESSENTIAL_CONFORMANCE if c not in frame.columns]
  if missing:
    raise ResultsError(
        f"{path}: not a conformance results table: missing column(s) {', '.join(missing)} "
        f"(found: {', '.join(map(str, frame.columns)) or 'none'})")
  for column in CONFORMANCE_COLUMNS:
    if column not in frame.columns:
      frame[column] = ""
  # Tables from before the device axis ran on the CPU.
  frame["device"] = frame["device"].where(frame["device"] != "", "cpu")
  for column, allowed in (("outcome", OUTCOMES), ("severity", ("", *SEVERITIES)),
                          ("input_class", ("", *INPUT_CLASSES)), ("result", ("", *RESULTS))):
    bad = ~frame[column].isin(allowed)
    if bad.any():
      row = int(bad.to_numpy().nonzero()[0][0])
      raise ResultsError(
          f"{path}: line {row + 2}: unknown {column} {frame[column].iloc[row]!r}; "
          f"expected one of {', '.join(a for a in allowed if a)}")
  for column in _NUMERIC_CONFORMANCE:
    frame[column] = _numeric_column(frame[column], path, column)
  return frame[list(CONFORMANCE_COLUMNS)]


def read_safe_range(path: str | os.PathLike[str]) -> pd.DataFrame:
  """The safe-range scan table (``SAFE_RANGE_COLUMNS``), validated; numbers as floats.

  Raises:
    ResultsError: the file is missing, not a CSV, lacks a column, or holds an unknown verdict
      or check, or a non-numeric norm or error (the message gives the row).
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise _missing(path, "safe-range scan", "run `python -m clipbench.conformance.safe_range`")
  try:
    frame = pd.read_csv(path, dtype=str, keep_default_na=False, na_filter=False)
  except pd.errors.EmptyDataError:
    raise ResultsError(f"{path}: empty file, not a safe-range table") from None
  except (OSError, UnicodeDecodeError, pd.errors.ParserError) as e:
    raise ResultsError(f"{path}: not a readable CSV file: {e}") from None
  missing = [c for c in SAFE_RANGE_COLUMNS if c not in frame.columns]
  if missing:
    raise ResultsError(f"{path}: not a safe-range table: missing column(s) {', '.join(missing)}")
  for column, allowed in (("rounding", ("pass", "fail")), ("material", ("pass", "fail")),
                          ("check", ("", *SAFE_RANGE_CHECKS))):
    bad = ~frame[column].isin(allowed)
    if bad.any():
      row = int(bad.to_numpy().nonzero()[0][0])
      raise ResultsError(f"{path}: line {row + 2}: unknown {column} {frame[column].iloc[row]!r}; "
                         f"expected one of {', '.join(a for a in allowed if a)}")
  for column in ("log2_norm", "threshold", "rel_error"):
    frame[column] = _numeric_column(frame[column], path, column)
  return frame[list(SAFE_RANGE_COLUMNS)]


def _numeric_column(text: pd.Series, path: str, column: str) -> pd.Series:
  stripped = text.str.strip()
  values = pd.to_numeric(stripped.where(stripped != "", None), errors="coerce")
  bad = values.isna() & (stripped != "") & (stripped.str.lower() != "nan")
  if bad.any():
    row = int(bad.to_numpy().nonzero()[0][0])
    raise ResultsError(
        f"{path}: line {row + 2}: column {column}: expected a number, got {text.iloc[row]!r}")
  return values.astype(float)


@dataclasses.dataclass(frozen=True)
class BenchmarkRun:
  """One pytest-benchmark run.

  Attributes:
    frame: one row per benchmark (``BENCHMARK_COLUMNS``), as recorded.
    summary: ``clipbench.benchmarks.roofline.summarize`` of the file: one row per workload x
      implementation x dtype x device with ``median_s``, ``gbs``, ``roofline_ratio`` and
      ``speedup_vs_best_library``.
    machine_info: pytest-benchmark's description of the machine.
    datetime: when the run finished.
    path: the file read.
  """

  frame: pd.DataFrame
  summary: pd.DataFrame
  machine_info: dict[str, Any]
  datetime: str
  path: str


def read_benchmarks(path: str | os.PathLike[str]) -> BenchmarkRun:
  """The benchmarks of a pytest-benchmark JSON file, validated, with the roofline summary.

  Raises:
    ResultsError: the file is missing, not JSON, not pytest-benchmark output, or a benchmark
      lacks its implementation, workload, median time or roofline figures.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise _missing(path, "benchmark results", "run `clipbench bench` first")
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, UnicodeDecodeError) as e:
    raise ResultsError(f"{path}: cannot read: {e}") from None
  except json.JSONDecodeError as e:
    raise ResultsError(f"{path}: not valid JSON: {e}") from None
  if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
    raise ResultsError(f"{path}: not a pytest-benchmark JSON file (no 'benchmarks' list)")
  rows = [_benchmark_row(path, b) for b in data["benchmarks"]]
  frame = pd.DataFrame(rows, columns=list(BENCHMARK_COLUMNS))
  from clipbench.benchmarks import roofline  # pylint: disable=import-outside-toplevel
  try:
    summary = roofline.summarize(path)
  except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
    raise ResultsError(f"{path}: cannot summarize: {type(e).__name__}: {e}") from None
  machine = data.get("machine_info") if isinstance(data.get("machine_info"), dict) else {}
  return BenchmarkRun(frame, summary, machine, str(data.get("datetime") or ""), path)


def _benchmark_row(path: str, bench: Any) -> dict[str, Any]:
  if not isinstance(bench, dict):
    raise ResultsError(f"{path}: a 'benchmarks' entry is not an object: {bench!r:.80}")
  name = str(bench.get("fullname") or bench.get("name") or "?")
  extra = bench.get("extra_info") or {}
  stats = bench.get("stats") or {}
  if not isinstance(extra, dict) or not isinstance(stats, dict):
    raise ResultsError(f"{path}: benchmark {name}: 'extra_info' and 'stats' must be objects")
  workload = extra.get("workload") or bench.get("group")
  for key, value in (("extra_info.impl", extra.get("impl")), ("extra_info.workload", workload)):
    if not value:
      raise ResultsError(f"{path}: benchmark {name}: missing {key}")
  positive = {"stats.median": stats.get("median"),
              "extra_info.bytes_moved": extra.get("bytes_moved"),
              "extra_info.bandwidth_gbs": extra.get("bandwidth_gbs"),
              "extra_info.roofline_seconds": extra.get("roofline_seconds")}
  for key, value in positive.items():
    number = _number(value)
    if not (number > 0 and math.isfinite(number)):
      raise ResultsError(f"{path}: benchmark {name}: {key} must be a positive number, "
                         f"got {value!r}")
  return {
      "impl": str(extra["impl"]), "kind": str(extra.get("kind") or ""),
      "workload": str(workload), "dtype": str(extra.get("dtype") or "float32"),
      "device": str(extra.get("device") or "cpu"),
      "group": str(bench.get("group") or workload), "name": name,
      "median_s": _number(stats["median"]), "min_s": _number(stats.get("min")),
      "mean_s": _number(stats.get("mean")), "stddev_s": _number(stats.get("stddev")),
      "iqr_s": _number(stats.get("iqr")), "rounds": _number(stats.get("rounds")),
      "bytes_moved": _number(extra["bytes_moved"]),
      "bandwidth_gbs": _number(extra["bandwidth_gbs"]),
      "roofline_seconds": _number(extra["roofline_seconds"]),
  }


def _number(value: Any) -> float:
  try:
    return float(value)
  except (TypeError, ValueError):
    return math.nan


ASV_HISTORY_COLUMNS: tuple[str, ...] = (
    "commit", "date", "machine", "env", "benchmark", "metric", "impl", "params", "value")


def read_asv_history(results_dir: str | os.PathLike[str]) -> pd.DataFrame:
  """Every asv result value under ``results_dir``, one row per commit x benchmark x params.

  ``impl`` is the parameter called ``impl`` (the implementation); ``params`` the others, as
  ``name=value`` text. A missing folder gives an empty table: history is optional.

  Raises:
    ResultsError: a results file exists but asv cannot load it.
  """
  results_dir = os.fspath(results_dir)
  if not os.path.isdir(results_dir):
    return pd.DataFrame(columns=list(ASV_HISTORY_COLUMNS))
  from asv import results as asv_results  # pylint: disable=import-outside-toplevel
  from asv import util as asv_util  # pylint: disable=import-outside-toplevel
  param_names = _asv_param_names(results_dir)
  rows = []
  for root, filename, machine in asv_results.iter_results_paths(results_dir):
    file_path = os.path.join(root, filename)
    try:
      result = asv_results.Results.load(file_path, machine_name=machine)
    except (asv_util.UserError, KeyError, ValueError, TypeError, OSError) as e:
      raise ResultsError(f"{file_path}: not a readable asv results file: {e}") from None
    date = datetime.datetime.fromtimestamp((result.date or 0) / 1000, datetime.timezone.utc)
    for key in result.get_all_result_keys():
      rows.extend(_asv_rows(result, key, param_names.get(key), machine, date))
  frame = pd.DataFrame(rows, columns=list(ASV_HISTORY_COLUMNS))
  return frame.sort_values(["date", "benchmark", "impl", "params"], kind="stable",
                           ignore_index=True)


def _asv_param_names(results_dir: str) -> dict[str, list[str]]:
  path = os.path.join(results_dir, "benchmarks.json")
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, json.JSONDecodeError):
    return {}  # names are a nicety; without them parameters are shown by position
  return {k: list(v.get("param_names") or []) for k, v in data.items() if isinstance(v, dict)}


def _asv_rows(result: Any, key: str, names: list[str] | None, machine: str,
              date: datetime.datetime) -> list[dict[str, Any]]:
  params = result.get_result_params(key) or []
  # One value per parameter combination (a single one, for () when not parametrized).
  values = result.get_result_value(key, params)
  combos = list(itertools.product(*params))
  names = names if names and len(names) == len(params) else [f"p{i}" for i in range(len(params))]
  rows = []
  for combo, value in zip(combos, values):
    if not isinstance(value, (int, float)) or math.isnan(value):
      continue  # skipped or failed case: asv records no value
    labelled = dict(zip(names, (_asv_param_value(v) for v in combo)))
    impl = labelled.pop("impl", "")
    rows.append({
        "commit": result.commit_hash, "date": date, "machine": machine, "env": result.env_name,
        "benchmark": key, "metric": key.rsplit(".", 1)[-1], "impl": impl,
        "params": ", ".join(f"{k}={v}" for k, v in labelled.items()), "value": float(value)})
  return rows


def _asv_param_value(text: str) -> str:
  # asv stores parameter values as their repr: "'W1-model'".
  try:
    return str(ast.literal_eval(text))
  except (ValueError, SyntaxError):
    return str(text)
