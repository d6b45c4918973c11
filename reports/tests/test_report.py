"""The report builder on recorded results (reports/tests/data, made by make_fixtures.py)."""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import shutil

import pandas as pd
import pytest

from clipbench import files
from clipbench.reports import build, render, results, tables

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
CONFORMANCE = os.path.join(DATA, "conformance.csv")
BENCHMARKS = os.path.join(DATA, "benchmarks.json")
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
                       run_facts=(("Command", "`clipbench report --reuse`"),))


@pytest.fixture(scope="module")
def report(sources) -> build.Report:
  return build.build(sources, generated=NOW)


# --- reading ---------------------------------------------------------------------------------

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


def test_summary_verdicts(report):
  summary = report.tables["summary"].set_index("impl")
  assert summary.loc["reference", "verdict"] == "conforms"
  assert summary.loc["optax.clip_by_global_norm", "verdict"] == (
      "conforms except listed deviations")
  assert summary.loc["tmpmod:impl", "verdict"] == "fails"
  assert summary.loc["clipbench.numba", "verdict"] == "not checked"  # benchmarked only
  assert list(summary.index[:2]) == ["reference", "clipbench.jax"]


def test_divergences_failures_first(report):
  div = report.tables["divergences"]
  assert list(div["outcome"].iloc[:3]) == ["fail", "error", "unexpected-pass"]
  assert (div["outcome"] == "deviation").sum() == 4


# --- rendering -------------------------------------------------------------------------------

def test_html_is_self_contained_and_complete(report):
  text = render.to_html(report.document)
  assert "<script" not in text.lower()
  assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
  assert "@import" not in text and "url(" not in text
  assert text.count("data:image/png;base64,") == 3  # two size families + roofline bars
  for anchor in ("summary", "conformance", "accuracy", "performance", "divergences",
                 "history", "machine"):
    assert f'id="{anchor}"' in text
  # The reason of a cell is both a tooltip and a visible footnote it links to.
  assert re.search(r'title="1 pass, 1 deviation \| 0/0 when norm == max == 0 gives NaN"', text)
  assert re.search(r'<sup><a href="#note-\d+">\[\d+\]</a></sup>', text)
  assert "torch.nn.utils.clip_grad_norm_([p], 5.0)" in text  # a reproducer
  assert "Fixture CPU @ 2.60GHz" in text and "9.6 GB/s" in text
  assert "Rule 3" not in text or "At or below the threshold" in text


def test_markdown_has_the_same_content(report):
  md = render.to_markdown(report.document)
  html_text = render.to_html(report.document)
  for needle in ("## Conformance matrix", "| optax.clip_by_global_norm |", "deviation [",
                 "```python\nimport numpy as np\nimport optax", "## Divergence catalogue",
                 "aaaaaaaa 2026-11-20", "Measured memory bandwidth"):
    assert needle in md
  for plot in render.plots_of(report.document):
    assert f"]({render.image_path(plot)})" in md
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
  assert {"index.html", "REPORT.md", "conformance.csv", "conformance_matrix.csv",
          "accuracy.csv", "performance.csv", "divergences.csv", "versions.csv",
          "asv_history.csv", "plots"} <= names
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
