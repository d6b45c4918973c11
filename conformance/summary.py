"""The end of a run in a few lines: failures grouped by rule, what was not applicable.

A failure is shown as one line (implementation, operation, case, what was observed); failures
of one rule whose observation is the same (an implementation raising one error everywhere)
collapse into one line with a count. The full messages and reproducers are behind ``-v`` and
in the results table.
"""

from __future__ import annotations

import collections
import dataclasses

LINE_WIDTH = 160


@dataclasses.dataclass(frozen=True)
class Failure:
  """One failed conformance check, as the summary shows it."""

  impl: str
  op: str
  rule: int | str
  case: str
  observed: str  # the first line of the message
  outcome: str = "fail"  # "fail", "error" or "unexpected-pass"


def _rule_key(rule: int | str) -> tuple[int, str]:
  return (rule, "") if isinstance(rule, int) else (99, str(rule))


def _clip(text: str, width: int) -> str:
  return text if len(text) <= width else text[:width - 3] + "..."


def _cases(cases: list[str]) -> str:
  if len(cases) == 1:
    return cases[0]
  return f"{len(cases)} cases ({', '.join(cases[:3])}{', ...' if len(cases) > 3 else ''})"


def failure_lines(failures: list[Failure], width: int = LINE_WIDTH) -> list[str]:
  """The same error raised in several checks first, one line each with its count; then one
  header per rule and one line per distinct (impl, op, outcome, observation)."""
  raised: dict[tuple[str, str, str], list[Failure]] = collections.defaultdict(list)
  for f in failures:
    if f.observed.startswith("raised "):
      raised[(f.impl, f.op, f.observed)].append(f)
  repeated = {key: group for key, group in raised.items() if len(group) > 1}
  lines = []
  if repeated:
    lines.append("the same error in several checks:")
    for (impl, op, observed), group in repeated.items():
      rule_list = sorted({f.rule for f in group}, key=_rule_key)
      rules = ", ".join(str(r) for r in rule_list)
      lines.append(_clip(f"  {len(group)}x {impl} {op} (rule {rules}; "
                         f"{_cases([f.case for f in group])}): {observed}", width))
    failures = [f for f in failures if (f.impl, f.op, f.observed) not in repeated]
  by_rule: dict[int | str, list[Failure]] = collections.defaultdict(list)
  for f in failures:
    by_rule[f.rule].append(f)
  for rule in sorted(by_rule, key=_rule_key):
    group = by_rule[rule]
    label = f"rule {rule}" if isinstance(rule, int) else str(rule)
    lines.append(f"{label}: {len(group)} failure{'s' if len(group) != 1 else ''}")
    same: dict[tuple[str, str, str, str], list[str]] = collections.defaultdict(list)
    for f in group:
      same[(f.impl, f.op, f.outcome, f.observed)].append(f.case)
    for (impl, op, outcome, observed), cases in same.items():
      mark = "" if outcome == "fail" else f"[{outcome}] "
      lines.append(_clip(f"  {mark}{impl} {op} {_cases(cases)}: {observed}", width))
  return lines


def not_applicable_line(reasons: list[str], top: int = 4) -> str:
  """How many cases were not applicable, with the most common reasons."""
  counts = collections.Counter(reasons)
  shown = ", ".join(f"{reason} ({n})" for reason, n in counts.most_common(top))
  rest = len(counts) - top
  more = f", {rest} other reason{'s' if rest != 1 else ''}" if rest > 0 else ""
  return f"{len(reasons)} not applicable: {shown}{more}"
