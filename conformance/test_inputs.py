"""Rule 12 (inputs are not modified) and outputs on the input's device."""

from __future__ import annotations

import pytest

from clipbench.conformance.cases import case_named
from clipbench.conformance.rules import Violation
from clipbench.conformance.running import SESSION, call, not_applicable

CASES = ("clip_3_4_to_1", "random_float32", "large_batch_interleaved", "tie_3_4")


def mutation_cases(impl, op):
  out = []
  for name in CASES:
    case = case_named(name)
    if op not in case.ops:
      continue
    inputs = SESSION.inputs(case, op)
    reason = not_applicable(impl, op, inputs)
    if reason is None and impl.capabilities.in_place:
      reason = "declares itself in-place"
    out.append((name, case, reason, "+".join(sorted(inputs.dtypes))))
  return out


def device_cases(impl, op):
  reason = "numpy has no devices" if impl.framework == "numpy" else None
  case = case_named("clip_3_4_to_1")
  inputs = SESSION.inputs(case, op)
  return [("clip_3_4_to_1", case, reason or not_applicable(impl, op, inputs), "float32")]


def verify_not_modified(impl, op, inputs):
  outcome = call(impl, op, inputs)
  outcome.raise_if_error()
  if outcome.mutated:
    raise Violation(f"modified its input leaves {outcome.mutated} without declaring in-place")


def verify_device(impl, op, inputs):
  outcome = call(impl, op, inputs)
  outcome.raise_if_error()
  if not outcome.devices_ok:
    raise Violation("returned leaves on another device than their inputs")


@pytest.mark.conformance(rule=12, cases=mutation_cases)
def test_rule12_inputs_are_not_modified(target, check):
  inputs = SESSION.inputs(target.payload, target.op)
  check(target, lambda: verify_not_modified(target.impl, target.op, inputs), inputs)


@pytest.mark.conformance(rule=12, cases=device_cases)
def test_rule12_outputs_stay_on_the_input_device(target, check):
  inputs = SESSION.inputs(target.payload, target.op)
  check(target, lambda: verify_device(target.impl, target.op, inputs), inputs)
