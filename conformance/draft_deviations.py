"""Drafts manifest entries from a result table: every failure not yet listed, grouped.

  python -m clipbench.conformance.draft_deviations results/conformance.csv > draft.toml

Each group (implementation, operation, rule) becomes one ``[[deviation]]`` with its case
names and the first observed message; the reason is left for a person to write after reading
the reproducers: a draft is a starting point, never a way to make failures pass unread.
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd


def _quote(text: str) -> str:
  return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'


def draft(results_csv: str) -> str:
  table = pd.read_csv(results_csv, dtype=str, keep_default_na=False)
  failed = table[table.outcome.isin(["fail", "error"])]
  out = []
  for (impl, op, rule), group in failed.groupby(["impl", "op", "rule"], sort=True):
    cases = sorted(set(group.case))
    observed = next((o for o in group.observed if o), "")
    out.append("[[deviation]]")
    out.append(f"impl = {_quote(impl)}")
    out.append(f"op = {_quote(op)}")
    out.append(f"rule = {rule if rule.isdigit() else _quote(rule)}")
    out.append("cases = [" + ", ".join(_quote(c) for c in cases) + "]")
    out.append('reason = "TODO: why (read the reproducers)"')
    out.append(f"observed = {_quote(observed[:300])}")
    out.append("")
  return "\n".join(out)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("results", help="result table written by the conformance suite")
  args = parser.parse_args(argv)
  try:
    sys.stdout.write(draft(args.results))
  except (OSError, pd.errors.ParserError, AttributeError) as e:
    print(f"error: {args.results}: cannot read the result table: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
