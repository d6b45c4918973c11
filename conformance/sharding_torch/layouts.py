"""Rule 14's layouts as torch places them: ``conformance/sharding/layouts.py`` plus two of torch's.

The cases and their names are the shared ones (``sharding.layouts``: ``rows-uneven-4-pinf``
...), so a row means the same for JAX and torch. On one 1-D ``DeviceMesh`` of the layout's
size, a ``rows`` leaf is ``Shard(0)`` (``torch.chunk``: ``ceil(rows / ranks)`` per rank in rank
order, the last ranks short or empty, as the shared layouts assume) and a ``replicated`` leaf is
``Replicate()``.

Whole leaves on different ranks (the shared ``leaves-on-devices-*``) cannot be said with one
mesh: ``Shard(0)`` splits every leaf over all its ranks, so a leaf lies whole on one rank only
when it has one row, and then on the first. A mesh over the ranks in another order
(``DeviceMesh("cpu", [3, 0, 1, 2])``) would put it on another rank, but torch 2.14.1's
``full_tensor()`` gathers such a mesh's shards in the default group's order (wrong values,
measured), so those cases are not applicable here; the nearest torch layouts are
``empty-shard-4`` (leaves held by some ranks only) and ``two-meshes-*``.

The shared ``columns`` placement (tensor parallelism) is ``Shard(1)`` for the 2-D leaves and
``Shard(0)`` for the 1-D one; ids are whole on every rank (the 1-D leaf's split like it).

Torch's own layouts, with the shared variants:

* ``two-meshes-N``: rows split, alternate leaves on a second mesh over the same ranks (alike
  but not equal: its dimension has another name), the case of pytorch/pytorch#180346;
* ``fsdp2-N``: the DTensor gradients of a small model wrapped with ``fully_shard`` (FSDP2),
  ``clip_grad_norm`` only; the model, not the layout, makes the values;
* ``dp-tp-N`` and ``dp-tp-systems-N``: a 2-D mesh of ``(2, N / 2)`` ranks, FSDP's rows on the
  first dimension and tensor parallelism's columns on the second (``[Shard(0), Shard(1)]``),
  the 1-D leaf split by rows and copied along the second (``[Shard(0), Replicate()]``, as a
  bias is), the ids placed like their leaf's rows.
"""

from __future__ import annotations

import dataclasses

from clipbench.conformance.sharding import layouts as shared

ON_DEVICE_NOTE = (
    "whole leaves on different ranks cannot be said with one torch DeviceMesh (Shard(0) splits "
    "every leaf over all ranks); a mesh in another rank order gives wrong full_tensor() values "
    "in torch 2.14.1 (see empty-shard-4 and two-meshes-* for the nearest torch layouts)")

TWO_MESHES = "two-meshes"
FSDP2 = "fsdp2"
DP_TP = "dp-tp"

_TORCH_LAYOUTS = (
    shared.Layout(f"{TWO_MESHES}-2", 2, (7, 6, 3), (shared.ROWS,) * 3),
    shared.Layout(f"{TWO_MESHES}-4", 4, (9, 8, 3), (shared.ROWS,) * 3),
    # (3 -> 2W+1 -> max(W-1, 1)) linear layers: weights of 2W+1 rows split unevenly, and of
    # W-1 rows, which leave the last rank without any.
    shared.Layout(f"{FSDP2}-2", 2, (5, 5, 1, 1), (shared.ROWS,) * 4),
    shared.Layout(f"{FSDP2}-4", 4, (9, 9, 3, 3), (shared.ROWS,) * 4),
    shared.Layout(f"{DP_TP}-4", 4, (9, 6, 5), (shared.ROWS,) * 3),
    shared.Layout(f"{DP_TP}-systems-4", 4, (15, 10, 7), (shared.ROWS,) * 3, per_system=True),
)
_TORCH_VARIANTS = ("p2", "p1", "pinf", "nonfinite-zero")
# ci: the shared ci cases, and each torch layout at p = 2. (fsdp2-*-pinf, the norm of
# meta-pytorch/torchrec#3199, deadlocks torch's clip_grad_norm_: a group restart, thorough only.)
CI_TORCH_CASES = frozenset({"two-meshes-4-p2", "fsdp2-2-p2", "fsdp2-4-p2", "dp-tp-4-p2",
                            "dp-tp-systems-4-p2"})


@dataclasses.dataclass(frozen=True)
class TorchCase(shared.ShardingCase):
  """A shared case, or one of torch's own layouts."""

  @property
  def on_two_meshes(self) -> bool:
    return self.layout.name.startswith(TWO_MESHES)

  @property
  def fsdp2(self) -> bool:
    return self.layout.name.startswith(FSDP2)

  @property
  def on_2d_mesh(self) -> bool:
    return self.layout.name.startswith(DP_TP)

  def placements(self, leaf: int, ndim: int, ids: bool = False) -> list:
    """The torch placements of leaf ``leaf`` (of ``ndim`` dimensions), or of its ids (the 2-D
    layouts split every leaf)."""
    from torch.distributed.tensor import Replicate, Shard  # pylint: disable=import-outside-toplevel
    if self.layout.placements[leaf] == shared.COLUMNS:
      return [Shard(0)] if ndim == 1 else [Replicate()] if ids else [Shard(1)]
    if self.on_2d_mesh:
      return [Shard(0), Shard(1) if ndim > 1 and not ids else Replicate()]
    return [Shard(0) if self.layout.placements[leaf] == shared.ROWS else Replicate()]

  @property
  def expressible(self) -> bool:
    return shared.ON_DEVICE not in self.layout.placements

  def applies_to(self, op: str) -> bool:
    return (not self.fsdp2 or op == "clip_grad_norm") and super().applies_to(op)


def cases(profile: str = "ci") -> list[TorchCase]:
  """The shared cases of ``profile`` and torch's own (ci: :data:`CI_TORCH_CASES`)."""
  out = [TorchCase(c.layout, c.variant) for c in shared.cases(profile)]
  variants = [v for v in shared.VARIANTS if v.name in _TORCH_VARIANTS]
  own = [TorchCase(layout, variant) for layout in _TORCH_LAYOUTS for variant in variants]
  return out + [c for c in own if profile == "thorough" or c.name in CI_TORCH_CASES]


def case_named(name: str) -> TorchCase:
  for case in cases("thorough"):
    if case.name == name:
      return case
  raise ValueError(f"case: unknown torch sharding case {name!r}")
