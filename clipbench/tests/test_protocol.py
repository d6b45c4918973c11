"""The protocol's structured facts agree with the prose they summarize."""

from __future__ import annotations

import importlib.resources
import re

from clipbench.protocol import RULES

_RULE_HEADING = re.compile(r"^##\s+Rule\s+(\d+)\.\s+(.+?)\s*$")


def spec_rule_headings() -> dict[int, str]:
  """Rule number -> title of every ``## Rule N. Title`` heading of SPEC.md, in order."""
  text = (importlib.resources.files("clipbench.reference") / "SPEC.md").read_text("utf-8")
  headings: dict[int, str] = {}
  for line in text.splitlines():
    match = _RULE_HEADING.match(line)
    if match:
      number = int(match.group(1))
      assert number not in headings, f"SPEC.md has two headings for rule {number}"
      headings[number] = match.group(2)
  return headings


def test_rules_are_the_spec_headings() -> None:
  headings = spec_rule_headings()
  assert len(headings) >= 13  # the pattern reads the headings at all
  assert dict(RULES) == headings
  assert list(RULES) == sorted(RULES)
