"""Rule 14 on JAX: each implementation on leaves sharded over host CPU devices, against the
same call on unsharded leaves, bit for bit.

  python -m clipbench.conformance.sharding.jax_runner --impl optax.clip_by_global_norm
  python -m clipbench.conformance.sharding.jax_runner --request calls.json --out results.json

JAX fixes its device count when it starts, so this runs in a process of its own with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (``host_devices``; set here before JAX
is imported, so the module also runs by hand). The mesh axes are ``Auto`` (XLA's partitioner
chooses how to split each operation, as under ``pjit``), not jax 0.12's ``Explicit`` default
of ``jax.make_mesh``. Leaves go on a one-axis mesh of 2 or 4 CPU devices with
``jax.device_put`` and ``NamedSharding``: ``PartitionSpec("shards")`` splits rows,
``PartitionSpec(None, "shards")`` columns (their ids replicated), ``PartitionSpec()``
replicates. Each implementation is called as its users call it: under an
outer ``jax.jit`` where it declares ``jit``, else eagerly. The unsharded call is the same
function on arrays on one device, in the same process, called after the sharded one.

Where JAX cannot express a layout, the row says so (``not-applicable`` with the reason):
``device_put`` refuses rows (or columns) that do not divide evenly, so uneven and empty shards
are made inside the jitted function with ``with_sharding_constraint`` (XLA pads the last
shards), which
an implementation called eagerly cannot receive; and JAX refuses arrays committed to
different devices in one computation before any implementation code runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from typing import Any

from clipbench.conformance.sharding import host_devices

if "jax" not in sys.modules:
  os.environ.update(host_devices.environment())

import jax  # noqa: E402  (after XLA_FLAGS)
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from clipbench.conformance import running  # noqa: E402
from clipbench.conformance.sharding import compare, layouts  # noqa: E402
from clipbench.impls import calling, registry  # noqa: E402

AXIS = "shards"
# Statuses of one (implementation, op, case): the bits agree, they differ, a call raised, or
# the layout cannot be given to this implementation on JAX (the note says why).
STATUSES = ("identical", "differs", "error", "not-applicable")

DIFFERENT_DEVICES = ("JAX refuses arrays committed to different devices in one computation "
                     "(ValueError: incompatible devices) before any implementation code runs")
UNEVEN_EAGER = ("uneven shards exist only inside jax.jit (device_put needs rows or columns that divide "
                "evenly), and this implementation is called eagerly (it does not declare jit)")


@functools.cache
def mesh(devices: int) -> jax.sharding.Mesh:
  if jax.device_count() < devices:
    raise RuntimeError(f"devices: {devices} needed, JAX has {jax.device_count()}; start the "
                       f"process with XLA_FLAGS={host_devices.FLAG} set before JAX is imported")
  return jax.make_mesh((devices,), (AXIS,), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:devices])


def _split_spec(axis: int | None, ndim: int) -> P:
  """The leaf (or ids) of ``ndim`` axes split along ``axis`` (None, or an axis it lacks:
  replicated)."""
  if axis is None or axis >= ndim:
    return P()
  return P(*([None] * axis), AXIS, *([None] * (ndim - axis - 1)))


def place(layout: layouts.Layout, leaves: list[Any], segments: list[Any] | None
          ) -> tuple[list[Any], list[Any] | None, tuple[Any, ...]]:
  """The leaves (and segments) placed as ``layout`` says, and per leaf whether a jitted caller
  must split it inside the function (``device_put`` refuses an uneven split)."""
  m = mesh(layout.devices)

  def target(i: int, ndim: int, ids: bool) -> Any:
    kind = layout.placements[i]
    if kind == layouts.ON_DEVICE:
      return jax.devices()[layout.device_of(i)]
    axis = layout.split_axis(i)
    if axis is None or not layout.evenly_split(i) or (ids and axis > 0):
      return NamedSharding(m, P())
    return NamedSharding(m, _split_spec(axis, ndim))

  placed = [jax.device_put(x, target(i, x.ndim, False)) for i, x in enumerate(leaves)]
  placed_segments = None if segments is None else [
      jax.device_put(g, target(i, g.ndim, True)) for i, g in enumerate(segments)]
  inside = tuple(layout.split_axis(i) if layout.split_axis(i) is not None
                 and not layout.evenly_split(i) else None for i in range(len(leaves)))
  return placed, placed_segments, inside


def _caller(fn, threshold: Any, kwargs: dict[str, Any], split_inside: tuple[Any, ...] | None,
            devices: int, jitted: bool):
  """``fn(leaves, threshold, **kwargs)`` as a user calls it; under jit, the leaves marked in
  ``split_inside`` (by the axis to split, else None) are split across the mesh first, and
  their segments too where the leaf's rows are."""

  def split(x, axis):
    spec = NamedSharding(mesh(devices), _split_spec(axis, x.ndim))
    return jax.lax.with_sharding_constraint(x, spec)

  def call(leaves, segments):
    if split_inside is not None:
      leaves = [x if a is None else split(x, a) for x, a in zip(leaves, split_inside)]
      if segments is not None:
        segments = [split(g, 0) if a == 0 else g for g, a in zip(segments, split_inside)]
    kw = dict(kwargs)
    if segments is not None:
      kw["segments"] = list(segments)
    return fn(list(leaves), threshold, **kw)

  return jax.jit(call) if jitted else call


def _norm_replicated(norms: Any) -> bool:
  sharding = getattr(norms, "sharding", None)
  return norms is None or sharding is None or bool(sharding.is_fully_replicated)


def run_case(impl: registry.Implementation, op: str, case: layouts.ShardingCase) -> dict:
  """One (implementation, op, case): the unsharded and the sharded call, compared."""
  row: dict[str, Any] = {"impl": impl.name, "op": op, "case": case.name}
  inputs = case.build(op)
  reason = running.not_applicable(impl, op, inputs)
  if reason is not None:
    return dict(row, status="not-applicable", note=reason)
  jitted = "jit" in impl.capabilities.transforms
  row["how"] = "jax.jit" if jitted else "eager"
  layout = case.layout
  if not jitted and any(layout.split_axis(i) is not None and not layout.evenly_split(i)
                        for i in range(len(layout.placements))):
    return dict(row, status="not-applicable", note=UNEVEN_EAGER)
  kw = inputs.kwargs(op)
  if op == "clip_grad_norm":
    kw.pop("segments", None), kw.pop("num_systems", None)
  prepared = calling.prepare(impl, op, inputs.leaves, inputs.threshold, **kw)
  static = {k: v for k, v in prepared.kwargs.items() if k != "segments"}
  segments = prepared.kwargs.get("segments")
  fn = impl.function(op)
  plain = _caller(fn, prepared.threshold, static, None, layout.devices, jitted)
  started = time.perf_counter()
  # The sharded call first: a layout JAX refuses needs no unsharded call. Where device_put
  # placed everything it is the same jitted function (jit retraces per input sharding).
  try:
    leaves, placed_segments, inside = place(layout, prepared.leaves, segments)
    caller = plain if all(a is None for a in inside) else _caller(
        fn, prepared.threshold, static, inside, layout.devices, jitted)
    result = jax.block_until_ready(caller(leaves, placed_segments))
  except ValueError as e:
    if "incompatible devices" in str(e):
      return dict(row, status="not-applicable", note=DIFFERENT_DEVICES)
    return dict(row, status="error", error=f"sharded call raised {_error(e)}",
                trace=traceback.format_exc(limit=-3))
  except Exception as e:  # pylint: disable=broad-except
    return dict(row, status="error", error=f"sharded call raised {_error(e)}",
                trace=traceback.format_exc(limit=-3))
  try:
    unsharded = calling.result_to_numpy(jax.block_until_ready(plain(prepared.leaves, segments)))
  except Exception as e:  # pylint: disable=broad-except
    return dict(row, status="error", error=f"unsharded call raised {_error(e)}",
                trace=traceback.format_exc(limit=-3))
  row["duration_s"] = time.perf_counter() - started
  row["norm_replicated"] = _norm_replicated(result[1])
  found = compare.compare(op, inputs, unsharded, calling.result_to_numpy(result))
  row["comparison"] = found.as_dict()
  row["status"] = "identical" if found.identical and row["norm_replicated"] else "differs"
  return row


def _error(e: BaseException) -> str:
  first = str(e).splitlines()[0] if str(e) else ""
  return f"{type(e).__name__}: {first[:300]}"


def calls_for(impl: registry.Implementation, profile: str) -> list[dict]:
  """Every (op, case) of ``profile`` that applies to ``impl``'s operations."""
  return [{"impl": impl.name, "op": op, "case": case.name}
          for op in impl.ops for case in layouts.cases(profile, op)]


def run_calls(calls: list[dict], specs: dict[str, str] | None = None) -> list[dict]:
  """Runs each ``{"impl", "op", "case"}``; ``specs`` maps an implementation's name to what
  ``registry.load`` takes (an outside target), else the name itself is loaded."""
  loaded: dict[str, registry.Implementation] = {}
  rows = []
  for call in calls:
    name = call["impl"]
    if name not in loaded:
      loaded[name] = registry.load((specs or {}).get(name, name))
    impl = loaded[name]
    if not impl.available:
      rows.append(dict(call, status="error", error=f"unavailable: {impl.reason}"))
      continue
    rows.append(run_case(impl, call["op"], layouts.case_named(call["case"])))
  return rows


def _table(rows: list[dict]) -> str:
  lines = []
  for row in rows:
    found = row.get("comparison") or {}
    what = row.get("note") or row.get("error") or (
        "identical bits" if row["status"] == "identical" else
        f"{found.get('max_ulp')} ulp, norm {found.get('norm_ulp')} ulp, decision changed: "
        f"{found.get('decision_changed')}, bound broken: {found.get('bound_broken')}; "
        f"{found.get('detail', '')}")
    lines.append(f"{row['impl']:36} {row['op']:20} {row['case']:42} {row['status']:14} {what}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m clipbench.conformance.sharding.jax_runner",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--impl", action="append", default=[],
                      help="implementation (registered name or package.module:attr); repeatable")
  parser.add_argument("--profile", choices=layouts.PROFILES, default="ci")
  parser.add_argument("--request", help="JSON file: {'calls': [{impl, op, case}], "
                                        "'specs': {name: target}}")
  parser.add_argument("--out", help="write the rows as JSON here (default: a table on stdout)")
  args = parser.parse_args(argv)
  if args.request:
    with open(args.request, encoding="utf-8") as f:
      request = json.load(f)
    rows = run_calls(request["calls"], request.get("specs"))
  elif args.impl:
    impls = {spec: registry.load(spec) for spec in args.impl}
    calls = [c for impl in impls.values() for c in calls_for(impl, args.profile)]
    rows = run_calls(calls, {impl.name: spec for spec, impl in impls.items()})
  else:
    parser.error("give --impl or --request")
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(rows, f, default=float)
  else:
    print(_table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
