"""One rank of a rule-14 group: ``python -m clipbench.conformance.sharding_torch.worker SPEC``.

Started by ``launch`` with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``). For each call (implementation, op, case) every rank builds the case's inputs
from its name, places them as DTensors, makes the call and gathers the outputs (collectives
need every rank); rank 0 makes the same call on the unsharded leaves, compares them with the
shared ``sharding.compare`` and appends the row (a JSON line, the format of
``sharding.jax_runner``'s rows) to the spec's ``results`` path. An error is a row: every rank
learns of it (``all_gather_object``), so the group stays in step; a rank that raises where
the others wait in a collective is caught by ``launch``'s timeout.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from clipbench.conformance import running
from clipbench.conformance.cases import Inputs
from clipbench.conformance.sharding import compare
from clipbench.conformance.sharding_torch import layouts
from clipbench.conformance.sharding_torch.launch import key
from clipbench.impls import frameworks, registry


def _place(x: np.ndarray, placements: list, mesh) -> DTensor:
  # src_data_rank=None: every rank holds the whole value and keeps its chunk, no communication.
  return distribute_tensor(frameworks.to_framework(x, "torch"), mesh, placements,
                           src_data_rank=None)


def _whole(x):
  return frameworks.to_numpy(x.full_tensor() if isinstance(x, DTensor) else x)


def _kwargs(op: str, inputs: Inputs, segments) -> dict:
  kw = inputs.kwargs(op)
  if op == "clip_grad_norm":
    kw.pop("segments", None), kw.pop("num_systems", None)
  elif segments is not None:
    kw["segments"] = segments
  return kw


def _layout_call(case: layouts.TorchCase, op: str, fn, meshes):
  """(sharded result, the unsharded inputs) of a layout of leaves."""
  inputs = case.build(op)
  mesh_of = lambda i: meshes[2 if case.on_2d_mesh else i % 2 if case.on_two_meshes else 0]
  leaves = [_place(x, case.placements(i, x.ndim), mesh_of(i))
            for i, x in enumerate(inputs.leaves)]
  segments = None if inputs.segments is None else [
      _place(s, case.placements(i, inputs.leaves[i].ndim, ids=True), mesh_of(i))
      for i, s in enumerate(inputs.segments)]
  return fn(leaves, inputs.threshold, **_kwargs(op, inputs, segments)), inputs


def _fsdp2_call(case: layouts.TorchCase, op: str, fn, meshes):
  """The same for the gradients of a small model wrapped with ``fully_shard`` (FSDP2)."""
  from torch.distributed.fsdp import fully_shard  # pylint: disable=import-outside-toplevel
  world = dist.get_world_size()
  dtype = getattr(torch, case.variant.dtype)
  torch.manual_seed(14)
  model = torch.nn.Sequential(torch.nn.Linear(3, 2 * world + 1), torch.nn.Tanh(),
                              torch.nn.Linear(2 * world + 1, max(world - 1, 1))).to(dtype)
  for layer in (model[0], model[2]):
    fully_shard(layer, mesh=meshes[0])
  fully_shard(model, mesh=meshes[0])
  x = torch.randn(4, 3, generator=torch.Generator().manual_seed(dist.get_rank())).to(dtype)
  model(x).square().sum().backward()
  params = list(model.parameters())
  whole = [_whole(p.grad) for p in params]
  if case.variant.poisoned:
    # The shared layouts' poison (a NaN row in the first leaf, an inf last), put back in
    # FSDP2's own placement (Shard(0) on its mesh).
    whole[0][1], whole[-1][-1] = np.nan, np.inf
    for p, g in zip(params, whole):
      p.grad = _place(g, [Shard(0)], meshes[0])
  flat = np.concatenate([g.ravel() for g in whole]).astype(np.float64)
  threshold = 0.5 * float(np.linalg.norm(flat[np.isfinite(flat)], ord=case.variant.norm_type))
  inputs = Inputs(whole, threshold, norm_type=case.variant.norm_type,
                  nonfinite=case.variant.nonfinite)
  return fn([p.grad for p in params], threshold, **_kwargs(op, inputs, None)), inputs


def _norm_placement(norms) -> str:
  """How the norm came back: rule 14 takes a plain tensor (the same on every rank) or a
  DTensor whose ``full_tensor()`` is the norm (torch's ``clip_grad_norm_`` returns one,
  ``Partial(max)`` for p = inf), so both count as replicated; the row says which."""
  if isinstance(norms, DTensor):
    return f"DTensor {tuple(norms.placements)}"
  return "plain tensor"


def _error(e: BaseException) -> str:
  first = str(e).splitlines()[0] if str(e) else ""
  return f"{type(e).__name__}: {first[:300]}"


def run_call(call: dict, impls: dict, meshes) -> dict:
  """One call's row on rank 0 (``{}`` on the other ranks)."""
  row = dict(call, how="DTensor, gloo")
  if call["impl"] not in impls:  # an outside implementation comes with its load spec
    impls[call["impl"]] = registry.load(call.get("spec") or call["impl"])
  impl, op, case = impls[call["impl"]], call["op"], layouts.case_named(call["case"])
  fn = impl.function(op)
  error, trace = "", ""
  started = time.perf_counter()
  try:
    result, inputs = (_fsdp2_call if case.fsdp2 else _layout_call)(case, op, fn, meshes)
    sharded = ([_whole(x) for x in result[0]], _whole(result[1]))
    row["norm_replicated"], row["norm_placement"] = True, _norm_placement(result[1])
  except Exception as e:  # pylint: disable=broad-except
    error, trace = f"sharded call raised {_error(e)}", traceback.format_exc(limit=-3)
    # Where the other ranks wait in a collective of the call, the launcher reads this line.
    print(f"raised {key(call)}: {error}", flush=True)
  row["duration_s"] = time.perf_counter() - started
  errors = [""] * dist.get_world_size()
  dist.all_gather_object(errors, error)
  if dist.get_rank() != 0:
    return {}
  if any(errors):
    rank = next(r for r, e in enumerate(errors) if e)
    return dict(row, status="error", error=f"rank {rank}: {errors[rank]}", trace=trace)
  try:
    plain = [frameworks.to_framework(x, "torch") for x in inputs.leaves]
    segments = None if inputs.segments is None else [torch.from_numpy(s)
                                                     for s in inputs.segments]
    out = fn(plain, inputs.threshold, **_kwargs(op, inputs, segments))
    unsharded = ([_whole(x) for x in out[0]], _whole(out[1]))
  except Exception as e:  # pylint: disable=broad-except
    return dict(row, status="error", error=f"unsharded call raised {_error(e)}",
                trace=traceback.format_exc(limit=-3))
  found = compare.compare(op, inputs, unsharded, sharded)
  row["comparison"] = found.as_dict()
  row["status"] = "identical" if found.identical and row["norm_replicated"] else "differs"
  return row


def not_applicable(impl, op: str, case: layouts.TorchCase) -> str | None:
  """Why a case does not apply to ``impl`` (None when it does)."""
  if not case.expressible:
    return layouts.ON_DEVICE_NOTE
  return running.not_applicable(impl, op, case.build(op))


def main(spec_path: str) -> int:
  with open(spec_path, encoding="utf-8") as f:
    spec = json.load(f)
  dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec["timeout_s"]))
  world = dist.get_world_size()
  # Two meshes over the same ranks: alike but not equal (their dimension names differ); a 2-D
  # mesh of FSDP's and tensor parallelism's dimensions.
  meshes = [init_device_mesh("cpu", (world,), mesh_dim_names=("shards",)),
            init_device_mesh("cpu", (world,), mesh_dim_names=("other_shards",))]
  if world % 2 == 0:
    meshes.append(init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp")))
  impls: dict = {}
  with open(spec["results"], "a", encoding="utf-8") as out:
    for call in spec["calls"]:
      print(f"started {key(call)}", flush=True)  # the log names a call that hangs
      row = run_call(call, impls, meshes)
      if row:
        out.write(json.dumps(dict(row, key=key(call))) + "\n")
        out.flush()
  dist.destroy_process_group()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
