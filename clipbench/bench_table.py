"""The terminal tables of ``clipbench bench``: one per workload and dtype, as in the report.

Beside each median (lower is better): its spread (the IQR of the timed rounds) and the number
of rounds, the bandwidth, the roofline ratio (1 is the memory bound; lower is better), the
speed-up over the fastest library and the implementation's conformance verdict from the last
``conform`` run's results table: a fast result that is wrong is not a result. An implementation
that table does not hold (or no table) reads ``not checked``. Below
:data:`FULL_TABLE_WIDTH` columns the kind and the bandwidth are left out.

The figures and verdicts come from the report's own functions (``reports.tables``,
``reports.build``), so the terminal and the report never disagree.
"""

from __future__ import annotations

import math

import os
from typing import Any, Mapping

from clipbench import terminal
from clipbench.errors import note

NOT_CHECKED = ("not checked", "n/a")  # (verdict, worst class) without conformance results
# Headers broken over lines so that the table fits a terminal; each says which way is better.
MEDIAN, IQR, ROUNDS = "median\nlower\nis\nbetter", "IQR", "rounds"
GBS = "GB/s\nhigher\nis\nbetter"
ROOFLINE = "roofline\nratio\nlower\nis\nbetter"
VS_FASTEST = "vs\nfastest\nlibrary\nhigher\nis\nbetter"
VS_PEER = "time vs\nits\nframe-\nwork's\nfastest\nlower\nis\nbetter"
# Below this many columns the kind and the bandwidth (the roofline ratio says the same) are left
# out, so that the name, the numbers and the verdict keep their width.
FULL_TABLE_WIDTH = 100
VERDICT_MIN_WIDTH = 15
# Rich styles of a verdict by its worst class: red where an update can be silently corrupted
# (or a failure is not even listed), yellow for any other listed deviation.
_WORST_STYLES = {"conforms": "green", "n/a": "dim", "silent-wrong-value": "red"}


def conformance_verdicts(path: str) -> dict[str, tuple[str, str]]:
  """Per implementation in the results table at ``path``: (verdict, worst class), as the report
  words them; empty when there is no table (and, with a note, when it cannot be read)."""
  from clipbench.reports import results, tables
  if not os.path.isfile(path):
    return {}
  try:
    table = results.read_conformance(path)
  except results.ResultsError as e:
    note(f"conformance verdicts not shown: {e}")
    return {}
  return {impl: tables.verdict(rows)
          for impl, rows in table.groupby("impl", sort=False)}


def _verdict_markup(verdict: str, worst: str) -> str:
  from rich.markup import escape
  from clipbench.reports import tables
  style = "red" if worst == tables.UNLISTED else _WORST_STYLES.get(worst, "yellow")
  return f"[{style}]{escape(verdict)}[/]"


def print_performance(run: Any, verdicts: Mapping[str, tuple[str, str]]) -> None:
  """One table per workload, dtype and device of the benchmark ``run``
  (``reports.results.BenchmarkRun``), each timing beside its implementation's entry in
  ``verdicts`` (:func:`conformance_verdicts`); the fastest median of each table in bold."""
  from rich import box
  from rich.table import Table
  from clipbench.reports import tables
  from clipbench.reports.build import (fmt_count, fmt_number, fmt_seconds,
                                       workload_description)
  performance = tables.performance_with_spread(run.summary, run.frame)
  several_devices = performance["device"].nunique() > 1
  console = terminal.console()
  console.print("Median wall time of one call and its spread (IQR over the timed rounds); "
                "roofline ratio: median over the three-pass memory traffic at the measured copy "
                "bandwidth (1 = memory bound); conformance: the verdict of the last "
                "`clipbench conform` run.")
  full = console.width >= FULL_TABLE_WIDTH
  keys = ["workload", "dtype", "device"]
  for (workload, dtype, device), group in performance.groupby(keys, sort=False):
    title = f"{workload}, {dtype}" + (f", {device}" if several_devices else "")
    # No vertical rules and one space between columns, so that the table fits a terminal.
    table = Table(title=title, caption=workload_description(workload) or None,
                  box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False, collapse_padding=True)
    # A name stays whole (it is what a reader copies); a verdict wraps at its words, and the
    # numbers and headers make the room.
    table.add_column("implementation", no_wrap=True, min_width=int(group["impl"].str.len().max()))
    # Our own implementations against their framework's fastest library or baseline, where
    # the terminal has room (the report always shows it).
    peer = full and group.get("time_vs_framework_peer", group["median_s"] * math.nan).notna().any()
    numbers = (MEDIAN, IQR, ROUNDS, *((GBS,) if full else ()), ROOFLINE, VS_FASTEST,
               *((VS_PEER,) if peer else ()))
    for column in (("kind",) if full else ()) + numbers:
      table.add_column(column, justify="left" if column == "kind" else "right")
    table.add_column("conformance", overflow="fold", min_width=VERDICT_MIN_WIDTH)
    fastest = group["median_s"].min()
    for _, r in group.iterrows():
      median = fmt_seconds(r["median_s"])
      cells = {MEDIAN: f"[bold]{median}[/]" if r["median_s"] == fastest else median,
               IQR: fmt_seconds(r["iqr_s"]), ROUNDS: fmt_count(r["rounds"]),
               GBS: fmt_number(r["gbs"]), ROOFLINE: fmt_number(r["roofline_ratio"]),
               VS_FASTEST: fmt_number(r["speedup_vs_best_library"], 3, "x"),
               VS_PEER: fmt_number(r.get("time_vs_framework_peer", math.nan), 3, "x")}
      table.add_row(r["impl"], *((r["kind"],) if full else ()), *(cells[c] for c in numbers),
                    _verdict_markup(*verdicts.get(r["impl"], NOT_CHECKED)))
    console.print(table)
