"""How a ``clipbench`` command ends: its exit statuses and the two errors that stop it.

A :class:`UsageError` is a problem with what the user asked for, said in one line before any
work starts (exit 2); a :class:`RunFailed` is a run behind a command that failed (exit with the
run's own status). :func:`note` is the one way the command speaks on stderr.
"""

from __future__ import annotations

import sys

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # the shell's convention: 128 + SIGINT


class UsageError(Exception):
  """A problem with what the user asked for; reported as ``clipbench: error: ...``, exit 2."""


class RunFailed(Exception):
  """A run behind the report failed; no report is written. Exit status ``code``."""

  def __init__(self, what: str, code: int, why: str = "") -> None:
    super().__init__(f"the {what} run failed ({why or f'exit status {code}'}); "
                     "no report written")
    self.code = code


def note(message: str) -> None:
  """Prints ``clipbench: message`` on stderr, at once (a progress bar may follow)."""
  print(f"clipbench: {message}", file=sys.stderr, flush=True)
