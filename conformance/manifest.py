"""The expected-deviation manifest (``deviations.toml``): known departures, per implementation.

The suite applies each entry as a *strict* expected failure: a listed case that fails is a
``deviation``; one that passes is an ``unexpected-pass`` error, so the manifest stays true
when a library fixes something. Entries are data, never ``if library == ...`` in tests.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import tomllib

MANIFEST_PATH = os.path.join(os.path.dirname(__file__), "deviations.toml")


@dataclasses.dataclass(frozen=True)
class Deviation:
  impl: str
  rule: int | str  # a SPEC rule number, or "transform"
  cases: tuple[str, ...]  # fnmatch patterns over case names
  reason: str
  observed: str
  op: str = "*"
  # Generated (hypothesis) cases may or may not draw an input that shows a defect, so their
  # entries are not strict: a pass there is reported, not an error.
  strict: bool = True

  def matches(self, impl: str, op: str, rule: int, case: str) -> bool:
    return (self.impl == impl and self.rule == rule and fnmatch.fnmatchcase(op, self.op) and
            any(fnmatch.fnmatchcase(case, pattern) for pattern in self.cases))


def load(path: str = MANIFEST_PATH) -> list[Deviation]:
  """Reads the manifest; raises ValueError naming the file and entry when malformed."""
  try:
    with open(path, "rb") as f:
      data = tomllib.load(f)
  except (OSError, tomllib.TOMLDecodeError) as e:
    raise ValueError(f"{path}: cannot read the deviation manifest: {e}") from e
  out = []
  for i, entry in enumerate(data.get("deviation", [])):
    missing = {"impl", "rule", "cases", "reason", "observed"} - set(entry)
    if missing:
      raise ValueError(f"{path}: deviation #{i + 1} lacks {sorted(missing)}")
    unknown = set(entry) - {"impl", "rule", "cases", "reason", "observed", "op", "strict"}
    if unknown:
      raise ValueError(f"{path}: deviation #{i + 1} has unknown keys {sorted(unknown)}")
    cases = entry["cases"]
    rule = entry["rule"]
    if not (isinstance(rule, int) and 1 <= rule <= 13) and rule != "transform":
      raise ValueError(f"{path}: deviation #{i + 1}: rule must be 1-13 or \"transform\", "
                       f"got {rule!r}")
    out.append(Deviation(impl=entry["impl"], rule=rule,
                         cases=tuple([cases] if isinstance(cases, str) else cases),
                         reason=entry["reason"], observed=entry["observed"],
                         op=entry.get("op", "*"), strict=bool(entry.get("strict", True))))
  return out


def find(deviations: list[Deviation], impl: str, op: str, rule: int,
         case: str) -> Deviation | None:
  return next((d for d in deviations if d.matches(impl, op, rule, case)), None)
