"""Bad input: the error type and a message naming the argument (rules 6, 9, 10, 13).

Each entry is data, in the way torch's OpInfo ``error_inputs`` pin the type and message: a
name, the rule, how to spoil a valid call, the expected exception type and a regex the
message must match. A crash deep inside a library (another type, or a message that does not
name the argument) and a silent wrong answer (no exception) both fail.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

import numpy as np
import pytest

from clipbench.conformance.cases import Inputs
from clipbench.conformance.rules import Violation
from clipbench.conformance.running import call, not_applicable


@dataclasses.dataclass(frozen=True)
class BadInput:
  name: str
  rule: int
  spoil: Callable[[Inputs, str], Inputs]
  error: type
  message: str  # regex; {arg} is the threshold's name for the operation
  needs: str = ""  # "per_system", "per_system_max" or "any_p"


def _valid(op: str) -> Inputs:
  rng = np.random.default_rng(3)
  x = rng.standard_normal((6, 3)).astype(np.float32)
  if op == "clip_grad_norm":
    return Inputs([x.ravel()], 1.0)
  return Inputs([x], 1.0, [np.array([0, 1, 0, 2, 1, 2])], 3)


def _with(**changes):
  return lambda inputs, op: dataclasses.replace(inputs, **changes)


def _segments(fn):
  def spoil(inputs, op):
    return dataclasses.replace(inputs, segments=fn(inputs.segments))
  return spoil


def _int_leaf(inputs, op):
  return dataclasses.replace(inputs, leaves=inputs.leaves + [np.array(
      [[1, 2, 3]] if op != "clip_grad_norm" else [1, 2, 3], np.int32)], segments=(
          inputs.segments + [np.array([0])] if inputs.segments is not None else None))


def _per_system_max(values):
  return lambda inputs, op: dataclasses.replace(inputs, threshold=np.array(values, np.float64))


BAD_INPUTS = (
    BadInput("max_negative", 6, _with(threshold=-1.0), ValueError, r"{arg}"),
    BadInput("max_nan", 6, _with(threshold=math.nan), ValueError, r"{arg}"),
    BadInput("max_per_system_negative", 6, _per_system_max([1.0, -1.0, 1.0]), ValueError,
             r"{arg}", needs="per_system_max"),
    BadInput("max_per_system_nan", 6, _per_system_max([1.0, 1.0, math.nan]), ValueError,
             r"{arg}", needs="per_system_max"),
    BadInput("integer_leaf", 9, _int_leaf, TypeError, r"leaves\[1\]"),
    BadInput("norm_type_0", 10, _with(norm_type=0.0), ValueError, r"norm_type", needs="any_p"),
    BadInput("norm_type_0.5", 10, _with(norm_type=0.5), ValueError, r"norm_type",
             needs="any_p"),
    BadInput("norm_type_nan", 10, _with(norm_type=math.nan), ValueError, r"norm_type",
             needs="any_p"),
    BadInput("segments_wrong_length", 13, _segments(lambda s: [s[0][:-1]]), ValueError,
             r"segments\[0\]|leaves\[0\]", needs="per_system"),
    BadInput("segments_id_out_of_range", 13, _segments(lambda s: [s[0] + 1]), ValueError,
             r"segments\[0\]|leaves\[0\]", needs="per_system"),
    BadInput("segments_negative_id", 13, _segments(lambda s: [s[0] - 1]), ValueError,
             r"segments\[0\]|leaves\[0\]", needs="per_system"),
    BadInput("segments_not_integer", 13, _segments(lambda s: [s[0].astype(np.float32)]),
             ValueError, r"segments\[0\]|leaves\[0\]", needs="per_system"),
    BadInput("num_systems_missing", 13, _with(num_systems=None), ValueError, r"num_systems",
             needs="per_system"),
)


def bad_inputs(rule: int):
  def cases(impl, op):
    out = []
    caps = impl.capabilities
    for bad in BAD_INPUTS:
      if bad.rule != rule:
        continue
      if op == "clip_by_max_step" and bad.needs == "any_p":
        continue
      if bad.needs == "per_system" and op == "clip_grad_norm":
        continue
      reason = None
      if bad.needs == "per_system" and not caps.per_system:
        reason = "not per-system"
      elif bad.needs == "per_system_max" and (op == "clip_grad_norm" or not caps.per_system_max):
        reason = "no per-system thresholds"
      elif bad.needs == "any_p" and not caps.any_norm_type:
        reason = "L2 only" if tuple(caps.norm_types) == (2.0,) else "norm_type not a parameter"
      elif op != "clip_grad_norm" and not caps.per_system and bad.needs != "per_system":
        reason = None  # the global form of a per-system op
      if reason is None:
        base = _valid(op)
        if not caps.per_system or op == "clip_grad_norm":
          base = Inputs([x.reshape(-1, 3) if op != "clip_grad_norm" else x
                         for x in base.leaves], 1.0)
        reason = not_applicable(impl, op, dataclasses.replace(
            base, leaves=[x for x in base.leaves]))
      out.append((bad.name, bad, reason, "float32"))
    return out
  return cases


def verify_rejected(impl, op, bad: BadInput) -> Inputs:
  inputs = _valid(op)
  if op != "clip_grad_norm" and (not impl.capabilities.per_system) and bad.needs != "per_system":
    inputs = Inputs(inputs.leaves, inputs.threshold)
  inputs = bad.spoil(inputs, op)
  arg = "max_step" if op == "clip_by_max_step" else "max_norm"
  outcome = call(impl, op, inputs)
  if outcome.error is None:
    raise Violation(f"accepted {bad.name.replace('_', ' ')} without an error (returned "
                    f"{outcome.leaves[0].ravel()[:3] if outcome.leaves else outcome.leaves}, "
                    f"norm {outcome.norms})")
  pattern = bad.message.format(arg=arg)
  if not isinstance(outcome.error, bad.error) or not re.search(pattern, str(outcome.error)):
    raise Violation(f"raised {type(outcome.error).__name__}: {str(outcome.error)[:200]!r}; "
                    f"expected {bad.error.__name__} naming /{pattern}/")
  if outcome.mutated:
    raise Violation(f"raised, but only after modifying input leaves {outcome.mutated}")
  return inputs


def _run(target, check):
  bad = target.payload
  check(target, lambda: verify_rejected(target.impl, target.op, bad),
        bad.spoil(_valid(target.op), target.op), invalid=True)


@pytest.mark.conformance(rule=6, cases=bad_inputs(6))
def test_rule6_negative_or_nan_threshold_raises_value_error(target, check):
  _run(target, check)


@pytest.mark.conformance(rule=9, cases=bad_inputs(9))
def test_rule9_non_float_leaf_raises_type_error(target, check):
  _run(target, check)


@pytest.mark.conformance(rule=10, cases=bad_inputs(10))
def test_rule10_p_below_one_or_nan_raises_value_error(target, check):
  _run(target, check)


@pytest.mark.conformance(rule=13, cases=bad_inputs(13))
def test_rule13_bad_segments_raise_value_error_naming_the_leaf(target, check):
  _run(target, check)
