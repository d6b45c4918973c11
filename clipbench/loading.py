"""The implementations a command works on: those named by ``--impl``, or every registered one,
and which of them reach the device the command runs on.

An outside implementation is named ``package.module:attr``; the working directory is on the
import path (as with ``python -m``), for this process and the pytest runs it starts.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

from clipbench import terminal
from clipbench.errors import UsageError


def _with_cwd_on_path() -> None:
  # The console script's sys.path lacks the working directory, unlike `python -m`; outside
  # implementations named module:attr must resolve the same way in both.
  if os.getcwd() not in sys.path and "" not in sys.path:
    sys.path.insert(0, os.getcwd())


def load_requested(specs: Sequence[str], *, require_available: bool) -> list[Any]:
  """Loads each ``--impl``; unknown ones (and unavailable ones, if required) are usage errors."""
  from clipbench.impls import registry
  _with_cwd_on_path()
  impls = []
  for spec in specs:
    try:
      impl = registry.load(spec)
    except ValueError as e:
      raise UsageError(str(e)) from None
    except Exception as e:  # pylint: disable=broad-except
      # An outside module that raises on import is the user's to fix; say so plainly.
      raise UsageError(f"impl {spec!r}: loading failed: {type(e).__name__}: {e}") from None
    if require_available and not impl.available:
      raise UsageError(f"impl {spec!r} is unavailable here: {impl.reason}")
    impls.append(impl)
  return impls


def load_all(progress: bool | None = None) -> list[Any]:
  """Every registered implementation (unavailable ones with their reason), with a progress bar."""
  from clipbench.impls import registry
  entries = registry.all_entries()
  progress = terminal.interactive() if progress is None else progress
  iterator: Any = entries
  if progress:
    from rich.progress import track
    iterator = track(entries, description="loading implementations", transient=True)
  impls = []
  for entry in iterator:
    try:
      impls.append(registry.load_entry(entry))
    except ValueError as e:  # a registered object that does not speak the protocol
      impls.append(registry.Implementation(name=entry.name, target=entry.target,
                                           kind=entry.kind, library=entry.library,
                                           reason=str(e)))
  return impls


def mark_off_device(impls: Sequence[Any], device: Any) -> list[Any]:
  """Marks each available implementation whose framework cannot reach ``device`` (a
  ``clipbench.devices.Device``) unavailable, with the reason (``not on cuda: ...``); returns
  those it marked."""
  from clipbench import devices
  marked = []
  for impl in impls:
    if not impl.available:
      continue
    try:
      devices.framework_device(device, impl.framework)
    except devices.DeviceUnavailable as e:
      impl.available, impl.reason = False, f"not on {device}: {e}"
      marked.append(impl)
  return marked
