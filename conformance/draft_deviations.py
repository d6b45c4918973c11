"""Drafts manifest entries from a result table: every failure not yet listed, grouped.

  python -m clipbench.conformance.draft_deviations results/conformance.csv > my-deviations.toml
  pytest ... --deviations my-deviations.toml

One ``[[deviation]]`` per (implementation, operation, rule) with its case names, keyed by the
implementation's name as the suite reports it; generated (``hypothesis_*``) cases go to a
separate entry with ``strict = false``, since a new draw may miss the defect. The reason and
the severity are left for a person to write after reading the reproducers: a draft is a
starting point, never a way to make failures pass unread. What each case returned is in the
results table (``observed``), quoted here as a comment. Failures from a run on a GPU
(``--device cuda``) get ``device = "cuda"``: seen there, they are expected there only.
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

from clipbench.schema import SEVERITIES

GENERATED_PREFIX = "hypothesis_"


def _quote(text: str) -> str:
  return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'


def _entry(impl: str, op: str, rule: str, cases: list[str], observed: str,
           strict: bool, device: str = "cpu") -> list[str]:
  lines = ["[[deviation]]", f"impl = {_quote(impl)}", f"op = {_quote(op)}",
           f"rule = {rule if rule.isdigit() else _quote(rule)}",
           "cases = [" + ", ".join(_quote(c) for c in cases) + "]"]
  if device != "cpu":
    lines.append(f"device = {_quote(device)}  # seen on {device}; drop it if the CPU shows it too")
  if not strict:
    lines.append("strict = false  # generated inputs show the defect on some draws only")
  if observed:
    lines.append(f"# observed: {observed[:300]}".replace("\n", " "))
  lines += ['reason = "TODO: why (read the reproducers)"',
            f'severity = "TODO: one of {", ".join(SEVERITIES)}"', ""]
  return lines


def draft(results_csv: str) -> str:
  """TOML text with one entry per unlisted (impl, op, rule) failure group of the table."""
  table = pd.read_csv(results_csv, dtype=str, keep_default_na=False)
  # The device kind a row ran on (tables from before the device axis ran on the CPU).
  table["kind_of_device"] = (table["device"] if "device" in table.columns else pd.Series(
      "", index=table.index)).str.partition(":")[0].replace("", "cpu")
  failed = table[table.outcome.isin(["fail", "error"])]
  out = []
  for (impl, op, rule, device), group in failed.groupby(["impl", "op", "rule", "kind_of_device"],
                                                        sort=True):
    generated = group.case.str.startswith(GENERATED_PREFIX)
    for rows, strict in ((group[~generated], True), (group[generated], False)):
      if rows.empty:
        continue
      cases = [f"{GENERATED_PREFIX}*"] if not strict else sorted(set(rows.case))
      observed = next((o for o in rows.observed if o), "")
      out += _entry(impl, op, rule, cases, observed, strict, device)
  return "\n".join(out)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("results", help="result table written by the conformance suite")
  args = parser.parse_args(argv)
  try:
    sys.stdout.write(draft(args.results))
  except (OSError, pd.errors.ParserError, AttributeError, KeyError) as e:
    print(f"error: {args.results}: cannot read the result table: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
