"""Sharded leaves (``torch.distributed.tensor.DTensor``): SPEC rule 14, same bits on many ranks.

A call whose leaves are DTensors gives, on every rank, the output bits and the norm bits of
the same call on the unsharded leaves. The own implementations get there by *gathering*: each
DTensor leaf (and each DTensor segment-id or threshold tensor) is made whole on its own mesh
(``Shard(0)`` leaves of a 1-D mesh all in one all-gather of their bytes, ``Replicate`` ones
as they are, anything else by ``full_tensor()``), the unsharded call runs on the whole leaves,
and each output goes back to its input's mesh and placements.

Why gathering. Every decision of the unsharded call is a function of the exact values of a
system's elements, so a rank that holds all of them reaches it with no reduction across ranks
at all: nothing is summed across shards, so there is no order to fix, and the result is exact
by construction for every layout (rows split evenly or unevenly, a rank holding no rows,
replicated leaves, systems straddling shard boundaries, leaves on different meshes). The cost
is one all-gather of the leaves per mesh (each element crosses the network once per receiving
rank) and the unsharded call's compute repeated on every rank; going back to the input
placements is a local slice (``Replicate -> Shard`` needs no communication).

The alternative, cheaper in bandwidth for large leaves, is to reduce *exact partial sums*:
each rank computes its shard's per-system power sums as exact integers (the int64 limb sums per
(system, exponent) bucket of ``oracles.exact_power_sums``) or maxima, all-reduces them (integer
addition and max are associative, so any reduction order gives the same bits), and takes the
decisions from the exact totals. That needs the certified fast path rebuilt around a
collective, for a gain only where the leaves dwarf the network; it is not done here.

What comes back:

* outputs: DTensors on each input's mesh with its placements (a ``Partial`` placement comes
  back ``Replicate``: a clipped value is not a pending sum);
* norms: a plain ``torch.Tensor``, replicated: the same value on every rank (the form users read
  from ``clip_grad_norm_``'s total norm).

Decisions on what is refused:

* DTensor leaves mixed with plain tensors: a plain tensor could be this rank's piece or a copy
  held by every rank, and the two readings give different calls; it is a ``TypeError`` naming
  the leaf (wrap it with ``DTensor.from_local(x, mesh, [Replicate()])`` to say which).
* Leaves on different meshes are accepted (pytorch/pytorch#180346: torch's own norm fails to
  stack them): each is gathered on its own mesh. Every mesh must include this rank, since a
  rank outside a mesh cannot take part in its gather (``ValueError`` naming the leaf).
* Segment ids may be DTensors (gathered like leaves) or plain tensors/arrays describing the
  *whole* leaf's rows, the same on every rank.
"""

from __future__ import annotations

from typing import Any


def has_dtensor(leaves: Any) -> bool:
  """Whether any leaf is a DTensor (the sharded route)."""
  try:
    from torch.distributed.tensor import DTensor
  except ImportError:  # a torch built without distributed
    return False
  return isinstance(leaves, (list, tuple)) and any(isinstance(x, DTensor) for x in leaves)


def _check_mesh(value: Any, name: str) -> None:
  if value.device_mesh.get_coordinate() is None:
    raise ValueError(f"{name}: a DTensor on a device mesh {value.device_mesh} that does not "
                     "include this rank; every rank that calls must belong to every mesh")


def _row_split(value: Any) -> bool:
  """Whether ``value`` is ``Shard(0)`` on a 1-D mesh (gathered as bytes, below)."""
  from torch.distributed.tensor import Shard  # pylint: disable=import-outside-toplevel
  # A row of zero elements cannot be told apart in bytes: such a leaf takes full_tensor().
  return (value.device_mesh.ndim == 1 and tuple(value.placements) == (Shard(0),)
          and all(d > 0 for d in value.shape[1:]))


def _gather_rows(values: list[Any]) -> list[Any]:
  """Whole tensors of ``Shard(0)`` DTensors on one 1-D mesh, with one all-gather of bytes.

  ``full_tensor()`` per leaf costs a collective per leaf (200 for a model's gradient); here
  every rank's local rows of every value travel in one byte buffer (any dtype; each value on
  an 8-byte boundary), padded to the longest, and each value is cut back out and concatenated
  in mesh order. Only bytes move, so the values are exact.
  """
  import torch  # pylint: disable=import-outside-toplevel
  import torch.distributed as dist  # pylint: disable=import-outside-toplevel
  mesh = values[0].device_mesh
  group = mesh.get_group(0)
  local = [v.to_local().contiguous().reshape(-1).view(torch.uint8) for v in values]
  sizes = torch.tensor([t.numel() for t in local], dtype=torch.int64)
  all_sizes = [torch.empty_like(sizes) for _ in range(mesh.size())]
  dist.all_gather(all_sizes, sizes, group=group)
  # Each value starts on a multiple of 8 bytes, so that its bytes view as any dtype.
  starts = [torch.cumsum((s + 7) // 8 * 8, 0) - (s + 7) // 8 * 8 for s in all_sizes]
  buffer = torch.zeros(max(int(((s + 7) // 8 * 8).sum()) for s in all_sizes), dtype=torch.uint8)
  me = dist.get_rank(group)
  for t, start in zip(local, starts[me].tolist()):
    buffer[start:start + t.numel()] = t
  gathered = [torch.empty_like(buffer) for _ in range(mesh.size())]
  dist.all_gather(gathered, buffer, group=group)
  # all_gather fills in group-rank order; the rows go in mesh-coordinate order.
  group_ranks = dist.get_process_group_ranks(group)
  order = [group_ranks.index(int(r)) for r in mesh.mesh.reshape(-1)]
  whole = []
  for i, v in enumerate(values):
    parts = []
    for g in order:
      start = int(starts[g][i])
      part = gathered[g][start:start + int(all_sizes[g][i])]
      parts.append(part.view(v.dtype).reshape((-1,) + tuple(v.shape[1:])))
    whole.append(torch.cat(parts))
  return whole


def _whole_all(named: dict[str, Any]) -> dict[str, Any]:
  """Each value gathered on its own mesh when it is a DTensor, else unchanged.

  ``Replicate`` values are whole on every rank already; ``Shard(0)`` values on a 1-D mesh
  travel together, one all-gather per mesh; anything else (other meshes, dimensions or
  ``Partial``) goes through ``full_tensor()``.
  """
  from torch.distributed.tensor import DTensor  # pylint: disable=import-outside-toplevel
  whole, by_mesh = {}, {}
  for name, value in named.items():
    if not isinstance(value, DTensor):
      whole[name] = value
      continue
    _check_mesh(value, name)
    if all(p.is_replicate() for p in value.placements):
      whole[name] = value.to_local()
    elif _row_split(value):
      by_mesh.setdefault(id(value.device_mesh), []).append(name)
    else:
      whole[name] = value.full_tensor()
  # Every rank meets the meshes in the same order (the order of the arguments).
  for names in by_mesh.values():
    whole.update(zip(names, _gather_rows([named[n] for n in names])))
  return whole


def _check_mixed(leaves: Any) -> None:
  import torch  # pylint: disable=import-outside-toplevel
  from torch.distributed.tensor import DTensor  # pylint: disable=import-outside-toplevel
  sharded = [i for i, x in enumerate(leaves) if isinstance(x, DTensor)]
  for i, leaf in enumerate(leaves):
    if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor):
      raise TypeError(
          f"leaves[{i}]: a plain torch.Tensor among DTensor leaves (leaves[{sharded[0]}] is a "
          "DTensor); whether it is this rank's piece or a replica is ambiguous: make it a "
          "DTensor, e.g. DTensor.from_local(x, mesh, [Replicate()])")


def _like_input(output: Any, leaf: Any) -> Any:
  """``output`` (whole, the same on every rank) as a DTensor with ``leaf``'s mesh and placements.

  ``from_local`` with ``Replicate`` states a fact (every rank holds the same whole value),
  checked by nothing (``run_check=False``); ``redistribute`` to ``Shard`` then keeps this
  rank's chunk, a local slice with no communication.
  """
  from torch.distributed.tensor import DTensor, Replicate  # pylint: disable=import-outside-toplevel
  mesh = leaf.device_mesh
  placements = [Replicate() if p.is_partial() else p for p in leaf.placements]
  replicated = DTensor.from_local(output, mesh, [Replicate()] * mesh.ndim, run_check=False)
  return replicated.redistribute(mesh, placements)


def clip_sharded(clipping: Any, leaves: Any, call: Any):
  """(outputs, norms) of ``call`` on DTensor leaves, bit for bit the unsharded call's.

  ``clipping`` is the :class:`~clipbench.impls.own.torch.api.TorchClipping` whose
  ``_run(plain_leaves, call)`` makes the unsharded call; ``call`` is its ``_Call``. Outputs are
  DTensors with each input's mesh and placements; the norms a plain tensor, the same on every
  rank.
  """
  _check_mixed(leaves)
  # Anything not a tensor (a list, None) is left to the unsharded call's checks and messages.
  named = {f"leaves[{i}]": x for i, x in enumerate(leaves)}
  segments = call.segments
  if isinstance(segments, (list, tuple)):
    named.update({f"segments[{i}]": s for i, s in enumerate(segments)})
  named[call.threshold_name] = call.threshold
  whole = _whole_all(named)
  if isinstance(segments, (list, tuple)):
    segments = type(segments)(whole[f"segments[{i}]"] for i in range(len(segments)))
  whole_call = call._replace(segments=segments, threshold=whole[call.threshold_name])
  outputs, norms = clipping._run(  # pylint: disable=protected-access
      [whole[f"leaves[{i}]"] for i in range(len(leaves))], whole_call)
  return [_like_input(out, leaf) for out, leaf in zip(outputs, leaves)], norms
