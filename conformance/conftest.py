"""pytest plumbing of the conformance suite: options, parametrization, manifest, results.

Options:
  --impl NAME|package.module:attr   implementations to test (repeatable; default: every
                                    available registered one)
  --ops OP[,OP]                     restrict to these operations
  --profile ci|thorough             hypothesis budget (ci: derandomized and bounded)
  --results PATH                    result table (CSV), written atomically at the end
  --manifest PATH                   the expected-deviation manifest

Each test carries a ``conformance(rule=..., cases=...)`` marker; ``cases(impl, op)`` yields
the test's cases for one implementation and operation as (name, payload, skip reason, dtype).
The generated ids read ``[impl-op-ruleN-case]``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import hypothesis
import pytest

from clipbench import files
from clipbench.conformance import manifest, reproducer, results
from clipbench.conformance.cases import Inputs
from clipbench.conformance.rules import Finding
from clipbench.impls import registry
from clipbench.protocol import OPS

# The ci profile does not shrink: a known deviation fails on every run, and shrinking it
# costs minutes; the failing example is still printed with its reproducer.
hypothesis.settings.register_profile(
    "ci", max_examples=8, derandomize=True, deadline=None, database=None,
    phases=(hypothesis.Phase.explicit, hypothesis.Phase.generate),
    suppress_health_check=list(hypothesis.HealthCheck))
hypothesis.settings.register_profile(
    "thorough", max_examples=150, deadline=None,
    suppress_health_check=list(hypothesis.HealthCheck))


@dataclasses.dataclass
class Target:
  """One conformance check: an implementation, an operation, a rule and a case."""

  impl: registry.Implementation
  op: str
  rule: Any
  case: str
  payload: Any = None
  dtype: str = ""

  @property
  def id(self) -> str:
    rule = f"rule{self.rule}" if isinstance(self.rule, int) else str(self.rule)
    return f"{self.impl.name}-{self.op}-{rule}-{self.case}"


def pytest_addoption(parser):
  group = parser.getgroup("clipbench", "clipbench conformance")
  group.addoption("--impl", action="append", default=None, metavar="NAME|module:attr",
                  help="implementation to test (repeatable); default: all available")
  group.addoption("--ops", default=None, metavar="OP[,OP]",
                  help=f"operations to test, from {', '.join(OPS)}")
  group.addoption("--profile", default="ci", choices=("ci", "thorough"),
                  help="hypothesis budget: ci (derandomized, bounded) or thorough")
  group.addoption("--results", default=os.path.join("results", "conformance.csv"),
                  metavar="PATH", help="where to write the result table (CSV)")
  group.addoption("--manifest", default=manifest.MANIFEST_PATH, metavar="PATH",
                  help="expected-deviation manifest (TOML)")


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "conformance(rule, cases): a conformance check of one SPEC rule")
  hypothesis.settings.load_profile(config.getoption("--profile"))
  try:
    specs = config.getoption("--impl")
    impls = registry.load_many(specs)
  except ValueError as e:
    raise pytest.UsageError(str(e)) from e
  requested_unavailable = [i for i in impls if not i.available and specs]
  if requested_unavailable:
    raise pytest.UsageError("; ".join(f"impl {i.name}: unavailable ({i.reason})"
                                      for i in requested_unavailable))
  ops = config.getoption("--ops")
  selected_ops = tuple(OPS) if not ops else tuple(o.strip() for o in ops.split(","))
  unknown = set(selected_ops) - set(OPS)
  if unknown:
    raise pytest.UsageError(f"--ops: unknown operation(s) {sorted(unknown)}; known: {OPS}")
  try:
    deviations = manifest.load(config.getoption("--manifest"))
  except ValueError as e:
    raise pytest.UsageError(str(e)) from e
  config.clipbench = dict(impls=impls, ops=selected_ops, deviations=deviations, rows=[],
                          results=config.getoption("--results"),
                          repro_dir=os.path.join(
                              os.path.dirname(os.path.abspath(config.getoption("--results"))),
                              "reproducers"))


def pytest_generate_tests(metafunc):
  marker = metafunc.definition.get_closest_marker("conformance")
  if marker is None or "target" not in metafunc.fixturenames:
    return
  state = metafunc.config.clipbench
  rule, cases_fn = marker.kwargs["rule"], marker.kwargs["cases"]
  params = []
  for impl in state["impls"]:
    if not impl.available:
      continue
    for op in impl.ops:
      if op not in state["ops"]:
        continue
      for name, payload, skip_reason, dtype in cases_fn(impl, op):
        target = Target(impl, op, rule, name, payload, dtype)
        marks = []
        if skip_reason:
          marks.append(pytest.mark.skip(reason=skip_reason))
        else:
          deviation = manifest.find(state["deviations"], impl.name, op, rule, name)
          if deviation is not None:
            marks.append(pytest.mark.xfail(
                strict=deviation.strict,
                reason=f"{deviation.reason} (observed: {deviation.observed})"))
        params.append(pytest.param(target, id=target.id, marks=marks))
  metafunc.parametrize("target", params)


@pytest.fixture
def check(request):
  """Runs a rule check; on failure, appends a standalone reproducer to the message."""

  def run(target: Target, fn, inputs: Inputs | None = None) -> Finding | None:
    try:
      finding = fn()
    except AssertionError as e:
      # Only rule violations (and errors the implementation raised, re-raised as assertions
      # by Outcome) are findings; any other exception is a bug of the suite and propagates.
      message = str(e)
      request.node.user_properties.append(("observed", message.splitlines()[0][:300]))
      if inputs is not None:
        text = reproducer.snippet(target.impl.name, target.impl.description, target.op, inputs,
                                  request.config.clipbench["repro_dir"], target.id,
                                  getattr(target.impl.obj, "reproducer", None))
        request.node.user_properties.append(("reproducer", text))
        message += "\n\nReproducer:\n" + text
      raise AssertionError(message) from None
    if isinstance(finding, Finding):
      request.node.user_properties.extend([
          ("max_ulp_error", finding.max_ulp_error), ("norm_ulp_error", finding.norm_ulp_error),
          ("observed", finding.observed)])
    return finding

  return run


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  rep = outcome.get_result()
  target = getattr(item, "callspec", None) and item.callspec.params.get("target")
  if not isinstance(target, Target):
    return
  if rep.when == "call" or (rep.when == "setup" and (rep.skipped or rep.failed)):
    props = dict(item.user_properties)
    if rep.passed:
      # A non-strict listed case that passes (a generated input that missed the defect).
      kind = "pass"
    elif rep.skipped:
      kind = "deviation" if hasattr(rep, "wasxfail") else "not-applicable"
    elif "XPASS(strict)" in str(rep.longrepr):
      kind = "unexpected-pass"
    else:
      kind = "fail" if rep.when == "call" else "error"
    reason = ""
    if kind == "not-applicable" and isinstance(rep.longrepr, tuple):
      reason = rep.longrepr[2].removeprefix("Skipped: ")
    elif hasattr(rep, "wasxfail"):
      reason = rep.wasxfail
    impl = target.impl
    item.config.clipbench["rows"].append(dict(
        impl=impl.name, kind=impl.kind, library=impl.library, version=impl.version,
        framework=impl.framework, op=target.op, rule=target.rule, case=target.case,
        dtype=target.dtype, outcome=kind, max_ulp_error=_num(props.get("max_ulp_error")),
        norm_ulp_error=_num(props.get("norm_ulp_error")),
        observed=props.get("observed", "") if kind != "not-applicable" else "",
        reason=reason, reproducer=props.get("reproducer", ""), test_id=item.nodeid,
        duration_s=f"{rep.duration:.3f}"))


def _num(v) -> str:
  if v is None or (isinstance(v, float) and math.isnan(v)):
    return ""
  return f"{v:.3g}" if isinstance(v, float) else str(v)


def pytest_sessionfinish(session, exitstatus):
  state = getattr(session.config, "clipbench", None)
  if not state or not state["rows"] or session.config.option.collectonly:
    return
  files.write_text(state["results"], results.to_csv(state["rows"]))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
  state = getattr(config, "clipbench", None)
  if not state:
    return
  unavailable = [i for i in state["impls"] if not i.available]
  if unavailable:
    terminalreporter.write_sep("-", "unavailable implementations (not tested)")
    for impl in unavailable:
      terminalreporter.write_line(f"{impl.name}: {impl.reason}")
  if state["rows"]:
    counts: dict[str, int] = {}
    for row in state["rows"]:
      counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    terminalreporter.write_sep("-", "clipbench conformance")
    terminalreporter.write_line(", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    terminalreporter.write_line(f"result table: {state['results']}")
