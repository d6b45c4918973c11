"""Sharded against unsharded time of JAX implementations on host CPU devices (rule 14's cost).

  python -m clipbench.benchmarks.sharded                      # W1 and W3, 2 and 4 devices
  python -m clipbench.benchmarks.sharded --scale 0.05 --repeats 5 --impl optax.clip_by_global_norm
  python -m clipbench.benchmarks.sharded --placement columns [--width 1024] --workload W1-model
  python -m clipbench.benchmarks.sharded --norm-type 2.5 --impl clipbench.jax

Each workload is drawn once; each implementation is jitted once and timed on the leaves on
one device and on a one-axis mesh of 2 and 4 CPU devices (``XLA_FLAGS`` forces 4 host
devices, set here before JAX starts). Every leaf (and segment array) has its rows split across
the mesh (``PartitionSpec("shards")``): placed so by ``jax.device_put`` where the rows divide
evenly, else placed replicated and split inside the jitted function by
``with_sharding_constraint`` (``device_put`` refuses uneven shards; XLA pads them), and
their outputs constrained alike. With ``--placement columns`` (tensor parallelism) every leaf
is split along its second axis instead, as ``benchmarks/sharded_torch.py`` splits them: W1's
1-D leaves as one row of all their elements (``--width W``: rows of W elements, the
remainder dropped), W3's positions and cells by their 3 columns, and the ids whole on every
device. The
unsharded call is the same jitted function on one device. The ratio is the sharded
median over the unsharded one (above 1: sharding costs time). Host devices share the
machine's cores and memory, so the ratio measures the partitioned program and its
collectives, not a speed-up from more hardware.

Two columns per call and device, read from the compiled program (the per-device program of
XLA's SPMD partitioner, the same on every device), not measured while it runs:

* ``sent``: bytes one device hands to collectives: the sum of the operand sizes of every
  collective instruction of the optimized HLO (``clipbench/hlo_collectives.py``). Exact for a
  program whose collectives each run once; one in a loop body counts once per instruction, not
  per trip, and one in a ``lax.cond`` branch counts although the branch may not run (the own
  graph route's near-tie branch). The FFI route's kernels send nothing themselves: XLA's
  collectives around the custom call are all it exchanges.
  The percentage is of the device's shard (its arguments). Collectives of the
  ``with_sharding_constraint`` that splits uneven leaves are left out (they move those
  leaves to and from their split, for every implementation alike: about 2.2 MiB per device
  on W1 at scale 0.25).
* ``peak``: XLA's buffer assignment per device, ``memory_analysis()``'s temporaries plus
  outputs (the arguments, the device's shard, excluded): what the call allocates beyond its
  inputs, as XLA plans it. Memory that a custom call allocates itself (the numba kernels'
  per-block partials, small) is not in it; the operands XLA gathers for it are.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_DEVICES = 4
_FLAG = f"--xla_force_host_platform_device_count={_DEVICES}"
if "jax" not in sys.modules and _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from clipbench.benchmarks import workloads  # noqa: E402
from clipbench.benchmarks.script_args import (  # noqa: E402
    add_norm_type, add_scale_and_repeats, check_norm_type, check_scale_and_repeats)
from clipbench.impls import calling, registry  # noqa: E402
from clipbench import hlo_collectives as collectives  # noqa: E402

IMPLS = ("clipbench.jax", "clipbench.jax-xla", "optax.clip_by_global_norm")
WORKLOADS = ("W1-model", "W3-relax-large")
DEVICE_COUNTS = (2, 4)


def _mesh(devices: int) -> jax.sharding.Mesh:
  return jax.make_mesh((devices,), ("shards",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:devices])


def _split(devices: int, ndim: int, dim: int | None) -> NamedSharding:
  """Split along axis ``dim`` (None: whole on every device)."""
  if dim is None or ndim <= dim:
    return NamedSharding(_mesh(devices), P())
  return NamedSharding(_mesh(devices), P(*([None] * dim), "shards", *([None] * (ndim - dim - 1))))


def _place(arrays: list, devices: int, dim: int | None) -> tuple[list, tuple[bool, ...]]:
  """The arrays on the mesh split along axis ``dim``, and which of them the jitted function
  must split itself."""
  uneven = tuple(dim is not None and (x.ndim <= dim or x.shape[dim] % devices != 0)
                 for x in arrays)
  placed = [jax.device_put(x, NamedSharding(_mesh(devices), P()) if later else
                           _split(devices, x.ndim, dim)) for x, later in zip(arrays, uneven)]
  return placed, uneven


def _split_inside(arrays, uneven: tuple[bool, ...], devices: int, dim: int | None):
  if arrays is None:
    return None
  return [jax.lax.with_sharding_constraint(x, _split(devices, x.ndim, dim)) if later and x.ndim
          else x for x, later in zip(arrays, uneven)]


def _as_columns(leaves: list, width: int) -> list:
  """1-D leaves as one row (``width``: rows of ``width`` elements, the remainder dropped)."""
  if width:
    return [x[:x.size // width * width].reshape(-1, width) if x.ndim == 1 else x
            for x in leaves]
  return [x.reshape(1, -1) if x.ndim == 1 else x for x in leaves]


def _bytes(n: int) -> str:
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if n >= size:
      return f"{n / size:7.1f} {unit}"
  return f"{n:7d} B  "


def program_costs(jitted, args) -> tuple[int, int, int]:
  """(bytes sent, peak bytes = temporaries + outputs, argument bytes) per device of the
  compiled call (see the module docstring)."""
  compiled = jitted.lower(*args).compile()
  # The uneven leaves' placement (with_sharding_constraint) moves them in the program too; it
  # is the benchmark's doing, not the call's.
  sent = sum(c.operands.nbytes for c in collectives.collectives(compiled.as_text())
             if not c.op_name.endswith("sharding_constraint"))
  memory = compiled.memory_analysis()
  return (sent, int(memory.temp_size_in_bytes + memory.output_size_in_bytes),
          int(memory.argument_size_in_bytes))


def _costs(jitted, args) -> str:
  sent, peak, argument = program_costs(jitted, args)
  return (f"sent {_bytes(sent)} {100 * sent / max(argument, 1):6.2f}%  peak {_bytes(peak)}  "
          f"(shard {_bytes(argument)})")


def _median_seconds(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure(impl: registry.Implementation, workload: workloads.Workload, scale: float,
            repeats: int, placement: str = "rows", width: int = 0,
            norm_type: float | None = None) -> list[str]:
  """Lines of ``impl`` on ``workload``: the unsharded median, then each mesh's and the ratio
  (at ``norm_type``, or the workload's own p)."""
  op = workload.op
  if op not in impl.ops:
    return [f"{impl.name:28} {workload.name:16} not applicable: no {op}"]
  drawn = workload.build(scale, "float32")
  p = drawn.norm_type if norm_type is None else norm_type
  if not impl.capabilities.supports_norm_type(p):
    return [f"{impl.name:28} {workload.name:16} not applicable: no p = {p:g}"]
  kw = {"norm_type": p}
  if op != "clip_grad_norm":
    kw.update(segments=list(drawn.segments) if drawn.segments is not None else None,
              num_systems=drawn.num_systems)
  leaves = list(drawn.leaves)
  if placement == "columns":
    leaves = _as_columns(leaves, width)
  # Leaves along their rows or second axis; the ids with their rows, or whole.
  leaf_dim, id_dim = (1, None) if placement == "columns" else (0, 0)
  prepared = calling.prepare(impl, op, leaves, drawn.threshold, **kw)
  static = {k: v for k, v in prepared.kwargs.items() if k != "segments"}
  fn = impl.function(op)
  threshold = prepared.threshold

  def call(leaves, segments):
    return fn(leaves, threshold, **static, **(
        {"segments": segments} if segments is not None else {}))

  segments = prepared.kwargs.get("segments")
  plain = jax.jit(call)
  base = _median_seconds(plain, (prepared.leaves, segments), repeats)
  lines = [f"{impl.name:28} {workload.name:16} {drawn.num_elements:>10,} elements  "
           f"1 device  {base * 1e3:9.2f} ms              "
           f"{_costs(plain, (prepared.leaves, segments))}"]
  for devices in DEVICE_COUNTS:
    leaves, uneven = _place(prepared.leaves, devices, leaf_dim)
    placed_segments, uneven_ids = (None, ()) if segments is None else _place(
        segments, devices, id_dim)

    def sharded(leaves, segments, uneven=uneven, uneven_ids=uneven_ids, devices=devices):
      outs, *rest = call(_split_inside(leaves, uneven, devices, leaf_dim),
                         _split_inside(segments, uneven_ids, devices, id_dim))
      # Outputs keep their leaves' split, as a caller's sharded step keeps them.
      return (_split_inside(list(outs), uneven, devices, leaf_dim), *rest)

    jitted = jax.jit(sharded)
    seconds = _median_seconds(jitted, (leaves, placed_segments), repeats)
    lines.append(f"{'':28} {'':16} {'':20}{devices} devices {seconds * 1e3:9.2f} ms  "
                 f"ratio {seconds / base:5.2f}  {_costs(jitted, (leaves, placed_segments))}")
  return lines


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m clipbench.benchmarks.sharded",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--impl", action="append", default=None,
                      help=f"implementation (repeatable; default: {', '.join(IMPLS)})")
  parser.add_argument("--workload", action="append", default=None, choices=workloads.NAMES,
                      help=f"workload (repeatable; default: {', '.join(WORKLOADS)})")
  add_scale_and_repeats(parser, scale=0.1, repeats=10,
                        scale_help="fraction of each workload's full size",
                        repeats_help="timed calls per point")
  parser.add_argument("--placement", default="rows", choices=("rows", "columns"),
                      help="split every leaf along its rows (default) or its second axis")
  parser.add_argument("--width", type=int, default=0,
                      help="with --placement columns: 1-D leaves as rows of this many "
                           "elements (default: one row)")
  add_norm_type(parser, None, "default: each workload's own")
  args = parser.parse_args(argv)
  check_scale_and_repeats(parser, args)
  check_norm_type(parser, args)
  if args.width < 0 or (args.width and args.placement != "columns"):
    parser.error(f"--width: expected a positive width with --placement columns, got "
                 f"{args.width} with --placement {args.placement}")
  print(f"{jax.device_count()} host CPU devices on {os.cpu_count()} cores "
        f"(devices share the cores: a ratio is the cost of the partitioned program); sent and "
        f"peak are per device and call, from the compiled program")
  for name in args.impl or IMPLS:
    impl = registry.load(name)
    if not impl.available:
      print(f"{name:28} unavailable: {impl.reason}")
      continue
    for workload in args.workload or WORKLOADS:
      try:
        lines = measure(impl, workloads.get(workload), args.scale, args.repeats,
                        args.placement, args.width, args.norm_type)
      except Exception as e:  # pylint: disable=broad-except
        lines = [f"{name:28} {workload:16} error: {type(e).__name__}: "
                 f"{str(e).splitlines()[0][:200] if str(e) else ''}"]
      print("\n".join(lines), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
