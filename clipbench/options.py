"""Command-line values checked once: each bad one is a :class:`UsageError` naming its option.

Shared by the commands that take the same option (``--ops``, ``--scale``, ``--profile``,
``--deviations``, ``--timeout``, ``--budget``, ``--jobs``, ``--workload``, ``--device``), so
each is checked and worded the same way.
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

from clipbench.errors import UsageError

PROFILES = ("ci", "thorough")
QUICK_SCALE = 0.02  # of every workload (W1: 335k elements; W3: 400 systems)


def operations(text: str | None) -> list[str]:
  """``--ops``: a comma-separated subset of the canonical operations (none: every one)."""
  if not text:
    return []
  from clipbench.protocol import OPS
  ops = [op.strip() for op in text.split(",") if op.strip()]
  unknown = [op for op in ops if op not in OPS]
  if unknown or not ops:
    raise UsageError(f"--ops: unknown operation(s) {', '.join(unknown) or repr(text)}; "
                     f"expected a comma-separated subset of {', '.join(OPS)}")
  return ops


def lacking_operations(impl: Any, lacking: Sequence[str]) -> UsageError:
  """The error for an ``--ops`` that the implementation ``impl`` does not provide."""
  return UsageError(f"--ops: implementation {impl.name!r} has no {', '.join(lacking)} "
                    f"(it provides: {', '.join(impl.ops) or 'no operation'})")


def workload_names(names: Sequence[str]) -> list[str]:
  """``--workload``: names of defined workloads (none: every one)."""
  if not names:
    return []
  from clipbench.benchmarks import workloads
  for name in names:
    try:
      workloads.get(name)
    except ValueError as e:
      raise UsageError(str(e)) from None
  return list(names)


def scale(given: float | None, quick: bool) -> float | None:
  """``--scale`` (a positive finite number), else :data:`QUICK_SCALE` for ``--quick``."""
  if given is not None:
    if not (given > 0 and given < float("inf")):
      raise UsageError(f"--scale: expected a positive number, got {given}")
    return given
  return QUICK_SCALE if quick else None


def profile(given: str | None, quick: bool) -> str | None:
  """The hypothesis profile: ``ci`` for ``--quick`` (which contradicts ``thorough``)."""
  if quick and given == "thorough":
    raise UsageError("--quick runs the ci profile; it contradicts --profile thorough")
  return "ci" if quick else given


def deviation_files(paths: Sequence[str]) -> tuple[str, ...]:
  """``--deviations``: files that exist."""
  for path in paths:
    if not os.path.isfile(path):
      raise UsageError(f"--deviations: no such file: {path}")
  return tuple(paths)


def seconds(option: str, value: float | None) -> float | None:
  """``option`` (``--timeout``, ``--budget``): a positive finite number of seconds, or none."""
  if value is not None and not (value > 0 and math.isfinite(value)):
    raise UsageError(f"{option}: expected a positive number of seconds, got {value}")
  return value


def timeout(value: float | None) -> float | None:
  """``--timeout``: a positive finite number of seconds, or none."""
  return seconds("--timeout", value)


def jobs(count: int) -> int:
  """``--jobs``: how many pytest children run at once, at least one."""
  if count < 1:
    raise UsageError(f"--jobs: expected a positive number of children, got {count}")
  return count


def device(text: str) -> Any:
  """``--device``: ``cpu[:N]`` or ``cuda[:N]``, as a ``clipbench.devices.Device``; ``cuda`` on
  a machine without an NVIDIA device node is a usage error (``devices.requested``)."""
  from clipbench import devices
  try:
    return devices.requested(text)
  except ValueError as e:
    raise UsageError(f"--{e}") from None


def device_reachable(impls: Sequence[Any], target: Any) -> None:
  """Each implementation named by ``--impl`` must reach ``--device`` in its framework: a run
  that would test nothing for one of them is a usage error."""
  from clipbench import loading
  for impl in loading.mark_off_device(impls, target):
    reason = impl.reason.removeprefix(f"not on {target}: ")
    raise UsageError(f"--device {target}: impl {impl.name!r} cannot run there: {reason}")
