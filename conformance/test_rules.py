"""Rules 1-10 on the fixed edge-case table and on hypothesis-generated batches.

Each test names the SPEC rule it checks; the checks themselves live in ``rules.py``.
"""

from __future__ import annotations

import itertools

import pytest

from clipbench.conformance import generation, rules, strategies
from clipbench.conformance.cases import Case, cases_for
from clipbench.conformance.running import SESSION, not_applicable


def table(rule: int):
  """Cases of ``rule`` from the fixed table, for one implementation and operation."""

  def cases(impl, op):
    out = []
    for case in cases_for(rule, op):
      inputs = SESSION.inputs(case, op)
      out.append((case.name, case, not_applicable(impl, op, inputs),
                  "+".join(sorted(inputs.dtypes))))
    return out

  return cases


def _run(target, check, rule):
  case = target.payload
  return check(target, lambda: rules.VERIFY[rule](target.impl, target.op, case),
               SESSION.inputs(case, target.op))


@pytest.mark.conformance(rule=1, cases=table(1))
def test_rule1_norm_spans_every_row_of_every_leaf(target, check):
  _run(target, check, 1)


@pytest.mark.conformance(rule=2, cases=table(2))
def test_rule2_step_norm_is_the_largest_vector_norm(target, check):
  _run(target, check, 2)


@pytest.mark.conformance(rule=3, cases=table(3))
def test_rule3_at_or_below_threshold_is_bitwise_unchanged(target, check):
  _run(target, check, 3)


@pytest.mark.conformance(rule=4, cases=table(4))
def test_rule4_one_factor_and_strict_bound(target, check):
  _run(target, check, 4)


@pytest.mark.conformance(rule=5, cases=table(5))
def test_rule5_norm_accuracy_without_overflow_or_underflow(target, check):
  _run(target, check, 5)


@pytest.mark.conformance(rule=6, cases=table(6))
def test_rule6_threshold_zero_and_inf(target, check):
  _run(target, check, 6)


@pytest.mark.conformance(rule=7, cases=table(7))
def test_rule7_nonfinite_input_stays_in_its_system(target, check):
  _run(target, check, 7)


@pytest.mark.conformance(rule=8, cases=table(8))
def test_rule8_empty_inputs_are_valid(target, check):
  _run(target, check, 8)


@pytest.mark.conformance(rule=9, cases=table(9))
def test_rule9_mixed_dtypes_keep_their_own(target, check):
  _run(target, check, 9)


@pytest.mark.conformance(rule=10, cases=table(10))
def test_rule10_p_norms(target, check):
  _run(target, check, 10)


# ----------------------------------------------------------------- hypothesis-generated inputs
_counter = itertools.count()


def generated(rule: int):
  """One hypothesis-driven test per dtype the implementation declares."""

  def cases(impl, op):
    out = []
    for dtype in ("float16", "bfloat16", "float32", "float64"):
      reason = None if dtype in impl.capabilities.dtypes else f"{dtype} not supported"
      out.append((f"hypothesis_{dtype}", dtype, reason, dtype))
    return out

  return cases


def _strategy(target):
  caps = target.impl.capabilities
  per_system = target.op != "clip_grad_norm" and caps.per_system
  norm_types = (2.0,) if target.op == "clip_by_max_step" else tuple(
      p for p in (1.0, 1.5, 2.0, 3.0, float("inf"), float("-inf")) if caps.supports_norm_type(p))
  return strategies.batches({target.payload}, per_system=per_system,
                            max_step=target.op == "clip_by_max_step",
                            per_system_max=caps.per_system_max, norm_types=norm_types,
                            nonfinite=tuple(caps.nonfinite))


def _hypothesis_check(target, check, rule):
  def one(inputs):
    case = Case(f"generated-{next(_counter)}", (rule,), lambda op, inputs=inputs: inputs)
    try:
      check(target, lambda: rules.VERIFY[rule](target.impl, target.op, case), inputs)
    finally:
      SESSION.forget(case)

  generation.check_generated(_strategy(target), one)


@pytest.mark.conformance(rule=3, cases=generated(3))
def test_rule3_random_batches_below_threshold_unchanged(target, check):
  _hypothesis_check(target, check, 3)


@pytest.mark.conformance(rule=4, cases=generated(4))
def test_rule4_random_batches_strict_bound(target, check):
  _hypothesis_check(target, check, 4)


@pytest.mark.conformance(rule=5, cases=generated(5))
def test_rule5_random_batches_norm_accuracy(target, check):
  _hypothesis_check(target, check, 5)
