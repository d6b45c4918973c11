"""Rule 12: inputs are not modified (unless in-place), and nothing leaves the device.

Every call runs on the session's device (``--device``, the CPU by default): the inputs are
moved there explicitly, so the outputs must come back there too, and the inputs must still be
there, unmodified, after the call.
"""

from __future__ import annotations

import pytest

from clipbench.conformance.cases import case_named
from clipbench.conformance.rules import Violation
from clipbench.conformance.running import SESSION, call, device, not_applicable

CASES = ("clip_3_4_to_1", "random_float32", "large_batch_interleaved", "tie_3_4")


def _cases(impl, op, refuse, prefix=""):
  """The rule's cases for (impl, op), named ``prefix + case``; ``refuse(impl)`` is a reason
  that rules them all out."""
  out = []
  for name in CASES:
    case = case_named(name)
    if op not in case.ops:
      continue
    inputs = SESSION.inputs(case, op)
    reason = not_applicable(impl, op, inputs) or refuse(impl)
    out.append((prefix + name, case, reason, "+".join(sorted(inputs.dtypes))))
  return out


def mutation_cases(impl, op):
  return _cases(impl, op, lambda i: "declares itself in-place" if i.capabilities.in_place
                else None)


def device_cases(impl, op):
  # Named apart from the mutation cases: a deviation entry names one check or the other.
  return _cases(impl, op, lambda i: "numpy has no devices" if i.framework == "numpy" else None,
                prefix="device-")


def verify_not_modified(impl, op, inputs):
  outcome = call(impl, op, inputs)
  outcome.raise_if_error()
  if outcome.mutated:
    raise Violation(f"modified its input leaves {outcome.mutated} without declaring in-place")


def verify_device(impl, op, case):
  # The session's call of the case, which the rules' checks of the same case read too.
  outcome = SESSION.result(impl, case, op)
  outcome.raise_if_error()
  if outcome.misplaced:
    raise Violation(f"on {device()}: {outcome.misplaced}")


@pytest.mark.conformance(rule=12, cases=mutation_cases)
def test_rule12_inputs_are_not_modified(target, check):
  inputs = SESSION.inputs(target.payload, target.op)
  check(target, lambda: verify_not_modified(target.impl, target.op, inputs), inputs)


@pytest.mark.conformance(rule=12, cases=device_cases)
def test_rule12_outputs_stay_on_the_input_device(target, check):
  inputs = SESSION.inputs(target.payload, target.op)
  check(target, lambda: verify_device(target.impl, target.op, target.payload), inputs)
