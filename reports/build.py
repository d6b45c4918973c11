"""The comparison report: which implementation to trust and which is fastest, with the evidence.

``build`` turns recorded results (conformance table, pytest-benchmark JSON, asv history) into a
:class:`Report`: one document (rendered to ``index.html`` and ``REPORT.md``) and the raw tables
behind it (CSV). ``write`` puts it in ``<out>/<YYYY-MM-DD_HHMMSS>/`` and refreshes
``<out>/latest/``; both folders are assembled under a temporary name and renamed into place,
so a failed run never leaves a half-written report or spoils the previous one.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import math
import os
import re
import shutil
from typing import Callable, Iterable

import pandas as pd

from clipbench import files
from clipbench.reports import machine, plots, render, results, tables
from clipbench.reports.render import Cell, Code, Facts, Heading, Image, Notes, Table, Text

LATEST = "latest"
STAMP_FORMAT = "%Y-%m-%d_%H%M%S"


@dataclasses.dataclass(frozen=True)
class Sources:
  """Everything a report is built from; any part may be absent.

  Attributes:
    conformance: the conformance results table (``results.read_conformance``).
    conformance_path: where it was read from (shown in the report).
    benchmarks: the pytest-benchmark run (``results.read_benchmarks``).
    asv_history: ``results.read_asv_history`` (empty when there is no asv results folder).
    implementations: one row per registered implementation (name, kind, available, reason,
      version, framework, ops, capabilities), or None to leave that section out.
    run_facts: (label, value) pairs about how the results were produced.
  """

  conformance: pd.DataFrame | None = None
  conformance_path: str = ""
  benchmarks: results.BenchmarkRun | None = None
  asv_history: pd.DataFrame = dataclasses.field(
      default_factory=lambda: pd.DataFrame(columns=list(results.ASV_HISTORY_COLUMNS)))
  implementations: pd.DataFrame | None = None
  run_facts: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Report:
  document: render.Document
  tables: dict[str, pd.DataFrame]


def only_impls(sources: Sources, names: Iterable[str]) -> Sources:
  """The same sources restricted to the implementations called ``names``."""
  keep = set(names)
  conformance = sources.conformance
  if conformance is not None:
    conformance = conformance[conformance["impl"].isin(keep)].reset_index(drop=True)
  bench = sources.benchmarks
  if bench is not None:
    bench = dataclasses.replace(
        bench, frame=bench.frame[bench.frame["impl"].isin(keep)].reset_index(drop=True),
        summary=bench.summary[bench.summary["impl"].isin(keep)].reset_index(drop=True))
  history = sources.asv_history[sources.asv_history["impl"].isin(keep)]
  listing = sources.implementations
  if listing is not None:
    listing = listing[listing["name"].isin(keep)].reset_index(drop=True)
  return dataclasses.replace(sources, conformance=conformance, benchmarks=bench,
                             asv_history=history, implementations=listing)


def workload_family(name: str) -> str:
  """Workloads that differ only in size share a family (same op, p and per-system-ness)."""
  try:
    from clipbench.benchmarks import workloads  # pylint: disable=import-outside-toplevel
    workload = workloads.get(name)
  except (ImportError, ValueError, AttributeError):
    return name
  label = workload.op
  if workload.op != "clip_by_max_step":
    label += f", p={workload.norm_type:g}"
  return label + (", per-system" if workload.per_system else ", global")


def workload_description(name: str) -> str:
  try:
    from clipbench.benchmarks import workloads  # pylint: disable=import-outside-toplevel
    return workloads.get(name).description
  except (ImportError, ValueError, AttributeError):
    return ""


# --- formatting ------------------------------------------------------------------------------

def fmt_seconds(s: float) -> str:
  if not (s > 0 and math.isfinite(s)):
    return "–"
  for unit, factor in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
    if s >= factor:
      return f"{s / factor:.3g} {unit}"
  return f"{s / 1e-9:.3g} ns"


def fmt_number(x: float, digits: int = 3, suffix: str = "") -> str:
  """``digits`` significant digits, trailing zeros kept (2.00, not 2) so columns align."""
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "–"
  if math.isinf(x):
    return "inf" if x > 0 else "-inf"
  text = f"{x:#.{digits}g}"
  return (text[:-1] if text.endswith(".") else text) + suffix


def fmt_ulp(x: float) -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "–"
  if math.isinf(x):
    return "inf"
  if x == int(x) and abs(x) < 1e6:
    return str(int(x))
  return f"{x:.3g}"


_STATUS_CSS = {"pass": "st-pass", "deviation": "st-deviation", "fail": "st-fail", "n/a": "st-na"}
_VERDICT_CSS = {"conforms": "st-pass", "conforms except listed deviations": "st-deviation",
                "fails": "st-fail", "nothing applicable": "st-na", "not checked": "st-na"}


class _Footnotes:
  """Numbers distinct footnote texts in order of first use, so equal reasons share a number."""

  def __init__(self) -> None:
    self.numbers: dict[str, int] = {}

  def number(self, text: str) -> int | None:
    if not text:
      return None
    return self.numbers.setdefault(text, len(self.numbers) + 1)

  def items(self) -> tuple[tuple[int, str], ...]:
    return tuple((n, t) for t, n in self.numbers.items())


# --- sections --------------------------------------------------------------------------------

def _summary_section(summary: pd.DataFrame) -> list[render.Block]:
  rows = []
  for _, r in summary.iterrows():
    rows.append((
        r["impl"], r["kind"], r["version"] or "–",
        Cell(r["verdict"], css=_VERDICT_CSS.get(r["verdict"], "")),
        Cell(str(r["pass"]), css="num"), Cell(str(r["deviation"]), css="num"),
        Cell(str(r["fail"]), css="num"), Cell(str(r["not_applicable"]), css="num"),
        Cell(fmt_ulp(r["max_ulp_error"]), css="num"),
        Cell(fmt_number(r["roofline_ratio_geomean"]), css="num")))
  return [
      Heading("Summary", 2, "summary"),
      Text("Which implementation to trust: the verdict counts every conformance case "
           "(a listed deviation is a known, documented departure from the spec; a failure is "
           "one nobody listed). Which is fastest: the geometric mean of the roofline ratio over "
           "every benchmark the implementation ran (1 is the memory bound; lower is better)."),
      Table(("implementation", "kind", "version", "verdict", "pass", "deviation", "fail",
             "n/a", "max ulp error", "roofline ratio (geomean)"), tuple(rows)),
  ]


def rule_titles() -> dict[str, str]:
  """Rule number (as text) -> its heading in SPEC.md ("At or below the threshold: ...")."""
  spec = importlib.util.find_spec("clipbench.reference")
  titles: dict[str, str] = {}
  for folder in (spec.submodule_search_locations or []) if spec else []:
    try:
      with open(os.path.join(folder, "SPEC.md"), encoding="utf-8") as f:
        for line in f:
          match = re.match(r"#+\s*Rule\s+(\d+)\.?\s*(.*)", line)
          if match:
            titles[match.group(1)] = match.group(2).strip()
    except OSError:
      continue
  return titles


def rule_label(rule: str) -> str:
  return f"R{rule}" if str(rule).isdigit() else str(rule)


def _matrix_section(conformance: pd.DataFrame, matrix: pd.DataFrame) -> list[render.Block]:
  rule_names = tables.rules(conformance)
  titles = rule_titles()
  notes = _Footnotes()
  cells = {(r["impl"], r["rule"]): r for _, r in matrix.iterrows()}
  rows = []
  for impl in tables.implementations(conformance)["impl"]:
    row: list[Cell | str] = [impl]
    for rule in rule_names:
      cell = cells.get((impl, rule))
      if cell is None:
        row.append(Cell("–", title="no case of this rule was run", css="st-na"))
        continue
      counts = ", ".join(f"{cell[f'n_{o}']} {o}" for o in
                         ("pass", "deviation", "fail", "unexpected-pass", "error",
                          "not-applicable") if cell[f"n_{o}"])
      title = counts + (f" | {cell['reasons']}" if cell["reasons"] else "")
      row.append(Cell(cell["status"], title=title, css=_STATUS_CSS[cell["status"]],
                      note=notes.number(cell["reasons"])))
    rows.append(tuple(row))
  blocks: list[render.Block] = [
      Heading("Conformance matrix", 2, "conformance"),
      Text("Each cell aggregates every op, case and dtype of one rule of SPEC.md: `fail` if "
           "any case failed, errored or unexpectedly passed a listed deviation; `deviation` if "
           "a deviation listed in the manifest was seen; `pass` if every applicable case "
           "passed; `n/a` if nothing applied (outside the declared capabilities, never "
           "counted as a pass). Hover a cell for its case counts; the numbered notes give "
           "the reasons."),
      Table(("implementation",
             *(Cell(rule_label(r), title=titles.get(str(r), "")) for r in rule_names)),
            tuple(rows), notes="note", css="matrix"),
      Text("Rules: " + " · ".join(
          f"{rule_label(r)} {titles[str(r)]}" if str(r) in titles else rule_label(r)
          for r in rule_names) + ".", "muted"),
  ]
  if notes.numbers:
    blocks += [Heading("Notes", 3), Notes(notes.items(), "note")]
  return blocks


def _accuracy_section(accuracy: pd.DataFrame) -> list[render.Block]:
  blocks: list[render.Block] = [
      Heading("Accuracy", 2, "accuracy"),
      Text("Largest error in ulps against the exact reference, over every case that measured "
           "one, per implementation, operation and dtype. Each cell reads `output / norm`: the "
           "output elements (in ulps of the leaf dtype) and the reported norms (in ulps of the "
           "norm dtype). Rule 5 allows 2 ulp per norm. Rule 4 bounds each output element by "
           "1 ulp of `x*s` with the implementation's own factor `s`, which may sit up to 4 units "
           "of roundoff of the system's coarsest leaf dtype below the reference's: a few ulps "
           "against the reference within one dtype, and up to about 2**31 float64 ulps on a "
           "float64 leaf that shares a system with a float32 leaf (the `float32+float64` "
           "column). Whether an error breaks a rule is the conformance matrix's verdict, not "
           "this table's.")]
  if accuracy.empty:
    return blocks + [Text("No case recorded an ulp error.", "muted")]
  dtypes = sorted(accuracy["dtype"].unique(), key=tables.dtype_sort_key)
  values = {(r.impl, r.op, r.dtype): (r.max_ulp_error, r.norm_ulp_error)
            for r in accuracy.itertuples()}
  keys = list(dict.fromkeys(zip(accuracy["impl"], accuracy["op"])))

  def cell(key: tuple[str, str, str]) -> Cell:
    if key not in values:
      return Cell("–", css="num")
    out, norm = values[key]
    return Cell(f"{fmt_ulp(out)} / {fmt_ulp(norm)}", css="num")

  rows = tuple((impl, op, *(cell((impl, op, d)) for d in dtypes)) for impl, op in keys)
  # Cases without a dtype (empty input, bad arguments) and mixed-dtype calls get columns too.
  headers = tuple(d or "no dtype" for d in dtypes)
  return blocks + [Table(("implementation", "op", *headers), rows)]


def _performance_section(performance: pd.DataFrame, bench: results.BenchmarkRun | None,
                         family: Callable[[str], str]) -> list[render.Block]:
  blocks: list[render.Block] = [
      Heading("Performance", 2, "performance"),
      Text("Median wall time of one call (device work synchronized), the bandwidth it achieves "
           "on the three-pass roofline (read for the norm, read and write to scale: "
           "`3 x bytes of the leaves`), the roofline ratio (median time over that traffic at "
           "the copy bandwidth measured in the same run; 1 is the bound, lower is better) and "
           "the speed-up over the fastest library adapter on the same workload and dtype "
           "(above 1: faster than every library).")]
  if bench is None or performance.empty:
    return blocks + [Text("No benchmark results.", "muted")]
  several_devices = performance["device"].nunique() > 1
  for workload, group in performance.groupby("workload", sort=False):
    description = workload_description(workload)
    blocks.append(Heading(workload, 3, f"perf-{workload}"))
    if description:
      blocks.append(Text(description, "muted"))
    best = group.groupby(["dtype", "device"])["median_s"].transform("min")
    rows = []
    for (_, r), fastest in zip(group.iterrows(), best):
      mark = " best" if r["median_s"] == fastest else ""
      rows.append((
          Cell(r["impl"], css=mark.strip()), r["kind"], r["dtype"],
          *((r["device"],) if several_devices else ()),
          Cell(fmt_seconds(r["median_s"]), css="num" + mark),
          Cell(fmt_number(r["gbs"]), css="num"),
          Cell(fmt_number(r["roofline_ratio"]), css="num"),
          Cell(fmt_number(r["speedup_vs_best_library"], 3, "×"), css="num")))
    blocks.append(Table(("implementation", "kind", "dtype",
                         *(("device",) if several_devices else ()), "median time", "GB/s",
                         "roofline ratio", "speed-up vs fastest library"), tuple(rows)))
  figures = plots.time_vs_size(performance, family)
  bars = plots.roofline_bars(performance)
  if figures or bars:
    blocks.append(Heading("Plots", 3, "plots"))
  blocks += [Image(p) for p in figures]
  if bars is not None:
    blocks.append(Image(bars))
  return blocks


def _divergence_section(divergent: pd.DataFrame) -> list[render.Block]:
  blocks: list[render.Block] = [
      Heading("Divergence catalogue", 2, "divergences"),
      Text("Every failure and every listed deviation seen in this run, with a standalone "
           "reproducer (numpy in, the implementation's public API called as its users call it) "
           "ready for the library's issue tracker.")]
  if divergent.empty:
    return blocks + [Text("None: every applicable case passed.", "muted")]
  for impl, group in divergent.groupby("impl", sort=False):
    blocks.append(Heading(f"{impl} ({len(group)})", 3))
    for _, r in group.iterrows():
      title = " · ".join(str(x) for x in (r["outcome"], r["op"], rule_label(r["rule"]), r["case"],
                                          r["dtype"]) if x)
      blocks.append(Heading(title, 4))
      facts = [(k, str(v)) for k, v in (
          ("reason", r["reason"]), ("observed", r["observed"]),
          ("max ulp error (output / norm)",
           "" if math.isnan(r["max_ulp_error"]) and math.isnan(r["norm_ulp_error"])
           else f"{fmt_ulp(r['max_ulp_error'])} / {fmt_ulp(r['norm_ulp_error'])}"),
          ("test", f"`{r['test_id']}`" if r["test_id"] else "")) if v]
      if facts:
        blocks.append(Facts(tuple(facts)))
      if str(r["reproducer"]).strip():
        blocks.append(Code(str(r["reproducer"])))
  return blocks


def _history_section(history: pd.DataFrame) -> list[render.Block]:
  summaries = tables.asv_summary(history)
  if not summaries:
    return []
  blocks: list[render.Block] = [
      Heading("History across commits (asv)", 2, "history"),
      Text("From the asv results folder: per implementation and commit (oldest first, the "
           "last 12), times and roofline ratios as the geometric mean over the workloads, "
           "dtypes and devices that ran, ulp errors as the maximum. The full history is in "
           "`asv_history.csv`; `asv publish` draws it.")]
  for metric, table in summaries.items():
    rows = tuple((impl or "(machine)", *(Cell(fmt_number(v, 4), css="num") for v in values))
                 for impl, values in zip(table.index, table.to_numpy()))
    blocks += [Heading(metric, 3), Table(("implementation", *map(str, table.columns)), rows)]
  return blocks


def _implementations_section(listing: pd.DataFrame) -> list[render.Block]:
  rows = tuple((
      r["name"], r["kind"],
      Cell("yes", css="st-pass") if r["available"] else Cell("no", css="st-na",
                                                             title=r["reason"]),
      r["version"] or "–", r["framework"] or "–", ", ".join(r["ops"]) or "–",
      r["capabilities"] if r["available"] else r["reason"]) for _, r in listing.iterrows())
  return [Heading("Implementations", 2, "implementations"),
          Table(("implementation", "kind", "available", "version", "framework", "ops",
                 "capabilities / reason unavailable"), rows)]


def _machine_section(bench: results.BenchmarkRun | None,
                     versions: pd.DataFrame) -> tuple[list[render.Block], pd.DataFrame]:
  bandwidths = bench.frame["bandwidth_gbs"].tolist() if bench is not None else []
  described = machine.machine_description(bench.machine_info if bench else None, bandwidths)
  rows = tuple((r["library"], r["installed"], r["in_results"] or "–")
               for _, r in versions.iterrows())
  blocks = [Heading("Machine and library versions", 2, "machine"), Facts(tuple(described)),
            Table(("library", "installed", "recorded in the results"), rows)]
  return blocks, pd.DataFrame(described, columns=["item", "value"])


def build(sources: Sources, *, generated: datetime.datetime,
          family: Callable[[str], str] = workload_family) -> Report:
  """The report document and its raw tables, from recorded results only (no measurement)."""
  conformance = sources.conformance
  if conformance is None:
    conformance = pd.DataFrame(columns=list(results.CONFORMANCE_COLUMNS))
  bench = sources.benchmarks
  performance = bench.summary if bench is not None else pd.DataFrame()
  out: dict[str, pd.DataFrame] = {}
  facts = [("Generated", f"{generated:%Y-%m-%d %H:%M:%S %Z}".strip())]
  facts += list(sources.run_facts)
  blocks: list[render.Block] = [Facts(tuple(facts))]

  summary = tables.implementation_summary(conformance, performance)
  if len(summary):
    blocks += _summary_section(summary)
    out["summary"] = summary
  divergent = None
  if len(conformance):
    matrix = tables.conformance_matrix(conformance)
    accuracy = tables.accuracy_table(conformance)
    divergent = tables.divergences(conformance)
    blocks += _matrix_section(conformance, matrix)
    blocks += _accuracy_section(accuracy)
    out.update(conformance=conformance, conformance_matrix=matrix, accuracy=accuracy,
               divergences=divergent)
  else:
    blocks += [Heading("Conformance matrix", 2, "conformance"),
               Text("No conformance results.", "muted")]
  blocks += _performance_section(performance, bench, family)
  if not performance.empty:
    out["performance"] = performance
  if divergent is not None:
    blocks += _divergence_section(divergent)
  history = sources.asv_history
  blocks += _history_section(history)
  if not history.empty:
    out["asv_history"] = history
  if sources.implementations is not None:
    blocks += _implementations_section(sources.implementations)
    out["implementations"] = sources.implementations.assign(
        ops=sources.implementations["ops"].map(" ".join))
  versions = machine.library_versions(conformance)
  machine_blocks, machine_table = _machine_section(bench, versions)
  blocks += machine_blocks
  out.update(versions=versions, machine=machine_table)
  return Report(render.Document("clipbench: update-clipping implementations compared",
                                tuple(blocks)), out)


def write_folder(report: Report, folder: str) -> None:
  """Writes index.html, REPORT.md, plots/*.png and one CSV per table into ``folder``."""
  os.makedirs(os.path.join(folder, "plots"), exist_ok=True)
  for plot in render.plots_of(report.document):
    files.write_bytes(os.path.join(folder, render.image_path(plot)), plot.png)
  for name, frame in report.tables.items():
    files.write_csv(os.path.join(folder, f"{name}.csv"), frame)
  files.write_text(os.path.join(folder, "REPORT.md"), render.to_markdown(report.document))
  files.write_text(os.path.join(folder, "index.html"), render.to_html(report.document))


def write(report: Report, out_root: str, stamp: str) -> str:
  """Writes ``<out_root>/<stamp>/`` and refreshes ``<out_root>/latest/``; returns the former.

  A stamp already taken (two runs in one second) gets a ``-2``, ``-3``... suffix.
  """
  os.makedirs(out_root, exist_ok=True)
  target = os.path.join(out_root, stamp)
  n = 2
  while os.path.exists(target):
    target = os.path.join(out_root, f"{stamp}-{n}")
    n += 1
  tmp = files.temporary_dir(out_root, os.path.basename(target))
  try:
    write_folder(report, tmp)
    os.rename(tmp, target)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  files.copy_dir_atomically(target, os.path.join(out_root, LATEST))
  return target
