"""Global clipping inside a larger jitted step: what a custom call costs beside XLA's fusions.

  python -m clipbench.benchmarks.in_step                    # W1, full size
  python -m clipbench.benchmarks.in_step --scale 0.1 --repeats 10

``clipbench bench`` times each JAX implementation as the only thing under ``jax.jit``. A
training step clips gradients that other operations of the same jitted function have just
produced. XLA fuses those operations into a library's clipping, but it must materialize the
operands of a custom call (``clipbench.jax`` on the CPU): a temporary the size of every
leaf, allocated per call. This times ``step(leaves) = clip([x * a + b for x in leaves])``
under ``jax.jit`` for each implementation, and the step without the clipping, and counts
the process's minor page faults per call (a temporary that comes from fresh pages each call
shows there). Medians of ``--repeats`` calls each.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

import jax

from clipbench.benchmarks import timing, workloads
from clipbench.benchmarks.script_args import add_scale_and_repeats, check_scale_and_repeats
from clipbench.impls import registry

IMPLS = ("clipbench.jax", "kups.ClipByGlobalNorm", "optax.clip_by_global_norm")
WORKLOAD = "W1-model"


def _prelude(leaves):
  return [x * 1.0001 + 0.5 for x in leaves]


def _median_ms_and_faults(step, leaves, repeats: int) -> tuple[float, float]:
  for _ in range(3):  # compile and warm up
    jax.block_until_ready(step(leaves))
  times = []
  faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(step(leaves))
    times.append(time.perf_counter() - start)
  faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
  return statistics.median(times) * 1e3, faults / repeats


def measure(names: list[str], scale: float, repeats: int) -> list[str]:
  """One line per implementation (and one for the step without clipping)."""
  workload = workloads.get(WORKLOAD)
  drawn = workload.build(scale, "float32")
  lines = []
  leaves = None
  for name in names:
    impl = registry.load(name)
    if not impl.available:
      lines.append(f"{name:28} unavailable: {impl.reason}")
      continue
    # As clipbench bench calls it: a per-system library runs W1 as one system.
    prepared = timing.prepare(impl, workload, drawn, "cpu")
    fn, threshold, kwargs = impl.function(prepared.op), prepared.threshold, prepared.kwargs
    leaves = prepared.leaves
    step = jax.jit(lambda xs, fn=fn, threshold=threshold, kwargs=kwargs:
                   fn(_prelude(xs), threshold, **kwargs))
    ms, faults = _median_ms_and_faults(step, leaves, repeats)
    lines.append(f"{name:28} {ms:9.2f} ms  {faults:10,.0f} page faults a call")
  if leaves is not None:
    ms, faults = _median_ms_and_faults(jax.jit(_prelude), leaves, repeats)
    lines.append(f"{'(the step without clipping)':28} {ms:9.2f} ms  {faults:10,.0f} page faults a call")
  return lines


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m clipbench.benchmarks.in_step",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--impl", action="append", default=None,
                      help=f"implementation (repeatable; default: {', '.join(IMPLS)})")
  add_scale_and_repeats(parser, scale=1.0, repeats=30, scale_help="fraction of W1's full size",
                        repeats_help="timed calls per implementation")
  args = parser.parse_args(argv)
  check_scale_and_repeats(parser, args)
  print(f"{WORKLOAD} at scale {args.scale}, float32, inside jax.jit after x * a + b per leaf")
  print("\n".join(measure(args.impl or list(IMPLS), args.scale, args.repeats)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
