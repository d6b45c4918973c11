"""The machine-readable result table: one row per implementation x op x rule x case.

Written atomically at the end of a session (a temporary file in the target directory, then
``os.replace``), so an interrupted run never leaves half a table where a good one was.
"""

from __future__ import annotations

import csv
import io
import os
import tempfile

COLUMNS = ("impl", "kind", "library", "version", "framework", "op", "rule", "case", "dtype",
           "outcome", "max_ulp_error", "norm_ulp_error", "observed", "reason", "reproducer",
           "test_id", "duration_s")
OUTCOMES = ("pass", "deviation", "fail", "unexpected-pass", "not-applicable", "error")


def write_atomically(path: str, text: str) -> None:
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=directory)
  try:
    with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
      f.write(text)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def to_csv(rows: list[dict]) -> str:
  buffer = io.StringIO()
  writer = csv.DictWriter(buffer, fieldnames=COLUMNS, extrasaction="ignore")
  writer.writeheader()
  for row in rows:
    writer.writerow({k: row.get(k, "") for k in COLUMNS})
  return buffer.getvalue()
