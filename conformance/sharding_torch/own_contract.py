"""Our torch implementation's DTensor contract, checked in a one-rank gloo group.

  python -m clipbench.conformance.sharding_torch.own_contract   (RANK, WORLD_SIZE=1, MASTER_*)

What rule 14's layouts do not show: outputs come back as DTensors with the input's mesh and
placements and the norm as a plain tensor; a plain tensor among DTensor leaves is a TypeError
naming it; a bad argument with DTensor leaves gets the unsharded call's error. Prints one line
per failed check and exits 1 when any failed.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from clipbench.impls.own.torch import eager


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
  return [f for f in found if f]


def main() -> int:
  dist.init_process_group("gloo")
  found = failures()
  dist.destroy_process_group()
  for line in found:
    print(line)
  return 1 if found else 0


if __name__ == "__main__":
  sys.exit(main())
