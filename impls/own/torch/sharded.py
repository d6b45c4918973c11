"""Sharded leaves (``torch.distributed.tensor.DTensor``): SPEC rule 14, same bits on many ranks.

A call whose leaves are DTensors gives, on every rank, the output bits and the norm bits of
the same call on the unsharded leaves. The own implementations get there by *gathering*: each
DTensor leaf (and each DTensor segment-id or threshold tensor) is made whole with
``full_tensor()`` on its own mesh, the unsharded call runs on the whole leaves, and each output
goes back to its input's mesh and placements.

Why gathering. Every decision of the unsharded call is a function of the exact values of a
system's elements, so a rank that holds all of them reaches it with no reduction across ranks
at all: nothing is summed across shards, so there is no order to fix, and the result is exact
by construction for every layout (rows split evenly or unevenly, a rank holding no rows,
replicated leaves, systems straddling shard boundaries, leaves on different meshes). The cost
is one all-gather of the leaves (each element crosses the network once per receiving rank) and
the unsharded call's compute repeated on every rank; going back to the input placements is a
local slice (``Replicate -> Shard`` needs no communication).

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


def _whole(value: Any, name: str) -> Any:
  """``value`` gathered on its own mesh when it is a DTensor, else unchanged."""
  from torch.distributed.tensor import DTensor  # pylint: disable=import-outside-toplevel
  if not isinstance(value, DTensor):
    return value
  if value.device_mesh.get_coordinate() is None:
    raise ValueError(f"{name}: a DTensor on a device mesh {value.device_mesh} that does not "
                     "include this rank; every rank that calls must belong to every mesh")
  return value.full_tensor()


def _whole_leaves(leaves: Any) -> list[Any]:
  import torch  # pylint: disable=import-outside-toplevel
  from torch.distributed.tensor import DTensor  # pylint: disable=import-outside-toplevel
  sharded = [i for i, x in enumerate(leaves) if isinstance(x, DTensor)]
  for i, leaf in enumerate(leaves):
    if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor):
      raise TypeError(
          f"leaves[{i}]: a plain torch.Tensor among DTensor leaves (leaves[{sharded[0]}] is a "
          "DTensor); whether it is this rank's piece or a replica is ambiguous: make it a "
          "DTensor, e.g. DTensor.from_local(x, mesh, [Replicate()])")
  # Anything else (a list, None) is left to the unsharded call's checks, with its messages.
  return [_whole(x, f"leaves[{i}]") for i, x in enumerate(leaves)]


def _whole_segments(segments: Any) -> Any:
  if segments is None or not isinstance(segments, (list, tuple)):
    return segments  # the unsharded call's checks name what is wrong
  return type(segments)(_whole(s, f"segments[{i}]") for i, s in enumerate(segments))


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
  whole = _whole_leaves(leaves)
  whole_call = call._replace(segments=_whole_segments(call.segments),
                             threshold=_whole(call.threshold, call.threshold_name))
  outputs, norms = clipping._run(whole, whole_call)  # pylint: disable=protected-access
  return [_like_input(out, leaf) for out, leaf in zip(outputs, leaves)], norms
