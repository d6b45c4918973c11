"""The report's plots as PNG bytes (matplotlib, Agg, no pyplot global state).

* Time against problem size, log-log, one line per implementation, for each family of
  workloads (same operation and p) that was run at two sizes or more, with the roofline
  (bytes moved / measured bandwidth) as a dashed line: a curve parallel to it scales as well
  as memory allows; one that flattens at small sizes is dominated by overhead.
* Roofline ratios as horizontal bars, one panel per workload (log axis; 1 is the bound).
"""

from __future__ import annotations

import dataclasses
import io
import math
import re
from typing import Callable, Sequence

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from clipbench.reports.tables import dtype_sort_key


@dataclasses.dataclass(frozen=True)
class Plot:
  """A rendered figure: ``name`` is its file stem, ``title`` its caption."""

  name: str
  title: str
  png: bytes


def _png(fig: Figure) -> bytes:
  buffer = io.BytesIO()
  # No metadata: the same data gives the same bytes (a regenerated report diffs cleanly).
  fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
  return buffer.getvalue()


def impl_colors(impls: Sequence[str]) -> dict[str, tuple[float, ...]]:
  """A fixed color per implementation, so one implementation looks the same in every plot."""
  from matplotlib import colormaps  # pylint: disable=import-outside-toplevel
  cmap = colormaps["tab20"]
  return {name: cmap(i % 20) for i, name in enumerate(sorted(set(impls)))}


def _slug(text: str) -> str:
  return re.sub(r"[^0-9a-z]+", "-", text.lower()).strip("-")


def _readable_log_axis(axis) -> None:
  # Ticks at 1, 2, 5 x 10^k as plain numbers: ratios and times often span less than a decade,
  # where the default shows one labelled tick or a crowd of overlapping minor labels.
  axis.set_major_locator(LogLocator(base=10.0, subs=(1.0, 2.0, 5.0)))
  axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
  axis.set_minor_formatter(NullFormatter())


def time_vs_size(performance: pd.DataFrame, family: Callable[[str], str]) -> list[Plot]:
  """One log-log plot per workload family having at least two problem sizes."""
  if performance.empty:
    return []
  frame = performance.assign(family=performance["workload"].map(family))
  colors = impl_colors(frame["impl"])
  plots = []
  for fam, group in frame.groupby("family", sort=True):
    dtypes = [d for d in sorted(group["dtype"].unique(), key=dtype_sort_key)
              if group.loc[group["dtype"] == d, "bytes_moved"].nunique() >= 2]
    if not dtypes:
      continue
    fig = Figure(figsize=(5.2 * len(dtypes), 4.2))
    axes = fig.subplots(1, len(dtypes), squeeze=False)[0]
    for ax, dtype in zip(axes, dtypes):
      rows = group[group["dtype"] == dtype].sort_values("bytes_moved")
      for impl, line in rows.groupby("impl", sort=True):
        ax.plot(line["bytes_moved"] / 1e6, line["median_s"], marker="o", label=impl,
                color=colors[impl])
      bound = rows.groupby("bytes_moved")["bandwidth_gbs"].median().dropna()
      bound = bound[bound > 0]
      if len(bound):
        ax.plot(bound.index / 1e6, bound.index / (bound.to_numpy() * 1e9), "k--", lw=1,
                label="roofline")
      ax.set(xscale="log", yscale="log", xlabel="bytes moved by the roofline (MB)",
             ylabel="median time (s)", title=f"{fam}, {dtype}")
      ax.grid(True, which="both", alpha=0.3)
      _readable_log_axis(ax.xaxis)
      _readable_log_axis(ax.yaxis)
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    plots.append(Plot(f"time-vs-size-{_slug(fam)}", f"Time against problem size: {fam}",
                      _png(fig)))
  return plots


def roofline_bars(performance: pd.DataFrame) -> Plot | None:
  """Roofline ratio of every implementation x dtype, one panel per workload."""
  frame = performance.dropna(subset=["roofline_ratio"])
  frame = frame[frame["roofline_ratio"] > 0]
  if frame.empty:
    return None
  workloads = sorted(frame["workload"].unique())
  ncols = min(3, len(workloads))
  nrows = math.ceil(len(workloads) / ncols)
  bars_per_panel = frame.groupby("workload").size().max()
  fig = Figure(figsize=(5.0 * ncols, max(2.0, 0.22 * bars_per_panel + 1.0) * nrows))
  axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
  colors = impl_colors(frame["impl"])
  for ax, workload in zip(axes, workloads):
    rows = frame[frame["workload"] == workload].sort_values("roofline_ratio", ascending=False)
    labels = [f"{i} ({d})" for i, d in zip(rows["impl"], rows["dtype"])]
    ax.barh(range(len(rows)), rows["roofline_ratio"], color=[colors[i] for i in rows["impl"]])
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.axvline(1.0, color="k", lw=1, ls="--")
    ax.set_xscale("log")
    ax.set_title(workload, fontsize=9)
    ax.set_xlabel("median time / roofline time (1 = bound)", fontsize=8)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    _readable_log_axis(ax.xaxis)
  for ax in axes[len(workloads):]:
    ax.set_visible(False)
  fig.tight_layout()
  return Plot("roofline-ratios", "Roofline ratio per workload (lower is better; 1 is the bound)",
              _png(fig))
