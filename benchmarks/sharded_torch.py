"""Sharded against unsharded clipping time on torch.distributed (DTensor ``Shard(0)``, gloo, CPU).

  python -m clipbench.benchmarks.sharded_torch [--scale 0.25] [--worlds 2 4] [--repeats 5]

For W1 (``clip_grad_norm``, 200 leaves) and W3 (per-system ``clip_by_global_norm``, positions
and cells with their segments), each rank holds ``Shard(0)`` of every leaf (and of the segment
ids); a call's time is the slowest rank's, between barriers; the median and the minimum of
``--repeats`` are printed (the minimum is the least disturbed by other load). The unsharded
time is the same call on whole tensors in this process, with every core. Printed: seconds and
the ratio sharded / unsharded, for our torch implementation and for
``torch.nn.utils.clip_grad_norm_`` (W1 only: it has no per-system form).

Read the ratios with the machine in mind: the ranks share its cores (``os.cpu_count()``,
printed), so 4 ranks on 2 cores measure communication and oversubscription, not the speed-up
of 4 devices. Our implementation gathers the leaves (``impls/own/torch/sharded.py``: one
all-gather of their bytes), so its ratio is about that all-gather plus the unsharded call.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import numpy as np
import torch

from clipbench.benchmarks import workloads
from clipbench.benchmarks.script_args import add_scale_and_repeats, check_scale_and_repeats

WORKLOADS = ("W1-model", "W3-relax-large")


def _tensors(inputs: workloads.WorkloadInputs):
  leaves = [torch.from_numpy(np.ascontiguousarray(x)) for x in inputs.leaves]
  segments = None if inputs.segments is None else [torch.from_numpy(s) for s in inputs.segments]
  return leaves, segments


def _own_call(inputs, leaves, segments):
  from clipbench.impls.own.torch import eager  # pylint: disable=import-outside-toplevel
  if inputs.segments is None:
    return lambda: eager.clip_grad_norm(leaves, inputs.threshold)
  return lambda: eager.clip_by_global_norm(leaves, inputs.threshold, segments=segments,
                                           num_systems=inputs.num_systems)


def _library_call(inputs, grads, foreach: bool):
  params = []
  for g in grads:
    p = torch.nn.Parameter(torch.empty_like(g))
    p.grad = g  # clipped in place on every repeat: the work is the same each time
    params.append(p)
  return lambda: torch.nn.utils.clip_grad_norm_(params, inputs.threshold, foreach=foreach)


def _calls(inputs, leaves, segments) -> dict:
  calls = {"clipbench.torch": _own_call(inputs, leaves, segments)}
  if inputs.segments is None:
    calls["torch.clip_grad_norm_"] = _library_call(inputs, leaves, False)
    calls["torch.clip_grad_norm_.foreach"] = _library_call(inputs, leaves, True)
  return calls


def _times(fn, repeats: int, barrier=None) -> tuple[float, float]:
  """(median, min) seconds of ``repeats`` calls after a first one."""
  fn()  # a first call compiles and warms caches
  times = []
  for _ in range(repeats):
    if barrier:
      barrier()
    start = time.perf_counter()
    fn()
    if barrier:
      barrier()
    times.append(time.perf_counter() - start)
  return statistics.median(times), min(times)


def _rank(rank: int, world: int, port: int, scale: float, repeats: int, out) -> None:
  # pylint: disable=import-outside-toplevel
  import torch.distributed as dist
  from torch.distributed.device_mesh import init_device_mesh
  from torch.distributed.tensor import Shard, distribute_tensor
  os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                    WORLD_SIZE=str(world))
  torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
  dist.init_process_group("gloo")
  mesh = init_device_mesh("cpu", (world,))
  shard = lambda t: distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)
  for name in WORKLOADS:
    inputs = workloads.get(name).build(scale)
    leaves, segments = _tensors(inputs)
    leaves = [shard(x) for x in leaves]
    segments = None if segments is None else [shard(s) for s in segments]
    for impl, fn in _calls(inputs, leaves, segments).items():
      seconds = _times(fn, repeats, dist.barrier)
      if rank == 0:
        out.put((name, impl, seconds))
  dist.destroy_process_group()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_scale_and_repeats(parser, scale=0.25, repeats=7,
                        scale_help="workload scale (1.0: W1 16M elements, W3 20,000 systems)",
                        repeats_help="timed calls per point")
  parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
  args = parser.parse_args(argv)
  check_scale_and_repeats(parser, args)
  if any(w < 1 for w in args.worlds):
    parser.error(f"--worlds: expected positive integers, got {args.worlds}")
  import torch.multiprocessing as mp  # pylint: disable=import-outside-toplevel
  print(f"{os.cpu_count()} CPU cores; torch {torch.__version__}; scale {args.scale:g}; "
        f"{args.repeats} repeats; load average {os.getloadavg()[0]:.1f}")
  unsharded = {}
  for name in WORKLOADS:
    inputs = workloads.get(name).build(args.scale)
    leaves, segments = _tensors(inputs)
    for impl, fn in _calls(inputs, [x.clone() for x in leaves], segments).items():
      unsharded[(name, impl)] = _times(fn, args.repeats)
  print(f"{'workload':16} {'implementation':30} {'ranks':>5} {'unsharded s':>17} "
        f"{'sharded s':>17} {'ratio':>11}   (median / min)")
  for world in args.worlds:
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(world, _free_port(), args.scale, args.repeats, queue), nprocs=world)
    while not queue.empty():
      name, impl, (median, least) = queue.get()
      base_median, base_least = unsharded[(name, impl)]
      print(f"{name:16} {impl:30} {world:5d} {base_median:8.4f}/{base_least:8.4f} "
            f"{median:8.4f}/{least:8.4f} {median / base_median:5.1f}/{least / base_least:5.1f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
