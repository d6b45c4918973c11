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

from clipbench import child_run, devices, outputs
from clipbench.errors import EXIT_FAILED, note


def scan_command(impls: Sequence[str], profile: str | None, results_path: str,
                 device: devices.Device = devices.HOST) -> list[str]:
  cmd = [sys.executable, "-m", "clipbench.conformance.safe_range", "--results", results_path]
  for spec in impls:
    cmd += ["--impl", spec]
  if device != devices.HOST:
    cmd += ["--device", str(device)]
  return cmd + (["--profile", profile] if profile else [])


def _scan(impls: Sequence[str], profile: str | None, tmp: str, results_path: str,
          env_defaults: dict[str, str], device: devices.Device, jobs: int) -> int:
  """The scan in one child, or one child per implementation (``jobs`` > 1, ``impls`` named)
  whose tables are joined at ``tmp``: those that completed (the others named in a note); the
  first failing exit status when none did."""
  if jobs == 1 or not impls:
    proc = subprocess.Popen(scan_command(impls, profile, tmp, device),
                            env=child_run.child_env(env_defaults))
    try:
      return proc.wait()
    except KeyboardInterrupt:
      child_run.stop_child(proc)
      raise
  folder = os.path.dirname(tmp)
  parts = [os.path.join(folder, f"part-{i}.csv") for i in range(len(impls))]
  logs = [f"{os.path.splitext(results_path)[0]}-{name.replace(':', '_')}.log" for name in impls]
  statuses = child_run.run_side_by_side(
      [scan_command([name], profile, part, device) for name, part in zip(impls, parts)], logs,
      jobs, env_defaults=env_defaults, shown_paths={part: results_path for part in parts})
  done = [part for part, rc in zip(parts, statuses) if rc == 0 and os.path.exists(part)]
  for name, rc, log in zip(impls, statuses, logs):
    if rc != 0:  # one implementation's crash leaves the others' ranges standing
      note(f"the safe-range scan of {name} did not complete (exit status {rc}); its ranges "
           f"are left out: see {log}")
  if not done:
    return next((rc for rc in statuses if rc), EXIT_FAILED)
  import pandas as pd
  from clipbench import files
  files.write_csv(tmp, pd.concat([pd.read_csv(p, dtype=str, keep_default_na=False)
                                  for p in done]))
  return 0


def run_safe_range(impls: Sequence[str], profile: str | None, results_path: str,
                   env_defaults: dict[str, str], *, device: devices.Device = devices.HOST,
                   jobs: int = 1) -> int:
  """Scans ``impls`` (every available one when empty) on ``device``, ``jobs`` children at a
  time (one implementation each); promotes the table over ``results_path`` only if it is
  sound. Returns the children's exit status."""
  from clipbench.reports import results
  with outputs.staged(results_path) as tmp:
    rc = _scan(impls, profile, tmp, results_path, env_defaults, device, jobs)
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
