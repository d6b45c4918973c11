"""The Triton route's launch shapes on a CUDA card: work-item length, tiles and warps, timed.

  python -m clipbench.benchmarks.triton_tuning [--gpu-scale 0.25] [--workload NAME ...]
                                               [--config NAME ...] [--output tuning.csv]

The Triton kernels' speed on a card depends on choices no interpreter shows: how long a work
item is (so how many programs a call launches, :mod:`clipbench.impls.own.triton.tables`), how
many units a tile holds (one system, per system, apply) and how many warps run a program. None
of them changes a bit of the output (every bit is a function of the exact values), so this
runs ``clipbench.triton`` under each configuration of :data:`CONFIGS` on each workload, checks
that every configuration gives the output bits of our eager CUDA route (``clipbench.torch``,
timed too), and times each beside the torch call users would make instead
(``clip_grad_norm_(foreach=True)``, or the ``index_add_`` baseline per system), all in one
run: median wall time of calls that wait for the device. The exit status is 1 when some
configuration's bits differ.

``default`` is the route's own configuration; ``items-64k`` the fixed 65,536-unit work items
the route had before items were sized per call; the others change one or two constants.
Without a CUDA device it prints one line and exits 0 (``--device cpu`` runs it on CPU tensors
under ``TRITON_INTERPRET=1``: a smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Iterator, Sequence

from clipbench.benchmarks import workloads

# The tunable module constants, by module: tables (work items) and passes (tiles, warps).
_TABLES = ("MIN_ITEM_UNITS", "MAX_ITEM_UNITS", "TARGET_ITEMS")
_PASSES = ("BLOCK", "SYSTEM_BLOCK", "APPLY_BLOCK", "WARPS", "ROW_UNITS")
CONFIGS: dict[str, dict[str, int]] = {
    "default": {},
    "items-64k": {"MIN_ITEM_UNITS": 1 << 16},
    "elements": {"ROW_UNITS": 0},
    "elements-system-tile-1024": {"ROW_UNITS": 0, "SYSTEM_BLOCK": 1024},
    "items-for-2k": {"TARGET_ITEMS": 2048, "MIN_ITEM_UNITS": 1 << 12},
    "system-tile-1024": {"SYSTEM_BLOCK": 1024},
    "system-tile-256": {"SYSTEM_BLOCK": 256},
    "warps-8": {"WARPS": 8},
    "warps-8-system-tile-1024": {"WARPS": 8, "SYSTEM_BLOCK": 1024},
    "tiles-2k-warps-8": {"BLOCK": 2048, "APPLY_BLOCK": 2048, "WARPS": 8},
}
WORKLOADS = ("W1-model", "W2-relax", "W3-relax-large", "W3-relax-large-max-step",
             "W8-relax-gpu", "W8-relax-gpu-max-step", "W7-model-gpu")
OURS = "clipbench.triton"
EAGER = "clipbench.torch"  # the eager CUDA route: the bits every configuration must give


@contextlib.contextmanager
def configured(settings: dict[str, int]) -> Iterator[None]:
  """The Triton route with ``settings`` in place of its module constants, restored after."""
  from clipbench.impls.own.triton import passes, tables  # pylint: disable=import-outside-toplevel
  unknown = set(settings) - set(_TABLES) - set(_PASSES)
  if unknown:
    raise ValueError(f"settings: unknown constants {sorted(unknown)}")
  saved = {name: getattr(tables if name in _TABLES else passes, name) for name in settings}
  try:
    for name, value in settings.items():
      setattr(tables if name in _TABLES else passes, name, value)
    tables._cache.clear()  # pylint: disable=protected-access
    yield
  finally:
    for name, value in saved.items():
      setattr(tables if name in _TABLES else passes, name, value)
    tables._cache.clear()  # pylint: disable=protected-access


def _cuda_route(device: str):
  """On CPU tensors (the smoke run), the eager route's CUDA branches: the bits Triton gives."""
  if device == "cuda":
    return contextlib.nullcontext()
  from clipbench.impls.own.torch import branches  # pylint: disable=import-outside-toplevel
  return branches.accelerator_branches()


def _output_bits(result) -> list[bytes]:
  import torch  # pylint: disable=import-outside-toplevel
  outs, norm = result
  ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
  return [t.detach().contiguous().view(ints[t.element_size()]).cpu().numpy().tobytes()
          for t in list(outs) + [norm]]


def _timed(impl_name: str, workload, inputs, device: str) -> tuple[float, object] | str:
  """(median seconds, one call's result), or why the case does not run."""
  from clipbench.benchmarks import timing  # pylint: disable=import-outside-toplevel
  from clipbench.benchmarks.gpu_targets import synchronize  # pylint: disable=import-outside-toplevel
  impl, _, reason = timing.load_case(impl_name, workload.name, "float32", device)
  if reason is not None:
    return reason
  prepared = timing.prepare(impl, workload, inputs, device)
  runner = timing.timed_runner(impl, prepared)

  def reset():
    if impl.capabilities.in_place:
      timing.refill_in_place(prepared, inputs)
    synchronize(device)

  for _ in range(2):  # compilation, tables, allocator
    reset()
    result = runner(prepared)
  seconds = timing.median_call_seconds(lambda: runner(prepared), reset, min_calls=5,
                                       max_calls=30, budget_seconds=1.0)
  return seconds, result


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m clipbench.benchmarks.triton_tuning",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--gpu-scale", type=float, default=0.25,
                      help="fraction of the GPU-sized workloads' (W7, W8) stated size")
  parser.add_argument("--scale", type=float, default=1.0,
                      help="fraction of the other workloads' stated size")
  parser.add_argument("--workload", action="append",
                      choices=tuple(w.name for w in workloads.WORKLOADS),
                      help="workload (repeatable)")
  parser.add_argument("--config", action="append", choices=tuple(CONFIGS),
                      help="configuration (repeatable; default: all)")
  parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
  parser.add_argument("--output", help="also write the table as CSV to this path")
  args = parser.parse_args(argv)
  for option, value in (("--gpu-scale", args.gpu_scale), ("--scale", args.scale)):
    if not 0 < value <= 1:
      parser.error(f"{option}: expected a fraction in (0, 1], got {value}")
  from clipbench.benchmarks import gpu_check  # pylint: disable=import-outside-toplevel
  reason = gpu_check.no_gpu_reason() if args.device == "cuda" else None
  if reason:
    print(f"triton_tuning: {reason}; nothing timed")
    return 0
  import pandas as pd  # pylint: disable=import-outside-toplevel
  rows = []
  for name in args.workload or WORKLOADS:
    workload = workloads.get(name)
    scale = args.gpu_scale if workload.gpu_sized else args.scale
    if workloads.host_skip_reason(workload, args.device, scale):
      continue
    inputs = workload.build(scale, "float32")
    peer = ("torch.clip_grad_norm_.foreach" if workload.op == "clip_grad_norm"
            else "baseline.torch-index-add")
    timed = _timed(peer, workload, inputs, args.device)
    peer_ms = timed[0] * 1e3 if isinstance(timed, tuple) else float("nan")
    reference = None
    for config in (EAGER,) + tuple(args.config or CONFIGS):
      if config == EAGER:
        with _cuda_route(args.device):
          timed = _timed(EAGER, workload, inputs, args.device)
      else:
        with configured(CONFIGS[config]):
          timed = _timed(OURS, workload, inputs, args.device)
      row = {"workload": name, "scale": scale, "config": config, "peer": peer,
             "peer_ms": peer_ms}
      if isinstance(timed, str):
        rows.append({**row, "skip": timed})
        continue
      bits = _output_bits(timed[1])
      reference = bits if reference is None else reference
      row.update(ms=timed[0] * 1e3, vs_peer=timed[0] * 1e3 / peer_ms,
                 same_bits=bits == reference)
      rows.append(row)
      print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()},
            flush=True)
    del inputs
  frame = pd.DataFrame(rows)
  print(frame.to_string(index=False, float_format=lambda v: f"{v:,.3f}"))
  if args.output:
    from clipbench import files  # pylint: disable=import-outside-toplevel
    files.write_text(args.output, frame.to_csv(index=False))
  if "same_bits" in frame and not frame["same_bits"].fillna(True).all():
    print("triton_tuning: a configuration changed output bits", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
