"""Expected-deviation manifests: known departures from the SPEC, per implementation.

clipbench ships one (``deviations.toml``, for the libraries it wraps); a maintainer adds their
own with ``--deviations FILE``, and the suite applies the union. Each entry is a *strict*
expected failure unless it says ``strict = false``: a listed case that fails is a
``deviation``; one that passes is an ``unexpected-pass`` error, so a manifest stays true when
a library fixes something. Entries are data, never ``if library == ...`` in tests.

An entry may name the ``device`` kind it was seen on (``cpu`` or ``cuda``; default: any), so
a departure only a GPU shows is listed apart from the CPU's and is expected only in a run on
that kind (``--device``); an entry without one is expected on every device.

An entry's ``severity`` is one of :data:`clipbench.schema.SEVERITIES`: the class a person gave
it. The report derives each case's class from what the case showed (the results table records
it on every run; ``clipbench.schema.case_severity``) and falls back on the entry's only where
that data cannot tell.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import tomllib
from typing import Iterable

from clipbench import devices
from clipbench.protocol import OPS, RULES
from clipbench.schema import SEVERITIES

MANIFEST_PATH = os.path.join(os.path.dirname(__file__), "deviations.toml")

REQUIRED_KEYS = frozenset({"impl", "rule", "cases", "reason", "severity"})
OPTIONAL_KEYS = frozenset({"op", "strict", "device"})
ANY_DEVICE = "*"


@dataclasses.dataclass(frozen=True)
class Deviation:
  """One listed departure: ``impl`` breaks ``rule`` on the cases matching ``cases``."""

  impl: str  # the implementation's name (registered name, or an outside impl's ``name``)
  rule: int | str  # a SPEC rule number, or "transform"
  cases: tuple[str, ...]  # fnmatch patterns over case names
  reason: str
  severity: str  # a key of clipbench.schema.SEVERITIES
  op: str = "*"
  # Generated (hypothesis) cases may or may not draw an input that shows a defect, so their
  # entries are not strict: a pass there is reported, not an error.
  strict: bool = True
  source: str = ""  # the file the entry came from
  device: str = ANY_DEVICE  # the device kind it is seen on (clipbench.devices.KINDS), or any

  def matches(self, impl: str, op: str, rule: int | str, case: str,
              device: devices.Device = devices.HOST) -> bool:
    return (self.impl == impl and self.rule == rule and fnmatch.fnmatchcase(op, self.op) and
            self.device in (ANY_DEVICE, device.kind) and
            any(fnmatch.fnmatchcase(case, pattern) for pattern in self.cases))


def _entry(path: str, number: int, entry: dict) -> Deviation:
  where = f"{path}: deviation #{number}"
  if not isinstance(entry, dict):
    raise ValueError(f"{where}: expected a table, got {type(entry).__name__}")
  missing = REQUIRED_KEYS - set(entry)
  if missing:
    raise ValueError(f"{where} lacks {sorted(missing)}")
  unknown = set(entry) - REQUIRED_KEYS - OPTIONAL_KEYS
  if unknown:
    hint = " (observed is no longer kept: the results table records it)" if (
        "observed" in unknown) else ""
    raise ValueError(f"{where} has unknown keys {sorted(unknown)}{hint}")
  rule = entry["rule"]
  if not (isinstance(rule, int) and rule in RULES) and rule != "transform":
    raise ValueError(f"{where}: rule must be {min(RULES)}-{max(RULES)} or \"transform\", "
                     f"got {rule!r}")
  severity = entry["severity"]
  if severity not in SEVERITIES:
    raise ValueError(f"{where}: severity must be one of {', '.join(SEVERITIES)}, "
                     f"got {severity!r}")
  op = entry.get("op", "*")
  if op != "*" and op not in OPS:
    raise ValueError(f"{where}: op must be one of {', '.join(OPS)} (or \"*\"), got {op!r}")
  cases = entry["cases"]
  cases = [cases] if isinstance(cases, str) else cases
  if not cases or not all(isinstance(c, str) and c for c in cases):
    raise ValueError(f"{where}: cases must be a non-empty list of case-name patterns")
  for key in ("impl", "reason"):
    if not isinstance(entry[key], str) or not entry[key].strip():
      raise ValueError(f"{where}: {key} must be a non-empty string")
  strict = entry.get("strict", True)
  if not isinstance(strict, bool):
    raise ValueError(f"{where}: strict must be true or false, got {strict!r}")
  device = entry.get("device", ANY_DEVICE)
  if device != ANY_DEVICE and device not in devices.KINDS:
    raise ValueError(f"{where}: device must be one of {', '.join(devices.KINDS)} (or "
                     f"\"*\"), got {device!r}")
  return Deviation(impl=entry["impl"], rule=rule, cases=tuple(cases), reason=entry["reason"],
                   severity=severity, op=op, strict=strict, source=path, device=device)


def load(path: str = MANIFEST_PATH) -> list[Deviation]:
  """Reads one manifest; raises ValueError naming the file and entry when malformed."""
  if not isinstance(path, (str, os.PathLike)):
    raise TypeError(f"path: expected a file path, got {type(path).__name__}")
  path = os.fspath(path)
  try:
    with open(path, "rb") as f:
      data = tomllib.load(f)
  except (OSError, tomllib.TOMLDecodeError) as e:
    raise ValueError(f"{path}: cannot read the deviation manifest: {e}") from e
  unknown = set(data) - {"deviation"}
  if unknown:
    raise ValueError(f"{path}: unknown top-level keys {sorted(unknown)}; entries are "
                     "[[deviation]] tables")
  return [_entry(path, i + 1, entry) for i, entry in enumerate(data.get("deviation", []))]


def load_all(extra_paths: Iterable[str] = (), builtin: bool = True) -> list[Deviation]:
  """clipbench's manifest (unless ``builtin`` is False) followed by each extra manifest.

  Entries are merged, never replaced: a case listed in several files matches the first
  entry (clipbench's own first, then the extra files in order).
  """
  paths = ([MANIFEST_PATH] if builtin else []) + list(extra_paths)
  out: list[Deviation] = []
  for path in paths:
    out.extend(load(path))
  return out


def find(deviations: list[Deviation], impl: str, op: str, rule: int | str, case: str,
         device: devices.Device = devices.HOST) -> Deviation | None:
  """The first entry listing (impl, op, rule, case) on ``device``'s kind, or None."""
  return next((d for d in deviations if d.matches(impl, op, rule, case, device)), None)
