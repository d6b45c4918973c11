"""A pytest-benchmark JSON (from ``bench_workloads.py``) as one row per workload x implementation.

Columns: ``median_s`` (median call time), ``gbs`` (the three-pass bytes over the median time,
in GB/s), ``roofline_ratio`` (median over the roofline time at the bandwidth measured in that
run; 1.0 is the bound, lower is better) and ``speedup_vs_best_library`` (the fastest library
adapter's median on the same workload, dtype and device over this median; above 1 is faster)
and, for our own implementations, ``time_vs_framework_peer``: this median over the fastest
library or baseline of the same framework (JAX, torch) on the same workload, dtype and device
(at most 1.0: as fast as what that framework's users have; issue 17's targets).
"""

from __future__ import annotations

import json
import math
import os

import pandas as pd

from clipbench.benchmarks import workloads
from clipbench.impls import registry

COLUMNS = ("workload", "impl", "kind", "dtype", "device", "median_s", "gbs", "roofline_ratio",
           "speedup_vs_best_library", "time_vs_framework_peer", "bandwidth_gbs", "bytes_moved")
_DERIVED = ("speedup_vs_best_library", "time_vs_framework_peer")


def _row(bench: dict) -> dict:
  info = bench.get("extra_info", {})
  median = float(bench["stats"]["median"])
  nbytes = float(info["bytes_moved"])
  impl = info["impl"]
  return {
      "workload": info.get("workload", bench.get("group")),
      "impl": impl,
      "kind": info.get("kind") or registry.kind_of(impl),
      "dtype": info.get("dtype", "float32"),
      "device": info.get("device", "cpu"),
      "median_s": median,
      "gbs": nbytes / median / 1e9 if median > 0 else math.inf,
      "roofline_ratio": median / float(info["roofline_seconds"]),
      "bandwidth_gbs": float(info["bandwidth_gbs"]),
      "bytes_moved": int(nbytes),
  }


def summarize(json_path: str | os.PathLike) -> pd.DataFrame:
  """One row per (workload, impl, dtype, device) of a ``--benchmark-json`` file."""
  with open(json_path, encoding="utf-8") as f:
    data = json.load(f)
  rows = [_row(b) for b in data.get("benchmarks", []) if "impl" in b.get("extra_info", {})]
  frame = pd.DataFrame(rows, columns=[c for c in COLUMNS if c not in _DERIVED])
  keys = ["workload", "dtype", "device"]
  library = frame[frame["kind"] == "library"].groupby(keys)["median_s"].min()
  best = frame.join(library.rename("best_library_s"), on=keys)["best_library_s"]
  frame["speedup_vs_best_library"] = best / frame["median_s"]
  frame["time_vs_framework_peer"] = _time_vs_framework_peer(frame, keys)
  order = {name: i for i, name in enumerate(workloads.NAMES)}
  frame = frame.assign(_order=frame["workload"].map(order).fillna(len(order)))
  frame = frame.sort_values(["_order", "dtype", "device", "median_s"]).drop(columns="_order")
  return frame[list(COLUMNS)].reset_index(drop=True)


def _time_vs_framework_peer(frame: pd.DataFrame, keys: list[str]) -> pd.Series:
  """Own rows: median over the fastest library or baseline median of the same framework."""
  framework = frame["impl"].map(registry.framework_of)
  peers = frame[frame["kind"].isin(("library", "baseline"))].assign(framework=framework)
  fastest = peers.groupby(keys + ["framework"])["median_s"].min().rename("peer_s")
  joined = frame.assign(framework=framework).join(fastest, on=keys + ["framework"])
  ratio = joined["median_s"] / joined["peer_s"]
  return ratio.where(frame["kind"] == "own")
