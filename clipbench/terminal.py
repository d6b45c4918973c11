"""What the command prints to: whether a person watches, and the console tables go to."""

from __future__ import annotations

import os
import sys
from typing import Any


def interactive() -> bool:
  """True when stdout is a terminal: runs then show a progress bar instead of pytest's output."""
  return sys.stdout.isatty()


def console() -> Any:
  """A rich console as wide as the terminal (or ``COLUMNS``); 200 columns for piped output."""
  from rich.console import Console
  # rich follows the terminal, or COLUMNS where set; piped output without COLUMNS is read by
  # people in logs too: do not squeeze tables into 80 columns there.
  wide = not interactive() and not os.environ.get("COLUMNS", "").isdigit()
  return Console(width=200 if wide else None, highlight=False)
