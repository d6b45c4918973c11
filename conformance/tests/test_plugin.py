"""The conformance plugin as an outside maintainer uses it (issue 15, items 1-5).

The subprocess tests run pytest in a temporary project outside the repository, so they see
exactly what a maintainer who only installed clipbench sees. Each is narrowed to a handful of
cases (``--ops``, ``-k``) to stay fast on two cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pandas as pd
import pytest

from clipbench.conformance import (draft_deviations, manifest, probing, results, rules, running,
                                   summary)
from clipbench.conformance.cases import case_named
from clipbench.impls import registry
from clipbench.protocol import as_capabilities
from clipbench.schema import CONFORMANCE_COLUMNS, SEVERITIES

# An implementation built on the reference (so it conforms), with a switchable defect.
_OUTSIDE_MODULE = '''
import time
import numpy as np
from clipbench import reference

class Impl:
  framework = "numpy"
  name = "tmpimpl"

  def __init__(self, bug=None):
    self.bug = bug

  def clip_grad_norm(self, leaves, max_norm, *, norm_type=2.0, nonfinite="propagate"):
    if self.bug == "hang" and max_norm == 5.0:  # the tie_3_4 cases; the preflight passes
      time.sleep(60)
    if self.bug == "three":
      return leaves, None, None
    out, norm = reference.clip_grad_norm(leaves, max_norm, norm_type=norm_type,
                                         nonfinite=nonfinite)
    if self.bug == "zeros":
      out = [np.zeros_like(x) for x in out]
    return out, norm

impl = Impl()
zeros = Impl("zeros")
hang = Impl("hang")
three = Impl("three")
'''


def _pytest(tmp_path, *args, timeout=600):
  (tmp_path / "tmpmod.py").write_text(_OUTSIDE_MODULE)
  cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "clipbench",
         "--pyargs", "clipbench.conformance", "--ops", "clip_grad_norm",
         "--results", str(tmp_path / "out.csv"), *args]
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
  done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
                        env=env)
  return done.returncode, done.stdout + done.stderr


def test_plugin_runs_an_outside_implementation_from_another_folder(tmp_path):
  rc, out = _pytest(tmp_path, "--impl", "tmpmod:impl", "-k", "rule3 and tie_3_4")
  assert rc == 0, out
  assert "unrecognized arguments" not in out
  table = pd.read_csv(tmp_path / "out.csv", dtype=str, keep_default_na=False)
  assert set(table.impl) == {"tmpimpl"}  # keyed by the implementation's own name
  assert set(table.outcome) == {"pass"} and len(table) >= 3
  # What the case showed is recorded whether it passes or not: [3, 4] with max 5.
  tie = table[table.case == "tie_3_4"].iloc[0]
  assert (tie.input_class, tie.result, tie.rel_error) == ("finite", "returned", "0.0")
  assert (float(tie.input_min_abs), float(tie.input_max_abs)) == (3.0, 4.0)
  assert float(tie.norm_min) == float(tie.norm_max) == pytest.approx(5.0)


def test_failures_are_one_line_each_with_the_draft_command(tmp_path):
  rc, out = _pytest(tmp_path, "--impl", "tmpmod:zeros", "-k", "rule4 and (clip_3_4 or one_el)")
  assert rc == 1, out
  failure_lines = [line for line in out.splitlines() if line.startswith("  tmpimpl ")]
  assert len(failure_lines) == 2, out
  assert all("clip_grad_norm" in line for line in failure_lines)
  assert "rule 4: 2 failures" in out
  assert "def run(" not in out and "Reproducer" not in out  # no fixture source, no snippet
  assert len(out.splitlines()) < 30, out
  assert "python -m clipbench.conformance.draft_deviations" in out
  # A zeroed update is as far off as an update can be: the relative error of a silent wrong value.
  failed = pd.read_csv(tmp_path / "out.csv", dtype=str, keep_default_na=False)
  failed = failed[failed.outcome == "fail"]
  assert set(failed.result) == {"returned"} and set(failed.rel_error) == {"inf"}, failed
  verbose_rc, verbose = _pytest(tmp_path, "--impl", "tmpmod:zeros", "-k", "rule4 and clip_3_4",
                                "-v")
  assert verbose_rc == 1 and "Reproducer" in verbose
  # The reproducer runs on its own and shows the departure, loading the implementation by its
  # spec (its name, "tmpimpl", is registered nowhere).
  table = pd.read_csv(tmp_path / "out.csv", dtype=str, keep_default_na=False)
  (tmp_path / "repro.py").write_text(table.reproducer[table.outcome == "fail"].iloc[0])
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
  done = subprocess.run([sys.executable, "repro.py"], cwd=tmp_path, capture_output=True,
                        text=True, timeout=300, env=env)
  assert "registry.load('tmpmod:zeros')" in (tmp_path / "repro.py").read_text()
  assert done.returncode == 1 and "AssertionError" in done.stderr, done.stdout + done.stderr
  assert "unknown implementation" not in done.stdout + done.stderr


def test_timeout_records_the_stuck_case_as_an_error_and_moves_on(tmp_path):
  rc, out = _pytest(tmp_path, "--impl", "tmpmod:hang", "--timeout", "0.5", "-k",
                    "rule3 and (tie_3_4_float16 or below_threshold_41)", timeout=120)
  assert rc == 1, out
  assert ("[error] tmpimpl clip_grad_norm tie_3_4_float16: impl tmpimpl: clip_grad_norm: no "
          "result within --timeout 0.5 s") in out
  table = pd.read_csv(tmp_path / "out.csv", dtype=str, keep_default_na=False)
  outcomes = dict(zip(table.case, table.outcome))
  assert outcomes == {"tie_3_4_float16": "error", "below_threshold_41": "pass"}


def test_beside_pytest_timeout_the_per_call_limit_is_clipbench_timeout(tmp_path):
  # A stand-in for pytest-timeout, loaded after clipbench's plugin, adding --timeout in its
  # own group: two such options break argparse when the command line is parsed.
  (tmp_path / "pytest_timeout.py").write_text(textwrap.dedent("""
      def pytest_addoption(parser):
        parser.getgroup("timeout").addoption("--timeout", type=float, help="per test")
      """))
  rc, out = _pytest(tmp_path, "-p", "pytest_timeout", "--impl", "tmpmod:hang",
                    "--clipbench-timeout", "0.5", "-k",
                    "rule3 and (tie_3_4_float16 or below_threshold_41)", timeout=120)
  assert rc == 1, out
  assert "conflicting option string" not in out
  table = pd.read_csv(tmp_path / "out.csv", dtype=str, keep_default_na=False)
  assert dict(zip(table.case, table.outcome)) == {"tie_3_4_float16": "error",
                                                  "below_threshold_41": "pass"}


def test_preflight_blames_a_wrong_return_convention_in_one_message(tmp_path):
  rc, out = _pytest(tmp_path, "--impl", "tmpmod:three", "-k", "rule3")
  assert rc == 1, out
  assert ("impl tmpimpl: clip_grad_norm returned a 3-tuple; the canonical return is "
          "(leaves, total_norm)") in out
  assert out.count("3-tuple") == 1, out


def _outside(obj, name="outside") -> registry.Implementation:
  return registry.Implementation(
      name=name, target=name, kind="outside", library=name, available=True, obj=obj,
      framework=obj.framework, capabilities=as_capabilities(getattr(obj, "capabilities", None)))


class _PerSystemOffByOne:
  """Per-system clipping that declares nothing; system k gets the factor of system k - 1."""

  framework = "numpy"

  def clip_by_global_norm(self, leaves, max_norm, *, segments=None, num_systems=None):
    if segments is None:
      segments, num_systems = [np.zeros(x.shape[0], np.int64) for x in leaves], 1
    squares = np.zeros(num_systems)
    for x, s in zip(leaves, segments):
      np.add.at(squares, s, np.sum(np.square(x.astype(np.float64)).reshape(len(x), -1), 1))
    norms = np.sqrt(squares)
    factor = np.where(norms > max_norm, max_norm / np.where(norms > 0, norms, 1.0), 1.0)
    factor = np.roll(factor, 1)
    out = [np.where(factor[s].reshape((-1,) + (1,) * (x.ndim - 1)) == 1.0, x,
                    x * factor[s].reshape((-1,) + (1,) * (x.ndim - 1))).astype(x.dtype)
           for x, s in zip(leaves, segments)]
    return out, norms.astype(np.float32)


def test_probe_finds_per_system_support_and_the_suite_catches_the_bug():
  impl = _outside(_PerSystemOffByOne())
  case = case_named("large_batch_interleaved")
  inputs = running.SESSION.inputs(case, "clip_by_global_norm")
  # Undeclared, the batch case was "not per-system" and the bug went unseen.
  assert running.not_applicable(impl, "clip_by_global_norm", inputs) == "not per-system"
  found = probing.probe(impl)
  assert found.found["per_system"] is True
  assert found.capabilities.per_system
  impl.capabilities = found.capabilities
  assert running.not_applicable(impl, "clip_by_global_norm", inputs) is None
  with pytest.raises(rules.Violation):
    rules.VERIFY[4](impl, "clip_by_global_norm", case)


class _GlobalOnly:
  framework = "numpy"

  def clip_grad_norm(self, leaves, max_norm):
    return [x.copy() for x in leaves], np.float32(0.0)


def test_probe_respects_signatures_and_declarations():
  found = probing.probe(_outside(_GlobalOnly()))
  assert found.found["norm_types"] == (2.0,) and found.found["nonfinite"] == ("propagate",)
  declared = _GlobalOnly()
  declared.capabilities = {"norm_types": "any"}
  found = probing.probe(_outside(declared))
  assert "norm_types" not in found.found and found.capabilities.any_norm_type


def test_preflight_message_names_the_implementation_and_the_convention():
  three = type("Three", (), {"framework": "numpy",
                             "clip_grad_norm": lambda self, leaves, m: (leaves, 1.0, 2.0)})()
  assert probing.preflight(_outside(three, "mylib"), "clip_grad_norm") == (
      "impl mylib: clip_grad_norm returned a 3-tuple; the canonical return is "
      "(leaves, total_norm)")
  assert probing.preflight(_outside(_GlobalOnly()), "clip_grad_norm") is None


def test_a_hanging_call_is_abandoned_after_the_timeout():
  release = threading.Event()
  hang = type("Hang", (), {"framework": "numpy", "clip_grad_norm":
                           lambda self, leaves, m: release.wait(30)})()
  running.set_call_timeout(0.2)
  try:
    outcome = running.call(_outside(hang, "stuck"), "clip_grad_norm",
                           running.SESSION.inputs(case_named("tie_3_4"), "clip_grad_norm"))
  finally:
    running.set_call_timeout(None)
    release.set()
  assert isinstance(outcome.error, running.CallTimeout)
  assert "impl stuck: clip_grad_norm" in str(outcome.error)
  with pytest.raises(running.CallTimeout):
    outcome.raise_if_error()


def _manifest(path, impl, severity="rounding-level", extra=""):
  path.write_text(textwrap.dedent(f'''
      [[deviation]]
      impl = "{impl}"
      rule = 3
      cases = ["tie_*"]
      reason = "a reason"
      severity = "{severity}"
      {extra}
      '''))
  return str(path)


def test_deviation_files_are_merged_with_the_builtin_manifest(tmp_path):
  mine = _manifest(tmp_path / "a.toml", "mylib")
  theirs = _manifest(tmp_path / "b.toml", "otherlib")
  merged = manifest.load_all([mine, theirs])
  builtin = manifest.load()
  assert len(merged) == len(builtin) + 2
  assert manifest.find(merged, "mylib", "clip_grad_norm", 3, "tie_3_4").source == mine
  assert manifest.find(merged, "otherlib", "clip_grad_norm", 3, "tie_3_4").source == theirs
  assert manifest.find(merged, "torch.clip_grad_norm_", "clip_grad_norm", 3, "tie_3_4")


@pytest.mark.parametrize("severity, extra, message", [
    ("bad", "", "severity must be one of"),
    ("rounding-level", 'observed = "x"', "observed is no longer kept"),
])
def test_manifest_entries_need_a_known_severity_and_no_observed(tmp_path, severity, extra,
                                                                 message):
  with pytest.raises(ValueError, match=message):
    manifest.load(_manifest(tmp_path / "m.toml", "mylib", severity, extra))


def test_every_builtin_entry_has_a_severity():
  assert {d.severity for d in manifest.load()} <= set(SEVERITIES)


def test_draft_keys_by_name_and_drafts_generated_cases_non_strict(tmp_path):
  rows = [dict(impl="mylib", op="clip_grad_norm", rule=4, case=c, outcome="fail",
               observed="over the bound") for c in ("clip_3_4_to_1", "one_element",
                                                    "hypothesis_float32")]
  table = tmp_path / "r.csv"
  table.write_text(results.to_csv(rows))
  text = draft_deviations.draft(str(table))
  assert text.count("[[deviation]]") == 2
  assert 'cases = ["clip_3_4_to_1", "one_element"]' in text
  assert 'cases = ["hypothesis_*"]\nstrict = false' in text
  filled = text.replace('"TODO: why (read the reproducers)"', '"why"')
  filled = filled.replace(filled[filled.index('"TODO: one of'):].split("\n")[0],
                          '"rounding-level"')
  (tmp_path / "d.toml").write_text(filled)
  entries = manifest.load(str(tmp_path / "d.toml"))
  assert [d.strict for d in entries] == [True, False]


def test_results_table_has_the_schema_columns():
  header = results.to_csv([]).strip().split(",")
  assert tuple(header) == CONFORMANCE_COLUMNS
  with pytest.raises(ValueError, match="outcome"):
    results.to_csv([{"outcome": "maybe"}])


def test_summary_collapses_one_error_raised_everywhere_into_one_line():
  failures = [summary.Failure("mylib", "clip_grad_norm", rule, f"case{i}",
                              "raised RuntimeError: boom")
              for i, rule in enumerate([3, 3, 4, 5, 7] * 18)]
  failures.append(summary.Failure("mylib", "clip_grad_norm", 4, "clip_3_4_to_1",
                                  "output norm 1.0000001 > max 1"))
  lines = summary.failure_lines(failures)
  assert lines[:2] == ["the same error in several checks:",
                       "  90x mylib clip_grad_norm (rule 3, 4, 5, 7; 90 cases (case0, case1, "
                       "case2, ...)): raised RuntimeError: boom"]
  assert lines[2:] == ["rule 4: 1 failure",
                       "  mylib clip_grad_norm clip_3_4_to_1: output norm 1.0000001 > max 1"]


def test_jax_without_x64_gets_a_hint_to_declare_its_dtypes(monkeypatch):
  float64 = np.dtype(np.float64)
  monkeypatch.setattr(probing, "_holds", lambda impl, dtype: dtype != float64)
  monkeypatch.setattr(probing, "_accepts", lambda *args, **kwargs: True)
  jax_impl = type("JaxClip", (), {"framework": "jax",
                                  "clip_grad_norm": lambda self, leaves, m: (leaves, None)})()
  found = probing.probe(_outside(jax_impl, "jaxlib-user"))
  assert "float64" not in found.capabilities.dtypes
  assert len(found.hints) == 1 and "x64" in found.hints[0] and "dtypes" in found.hints[0]


def test_a_spent_budget_leaves_out_the_rest_saying_so_and_the_cases_go_round_robin(tmp_path):
  rc, out = _pytest(tmp_path, "--impl", "tmpmod:impl", "--budget", "1e-9", "-k",
                    "rule3 or rule4")
  assert rc == 0, out
  table = pd.read_csv(tmp_path / "out.csv", dtype=str, keep_default_na=False)
  ran, left = table[table.outcome == "pass"], table[table.outcome == "not-applicable"]
  assert len(ran) == 1 and len(left) > 10  # the first test spent it
  assert set(left.reason) == {"left out: tmpimpl's tests had taken the --budget of 1e-09 s"}
  rc, out = _pytest(tmp_path, "--impl", "tmpmod:impl", "--budget", "1000", "-k",
                    "rule3 or rule4", "--collect-only", "-q")
  tests = [line.split("[")[0] for line in out.splitlines() if "::test_" in line]
  # The first case of every test, then the second of every test...
  assert len(tests) > 4 and len(set(tests[:4])) == 4, tests[:6]


def test_bad_budget_and_device_are_usage_errors(tmp_path):
  for args, message in ((("--budget", "0"), "--budget: expected a positive number"),
                        (("--device", "tpu"), "--device: expected cpu[:N] or cuda[:N]")):
    rc, out = _pytest(tmp_path, "--impl", "tmpmod:impl", *args, "-k", "rule3")
    assert rc == 4 and message in out, out
