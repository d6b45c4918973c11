"""The benchmark grids: which implementation runs which operation family, on which device.

asv imports the benchmark module to discover the grids, and forks one process per benchmark
method and parameter combination from a server that imported it (``forkserver``), so the grids
must be known without importing any framework. They are derived from the registry's static
facts (``registry.Entry``: framework, devices, the operation families an implementation is
timed on, its slow cases, whether asv tracks it by default); this module adds each family's
workloads. ``benchmarks/tests`` checks those facts against what every
loaded implementation declares.

asv's grid is the tracked entries by default (``registry.Entry.tracked``: sized for tracking
commits in a CI job); ``CLIPBENCH_ASV_IMPLS`` widens or narrows it. ``clipbench bench`` and the
GPU check time every timed entry (``timed_entries``), whatever asv's grid is.

A family is a set of workloads run by the same implementations:

* ``global``: global L2 norm (W1-model, W4-many-small; on CUDA also W7-model-gpu);
* ``pnorm``: global p-norm with p = 1, 3, inf (W1-model-p1, -p3, -pinf), for implementations
  accepting any p;
* ``per_system``: per-system L2 norm with segments (W2-relax, W3-relax-large, W5-many-tiny,
  W6-one-giant; on CUDA also W8-relax-gpu);
* ``max_step``: per-system max-step (W2-relax-max-step, W3-relax-large-max-step,
  W5-many-tiny-max-step, W6-one-giant-max-step; on CUDA also W8-relax-gpu-max-step).

Nothing here imports numpy or a framework: the module is data and string parsing.
"""

from __future__ import annotations

import dataclasses
import os

from clipbench.impls import registry

DTYPES_ENV = "CLIPBENCH_ASV_DTYPES"
SLOW_ENV = "CLIPBENCH_ASV_SLOW"
IMPLS_ENV = "CLIPBENCH_ASV_IMPLS"

ALL_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float64")
# float32 only unless CLIPBENCH_ASV_DTYPES says otherwise: each dtype adds as many processes
# to an asv run again (README, Benchmarks).
DEFAULT_DTYPES: tuple[str, ...] = ("float32",)
DEVICES: tuple[str, ...] = registry.DEVICES


@dataclasses.dataclass(frozen=True)
class Family:
  """One operation family: a name, its workloads and one line for docs.

  ``gpu_workloads`` are sized for a GPU (``workloads.Workload.gpu_sized``): timed on CUDA only.
  """

  name: str
  workloads: tuple[str, ...]
  description: str
  gpu_workloads: tuple[str, ...] = ()

  def workloads_on(self, device: str) -> tuple[str, ...]:
    """The workloads timed on ``device``."""
    return self.workloads + (self.gpu_workloads if device == "cuda" else ())


FAMILIES: tuple[Family, ...] = (
    Family("global", ("W1-model", "W4-many-small"), "global L2 norm", ("W7-model-gpu",)),
    Family("pnorm", ("W1-model-p1", "W1-model-p3", "W1-model-pinf"), "global p-norm, p != 2"),
    Family("per_system", ("W2-relax", "W3-relax-large", "W5-many-tiny", "W6-one-giant"),
           "per-system L2 norm (segments)", ("W8-relax-gpu",)),
    Family("max_step", ("W2-relax-max-step", "W3-relax-large-max-step", "W5-many-tiny-max-step",
                        "W6-one-giant-max-step"), "per-system max-step",
           ("W8-relax-gpu-max-step",)),
)
FAMILY_NAMES: tuple[str, ...] = tuple(f.name for f in FAMILIES)

_FAMILY_OF = {w: f.name for f in FAMILIES for w in f.workloads + f.gpu_workloads}


def family(name: str) -> Family:
  for f in FAMILIES:
    if f.name == name:
      return f
  raise ValueError(f"family: expected one of {FAMILY_NAMES}, got {name!r}")


def timed_entries() -> list[registry.Entry]:
  """The built-in implementations that are timed (those naming a family), in registry order."""
  return [e for e in registry.BUILTIN if e.families]


def timed_impl_names() -> tuple[str, ...]:
  """Names of ``timed_entries()``: what ``clipbench bench`` times by default."""
  return tuple(e.name for e in timed_entries())


def entry(impl: str) -> registry.Entry | None:
  """The registry entry of a timed ``impl``, or None for one outside the grid."""
  return next((e for e in timed_entries() if e.name == impl), None)


def family_of(workload: str) -> str | None:
  return _FAMILY_OF.get(workload)


def impls_for(family_name: str, device: str) -> list[str]:
  """Implementations providing ``family_name`` on ``device``, in registry order."""
  family(family_name)  # validates the name
  return [e.name for e in timed_entries()
          if family_name in e.families and device in e.devices]


def tracked_impl_names() -> tuple[str, ...]:
  """The implementations of asv's default grid: the timed entries marked ``tracked``."""
  return tuple(e.name for e in timed_entries() if e.tracked)


def asv_impls() -> tuple[str, ...]:
  """The implementations of this asv run: ``CLIPBENCH_ASV_IMPLS`` (comma separated), else the
  tracked ones; ``CLIPBENCH_ASV_IMPLS=all`` is every timed implementation (the whole field)."""
  text = os.environ.get(IMPLS_ENV, "").strip()
  if not text:
    return tracked_impl_names()
  timed = timed_impl_names()
  if text == "all":
    return timed
  chosen = {name.strip() for name in text.split(",") if name.strip()}
  unknown = sorted(chosen - set(timed))
  if unknown or not chosen:
    raise ValueError(f"{IMPLS_ENV}: expected 'all' or a comma-separated list of timed "
                     f"implementations ({', '.join(timed)}), got {text!r}"
                     + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
  return tuple(name for name in timed if name in chosen)  # registry order, no duplicates


_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0", "")


def _env_flag(name: str) -> bool:
  text = os.environ.get(name, "").strip().lower()
  if text in _TRUE:
    return True
  if text in _FALSE:
    return False
  raise ValueError(f"{name}: expected a boolean (1/0, true/false, yes/no), got {text!r}")


def dtypes() -> tuple[str, ...]:
  """The dtypes of this run: ``CLIPBENCH_ASV_DTYPES`` (comma separated), else float32.

  ``CLIPBENCH_ASV_DTYPES=all`` is every dtype (float32, bfloat16, float64).
  """
  text = os.environ.get(DTYPES_ENV, "").strip()
  if not text:
    return DEFAULT_DTYPES
  if text == "all":
    return ALL_DTYPES
  chosen = tuple(d.strip() for d in text.split(",") if d.strip())
  unknown = [d for d in chosen if d not in ALL_DTYPES]
  if unknown or not chosen:
    raise ValueError(f"{DTYPES_ENV}: expected 'all' or a comma-separated subset of "
                     f"{ALL_DTYPES}, got {text!r}")
  return tuple(d for d in ALL_DTYPES if d in chosen)  # canonical order, no duplicates


def run_slow() -> bool:
  """Whether the cases the registry marks slow run too (``CLIPBENCH_ASV_SLOW=1``)."""
  return _env_flag(SLOW_ENV)


def jax_x64_from_env() -> bool:
  """JAX's x64 flag as a fresh process gets it: from ``JAX_ENABLE_X64`` (jax's own parsing)."""
  text = os.environ.get("JAX_ENABLE_X64", "0").strip().lower()
  return text in _TRUE


def params(family_name: str, device: str) -> list[list[str]]:
  """asv ``params`` of one family on one device: impl x workload x dtype x (device,), over this
  run's implementations (``asv_impls``); no implementation: an empty first axis."""
  chosen = asv_impls()
  return [[name for name in impls_for(family_name, device) if name in chosen],
          list(family(family_name).workloads_on(device)), list(dtypes()), [device]]


def static_skip_reason(impl: str, workload: str, dtype: str, device: str) -> str | None:
  """Why a grid point cannot run, decided from the registry's facts alone (no import), or None.

  Covers the declared limits (device, family), JAX float64 without x64 (JAX turns float64
  into float32 then, and its implementations do not declare it) and the slow cases. The
  CUDA hardware check is ``timing.early_skip_reason``; everything else needs the loaded
  implementation (``timing.skip_reason``).
  """
  e = entry(impl)
  if e is None:
    return None  # an implementation outside the grid: only the loaded one can tell
  fam = family_of(workload)
  if fam is not None and fam not in e.families:
    return f"{impl} does not provide the {fam} family"
  if device not in e.devices:
    return f"{impl} does not run on {device}"
  if e.framework == "jax" and dtype == "float64" and not jax_x64_from_env():
    return "JAX implementations take float64 only with JAX_ENABLE_X64=1"
  for slow_workload, why in e.slow:
    if slow_workload == workload and not run_slow():
      return (f"{impl} on {workload} is beyond the asv run's time budget on a CPU: {why}; "
              f"{SLOW_ENV}=1 runs it")
  return None
