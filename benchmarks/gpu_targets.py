"""Issue 30's targets on a CUDA card: our routes beside torch's own calls, timed in one run.

  python -m clipbench.benchmarks.gpu_targets [--gpu-scale 1.0] [--output targets.csv]
                                             [--workload NAME ...] [--impl NAME ...]

For each workload: our CUDA routes (eager, ``torch.compile``d, Triton) and the torch call users
would make instead (``clip_grad_norm_(foreach=True)`` for one system, the ``index_add_``
baseline per system), each prepared once (torch's in-place calls refill the same gradients,
untimed, before every call), warmed up, then timed as the median wall time of calls that wait
for the device. Beside each time: its ratio to the peer's in the same run (the targets: W1 at
most 1.3x, W4 at most 2x, per-system at most 1.3x the baseline), the bandwidth of the
roofline's three passes against the card's measured copy bandwidth and datasheet peak (the
target: Triton and ``torch.compile`` at 50% or more of the peak on the GPU-sized W7 and W8),
and what one call dispatches on the card, counted by the profiler: kernels, memory copies and
the device-to-host copies among them (host round trips).

The GPU-sized workloads (W7, W8) run at ``--gpu-scale`` of their stated size; the others at
their stated size. Without a CUDA device it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from clipbench.benchmarks import timing, workloads

OURS = ("clipbench.torch", "clipbench.torch-compile", "clipbench.triton")
ONE_SYSTEM_PEERS = ("torch.clip_grad_norm_.foreach", "torch.clip_grads_with_norm_")
BASELINE = "baseline.torch-index-add"
WORKLOADS = ("W1-model", "W4-many-small", "W2-relax", "W3-relax-large", "W2-relax-max-step",
             "W3-relax-large-max-step", "W7-model-gpu", "W8-relax-gpu",
             "W8-relax-gpu-max-step")
TARGETS = {"W1-model": 1.3, "W4-many-small": 2.0}  # ours / peer; per system: 1.3
PER_SYSTEM_TARGET = 1.3
PEAK_SHARE_TARGET = 0.5  # of the datasheet peak, Triton and torch.compile on W7 and W8


def _dispatched(run) -> dict[str, int]:
  """Kernels, memory copies and device-to-host copies of one call, from the profiler."""
  import torch
  from torch.profiler import ProfilerActivity, profile
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    run()
    torch.cuda.synchronize()
  kernels = copies = to_host = 0
  for event in prof.events():
    if event.device_type != torch.autograd.DeviceType.CUDA:
      continue
    name = event.name.lower()
    if "memcpy" in name:
      copies += 1
      to_host += "dtoh" in name or "device -> pageable" in name or "device -> pinned" in name
    elif "memset" not in name:
      kernels += 1
  return {"kernels": kernels, "copies": copies, "to_host": to_host}


def synchronize(device: str) -> None:
  if device == "cuda":
    import torch  # pylint: disable=import-outside-toplevel
    torch.cuda.synchronize()


def time_case(impl_name: str, workload: workloads.Workload, inputs,
              device: str = "cuda") -> dict[str, object]:
  """One implementation on one workload's inputs: median time and what a call dispatches."""
  impl, _, reason = timing.load_case(impl_name, workload.name, "float32", device)
  row: dict[str, object] = {"workload": workload.name, "impl": impl_name}
  if reason is not None:
    return {**row, "skip": reason}
  prepared = timing.prepare(impl, workload, inputs, device)
  runner = timing.timed_runner(impl, prepared)
  in_place = impl.capabilities.in_place

  def reset():
    if in_place:
      timing.refill_in_place(prepared, inputs)
    synchronize(device)

  for _ in range(2):  # compilation, caches, allocator
    reset()
    runner(prepared)
  seconds = timing.median_call_seconds(lambda: runner(prepared), reset, min_calls=5,
                                       max_calls=30, budget_seconds=1.0)
  reset()
  counts = _dispatched(lambda: runner(prepared)) if device == "cuda" else {}
  return {**row, "median_ms": seconds * 1e3, **counts}


def with_ratios(frame):
  """The table with each time over its workload's peer's (same run) and the target."""
  peers = {}
  for workload in frame["workload"].unique():
    peer = ONE_SYSTEM_PEERS[0] if workloads.get(workload).op == "clip_grad_norm" else BASELINE
    times = frame.loc[(frame["workload"] == workload) & (frame["impl"] == peer), "median_ms"]
    peers[workload] = float(times.iloc[0]) if len(times) else float("nan")
  frame = frame.copy()
  frame["vs_peer"] = frame["median_ms"] / frame["workload"].map(peers)
  frame["target"] = [TARGETS.get(w, None if workloads.get(w).op == "clip_grad_norm" else
                                 PER_SYSTEM_TARGET) for w in frame["workload"]]
  return frame


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m clipbench.benchmarks.gpu_targets",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--gpu-scale", type=float, default=1.0,
                      help="fraction of the GPU-sized workloads' (W7, W8) stated size")
  parser.add_argument("--scale", type=float, default=1.0,
                      help="fraction of the other workloads' stated size")
  parser.add_argument("--workload", action="append", help="workload (repeatable)")
  parser.add_argument("--impl", action="append", help="implementation (repeatable)")
  parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                      help="cpu: a smoke run of this script on a machine without a GPU")
  parser.add_argument("--output", help="also write the table as CSV to this path")
  args = parser.parse_args(argv)
  for option, value in (("--gpu-scale", args.gpu_scale), ("--scale", args.scale)):
    if not 0 < value <= 1:
      parser.error(f"{option}: expected a fraction in (0, 1], got {value}")
  from clipbench.benchmarks import gpu_check  # pylint: disable=import-outside-toplevel
  reason = gpu_check.no_gpu_reason() if args.device == "cuda" else None
  if reason:
    print(f"gpu_targets: {reason}; nothing timed")
    return 0
  import pandas as pd  # pylint: disable=import-outside-toplevel
  copy_gbs, peak = float("nan"), None
  if args.device == "cuda":
    copy_gbs = gpu_check.measure_cuda_copy_bandwidth() / 1e9
    card = gpu_check.card_facts()
    peak = card["peak_gbs"]
    print(f"{card['name']}: copy {copy_gbs:,.0f} GB/s, datasheet peak "
          f"{peak if peak else 'unknown'} GB/s; {card['software']}", flush=True)
  rows = []
  for name in args.workload or WORKLOADS:
    workload = workloads.get(name)
    scale = args.gpu_scale if workload.gpu_sized else args.scale
    if workloads.host_skip_reason(workload, args.device, scale):
      continue
    inputs = workload.build(scale, "float32")
    one_system = workload.op == "clip_grad_norm"
    impls = args.impl or (OURS + (ONE_SYSTEM_PEERS if one_system else (BASELINE,)))
    for impl_name in impls:
      row = time_case(impl_name, workload, inputs, args.device)
      row["scale"] = scale
      if "median_ms" in row:
        gbs = workloads.bytes_moved(inputs) / (row["median_ms"] / 1e3) / 1e9
        row.update(gbs=gbs, of_copy=gbs / copy_gbs, of_peak=gbs / peak if peak else None)
      rows.append(row)
      print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()},
            flush=True)
    del inputs
  frame = with_ratios(pd.DataFrame(rows))
  print(frame.to_string(index=False, float_format=lambda v: f"{v:,.3f}"))
  if args.output:
    from clipbench import files  # pylint: disable=import-outside-toplevel
    files.write_text(args.output, frame.to_csv(index=False))
  return 0


if __name__ == "__main__":
  sys.exit(main())
