"""The report's tables, derived from the raw results by small pure functions.

* Conformance matrix: one cell per implementation x rule, aggregated over every op, case and
  dtype of that rule: ``fail`` if any case failed, errored or passed although listed as a
  deviation (the manifest is stale), else ``deviation`` if any listed deviation was seen, else
  ``pass`` if any case passed, else ``n/a`` (nothing applicable: outside the declared
  capabilities). The reasons behind a cell travel with it.
* Accuracy: the largest ulp error per implementation x op x dtype, of the output elements and
  of the reported norms.
* Summary: per implementation, outcome counts, a verdict, the worst ulp error and the geometric
  mean of its roofline ratios (the performance table itself is
  ``clipbench.benchmarks.roofline.summarize``, the one definition shared with ``clipbench bench``).

Numbers stay numbers here; formatting belongs to the renderer.
"""

from __future__ import annotations

import math
import re
from typing import Iterable

import numpy as np
import pandas as pd

KIND_ORDER: tuple[str, ...] = ("reference", "own", "library", "baseline", "outside")
DTYPE_ORDER: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64")
STATUSES: tuple[str, ...] = ("pass", "deviation", "fail", "n/a")
FAILING: frozenset[str] = frozenset({"fail", "error", "unexpected-pass"})
DIVERGENT: tuple[str, ...] = ("fail", "error", "unexpected-pass", "deviation")
MAX_REASONS_PER_CELL = 3


def kind_rank(kind: str) -> int:
  return KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)


def rule_sort_key(rule: str) -> tuple[int, int, str]:
  """Numbered rules in numeric order ("rule2" before "rule10"), then any other label."""
  match = re.search(r"\d+", str(rule))
  return (0, int(match.group()), str(rule)) if match else (1, 0, str(rule))


def dtype_sort_key(dtype: str) -> tuple[int, str]:
  return (DTYPE_ORDER.index(dtype) if dtype in DTYPE_ORDER else len(DTYPE_ORDER), dtype)


def implementations(conformance: pd.DataFrame) -> pd.DataFrame:
  """One row per implementation seen in the results (kind, library, version, framework)."""
  columns = ["impl", "kind", "library", "version", "framework"]
  frame = conformance[columns].drop_duplicates("impl").copy()
  frame["_rank"] = frame["kind"].map(kind_rank)
  return frame.sort_values(["_rank", "impl"]).drop(columns="_rank").reset_index(drop=True)


def cell_status(outcomes: Iterable[str]) -> str:
  seen = set(outcomes)
  if seen & FAILING:
    return "fail"
  if "deviation" in seen:
    return "deviation"
  if "pass" in seen:
    return "pass"
  return "n/a"


def _reason_text(row: pd.Series) -> str:
  outcome = row["outcome"]
  reason = str(row["reason"]).strip()
  observed = str(row["observed"]).strip()
  if outcome == "unexpected-pass":
    return f"listed deviation not seen (manifest out of date): {reason or observed}"
  if outcome in ("fail", "error"):
    return f"{outcome}: {observed or reason or 'see the test log'}"
  return reason or observed or outcome


def _cell_reasons(rows: pd.DataFrame, status: str) -> str:
  if status == "pass":
    return ""
  relevant = {"fail": FAILING, "deviation": {"deviation"}, "n/a": {"not-applicable"}}[status]
  texts = [_reason_text(r) for _, r in rows[rows["outcome"].isin(relevant)].iterrows()]
  counts = pd.Series(texts, dtype=object).value_counts(sort=True) if texts else pd.Series()
  parts = [f"{text} ({n} case{'s' if n > 1 else ''})" if n > 1 else text
           for text, n in counts.iloc[:MAX_REASONS_PER_CELL].items()]
  if len(counts) > MAX_REASONS_PER_CELL:
    parts.append(f"and {len(counts) - MAX_REASONS_PER_CELL} more reasons")
  return "; ".join(parts)


def conformance_matrix(conformance: pd.DataFrame) -> pd.DataFrame:
  """Long matrix: impl, rule, status, counts per outcome and the reasons behind the status."""
  rows = []
  for (impl, rule), group in conformance.groupby(["impl", "rule"], sort=False):
    status = cell_status(group["outcome"])
    counts = group["outcome"].value_counts()
    rows.append({"impl": impl, "rule": rule, "status": status,
                 **{f"n_{o}": int(counts.get(o, 0)) for o in
                    ("pass", "deviation", "fail", "unexpected-pass", "error", "not-applicable")},
                 "reasons": _cell_reasons(group, status)})
  frame = pd.DataFrame(rows, columns=[
      "impl", "rule", "status", "n_pass", "n_deviation", "n_fail", "n_unexpected-pass",
      "n_error", "n_not-applicable", "reasons"])
  order = {name: i for i, name in enumerate(implementations(conformance)["impl"])}
  frame["_i"] = frame["impl"].map(order)
  frame["_r"] = frame["rule"].map(rule_sort_key)
  return frame.sort_values(["_i", "_r"]).drop(columns=["_i", "_r"]).reset_index(drop=True)


def rules(conformance: pd.DataFrame) -> list[str]:
  return sorted(conformance["rule"].unique(), key=rule_sort_key)


def accuracy_table(conformance: pd.DataFrame) -> pd.DataFrame:
  """Long table: impl, op, dtype, the largest output and norm ulp errors, cases measured."""
  measured = conformance.dropna(subset=["max_ulp_error", "norm_ulp_error"], how="all")
  frame = (measured.groupby(["impl", "op", "dtype"], sort=False)
           .agg(max_ulp_error=("max_ulp_error", "max"), norm_ulp_error=("norm_ulp_error", "max"),
                cases=("outcome", "size")).reset_index())
  order = {name: i for i, name in enumerate(implementations(conformance)["impl"])}
  frame["_i"] = frame["impl"].map(order)
  frame["_d"] = frame["dtype"].map(dtype_sort_key)
  return (frame.sort_values(["_i", "op", "_d"]).drop(columns=["_i", "_d"])
          .reset_index(drop=True))


def divergences(conformance: pd.DataFrame) -> pd.DataFrame:
  """Every failing or deviating row, failures first, then by implementation and rule."""
  rows = conformance[conformance["outcome"].isin(DIVERGENT)].copy()
  rows["_o"] = rows["outcome"].map(DIVERGENT.index)
  rows["_i"] = rows["kind"].map(kind_rank)
  rows["_r"] = rows["rule"].map(rule_sort_key)
  return (rows.sort_values(["_o", "_i", "impl", "_r", "case", "dtype"], kind="stable")
          .drop(columns=["_o", "_i", "_r"]).reset_index(drop=True))


def geometric_mean(values: Iterable[float]) -> float:
  array = np.asarray([v for v in values if v > 0 and math.isfinite(v)], dtype=float)
  return float(np.exp(np.mean(np.log(array)))) if array.size else math.nan


def implementation_summary(conformance: pd.DataFrame,
                           performance: pd.DataFrame | None) -> pd.DataFrame:
  """Per implementation: outcome counts, a verdict, the worst ulp error, speed in one figure.

  Implementations that were only benchmarked get the verdict ``not checked``.
  """
  listed = implementations(conformance)
  if performance is not None and len(performance):
    timed = performance[~performance["impl"].isin(listed["impl"])].drop_duplicates("impl")
    extra = pd.DataFrame({"impl": timed["impl"], "kind": timed["kind"], "library": "",
                          "version": "", "framework": ""})
    listed = pd.concat([listed, extra], ignore_index=True)
    listed["_rank"] = listed["kind"].map(kind_rank)
    listed = listed.sort_values(["_rank"], kind="stable").drop(columns="_rank")
  rows = []
  for _, impl in listed.iterrows():
    mine = conformance[conformance["impl"] == impl["impl"]]
    counts = mine["outcome"].value_counts()
    failing = int(sum(counts.get(o, 0) for o in FAILING))
    deviations = int(counts.get("deviation", 0))
    passed = int(counts.get("pass", 0))
    if mine.empty:
      verdict = "not checked"
    elif failing:
      verdict = "fails"
    elif deviations:
      verdict = "conforms except listed deviations"
    elif passed:
      verdict = "conforms"
    else:
      verdict = "nothing applicable"
    ratio = math.nan
    if performance is not None and len(performance):
      ratio = geometric_mean(performance.loc[performance["impl"] == impl["impl"],
                                             "roofline_ratio"])
    rows.append({**impl.to_dict(), "verdict": verdict, "pass": passed,
                 "deviation": deviations, "fail": failing,
                 "not_applicable": int(counts.get("not-applicable", 0)),
                 "max_ulp_error": mine[["max_ulp_error", "norm_ulp_error"]].max().max(),
                 "roofline_ratio_geomean": ratio})
  return pd.DataFrame(rows, columns=[
      "impl", "kind", "library", "version", "framework", "verdict", "pass", "deviation", "fail",
      "not_applicable", "max_ulp_error", "roofline_ratio_geomean"])


# How asv metrics are folded over their parameters (workload, dtype, device) per commit.
_ASV_FOLD = {"track_max_ulp_error": "max"}
ASV_MAX_COMMITS = 12


def asv_summary(history: pd.DataFrame) -> dict[str, pd.DataFrame]:
  """Per asv metric: implementation x commit (oldest first, the last 12 commits).

  Times and ratios are folded over workloads, dtypes and devices by the geometric mean, ulp
  errors by the maximum; a commit where fewer cases ran is therefore not strictly comparable.
  """
  if history.empty:
    return {}
  commits = (history.groupby("commit")["date"].min().sort_values().index[-ASV_MAX_COMMITS:])
  dates = history.groupby("commit")["date"].min()
  labels = {c: f"{c[:8]} {dates[c]:%Y-%m-%d}" for c in commits}
  recent = history[history["commit"].isin(commits)]
  tables = {}
  for metric, group in recent.groupby("metric", sort=True):
    fold = _ASV_FOLD.get(metric, "geomean")
    folded = group.groupby(["impl", "commit"])["value"].agg(
        "max" if fold == "max" else geometric_mean)
    table = folded.unstack("commit").reindex(columns=[c for c in commits
                                                      if c in set(group["commit"])])
    tables[metric] = table.rename(columns=labels)
  return tables
