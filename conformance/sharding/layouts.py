"""The shard layouts of rule 14 and the inputs of each case, independent of any framework.

A layout says how many devices (shards) there are and where each leaf lives: its rows split
across every shard (``ROWS``; evenly, unevenly, or leaving a shard with no rows), its columns
split (``COLUMNS``, tensor parallelism: a leaf's second axis, 3 columns over 2 or 4 shards, so
unevenly and, over 4, leaving one shard none; a 1-D leaf's rows), the whole leaf on one
device (``ON_DEVICE``, leaf i on device i mod n), or a full copy on every device
(``REPLICATED``). Per-system layouts give each leaf segments whose systems run across shard
boundaries (a system's rows on two shards, and on several leaves). Each runner maps these
placements onto its engine (JAX ``NamedSharding``, torch ``DTensor``) and states where the
engine cannot express one.

A case is a layout and a variant (p, non-finite values and mode); its name holds both, e.g.
``rows-uneven-4-pinf``. The ``ci`` profile runs :data:`CI_CASES`; ``thorough`` the full grid.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import numpy as np

from clipbench.conformance.cases import BF16, Inputs

ROWS = "rows"
COLUMNS = "columns"
REPLICATED = "replicated"
ON_DEVICE = "device"
PLACEMENTS = (ROWS, COLUMNS, REPLICATED, ON_DEVICE)
_COLUMNS = 3  # of every leaf but the 1-D one (``_build``'s shapes)

PER_SYSTEM_OPS = ("clip_by_global_norm", "clip_by_max_step")
PROFILES = ("ci", "thorough")


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the leaves of one case live.

  Attributes:
    name: the case-id prefix, ending in the number of devices.
    devices: number of devices (shards) of the mesh.
    rows: rows of each leaf; leaf 1 is 1-D (1-vectors), the others hold 3-vectors.
    placements: one of ``PLACEMENTS`` per leaf.
    per_system: the leaves carry segments (systems straddling shard boundaries); such a
      layout applies to ``clip_by_global_norm`` and ``clip_by_max_step`` only.
  """

  name: str
  devices: int
  rows: tuple[int, ...]
  placements: tuple[str, ...]
  per_system: bool = False

  def __post_init__(self) -> None:
    if len(self.rows) != len(self.placements):
      raise ValueError(f"placements: expected one per leaf ({len(self.rows)}), got "
                       f"{len(self.placements)} ({self.name})")
    unknown = set(self.placements) - set(PLACEMENTS)
    if unknown:
      raise ValueError(f"placements: unknown {sorted(unknown)} ({self.name}); known: "
                       f"{PLACEMENTS}")

  def device_of(self, leaf: int) -> int:
    """The device holding leaf ``leaf`` whole (``ON_DEVICE`` placements)."""
    return leaf % self.devices

  def split_axis(self, leaf: int) -> int | None:
    """The axis a leaf is split along (None: not split)."""
    kind = self.placements[leaf]
    if kind == COLUMNS and leaf != 1:
      return 1
    return 0 if kind in (ROWS, COLUMNS) else None

  def evenly_split(self, leaf: int) -> bool:
    size = _COLUMNS if self.split_axis(leaf) == 1 else self.rows[leaf]
    return size % self.devices == 0

  def shard_rows(self, leaf: int) -> list[int]:
    """Rows of each shard of a ``ROWS`` leaf, as torch's ``Shard(0)`` and XLA split them:
    ``ceil(rows / devices)`` per shard, the last shards short or empty."""
    rows, n = self.rows[leaf], self.devices
    block = -(-rows // n)
    return [max(0, min(block, rows - i * block)) for i in range(n)]


_SPLIT = (ROWS, ROWS, ROWS)
LAYOUTS: tuple[Layout, ...] = (
    Layout("rows-even-2", 2, (8, 6, 4), _SPLIT),
    Layout("rows-even-4", 4, (8, 12, 4), _SPLIT),
    Layout("rows-uneven-2", 2, (7, 5, 3), _SPLIT),
    Layout("rows-uneven-4", 4, (9, 6, 7), _SPLIT),
    # 3 rows on 4 shards: 1, 1, 1, 0; one row: 1, 0, 0, 0; 6 rows: 2, 2, 2, 0.
    Layout("empty-shard-4", 4, (3, 1, 6), _SPLIT),
    Layout("leaves-on-devices-2", 2, (5, 4, 6), (ON_DEVICE,) * 3),
    Layout("leaves-on-devices-4", 4, (5, 4, 6), (ON_DEVICE,) * 3),
    Layout("replicated-2", 2, (5, 4, 6), (REPLICATED,) * 3),
    Layout("replicated-4", 4, (5, 4, 6), (REPLICATED,) * 3),
    Layout("mixed-4", 4, (8, 5, 7), (ROWS, REPLICATED, ROWS)),
    Layout("systems-straddle-2", 2, (14, 10, 8), _SPLIT, per_system=True),
    Layout("systems-straddle-4", 4, (16, 12, 8), _SPLIT, per_system=True),
    Layout("systems-straddle-uneven-4", 4, (15, 10, 7), _SPLIT, per_system=True),
    Layout("columns-2", 2, (7, 6, 5), (COLUMNS,) * 3),
    Layout("columns-4", 4, (9, 6, 5), (COLUMNS,) * 3),
    Layout("columns-systems-4", 4, (16, 12, 8), (COLUMNS,) * 3, per_system=True),
)


@dataclasses.dataclass(frozen=True)
class Variant:
  """The numbers of a case: p, leaf dtype, and non-finite values with their mode."""

  name: str
  norm_type: float = 2.0
  dtype: str = "float32"
  nonfinite: str = "propagate"
  poisoned: bool = False  # a NaN and an inf among the values
  norm_ops_only: bool = False  # p means nothing to clip_by_max_step


VARIANTS: tuple[Variant, ...] = (
    Variant("p2"),
    Variant("p1", norm_type=1.0, norm_ops_only=True),
    Variant("p3", norm_type=3.0, norm_ops_only=True),
    Variant("pinf", norm_type=math.inf, norm_ops_only=True),
    # A non-integer p: no exact power sum, so exact decisions need enclosures.
    Variant("p2.5", norm_type=2.5, norm_ops_only=True),
    Variant("p2-bfloat16", dtype="bfloat16"),
    Variant("nonfinite-propagate", poisoned=True),
    Variant("nonfinite-zero", nonfinite="zero", poisoned=True),
    # Maxima across shards: XLA's cross-device max drops a NaN that one device holds.
    Variant("pinf-nonfinite-propagate", norm_type=math.inf, poisoned=True, norm_ops_only=True),
)

# The ci profile: clip_grad_norm on every kind of global layout, with p = inf over a NaN (a max
# across shards) on an even split and nonfinite="zero" on an uneven one; the per-system
# operations on systems straddling shard boundaries (an uneven split, and a NaN). The thorough
# profile runs every layout with every variant on every operation.
CI_CASES: dict[str, frozenset[str]] = {
    "clip_grad_norm": frozenset({
        "rows-uneven-4-p2", "empty-shard-4-p2", "leaves-on-devices-2-p2", "mixed-4-p2",
        "rows-even-2-pinf-nonfinite-propagate", "rows-uneven-4-nonfinite-zero", "columns-2-p2"}),
    **{op: frozenset({"systems-straddle-uneven-4-p2", "systems-straddle-4-nonfinite-propagate"})
       for op in PER_SYSTEM_OPS},
}


@dataclasses.dataclass(frozen=True)
class ShardingCase:
  """One rule-14 case: a layout, a variant, and the inputs it builds for an operation."""

  layout: Layout
  variant: Variant

  @property
  def name(self) -> str:
    return f"{self.layout.name}-{self.variant.name}"

  def applies_to(self, op: str) -> bool:
    if self.layout.per_system and op not in PER_SYSTEM_OPS:
      return False
    return not (self.variant.norm_ops_only and op == "clip_by_max_step")

  def build(self, op: str) -> Inputs:
    """The numpy inputs of this case for ``op`` (the same every time: seeded by the name)."""
    if not self.applies_to(op):
      raise ValueError(f"op: case {self.name} does not apply to {op}")
    return _build(self.layout, self.variant, op, zlib.crc32(self.name.encode()))


def cases(profile: str = "ci", op: str | None = None) -> list[ShardingCase]:
  """The cases of ``profile`` that apply to ``op`` (every op when None): ``"ci"`` the few of
  :data:`CI_CASES`, ``"thorough"`` every layout with every variant."""
  if profile not in PROFILES:
    raise ValueError(f"profile: expected one of {PROFILES}, got {profile!r}")
  if op is not None and op not in CI_CASES:
    raise ValueError(f"op: expected one of {tuple(CI_CASES)}, got {op!r}")
  every = [ShardingCase(layout, variant) for layout in LAYOUTS for variant in VARIANTS]
  ops = [op] if op is not None else list(CI_CASES)
  return [c for c in every if any(c.applies_to(o) and (
      profile == "thorough" or c.name in CI_CASES[o]) for o in ops)]


def case_named(name: str) -> ShardingCase:
  for case in cases("thorough"):
    if case.name == name:
      return case
  raise ValueError(f"case: unknown sharding case {name!r}")


def _segments(rows: tuple[int, ...]) -> tuple[list[np.ndarray], int]:
  """Systems in runs of 3, 5 and 2 rows, carried on from leaf to leaf, so that runs cross
  every shard boundary and most systems have rows in several leaves; the last of the
  ``num_systems`` ids is never used (an empty system)."""
  num_systems = 6
  runs = (3, 5, 2)
  segments, system, run, left = [], 0, 0, runs[0]
  for count in rows:
    ids = np.empty(count, np.int64)
    for i in range(count):
      if left == 0:
        system, run = (system + 1) % (num_systems - 1), run + 1
        left = runs[run % len(runs)]
      ids[i] = system
      left -= 1
    segments.append(ids)
  return segments, num_systems


def _system_norms(leaves64: list[np.ndarray], segments: list[np.ndarray] | None,
                  num_systems: int, op: str, p: float) -> np.ndarray:
  """Each system's norm in float64 numpy (only to set thresholds that clip some systems)."""
  out = np.zeros(num_systems)
  for k in range(num_systems):
    parts = []
    for x, seg in zip(leaves64, segments or [None] * len(leaves64)):
      rows = x if seg is None else x[seg == k]
      if op == "clip_by_max_step":
        vectors = rows.reshape(rows.shape[0], int(np.prod(rows.shape[1:])))
        parts.append(np.sqrt((vectors ** 2).sum(axis=1)))
      else:
        parts.append(np.abs(rows).ravel())
    values = np.concatenate(parts) if parts else np.zeros(0)
    if not values.size:
      continue
    if op == "clip_by_max_step" or p == math.inf:
      out[k] = values.max()
    else:
      out[k] = (values ** p).sum() ** (1 / p)
  return out


def _build(layout: Layout, variant: Variant, op: str, seed: int) -> Inputs:
  rng = np.random.default_rng(seed)
  dtype = BF16 if variant.dtype == "bfloat16" else np.dtype(variant.dtype)
  shapes = [(r,) if i == 1 else (r, 3) for i, r in enumerate(layout.rows)]
  leaves64 = [rng.normal(0.0, 1.0, s) * rng.choice([0.5, 1.0, 4.0], size=s[:1]).reshape(
      (-1,) + (1,) * (len(s) - 1)) for s in shapes]
  leaves64 = [x.astype(dtype).astype(np.float64) for x in leaves64]
  segments, num_systems = _segments(layout.rows) if layout.per_system else (None, 1)
  norms = _system_norms(leaves64, segments, num_systems, op, variant.norm_type)
  # Below most systems' norms, above some: a sharded run that misjudges one system's norm
  # changes that system's decision.
  threshold = float(np.median(norms[norms > 0])) if layout.per_system else float(norms[0] / 2)
  leaves = [x.astype(dtype) for x in leaves64]
  if variant.poisoned:
    leaves[0][1] = np.nan
    leaves[-1][-1] = np.inf
  return Inputs(leaves, threshold, segments, num_systems if segments is not None else None,
                norm_type=variant.norm_type, nonfinite=variant.nonfinite)
