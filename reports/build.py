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
import gzip
import hashlib
import math
import os
import shutil
from typing import Any, Callable, Iterable, Sequence

import pandas as pd

from clipbench import files
from clipbench.protocol import RULES
from clipbench.reports import machine, plots, render, results, tables
from clipbench.reports.render import (Cell, Details, Facts, Heading, Image, Notes, Table,
                                      Text)
from clipbench.schema import (CONFORMANCE_COLUMNS, EVERYDAY_RANGE, MATERIAL_TOLERANCE,
                              SEVERITIES)

LATEST = "latest"
STAMP_FORMAT = "%Y-%m-%d_%H%M%S"

# Tables written gzip-compressed: the results table has a row per case and the safe-range scan a
# row per point, megabytes as CSV, and every committed report file must stay under GitHub's
# 500 KB diff limit.
# ``pandas.read_csv`` and ``results.read_conformance`` read the ``.gz`` directly.
COMPRESSED_TABLES: frozenset[str] = frozenset({"conformance", "safe_range"})
# Left out of the report's copy of the results table: a reproducer per case holds its input
# inline (tens of kilobytes for the large cases). The catalogue keeps one per entry; every
# case's own is in the results table the report was built from.
PER_CASE_ONLY_COLUMNS: tuple[str, ...] = ("reproducer",)


@dataclasses.dataclass(frozen=True)
class Sources:
  """Everything a report is built from; any part may be absent.

  Attributes:
    conformance: the conformance results table (``results.read_conformance``).
    conformance_path: where it was read from (shown in the report).
    benchmarks: the pytest-benchmark run (``results.read_benchmarks``).
    asv_history: ``results.read_asv_history`` (empty when there is no asv results folder).
    safe_range: the safe-range scan (``results.read_safe_range``), or None.
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
  safe_range: pd.DataFrame | None = None
  run_facts: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Report:
  document: render.Document
  tables: dict[str, pd.DataFrame]
  # Path inside the report folder -> text: one standalone reproducer per catalogue entry.
  reproducers: dict[str, str] = dataclasses.field(default_factory=dict)


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
  scan = sources.safe_range
  if scan is not None:
    scan = scan[scan["impl"].isin(keep)].reset_index(drop=True)
  return dataclasses.replace(sources, conformance=conformance, benchmarks=bench,
                             asv_history=history, implementations=listing, safe_range=scan)


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


def workload_group(name: str) -> str:
  """The comparison group of a workload: ``global``, ``per-system`` or ``max-step``.

  The summary compares implementations within a group, over the workloads all of them ran.
  """
  try:
    from clipbench.benchmarks import workloads  # pylint: disable=import-outside-toplevel
    workload = workloads.get(name)
  except (ImportError, ValueError, AttributeError):
    return name
  if workload.op == "clip_by_max_step":
    return "max-step"
  return "per-system" if workload.per_system else "global"


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


def fmt_count(x: float) -> str:
  if x is None or not math.isfinite(x):
    return "–"
  return str(int(x))


def fmt_ulp(x: float) -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "–"
  if math.isinf(x):
    return "inf"
  if x == int(x) and abs(x) < 1e6:
    return str(int(x))
  return f"{x:.3g}"


_STATUS_CSS = {"pass": "st-pass", "deviation": "st-deviation", "fail": "st-fail", "n/a": "st-na"}


def _slug(text: str) -> str:
  return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def verdict_cell(verdict: str, worst: str) -> Cell:
  """The verdict, colored by its worst class (red: silent wrong values or unlisted failures)."""
  if worst == "conforms":
    return Cell(verdict, css="st-pass nowrap")
  if worst == "n/a":
    return Cell(verdict, css="st-na nowrap")
  return Cell(verdict, css=f"sev-{_slug(worst)} nowrap",
              title=tables.CLASS_DESCRIPTIONS.get(worst, worst))


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

def sharding_cell(record: Any) -> Cell:
  """Rule 14 for one implementation: identical bits, or how far and what changed."""
  cases = int(record["sharding_cases"])
  if not cases:
    return Cell("not run", css="st-na",
                title="no rule-14 case ran: no sharded engine checked, or none applies")
  identical = int(record["sharding_identical"])
  if identical == cases:
    return Cell(f"identical bits ({cases} cases)", css="st-pass")
  parts = [f"{cases - identical} of {cases} cases differ",
           f"up to {fmt_ulp(record['sharding_max_ulp'])} ulp"]
  if not math.isnan(record["sharding_norm_ulp"]):
    parts[-1] += f" (norm {fmt_ulp(record['sharding_norm_ulp'])})"
  changed, broken = int(record["sharding_decision_changed"]), int(record["sharding_bound_broken"])
  parts.append(f"decision changed in {changed}" if changed else "no decision changed")
  parts.append(f"bound broken in {broken}" if broken else "bound held")
  return Cell("; ".join(parts), css="st-deviation",
              title="sharded against the same call on unsharded leaves (SPEC rule 14)")


def _count_cell(everyday: int, edge: int, entries: int, cls: str) -> Cell:
  """``everyday / edge (entries)``: cases on everyday inputs, at the range's edge."""
  cases = everyday + edge
  if not cases:
    return Cell("0", css="num zero")
  css = f"num sev-{_slug(cls)}" if everyday or cls in (tables.UNLISTED, tables.STALE) else "num"
  return Cell(f"{everyday} / {edge} ({entries})", css=css,
              title=f"{everyday} case{'s' if everyday != 1 else ''} on everyday inputs, {edge} "
                    f"at the range's edge, from {entries} entr{'ies' if entries > 1 else 'y'}")


def _severity_section(severity: pd.DataFrame, with_device: bool = False) -> list[render.Block]:
  shown = [c for c in tables.SEVERITY_CLASSES
           if c in (*SEVERITIES, tables.UNLISTED) or severity[c].sum()]
  descriptions = tables.CLASS_DESCRIPTIONS
  rows = tuple((r["impl"], *((r["device"],) if with_device else ()),
                *(_count_cell(int(r[f"{c} everyday"]), int(r[f"{c} edge"]),
                              int(r[f"{c} entries"]), c) for c in shown))
               for _, r in severity.iterrows())
  low, high = EVERYDAY_RANGE
  return [
      Heading("Which library can corrupt an update", 3, "severity"),
      Text("Cases of each class of departure from SPEC.md, most harmful first, each cell "
           "`everyday / range edge (entries)`. A case is *everyday* when its inputs are finite "
           f"and every nonzero |x| and every nonzero exact norm lies in [2**{math.log2(low):.0f}, "
           f"2**{math.log2(high):.0f}] (float16's normal range, whatever the dtype), else "
           "it is at the *range edge*. A case's class is derived from what it showed: an error "
           f"beyond {MATERIAL_TEXT} relative (or zeros, NaN, a flipped sign) is a silent "
           "wrong value, beyond rounding but within it is precision; a spoiled argument "
           "accepted is invalid input accepted, a raise on a valid input is valid input "
           "rejected, an input holding NaN or infinity is non-finite policy; the manifest's "
           "class stands only where the case data cannot tell (bits that differ alone and "
           "batched, a modified input). Unlisted failures are departures nobody has "
           "classified yet."),
      Table(("implementation", *((Cell("device", title=DEVICE_TITLE),) if with_device else ()),
             *(Cell(c, title=descriptions[c]) for c in shown)), rows, css="severity"),
      Facts(tuple((c, descriptions[c]) for c in shown)),
  ]


DEVICE_TITLE = ("where the calls ran: the suite built its inputs on the host, moved them there "
                "and checked that the outputs stayed there (clipbench --device)")


def speed_cell(ratio: float, count: float) -> Cell:
  if not count or count != count:
    return Cell("–", css="num", title="ran no workload of this group")
  return Cell(f"{fmt_number(ratio)} ({int(count)})", css="num",
              title=f"geometric mean over the {int(count)} workload(s) it ran")


def speed_columns(summary: pd.DataFrame, sets: dict[str, list[tables.BenchKey]]
                  ) -> tuple[list[str], list[str]]:
  """The groups shown (each as ``ratio (count)``) and the per-workload columns of groups
  whose implementations share no workload."""
  groups = [g for g in sets if f"roofline {g}" in summary.columns and
            summary[f"{g} workloads"].fillna(0).any()]
  workloads = [c.removeprefix("roofline ") for c in summary.columns
               if c.startswith("roofline ") and c.removeprefix("roofline ") not in sets
               and summary[c].notna().any()]
  return groups, workloads


def _summary_section(summary: pd.DataFrame, severity: pd.DataFrame | None,
                     sets: dict[str, list[tables.BenchKey]],
                     sentences: Sequence[render.Block] = (),
                     ranges: Sequence[render.Block] = (),
                     with_device: bool = False) -> list[render.Block]:
  groups, workloads = speed_columns(summary, sets)
  timed = "time vs fastest" in summary.columns
  rows = []
  for _, r in summary.iterrows():
    mixed = r["max_ulp_error_mixed"]
    mixed_text = fmt_ulp(mixed)
    if mixed > tables.MIXED_ALLOWANCE_ULP:
      mixed_text += " (mixed-dtype allowance)"
    rows.append((
        r["impl"], r["kind"], r["version"] or "–", verdict_cell(r["verdict"], r["worst"]),
        Cell(str(r["pass"]), css="num"), Cell(str(r["deviation"]), css="num"),
        Cell(str(r["fail"]), css="num"), Cell(str(r["not_applicable"]), css="num"),
        Cell(fmt_ulp(r["max_ulp_error"]), css="num"), Cell(mixed_text, css="num"),
        sharding_cell(r),
        *((Cell(fmt_number(r["time vs fastest"], 3, "×"), css="num"),) if timed else ()),
        *(speed_cell(r[f"roofline {g}"], r[f"{g} workloads"]) for g in groups),
        *(Cell(fmt_number(r[f"roofline {w}"]), css="num") for w in workloads)))
  group_headers = tuple(
      Cell(f"roofline ratio, {g} (geomean over the workloads run; count)",
           title=f"common to all: {tables.describe_keys(sets[g]) or 'none'}")
      for g in groups)
  disjoint = [g for g in groups if not sets[g]]
  blocks: list[render.Block] = [Heading("Summary", 2, "summary"), *sentences]
  if severity is not None and len(severity):
    blocks += _severity_section(severity, with_device)
  blocks += ranges
  return blocks + [
      Heading("Verdict, accuracy and speed", 3, "verdicts"),
      Text("Which implementation to trust: the verdict names unlisted failures first, then "
           "the worst class on everyday inputs, then the worst at the range's edge; the table "
           "above counts every class. Which is fastest: `time vs fastest` is the geometric "
           "mean, over every workload, dtype and device it ran, of its median time over the "
           "fastest median there (1: the fastest; lower is better); per group of workloads, "
           "the geometric mean of the roofline ratio (1 is the memory bound; lower is better) "
           "over the workloads it ran, with their count: figures over different counts cover "
           "different work"
           + (f"; the {', '.join(disjoint)} group{'s' if len(disjoint) > 1 else ''} share no "
              "workload, so each of its workloads has a column of its own (float32, CPU)."
              if disjoint and workloads else ".")),
      Table(("implementation", "kind", "version", "verdict", "pass", "deviation", "fail",
             "n/a", "max ulp error (one dtype)", "max ulp error (mixed dtypes)",
             Cell("sharding", title="SPEC rule 14: sharded leaves against the same call on "
                                    "unsharded leaves, bit for bit"),
             *((Cell("time vs fastest (geomean, lower is better)"),) if timed else ()),
             *group_headers,
             *(Cell(f"roofline ratio, {w}") for w in workloads)), tuple(rows)),
  ]


MATERIAL_TEXT = f"{MATERIAL_TOLERANCE:.0e}".replace("e-0", "e-")  # 1e-3

# The dtypes users train in: the sentences give the safe range in these.
TRAINING_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32")


def fmt_norm(log2_norm: float) -> str:
  """2**log2_norm, in two significant digits: ``6.1e-05``, ``0.25``, ``1.3e+02``."""
  value = 2.0 ** log2_norm
  return f"{value:.2g}"


def range_text(low: float, high: float, whole_low: bool, whole_high: bool, below: str = "",
               above: str = "") -> str:
  """A conforming range (log2 ends; NaN: none) and, where given, what breaks beyond each end;
  ``the whole range`` when it reaches both ends of the scan."""
  if low != low:
    return "nowhere" + (f" ({below})" if below else "")
  if whole_low and whole_high:
    return "the whole range"
  core = (f"up to {fmt_norm(high)}" if whole_low else f"from {fmt_norm(low)}" if whole_high
          else f"{fmt_norm(low)} – {fmt_norm(high)}")
  breaks = ([f"below: {below}"] if below and not whole_low else []) + (
      [f"above: {above}"] if above and not whole_high else [])
  return core + (f" ({'; '.join(breaks)})" if breaks else "")


def _variant(r: Any) -> str:
  return "max-step" if r["op"] == "clip_by_max_step" else f"p={r['norm_type']}"


def safe_range_cell(r: Any) -> Cell:
  text = range_text(r["low_log2"], r["high_log2"], bool(r["whole_low"]), bool(r["whole_high"]),
                    r["below"], r["above"])
  rounding = (r["rounding_low_log2"], r["rounding_high_log2"])
  if rounding != (r["low_log2"], r["high_log2"]) and not (
      rounding[0] != rounding[0] and r["low_log2"] != r["low_log2"]):
    inner = ("nowhere" if rounding[0] != rounding[0] else
             f"{fmt_norm(rounding[0])} – {fmt_norm(rounding[1])}")
    text += f"; within rounding: {inner}"
  whole = bool(r["whole_low"]) and bool(r["whole_high"])
  if r["variants"] > 1 and not whole:
    text = f"{_variant(r)}: {text}"
  return Cell(text, css="st-pass" if whole else ("st-fail" if r["low_log2"] != r["low_log2"]
                                                 else "st-deviation"),
              title=f"{r['op']}, {_variant(r)}: the narrowest of its {r['variants']} "
                    f"operation and p combination(s)")


def _safe_range_section(narrow: pd.DataFrame) -> list[render.Block]:
  dtypes = sorted(narrow["dtype"].unique(), key=tables.dtype_sort_key)
  cells = {(r["impl"], r["dtype"]): safe_range_cell(r) for _, r in narrow.iterrows()}
  rows = tuple((impl, *(cells.get((impl, d), Cell("–", css="st-na",
                                                   title="dtype not supported or not scanned"))
                        for d in dtypes)) for impl in dict.fromkeys(narrow["impl"]))
  return [
      Heading("Safe ranges", 3, "safe-ranges"),
      Text("Over which system norms each implementation conforms on ordinary input: a "
           "fixed-seed random input (72 elements) scaled to an exact norm of 2**e for every "
           "e from subnormal elements to elements that would overflow the dtype, clipped at "
           "half its norm. Each cell is the longest run of norms where the result is within "
           f"{MATERIAL_TEXT} relative (no zeros, NaN, sign flips or overflowed norm), "
           "what fails just beyond each end, and, where narrower, the run within rounding "
           "(SPEC rules 4 and 5 to the ulp); the narrowest of its operations and p (1, 2, 3, "
           "inf) that was scanned is shown (a dtype or p is missing when not supported, or "
           "when the scan's time budget for the implementation ran out first). A scan, not a "
           "bisection: nothing assumes pass and fail are monotone. Every point is a row of "
           "`safe_range.csv.gz`, every range of `safe_ranges.csv`."),
      Table(("implementation", *dtypes), rows, css="ranges"),
  ]


def _finding_link(catalogue: pd.DataFrame | None, files_of: dict[int, str], impl: str
                  ) -> str:
  """The implementation's worst everyday catalogue entry, linked to its reproducer."""
  if catalogue is None or catalogue.empty:
    return ""
  mine = catalogue[(catalogue["impl"] == impl) &
                   ~catalogue["everyday_class"].isin(("", tables.STALE))]
  if mine.empty:
    return ""
  rank = mine["everyday_class"].map(tables.CLASS_RANK)
  i = rank.sort_values(kind="stable").index[0]
  r = mine.loc[i]
  what = f"{r['op']} {rule_label(r['rule'])}: {_shortened(str(r['reason']), 90)}"
  return f"[{what}]({files_of[i]})" if i in files_of else what


def _shortened(text: str, limit: int) -> str:
  return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def _verdict_sentences(summary: pd.DataFrame, narrow: pd.DataFrame | None,
                       catalogue: pd.DataFrame | None, files_of: dict[int, str]
                       ) -> list[render.Block]:
  """One sentence per implementation: everyday verdict, safe range in the training dtypes,
  speed against the fastest, worst everyday finding."""
  ranges = {} if narrow is None else {(r["impl"], r["dtype"]): r for _, r in narrow.iterrows()}
  lines = []
  for _, r in summary.iterrows():
    if r["verdict"] == "not checked" or r["worst"] == tables.UNLISTED:
      parts = [r["verdict"]]
    else:
      everyday = tables.SEVERITY_VERDICTS[r["everyday"]] if r["everyday"] else "conforms"
      edge = f" (range edge: {tables.SEVERITY_VERDICTS[r['edge']]})" if r["edge"] else ""
      parts = [f"everyday inputs: {everyday}{edge}"]
    safe = [f"{d} {range_text(x['low_log2'], x['high_log2'], x['whole_low'], x['whole_high'])}"
            for d, x in ((d, ranges.get((r["impl"], d))) for d in TRAINING_DTYPES)
            if x is not None]
    if safe:
      parts.append(f"within {MATERIAL_TEXT} for norms in " + ", ".join(safe))
    speed = r.get("time vs fastest", math.nan)
    if speed == speed:
      parts.append("the fastest" if speed <= 1.0005 else f"{speed:.3g}× the fastest time")
    finding = _finding_link(catalogue, files_of, r["impl"])
    if finding:
      parts.append(f"worst everyday finding: {finding}")
    lines.append(f"**{r['impl']}**: " + "; ".join(parts) + ".")
  return [Heading("In one sentence each", 3, "sentences"),
          Text("Per implementation: its verdict on everyday inputs (finite, |x| and norms in "
               f"[2**{math.log2(EVERYDAY_RANGE[0]):.0f}, 2**{math.log2(EVERYDAY_RANGE[1]):.0f}]) "
               "and at the range's edge, the norms over which it stays within "
               f"{MATERIAL_TEXT} in the dtypes users train in (see Safe ranges), its time "
               "against the fastest (geometric mean over the workloads it ran) and its worst "
               "everyday finding, linked to a standalone reproducer."),
          *(Text(line) for line in lines)]


def rule_titles() -> dict[str, str]:
  """Rule number (as text) -> its title in SPEC.md, from ``clipbench.protocol.RULES``."""
  return {str(number): title for number, title in RULES.items()}


def rule_label(rule: str) -> str:
  return f"R{rule}" if str(rule).isdigit() else str(rule)


def _matrix_section(conformance: pd.DataFrame, matrix: pd.DataFrame) -> list[render.Block]:
  rule_names = tables.rules(conformance)
  titles = rule_titles()
  notes = _Footnotes()
  cells = {(r["impl"], r["rule"]): r for _, r in matrix.iterrows()}
  placed = tables.devices_of(conformance) if tables.off_the_host(conformance) else None
  rows = []
  for impl in tables.implementations(conformance)["impl"]:
    row: list[Cell | str] = [impl, *((placed[impl],) if placed else ())]
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
      Table(("implementation", *((Cell("device", title=DEVICE_TITLE),) if placed else ()),
             *(Cell(rule_label(r), title=titles.get(str(r), "")) for r in rule_names)),
            tuple(rows), notes="note", css="matrix"),
      Text("Rules: " + " · ".join(
          f"{rule_label(r)} {titles[str(r)]}" if str(r) in titles else rule_label(r)
          for r in rule_names) + ".", "muted"),
  ]
  if notes.numbers:
    # Collapsed: the reasons run to pages; a note's link opens it.
    blocks.append(Details(f"the reasons behind the cells ({len(notes.numbers)})",
                          (Notes(notes.items(), "note"),), label="Notes:"))
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
           "column; such cells, in any mixed-dtype column, are marked). Whether an error "
           "breaks a rule is the conformance matrix's verdict, not this table's.")]
  if accuracy.empty:
    return blocks + [Text("No case recorded an ulp error.", "muted")]
  dtypes = sorted(accuracy["dtype"].unique(), key=tables.dtype_sort_key)
  values = {(r.impl, r.op, r.dtype): (r.max_ulp_error, r.norm_ulp_error, r.mixed_allowance)
            for r in accuracy.itertuples()}
  keys = list(dict.fromkeys(zip(accuracy["impl"], accuracy["op"])))
  allowance = ("dominated by rule 4's mixed-dtype allowance: a system's factor may sit 4 "
               "roundoffs of its coarsest leaf dtype below the reference's, which is about "
               "2**31 ulps of a float64 leaf beside a float32 one (2**18 float32 ulps beside "
               "bfloat16); not an inaccuracy within one dtype")
  notes = _Footnotes()

  def cell(key: tuple[str, str, str]) -> Cell:
    if key not in values:
      return Cell("–", css="num")
    out, norm, mixed = values[key]
    return Cell(f"{fmt_ulp(out)} / {fmt_ulp(norm)}", css="num",
                title=allowance if mixed else "",
                note=notes.number(allowance) if mixed else None)

  rows = tuple((impl, op, *(cell((impl, op, d)) for d in dtypes)) for impl, op in keys)
  # Cases without a dtype (empty input, bad arguments) and mixed-dtype calls get columns too.
  headers = tuple(d or "no dtype" for d in dtypes)
  blocks.append(Table(("implementation", "op", *headers), rows, notes="acc"))
  if notes.numbers:
    blocks.append(Notes(notes.items(), "acc"))
  return blocks


def _verdicts(summary: pd.DataFrame | None) -> dict[str, Cell]:
  if summary is None or summary.empty:
    return {}
  return {r["impl"]: verdict_cell(r["verdict"], r["worst"]) for _, r in summary.iterrows()}


def _performance_section(performance: pd.DataFrame, bench: results.BenchmarkRun | None,
                         family: Callable[[str], str],
                         verdicts: dict[str, Cell]) -> list[render.Block]:
  blocks: list[render.Block] = [
      Heading("Performance", 2, "performance"),
      Text("Median wall time of one call (device work synchronized; lower is better) with its "
           "spread (the interquartile range of the timed rounds) and the number of rounds, "
           "the bandwidth it achieves on the three-pass roofline (read for the norm, read and "
           "write to scale: `3 x bytes of the leaves`; higher is better), the roofline ratio "
           "(median time over that traffic at the copy bandwidth measured in the same run; 1 "
           "is the bound, lower is better), the speed-up over the fastest library adapter on "
           "the same workload and dtype (above 1: faster than every library), for our own "
           "implementations their time over the fastest library or baseline of their framework "
           "(JAX, torch; at most 1: as fast as what that framework's users have) and, beside "
           "every timing, the implementation's conformance verdict: a fast result that is "
           "wrong is not a result.")]
  if bench is None or performance.empty:
    return blocks + [Text("No benchmark results.", "muted")]
  several_devices = performance["device"].nunique() > 1
  unknown = Cell("not checked", css="st-na")
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
          Cell(fmt_seconds(r["iqr_s"]), css="num"),
          Cell(fmt_count(r["rounds"]), css="num"),
          Cell(fmt_number(r["gbs"]), css="num"),
          Cell(fmt_number(r["roofline_ratio"]), css="num"),
          Cell(fmt_number(r["speedup_vs_best_library"], 3, "×"), css="num"),
          Cell(fmt_number(r.get("time_vs_framework_peer", math.nan), 3, "×"), css="num"),
          verdicts.get(r["impl"], unknown)))
    blocks.append(Table(("implementation", "kind", "dtype",
                         *(("device",) if several_devices else ()),
                         "median time (lower is better)", "IQR", "rounds",
                         "GB/s (higher is better)", "roofline ratio (lower is better)",
                         "speed-up vs fastest library (higher is better)",
                         "own: time vs its framework's fastest library or baseline (lower is "
                         "better)", "conformance"),
                        tuple(rows)))
  figures = plots.time_vs_size(performance, family)
  bars = plots.roofline_bars(performance)
  if figures or bars:
    blocks.append(Heading("Plots", 3, "plots"))
  blocks += [Image(p) for p in figures]
  if bars is not None:
    blocks.append(Image(bars))
  return blocks


def _share(achieved: float, of: float | None) -> str:
  return "–" if of is None or not of > 0 or achieved != achieved else (
      f"{100.0 * achieved / of:.1f}%")


def _gpu_section(performance: pd.DataFrame, bench: results.BenchmarkRun | None
                 ) -> tuple[list[render.Block], pd.DataFrame | None]:
  """The card the CUDA benchmarks ran on (the benchmark JSON's ``machine_info["cuda"]``): its
  datasheet peak, the copy bandwidth measured with the timings, and each CUDA benchmark's
  achieved bandwidth as a share of both; nothing when no benchmark ran on CUDA."""
  cuda = performance[performance["device"] == "cuda"] if not performance.empty else performance
  if bench is None or cuda.empty:
    return [], None
  card = bench.machine_info.get("cuda") if isinstance(bench.machine_info.get("cuda"),
                                                      dict) else {}
  peak = card.get("peak_gbs")
  peak = float(peak) if isinstance(peak, (int, float)) and peak > 0 else None
  copies = bench.frame.loc[bench.frame["device"] == "cuda", "bandwidth_gbs"]
  copy = float(copies.median()) if len(copies) else None
  table = cuda[["workload", "dtype", "impl", "median_s", "gbs"]].assign(
      of_peak=[g / peak if peak else math.nan for g in cuda["gbs"]],
      of_copy=[g / copy if copy else math.nan for g in cuda["gbs"]])
  facts = [("Card", str(card.get("name") or "not recorded")),
           ("Software", str(card.get("software") or "not recorded")),
           ("Datasheet peak", f"{peak:,.0f} GB/s" if peak else
            "unknown (the card is not in clipbench.benchmarks.gpu_check.PEAK_BANDWIDTH_GBS)"),
           ("Measured copy bandwidth", "not measured" if copy is None else
            f"{copy:,.0f} GB/s (device to device, read + write; {_share(copy, peak)} of the "
            "peak)")]
  rows = tuple((r["workload"], r["dtype"], r["impl"], Cell(fmt_seconds(r["median_s"]), css="num"),
                Cell(fmt_number(r["gbs"]), css="num"), Cell(_share(r["gbs"], peak), css="num"),
                Cell(_share(r["gbs"], copy), css="num")) for _, r in table.iterrows())
  return [Heading("GPU", 2, "gpu"), Facts(tuple(facts)),
          Text("Achieved bandwidth of each CUDA benchmark: the roofline's three passes over the "
               "data (read, read, write) over the median call time, as a share of the card's "
               "datasheet peak and of the copy bandwidth measured in the same run."),
          Table(("workload", "dtype", "implementation", "median", "achieved GB/s",
                 "of peak", "of measured copy"), rows)], table


SUMMARY_REASON_CHARS = 200  # of an entry's reason on its collapsed line

_CLASS_TITLES = {
    tables.UNLISTED: "Unlisted failures",
    "silent-wrong-value": "Silent wrong values",
    "invalid-input-accepted": "Invalid input accepted",
    "valid-input-rejected": "Valid input rejected or crash",
    "non-finite-policy": "Non-finite policy",
    "precision": "Precision",
    "rounding-level": "Rounding-level",
    tables.UNCLASSIFIED: "Unclassified deviations",
    tables.STALE: "Stale manifest entries (listed, but passed)",
}


REPRODUCER_DIR = "reproducers"


def reproducer_files(catalogue: pd.DataFrame) -> dict[int, str]:
  """Catalogue row -> where its reproducer is written: a section of its implementation's page
  ``reproducers/<impl>.md``, anchored by the entry (op, rule and a hash of its class and
  reason), so an entry keeps its address and an unchanged reproducer makes no diff. Pages (a
  Markdown code block per entry) rather than ``.py`` files: GitHub shows them highlighted,
  and generated code stays out of the tree's code."""
  out = {}
  for i, r in catalogue.iterrows():
    if str(r["reproducer"]).strip():
      digest = hashlib.sha1(f"{r['class']}|{r['reason']}".encode()).hexdigest()[:8]
      anchor = f"{_slug(str(r['op']))}-rule{_slug(str(r['rule']))}-{digest}"
      out[i] = f"{REPRODUCER_DIR}/{_slug(str(r['impl']))}.md#{anchor}"
  return out


def reproducer_pages(catalogue: pd.DataFrame, files_of: dict[int, str]) -> dict[str, str]:
  """Page path -> Markdown: each implementation's reproducers, in the catalogue's order."""
  pages: dict[str, list[str]] = {}
  for i, address in files_of.items():
    r = catalogue.loc[i]
    path, anchor = address.split("#")
    lines = pages.setdefault(path, [f"# Reproducers: {r['impl']}\n",
                                    "Each block runs on its own wherever clipbench is installed "
                                    "and ends in an assertion against the exact reference that "
                                    "fails while the deviation stands.\n"])
    lines += [f'<a id="{anchor}"></a>\n',
              f"## {r['op']} · {rule_label(r['rule'])} · {r['class']}\n",
              f"{r['reason']}\n",
              f"Case: `{r['reproducer_test_id']}` ({r['cases']} case"
              f"{'s' if r['cases'] > 1 else ''} in this entry)\n",
              "```python\n" + str(r["reproducer"]).rstrip() + "\n```\n"]
  return {path: "\n".join(lines) for path, lines in pages.items()}


def _divergence_section(catalogue: pd.DataFrame, results_path: str,
                        files_of: dict[int, str]) -> list[render.Block]:
  blocks: list[render.Block] = [
      Heading("Divergence catalogue", 2, "divergences"),
      Text("Every failure and every listed deviation seen in this run, one entry per manifest "
           "entry (implementation, op, rule, reason, severity) or, for failures nobody listed, "
           "per implementation, op and rule; most harmful class first. An entry's class is "
           "the worst its cases showed (see the severity table); its reproducer shows it on "
           "everyday inputs where it shows there. Each entry gives its "
           "case count and one standalone reproducer, on its implementation's page in "
           "`reproducers/` beside this report (the inputs inline, the call as the library's users write it, then an "
           "assertion against the exact reference that fails while the deviation stands; it "
           "runs wherever clipbench is installed), ready for the library's issue tracker. "
           "`divergences.csv` is this catalogue as a table, with each entry's case names; "
           "every case is a row of "
           "`conformance.csv.gz` beside this report (the results table, gzip-compressed to "
           "stay within GitHub's file limits: `pandas.read_csv` and `zcat` read it directly), "
           "without its reproducer. Each case's own reproducer is in the results table this "
           f"report was built from{f' (`{results_path}`)' if results_path else ''}, which "
           "`clipbench conform --impl NAME` writes again for any implementation.")]
  if catalogue.empty:
    return blocks + [Text("None: every applicable case passed.", "muted")]
  for cls, group in catalogue.groupby("class", sort=False):
    title = _CLASS_TITLES.get(cls, cls)
    cases = int(group["cases"].sum())
    blocks.append(Heading(f"{title}: {len(group)} entr{'ies' if len(group) > 1 else 'y'}, "
                          f"{cases} case{'s' if cases > 1 else ''}", 3, f"div-{_slug(cls)}"))
    if cls in SEVERITIES:
      blocks.append(Text(SEVERITIES[cls], "muted"))
    for i, r in group.iterrows():
      label = " · ".join(str(x) for x in (r["impl"], r["op"], rule_label(r["rule"])) if x)
      reason = str(r["reason"])
      shown = SUMMARY_REASON_CHARS
      everyday = (f", {r['everyday_cases']} everyday" if r["everyday_cases"] else
                  ", range edge only")
      summary = (f"{reason[:shown]}{'…' if len(reason) > shown else ''} "
                 f"({r['cases']} case{'s' if r['cases'] > 1 else ''}{everyday})")
      ulps = ("" if math.isnan(r["max_ulp_error"]) and math.isnan(r["norm_ulp_error"])
              else f"{fmt_ulp(r['max_ulp_error'])} / {fmt_ulp(r['norm_ulp_error'])}")
      facts = [(k, str(v)) for k, v in (
          # The reason is repeated only when the summary line cut it, or it is the observation.
          ("reason", reason if len(reason) > shown and reason != r["observed"] else ""),
          ("dtypes", r["dtypes"]), ("observed", r["observed"]),
          ("max ulp error (output / norm)", ulps))
               if v]
      inner: list[render.Block] = [Facts(tuple(facts))]
      if i in files_of:
        inner.append(Text(f"Reproducer: [`{files_of[i].split('#')[0]}`]({files_of[i]}) "
                          f"({r['reproducer_chars']:,} characters, standalone)"))
      else:
        inner.append(Text("No reproducer was recorded for these cases.", "muted"))
      blocks.append(Details(summary, tuple(inner), label=f"{label}:"))
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
  # The host's memory: a CUDA benchmark's roofline used the card's copy bandwidth (GPU section).
  bandwidths = (bench.frame.loc[bench.frame["device"] != "cuda", "bandwidth_gbs"].tolist()
                if bench is not None else [])
  described = machine.machine_description(bench.machine_info if bench else None, bandwidths)
  rows = tuple((r["library"], r["installed"], r["in_results"] or "–")
               for _, r in versions.iterrows())
  blocks = [Heading("Machine and library versions", 2, "machine"), Facts(tuple(described)),
            Table(("library", "installed", "recorded in the results"), rows)]
  return blocks, pd.DataFrame(described, columns=["item", "value"])


def build(sources: Sources, *, generated: datetime.datetime,
          family: Callable[[str], str] = workload_family,
          group_of: Callable[[str], str] = workload_group) -> Report:
  """The report document and its raw tables, from recorded results only (no measurement).

  ``family`` groups workloads that differ only in size (one time-against-size plot each);
  ``group_of`` groups the workloads the summary compares implementations on.
  """
  conformance = sources.conformance
  if conformance is None:
    conformance = pd.DataFrame(columns=list(CONFORMANCE_COLUMNS))
  bench = sources.benchmarks
  performance = pd.DataFrame()
  if bench is not None:
    performance = tables.performance_with_spread(bench.summary, bench.frame)
  out: dict[str, pd.DataFrame] = {}
  facts = [("Generated", f"{generated:%Y-%m-%d %H:%M:%S %Z}".strip())]
  facts += list(sources.run_facts)
  blocks: list[render.Block] = [Facts(tuple(facts))]

  summary = tables.implementation_summary(conformance, performance, group_of)
  severity = tables.severity_table(conformance) if len(conformance) else None
  ranges = narrow = None
  if sources.safe_range is not None and len(sources.safe_range):
    ranges = tables.safe_ranges(sources.safe_range)
    narrow = tables.narrowest_ranges(ranges)
    out.update(safe_range=sources.safe_range, safe_ranges=ranges)
  catalogue, files_of = None, {}
  if len(conformance):
    catalogue = tables.divergence_catalogue(conformance)
    files_of = reproducer_files(catalogue)
  if len(summary):
    blocks += _summary_section(summary, severity, tables.comparison_sets(performance, group_of),
                               _verdict_sentences(summary, narrow, catalogue, files_of),
                               _safe_range_section(narrow) if narrow is not None else [],
                               with_device=tables.off_the_host(conformance))
    out["summary"] = summary
  if severity is not None:
    out["severity"] = severity
  reproducers = {}
  if len(conformance):
    matrix = tables.conformance_matrix(conformance)
    accuracy = tables.accuracy_table(conformance)
    blocks += _matrix_section(conformance, matrix)
    blocks += _accuracy_section(accuracy)
    # The file names its case: the test id of the results table's row it was taken from.
    reproducers = reproducer_pages(catalogue, files_of)
    out.update(conformance=conformance.drop(columns=list(PER_CASE_ONLY_COLUMNS)),
               conformance_matrix=matrix, accuracy=accuracy,
               divergences=catalogue.drop(columns="reproducer").assign(
                   reproducer_file=[files_of.get(i, "") for i in catalogue.index]))
  else:
    blocks += [Heading("Conformance matrix", 2, "conformance"),
               Text("No conformance results.", "muted")]
  blocks += _performance_section(performance, bench, family, _verdicts(summary))
  if not performance.empty:
    out["performance"] = performance
  gpu_blocks, gpu_table = _gpu_section(performance, bench)
  blocks += gpu_blocks
  if gpu_table is not None:
    out["gpu"] = gpu_table
  if catalogue is not None:
    blocks += _divergence_section(catalogue, sources.conformance_path, files_of)
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
                                tuple(blocks)), out, reproducers)


def table_file(name: str) -> str:
  """The file name a table is written to: ``<name>.csv``, or ``<name>.csv.gz`` for
  :data:`COMPRESSED_TABLES`."""
  return f"{name}.csv.gz" if name in COMPRESSED_TABLES else f"{name}.csv"


def write_folder(report: Report, folder: str) -> None:
  """Writes index.html, REPORT.md, plots/*.png and one CSV per table into ``folder``."""
  os.makedirs(os.path.join(folder, "plots"), exist_ok=True)
  for plot in render.plots_of(report.document):
    files.write_bytes(os.path.join(folder, render.image_path(plot)), plot.png)
  for name, frame in report.tables.items():
    path = os.path.join(folder, table_file(name))
    if name in COMPRESSED_TABLES:
      # mtime=0: the same table gives the same bytes, so an unchanged table makes no diff.
      text = frame.to_csv(index=False, lineterminator="\n").encode("utf-8")
      files.write_bytes(path, gzip.compress(text, compresslevel=9, mtime=0))
    else:
      files.write_csv(path, frame)
  for path, text in report.reproducers.items():
    os.makedirs(os.path.dirname(os.path.join(folder, path)), exist_ok=True)
    files.write_text(os.path.join(folder, path), text.rstrip() + "\n")
  files.write_text(os.path.join(folder, "REPORT.md"), render.to_markdown(report.document))
  files.write_text(os.path.join(folder, "index.html"), render.to_html(report.document))


def write(report: Report, out_root: str, stamp: str, latest: str = LATEST) -> str:
  """Writes ``<out_root>/<stamp>/`` and refreshes ``<out_root>/<latest>/``; returns the former.

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
  files.copy_dir_atomically(target, os.path.join(out_root, latest))
  return target
