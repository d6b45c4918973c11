"""Where a command's results go: checked before any work, staged beside their final path.

Every output folder is checked for writability before a run starts (a usage error otherwise).
A run writes into a hidden folder beside its final file; the caller moves the file over the
final path only once it reads back correctly, and the folder goes whatever happens (Ctrl-C
included), so a failed or interrupted run leaves the previous results and no temporary file.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from clipbench.errors import UsageError

DEFAULT_RESULTS_DIR = "results"  # relative to the working directory
CONFORMANCE_FILE = "conformance.csv"  # the results table of `conform`
BENCHMARK_FILE = "benchmarks.json"  # the pytest-benchmark JSON of `bench`
SAFE_RANGE_FILE = "safe_range.csv"  # the safe-range scan `report` runs after the suite


def check_writable(folder: str, what: str) -> None:
  """Usage error naming the option ``what`` unless files can be created in ``folder``."""
  from clipbench import files  # imports pandas: not for `clipbench --version`
  try:
    files.check_writable(folder or ".")
  except files.UnwritableFolderError as e:
    raise UsageError(f"{what}: {e}") from None


def folder_of(path: str) -> str:
  """The folder a results file ``path`` goes to; a usage error if ``path`` is a folder."""
  if os.path.isdir(path):
    raise UsageError(f"{path} is a folder; expected a file path")
  return os.path.dirname(os.path.abspath(path))


@contextlib.contextmanager
def staged(final_path: str) -> Iterator[str]:
  """A path for a run's output in a hidden folder beside ``final_path``; the folder goes with
  anything in it (the child's own temporary files included) unless its file was promoted."""
  from clipbench import files
  with files.staging_dir(final_path) as folder:
    yield os.path.join(folder, os.path.basename(final_path))


def log_path(results_path: str) -> str:
  """Where the full pytest output of the run writing ``results_path`` is kept."""
  return os.path.splitext(results_path)[0] + ".log"
