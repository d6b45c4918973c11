"""The arguments every standalone benchmark script takes: a workload scale and a repeat count.

``python -m clipbench.benchmarks.in_step``, ``.sharded`` and ``.sharded_torch`` time a few
implementations outside ``clipbench bench``; each takes ``--scale`` (a fraction of the
workloads' stated sizes) and ``--repeats`` (timed calls per point), checked the same way; the
sharded ones also ``--norm-type``. ``.costs`` and ``.triton_launcher`` take ``--workload``
(repeatable) and ``--scale``.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from clipbench.benchmarks import workloads


def add_workloads_and_scale(parser: argparse.ArgumentParser, defaults: Sequence[str]) -> None:
  parser.add_argument("--workload", action="append", help="workload (repeatable; default: "
                      + ", ".join(defaults) + ")")
  parser.add_argument("--scale", type=float, default=1.0,
                      help="fraction of the workloads' stated sizes (default 1)")


def checked_workloads(parser: argparse.ArgumentParser, args: argparse.Namespace,
                      defaults: Sequence[str]) -> list[str]:
  """The workloads asked for (``defaults`` when none is), each known; exits through
  ``parser.error`` on an unknown name or unless 0 < scale <= 1."""
  if not 0 < args.scale <= 1:
    parser.error(f"--scale: expected a fraction in (0, 1], got {args.scale}")
  names = args.workload or list(defaults)
  try:
    for name in names:
      workloads.get(name)
  except ValueError as e:
    parser.error(str(e))
  return names


def add_scale_and_repeats(parser: argparse.ArgumentParser, *, scale: float, repeats: int,
                          scale_help: str, repeats_help: str) -> None:
  parser.add_argument("--scale", type=float, default=scale,
                      help=f"{scale_help} (default {scale:g})")
  parser.add_argument("--repeats", type=int, default=repeats,
                      help=f"{repeats_help} (default {repeats})")


def check_scale_and_repeats(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Exits through ``parser.error`` unless 0 < scale <= 1 and repeats >= 1."""
  if not 0 < args.scale <= 1:
    parser.error(f"--scale: expected a fraction in (0, 1], got {args.scale}")
  if args.repeats < 1:
    parser.error(f"--repeats: expected at least 1, got {args.repeats}")


def add_norm_type(parser: argparse.ArgumentParser, default: float | None, default_help: str):
  parser.add_argument("--norm-type", type=float, default=default,
                      help=f"the p of every call: at least 1, inf or -inf ({default_help})")


def check_norm_type(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Exits through ``parser.error`` unless ``--norm-type`` is unset, at least 1, or +-inf."""
  p = args.norm_type
  if p is not None and not (p >= 1 or p in (float("inf"), float("-inf"))):
    parser.error(f"--norm-type: expected at least 1, inf or -inf, got {p}")
