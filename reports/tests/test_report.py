"""The report builder on recorded results (reports/tests/data, made by make_fixtures.py)."""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import shutil

import numpy as np
import pandas as pd
import pytest

from clipbench import files
from clipbench.reports import build, machine, render, results, tables
from clipbench.schema import CONFORMANCE_COLUMNS, SEVERITIES

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
CONFORMANCE = os.path.join(DATA, "conformance.csv")
BENCHMARKS = os.path.join(DATA, "benchmarks.json")
SAFE_RANGE = os.path.join(DATA, "safe_range.csv")
ASV = os.path.join(DATA, "asv_results")
NOW = datetime.datetime(2026, 11, 22, 1, 2, 3, tzinfo=datetime.timezone.utc)


@pytest.fixture(scope="module")
def conformance() -> pd.DataFrame:
  return results.read_conformance(CONFORMANCE)


@pytest.fixture(scope="module")
def bench() -> results.BenchmarkRun:
  return results.read_benchmarks(BENCHMARKS)


@pytest.fixture(scope="module")
def sources(conformance, bench) -> build.Sources:
  return build.Sources(conformance=conformance, conformance_path=CONFORMANCE, benchmarks=bench,
                       asv_history=results.read_asv_history(ASV),
                       safe_range=results.read_safe_range(SAFE_RANGE),
                       run_facts=(("Command", "`clipbench report --reuse`"),))


@pytest.fixture(scope="module")
def report(sources) -> build.Report:
  return build.build(sources, generated=NOW)


# --- reading ---------------------------------------------------------------------------------

def test_tables_read_with_the_one_schema(conformance, bench):
  from clipbench import schema
  from clipbench.conformance import results as written
  assert tuple(conformance.columns) == schema.CONFORMANCE_COLUMNS
  assert tuple(bench.frame.columns) == schema.BENCHMARK_COLUMNS
  assert written.to_csv([]).strip() == ",".join(schema.CONFORMANCE_COLUMNS)
  for name in ("OUTCOMES", "CONFORMANCE_COLUMNS", "BENCHMARK_COLUMNS"):
    assert getattr(results, name) is getattr(schema, name)  # imported, not declared again


def test_read_conformance_types(conformance):
  assert set(conformance["outcome"]) <= set(results.OUTCOMES)
  assert conformance["max_ulp_error"].dtype == float
  assert math.isinf(conformance["max_ulp_error"].max())
  multi_line = conformance.loc[conformance["reproducer"] != "", "reproducer"]
  assert any("\n" in r and '"' in r for r in multi_line)  # CSV quoting survived


@pytest.mark.parametrize("content, expected", [
    (b"", "empty file"),
    (b"\x00\xff\xfe garbage \x00", "not a readable CSV file"),
    (b"a,b\n1,2\n", "missing column(s) impl, rule, outcome"),
    (b"impl,rule,outcome\nx,1,passed\n", "line 2: unknown outcome 'passed'"),
    (b"impl,rule,outcome,max_ulp_error\nx,1,pass,\nx,2,pass,lots\n",
     "line 3: column max_ulp_error: expected a number, got 'lots'"),
])
def test_corrupt_conformance_file_names_file_and_reason(tmp_path, content, expected):
  path = tmp_path / "conformance.csv"
  path.write_bytes(content)
  with pytest.raises(results.ResultsError) as e:
    results.read_conformance(path)
  assert str(path) in str(e.value) and expected in str(e.value)


def test_missing_results_file_says_how_to_make_it(tmp_path):
  with pytest.raises(results.ResultsError, match="no such file.*clipbench conform"):
    results.read_conformance(tmp_path / "nope.csv")
  with pytest.raises(results.ResultsError, match="no such file.*clipbench bench"):
    results.read_benchmarks(tmp_path / "nope.json")


def _bench_with(tmp_path, mutate) -> str:
  with open(BENCHMARKS, encoding="utf-8") as f:
    data = json.load(f)
  mutate(data)
  path = tmp_path / "benchmarks.json"
  path.write_text(json.dumps(data))
  return str(path)


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d.pop("benchmarks"), "no 'benchmarks' list"),
    (lambda d: d["benchmarks"][0]["extra_info"].pop("impl"), "missing extra_info.impl"),
    (lambda d: d["benchmarks"][1]["stats"].update(median=None),
     "stats.median must be a positive number"),
    (lambda d: d["benchmarks"][2]["extra_info"].update(bandwidth_gbs=0),
     "extra_info.bandwidth_gbs must be a positive number"),
])
def test_corrupt_benchmark_file(tmp_path, mutate, expected):
  path = _bench_with(tmp_path, mutate)
  with pytest.raises(results.ResultsError) as e:
    results.read_benchmarks(path)
  assert path in str(e.value) and expected in str(e.value)


def test_truncated_benchmark_json(tmp_path):
  path = tmp_path / "benchmarks.json"
  path.write_text(open(BENCHMARKS, encoding="utf-8").read()[:500])
  with pytest.raises(results.ResultsError, match="not valid JSON"):
    results.read_benchmarks(path)


def test_benchmark_summary_speedup(bench):
  s = bench.summary.set_index(["workload", "dtype", "impl"])
  # Fixture: W1-model float32, clipbench.jax 0.16 s/GB, the fastest library (torch) 0.30 s/GB.
  assert s.loc[("W1-model", "float32", "clipbench.jax"), "speedup_vs_best_library"] == (
      pytest.approx(0.30 / 0.16))
  assert s.loc[("W1-model", "float32", "torch.clip_grad_norm_"), "roofline_ratio"] == (
      pytest.approx(0.30 * 9.6))
  assert s.loc[("W1-model", "float32", "clipbench.numba"), "kind"] == "own"


def test_asv_history(sources):
  history = sources.asv_history
  assert history["commit"].nunique() == 2
  assert set(history["impl"]) == {"clipbench.jax", "optax.clip_by_global_norm", ""}
  assert not history["params"].str.contains("cuda").any()  # skipped (NaN) cases dropped
  summary = tables.asv_summary(history)
  ratio = summary["track_roofline_ratio"]
  assert ratio.loc["clipbench.jax"].iloc[0] == pytest.approx(math.sqrt(1.6 * 9.0))
  assert ratio.loc["clipbench.jax"].iloc[1] == pytest.approx(0.8 * math.sqrt(1.6 * 9.0))
  assert summary["track_max_ulp_error"].loc["optax.clip_by_global_norm"].tolist() == [1.0, 1.0]
  # A benchmark without parameters (the machine's bandwidth) has no implementation.
  assert summary["track_bandwidth_gbs"].loc[""].tolist() == pytest.approx([9.6, 10.6])


def test_corrupt_asv_results_file(tmp_path):
  shutil.copytree(ASV, tmp_path / "asv")
  bad = next((tmp_path / "asv" / "fixture-machine").glob("aaaa*.json"))
  bad.write_text("{not json")
  with pytest.raises(results.ResultsError, match=re.escape(str(bad))):
    results.read_asv_history(tmp_path / "asv")


def test_no_asv_folder_is_an_empty_history(tmp_path):
  assert results.read_asv_history(tmp_path / "missing").empty


# --- tables ----------------------------------------------------------------------------------

@pytest.mark.parametrize("outcomes, status", [
    (["pass", "pass"], "pass"),
    (["pass", "deviation", "not-applicable"], "deviation"),
    (["deviation", "fail"], "fail"),
    (["pass", "unexpected-pass"], "fail"),
    (["error"], "fail"),
    (["not-applicable"], "n/a"),
])
def test_cell_status(outcomes, status):
  assert tables.cell_status(outcomes) == status


def test_matrix_cells(conformance):
  matrix = tables.conformance_matrix(conformance).set_index(["impl", "rule"])
  assert matrix.loc[("optax.clip_by_global_norm", "3"), "status"] == "deviation"
  assert "0/0" in matrix.loc[("optax.clip_by_global_norm", "3"), "reasons"]
  assert matrix.loc[("optax.clip_by_global_norm", "2"), "status"] == "n/a"
  assert matrix.loc[("optax.clip_by_global_norm", "2"), "reasons"] == "not per-system"
  assert matrix.loc[("kups.MaxStepSize", "6"), "status"] == "fail"
  assert "manifest out of date" in matrix.loc[("kups.MaxStepSize", "6"), "reasons"]
  assert matrix.loc[("tmpmod:impl", "12"), "status"] == "fail"
  assert matrix.loc[("reference", "3"), "status"] == "pass"
  rules = tables.rules(conformance)
  assert rules[:3] == ["1", "2", "3"] and rules[-2:] == ["13", "transform"]


def test_accuracy_table(conformance):
  acc = tables.accuracy_table(conformance).set_index(["impl", "op", "dtype"])
  row = acc.loc[("optax.clip_by_global_norm", "clip_grad_norm", "float32")]
  assert (row["max_ulp_error"], row["norm_ulp_error"]) == (1.0, 2.4)
  assert math.isinf(acc.loc[("optax.clip_by_global_norm", "clip_grad_norm", "float16"),
                            "max_ulp_error"])


def test_summary_verdicts_name_the_worst_class(report):
  summary = report.tables["summary"].set_index("impl")
  assert summary.loc["reference", "verdict"] == "conforms"
  # optax has a rounding-level deviation too; its verdict names the most harmful class.
  assert summary.loc["optax.clip_by_global_norm", "verdict"] == "everyday: silent wrong values"
  # Listed as rounding-level, but max / (norm + 1e-6) at a norm of 0.01 is 1e-4 off.
  assert summary.loc["torch.clip_grad_norm_", "verdict"] == "everyday: precision (within 1e-3)"
  assert summary.loc["tmpmod:impl", "verdict"] == "2 unlisted failures"
  assert summary.loc["kups.MaxStepSize", "verdict"] == "1 listed case passed (stale manifest)"
  assert summary.loc["clipbench.numba", "verdict"] == "not checked"  # benchmarked only
  assert list(summary.index[:2]) == ["reference", "clipbench.jax"]


def test_severity_table_counts_cases_and_entries(report):
  severity = report.tables["severity"].set_index("impl")
  optax = severity.loc["optax.clip_by_global_norm"]
  assert (optax["silent-wrong-value"], optax["silent-wrong-value entries"]) == (2, 2)
  assert (optax["silent-wrong-value everyday"], optax["silent-wrong-value edge"]) == (2, 0)
  assert (optax["rounding-level"], optax[tables.UNLISTED]) == (1, 0)
  assert severity.loc["torch.clip_grad_norm_", "rounding-level"] == 1
  assert severity.loc["torch.clip_grad_norm_", "precision"] == 1
  tf = severity.loc["tensorflow.clip_by_global_norm"]
  assert (tf["silent-wrong-value everyday"], tf["silent-wrong-value edge"]) == (0, 1)
  assert severity.loc["tmpmod:impl", tables.UNLISTED] == 2  # a fail and an error
  assert severity.loc["kups.MaxStepSize", tables.STALE] == 1
  assert severity.loc["reference"].drop(
      ["device", *(c for c in severity.columns if c.endswith("entries"))]).sum() == 0
  assert set(severity["device"]) == {"cpu"}  # a table written before the device axis


def test_summary_leads_with_the_severity_table_most_harmful_first(report):
  md = render.to_markdown(report.document)
  summary = md.index("## Summary")
  table = md.index("| implementation | silent-wrong-value | invalid-input-accepted |", summary)
  assert "| precision | rounding-level |" in md[table:]
  assert table < md.index("### Verdict, accuracy and speed") < md.index("## Conformance matrix")
  header = md[table:md.index("\n", table)]
  assert header.index(tables.UNLISTED) > header.index("rounding-level")
  assert "| optax.clip_by_global_norm | 2 / 0 (2) | 0 | 0 | 0 | 0 | 1 / 0 (1) | 0 |" in md
  assert "| tensorflow.clip_by_global_norm | 0 / 1 (1) | 0 | 0 | 0 | 0 | 0 | 0 |" in md
  html_text = render.to_html(report.document)
  assert 'class="num sev-silent-wrong-value"' in html_text  # the harmful cell stands out


def test_results_without_severity_are_unclassified(conformance):
  # Results older than the severity field recorded no case data either.
  older = conformance.assign(severity="", input_class="", result="", rel_error=math.nan)
  severity = tables.severity_table(older).set_index("impl")
  assert severity.loc["optax.clip_by_global_norm", tables.UNCLASSIFIED] == 3
  assert severity.loc["tmpmod:impl", tables.UNLISTED] == 2
  summary = tables.implementation_summary(older, None).set_index("impl")
  assert summary.loc["optax.clip_by_global_norm", "verdict"] == (
      "everyday: unclassified deviations")
  md = render.to_markdown(build.build(build.Sources(conformance=older), generated=NOW).document)
  assert f"| {tables.UNCLASSIFIED} |" in md or f" {tables.UNCLASSIFIED} |" in md


def test_everyday_failures_and_range_edge_failures_get_different_verdicts(report):
  """The issue's test: TensorFlow fails only at float32 entries of 1e20, optax at float16
  gradients of 300. The first is everyday-clean with a range-edge defect, the second is an
  everyday silent wrong value; their safe ranges say where each breaks."""
  summary = report.tables["summary"].set_index("impl")
  tf, optax = summary.loc["tensorflow.clip_by_global_norm"], summary.loc[
      "optax.clip_by_global_norm"]
  assert tf["verdict"] == "everyday: conforms; range edge: silent wrong values"
  assert (tf["everyday"], tf["edge"]) == ("", "silent-wrong-value")
  assert optax["verdict"] == "everyday: silent wrong values"
  assert (optax["everyday"], optax["worst"]) == ("silent-wrong-value", "silent-wrong-value")
  ranges = report.tables["safe_ranges"].set_index(["impl", "dtype", "tolerance"])
  tf16 = ranges.loc[("tensorflow.clip_by_global_norm", "float16", "material")]
  assert (tf16["low_log2"], tf16["high_log2"]) == (-23, 15)  # every point of the scan
  assert ranges.loc[("tensorflow.clip_by_global_norm", "float32", "material"), "high_log2"] == 62
  optax16 = ranges.loc[("optax.clip_by_global_norm", "float16", "material")]
  assert (optax16["low_log2"], optax16["high_log2"]) == (-23, 7)
  assert optax16["above"] == "NaN, inf or zeros"
  md = render.to_markdown(report.document)
  table = md[md.index("### Safe ranges"):]
  tf_row = next(line for line in table.splitlines()
                if line.startswith("| tensorflow.clip_by_global_norm |"))
  assert tf_row == ("| tensorflow.clip_by_global_norm | the whole range | "
                    "up to 4.6e+18 (above: wrong norm) |")
  optax_row = next(line for line in table.splitlines()
                   if line.startswith("| optax.clip_by_global_norm |"))
  assert optax_row.startswith("| optax.clip_by_global_norm | up to 1.3e+02 (above: NaN, inf "
                              "or zeros) |")
  # The sentences at the top: everyday verdict, safe range, speed, worst everyday finding.
  top = md[md.index("## Summary"):md.index("### Which library can corrupt an update")]
  tf_line = next(line for line in top.splitlines()
                 if line.startswith("**tensorflow.clip_by_global_norm**"))
  assert tf_line.startswith("**tensorflow.clip_by_global_norm**: everyday inputs: conforms "
                            "(range edge: silent wrong values); within 1e-3 for norms in "
                            "float16 the whole range, float32 up to 4.6e+18")
  assert "worst everyday finding" not in tf_line
  optax_line = next(line for line in top.splitlines()
                    if line.startswith("**optax.clip_by_global_norm**"))
  assert optax_line.startswith("**optax.clip_by_global_norm**: everyday inputs: silent wrong "
                               "values; within 1e-3 for norms in float16 up to 1.3e+02")
  assert "× the fastest time; worst everyday finding: [clip_grad_norm R" in optax_line
  assert "](reproducers/optax-clip-by-global-norm.md#clip-grad-norm-rule" in optax_line


def test_unknown_severity_is_an_error(tmp_path):
  path = tmp_path / "conformance.csv"
  path.write_text("impl,rule,outcome,severity\nx,1,deviation,harmless\n")
  with pytest.raises(results.ResultsError, match="line 2: unknown severity 'harmless'"):
    results.read_conformance(path)


def test_catalogue_one_row_per_entry_most_harmful_first(report):
  catalogue = report.tables["divergences"]
  assert list(catalogue["class"]) == [
      tables.UNLISTED, tables.UNLISTED, "silent-wrong-value", "silent-wrong-value",
      "silent-wrong-value", "precision", "rounding-level", "rounding-level", tables.STALE]
  assert catalogue["cases"].sum() == 9


def test_catalogue_groups_cases_of_one_entry_and_keeps_the_shortest_reproducer(conformance):
  extra = conformance[conformance["outcome"] == "deviation"].head(1)
  many = pd.concat([extra.assign(case=f"c{i}", reproducer="x = 1\n" * (i + 1))
                    for i in range(30)], ignore_index=True)
  catalogue = tables.divergence_catalogue(many, max_case_names=5)
  assert len(catalogue) == 1
  row = catalogue.iloc[0]
  assert row["cases"] == 30 and row["reproducer"] == "x = 1\n"
  assert row["case_names"] == "c0, c1, c2, c3, c4 and 25 more"
  long = tables.divergence_catalogue(many.assign(reproducer="y" * 5000))
  assert long.iloc[0]["reproducer"] == "y" * 5000 and long.iloc[0]["reproducer_chars"] == 5000


# --- rendering -------------------------------------------------------------------------------

def test_html_is_self_contained_and_complete(report):
  text = render.to_html(report.document)
  assert "<script" not in text.lower()
  assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
  assert "@import" not in text and "url(" not in text
  # Two size families + roofline bars, linked as the PNG files written beside the page.
  images = re.findall(r'<img alt="[^"]*" src="(plots/[^"]+\.png)"', text)
  assert sorted(images) == sorted(render.image_path(p) for p in render.plots_of(report.document))
  assert len(images) == 3 and "base64" not in text
  for anchor in ("summary", "severity", "conformance", "accuracy", "performance",
                 "divergences", "history", "machine"):
    assert f'id="{anchor}"' in text
    assert f'href="#{anchor}"' in text  # the table of contents links every section
  # The reason of a cell is both a tooltip and a visible footnote it links to.
  assert re.search(r'title="1 pass, 1 deviation \| 0/0 when norm == max == 0 gives NaN"', text)
  assert re.search(r'<sup><a href="#note-\d+">\[\d+\]</a></sup>', text)
  # Each catalogue entry links its reproducer: a section of its implementation's page.
  linked = re.findall(r'<a href="(reproducers/[^"#]+\.md)#([^"]+)">', text)
  assert linked and {path for path, _ in linked} == set(report.reproducers)
  for path, anchor in linked:
    assert f'<a id="{anchor}"></a>' in report.reproducers[path]
  assert any("torch.nn.utils.clip_grad_norm_([p], 5.0)" in page
             for page in report.reproducers.values())
  assert "Fixture CPU @ 2.60GHz" in text and "9.6 GB/s" in text
  assert "Rule 3" not in text or "At or below the threshold" in text


def test_html_catalogue_collapsed_and_wide_tables_scroll(report):
  text = render.to_html(report.document)
  catalogue = text[text.index('id="divergences"'):]
  assert catalogue.count("<details>") == len(report.tables["divergences"])
  assert "<details open" not in catalogue
  assert text.count("<table") == text.count('<div class="scroll"><table')
  assert "div.scroll{overflow-x:auto" in text


def test_rule_titles_come_from_the_protocol(sources, monkeypatch):
  monkeypatch.setattr(build, "RULES", {3: "A title only the protocol knows"})
  md = render.to_markdown(build.build(sources, generated=NOW).document)
  assert "R3 A title only the protocol knows" in md
  assert "At or below the threshold" not in md  # SPEC.md's prose is not parsed


def test_accuracy_table_marks_the_mixed_dtype_allowance(report):
  accuracy = report.tables["accuracy"].set_index(["impl", "op", "dtype"])
  assert accuracy.loc[("clipbench.jax", "clip_by_global_norm", "float32+float64"),
                      "mixed_allowance"]
  assert not accuracy.loc[("optax.clip_by_global_norm", "clip_grad_norm", "float16"),
                          "mixed_allowance"]  # inf ulps within one dtype is no allowance
  md = render.to_markdown(report.document)
  assert "| 1.5e+09 / 0 [1] |" in md and "mixed-dtype allowance" in md
  summary = report.tables["summary"].set_index("impl")
  assert summary.loc["clipbench.jax", "max_ulp_error"] == 0.5  # one dtype apart from mixed
  assert "1.5e+09 (mixed-dtype allowance)" in md


def test_benchmark_spread_is_read(bench):
  row = bench.frame.set_index(["impl", "workload", "dtype"]).loc[
      ("clipbench.jax", "W1-model", "float32")]
  assert row["iqr_s"] == pytest.approx(row["median_s"] * 0.02)
  assert row["rounds"] == 11


def test_every_timing_shows_verdict_spread_and_direction(report):
  md = render.to_markdown(report.document)
  section = md[md.index("### W1-model"):md.index("### W2-relax")]
  assert ("| median time (lower is better) | IQR | rounds | GB/s (higher is better) | "
          "roofline ratio (lower is better) |") in section
  optax = next(line for line in section.splitlines()
               if line.startswith("| optax.clip_by_global_norm | library | float32"))
  assert "| 90.6 ms | 1.81 ms | 11 |" in optax
  assert optax.endswith("| everyday: silent wrong values |")
  torch = next(line for line in section.splitlines()
               if line.startswith("| torch.clip_grad_norm_ | library | float32"))
  assert torch.endswith("| everyday: precision (within 1e-3) |")


def _summary_table_columns(md: str) -> dict[str, list[str]]:
  """The summary's "Verdict, accuracy and speed" table, column by column."""
  section = md[md.index("### Verdict, accuracy and speed"):md.index("## Conformance matrix")]
  lines = [line for line in section.splitlines() if line.startswith("| ")]
  cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in lines]
  return {name: [row[i] for row in cells[1:]] for i, name in enumerate(cells[0])}


def test_speed_per_group_over_what_each_ran_with_its_count(report, bench):
  summary = report.tables["summary"].set_index("impl")
  ratios = bench.summary.set_index(["impl", "workload", "dtype"])["roofline_ratio"]
  jax_global = [ratios[("clipbench.jax", w, d)] for w in ("W1-model", "W4-many-small")
                for d in ("float32", "bfloat16")]
  assert summary.loc["clipbench.jax", "roofline global"] == pytest.approx(
      math.exp(np.mean(np.log(jax_global))))
  assert summary.loc["clipbench.jax", "global workloads"] == 4
  assert summary.loc["clipbench.numba", "global workloads"] == 2  # no bfloat16 timing
  assert summary.loc["kups.ClipByGlobalNorm", "global workloads"] == 0
  assert summary.loc["kups.ClipByGlobalNorm", "per-system workloads"] == 4
  # numba is the fastest wherever it ran; jax is the fastest in bfloat16, where numba is absent.
  assert summary.loc["clipbench.numba", "time vs fastest"] == pytest.approx(1.0)
  assert summary.loc["optax.clip_by_global_norm", "time vs fastest"] > 1
  columns = _summary_table_columns(render.to_markdown(report.document))
  assert columns["roofline ratio, per-system (geomean over the workloads run; count)"][
      list(summary.index).index("kups.ClipByGlobalNorm")].endswith("(4)")
  for name, values in columns.items():
    assert any(v not in ("–", "") for v in values), f"column {name!r} is all dashes"


def test_groups_without_a_common_workload_get_a_column_per_workload(report, bench):
  # kups ran only W2, the others only W3: the per-system group shares nothing.
  disjoint = bench.summary[~(((bench.summary["impl"] == "kups.ClipByGlobalNorm") &
                              (bench.summary["workload"] == "W3-relax-large")) |
                             ((bench.summary["impl"] != "kups.ClipByGlobalNorm") &
                              (bench.summary["workload"] == "W2-relax")))]
  assert tables.comparison_sets(disjoint, build.workload_group)["per-system"] == []
  summary = tables.implementation_summary(report.tables["conformance"], disjoint,
                                          build.workload_group).set_index("impl")
  assert summary.loc["kups.ClipByGlobalNorm", "roofline W2-relax"] > 0
  assert math.isnan(summary.loc["kups.ClipByGlobalNorm", "roofline W3-relax-large"])
  assert summary.loc["clipbench.jax", "roofline W3-relax-large"] > 0
  blocks = build._summary_section(summary.reset_index(), None,
                                  tables.comparison_sets(disjoint, build.workload_group))
  md = render.to_markdown(render.Document("t", tuple(blocks)))
  assert "| roofline ratio, W2-relax | roofline ratio, W3-relax-large |" in md


def test_log_axis_over_many_decades_has_one_label_per_decade():
  from matplotlib.figure import Figure
  from clipbench.reports import plots
  ax = Figure().subplots()
  ax.set_xscale("log")
  ax.set_xlim(0.8, 5000)
  plots.readable_log_axis(ax.xaxis, 0.8, 5000)
  ticks = [t for t in ax.get_xticks() if 0.8 <= t <= 5000]
  assert ticks == [1, 10, 100, 1000]
  ax.set_xlim(0.8, 20)
  plots.readable_log_axis(ax.xaxis, 0.8, 20)
  assert [t for t in ax.get_xticks() if 0.8 <= t <= 20] == [1, 2, 5, 10, 20]


def test_machine_names_the_vector_extensions_and_mkl_path(report):
  # Verdicts at a rule's limit move with them: a report must say which it ran with.
  assert machine.vector_extensions("fpu sse4_2 avx2 fma avx512f", "") == (
      "AVX-512, AVX2, FMA, SSE4.2; MKL_CBWR unset (MKL picks its code path by the CPU)")
  assert machine.vector_extensions("fpu sse4_2 avx2 fma", "COMPATIBLE") == (
      "AVX2, FMA, SSE4.2; MKL_CBWR=COMPATIBLE")
  assert machine.vector_extensions("", "").startswith("unknown;")
  assert "- **Vector extensions**: " in render.to_markdown(report.document)


def test_markdown_has_the_same_content(report):
  md = render.to_markdown(report.document)
  html_text = render.to_html(report.document)
  for needle in ("## Conformance matrix", "| optax.clip_by_global_norm |", "deviation [",
                 "## Divergence catalogue",
                 "aaaaaaaa 2026-11-20", "Measured memory bandwidth"):
    assert needle in md
  for plot in render.plots_of(report.document):
    assert f"]({render.image_path(plot)})" in md
  for path in report.reproducers:  # the catalogue links each reproducer page in both
    assert f"]({path}#" in md and f'href="{path}#' in html_text
  # Every footnote number used in a cell is defined once, in both renderings.
  used = set(re.findall(r"deviation \[(\d+)\]", md))
  assert used and all(f'id="note-{n}"' in md and f'id="note-{n}"' in html_text for n in used)


def test_markdown_escapes_table_pipes():
  doc = render.Document("t", (render.Table(("a",), (("x | y",),)),))
  assert "x \\| y" in render.to_markdown(doc)


def test_report_without_benchmarks_or_conformance():
  only_conf = build.build(build.Sources(conformance=results.read_conformance(CONFORMANCE)),
                          generated=NOW)
  assert "No benchmark results." in render.to_markdown(only_conf.document)
  nothing = build.build(build.Sources(), generated=NOW)
  md = render.to_markdown(nothing.document)
  assert "No conformance results." in md and "No benchmark results." in md


def test_only_impls(sources):
  kept = build.only_impls(sources, ["optax.clip_by_global_norm"])
  assert set(kept.conformance["impl"]) == {"optax.clip_by_global_norm"}
  assert set(kept.benchmarks.summary["impl"]) == {"optax.clip_by_global_norm"}
  assert set(kept.asv_history["impl"]) == {"optax.clip_by_global_norm"}


# --- writing ---------------------------------------------------------------------------------

def test_write_dated_and_latest(tmp_path, report):
  first = build.write(report, str(tmp_path), "2026-11-22_010203")
  second = build.write(report, str(tmp_path), "2026-11-22_010203")
  assert os.path.basename(first) == "2026-11-22_010203"
  assert os.path.basename(second) == "2026-11-22_010203-2"
  latest = tmp_path / "latest"
  names = set(os.listdir(latest))
  assert {"index.html", "REPORT.md", "conformance.csv.gz", "conformance_matrix.csv",
          "accuracy.csv", "performance.csv", "divergences.csv", "severity.csv",
          "versions.csv", "asv_history.csv", "plots"} <= names
  # The results table, compressed, reads back as recorded, per-case reproducers aside.
  full = results.read_conformance(latest / "conformance.csv.gz")
  recorded = results.read_conformance(CONFORMANCE)
  pd.testing.assert_frame_equal(full.drop(columns="reproducer"),
                                recorded.drop(columns="reproducer"))
  assert len(os.listdir(latest / "plots")) == 3
  assert (latest / "index.html").read_text() == open(os.path.join(second, "index.html")).read()
  assert oct(os.stat(latest / "index.html").st_mode & 0o777) != oct(0o600)
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary left
  matrix = pd.read_csv(latest / "conformance_matrix.csv", dtype=str, keep_default_na=False)
  assert set(matrix["status"]) == set(tables.STATUSES)


def test_failed_report_leaves_latest_untouched(tmp_path, report, monkeypatch):
  build.write(report, str(tmp_path), "2026-11-22_010203")
  before = (tmp_path / "latest" / "index.html").read_text()

  def broken(_doc):
    raise RuntimeError("renderer broke halfway")

  monkeypatch.setattr(render, "to_html", broken)
  with pytest.raises(RuntimeError):
    build.write(report, str(tmp_path), "2026-11-22_020000")
  assert (tmp_path / "latest" / "index.html").read_text() == before
  assert sorted(os.listdir(tmp_path)) == ["2026-11-22_010203", "latest"]


def test_atomic_write_keeps_old_file_on_error(tmp_path):
  path = tmp_path / "table.csv"
  files.write_text(path, "old\n")
  with pytest.raises(RuntimeError):
    with files.atomic_open(path, "w", encoding="utf-8") as f:
      f.write("new, half")
      raise RuntimeError("crash mid-write")
  assert path.read_text() == "old\n"
  assert os.listdir(tmp_path) == ["table.csv"]


def test_write_csv_that_fails_to_render_keeps_old_file(tmp_path):
  path = tmp_path / "t.csv"
  files.write_text(path, "old\n")

  class Broken(pd.DataFrame):
    def to_csv(self, *args, **kwargs):
      raise ValueError("cannot render")

  with pytest.raises(ValueError):
    files.write_csv(path, Broken({"a": [1]}))
  assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["t.csv"]


def test_copy_dir_atomically_replaces_whole_folder(tmp_path):
  src = tmp_path / "src"
  src.mkdir()
  (src / "a.txt").write_text("new")
  dst = tmp_path / "dst"
  dst.mkdir()
  (dst / "stale.txt").write_text("old")
  files.copy_dir_atomically(str(src), str(dst))
  assert sorted(os.listdir(dst)) == ["a.txt"]
  assert sorted(os.listdir(tmp_path)) == ["dst", "src"]


# --- size ------------------------------------------------------------------------------------

REPORT_MD_LIMIT = 300 * 1024  # bytes: REPORT.md reads on GitHub at a glance
FILE_LIMIT = 500 * 1024  # bytes: GitHub's diff limit per file


def large_conformance(impls: int = 12, entries: int = 12, cases: int = 25,
                      passes: int = 500) -> pd.DataFrame:
  """A results table shaped like a full run of every library, larger: thousands of divergent
  rows, each with a reproducer of several kilobytes (the committed report of 708 such rows
  had a 1.15 MB REPORT.md)."""
  rng = np.random.default_rng(0)
  classes = list(SEVERITIES)
  rows = []
  for i in range(impls):
    impl = f"library{i}.clip"
    base = {"impl": impl, "kind": "library", "library": f"library{i}", "version": "1.0",
            "framework": "numpy", "op": "clip_grad_norm", "dtype": "float32",
            "max_ulp_error": 3.0, "norm_ulp_error": 1.0, "duration_s": 0.01}
    for j in range(passes):
      rows.append({**base, "rule": str(j % 13 + 1), "case": f"case{j}", "outcome": "pass",
                   "test_id": f"conformance/test_rules.py::test[{impl}-case{j}]"})
    for e in range(entries):
      for c in range(cases):
        values = ", ".join(repr(float(v)) for v in rng.standard_normal(int(rng.integers(50, 600))))
        rows.append({
            **base, "rule": str(e % 13 + 1), "case": f"entry{e}_case{c}",
            "outcome": "fail" if e == 0 else "deviation",
            "severity": "" if e == 0 else classes[e % len(classes)],
            "reason": "" if e == 0 else f"reason {e} of {impl}: " + "why " * 30,
            "observed": "system 0: " + "observed detail " * 30,
            "reproducer": f"import numpy as np\nleaves = [np.array([{values}])]\nassert False",
            "test_id": f"conformance/test_rules.py::test_rule{e % 13 + 1}"
                       f"[{impl}-entry{e}_case{c}]"})
  frame = pd.DataFrame(rows)
  for column in CONFORMANCE_COLUMNS:
    if column not in frame:
      frame[column] = ""
  return frame[list(CONFORMANCE_COLUMNS)].fillna("")


def large_safe_range(impls: int = 24) -> pd.DataFrame:
  """A safe-range scan larger than a full default one: every dtype, op and p of every
  implementation at every binade of the default steps, half the points failing with a
  message."""
  rows = []
  for i in range(impls):
    for dtype, exps in (("float16", range(-23, 16, 2)), ("bfloat16", range(-132, 128, 8)),
                        ("float32", range(-148, 128, 8)), ("float64", range(-1073, 1024, 64))):
      for op, p in (("clip_grad_norm", "1"), ("clip_grad_norm", "2"), ("clip_grad_norm", "3"),
                    ("clip_grad_norm", "inf"), ("clip_by_max_step", "step")):
        for e in exps:
          bad = e > 0
          rows.append({"impl": f"lib{i}.clip", "kind": "library", "library": f"lib{i}",
                       "version": "1.0", "op": op, "dtype": dtype, "norm_type": p,
                       "log2_norm": e, "threshold": repr(2.0 ** (e - 1)),
                       "rounding": "fail" if bad else "pass",
                       "material": "fail" if bad else "pass",
                       "rel_error": repr(0.5 if bad else 0.0), "check": "bound" if bad else "",
                       "observed": (f"system 0: output norm {2.0 ** e:.12g} > max "
                                    f"{2.0 ** (e - 1):.12g} (by 3.2e+05 ulp): strict bound "
                                    "broken") if bad else ""})
  return pd.DataFrame(rows)


def test_report_of_a_large_run_fits_where_people_read_it(tmp_path, bench):
  conformance = large_conformance()
  divergent = conformance["outcome"].isin(["fail", "deviation"]).sum()
  assert divergent >= 3000 and conformance["reproducer"].str.len().sum() > 10 * FILE_LIMIT
  path = tmp_path / "conformance.csv"
  conformance.to_csv(path, index=False)
  scan_path = tmp_path / "safe_range.csv"
  large_safe_range().to_csv(scan_path, index=False)
  report = build.build(build.Sources(conformance=results.read_conformance(path),
                                     benchmarks=bench,
                                     safe_range=results.read_safe_range(scan_path)),
                       generated=NOW)
  build.write_folder(report, str(tmp_path / "out"))
  sizes = {os.path.relpath(os.path.join(root, name), tmp_path / "out"):
           os.path.getsize(os.path.join(root, name))
           for root, _, names in os.walk(tmp_path / "out") for name in names}
  assert sizes["REPORT.md"] < REPORT_MD_LIMIT, sizes
  assert max(sizes.values()) < FILE_LIMIT, sizes
  assert "safe_range.csv.gz" in sizes and "### Safe ranges" in (tmp_path / "out" /
                                                                "REPORT.md").read_text()
  # Every case is in the compressed table; the catalogue shows one reproducer per entry.
  full = results.read_conformance(tmp_path / "out" / "conformance.csv.gz")
  assert len(full) == len(conformance) and (full["case"] == conformance["case"]).all()
  catalogue = pd.read_csv(tmp_path / "out" / "divergences.csv", keep_default_na=False)
  assert len(catalogue) == 12 * 12 and catalogue["cases"].sum() == divergent
  # One reproducer per entry, on its implementation's page, each linked from the catalogue.
  written = sorted(p for p in sizes if p.startswith("reproducers/"))
  assert written == sorted({f.split("#")[0] for f in catalogue["reproducer_file"]})
  pages = "".join((tmp_path / "out" / p).read_text() for p in written)
  assert all(f'<a id="{f.split("#")[1]}"></a>' in pages for f in catalogue["reproducer_file"])
  assert pages.count("```python") == len(catalogue)


# --- sharding (rule 14) ----------------------------------------------------------------------
def _rule14_row(impl: str, case: str, outcome: str, observed: str, max_ulp: float,
                norm_ulp: float) -> dict:
  return {**{c: "" for c in CONFORMANCE_COLUMNS}, "impl": impl, "kind": "library",
          "framework": "jax", "op": "clip_grad_norm", "rule": "14", "case": case,
          "dtype": "float32", "outcome": outcome, "observed": observed,
          "max_ulp_error": max_ulp, "norm_ulp_error": norm_ulp}


def test_summary_has_a_sharding_column_per_implementation(conformance, sources):
  differs = ("sharded vs unsharded (jax.jit): outputs differ by up to 2 ulp, norms by 1 ulp; "
             "decision changed; bound held (leaves[0] element 0)")
  rule14 = pd.DataFrame([
      _rule14_row("optax.clip_by_global_norm", "rows-even-2-p2", "pass", "identical bits",
                  0.0, 0.0),
      _rule14_row("optax.clip_by_global_norm", "leaves-on-devices-2-p2", "not-applicable", "",
                  math.nan, math.nan),
      _rule14_row("kups.MaxStepSize", "rows-even-2-p2", "pass", "identical bits", 0.0, 0.0),
      _rule14_row("kups.MaxStepSize", "rows-uneven-4-p2", "deviation", differs, 2.0, 1.0)])
  # Rule 14's differences are sharded against unsharded: far above every accuracy error
  # here, they must stay out of the summary's and the accuracy table's ulp errors.
  rule14.loc[3, "max_ulp_error"] = 1e9
  with_rule14 = pd.concat([conformance, rule14], ignore_index=True)
  report = build.build(build.Sources(conformance=with_rule14, conformance_path=CONFORMANCE),
                       generated=NOW)
  summary = report.tables["summary"].set_index("impl")
  assert summary.loc["optax.clip_by_global_norm", "sharding_cases"] == 1
  assert summary.loc["optax.clip_by_global_norm", "sharding_identical"] == 1
  assert summary.loc["kups.MaxStepSize", "sharding_decision_changed"] == 1
  assert summary.loc["kups.MaxStepSize", "sharding_bound_broken"] == 0
  assert summary.loc["reference", "sharding_cases"] == 0
  assert summary.loc["kups.MaxStepSize", "max_ulp_error"] == 0.5
  accuracy = tables.accuracy_table(with_rule14)
  assert not ((accuracy["impl"] == "kups.MaxStepSize") &
              (accuracy["op"] == "clip_grad_norm")).any()
  md = render.to_markdown(report.document)
  header = next(line for line in md.splitlines() if line.startswith("| implementation | kind"))
  assert "| sharding |" in header
  assert "identical bits (1 cases)" in md
  cell = next(line for line in md.splitlines()
              if line.startswith("| kups.MaxStepSize | library |"))
  assert "1 of 2 cases differ" in cell and "decision changed in 1; bound held" in cell
  assert "not run" in md


# --- a run on a GPU (--device cuda) ------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_report(conformance, tmp_path_factory) -> build.Report:
  """The recorded results as if run with ``--device cuda``: every case on the card, every
  benchmark timed there at its recorded time, on a card of 4,000 GB/s measured at 3,200."""
  with open(BENCHMARKS, encoding="utf-8") as f:
    data = json.load(f)
  for bench in data["benchmarks"]:
    bench["extra_info"].update(device="cuda", bandwidth_gbs=3200.0)
  data["machine_info"]["cuda"] = {"name": "NVIDIA Test 80GB", "peak_gbs": 4000.0,
                                  "software": "torch 9.9, CUDA 99.0"}
  path = tmp_path_factory.mktemp("gpu") / "benchmarks.json"
  path.write_text(json.dumps(data))
  on_gpu = conformance.assign(device="cuda")
  return build.build(build.Sources(conformance=on_gpu, conformance_path=CONFORMANCE,
                                   benchmarks=results.read_benchmarks(path)), generated=NOW)


def test_a_gpu_run_shows_the_device_in_the_severity_table_and_the_matrix(gpu_report, report):
  md = render.to_markdown(gpu_report.document)
  severity = md[md.index("## Summary"):md.index("### Verdict, accuracy and speed")]
  assert "| implementation | device | silent-wrong-value |" in severity
  assert "| optax.clip_by_global_norm | cuda | 2 / 0 (2) |" in severity
  matrix = md[md.index("## Conformance matrix"):md.index("## Accuracy")]
  assert "| implementation | device | R" in matrix
  assert "| optax.clip_by_global_norm | cuda |" in matrix
  assert set(gpu_report.tables["severity"]["device"]) == {"cuda"}
  # A CPU run reads as it always did: no device column.
  cpu = render.to_markdown(report.document)
  assert "| implementation | device |" not in cpu and "## GPU" not in cpu


def test_the_gpu_section_gives_achieved_bandwidth_against_peak_and_measured_copy(gpu_report):
  md = render.to_markdown(gpu_report.document)
  section = md[md.index("## GPU"):]
  assert "NVIDIA Test 80GB" in section and "torch 9.9, CUDA 99.0" in section
  assert "4,000 GB/s" in section and "3,200 GB/s" in section and "80.0% of the peak" in section
  table = gpu_report.tables["gpu"]
  row = table[(table["workload"] == "W1-model") & (table["impl"] == "clipbench.jax")].iloc[0]
  achieved = 201326592 / 0.03221225472 / 1e9  # three passes over the median, recorded above
  assert row["gbs"] == pytest.approx(achieved)
  assert row["of_peak"] == pytest.approx(achieved / 4000.0)
  assert row["of_copy"] == pytest.approx(achieved / 3200.0)
  assert f"| {100 * achieved / 4000:.1f}% | {100 * achieved / 3200:.1f}% |" in section
