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
the device-to-host copies among them (host round trips), and the card's busy time in them.

The GPU-sized workloads (W7, W8) run at ``--gpu-scale`` of their stated size; the others at
their stated size. Without a CUDA device it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Callable, Iterator, Sequence

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


def _dispatched(run) -> dict[str, float]:
  """What one call dispatches on the card, from the profiler (:func:`device_activity`)."""
  import torch
  from torch.profiler import ProfilerActivity, profile
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    run()
    torch.cuda.synchronize()
  return device_activity(e for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA)


def device_activity(events) -> dict[str, float]:
  """Kernels, memory copies and the device-to-host copies among them, of the profiler's device
  events; the microseconds the card spends in them (``device_us``) and from the first one's
  start to the last one's end (``device_span_us``). A wall time far over the span is the
  host's: launches, Python, round trips."""
  kernels = copies = to_host = 0
  busy, starts, ends = 0.0, [], []
  for event in events:
    name = event.name.lower()
    if "memcpy" in name:
      copies += 1
      to_host += "dtoh" in name or "device -> pageable" in name or "device -> pinned" in name
    elif "memset" not in name:
      kernels += 1
    busy += event.time_range.elapsed_us()
    starts.append(event.time_range.start)
    ends.append(event.time_range.end)
  return {"kernels": kernels, "copies": copies, "to_host": to_host, "device_us": busy,
          "device_span_us": max(ends) - min(starts) if starts else 0.0}


def synchronize(device: str) -> None:
  if device == "cuda":
    import torch  # pylint: disable=import-outside-toplevel
    torch.cuda.synchronize()


@dataclasses.dataclass
class Timed:
  """One implementation timed on one workload's inputs: the median, the last call's result,
  and the call with its untimed reset (for a profile of one more call)."""

  seconds: float
  result: object
  call: Callable[[], object]
  reset: Callable[[], None]


def timed(impl_name: str, workload: workloads.Workload, inputs,
          device: str = "cuda") -> Timed | str:
  """The implementation prepared once, warmed up, then the median wall time of calls that
  wait for the device (torch's in-place calls refill their gradients, untimed, before each);
  or why the case does not run."""
  impl, _, reason = timing.load_case(impl_name, workload.name, "float32", device)
  if reason is not None:
    return reason
  prepared = timing.prepare(impl, workload, inputs, device)
  runner = timing.timed_runner(impl, prepared)
  in_place = impl.capabilities.in_place

  def reset():
    if in_place:
      timing.refill_in_place(prepared, inputs)
    synchronize(device)

  for _ in range(2):  # compilation, caches, allocator
    reset()
    result = runner(prepared)
  seconds = timing.median_call_seconds(lambda: runner(prepared), reset, min_calls=5,
                                       max_calls=30, budget_seconds=1.0)
  return Timed(seconds, result, lambda: runner(prepared), reset)


def time_case(impl_name: str, workload: workloads.Workload, inputs,
              device: str = "cuda") -> dict[str, object]:
  """One implementation on one workload's inputs: median time and what a call dispatches."""
  row: dict[str, object] = {"workload": workload.name, "impl": impl_name}
  case = timed(impl_name, workload, inputs, device)
  if isinstance(case, str):
    return {**row, "skip": case}
  case.reset()
  counts = _dispatched(case.call) if device == "cuda" else {}
  return {**row, "median_ms": case.seconds * 1e3, **counts}


def peer_of(workload_name: str) -> str:
  """The torch call users would make instead: foreach for one system, else the baseline."""
  one_system = workloads.get(workload_name).op == "clip_grad_norm"
  return ONE_SYSTEM_PEERS[0] if one_system else BASELINE


def add_card_arguments(parser: argparse.ArgumentParser, gpu_scale: float) -> None:
  """The options every script timing on a card takes: sizes, workloads, device, output."""
  parser.add_argument("--gpu-scale", type=float, default=gpu_scale,
                      help="fraction of the GPU-sized workloads' (W7, W8) stated size")
  parser.add_argument("--scale", type=float, default=1.0,
                      help="fraction of the other workloads' stated size")
  parser.add_argument("--workload", action="append",
                      choices=tuple(w.name for w in workloads.WORKLOADS),
                      help="workload (repeatable)")
  parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                      help="cpu: a smoke run of this script on a machine without a GPU")
  parser.add_argument("--output", help="also write the table as CSV to this path")


def card_absent(parser: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
  """Checks the sizes (``parser.error``); True, having said so, where no card is there."""
  for option, value in (("--gpu-scale", args.gpu_scale), ("--scale", args.scale)):
    if not 0 < value <= 1:
      parser.error(f"{option}: expected a fraction in (0, 1], got {value}")
  from clipbench.benchmarks import gpu_check  # pylint: disable=import-outside-toplevel
  reason = gpu_check.no_gpu_reason() if args.device == "cuda" else None
  if reason:
    print(f"{parser.prog.split('.')[-1]}: {reason}; nothing timed")
  return bool(reason)


def workload_inputs(args: argparse.Namespace,
                    default: Sequence[str]) -> Iterator[tuple[workloads.Workload, float, object]]:
  """(workload, scale, float32 inputs) of each workload the run takes, built one at a time;
  those the device cannot hold at their scale are left out."""
  for name in args.workload or default:
    workload = workloads.get(name)
    scale = args.gpu_scale if workload.gpu_sized else args.scale
    if workloads.host_skip_reason(workload, args.device, scale):
      continue
    yield workload, scale, workload.build(scale, "float32")


def print_row(row: dict[str, object]) -> None:
  print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)


def report(frame, output: str | None) -> None:
  """The table printed, and written atomically as CSV where asked."""
  print(frame.to_string(index=False, float_format=lambda v: f"{v:,.3f}"))
  if output:
    from clipbench import files  # pylint: disable=import-outside-toplevel
    files.write_text(output, frame.to_csv(index=False))


def with_ratios(frame):
  """The table with each time over its workload's peer's (same run) and the target."""
  peers = {}
  for workload in frame["workload"].unique():
    peer = peer_of(workload)
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
  add_card_arguments(parser, gpu_scale=1.0)
  parser.add_argument("--impl", action="append", help="implementation (repeatable)")
  args = parser.parse_args(argv)
  if card_absent(parser, args):
    return 0
  import pandas as pd  # pylint: disable=import-outside-toplevel
  from clipbench.benchmarks import gpu_check  # pylint: disable=import-outside-toplevel
  copy_gbs, peak = float("nan"), None
  if args.device == "cuda":
    copy_gbs = gpu_check.measure_cuda_copy_bandwidth() / 1e9
    card = gpu_check.card_facts()
    peak = card["peak_gbs"]
    print(f"{card['name']}: copy {copy_gbs:,.0f} GB/s, datasheet peak "
          f"{peak if peak else 'unknown'} GB/s; {card['software']}", flush=True)
  rows = []
  for workload, scale, inputs in workload_inputs(args, WORKLOADS):
    one_system = workload.op == "clip_grad_norm"
    impls = args.impl or (OURS + (ONE_SYSTEM_PEERS if one_system else (BASELINE,)))
    for impl_name in impls:
      row = time_case(impl_name, workload, inputs, args.device)
      row["scale"] = scale
      if "median_ms" in row:
        gbs = workloads.bytes_moved(inputs) / (row["median_ms"] / 1e3) / 1e9
        row.update(gbs=gbs, of_copy=gbs / copy_gbs, of_peak=gbs / peak if peak else None)
      rows.append(row)
      print_row(row)
    del inputs  # before the next workload's are built
  report(with_ratios(pd.DataFrame(rows)), args.output)
  return 0


if __name__ == "__main__":
  sys.exit(main())
