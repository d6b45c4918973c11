"""Running the safe-range scan (``clipbench.conformance.safe_range``) in a child process.

The scan loads every framework, as the conformance suite does, so it runs in a process of its
own; its table is written beside the final path and swapped in only once it reads back, so a
failed or interrupted scan leaves the previous one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

from clipbench import child_run, outputs
from clipbench.errors import EXIT_FAILED, note


def scan_command(impls: Sequence[str], profile: str | None, results_path: str) -> list[str]:
  cmd = [sys.executable, "-m", "clipbench.conformance.safe_range", "--results", results_path]
  for spec in impls:
    cmd += ["--impl", spec]
  return cmd + (["--profile", profile] if profile else [])


def run_safe_range(impls: Sequence[str], profile: str | None, results_path: str,
                   env_defaults: dict[str, str]) -> int:
  """Scans ``impls`` (every available one when empty); promotes the table over
  ``results_path`` only if it is sound. Returns the child's exit status."""
  from clipbench.reports import results
  with outputs.staged(results_path) as tmp:
    proc = subprocess.Popen(scan_command(impls, profile, tmp),
                            env=child_run.child_env(env_defaults))
    try:
      rc = proc.wait()
    except KeyboardInterrupt:
      child_run.stop_child(proc)
      raise
    if rc != 0 or not os.path.exists(tmp):
      note(f"the safe-range scan did not complete (exit status {rc}); "
           f"{results_path} left as it was")
      return rc or EXIT_FAILED
    try:
      table = results.read_safe_range(tmp)
    except results.ResultsError as e:
      note(f"the new safe-range table is unreadable, {results_path} left as it was: {e}")
      return EXIT_FAILED
    os.replace(tmp, results_path)
  print(f"safe ranges: {results_path} ({len(table)} points)")
  return 0
