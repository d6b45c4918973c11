"""The benchmark workloads, defined once for asv, pytest-benchmark and ``clipbench bench``.

A workload is a frozen record: a name, the canonical operation it exercises and a builder
``builder(scale, dtype, seed) -> WorkloadInputs`` returning numpy leaves, the threshold and,
for per-system workloads, the segments. Everything is drawn from ``numpy.random.default_rng(seed)``
with a fixed seed per workload, so a name always means the same bits (for a given scale and
dtype).

The workloads (scale 1.0):

* ``W1-model``: global L2 (``clip_grad_norm``) over 200 leaves with log-normal sizes, 2**24
  (16M) elements in total, as the gradient of a mid-sized model. ``W1-model-p1``, ``-p3`` and
  ``-pinf`` are the same leaves with the p = 1, 3 and inf norms.
* ``W2-relax``: per-system ``clip_by_global_norm`` over 2,000 systems of 10-500 atoms, as a
  batched structure relaxation: positions ``(n, 3)`` with ``segments`` the system of each atom
  (sorted, contiguous) and a per-system cell ``(num_systems, 3, 3)`` with ``segments = arange``.
* ``W3-relax-large``: as W2 with 20,000 systems.
* ``W4-many-small``: 10,000 leaves of 100 elements (``clip_grad_norm``): per-leaf overhead.
* ``W2-relax-max-step``, ``W3-relax-large-max-step``: ``clip_by_max_step`` on the W2/W3 leaves.
* ``W5-many-tiny``: as W2 with 100,000 systems of 2-8 atoms (small molecules batched for a
  relaxation): per-system overhead, not bandwidth, unless it is kept to a few nanoseconds.
* ``W6-one-giant``: one system of 4,000,000 atoms, positions ``(n, 3)`` with ``segments`` all
  zero and a ``(1, 3, 3)`` cell, ``num_systems=1``: a per-system call whose work is one run.
* ``W5-many-tiny-max-step``, ``W6-one-giant-max-step``: ``clip_by_max_step`` on those leaves.
* ``W7-model-gpu``: as W1 at a GPU's size, 400 leaves and 1.5 billion elements (6 GB in
  float32), the gradient of a 1.5B-parameter model; ``W8-relax-gpu`` and
  ``W8-relax-gpu-max-step``: as W2 with 1,000,000 systems of 10-200 atoms (about 1.3 GB in
  float32), a batched relaxation on one card. These are *GPU-sized*: on the CPU a run skips
  them with its reason unless ``scale`` brings them within :data:`HOST_MAX_ELEMENTS`
  (:func:`host_skip_reason`).

Every threshold is chosen so that clipping happens: half the global norm for W1/W4, the median
system norm (or step norm) for W2/W3/W5, so about half of the systems are clipped and half are
returned unchanged, and both branches are timed; half the norm (or step norm) of W6's one
system, so it is clipped.

``scale`` shrinks a workload linearly (total elements, number of leaves of W4, number of
systems of W2/W3/W5, atoms of W6) for smoke tests; ``scale=1`` is the size the targets are
stated for.

Definitions are append-only: asv compares results across commits by workload name, so a
changed workload must get a new name.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import ml_dtypes
import numpy as np

DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float64")

_NUMPY_DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}

_MODEL_ELEMENTS = 1 << 24
_MODEL_LEAVES = 200
_SMALL_LEAVES = 10_000
_SMALL_LEAF_SIZE = 100
_RELAX_SYSTEMS = 2_000
_RELAX_LARGE_SYSTEMS = 20_000
_ATOMS_RANGE = (10, 500)  # inclusive
_TINY_SYSTEMS = 100_000
_TINY_ATOMS_RANGE = (2, 8)  # inclusive
_GIANT_ATOMS = 4_000_000
_GPU_MODEL_ELEMENTS = 1_500_000_000
_GPU_MODEL_LEAVES = 400
_GPU_RELAX_SYSTEMS = 1_000_000
_GPU_ATOMS_RANGE = (10, 200)
# The largest workload a CPU run builds (W1's 16M elements, twice over): a GPU-sized one past
# it needs a scale (gigabytes of host memory and minutes of drawing otherwise).
HOST_MAX_ELEMENTS = 1 << 25


@dataclasses.dataclass(frozen=True)
class WorkloadInputs:
  """A workload's drawn arguments of one canonical call, in numpy.

  Attributes:
    leaves: the leaves, in call order.
    threshold: ``max_norm`` or ``max_step`` (a Python float).
    segments: None (one system) or one int64 array per leaf giving the system of each row.
    num_systems: None, or the number of systems when ``segments`` is given.
    norm_type: the p of the norm (2.0 for max-step, which has no p).
  """

  leaves: tuple[np.ndarray, ...]
  threshold: float
  segments: tuple[np.ndarray, ...] | None = None
  num_systems: int | None = None
  norm_type: float = 2.0

  @property
  def num_elements(self) -> int:
    return sum(int(x.size) for x in self.leaves)

  @property
  def nbytes(self) -> int:
    return sum(int(x.nbytes) for x in self.leaves)


Builder = Callable[[float, str, int], WorkloadInputs]


@dataclasses.dataclass(frozen=True)
class Workload:
  """One workload: what it computes and how its inputs are drawn.

  Attributes:
    name: stable identifier (asv parameter value, pytest-benchmark group).
    op: canonical operation (``clip_grad_norm``, ``clip_by_global_norm``, ``clip_by_max_step``).
    description: one line for tables.
    builder: ``builder(scale, dtype, seed) -> WorkloadInputs``.
    seed: the fixed seed passed to ``builder``.
    norm_type: p of the norm (known without building, so callers can skip early).
    per_system: the inputs carry ``segments`` (more than one system).
    full_elements: number of leaf elements at ``scale=1`` (approximate for W2/W3).
    gpu_sized: sized for a GPU: a CPU run needs a scale (``host_skip_reason``).
  """

  name: str
  op: str
  description: str
  builder: Builder
  seed: int
  norm_type: float = 2.0
  per_system: bool = False
  full_elements: int = 0
  gpu_sized: bool = False

  def build(self, scale: float = 1.0, dtype: str = "float32") -> WorkloadInputs:
    return self.builder(scale, dtype, self.seed)


def numpy_dtype(dtype: str) -> np.dtype:
  """The numpy dtype of a dtype name (bfloat16 through ml_dtypes)."""
  try:
    return _NUMPY_DTYPES[dtype]
  except KeyError:
    raise ValueError(f"dtype: expected one of {sorted(_NUMPY_DTYPES)}, got {dtype!r}") from None


def host_scale_limit(workload: Workload) -> float:
  """The largest scale at which a CPU run builds ``workload`` (1 for all but the GPU-sized)."""
  if not workload.gpu_sized:
    return 1.0
  return HOST_MAX_ELEMENTS / workload.full_elements


def host_skip_reason(workload: Workload, device: str, scale: float) -> str | None:
  """Why a run on ``device`` at ``scale`` leaves the GPU-sized ``workload`` out, or None."""
  limit = host_scale_limit(workload)
  if device != "cpu" or scale <= limit:
    return None
  return (f"{workload.name} is sized for a GPU ({workload.full_elements:,} elements); on the "
          f"CPU it runs at a scale of at most {limit:.3g}")


def bytes_moved(inputs: WorkloadInputs) -> int:
  """Bytes of the three-pass roofline: read (norm), read and write (scale) every leaf.

  Segment ids are not counted: the roofline is the cost of the clipping itself, the lower bound
  every implementation shares.
  """
  return 3 * inputs.nbytes


def _scaled_count(full: int, scale: float) -> int:
  if not (scale > 0 and math.isfinite(scale)):
    raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
  return max(1, int(round(full * scale)))


def _normal(rng: np.random.Generator, shape: tuple[int, ...], sigma: float,
            dtype: np.dtype) -> np.ndarray:
  # float64 leaves get genuine float64 values (not widened float32 draws); the narrower dtypes
  # round float32 draws, so bfloat16 and float32 workloads share their shape and scale.
  if dtype == np.float64:
    return rng.standard_normal(shape) * sigma
  x = rng.standard_normal(shape, dtype=np.float32)
  x *= np.float32(sigma)
  return x.astype(dtype)


def _p_norm(leaves: tuple[np.ndarray, ...], p: float) -> float:
  """The global p-norm in float64 (only to place the threshold; not a reference)."""
  if p == math.inf:
    return max(float(np.max(np.abs(x.astype(np.float64)))) for x in leaves if x.size)
  total = 0.0
  for x in leaves:
    a = np.abs(x.astype(np.float64))
    total += float(np.sum(a if p == 1 else a**p))
  return total ** (1.0 / p)


def _lognormal_sizes(rng: np.random.Generator, count: int, total: int,
                     sigma: float = 1.5) -> np.ndarray:
  """``count`` positive sizes summing exactly to ``total``, log-normally spread."""
  count = min(count, total)
  weights = rng.lognormal(0.0, sigma, count)
  sizes = np.maximum(1, np.floor(weights / weights.sum() * total)).astype(np.int64)
  sizes[int(np.argmax(sizes))] += total - int(sizes.sum())
  return sizes


def build_model(scale: float, dtype: str, seed: int, *, norm_type: float = 2.0,
                leaves: int = _MODEL_LEAVES, elements: int = _MODEL_ELEMENTS) -> WorkloadInputs:
  """W1 (W7): 200 (400) leaves, log-normal sizes, 2**24 (1.5e9) * scale elements; threshold
  half the norm."""
  np_dtype = numpy_dtype(dtype)
  rng = np.random.default_rng(seed)
  sizes = _lognormal_sizes(rng, leaves, _scaled_count(elements, scale))
  # Per-leaf gradient scales spread over two decades, as between layers of a network.
  sigmas = 10.0 ** rng.uniform(-3.0, -1.0, sizes.size)
  leaves = tuple(_normal(rng, (int(n),), float(s), np_dtype) for n, s in zip(sizes, sigmas))
  return WorkloadInputs(leaves, 0.5 * _p_norm(leaves, norm_type), norm_type=norm_type)


def build_many_small(scale: float, dtype: str, seed: int) -> WorkloadInputs:
  """W4: 10,000 * scale leaves of 100 elements; threshold half the global L2 norm."""
  np_dtype = numpy_dtype(dtype)
  rng = np.random.default_rng(seed)
  count = _scaled_count(_SMALL_LEAVES, scale)
  sigmas = 10.0 ** rng.uniform(-3.0, -1.0, count)
  leaves = tuple(_normal(rng, (_SMALL_LEAF_SIZE,), float(s), np_dtype) for s in sigmas)
  return WorkloadInputs(leaves, 0.5 * _p_norm(leaves, 2.0))


def _relax_leaves(num_systems: int, dtype: str, seed: int,
                  atoms_range: tuple[int, int] = _ATOMS_RANGE
                  ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
  """Positions (n, 3) and cell (S, 3, 3) of ``num_systems`` systems of ``atoms_range`` atoms
  (inclusive; one number of atoms when both ends are equal), and their sorted segments."""
  np_dtype = numpy_dtype(dtype)
  rng = np.random.default_rng(seed)
  atoms = rng.integers(atoms_range[0], atoms_range[1] + 1, num_systems)
  atom_system = np.repeat(np.arange(num_systems, dtype=np.int64), atoms)
  # Update steps of a relaxation: about 0.05 A per coordinate, the size varying by system
  # (some systems are nearly converged), so per-system norms spread over two decades.
  system_sigma = 0.05 * 10.0 ** rng.uniform(-1.0, 1.0, num_systems)
  positions = _normal(rng, (int(atoms.sum()), 3), 1.0, np_dtype)
  positions = (positions.astype(np.float64) * system_sigma[atom_system, None]).astype(np_dtype)
  cell = _normal(rng, (num_systems, 3, 3), 1.0, np_dtype)
  cell = (cell.astype(np.float64) * (0.1 * system_sigma)[:, None, None]).astype(np_dtype)
  return (positions, cell), (atom_system, np.arange(num_systems, dtype=np.int64))


def _system_row_offsets(segment: np.ndarray, num_systems: int) -> np.ndarray:
  return np.searchsorted(segment, np.arange(num_systems))


def build_relax(scale: float, dtype: str, seed: int, *, num_systems: int,
                atoms_range: tuple[int, int] = _ATOMS_RANGE) -> WorkloadInputs:
  """W2/W3/W5: per-system global L2; threshold the median system norm."""
  systems = _scaled_count(num_systems, scale)
  (positions, cell), segments = _relax_leaves(systems, dtype, seed, atoms_range)
  pos_sq = np.sum(positions.astype(np.float64) ** 2, axis=1)
  cell_sq = np.sum(cell.astype(np.float64) ** 2, axis=(1, 2))
  norms = np.sqrt(np.bincount(segments[0], weights=pos_sq, minlength=systems) + cell_sq)
  return WorkloadInputs((positions, cell), float(np.median(norms)), segments, systems)


def build_relax_max_step(scale: float, dtype: str, seed: int, *, num_systems: int,
                         atoms_range: tuple[int, int] = _ATOMS_RANGE) -> WorkloadInputs:
  """Max-step on the W2/W3/W5 leaves; threshold the median system step norm."""
  systems = _scaled_count(num_systems, scale)
  (positions, cell), segments = _relax_leaves(systems, dtype, seed, atoms_range)
  pos_steps = np.sqrt(np.sum(positions.astype(np.float64) ** 2, axis=1))
  # Systems are sorted and contiguous with at least 2 atoms, so reduceat sees no empty slice.
  pos_max = np.maximum.reduceat(pos_steps, _system_row_offsets(segments[0], systems))
  cell_max = np.max(np.sqrt(np.sum(cell.astype(np.float64) ** 2, axis=2)), axis=1)
  steps = np.maximum(pos_max, cell_max)
  return WorkloadInputs((positions, cell), float(np.median(steps)), segments, systems)


def build_giant(scale: float, dtype: str, seed: int, *, step: bool) -> WorkloadInputs:
  """W6: one system of 4,000,000 * scale atoms (segments all zero, ``num_systems=1``);
  threshold half its norm, or half its step norm for max-step, so the system is clipped."""
  atoms = _scaled_count(_GIANT_ATOMS, scale)
  (positions, cell), segments = _relax_leaves(1, dtype, seed, (atoms, atoms))
  if step:
    size = max(float(np.max(np.sqrt(np.sum(x.astype(np.float64) ** 2, axis=-1))))
               for x in (positions, cell))
  else:
    size = _p_norm((positions, cell), 2.0)
  return WorkloadInputs((positions, cell), 0.5 * size, segments, 1)


def _mean_relax_elements(num_systems: int, atoms_range: tuple[int, int] = _ATOMS_RANGE) -> int:
  return num_systems * (3 * sum(atoms_range) // 2 + 9)


def _model(name: str, p: float, label: str) -> Workload:
  return Workload(
      name, "clip_grad_norm",
      f"global {label}: 200 leaves, log-normal sizes, 16M elements",
      functools.partial(build_model, norm_type=p), seed=1, norm_type=p,
      full_elements=_MODEL_ELEMENTS)


def _relax(name: str, op: str, systems: int, seed: int, what: str,
           atoms_range: tuple[int, int] = _ATOMS_RANGE, gpu_sized: bool = False) -> Workload:
  build = build_relax if op == "clip_by_global_norm" else build_relax_max_step
  low, high = atoms_range
  return Workload(
      name, op,
      f"{what}: {systems:,} systems of {low}-{high} atoms, positions (n,3) + cell (S,3,3)",
      functools.partial(build, num_systems=systems, atoms_range=atoms_range), seed=seed,
      per_system=True, full_elements=_mean_relax_elements(systems, atoms_range),
      gpu_sized=gpu_sized)


def _giant(name: str, op: str, what: str) -> Workload:
  return Workload(
      name, op, f"{what}: one system of {_GIANT_ATOMS:,} atoms, positions (n,3) + cell (1,3,3)",
      functools.partial(build_giant, step=op == "clip_by_max_step"), seed=6, per_system=True,
      full_elements=3 * _GIANT_ATOMS + 9)


WORKLOADS: tuple[Workload, ...] = (
    _model("W1-model", 2.0, "L2"),
    _model("W1-model-p1", 1.0, "p=1"),
    _model("W1-model-p3", 3.0, "p=3"),
    _model("W1-model-pinf", math.inf, "p=inf"),
    _relax("W2-relax", "clip_by_global_norm", _RELAX_SYSTEMS, 2, "per-system L2"),
    _relax("W3-relax-large", "clip_by_global_norm", _RELAX_LARGE_SYSTEMS, 3, "per-system L2"),
    Workload("W4-many-small", "clip_grad_norm", "global L2: 10,000 leaves of 100 elements",
             build_many_small, seed=4, full_elements=_SMALL_LEAVES * _SMALL_LEAF_SIZE),
    _relax("W2-relax-max-step", "clip_by_max_step", _RELAX_SYSTEMS, 2, "per-system max-step"),
    _relax("W3-relax-large-max-step", "clip_by_max_step", _RELAX_LARGE_SYSTEMS, 3,
           "per-system max-step"),
    _relax("W5-many-tiny", "clip_by_global_norm", _TINY_SYSTEMS, 5, "per-system L2",
           _TINY_ATOMS_RANGE),
    _relax("W5-many-tiny-max-step", "clip_by_max_step", _TINY_SYSTEMS, 5, "per-system max-step",
           _TINY_ATOMS_RANGE),
    _giant("W6-one-giant", "clip_by_global_norm", "per-system L2"),
    _giant("W6-one-giant-max-step", "clip_by_max_step", "per-system max-step"),
    Workload("W7-model-gpu", "clip_grad_norm",
             "global L2: 400 leaves, log-normal sizes, 1.5 billion elements (GPU-sized)",
             functools.partial(build_model, leaves=_GPU_MODEL_LEAVES,
                               elements=_GPU_MODEL_ELEMENTS), seed=7,
             full_elements=_GPU_MODEL_ELEMENTS, gpu_sized=True),
    _relax("W8-relax-gpu", "clip_by_global_norm", _GPU_RELAX_SYSTEMS, 8,
           "per-system L2 (GPU-sized)", _GPU_ATOMS_RANGE, gpu_sized=True),
    _relax("W8-relax-gpu-max-step", "clip_by_max_step", _GPU_RELAX_SYSTEMS, 8,
           "per-system max-step (GPU-sized)", _GPU_ATOMS_RANGE, gpu_sized=True),
)

NAMES: tuple[str, ...] = tuple(w.name for w in WORKLOADS)


def get(name: str) -> Workload:
  """The workload called ``name``.

  Raises:
    ValueError: no workload has that name.
  """
  for workload in WORKLOADS:
    if workload.name == name:
      return workload
  raise ValueError(f"workload: unknown workload {name!r}; known: {', '.join(NAMES)}")


def scale_for_elements(workload: Workload, elements: int) -> float:
  """The scale giving ``workload`` about ``elements`` leaf elements (for small fixed inputs)."""
  return min(1.0, elements / workload.full_elements)
