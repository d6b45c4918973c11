"""The machine-readable result table: one row per implementation x op x rule x case.

Its columns and outcomes are :mod:`clipbench.schema`'s, the contract with the report. Written
atomically at the end of a session (``clipbench.files``: a temporary file in the target
directory, then ``os.replace``), so an interrupted run never leaves half a table where a good
one was.
"""

from __future__ import annotations

import csv
import io

from clipbench.schema import CONFORMANCE_COLUMNS as COLUMNS
from clipbench.schema import OUTCOMES

__all__ = ["COLUMNS", "OUTCOMES", "to_csv"]


def to_csv(rows: list[dict]) -> str:
  """The rows as CSV text with the schema's columns in order (missing values empty)."""
  unknown = {row.get("outcome") for row in rows} - set(OUTCOMES)
  if unknown:
    raise ValueError(f"rows: unknown outcome(s) {sorted(map(str, unknown))}; "
                     f"known: {', '.join(OUTCOMES)}")
  buffer = io.StringIO()
  writer = csv.DictWriter(buffer, fieldnames=COLUMNS, extrasaction="ignore")
  writer.writeheader()
  for row in rows:
    writer.writerow({k: row.get(k, "") for k in COLUMNS})
  return buffer.getvalue()
