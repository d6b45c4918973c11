"""``clipbench list``: every implementation with its availability, version and capabilities.

The same description of an implementation (:func:`describe`) feeds the ``--json`` output, the
terminal table and the report's list of implementations (:func:`listing_frame`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any, Sequence

from clipbench import loading, terminal
from clipbench.errors import EXIT_OK

OWN_KINDS = ("own", "reference")  # shipped by clipbench: their version is clipbench's


def display_version(impl: Any) -> str:
  """The version a reader should quote: the library's for an adapter, clipbench's for our own
  kernels and the reference (then the framework's in brackets, when it differs)."""
  if impl.kind not in OWN_KINDS:
    return impl.version or ""
  from clipbench import __version__
  own = f"clipbench {__version__}"
  if impl.library and impl.library != "clipbench" and impl.version:
    return f"{own} ({impl.library} {impl.version})"
  return own


def describe(impl: Any) -> dict[str, Any]:
  """An implementation as plain JSON-able data (p = inf as the string "inf": strict JSON).

  ``version`` is :func:`display_version`; ``library_version`` the version of ``library``.
  """
  caps = dataclasses.asdict(impl.capabilities)
  if isinstance(caps["norm_types"], (list, tuple)):
    caps["norm_types"] = [p if math.isfinite(p) else str(p) for p in caps["norm_types"]]
  return {"name": impl.name, "target": impl.target, "kind": impl.kind, "library": impl.library,
          "available": impl.available, "reason": impl.reason, "version": display_version(impl),
          "library_version": impl.version,
          "framework": impl.framework, "ops": list(impl.ops),
          "capabilities": caps if impl.available else None,
          "capabilities_summary": impl.capabilities.summary() if impl.available else "",
          "description": impl.description}


def listing_frame(impls: Sequence[Any]) -> Any:
  """The implementations as the report's table (one row each, capabilities summarized)."""
  import pandas as pd
  rows = [describe(i) for i in impls]
  return pd.DataFrame([{**r, "capabilities": r["capabilities_summary"]} for r in rows],
                      columns=["name", "kind", "available", "reason", "version", "framework",
                               "ops", "capabilities"])


def print_listing(rows: Sequence[dict[str, Any]]) -> None:
  """The rows of :func:`describe` as a table that folds into the terminal's width."""
  from rich.markup import escape
  from rich.table import Table
  # Four columns, each fact on its own line within a cell, so the table folds into 80 columns
  # (a min_width makes rich overrun the width; a max_width does not).
  table = Table(title="clipbench implementations", show_lines=True)
  table.add_column("implementation", overflow="fold")
  table.add_column("version", overflow="fold", max_width=len("clipbench 0.1.0"))
  table.add_column("ops", overflow="fold")
  table.add_column("capabilities", overflow="fold")
  for r in rows:
    name = f"{escape(r['name'])}\n[dim]{r['kind']}, {r['framework'] or '-'}[/]"
    if r["available"]:
      capabilities = escape(r["capabilities_summary"] or "-").replace("; ", "\n")
    else:
      capabilities = f"[red]unavailable[/]: {escape(r['reason'] or '')}"
    version = escape(r["version"] or "-").replace(" (", "\n(")
    table.add_row(name, version, "\n".join(r["ops"]) or "-", capabilities)
  terminal.console().print(table)


def list_command(args: argparse.Namespace) -> int:
  """``clipbench list [--impl NAME]... [--json]``."""
  impls = (loading.load_requested(args.impl, require_available=False) if args.impl
           else loading.load_all())
  rows = [describe(i) for i in impls]
  if args.json:
    print(json.dumps(rows, indent=2, default=str))
  else:
    print_listing(rows)
  return EXIT_OK
