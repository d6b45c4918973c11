"""Our torch implementation's DTensor contract, checked in a gloo group of two ranks.

  python -m clipbench.conformance.sharding_torch.own_contract   (RANK, WORLD_SIZE, MASTER_*)

What rule 14's layouts do not show: outputs come back as DTensors with the input's mesh and
placements and the norm as a plain tensor; a plain tensor among DTensor leaves is a TypeError
naming it; a bad argument with DTensor leaves gets the unsharded call's error, on every rank,
also when only one rank's rows hold it (an id out of range), instead of leaving the others
waiting in a collective. And the way there on CPU DTensors: ranks exchange block results, not
leaves (no call takes the gathering way, and what a rank sends, counted exactly by
``sharded.TRAFFIC``, is bounded by block results and one sub-block per leaf and boundary).
Prints one line per failed check and exits 1 when any failed.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from clipbench.impls.own.numba.layout import BLOCK, SUB_BLOCK
from clipbench.impls.own.torch import eager, sharded

# A leaf of many blocks per rank: the bound below fails if the leaf itself travels.
_BIG = 256 * BLOCK


def _raises(fn, kind: type, words: str) -> str:
  try:
    fn()
  except kind as e:
    return "" if words in str(e) else f"{kind.__name__} without {words!r}: {e}"
  except Exception as e:  # pylint: disable=broad-except
    return f"expected {kind.__name__} naming {words!r}, got {type(e).__name__}: {e}"
  return f"expected {kind.__name__} naming {words!r}, got a result"


def failures() -> list[str]:
  mesh = init_device_mesh("cpu", (dist.get_world_size(),))
  x, y = torch.arange(12.0).reshape(4, 3), torch.ones(2, 3, dtype=torch.float64)
  leaves = [distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(y, mesh, [Replicate()])]
  found = []
  out, norm = eager.clip_grad_norm(leaves, 1.0)
  if [type(o) for o in out] != [DTensor, DTensor] or [o.placements for o in out] != [
      (Shard(0),), (Replicate(),)]:
    found.append(f"outputs: expected DTensors placed like the inputs, got {out!r}")
  if isinstance(norm, DTensor) or not isinstance(norm, torch.Tensor):
    found.append(f"norm: expected a plain tensor, got {type(norm).__name__}")
  found.append(_raises(lambda: eager.clip_grad_norm([leaves[0], y], 1.0), TypeError,
                       "leaves[1]"))
  found.append(_raises(lambda: eager.clip_grad_norm(leaves, -1.0), ValueError, "max_norm"))
  segments = [distribute_tensor(torch.tensor([0, 0, 1, 5]), mesh, [Shard(0)]),
              torch.tensor([0, 1])]
  found.append(_raises(lambda: eager.clip_by_global_norm(leaves, 1.0, segments=segments,
                                                         num_systems=2), ValueError,
                       "segments[0]"))
  found += _partials_failures(mesh)
  found += _unchunked_failures(mesh)
  return [f for f in found if f]


def _same(got, want) -> bool:
  return got.dtype == want.dtype and torch.equal(got.reshape(-1).view(torch.uint8),
                                                 want.reshape(-1).view(torch.uint8))


def _check_call(name: str, fn, sharded_args, plain_args, kwargs, plain_kwargs,
                found: list[str]) -> None:
  before = sharded.TRAFFIC.snapshot()
  out, norms = fn(*sharded_args, **kwargs)
  after = sharded.TRAFFIC.snapshot()
  want_out, want_norms = fn(*plain_args, **plain_kwargs)
  if after.gathered_calls != before.gathered_calls:
    found.append(f"{name}: the call gathered its leaves")
  sent = after.bytes_sent - before.bytes_sent
  # The layout (rows, offsets and held systems' spans, per-system counts), 9 bytes a block,
  # and per leaf and boundary (two for a middle rank) the sums of the sub-blocks of one block
  # and the elements of one sub-block.
  systems = kwargs.get("num_systems", 1)
  blocks = sum(-(-x.to_local().numel() // BLOCK) for x in sharded_args[0])
  bound = 8 * (1 + 4 * len(out)) + 4 * systems * len(out) + 9 * (blocks + systems * len(out)) + \
      2 * len(out) * (9 * BLOCK // SUB_BLOCK + 8 * SUB_BLOCK)
  if sent > bound:
    found.append(f"{name}: sent {sent} bytes, more than {bound}")
  if not _same(norms, want_norms):
    found.append(f"{name}: norms {norms} differ from the unsharded {want_norms}")
  for i, (o, w) in enumerate(zip(out, want_out)):
    if tuple(o.placements) != tuple(sharded_args[0][i].placements):
      found.append(f"{name}: leaves[{i}] came back {o.placements}")
    if not _same(o.full_tensor(), w):
      found.append(f"{name}: leaves[{i}] differs from the unsharded output")


def _partials_failures(mesh) -> list[str]:
  """Two ranks or more: partials exchanged, bounded bytes, an error only one rank sees."""
  if dist.get_world_size() < 2:
    return []
  gen = torch.Generator().manual_seed(32)
  whole = [torch.randn(_BIG + 11, generator=gen), torch.randn(4001, 3, generator=gen),
           torch.randn(5, generator=gen).to(torch.bfloat16)]
  place = [Shard(0), Shard(0), Replicate()]
  leaves = [distribute_tensor(x, mesh, [p], src_data_rank=None) for x, p in zip(whole, place)]
  found: list[str] = []
  for p in (2.0, 1.0, float("inf")):
    _check_call(f"clip_grad_norm p={p}", eager.clip_grad_norm, (leaves, 3.0), (whole, 3.0),
                dict(norm_type=p), dict(norm_type=p), found)
  K = 64
  ids = [torch.sort(torch.randint(0, K, (x.shape[0],), generator=gen)).values for x in whole]
  placed_ids = [distribute_tensor(s, mesh, [p], src_data_rank=None) for s, p in zip(ids, place)]
  threshold = torch.rand(K, generator=gen, dtype=torch.float64) * 40
  for op in ("clip_by_global_norm", "clip_by_max_step"):
    _check_call(op, getattr(eager, op), (leaves, threshold), (whole, threshold),
                dict(segments=placed_ids, num_systems=K), dict(segments=ids, num_systems=K),
                found)
  # An id out of range in the last rank's rows only: every rank raises the unsharded error.
  bad = ids[1].clone()
  bad[-1] = K
  bad_ids = [placed_ids[0], distribute_tensor(bad, mesh, [Shard(0)], src_data_rank=None),
             placed_ids[2]]
  found.append(_raises(lambda: eager.clip_by_global_norm(leaves, threshold, segments=bad_ids,
                                                         num_systems=K), ValueError,
                       "segments[1]"))
  return [f"rank {dist.get_rank()}: {f}" for f in found if f]


def _unchunked_failures(mesh) -> list[str]:
  """Rows that are not DTensor's chunks (``from_local`` of other sizes; at three ranks or
  more the first rank's rows are its chunk, the others' not): the unsharded bits, by the
  gathering way on every rank, none left waiting."""
  ranks, me = dist.get_world_size(), dist.get_rank()
  if ranks < 2:
    return []
  gen = torch.Generator().manual_seed(14)
  sizes = [2] * ranks
  sizes[-2] += 1
  sizes[-1] -= 1
  whole = [torch.randn(sum(sizes), 5, generator=gen), torch.randn(7 * BLOCK, generator=gen)]
  start = sum(sizes[:me])
  uneven = DTensor.from_local(whole[0][start:start + sizes[me]], mesh, [Shard(0)],
                              run_check=False, shape=whole[0].shape, stride=whole[0].stride())
  leaves = [uneven, distribute_tensor(whole[1], mesh, [Shard(0)], src_data_rank=None)]
  found: list[str] = []
  for p in (2.0, float("inf")):
    before = sharded.TRAFFIC.snapshot()
    out, norm = eager.clip_grad_norm(leaves, 0.5, norm_type=p)
    if sharded.TRAFFIC.gathered_calls != before.gathered_calls + 1:
      found.append(f"rows not chunks, p={p}: expected the gathering way")
    want_out, want_norm = eager.clip_grad_norm(whole, 0.5, norm_type=p)
    if not _same(norm, want_norm):
      found.append(f"rows not chunks, p={p}: norm {norm} differs from the unsharded {want_norm}")
    for i, (o, w) in enumerate(zip(out, want_out)):
      if not _same(o.full_tensor(), w):
        found.append(f"rows not chunks, p={p}: leaves[{i}] differs from the unsharded output")
  return [f"rank {me}: {f}" for f in found]


def main() -> int:
  dist.init_process_group("gloo")
  found = failures()
  dist.destroy_process_group()
  for line in found:
    print(line)
  return 1 if found else 0


if __name__ == "__main__":
  sys.exit(main())
