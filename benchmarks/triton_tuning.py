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

from clipbench.benchmarks import gpu_targets

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
  # pylint: disable-next=import-outside-toplevel
  from clipbench.impls.own.triton import layouts, passes, tables
  unknown = set(settings) - set(_TABLES) - set(_PASSES)
  if unknown:
    raise ValueError(f"settings: unknown constants {sorted(unknown)}")
  saved = {name: getattr(tables if name in _TABLES else passes, name) for name in settings}
  try:
    for name, value in settings.items():
      setattr(tables if name in _TABLES else passes, name, value)
    layouts.clear()
    yield
  finally:
    for name, value in saved.items():
      setattr(tables if name in _TABLES else passes, name, value)
    layouts.clear()


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


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m clipbench.benchmarks.triton_tuning",
                                   description=__doc__.split("\n\n")[0])
  gpu_targets.add_card_arguments(parser, gpu_scale=0.25)
  parser.add_argument("--config", action="append", choices=tuple(CONFIGS),
                      help="configuration (repeatable; default: all)")
  args = parser.parse_args(argv)
  if gpu_targets.card_absent(parser, args):
    return 0
  import pandas as pd  # pylint: disable=import-outside-toplevel
  rows = []
  for workload, scale, inputs in gpu_targets.workload_inputs(args, WORKLOADS):
    peer = gpu_targets.peer_of(workload.name)
    case = gpu_targets.timed(peer, workload, inputs, args.device)
    peer_ms = float("nan") if isinstance(case, str) else case.seconds * 1e3
    reference = None
    for config in (EAGER,) + tuple(args.config or CONFIGS):
      if config == EAGER:
        with _cuda_route(args.device):
          case = gpu_targets.timed(EAGER, workload, inputs, args.device)
      else:
        with configured(CONFIGS[config]):
          case = gpu_targets.timed(OURS, workload, inputs, args.device)
      row = {"workload": workload.name, "scale": scale, "config": config, "peer": peer,
             "peer_ms": peer_ms}
      if isinstance(case, str):
        rows.append({**row, "skip": case})
        continue
      bits = _output_bits(case.result)
      reference = bits if reference is None else reference
      row.update(ms=case.seconds * 1e3, vs_peer=case.seconds * 1e3 / peer_ms,
                 same_bits=bits == reference)
      rows.append(row)
      gpu_targets.print_row(row)
    del inputs  # before the next workload's are built
  frame = pd.DataFrame(rows)
  gpu_targets.report(frame, args.output)
  if "same_bits" in frame and not frame["same_bits"].fillna(True).all():
    print("triton_tuning: a configuration changed output bits", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
