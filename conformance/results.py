"""The machine-readable result table: one row per implementation x op x rule x case.

Written atomically at the end of a session (``clipbench.files``: a temporary file in the
target directory, then ``os.replace``), so an interrupted run never leaves half a table where
a good one was.
"""

from __future__ import annotations

import csv
import io

COLUMNS = ("impl", "kind", "library", "version", "framework", "op", "rule", "case", "dtype",
           "outcome", "max_ulp_error", "norm_ulp_error", "observed", "reason", "reproducer",
           "test_id", "duration_s")
OUTCOMES = ("pass", "deviation", "fail", "unexpected-pass", "not-applicable", "error")


def to_csv(rows: list[dict]) -> str:
  buffer = io.StringIO()
  writer = csv.DictWriter(buffer, fieldnames=COLUMNS, extrasaction="ignore")
  writer.writeheader()
  for row in rows:
    writer.writerow({k: row.get(k, "") for k in COLUMNS})
  return buffer.getvalue()
