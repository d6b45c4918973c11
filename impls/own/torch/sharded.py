"""Sharded leaves (``torch.distributed.tensor.DTensor``): SPEC rule 14, same bits on many ranks.

A call whose leaves are DTensors gives, on every rank, the output bits and the norm bits of
the same call on the unsharded leaves.

CPU leaves (gloo), the numba route: partials, not leaves. Each rank reads only its own rows.
The unsharded bits come from the numba kernels' blocks (each system's run of rows cut into
blocks of 8,192 elements, each block reduced by one compiled function, the results folded in
block order), so the ranks exchange *block results*, and every rank folds them in the
unsharded order (:mod:`clipbench.impls.own.numba.sharded`): a block wholly on one rank is
reduced there; a block that straddles a boundary travels as the results of its sub-blocks or
pieces each rank holds, plus the elements of the one sub-block across the boundary, and is
completed by every rank (beyond two ranks: at one rank, sent the others' sub-block sums and
smaller pieces point to point); near-ties are settled from exact per-rank partials. Every
rank's rows are DTensor's chunks, known from metadata, so a call makes one all-gather of block
results (one more when the kernels take a first pass for the maxima: float64 leaves, p > 6;
an all-to-all before each beyond two ranks); a per-system call first all-gathers whether each
rank's ids are in range with the span of systems it holds, then its row counts per system
over that span. Each rank scales its own rows, and outputs keep their placements.

GPU leaves (and CPU leaves sent down the CUDA route: ``cpu_kernels=False``, or
``branches.accelerator_branches``), the CUDA route: per-system measures, not leaves
(:mod:`.sharded_intervals`). That route's bits are a function of each system's exact norm,
certified from an interval, so the ranks reduce their rows' float64 power sums (with a depth
bound that covers the reduction), maxima and minima, and every rank decides alike from the
reduced intervals: one exchange per pass (two for a general p: the maxima set its scaling),
16 to 32 bytes per system per call with the element counts (32 for float64 power sums). Large
exchanges go by owners: a rank sends the values of the systems it holds to the systems'
owners, and its folded slice to every rank (``_Exchange._by_owners``).
Near-ties are settled from every rank's exact partials of the flagged systems (exact power
sums, step norms, or for a non-integer p interval enclosures of the power sums, added). Rows
need not be DTensor's chunks unless whole segment ids must be cut at them.

Which leaves take which way (decided from metadata, so every rank takes the same):

* ``Shard(0)`` on a 1-D mesh: the rank's rows, as above;
* ``Replicate()`` on any mesh: whole on every rank, reduced by every rank (the CUDA route:
  measured by the group's first rank, so that it counts once), nothing sent;
* pieces (``Shard(d)`` or ``Replicate()`` on every dimension of a 1-D mesh, or of a larger
  mesh over every rank: tensor parallelism's ``Shard(1)``, FSDP with it on a 2-D mesh), read
  in place, a piece copied along a ``Replicate`` mesh dimension counted by the first rank
  along it; its ids are cut at the piece's rows. On the CUDA route any such piece: a
  system's measures do not depend on where its elements are. On the numba route pieces
  split along the rows and the second axis only, each rank's stretch of a row whole or at
  least ``SUB_BLOCK`` elements (``sharded_partials.column_pieces``): a row's stretches cut
  the blocks into pieces, and a sub-block two ranks share travels as its elements. Max-step's
  vectors are rows, so for it only pieces of rows are read in place;
* anything else (``Partial``; on the numba route, narrower columns and splits along a later
  axis; a leaf split by columns for max-step): gathered with ``full_tensor()`` and then
  treated as replicated; this moves that leaf whole, the only gather on these routes.

A whole call gathers (every DTensor leaf, segment and threshold made whole, the unsharded call
run on every rank, each output cut back to its placements) when no exchange of partials is
possible: on the CUDA route ``certified=False``; leaves on more than one device type;
leaves whose meshes span different ranks; on the numba route a ``Shard(0)`` leaf whose ranks'
rows are not the contiguous chunks DTensor describes (on the CUDA route only where whole ids
must be cut); or an argument some rank finds invalid (then every rank raises the unsharded
call's error). When every leaf is replicated the unsharded call runs on every rank, and
nothing moves.

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
  stack them). Every mesh must include this rank, since a rank outside a mesh cannot take part
  in its collectives (``ValueError`` naming the leaf).
* Segment ids may be DTensors (placed like their leaf, or gathered) or plain tensors/arrays
  describing the *whole* leaf's rows, the same on every rank.

Every byte a rank hands to a collective of a call is counted in :data:`TRAFFIC` (the
benchmarks' and tests' exact measure of what a call sends).
"""

from __future__ import annotations

from typing import Any

from clipbench.impls.own.torch import branches, sharded_intervals as intervals
from clipbench.impls.own.torch import sharded_partials as partials
from clipbench.impls.own.torch.sharded_partials import TRAFFIC, full_tensor, like_input


def has_dtensor(leaves: Any) -> bool:
  """Whether any leaf is a DTensor (the sharded route)."""
  try:
    from torch.distributed.tensor import DTensor
  except ImportError:  # a torch built without distributed
    return False
  # Over the leaves' distinct types: a call may have 10,000 leaves (W4).
  return isinstance(leaves, (list, tuple)) and any(issubclass(kind, DTensor)
                                                   for kind in set(map(type, leaves)))


def _check_mesh(value: Any, name: str) -> None:
  if value.device_mesh.get_coordinate() is None:
    raise ValueError(f"{name}: a DTensor on a device mesh {value.device_mesh} that does not "
                     "include this rank; every rank that calls must belong to every mesh")


def _row_split(value: Any) -> bool:
  """Whether ``value`` is ``Shard(0)`` on a 1-D mesh (gathered as bytes, below)."""
  placements = value.placements
  # A row of zero elements cannot be told apart in bytes: such a leaf takes full_tensor().
  return (len(placements) == 1 and placements[0].is_shard(0) and value.device_mesh.ndim == 1
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
  TRAFFIC.bytes_sent += buffer.numel() + sizes.numel() * 8
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
      whole[name] = full_tensor(value)
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


def clip_sharded(clipping: Any, leaves: Any, call: Any):
  """(outputs, norms) of ``call`` on DTensor leaves, bit for bit the unsharded call's.

  ``clipping`` is the :class:`~clipbench.impls.own.torch.api.TorchClipping` whose
  ``_run(plain_leaves, call)`` makes the unsharded call; ``call`` is its ``_Call``. Outputs are
  DTensors with each input's mesh and placements; the norms a plain tensor, the same on every
  rank.
  """
  _check_mixed(leaves)
  TRAFFIC.calls += 1
  ways = _partial_ways(leaves, call)
  if ways is not None and all(w == "replicated" for w in ways):
    return _clip_gathering(clipping, leaves, call)  # every leaf whole on every rank: none moves
  done = None
  if ways is not None and clipping.cpu_kernels and all(branches.on_host(x.device)
                                                       for x in leaves):
    # The numba kernels' bits: block results, in the order of the rows (pieces whose blocks
    # would travel as elements made whole).
    done = partials.clip(leaves, call, [
        "gathered" if w == "pieces" and not partials.column_pieces(x) else w
        for x, w in zip(leaves, ways)])
  elif ways is not None and intervals.applies(leaves, call, clipping.certified):
    done = intervals.clip(leaves, call, ways)  # the CUDA route's: certified intervals
  if done is not None:
    return done
  TRAFFIC.gathered_calls += 1
  return _clip_gathering(clipping, leaves, call)


def _partial_ways(leaves: Any, call: Any) -> list[str] | None:
  """Per leaf ``"rows"``, ``"pieces"``, ``"replicated"`` or ``"gathered"`` when the call can
  exchange partials (from metadata only: every rank decides alike), else None."""
  import torch  # pylint: disable=import-outside-toplevel
  from torch.distributed.tensor import DTensor  # pylint: disable=import-outside-toplevel
  if not (isinstance(leaves, (list, tuple)) and leaves):
    return None
  floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
  if not all(isinstance(x, DTensor) and x.dtype in floats for x in leaves):
    return None
  checked = set()
  for i, x in enumerate(leaves):
    if id(x.device_mesh) not in checked:
      _check_mesh(x, f"leaves[{i}]")
      checked.add(id(x.device_mesh))
  segments = call.segments
  if segments is not None and not (isinstance(segments, (list, tuple))
                                   and len(segments) == len(leaves)):
    return None
  ways = []
  for x in leaves:
    if all(p.is_replicate() for p in x.placements):
      ways.append("replicated")
    elif _row_split(x):
      ways.append("rows")
    elif _disjoint_pieces(x, call.op):
      ways.append("pieces")
    else:
      ways.append("gathered")
  meshes = {id(x.device_mesh): x.device_mesh for x, w in zip(leaves, ways)
            if w in ("rows", "pieces")}
  members = {tuple(sorted(m.mesh.reshape(-1).tolist())) for m in meshes.values()}
  if len(members) > 1:
    return None
  return ways


def _disjoint_pieces(value: Any, op: str) -> bool:
  """Whether ``value``'s local tensors are pieces of it that no two ranks share, but for
  copies along ``Replicate`` mesh dimensions (``Shard(d)`` or ``Replicate()`` on every
  dimension of the mesh: tensor parallelism, a 2-D mesh of FSDP and tensor parallelism), on a
  1-D mesh or one over every rank (so that one group holds every piece). A max-step vector is
  a leaf's row, so for ``clip_by_max_step`` only rows may be split."""
  import torch.distributed as dist  # pylint: disable=import-outside-toplevel
  from torch.distributed.tensor import Shard  # pylint: disable=import-outside-toplevel
  mesh = value.device_mesh
  if mesh.ndim > 1 and mesh.size() != dist.get_world_size():
    return False
  split = [p.dim for p in value.placements if type(p) is Shard]  # not _StridedShard
  if not split or len(split) + sum(p.is_replicate() for p in value.placements) != mesh.ndim:
    return False  # a Partial (a pending sum) or another placement: made whole
  return op != "clip_by_max_step" or all(d == 0 for d in split)


def _clip_gathering(clipping: Any, leaves: Any, call: Any):
  """The unsharded call on every rank, on leaves made whole."""
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
  return [like_input(out, leaf) for out, leaf in zip(outputs, leaves)], norms

