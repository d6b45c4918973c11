"""The pytest plugin of the conformance suite (entry point ``pytest11: clipbench``).

  pytest --pyargs clipbench.conformance --impl mypkg.clipping:impl
  pytest -p clipbench --pyargs clipbench.conformance --impl ...   # where plugins do not autoload

Options (``pytest --help``, group "clipbench conformance"):
  --impl NAME|package.module:attr   implementations to test (repeatable; default: every
                                    available registered one)
  --ops OP[,OP]                     restrict to these operations
  --profile ci|thorough             hypothesis budget (ci: derandomized and bounded)
  --results PATH                    result table (CSV), written atomically at the end
  --deviations FILE                 your expected deviations, added to clipbench's (repeatable)
  --timeout SECONDS                 per call of an implementation (``--clipbench-timeout``
                                    always; only that where pytest-timeout is installed)
  --device cpu[:N]|cuda[:N]         where every call runs (default: cpu); inputs are moved
                                    there in the implementation's framework
  --budget SECONDS                  per implementation: its cases left once its tests have
                                    taken that long are not run (not applicable, saying so)

Each test carries a ``conformance(rule=..., cases=...)`` marker; ``cases(impl, op)`` yields
the test's cases for one implementation and operation as (name, payload, skip reason, dtype).
The generated ids read ``[impl-op-ruleN-case]``. Nothing is loaded until a conformance test is
collected, so the plugin costs nothing in a session without one.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import math
import os
from typing import Any

import hypothesis
import pytest

from clipbench import devices, files, loading
from clipbench.conformance import manifest, results, summary
from clipbench.impls import registry
from clipbench.protocol import OPS, Capabilities

# The ci profile does not shrink: a known deviation fails on every run, and shrinking it
# costs minutes; the failing example is still printed with its reproducer.
hypothesis.settings.register_profile(
    "ci", max_examples=8, derandomize=True, deadline=None, database=None,
    phases=(hypothesis.Phase.explicit, hypothesis.Phase.generate),
    suppress_health_check=list(hypothesis.HealthCheck))
hypothesis.settings.register_profile(
    "thorough", max_examples=150, deadline=None,
    suppress_health_check=list(hypothesis.HealthCheck))

_HERE = os.path.dirname(os.path.abspath(__file__))
# The suite's own tests, not run against a maintainer's implementation (--impl).
SELF_TESTS = (os.path.join(_HERE, "tests"), os.path.join(_HERE, "test_suite_catches_broken.py"))


@dataclasses.dataclass
class Target:
  """One conformance check: an implementation, an operation, a rule and a case."""

  impl: registry.Implementation
  op: str
  rule: Any
  case: str
  payload: Any = None
  dtype: str = ""
  deviation: manifest.Deviation | None = None

  @property
  def id(self) -> str:
    rule = f"rule{self.rule}" if isinstance(self.rule, int) else str(self.rule)
    return f"{self.impl.name}-{self.op}-{rule}-{self.case}"


@dataclasses.dataclass
class State:
  """What a session knows: implementations (probed), deviations, and what happened."""

  impls: list[registry.Implementation]
  ops: tuple[str, ...]
  deviations: list[manifest.Deviation]
  results: str
  device: devices.Device = devices.HOST
  budget_s: float | None = None  # seconds of tests per implementation (--budget)
  spent_s: dict[str, float] = dataclasses.field(
      default_factory=lambda: collections.defaultdict(float))  # impl name -> seconds of tests
  rows: list[dict] = dataclasses.field(default_factory=list)
  failures: dict[str, summary.Failure] = dataclasses.field(default_factory=dict)  # by nodeid
  preflight: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
  probed: dict[str, Any] = dataclasses.field(default_factory=dict)  # impl name -> Probe


_STATE = pytest.StashKey[State | None]()


def pytest_addoption(parser: pytest.Parser) -> None:
  group = parser.getgroup("clipbench", "clipbench conformance")
  group.addoption("--impl", action="append", default=None, metavar="NAME|module:attr",
                  help="implementation to test (repeatable); default: all available")
  group.addoption("--ops", default=None, metavar="OP[,OP]",
                  help=f"operations to test, from {', '.join(OPS)}")
  group.addoption("--profile", default="ci", choices=("ci", "thorough"),
                  help="hypothesis budget: ci (derandomized, bounded) or thorough")
  group.addoption("--results", default=os.path.join("results", "conformance.csv"),
                  metavar="PATH", help="where to write the result table (CSV)")
  group.addoption("--deviations", action="append", default=[], metavar="FILE",
                  help="your expected-deviation manifest (TOML), added to clipbench's own "
                       "(repeatable); draft one with python -m "
                       "clipbench.conformance.draft_deviations results/conformance.csv")
  group.addoption("--manifest", action="append", default=[], metavar="FILE",
                  help="deprecated alias of --deviations (it now adds to clipbench's list)")
  timeout_help = ("seconds one call of an implementation may take; a longer call is "
                  "recorded as an error naming the case and the run moves on "
                  "(default: no limit)")
  names = ["--clipbench-timeout"] if _pytest_timeout_present() else ["--timeout",
                                                                     "--clipbench-timeout"]
  group.addoption(*names, dest="clipbench_timeout", type=float, default=None,
                  metavar="SECONDS", help=timeout_help)
  group.addoption("--device", dest="clipbench_device", default="cpu",
                  metavar="cpu[:N]|cuda[:N]",
                  help="where every call runs: inputs are built on the host and moved there "
                       "in the implementation's framework, outputs must stay there (default: "
                       "cpu; cuda is JAX's and TensorFlow's gpu; cpu:1 is a second JAX host "
                       "device)")
  group.addoption("--budget", dest="clipbench_budget", type=float, default=None,
                  metavar="SECONDS",
                  help="seconds of tests per implementation: once its tests have taken that "
                       "long, its remaining cases are not run (recorded as not applicable, "
                       "with that reason); the cases run round-robin over the tests, so every "
                       "rule gets its first cases (default: no limit)")


def _pytest_timeout_present() -> bool:
  """Whether pytest-timeout, which owns ``--timeout``, is installed.

  Asked of the installation, not of the plugins registered so far: pytest only catches a
  clash of option names within one group, so two plugins adding ``--timeout`` in their own
  groups break argparse when the options are parsed ("conflicting option string"), in
  whichever order the entry points happened to load.
  """
  return importlib.util.find_spec("pytest_timeout") is not None


def pytest_configure(config: pytest.Config) -> None:
  config.addinivalue_line(
      "markers", "conformance(rule, cases): a conformance check of one SPEC rule")
  timeout = config.getoption("clipbench_timeout")
  if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):
    raise pytest.UsageError(f"--timeout: expected a positive number of seconds, got {timeout}")
  budget = config.getoption("clipbench_budget")
  if budget is not None and not (budget > 0 and math.isfinite(budget)):
    raise pytest.UsageError(f"--budget: expected a positive number of seconds, got {budget}")
  _prepare_device(config)
  if config.getoption("--manifest"):
    config.issue_config_time_warning(pytest.PytestWarning(
        "--manifest is deprecated: use --deviations (it adds to clipbench's list, as "
        "--manifest now does too)"), stacklevel=2)
  config.stash[_STATE] = None
  # Options a user gave are checked at once (a usage error, exit 4); with none given, the
  # implementations load when the first conformance test is collected.
  if config.getoption("--impl") or config.getoption("--deviations") or config.getoption(
      "--manifest") or config.getoption("--ops"):
    state(config)


def _prepare_device(config: pytest.Config) -> None:
  """Checks ``--device`` before anything loads, and sets what the frameworks read once, when
  they start (``devices.requested``: JAX's host device count for ``cpu:N``, memory growth on
  a shared card), before any implementation imports them."""
  try:
    devices.requested(config.getoption("clipbench_device"))
  except ValueError as e:
    raise pytest.UsageError(f"--{e}") from None


def state(config: pytest.Config) -> State:
  """The session's state, built on first use: implementations loaded, checked and probed."""
  existing = config.stash.get(_STATE, None)
  if existing is not None:
    return existing
  from clipbench.conformance import probing, running  # pylint: disable=import-outside-toplevel
  hypothesis.settings.load_profile(config.getoption("--profile"))
  running.set_call_timeout(config.getoption("clipbench_timeout"))
  try:
    specs = config.getoption("--impl")
    impls = registry.load_many(specs)
  except ValueError as e:
    raise pytest.UsageError(str(e)) from e
  requested_unavailable = [i for i in impls if not i.available and specs]
  if requested_unavailable:
    raise pytest.UsageError("; ".join(f"impl {i.name}: unavailable ({i.reason})"
                                      for i in requested_unavailable))
  device = devices.parse(config.getoption("clipbench_device"))
  running.set_device(device)
  refused = loading.mark_off_device(impls, device)
  if refused and specs:
    raise pytest.UsageError("; ".join(f"impl {i.name}: {i.reason}" for i in refused))
  ops = config.getoption("--ops")
  selected_ops = tuple(OPS) if not ops else tuple(o.strip() for o in ops.split(","))
  unknown = set(selected_ops) - set(OPS)
  if unknown:
    raise pytest.UsageError(f"--ops: unknown operation(s) {sorted(unknown)}; known: {OPS}")
  try:
    deviations = manifest.load_all(config.getoption("--deviations") +
                                   config.getoption("--manifest"))
  except ValueError as e:
    raise pytest.UsageError(str(e)) from e
  results_path = config.getoption("--results")
  new = State(impls=impls, ops=selected_ops, deviations=deviations, results=results_path,
              device=device, budget_s=config.getoption("clipbench_budget"))
  for impl in impls:
    if not impl.available:
      continue
    for op in impl.ops:
      if op in selected_ops:
        message = probing.preflight(impl, op)
        if message:
          new.preflight[(impl.name, op)] = message
    if not any(name == impl.name for name, _ in new.preflight):
      found = probing.probe(impl)
      impl.capabilities = found.capabilities
      # Outside implementations are told what was probed; built-in ones only what was found
      # beyond the defaults (their declarations are complete by design).
      shown = found.found if impl.kind == "outside" else {
          k: v for k, v in found.found.items() if getattr(Capabilities(), k) != v}
      if shown or found.hints:
        new.probed[impl.name] = dataclasses.replace(found, found=shown)
  config.stash[_STATE] = new
  return new


def pytest_ignore_collect(collection_path, config: pytest.Config) -> bool | None:
  if config.getoption("--impl") and str(collection_path).startswith(SELF_TESTS):
    return True
  return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
  marker = metafunc.definition.get_closest_marker("conformance")
  if marker is None or "target" not in metafunc.fixturenames:
    return
  session = state(metafunc.config)
  rule, cases_fn = marker.kwargs["rule"], marker.kwargs["cases"]
  params = []
  for impl in session.impls:
    if not impl.available:
      continue
    for op in impl.ops:
      if op not in session.ops or (impl.name, op) in session.preflight:
        continue
      for name, payload, skip_reason, dtype in cases_fn(impl, op):
        target = Target(impl, op, rule, name, payload, dtype)
        marks = []
        if skip_reason:
          marks.append(pytest.mark.skip(reason=skip_reason))
        else:
          target.deviation = manifest.find(session.deviations, impl.name, op, rule, name,
                                           session.device)
          if target.deviation is not None:
            marks.append(pytest.mark.xfail(strict=target.deviation.strict,
                                           reason=target.deviation.reason))
        params.append(pytest.param(target, id=target.id, marks=marks))
  metafunc.parametrize("target", params)


@pytest.fixture
def check(request: pytest.FixtureRequest):
  """Runs a rule check; on failure, appends a standalone reproducer to the message."""
  from clipbench.conformance import measure  # pylint: disable=import-outside-toplevel
  from clipbench.conformance import reproducer  # pylint: disable=import-outside-toplevel
  from clipbench.conformance.rules import Finding  # pylint: disable=import-outside-toplevel
  from clipbench.conformance.running import CallTimeout  # pylint: disable=import-outside-toplevel

  def run(target: Target, fn, inputs=None, *, invalid: bool = False):
    """``invalid``: ``inputs`` are spoiled on purpose (a bad-input test)."""
    props = request.node.user_properties
    if inputs is not None:
      props.extend(measure.input_facts(target.op, inputs, invalid=invalid).items())
    try:
      finding = fn()
    except AssertionError as e:
      # Only rule violations (and errors the implementation raised, re-raised as assertions
      # by Outcome) are findings; any other exception is a bug of the suite and propagates.
      props.extend(getattr(e, "measured", {}).items())
      message = str(e)
      props.append(("observed", message.splitlines()[0][:300] if message else ""))
      if isinstance(e, CallTimeout) or "no result within --timeout" in message:
        props.append(("timed_out", True))
      if inputs is not None:
        # An outside implementation is loaded again by its spec: its own name is not registered.
        spec = target.impl.target if target.impl.kind == "outside" else target.impl.name
        text = reproducer.snippet(spec, target.impl.description, target.op, inputs,
                                  getattr(target.impl.obj, "reproducer", None),
                                  rule=target.rule)
        props.append(("reproducer", text))
        message += "\n\nReproducer:\n" + text
      raise AssertionError(message) from None
    if isinstance(finding, Finding):
      props.extend([
          ("max_ulp_error", finding.max_ulp_error), ("norm_ulp_error", finding.norm_ulp_error),
          ("observed", finding.observed), *finding.measured.items()])
    return finding

  return run


def _target(item: pytest.Item) -> Target | None:
  target = getattr(item, "callspec", None) and item.callspec.params.get("target")
  return target if isinstance(target, Target) else None


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
  """Under ``--budget``, each implementation's cases run round-robin over the tests (the first
  case of every test, then the second...), so a spent budget leaves out the last cases of
  every rule rather than the last rules."""
  if config.getoption("clipbench_budget") is None:
    return
  seen: dict[tuple[str, str], int] = collections.Counter()
  rank = {}
  for item in items:
    target = _target(item)
    if target is None:
      rank[item] = 0
      continue
    key = (item.originalname, target.impl.name)
    rank[item] = seen[key]
    seen[key] += 1
  items.sort(key=rank.__getitem__)  # stable: the tests' own order within a round


def pytest_runtest_setup(item: pytest.Item) -> None:
  target = _target(item)
  if target is None:
    return
  current = state(item.config)
  if current.budget_s is not None and current.spent_s[target.impl.name] >= current.budget_s:
    pytest.skip(f"left out: {target.impl.name}'s tests had taken the --budget of "
                f"{current.budget_s:g} s")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
  rep = yield
  target = _target(item)
  if target is None:
    return rep
  state(item.config).spent_s[target.impl.name] += rep.duration
  if rep.when == "call" or (rep.when == "setup" and (rep.skipped or rep.failed)):
    _record(item, call, rep, target)
  return rep


def _record(item: pytest.Item, call: pytest.CallInfo, rep: pytest.TestReport,
            target: Target) -> None:
  session = state(item.config)
  props = dict(item.user_properties)
  if rep.passed:
    # A non-strict listed case that passes (a generated input that missed the defect).
    kind = "pass"
  elif rep.skipped:
    kind = "deviation" if hasattr(rep, "wasxfail") else "not-applicable"
  elif "XPASS(strict)" in str(rep.longrepr):
    kind = "unexpected-pass"
  elif props.get("timed_out") or rep.when != "call":
    kind = "error"
  else:
    kind = "fail"
  reason = ""
  if kind == "not-applicable" and isinstance(rep.longrepr, tuple):
    reason = rep.longrepr[2].removeprefix("Skipped: ")
  elif hasattr(rep, "wasxfail"):
    reason = rep.wasxfail
  observed = props.get("observed", "") if kind != "not-applicable" else ""
  if kind in ("fail", "error", "unexpected-pass"):
    if kind == "unexpected-pass":
      observed = f"passes, but listed: {target.deviation.reason if target.deviation else ''}"
    elif call.excinfo is not None and not observed:
      observed = f"{call.excinfo.typename}: {str(call.excinfo.value).splitlines()[0][:300]}"
    session.failures[item.nodeid] = summary.Failure(
        target.impl.name, target.op, target.rule, target.case, observed, kind)
    if call.excinfo is not None and call.excinfo.errisinstance(AssertionError):
      # The message (what was observed, and the reproducer) is the whole story: the
      # traceback would only show the suite's own fixture source.
      rep.longrepr = str(call.excinfo.value)
  impl = target.impl
  session.rows.append(dict(
      impl=impl.name, kind=impl.kind, library=impl.library, version=impl.version,
      framework=impl.framework, device=str(session.device), op=target.op, rule=target.rule, case=target.case,
      dtype=target.dtype, outcome=kind,
      severity=target.deviation.severity if target.deviation and kind in (
          "deviation", "unexpected-pass") else "",
      max_ulp_error=_num(props.get("max_ulp_error")),
      norm_ulp_error=_num(props.get("norm_ulp_error")),
      input_class=props.get("input_class", ""), result=props.get("result", ""),
      input_min_abs=_exact(props.get("input_min_abs")),
      input_max_abs=_exact(props.get("input_max_abs")), norm_min=_exact(props.get("norm_min")),
      norm_max=_exact(props.get("norm_max")), rel_error=_exact(props.get("rel_error")),
      observed=observed, reason=reason,
      reproducer=props.get("reproducer", ""), test_id=item.nodeid,
      duration_s=f"{rep.duration:.3f}"))


def _exact(v) -> str:
  """Every digit: an extent rounded to 3 digits could cross the everyday range's ends."""
  return "" if v is None else repr(float(v))


def _num(v) -> str:
  if v is None or (isinstance(v, float) and math.isnan(v)):
    return ""
  return f"{v:.3g}" if isinstance(v, float) else str(v)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
  current = session.config.stash.get(_STATE, None)
  if current is None or session.config.option.collectonly:
    return
  if current.preflight and session.exitstatus in (pytest.ExitCode.OK,
                                                  pytest.ExitCode.NO_TESTS_COLLECTED):
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
  if current.rows:
    files.write_text(current.results, results.to_csv(current.rows))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config):
  current = config.stash.get(_STATE, None)
  hidden: dict[str, list] = {}
  if current is not None and config.get_verbosity() <= 0:
    # One line per failure below instead of pytest's sections (-v shows them in full).
    for key in ("failed", "error"):
      reports = terminalreporter.stats.get(key, [])
      hidden[key] = [r for r in reports if getattr(r, "nodeid", None) in current.failures]
      terminalreporter.stats[key] = [r for r in reports if r not in hidden[key]]
  try:
    return (yield)
  finally:
    for key, reports in hidden.items():
      terminalreporter.stats[key] = terminalreporter.stats.get(key, []) + reports
    if current is not None:
      _write_summary(terminalreporter, current, config)


def _write_summary(tr, current: State, config: pytest.Config) -> None:
  unavailable = [i for i in current.impls if not i.available]
  if unavailable:
    tr.write_sep("-", "unavailable implementations (not tested)")
    for impl in unavailable:
      tr.write_line(f"{impl.name}: {impl.reason}")
  if not current.rows and not current.preflight:
    return
  tr.write_sep("-", "clipbench conformance" + (
      f" on {current.device}" if current.device != devices.HOST else ""))
  for name, found in current.probed.items():
    if found.found:
      tr.write_line(f"impl {name}: undeclared capabilities probed: {found.summary()} "
                    "(declare `capabilities` to fix them)")
    for hint in found.hints:
      tr.write_line(f"hint: {hint}")
  for message in current.preflight.values():
    tr.write_line(f"PREFLIGHT FAILED {message}", red=True)
  if current.failures:
    for line in summary.failure_lines(list(current.failures.values())):
      tr.write_line(line)
  counts: dict[str, int] = {}
  for row in current.rows:
    counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
  tr.write_line(", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
  reasons = [row["reason"] for row in current.rows if row["outcome"] == "not-applicable"]
  if reasons:
    tr.write_line(summary.not_applicable_line(reasons))
  tr.write_line(f"result table: {current.results}")
  if current.failures and config.get_verbosity() <= 0:
    tr.write_line("full messages and reproducers: -v, or the result table's reproducer column")
  if any(f.outcome in ("fail", "error") for f in current.failures.values()):
    tr.write_line("draft the missing deviation entries: python -m "
                  f"clipbench.conformance.draft_deviations {current.results} > "
                  "deviations-draft.toml  (then --deviations deviations-draft.toml)")
