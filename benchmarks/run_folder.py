"""What the processes of one asv run share through its folder: built inputs and figures.

asv runs every benchmark of a run in one working folder (its ``setup_cache`` directory) and
deletes it at the end. The processes of the run (one per grid point and metric) leave two
things there for each other: each workload's built inputs (W1 and W3 take 0.3-1.3 s to draw),
and each grid point's figures (median call time, bytes moved, ulp error, or why it cannot run),
measured once by the first speed process so the Track processes need not load a framework.
Every file is written through a temporary file and a rename: a reader sees all of it or
nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from typing import Any, Callable

import numpy as np

from clipbench.benchmarks import workloads

# A grid point: (impl, workload, dtype, device).
Point = tuple[str, str, str, str]


def atomic_write(path: str, write: Callable[[Any], None]) -> None:
  """Writes ``path`` through a temporary file and a rename: readers see all of it or nothing.

  (Not ``clipbench.files``: it imports pandas, a cost in every benchmark process, and fsyncs,
  which a scratch folder deleted at the end of the run does not need.)
  """
  folder = os.path.dirname(path)
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
  try:
    with os.fdopen(fd, "wb") as f:
      write(f)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)
    raise


def _path(run_dir: str, kind: str, *parts: Any, suffix: str) -> str:
  name = "--".join(str(p) for p in parts).replace(os.sep, "_")
  return os.path.join(run_dir, "clipbench", kind, name + suffix)


def inputs_path(run_dir: str, workload: str, dtype: str, scale: float) -> str:
  return _path(run_dir, "inputs", workload, dtype, repr(scale), suffix=".npz")


def save_inputs(path: str, inputs: workloads.WorkloadInputs) -> None:
  """Stores ``inputs`` bit for bit (bfloat16 too) as one .npz of a few flat arrays."""
  leaves = [np.ascontiguousarray(x) for x in inputs.leaves]
  itemsize = leaves[0].dtype.itemsize if leaves else 1
  arrays = {
      "bits": np.concatenate([x.reshape(-1).view(f"u{itemsize}") for x in leaves])
              if leaves else np.zeros(0, np.uint8),
      "ndim": np.array([x.ndim for x in leaves], np.int64),
      "shape": np.array([n for x in leaves for n in x.shape], np.int64),
      "scalars": np.array([inputs.threshold, inputs.norm_type], np.float64),
      "num_systems": np.array(-1 if inputs.num_systems is None else inputs.num_systems,
                              np.int64),
  }
  if inputs.segments is not None:
    arrays["segments"] = np.concatenate([np.asarray(s, np.int64) for s in inputs.segments])
    arrays["segment_sizes"] = np.array([len(s) for s in inputs.segments], np.int64)
  atomic_write(path, lambda f: np.savez(f, **arrays))


def load_inputs(path: str, dtype: str) -> workloads.WorkloadInputs:
  """Reads what ``save_inputs`` wrote; the leaves are views of one buffer."""
  with np.load(path, allow_pickle=False) as data:
    bits, ndim, shape = data["bits"], data["ndim"], data["shape"]
    threshold, norm_type = (float(v) for v in data["scalars"])
    num_systems = int(data["num_systems"])
    segments = None
    if "segments" in data:
      cuts = np.cumsum(data["segment_sizes"])[:-1]
      segments = tuple(np.split(data["segments"], cuts))
  flat = bits.view(workloads.numpy_dtype(dtype))
  leaves, at, dim_at = [], 0, 0
  for n in ndim:
    dims = tuple(int(d) for d in shape[dim_at:dim_at + n])
    size = math.prod(dims)
    leaves.append(flat[at:at + size].reshape(dims))
    at, dim_at = at + size, dim_at + n
  return workloads.WorkloadInputs(tuple(leaves), threshold, segments,
                                  None if num_systems < 0 else num_systems, norm_type)


def _figures_path(run_dir: str, point: Point, scale: float) -> str:
  return _path(run_dir, "figures", *point, repr(scale), suffix=".json")


def read_figures(run_dir: str | None, point: Point, scale: float) -> dict[str, Any] | None:
  """The figures recorded for ``point`` in this run, or None."""
  if not run_dir:
    return None
  try:
    with open(_figures_path(run_dir, point, scale), encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def write_figures(run_dir: str, point: Point, scale: float, figures: dict[str, Any]) -> None:
  text = json.dumps(figures).encode("utf-8")
  atomic_write(_figures_path(run_dir, point, scale), lambda f: f.write(text))
