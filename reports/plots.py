"""The report's plots as PNG bytes (matplotlib, Agg, no pyplot global state).

* Time against problem size, log-log, one line per implementation, for each family of
  workloads (same operation and p) that was run at two sizes or more, with the roofline
  (bytes moved / measured bandwidth) as a dashed line: a curve parallel to it scales as well
  as memory allows; one that flattens at small sizes is dominated by overhead. The x ticks
  name the workloads; each implementation has its own color, marker and line style (fifteen
  lines in one panel are told apart by more than a shade), and the legend lists them from
  fastest to slowest at the largest size.
* Roofline ratios as horizontal bars, one panel per workload (log axis; 1 is the bound).

Log axes get ticks at 1, 2 and 5 per decade over up to two decades and at powers of ten
beyond (W4's ratios span four decades, where 1-2-5 labels overlap).
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


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*", "h", "p")
_LINESTYLES = ("-", "--", "-.", ":")


def readable_log_axis(axis, low: float, high: float) -> None:
  """Plain-number ticks at 1, 2, 5 x 10^k over at most two decades, 10^k beyond.

  Ratios and times often span less than a decade, where the default shows one labelled tick;
  over more than two decades 1-2-5 labels run into each other.
  """
  decades = math.log10(high / low) if low > 0 and high > low else 0.0
  subs = (1.0, 2.0, 5.0) if decades <= 2.0 else (1.0,)
  axis.set_major_locator(LogLocator(base=10.0, subs=subs))
  axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
  axis.set_minor_formatter(NullFormatter())


def impl_styles(impls: Sequence[str]) -> dict[str, dict[str, object]]:
  """Color, marker and line style per implementation, fixed across plots."""
  colors = impl_colors(impls)
  names = sorted(set(impls))
  return {name: {"color": colors[name], "marker": _MARKERS[i % len(_MARKERS)],
                 "linestyle": _LINESTYLES[(i // len(_MARKERS)) % len(_LINESTYLES)]}
          for i, name in enumerate(names)}


def time_vs_size(performance: pd.DataFrame, family: Callable[[str], str]) -> list[Plot]:
  """One log-log plot per workload family having at least two problem sizes."""
  if performance.empty:
    return []
  frame = performance.assign(family=performance["workload"].map(family))
  styles = impl_styles(frame["impl"])
  plots = []
  for fam, group in frame.groupby("family", sort=True):
    dtypes = [d for d in sorted(group["dtype"].unique(), key=dtype_sort_key)
              if group.loc[group["dtype"] == d, "bytes_moved"].nunique() >= 2]
    if not dtypes:
      continue
    fig = Figure(figsize=(6.4 * len(dtypes), 4.8))
    axes = fig.subplots(1, len(dtypes), squeeze=False)[0]
    for ax, dtype in zip(axes, dtypes):
      rows = group[group["dtype"] == dtype].sort_values("bytes_moved")
      largest = rows["bytes_moved"].max()
      at_largest = rows[rows["bytes_moved"] == largest].set_index("impl")["median_s"]
      order = sorted(rows["impl"].unique(), key=lambda i: (at_largest.get(i, math.inf), i))
      for impl in order:
        line = rows[rows["impl"] == impl]
        ax.plot(line["bytes_moved"] / 1e6, line["median_s"], label=impl, markersize=5,
                lw=1.4, **styles[impl])
      bound = rows.groupby("bytes_moved")["bandwidth_gbs"].median().dropna()
      bound = bound[bound > 0]
      if len(bound):
        ax.plot(bound.index / 1e6, bound.index / (bound.to_numpy() * 1e9), color="k", lw=2,
                ls=(0, (4, 2)), label="roofline (memory bound)")
      ax.set(xscale="log", yscale="log", ylabel="median time (s), lower is better",
             title=f"{fam}, {dtype}")
      ax.grid(True, which="major", alpha=0.35)
      times = rows["median_s"][rows["median_s"] > 0]
      if len(bound):
        times = pd.concat([times, pd.Series(bound.index / (bound.to_numpy() * 1e9))])
      readable_log_axis(ax.yaxis, float(times.min()), float(times.max()))
      # The x ticks are the workloads themselves: a reader looks for W4, not for 36 MB.
      sizes = rows.groupby("bytes_moved")["workload"].agg(lambda w: " / ".join(sorted(set(w))))
      ax.set_xticks(sizes.index / 1e6, [f"{w}\n{b / 1e6:.3g} MB" for b, w in sizes.items()],
                    fontsize=8)
      ax.xaxis.set_minor_formatter(NullFormatter())
      ax.set_xlabel("bytes moved by the roofline", fontsize=9)
      ax.set_xlim(sizes.index.min() / 1e6 / 1.6, sizes.index.max() / 1e6 * 1.6)
      ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                title="fastest first", title_fontsize=7)
    fig.tight_layout()
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
    ax.set_xlabel("median time / roofline time (1 = bound; lower is better)", fontsize=8)
    ax.grid(True, axis="x", which="major", alpha=0.3)
    ratios = rows["roofline_ratio"]
    readable_log_axis(ax.xaxis, min(float(ratios.min()), 1.0), max(float(ratios.max()), 1.0))
  for ax in axes[len(workloads):]:
    ax.set_visible(False)
  fig.tight_layout()
  return Plot("roofline-ratios", "Roofline ratio per workload (lower is better; 1 is the bound)",
              _png(fig))
