"""One rank of ``test_torch_sharded.py``'s gloo group (``RANK``, ``WORLD_SIZE``, ``MASTER_*``).

  python -m clipbench.impls.tests.torch_sharded_ranks

What rule 14's grid does not show about our torch implementation on CPU DTensors: that it
exchanges partials instead of gathering (no call takes the gathering way, and what a rank sends
is bounded by its block results plus its pieces of straddling blocks), that outputs keep their
placements without communication, and that an argument only one rank finds bad (an id out of
range in its rows) makes every rank raise the unsharded call's error instead of leaving the
others waiting in a collective. Prints one line per failed check; exits 1 when any failed.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from clipbench.impls.own.numba.layout import BLOCK
from clipbench.impls.own.torch import eager, sharded

# A leaf of many blocks per rank: its straddling pieces (at most one block per boundary) are a
# small part of the shard, so the bound below fails if the leaf itself travels.
_BIG = 256 * BLOCK


def _same(got, want) -> bool:
  return got.dtype == want.dtype and torch.equal(got.reshape(-1).view(torch.uint8),
                                                 want.reshape(-1).view(torch.uint8))


def _check_call(name: str, fn, sharded_args, plain_args, kwargs, shard_bytes: int,
                found: list[str], plain_kwargs=None) -> None:
  before = sharded.TRAFFIC.snapshot()
  out, norms = fn(*sharded_args, **kwargs)
  after = sharded.TRAFFIC.snapshot()
  want_out, want_norms = fn(*plain_args, **(kwargs if plain_kwargs is None else plain_kwargs))
  if after.gathered_calls != before.gathered_calls:
    found.append(f"{name}: the call gathered its leaves")
  sent = after.bytes_sent - before.bytes_sent
  # Block results (<= 25 bytes per block), one straddling block per leaf, per-system counts.
  bound = 0.01 * shard_bytes + len(out) * BLOCK * 8 + 4096
  if sent > bound:
    found.append(f"{name}: sent {sent} bytes, more than {bound:.0f}")
  if not _same(norms, want_norms):
    found.append(f"{name}: norms {norms} differ from the unsharded {want_norms}")
  for i, (o, w) in enumerate(zip(out, want_out)):
    if tuple(o.placements) != tuple(sharded_args[0][i].placements):
      found.append(f"{name}: leaves[{i}] came back {o.placements}")
    if not _same(o.full_tensor(), w):
      found.append(f"{name}: leaves[{i}] differs from the unsharded output")


def failures() -> list[str]:
  world, rank = dist.get_world_size(), dist.get_rank()
  mesh = init_device_mesh("cpu", (world,))
  gen = torch.Generator().manual_seed(32)
  whole = [torch.randn(_BIG + 11, generator=gen), torch.randn(4001, 3, generator=gen),
           torch.randn(5, generator=gen).to(torch.bfloat16)]
  place = [Shard(0), Shard(0), Replicate()]
  leaves = [distribute_tensor(x, mesh, [p], src_data_rank=None) for x, p in zip(whole, place)]
  shard_bytes = sum(x.to_local().numel() * x.element_size() for x in leaves)
  found: list[str] = []
  for p in (2.0, 1.0, float("inf")):
    _check_call(f"clip_grad_norm p={p}", eager.clip_grad_norm, (leaves, 3.0), (whole, 3.0),
                dict(norm_type=p), shard_bytes, found)
  K = 64
  ids = [torch.sort(torch.randint(0, K, (x.shape[0],), generator=gen)).values for x in whole]
  placed_ids = [distribute_tensor(s, mesh, [p], src_data_rank=None) for s, p in zip(ids, place)]
  threshold = torch.rand(K, generator=gen, dtype=torch.float64) * 40
  for op in ("clip_by_global_norm", "clip_by_max_step"):
    _check_call(op, getattr(eager, op), (leaves, threshold), (whole, threshold),
                dict(segments=placed_ids, num_systems=K), shard_bytes, found,
                dict(segments=ids, num_systems=K))
  # An id out of range in the last rank's rows only: every rank raises the unsharded error.
  bad = ids[1].clone()
  bad[-1] = K
  bad_ids = [placed_ids[0], distribute_tensor(bad, mesh, [Shard(0)], src_data_rank=None),
             placed_ids[2]]
  try:
    eager.clip_by_global_norm(leaves, threshold, segments=bad_ids, num_systems=K)
    found.append(f"rank {rank}: an id out of range was accepted")
  except ValueError as e:
    if "segments[1]" not in str(e):
      found.append(f"rank {rank}: the error does not name segments[1]: {e}")
  return found


def main() -> int:
  dist.init_process_group("gloo")
  found = failures()
  dist.destroy_process_group()
  for line in found:
    print(line)
  return 1 if found else 0


if __name__ == "__main__":
  sys.exit(main())
