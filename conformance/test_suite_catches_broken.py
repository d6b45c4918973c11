"""The suite tests itself: each deliberately broken implementation is caught by its rule.

A conformance suite that catches nothing passes everything; here every defect in
``broken.py`` must make at least one check of the named rule fail with a rule violation
(not with an error of the suite).
"""

from __future__ import annotations

import pytest

from clipbench.conformance import broken, rules
from clipbench.conformance import test_bad_input as bad_input
from clipbench.conformance import test_batch_invariance as batch_invariance
from clipbench.conformance import test_inputs as inputs_tests
from clipbench.conformance import test_sharding as sharding_tests
from clipbench.conformance.cases import cases_for
from clipbench.conformance.running import SESSION, not_applicable
from clipbench.conformance.sharding.checks import NotApplicable
from clipbench.impls import registry


def _checks(impl, op, rule):
  """Every check of ``rule`` the suite would run on (impl, op), as zero-argument callables."""
  if rule in rules.VERIFY:
    for case in cases_for(rule, op):
      if not_applicable(impl, op, SESSION.inputs(case, op)) is None:
        yield case.name, lambda case=case: rules.VERIFY[rule](impl, op, case)
  if rule == 11:
    for name, (variant, inputs), reason, _ in batch_invariance.variants(impl, op):
      if reason is None:
        yield name, lambda v=variant, i=inputs: batch_invariance.verify(impl, op, v, i)
  if rule == 12:
    for name, case, reason, _ in inputs_tests.device_cases(impl, op):
      if reason is None:
        yield name, lambda case=case: inputs_tests.verify_device(impl, op, case)
    for name, case, reason, _ in inputs_tests.mutation_cases(impl, op):
      if reason is None:
        yield name, lambda case=case: inputs_tests.verify_not_modified(
            impl, op, SESSION.inputs(case, op))
  if rule == 14:
    for name, _, reason, _ in sharding_tests.sharding_cases(impl, op):
      if reason is None:
        yield name, lambda name=name: _applicable_only(
            lambda: sharding_tests.verify(impl, op, name))
  for name, bad, reason, _ in bad_input.bad_inputs(rule)(impl, op):
    if reason is None:
      yield name, lambda bad=bad: bad_input.verify_rejected(impl, op, bad)


def _applicable_only(check):
  """Runs ``check``; a layout the engine cannot express is no violation (nor a pass)."""
  try:
    return check()
  except NotApplicable:
    return None


def first_violation(impl, rule):
  for op in impl.ops:
    for name, run in _checks(impl, op, rule):
      try:
        run()
      except AssertionError as e:
        return f"{op}/{name}: {str(e).splitlines()[0]}"
  return None


@pytest.mark.parametrize("name", sorted(broken.CAUGHT_BY))
def test_suite_catches_broken_implementation(name):
  impl = registry.load(f"clipbench.conformance.broken:{name}")
  rule = broken.CAUGHT_BY[name]
  caught = first_violation(impl, rule)
  assert caught is not None, (
      f"broken implementation {name!r} ({type(impl.obj).__doc__.splitlines()[0]}) passed "
      f"every rule-{rule} check: the suite would miss this defect")


def test_reference_is_caught_by_nothing():
  """The control: the reference passes the same checks the broken ones fail."""
  impl = registry.load("reference")
  for rule in sorted(set(broken.CAUGHT_BY.values())):
    assert first_violation(impl, rule) is None
