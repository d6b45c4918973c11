"""Sharded clipping on torch.distributed (DTensor ``Shard(0)``, gloo, CPU): time, bytes, memory.

  python -m clipbench.benchmarks.sharded_torch [--scale 0.25] [--worlds 2 4] [--repeats 5]
                                               [--dtype float64] [--workload W3-relax-large]
                                               [--impl clipbench.torch.cuda-route]
                                               [--placement columns [--width 1024]]
                                               [--norm-type 2.5]

For W1 (``clip_grad_norm``, 200 leaves) and W3 (per-system ``clip_by_global_norm``, positions
and cells with their segments), each rank holds ``Shard(0)`` of every leaf (and of the segment
ids). With ``--placement columns`` (tensor parallelism) each rank holds ``Shard(1)`` instead:
W1's 1-D leaves as one row of all their elements, W3's positions and cells by their second
axis (3 columns), and the ids whole on every rank; ``--width W`` makes W1's leaves weight
matrices of rows of W elements instead, split by their columns. ``--norm-type`` sets the
p-norm of every call (2 by default; a float64 non-integer p takes the exact path for every
system, mpmath enclosures of every element, so keep ``--scale`` small).

Implementations: ours (``clipbench.torch``: block results exchanged,
``impls/own/torch/sharded.py``), ours on its CUDA route (``clipbench.torch.cuda-route``: CPU
tensors sent down the branches a GPU takes, ``branches.accelerator_branches``, so per-system
measures are exchanged as a GPU rank's would be, over gloo instead of NCCL), ours the former
way (``clipbench.torch.gathering``: every leaf gathered, the unsharded call on every rank), and
``torch.nn.utils.clip_grad_norm_`` on the same DTensor gradients (W1 only: it has no
per-system form).

Per implementation and number of ranks, printed:

* seconds: a call's time is the slowest rank's, between barriers; the median and the minimum
  of ``--repeats`` (the minimum is the least disturbed by other load), and the ratio to
  ``torch.clip_grad_norm_`` on the same DTensors in the same run (``vs torch``) or, for W3,
  to the unsharded call of ours on whole tensors in this process (``vs unsharded``);
* bytes sent per call, the largest over ranks: what the process wrote to its sockets (the
  ``wchar`` of ``/proc/self/io``, which is every byte a gloo collective sends: a ring
  all-gather sends each byte of a payload to ``ranks - 1`` peers), and as a percentage of the
  rank's shard of the leaves;
* peak extra memory per call, the largest over ranks: the rise of the bytes the C allocator has
  handed out (glibc's ``mallinfo2``, which torch's CPU tensors and NumPy's arrays come from)
  above their level before the call, sampled every 0.2 ms by a thread (a buffer our kernels
  recycle from an earlier call's freed outputs is not counted again).

Read the times with the machine in mind: the ranks share its cores (``os.cpu_count()``,
printed), so 4 ranks on 2 cores measure communication and oversubscription, not the speed-up
of 4 devices.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import statistics
import sys
import threading
import time

import numpy as np
import torch

from clipbench.benchmarks import workloads
from clipbench.benchmarks.script_args import (add_norm_type, add_scale_and_repeats,
                                               check_norm_type, check_scale_and_repeats)

WORKLOADS = ("W1-model", "W3-relax-large")
IMPLS = ("clipbench.torch", "clipbench.torch.cuda-route", "clipbench.torch.gathering",
         "torch.clip_grad_norm_", "torch.clip_grad_norm_.foreach")


def _tensors(inputs: workloads.WorkloadInputs):
  leaves = [torch.from_numpy(np.ascontiguousarray(x)) for x in inputs.leaves]
  segments = None if inputs.segments is None else [torch.from_numpy(s) for s in inputs.segments]
  return leaves, segments


def _own_call(inputs, leaves, segments, norm_type: float, cuda_route: bool = False):
  from clipbench.impls.own.torch import branches, eager  # pylint: disable=import-outside-toplevel
  if inputs.segments is None:
    call = lambda: eager.clip_grad_norm(leaves, inputs.threshold, norm_type=norm_type)
  else:
    call = lambda: eager.clip_by_global_norm(leaves, inputs.threshold, segments=segments,
                                             num_systems=inputs.num_systems,
                                             norm_type=norm_type)
  if not cuda_route:
    return call

  def on_cuda_route():
    with branches.accelerator_branches():
      return call()
  return on_cuda_route


def _library_call(inputs, grads, norm_type: float, foreach: bool):
  params = []
  for g in grads:
    p = torch.nn.Parameter(torch.empty_like(g))
    p.grad = g  # clipped in place on every repeat: the work is the same each time
    params.append(p)
  return lambda: torch.nn.utils.clip_grad_norm_(params, inputs.threshold, norm_type=norm_type,
                                                foreach=foreach)


def _gathering_call(inputs, leaves, segments, norm_type: float):
  """Ours the former way: every DTensor made whole, the unsharded call on every rank."""
  # pylint: disable=import-outside-toplevel,protected-access
  from clipbench.impls.own.torch import api, eager, sharded
  if inputs.segments is None:
    call = api._Call("clip_grad_norm", inputs.threshold, "max_norm", None, None, norm_type,
                     "propagate")
  else:
    call = api._Call("clip_by_global_norm", inputs.threshold, "max_norm", segments,
                     inputs.num_systems, norm_type, "propagate")
  return lambda: sharded._clip_gathering(eager, leaves, call)


def _calls(inputs, leaves, segments, norm_type: float, distributed: bool = False) -> dict:
  calls = {"clipbench.torch": _own_call(inputs, leaves, segments, norm_type),
           "clipbench.torch.cuda-route": _own_call(inputs, leaves, segments, norm_type,
                                                   cuda_route=True)}
  if distributed:
    calls["clipbench.torch.gathering"] = _gathering_call(inputs, leaves, segments, norm_type)
  if inputs.segments is None:
    calls["torch.clip_grad_norm_"] = _library_call(inputs, leaves, norm_type, False)
    calls["torch.clip_grad_norm_.foreach"] = _library_call(inputs, leaves, norm_type, True)
  return calls


def _written() -> int:
  """Bytes this process has written (sockets included): ``wchar`` of ``/proc/self/io``."""
  try:
    with open("/proc/self/io", encoding="ascii") as f:
      return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
  except (OSError, StopIteration):
    return -1


class _MallInfo2(ctypes.Structure):
  _fields_ = [(name, ctypes.c_size_t) for name in (
      "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
      "fordblks", "keepcost")]


def _allocated_bytes() -> int:
  """Bytes the C allocator has handed out and not taken back (glibc's ``mallinfo2``: heap
  chunks in use plus mmapped blocks), where torch's CPU tensors, NumPy's arrays and the
  kernels' buffers all come from; the resident set where there is no glibc."""
  if _MALLINFO2 is not None:
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd
  with open("/proc/self/statm", encoding="ascii") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _find_mallinfo2():
  try:
    fn = ctypes.CDLL(None).mallinfo2
  except (OSError, AttributeError):
    return None
  fn.restype = _MallInfo2
  return fn


_MALLINFO2 = _find_mallinfo2()


class _PeakResident:
  """The largest rise of allocated bytes above their level at entry, sampled by a thread."""

  def __init__(self):
    self.rise = 0
    self._stop = threading.Event()

  def __enter__(self):
    self._base = _allocated_bytes()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    return self

  def _sample(self):
    while not self._stop.wait(0.0002):
      self.rise = max(self.rise, _allocated_bytes() - self._base)

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.rise = max(self.rise, _allocated_bytes() - self._base)


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


def _bytes_and_memory(fn, repeats: int, barrier) -> tuple[float, int]:
  """(bytes written per call, peak resident rise per call) of ``repeats`` calls, each call
  between barriers (whose own bytes are measured alone and taken off)."""
  barrier()
  start = _written()
  for _ in range(repeats):
    barrier()
  barriers_only = _written() - start
  peak = 0
  start = _written()
  for _ in range(repeats):
    barrier()
    with _PeakResident() as resident:
      fn()
    peak = max(peak, resident.rise)
  return (_written() - start - barriers_only) / repeats, peak


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
  # pylint: disable=import-outside-toplevel
  import torch.distributed as dist
  from torch.distributed.device_mesh import init_device_mesh
  from torch.distributed.tensor import Replicate, Shard, distribute_tensor
  os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                    WORLD_SIZE=str(world))
  torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
  dist.init_process_group("gloo")
  mesh = init_device_mesh("cpu", (world,))
  place = lambda t, p: distribute_tensor(t, mesh, [p], src_data_rank=None)
  scale, repeats = args.scale, args.repeats
  for name in args.workload:
    inputs = workloads.get(name).build(scale, args.dtype)
    leaves, segments = _tensors(inputs)
    if args.placement == "columns":
      if args.width:  # weight matrices: rows of ``width`` elements, the remainder dropped
        leaves = [x[:x.numel() // args.width * args.width].reshape(-1, args.width)
                  if x.dim() == 1 else x for x in leaves]
      leaves = [place(x.reshape(1, -1) if x.dim() == 1 else x, Shard(1)) for x in leaves]
      segments = None if segments is None else [place(s, Replicate()) for s in segments]
    else:
      leaves = [place(x, Shard(0)) for x in leaves]
      segments = None if segments is None else [place(s, Shard(0)) for s in segments]
    shard_bytes = sum(x.to_local().numel() * x.element_size() for x in leaves)
    for impl, fn in _calls(inputs, leaves, segments, args.norm_type,
                           distributed=True).items():
      if args.impl and impl not in args.impl and impl != "torch.clip_grad_norm_":
        continue  # torch's call stays: the ratios are to it
      seconds = _times(fn, repeats, dist.barrier)
      sent, peak = _bytes_and_memory(fn, repeats, dist.barrier)
      every = [None] * world
      dist.all_gather_object(every, (sent, peak, shard_bytes))
      if rank == 0:
        out.put((name, impl, seconds, every))
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
  parser.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                      help="the leaves' dtype (float64: the wide passes' exchanges)")
  parser.add_argument("--workload", action="append", choices=WORKLOADS,
                      help="a workload to run (repeatable; default: every one)")
  parser.add_argument("--impl", action="append", choices=IMPLS,
                      help="an implementation to run (repeatable; default: every one)")
  parser.add_argument("--placement", default="rows", choices=("rows", "columns"),
                      help="how the leaves are split: by rows (Shard(0), FSDP's way) or by "
                           "columns (Shard(1), tensor parallelism's)")
  parser.add_argument("--width", type=int, default=0,
                      help="with --placement columns: W1's 1-D leaves as rows of this many "
                           "elements (each leaf's last elements short of a row dropped), "
                           "weight matrices split by their columns; default: one row a leaf")
  add_norm_type(parser, 2.0, "default 2")
  args = parser.parse_args(argv)
  check_scale_and_repeats(parser, args)
  check_norm_type(parser, args)
  args.workload = args.workload or list(WORKLOADS)
  if any(w < 1 for w in args.worlds):
    parser.error(f"--worlds: expected positive integers, got {args.worlds}")
  if args.width < 0 or (args.width and args.placement != "columns"):
    parser.error(f"--width: expected a positive width with --placement columns, got "
                 f"{args.width} with --placement {args.placement}")
  import torch.multiprocessing as mp  # pylint: disable=import-outside-toplevel
  print(f"{os.cpu_count()} CPU cores; torch {torch.__version__}; scale {args.scale:g}; "
        f"{args.repeats} repeats; {args.dtype}; p = {args.norm_type:g}; "
        f"leaves split by {args.placement}; "
        f"load average {os.getloadavg()[0]:.1f}")
  unsharded = {}
  for name in args.workload:
    inputs = workloads.get(name).build(args.scale, args.dtype)
    leaves, segments = _tensors(inputs)
    for impl in ("clipbench.torch", "clipbench.torch.cuda-route"):
      unsharded[name, impl] = _times(_own_call(inputs, [x.clone() for x in leaves], segments,
                                               args.norm_type,
                                               cuda_route=impl.endswith("cuda-route")),
                                     args.repeats)
  print(f"{'workload':16} {'implementation':30} {'ranks':>5} {'seconds':>17} {'ratio':>17} "
        f"{'sent/call':>10} {'% shard':>8} {'peak MB':>8}")
  for world in args.worlds:
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(world, _free_port(), args, queue), nprocs=world)
    rows = []
    while not queue.empty():
      rows.append(queue.get())
    peer = {name: seconds for name, impl, seconds, _ in rows if impl == "torch.clip_grad_norm_"}
    for name, impl, (median, least), every in rows:
      route = "clipbench.torch.cuda-route" if impl.endswith("cuda-route") else "clipbench.torch"
      base, against = (peer[name], "vs torch") if name in peer else (unsharded[name, route],
                                                                      "vs unsharded")
      sent = max(e[0] for e in every)
      # Over the ranks that hold part of the leaves (3 columns over 4 ranks leave one none).
      share = max((e[0] / e[2] for e in every if e[2]), default=0.0)
      peak = max(e[1] for e in every)
      print(f"{name:16} {impl:30} {world:5d} {median:8.4f}/{least:8.4f} "
            f"{median / base[0]:5.2f}/{least / base[1]:5.2f} {against:12} {sent:10.0f} "
            f"{100 * share:7.2f}% {peak / 2**20:8.1f}")
  print("unsharded, this process, every core: " + ", ".join(
      f"{impl} {n} {m:.4f}/{s:.4f} s" for (n, impl), (m, s) in unsharded.items()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
