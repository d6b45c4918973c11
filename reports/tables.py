"""The report's tables, derived from the raw results by small pure functions.

* Conformance matrix: one cell per implementation x rule, aggregated over every op, case and
  dtype of that rule: ``fail`` if any case failed, errored or passed although listed as a
  deviation (the manifest is stale), else ``deviation`` if any listed deviation was seen, else
  ``pass`` if any case passed, else ``n/a`` (nothing applicable: outside the declared
  capabilities). The reasons behind a cell travel with it.
* Accuracy: the largest ulp error per implementation x op x dtype, of the output elements and
  of the reported norms.
* Severity: per implementation, the cases (and distinct entries) of each deviation class of
  ``clipbench.schema.SEVERITIES``, most harmful first, beside the unlisted failures, so a reader
  sees at once which library can silently corrupt an update.
* Summary: per implementation, outcome counts, a verdict naming its worst class, the worst ulp
  error (mixed-dtype calls apart: rule 4 allows them far more) and, per comparison group of
  workloads, the geometric mean of its roofline ratios over the workloads every implementation
  of that group ran (the performance table itself is ``clipbench.benchmarks.roofline.summarize``,
  the one definition shared with ``clipbench bench``).
* Sharding (rule 14): per implementation, the cases run on sharded leaves, how many gave the
  unsharded call's bits, the largest differences in ulp and the cases where a clip decision
  changed or the strict bound broke. Rule 14's ulp columns measure sharded against unsharded,
  not against the reference, so the accuracy table and the summary's ulp errors leave them out.
* Divergence catalogue: one row per manifest entry seen (implementation, op, rule, reason,
  severity) or per unlisted failure group, with its case count and one reproducer.

Numbers stay numbers here; formatting belongs to the renderer.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Iterable

import numpy as np
import pandas as pd

from clipbench.schema import (SEVERITIES, SHARDING_BOUND_BROKEN, SHARDING_DECISION_CHANGED,
                              SHARDING_RULE)

KIND_ORDER: tuple[str, ...] = ("reference", "own", "library", "baseline", "outside")
DTYPE_ORDER: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64")
STATUSES: tuple[str, ...] = ("pass", "deviation", "fail", "n/a")
FAILING: frozenset[str] = frozenset({"fail", "error", "unexpected-pass"})
MAX_REASONS_PER_CELL = 3

# Columns of the severity table beyond the manifest's classes: deviations recorded without a
# class (results older than the severity field), failures nobody listed (``fail``, ``error``)
# and listed cases that passed (the manifest entry is stale).
UNCLASSIFIED = "unclassified"
UNLISTED = "unlisted failures"
STALE = "listed but passed"
SEVERITY_CLASSES: tuple[str, ...] = (*SEVERITIES, UNCLASSIFIED, UNLISTED, STALE)
UNLISTED_OUTCOMES: frozenset[str] = frozenset({"fail", "error"})

# What each column of the severity table counts.
CLASS_DESCRIPTIONS: dict[str, str] = {
    **SEVERITIES,
    UNCLASSIFIED: "a listed deviation recorded without a class (older results)",
    UNLISTED: "failures and errors no manifest entry lists",
    STALE: "a listed case that passed: the entry is out of date",
}

# The verdict phrase of an implementation whose worst deviation is of this class.
SEVERITY_VERDICTS: dict[str, str] = {
    "silent-wrong-value": "silent wrong values",
    "invalid-input-accepted": "accepts invalid input",
    "valid-input-rejected": "rejects valid input",
    "non-finite-policy": "non-finite policy differs",
    "rounding-level": "rounding-level deviations only",
    UNCLASSIFIED: "unclassified deviations",
}

# Rule 4 lets a system's factor sit up to 4 roundoffs of its coarsest leaf dtype below the
# reference's, so a finer leaf sharing the system may be off by that much in its own ulps:
# about 2**31 float64 ulps beside a float32 leaf, 2**18 float32 ulps beside a bfloat16 one.
# Within one dtype the same allowance is a few ulps; an error above this many ulps in a
# mixed-dtype cell is the allowance's scale, not a within-dtype inaccuracy.
MIXED_ALLOWANCE_ULP = 16.0


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


# Results written while the manifest carried an ``observed`` text end each reason with it; the
# observation of the run is its own column, so the report leaves the old one out.
_MANIFEST_OBSERVED = re.compile(r" \(observed: .*\)$", re.S)


def _reason_text(row: pd.Series) -> str:
  outcome = row["outcome"]
  reason = _MANIFEST_OBSERVED.sub("", str(row["reason"]).strip())
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


def is_mixed_dtype(dtype: str) -> bool:
  """A case whose leaves have several dtypes (recorded as ``float32+float64``)."""
  return "+" in str(dtype)


def within_mixed_allowance(dtype: str, max_ulp_error: float) -> bool:
  """The error is large only because rule 4 allows a mixed-dtype system's factor to be
  placed by its coarsest leaf dtype (see :data:`MIXED_ALLOWANCE_ULP`)."""
  return is_mixed_dtype(dtype) and max_ulp_error > MIXED_ALLOWANCE_ULP


def is_sharding_row(rules: pd.Series) -> pd.Series:
  """Rows of rule 14, whose ulp columns hold sharded-against-unsharded differences."""
  return rules.astype(str) == str(SHARDING_RULE)


def against_reference(conformance: pd.DataFrame) -> pd.DataFrame:
  """The rows whose ulp columns measure an implementation against the reference."""
  return conformance[~is_sharding_row(conformance["rule"])]


def accuracy_table(conformance: pd.DataFrame) -> pd.DataFrame:
  """Long table: impl, op, dtype, the largest output and norm ulp errors, cases measured, and
  whether the output error is dominated by rule 4's mixed-dtype allowance."""
  measured = against_reference(conformance).dropna(subset=["max_ulp_error", "norm_ulp_error"],
                                                   how="all")
  frame = (measured.groupby(["impl", "op", "dtype"], sort=False)
           .agg(max_ulp_error=("max_ulp_error", "max"), norm_ulp_error=("norm_ulp_error", "max"),
                cases=("outcome", "size")).reset_index())
  frame["mixed_allowance"] = [within_mixed_allowance(d, e) for d, e in
                              zip(frame["dtype"], frame["max_ulp_error"])]
  order = {name: i for i, name in enumerate(implementations(conformance)["impl"])}
  frame["_i"] = frame["impl"].map(order)
  frame["_d"] = frame["dtype"].map(dtype_sort_key)
  return (frame.sort_values(["_i", "op", "_d"]).drop(columns=["_i", "_d"])
          .reset_index(drop=True))


def severity_class(outcome: str, severity: str) -> str | None:
  """The severity-table column of one case (None: the case does not diverge)."""
  if outcome in UNLISTED_OUTCOMES:
    return UNLISTED
  if outcome == "unexpected-pass":
    return STALE
  if outcome == "deviation":
    return severity if severity in SEVERITIES else UNCLASSIFIED
  return None


def _classified(conformance: pd.DataFrame) -> pd.DataFrame:
  """The divergent rows with their ``class`` and ``entry`` (the manifest entry behind a
  deviation: op, rule, reason and severity; for an unlisted failure, its op and rule)."""
  classes = [severity_class(o, s) for o, s in zip(conformance["outcome"], conformance["severity"])]
  rows = conformance.assign(**{"class": classes})
  rows = rows[rows["class"].notna()].copy()
  rows["reason"] = rows["reason"].str.replace(_MANIFEST_OBSERVED, "", regex=True)
  rows["entry"] = list(zip(rows["op"], rows["rule"].astype(str), rows["reason"], rows["class"]))
  return rows


def severity_table(conformance: pd.DataFrame) -> pd.DataFrame:
  """Per implementation (in summary order) and class of :data:`SEVERITY_CLASSES`: the number of
  cases (column ``<class>``) and of distinct entries (``<class> entries``)."""
  rows = _classified(conformance)
  out = []
  for impl in implementations(conformance)["impl"]:
    mine = rows[rows["impl"] == impl]
    record: dict[str, object] = {"impl": impl}
    for cls in SEVERITY_CLASSES:
      of_class = mine[mine["class"] == cls]
      record[cls] = len(of_class)
      record[f"{cls} entries"] = of_class["entry"].nunique()
    out.append(record)
  return pd.DataFrame(out, columns=["impl", *(c for cls in SEVERITY_CLASSES
                                             for c in (cls, f"{cls} entries"))])


SHARDING_COLUMNS: tuple[str, ...] = (
    "sharding_cases", "sharding_identical", "sharding_max_ulp", "sharding_norm_ulp",
    "sharding_decision_changed", "sharding_bound_broken")


def sharding_table(conformance: pd.DataFrame) -> pd.DataFrame:
  """Per implementation (in summary order), rule 14: cases run on sharded leaves (not-applicable
  ones apart), cases with the unsharded call's bits, the largest output and norm differences
  in ulp (NaN when none was measured), and the cases whose observation carries
  ``clipbench.schema``'s decision and bound markers."""
  rows = conformance[is_sharding_row(conformance["rule"])]
  out = []
  for impl in implementations(conformance)["impl"]:
    ran = rows[(rows["impl"] == impl) & (rows["outcome"] != "not-applicable")]
    observed = ran["observed"].astype(str)
    out.append({
        "impl": impl, "sharding_cases": len(ran),
        "sharding_identical": int(ran["outcome"].isin(("pass", "unexpected-pass")).sum()),
        "sharding_max_ulp": ran["max_ulp_error"].max(),
        "sharding_norm_ulp": ran["norm_ulp_error"].max(),
        "sharding_decision_changed": int(observed.str.contains(SHARDING_DECISION_CHANGED,
                                                               regex=False).sum()),
        "sharding_bound_broken": int(observed.str.contains(SHARDING_BOUND_BROKEN,
                                                           regex=False).sum())})
  return pd.DataFrame(out, columns=["impl", *SHARDING_COLUMNS])


def verdict(outcomes: pd.Series, severities: pd.Series) -> tuple[str, str]:
  """(phrase, worst class) for one implementation's cases: unlisted failures first, then the
  most harmful deviation class, then stale manifest entries; ``conforms`` when none."""
  if outcomes.empty:
    return "not checked", "n/a"
  classes = {severity_class(o, s) for o, s in zip(outcomes, severities)} - {None}
  parts = []
  unlisted = int(outcomes.isin(UNLISTED_OUTCOMES).sum())
  if unlisted:
    parts.append(f"{unlisted} unlisted failure{'s' if unlisted > 1 else ''}")
  worst_deviation = next((c for c in (*SEVERITIES, UNCLASSIFIED) if c in classes), None)
  if worst_deviation:
    parts.append(SEVERITY_VERDICTS[worst_deviation])
  stale = int((outcomes == "unexpected-pass").sum())
  if stale:
    parts.append(f"{stale} listed case{'s' if stale > 1 else ''} passed (stale manifest)")
  if parts:
    worst = UNLISTED if unlisted else worst_deviation or STALE
    return "; ".join(parts), worst
  if (outcomes == "pass").any():
    return "conforms", "conforms"
  return "nothing applicable", "n/a"


def _shortened(text: str, limit: int) -> str:
  return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def divergence_catalogue(conformance: pd.DataFrame, *, max_case_names: int = 8,
                         max_text_chars: int = 240) -> pd.DataFrame:
  """One row per manifest entry seen (impl, op, rule, reason, severity), or per unlisted
  failure group (impl, op, rule), most harmful class first, then by implementation and rule.

  Each row carries the case count, the first ``max_case_names`` case names, the dtypes, the
  worst ulp errors, one observation (cut at ``max_text_chars``) and one reproducer: the
  shortest of the group (``reproducer_test_id`` names its case, ``reproducer_chars`` gives its
  length). The report writes each entry's reproducer to a file of its own, so its pages grow
  with the number of entries, not of cases.
  """
  rows = _classified(conformance)
  columns = ["impl", "kind", "class", "op", "rule", "reason", "cases", "case_names", "dtypes",
             "max_ulp_error", "norm_ulp_error", "observed", "reproducer_test_id",
             "reproducer_chars", "reproducer"]
  if rows.empty:
    return pd.DataFrame(columns=columns)
  out = []
  for (impl, entry), group in rows.groupby(["impl", "entry"], sort=False):
    op, rule, reason, cls = entry
    with_repro = group[group["reproducer"].str.strip() != ""]
    chosen = (with_repro.loc[with_repro["reproducer"].str.len().idxmin()]
              if len(with_repro) else group.iloc[0])
    names = list(dict.fromkeys(group["case"]))
    shown = ", ".join(names[:max_case_names]) + (
        f" and {len(names) - max_case_names} more" if len(names) > max_case_names else "")
    out.append({
        "impl": impl, "kind": group["kind"].iloc[0], "class": cls, "op": op, "rule": rule,
        "reason": reason or _shortened(_first_text(group["observed"]), max_text_chars),
        "cases": len(group),
        "case_names": shown,
        "dtypes": ", ".join(sorted(set(group["dtype"]) - {""}, key=dtype_sort_key)),
        "max_ulp_error": group["max_ulp_error"].max(),
        "norm_ulp_error": group["norm_ulp_error"].max(),
        "observed": _shortened(str(chosen["observed"]), max_text_chars),
        "reproducer_test_id": str(chosen["test_id"]),
        "reproducer_chars": len(str(chosen["reproducer"]).strip()),
        "reproducer": str(chosen["reproducer"])})
  frame = pd.DataFrame(out, columns=columns)
  frame["_c"] = frame["class"].map(
      {c: i for i, c in enumerate((UNLISTED, *SEVERITIES, UNCLASSIFIED, STALE))})
  frame["_k"] = frame["kind"].map(kind_rank)
  frame["_r"] = frame["rule"].map(rule_sort_key)
  frame = (frame.sort_values(["_c", "_k", "impl", "_r", "op"], kind="stable")
           .drop(columns=["_c", "_k", "_r"]).reset_index(drop=True))
  return frame


def _first_text(values: pd.Series) -> str:
  return next((str(v) for v in values if str(v).strip()), "")


def geometric_mean(values: Iterable[float]) -> float:
  array = np.asarray([v for v in values if v > 0 and math.isfinite(v)], dtype=float)
  return float(np.exp(np.mean(np.log(array)))) if array.size else math.nan


BenchKey = tuple[str, str, str]  # workload, dtype, device


def comparison_sets(performance: pd.DataFrame,
                    group_of: Callable[[str], str]) -> dict[str, list[BenchKey]]:
  """Per comparison group of workloads (``group_of(workload)``, e.g. global, per-system,
  max-step): the (workload, dtype, device) every implementation that ran any workload of the
  group ran, in the table's order. A geometric mean over anything else would compare
  implementations on different workloads."""
  if performance is None or performance.empty:
    return {}
  frame = performance.assign(_group=performance["workload"].map(group_of))
  sets: dict[str, list[BenchKey]] = {}
  for group, rows in frame.groupby("_group", sort=False):
    keys = list(dict.fromkeys(zip(rows["workload"], rows["dtype"], rows["device"])))
    ran = [set(zip(r["workload"], r["dtype"], r["device"])) for _, r in rows.groupby("impl")]
    common = set.intersection(*ran) if ran else set()
    sets[group] = [k for k in keys if k in common]
  return sets


def describe_keys(keys: Iterable[BenchKey]) -> str:
  """``W1-model float32, W4-many-small float32`` (the device only when it is not the CPU)."""
  return ", ".join(f"{w} {d}" + (f" {dev}" if dev != "cpu" else "") for w, d, dev in keys)


def implementation_summary(conformance: pd.DataFrame, performance: pd.DataFrame | None,
                           group_of: Callable[[str], str] = lambda w: w) -> pd.DataFrame:
  """Per implementation: outcome counts, a verdict, the worst ulp errors, speed per group.

  ``verdict`` names the worst class (``worst``) of what the implementation did; ``max_ulp_error``
  is over single-dtype cases and ``max_ulp_error_mixed`` over mixed-dtype ones (rule 4 allows
  these up to about 2**31 float64 ulps); ``roofline <group>`` is the geometric mean of its
  roofline ratios over that group's common workloads (:func:`comparison_sets`), NaN when it
  ran none of them; the ``sharding_*`` columns are :func:`sharding_table`'s. Implementations
  that were only benchmarked get the verdict ``not checked``.
  """
  listed = implementations(conformance)
  sets = comparison_sets(performance, group_of) if performance is not None else {}
  if performance is not None and len(performance):
    timed = performance[~performance["impl"].isin(listed["impl"])].drop_duplicates("impl")
    extra = pd.DataFrame({"impl": timed["impl"], "kind": timed["kind"], "library": "",
                          "version": "", "framework": ""})
    listed = pd.concat([listed, extra], ignore_index=True)
    listed["_rank"] = listed["kind"].map(kind_rank)
    listed = listed.sort_values(["_rank"], kind="stable").drop(columns="_rank")
  sharding = sharding_table(conformance).set_index("impl")
  rows = []
  for _, impl in listed.iterrows():
    mine = conformance[conformance["impl"] == impl["impl"]]
    counts = mine["outcome"].value_counts()
    phrase, worst = verdict(mine["outcome"], mine["severity"])
    accuracy = against_reference(mine)
    mixed = accuracy["dtype"].map(is_mixed_dtype)
    record = {**impl.to_dict(), "verdict": phrase, "worst": worst,
              "pass": int(counts.get("pass", 0)), "deviation": int(counts.get("deviation", 0)),
              "fail": int(sum(counts.get(o, 0) for o in FAILING)),
              "not_applicable": int(counts.get("not-applicable", 0)),
              "max_ulp_error": accuracy.loc[~mixed, ["max_ulp_error",
                                                     "norm_ulp_error"]].max().max(),
              "max_ulp_error_mixed": accuracy.loc[mixed, "max_ulp_error"].max()}
    if impl["impl"] in sharding.index:
      record.update(sharding.loc[impl["impl"]].to_dict())
    else:
      record.update({c: 0 if c.endswith(("cases", "identical", "changed", "broken")) else
                     math.nan for c in SHARDING_COLUMNS})
    for group, keys in sets.items():
      ratios = performance[performance["impl"] == impl["impl"]]
      common = np.array([k in set(keys) for k in
                         zip(ratios["workload"], ratios["dtype"], ratios["device"])], dtype=bool)
      record[f"roofline {group}"] = geometric_mean(ratios.loc[common, "roofline_ratio"])
    rows.append(record)
  return pd.DataFrame(rows, columns=[
      "impl", "kind", "library", "version", "framework", "verdict", "worst", "pass",
      "deviation", "fail", "not_applicable", "max_ulp_error", "max_ulp_error_mixed",
      *SHARDING_COLUMNS, *(f"roofline {g}" for g in sets)])


def performance_with_spread(performance: pd.DataFrame, benchmarks: pd.DataFrame) -> pd.DataFrame:
  """The performance summary with each benchmark's ``iqr_s`` and ``rounds`` beside its median."""
  keys = ["impl", "workload", "dtype", "device"]
  if performance.empty:
    return performance.assign(iqr_s=pd.Series(dtype=float), rounds=pd.Series(dtype=float))
  spread = benchmarks.groupby(keys, sort=False)[["iqr_s", "rounds"]].first()
  return performance.drop(columns=[c for c in ("iqr_s", "rounds") if c in performance],
                          errors="ignore").join(spread, on=keys)


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
