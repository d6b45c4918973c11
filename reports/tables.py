"""The report's tables, derived from the raw results by small pure functions.

* Conformance matrix: one cell per implementation x rule, aggregated over every op, case and
  dtype of that rule: ``fail`` if any case failed, errored or passed although listed as a
  deviation (the manifest is stale), else ``deviation`` if any listed deviation was seen, else
  ``pass`` if any case passed, else ``n/a`` (nothing applicable: outside the declared
  capabilities). The reasons behind a cell travel with it.
* Accuracy: the largest ulp error per implementation x op x dtype, of the output elements and
  of the reported norms.
* Severity: per implementation, the cases (and distinct entries) of each deviation class of
  ``clipbench.schema.SEVERITIES``, most harmful first, split into everyday inputs and the
  range's edge (``clipbench.schema.is_everyday``), beside the unlisted failures, so a reader
  sees at once which library can silently corrupt an update in ordinary training. Each case's
  class is derived from its data (``clipbench.schema.case_severity``), not the manifest's.
* Summary: per implementation, outcome counts, a verdict naming its worst everyday class and
  its worst at the edge, the worst ulp error (mixed-dtype calls apart: rule 4 allows them far
  more) and its speed: its time over the fastest, and per comparison group of workloads the
  geometric mean of its roofline ratios over the workloads of that group it ran, with their
  count (the performance table itself is ``clipbench.benchmarks.roofline.summarize``, the one
  definition shared with ``clipbench bench``).
* Safe ranges: per implementation, op, dtype and p, the longest run of scanned norms over
  which it conforms (material tolerance and rounding) and what fails beyond each end.
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

from clipbench.schema import (EVERYDAY, RANGE_EDGE, SAFE_RANGE_CHECKS, SEVERITIES,
                              SHARDING_BOUND_BROKEN, SHARDING_DECISION_CHANGED, SHARDING_RULE,
                              case_severity, is_everyday)

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
    "precision": "precision (within 1e-3)",
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


def _devices(conformance: pd.DataFrame) -> pd.Series:
  """Each row's device (``cpu`` where the table has none: written before the device axis)."""
  if "device" not in conformance.columns:
    return pd.Series("cpu", index=conformance.index, dtype=object)
  return conformance["device"].where(conformance["device"].astype(str) != "", "cpu")


def devices_of(conformance: pd.DataFrame) -> dict[str, str]:
  """The devices each implementation's cases ran on (``cuda``; several joined by ``, ``)."""
  return {impl: ", ".join(sorted(set(group))) for impl, group in
          _devices(conformance).groupby(conformance["impl"], sort=False)}


def off_the_host(conformance: pd.DataFrame) -> bool:
  """Whether any case ran on another device than the host's first (the report then shows the
  device beside each implementation)."""
  return bool((_devices(conformance) != "cpu").any())


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
  """The severity-table column of one case (None: the case does not diverge); ``severity`` is
  the case's own class (:func:`case_classes`)."""
  if outcome in UNLISTED_OUTCOMES:
    return UNLISTED
  if outcome == "unexpected-pass":
    return STALE
  if outcome == "deviation":
    return severity if severity in SEVERITIES else UNCLASSIFIED
  return None


def case_classes(conformance: pd.DataFrame) -> pd.Series:
  """Each row's own class, from its case data (``clipbench.schema.case_severity``); the
  manifest entry's class where the data cannot tell."""
  return pd.Series([case_severity(listed, input_class, result, rel_error, dtype)
                    for listed, input_class, result, rel_error, dtype in zip(
                        conformance["severity"], conformance["input_class"],
                        conformance["result"], _numbers(conformance["rel_error"]),
                        conformance["dtype"])],
                   index=conformance.index, dtype=object)


def _numbers(column: pd.Series) -> pd.Series:
  """A numeric column of the results table (NaN where empty), however the frame was made."""
  return pd.to_numeric(column, errors="coerce")


def scopes(conformance: pd.DataFrame) -> pd.Series:
  """Each row's scope: ``everyday`` or ``range edge`` (``clipbench.schema.is_everyday``)."""
  return pd.Series([EVERYDAY if is_everyday(*values) else RANGE_EDGE for values in zip(
      conformance["input_class"], *(_numbers(conformance[c]) for c in (
          "input_min_abs", "input_max_abs", "norm_min", "norm_max")))],
      index=conformance.index, dtype=object)


CLASS_RANK: dict[str, int] = {c: i for i, c in enumerate(
    (UNLISTED, *SEVERITIES, UNCLASSIFIED, STALE))}


def worst_class(classes: Iterable[str]) -> str:
  """The most harmful of ``classes`` ("" when there are none)."""
  return min(classes, key=lambda c: CLASS_RANK.get(c, len(CLASS_RANK)), default="")


def _classified(conformance: pd.DataFrame) -> pd.DataFrame:
  """The divergent rows with their ``class`` (derived from the case data), ``scope`` and
  ``entry`` (the manifest entry behind a deviation: op, rule, reason and its listed class; for
  an unlisted failure, its op and rule)."""
  own = case_classes(conformance)
  classes = [severity_class(o, s) for o, s in zip(conformance["outcome"], own)]
  rows = conformance.assign(**{"class": classes, "scope": scopes(conformance)})
  rows = rows[rows["class"].notna()].copy()
  rows["reason"] = rows["reason"].str.replace(_MANIFEST_OBSERVED, "", regex=True)
  rows["entry"] = list(zip(rows["op"], rows["rule"].astype(str), rows["reason"],
                           rows["severity"]))
  return rows


def severity_table(conformance: pd.DataFrame) -> pd.DataFrame:
  """Per implementation (in summary order), the devices it ran on and, per class of
  :data:`SEVERITY_CLASSES`, the number of cases (column ``<class>``), of those on everyday
  inputs and at the range's edge (``<class> everyday``, ``<class> edge``) and of distinct
  entries (``<class> entries``)."""
  rows = _classified(conformance)
  placed = devices_of(conformance)
  out = []
  for impl in implementations(conformance)["impl"]:
    mine = rows[rows["impl"] == impl]
    record: dict[str, object] = {"impl": impl, "device": placed.get(impl, "")}
    for cls in SEVERITY_CLASSES:
      of_class = mine[mine["class"] == cls]
      record[cls] = len(of_class)
      record[f"{cls} everyday"] = int((of_class["scope"] == EVERYDAY).sum())
      record[f"{cls} edge"] = int((of_class["scope"] == RANGE_EDGE).sum())
      record[f"{cls} entries"] = of_class["entry"].nunique()
    out.append(record)
  return pd.DataFrame(out, columns=["impl", "device", *(c for cls in SEVERITY_CLASSES for c in (
      cls, f"{cls} everyday", f"{cls} edge", f"{cls} entries"))])


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


VERDICT_COLUMNS: tuple[str, ...] = ("verdict", "worst", "everyday", "edge")


def verdict(rows: pd.DataFrame) -> tuple[str, str]:
  """(phrase, worst everyday class) of one implementation's results rows."""
  found = verdict_parts(rows)
  return found["verdict"], found["worst"]


def verdict_parts(rows: pd.DataFrame) -> dict[str, str]:
  """One implementation's verdict: unlisted failures first, then the worst class on everyday
  inputs, then the worst at the range's edges, then stale
  manifest entries; ``conforms`` when none. ``worst`` is the class that colours it (unlisted
  failures, else the worst everyday class, else ``conforms``... ``n/a``); ``everyday`` and
  ``edge`` are the worst classes of each scope ("" for none)."""
  if rows.empty:
    return {"verdict": "not checked", "worst": "n/a", "everyday": "", "edge": ""}
  divergent = _classified(rows)
  listed = divergent[~divergent["class"].isin((UNLISTED, STALE))]
  everyday = worst_class(listed.loc[listed["scope"] == EVERYDAY, "class"])
  edge = worst_class(listed.loc[listed["scope"] == RANGE_EDGE, "class"])
  parts = []
  unlisted = int(rows["outcome"].isin(UNLISTED_OUTCOMES).sum())
  if unlisted:
    parts.append(f"{unlisted} unlisted failure{'s' if unlisted > 1 else ''}")
  if everyday or edge:
    parts.append(f"everyday: {SEVERITY_VERDICTS[everyday] if everyday else 'conforms'}")
  if edge:
    parts.append(f"range edge: {SEVERITY_VERDICTS[edge]}")
  stale = int((rows["outcome"] == "unexpected-pass").sum())
  if stale:
    parts.append(f"{stale} listed case{'s' if stale > 1 else ''} passed (stale manifest)")
  if parts:
    worst = UNLISTED if unlisted else everyday or (edge and "conforms") or STALE
    return {"verdict": "; ".join(parts), "worst": worst, "everyday": everyday, "edge": edge}
  worst = "conforms" if (rows["outcome"] == "pass").any() else "n/a"
  return {"verdict": "conforms" if worst == "conforms" else "nothing applicable",
          "worst": worst, "everyday": "", "edge": ""}


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
  columns = ["impl", "kind", "class", "everyday_class", "everyday_cases", "op", "rule",
             "reason", "cases", "case_names", "dtypes", "max_ulp_error", "norm_ulp_error",
             "max_rel_error", "observed", "reproducer_test_id", "reproducer_chars", "reproducer"]
  if rows.empty:
    return pd.DataFrame(columns=columns)
  out = []
  for (impl, entry), group in rows.groupby(["impl", "entry"], sort=False):
    op, rule, reason, _ = entry
    cls = worst_class(group["class"])
    everyday = group[group["scope"] == EVERYDAY]
    everyday_class = worst_class(everyday["class"])
    # The reproducer shows the entry at its worst, on everyday inputs where it shows there.
    pool = (everyday[everyday["class"] == everyday_class] if len(everyday)
            else group[group["class"] == cls])
    with_repro = pool[pool["reproducer"].str.strip() != ""]
    if with_repro.empty:
      with_repro = group[group["reproducer"].str.strip() != ""]
    chosen = (with_repro.loc[with_repro["reproducer"].str.len().idxmin()]
              if len(with_repro) else pool.iloc[0])
    names = list(dict.fromkeys(group["case"]))
    shown = ", ".join(names[:max_case_names]) + (
        f" and {len(names) - max_case_names} more" if len(names) > max_case_names else "")
    out.append({
        "impl": impl, "kind": group["kind"].iloc[0], "class": cls,
        "everyday_class": everyday_class, "everyday_cases": len(everyday), "op": op,
        "rule": rule,
        "reason": reason or _shortened(_first_text(group["observed"]), max_text_chars),
        "cases": len(group),
        "case_names": shown,
        "dtypes": ", ".join(sorted(set(group["dtype"]) - {""}, key=dtype_sort_key)),
        "max_ulp_error": group["max_ulp_error"].max(),
        "norm_ulp_error": group["norm_ulp_error"].max(),
        "max_rel_error": _numbers(group["rel_error"]).max(),
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

  The verdict columns are :func:`verdict_parts`'; ``max_ulp_error`` is over single-dtype cases
  and ``max_ulp_error_mixed`` over mixed-dtype ones (rule 4 allows these up to about 2**31
  float64 ulps); the speed columns are :func:`speed_summary`'s; the ``sharding_*`` columns
  are :func:`sharding_table`'s. Implementations that were only benchmarked get the verdict
  ``not checked``.
  """
  listed = implementations(conformance)
  if performance is not None and len(performance):
    timed = performance[~performance["impl"].isin(listed["impl"])].drop_duplicates("impl")
    extra = pd.DataFrame({"impl": timed["impl"], "kind": timed["kind"], "library": "",
                          "version": "", "framework": ""})
    listed = pd.concat([listed, extra], ignore_index=True)
    listed["_rank"] = listed["kind"].map(kind_rank)
    listed = listed.sort_values(["_rank"], kind="stable").drop(columns="_rank")
  sharding = sharding_table(conformance).set_index("impl")
  speed = speed_summary(performance, group_of) if performance is not None else None
  rows = []
  for _, impl in listed.iterrows():
    mine = conformance[conformance["impl"] == impl["impl"]]
    counts = mine["outcome"].value_counts()
    accuracy = against_reference(mine)
    mixed = accuracy["dtype"].map(is_mixed_dtype)
    record = {**impl.to_dict(), **verdict_parts(mine),
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
    if speed is not None:
      record.update(speed.loc[impl["impl"]].to_dict() if impl["impl"] in speed.index else {})
    rows.append(record)
  speed_columns = list(speed.columns) if speed is not None else []
  return pd.DataFrame(rows, columns=[
      "impl", "kind", "library", "version", "framework", *VERDICT_COLUMNS, "pass",
      "deviation", "fail", "not_applicable", "max_ulp_error", "max_ulp_error_mixed",
      *SHARDING_COLUMNS, *speed_columns])


def speed_summary(performance: pd.DataFrame,
                  group_of: Callable[[str], str]) -> pd.DataFrame | None:
  """Per implementation (index), per comparison group: ``roofline <group>``, the geometric
  mean of its roofline ratios over every workload of the group it ran, and ``<group>
  workloads``, how many; ``time vs fastest``, the geometric mean over everything it ran of its
  median over the fastest median of the same workload, dtype and device (1: the fastest);
  and, per workload of a group whose implementations share no workload
  (:func:`comparison_sets`), ``roofline <workload>`` (float32 on the CPU where it ran)."""
  if performance is None or performance.empty:
    return None
  frame = performance.assign(_group=performance["workload"].map(group_of))
  keys = ["workload", "dtype", "device"]
  frame["_vs_fastest"] = frame["median_s"] / frame.groupby(keys)["median_s"].transform("min")
  sets = comparison_sets(performance, group_of)
  disjoint = [g for g, common in sets.items() if not common]
  out = {}
  for impl, mine in frame.groupby("impl", sort=False):
    record: dict[str, float] = {}
    for group in sets:
      ran = mine[mine["_group"] == group]
      record[f"roofline {group}"] = geometric_mean(ran["roofline_ratio"])
      record[f"{group} workloads"] = len(ran)
    record["time vs fastest"] = geometric_mean(mine["_vs_fastest"])
    for _, r in frame[frame["_group"].isin(disjoint)].drop_duplicates("workload").iterrows():
      own = mine[mine["workload"] == r["workload"]]
      preferred = own[(own["dtype"] == "float32") & (own["device"] == "cpu")]
      record[f"roofline {r['workload']}"] = geometric_mean(
          (preferred if len(preferred) else own)["roofline_ratio"])
    out[impl] = record
  return pd.DataFrame.from_dict(out, orient="index")


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


SAFE_RANGE_TOLERANCES: tuple[str, ...] = ("material", "rounding")
SAFE_RANGE_TABLE_COLUMNS: tuple[str, ...] = (
    "impl", "kind", "op", "dtype", "norm_type", "tolerance", "low_log2", "high_log2",
    "scan_low_log2", "scan_high_log2", "below", "above", "points", "passing",
    "passing_outside")


def _break_phrase(row: pd.Series | None) -> str:
  """What fails at a point just beyond a range ("" beyond the scan's end)."""
  if row is None:
    return ""
  phrase = SAFE_RANGE_CHECKS.get(row["check"], "") or "off beyond the tolerance"
  rel = row["rel_error"]
  if row["check"] not in ("raised", "finite-outputs") and rel == rel and 0 < rel < math.inf:
    phrase += ", off by " + f"{rel:.0e}".replace("e+00", "").replace("e-0", "e-").replace(
        "e+0", "e+")
  return phrase


def _longest_run(passing: list[bool], exps: list[float]) -> tuple[int, int] | None:
  """(first, last) index of the longest run of passing points; a tie goes to the run
  nearest a norm of 1. None when nothing passes."""
  runs, start = [], None
  for i, ok in enumerate([*passing, False]):
    if ok and start is None:
      start = i
    elif not ok and start is not None:
      runs.append((start, i - 1))
      start = None
  if not runs:
    return None
  return max(runs, key=lambda r: (r[1] - r[0], -min(abs(exps[i]) for i in range(r[0], r[1] + 1))))


def safe_ranges(scan: pd.DataFrame) -> pd.DataFrame:
  """Per implementation, op, dtype, p and tolerance (material, rounding): the longest run of
  scanned norms (log2) over which it conforms, the scan's ends, what fails just below and
  above the run ("" at the scan's end: it conforms to the end), and how many points pass
  outside the run (pass and fail need not be monotone in the norm)."""
  out = []
  order = {name: i for i, name in enumerate(dict.fromkeys(scan["impl"]))}
  for (impl, op, dtype, p), points in scan.groupby(["impl", "op", "dtype", "norm_type"],
                                                   sort=False):
    points = points.sort_values("log2_norm")
    exps = points["log2_norm"].tolist()
    for tolerance in SAFE_RANGE_TOLERANCES:
      passing = (points[tolerance] == "pass").tolist()
      run = _longest_run(passing, exps)
      record = {"impl": impl, "kind": points["kind"].iloc[0], "op": op, "dtype": dtype,
                "norm_type": p, "tolerance": tolerance, "scan_low_log2": exps[0],
                "scan_high_log2": exps[-1], "points": len(points), "passing": sum(passing)}
      if run is None:
        first_fail = points.iloc[0]
        record.update(low_log2=math.nan, high_log2=math.nan, below=_break_phrase(first_fail),
                      above="", passing_outside=0)
      else:
        lo, hi = run
        record.update(low_log2=exps[lo], high_log2=exps[hi],
                      below=_break_phrase(points.iloc[lo - 1] if lo > 0 else None),
                      above=_break_phrase(points.iloc[hi + 1] if hi + 1 < len(points) else None),
                      passing_outside=sum(passing) - (hi - lo + 1))
      out.append(record)
  frame = pd.DataFrame(out, columns=list(SAFE_RANGE_TABLE_COLUMNS))
  frame["_i"] = frame["impl"].map(order)
  frame["_d"] = frame["dtype"].map(dtype_sort_key)
  return (frame.sort_values(["_i", "op", "_d", "norm_type"], kind="stable")
          .drop(columns=["_i", "_d"]).reset_index(drop=True))


def narrowest_ranges(ranges: pd.DataFrame) -> pd.DataFrame:
  """Per implementation and dtype, the op and p whose material range is narrowest (an empty
  range first), with its rounding range beside it: what a user of that dtype can rely on."""
  if ranges.empty:
    return pd.DataFrame(columns=["impl", "dtype", "op", "norm_type", "variants", "low_log2",
                                 "high_log2", "whole_low", "whole_high", "below", "above",
                                 "rounding_low_log2", "rounding_high_log2", "rounding_below",
                                 "rounding_above"])
  material = ranges[ranges["tolerance"] == "material"].copy()
  rounding = ranges[ranges["tolerance"] == "rounding"].set_index(
      ["impl", "op", "dtype", "norm_type"])
  material["_width"] = (material["high_log2"] - material["low_log2"]).fillna(-1)
  rows = []
  for (impl, dtype), group in material.groupby(["impl", "dtype"], sort=False):
    r = group.sort_values("_width", kind="stable").iloc[0]
    tight = rounding.loc[(impl, r["op"], dtype, r["norm_type"])]
    rows.append({
        "impl": impl, "dtype": dtype, "op": r["op"], "norm_type": r["norm_type"],
        "variants": len(group), "low_log2": r["low_log2"], "high_log2": r["high_log2"],
        "whole_low": r["low_log2"] == r["scan_low_log2"],
        "whole_high": r["high_log2"] == r["scan_high_log2"], "below": r["below"],
        "above": r["above"], "rounding_low_log2": tight["low_log2"],
        "rounding_high_log2": tight["high_log2"], "rounding_below": tight["below"],
        "rounding_above": tight["above"]})
  return pd.DataFrame(rows)
