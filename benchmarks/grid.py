"""The asv grids: which implementation runs which operation family, on which device.

asv starts one fresh process per benchmark method and parameter combination (``spawn``) and
re-imports the benchmark module in each, so the grids must be known without importing any
framework. They are built from the static table ``IMPLS`` below: for every timed built-in
implementation, its framework, the operation families it provides (those whose every workload
``cases.skip_reason`` lets it run), the devices it can run on (on some machine: ``"cuda"`` even
where this machine has no GPU) and its cases too slow for the asv run's budget.
``benchmarks/tests/test_benchmarks_smoke.py`` loads every registered implementation and checks
this table against its declared operations and capabilities, so the table cannot drift from
the code.

A family is a set of workloads run by the same implementations:

* ``global``: global L2 norm (W1-model, W4-many-small);
* ``pnorm``: global p-norm with p = 1, 3, inf (W1-model-p1, -p3, -pinf), for implementations
  accepting any p;
* ``per_system``: per-system L2 norm with segments (W2-relax, W3-relax-large);
* ``max_step``: per-system max-step (W2-relax-max-step, W3-relax-large-max-step).

Nothing here imports numpy or a framework: the module is pure data and string parsing.
"""

from __future__ import annotations

import dataclasses
import os

DTYPES_ENV = "CLIPBENCH_ASV_DTYPES"
SLOW_ENV = "CLIPBENCH_ASV_SLOW"

ALL_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float64")
# float32 only unless CLIPBENCH_ASV_DTYPES says otherwise: see bench_clipping's docstring for
# the time budget that forces it.
DEFAULT_DTYPES: tuple[str, ...] = ("float32",)
DEVICES: tuple[str, ...] = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class Family:
  """One operation family: a name, its workloads and one line for docs."""

  name: str
  workloads: tuple[str, ...]
  description: str


FAMILIES: tuple[Family, ...] = (
    Family("global", ("W1-model", "W4-many-small"), "global L2 norm"),
    Family("pnorm", ("W1-model-p1", "W1-model-p3", "W1-model-pinf"), "global p-norm, p != 2"),
    Family("per_system", ("W2-relax", "W3-relax-large"), "per-system L2 norm (segments)"),
    Family("max_step", ("W2-relax-max-step", "W3-relax-large-max-step"), "per-system max-step"),
)
FAMILY_NAMES: tuple[str, ...] = tuple(f.name for f in FAMILIES)

ALL_FAMILIES = frozenset(FAMILY_NAMES)
_GLOBAL_AND_P = frozenset({"global", "pnorm"})
_GLOBAL = frozenset({"global"})


@dataclasses.dataclass(frozen=True)
class ImplGrid:
  """What the grids need to know about one implementation, without importing it.

  Attributes:
    name: registered name.
    framework: its ``framework`` attribute (``"jax"`` turns on JAX's compilation cache and the
      float64-needs-x64 skip).
    families: the operation families it provides (names from ``FAMILY_NAMES``).
    devices: the devices it runs on where the hardware exists.
    slow: ``(workload, why)`` pairs of cases too slow to set up or call for the asv run's
      budget; skipped, with ``why``, unless ``CLIPBENCH_ASV_SLOW=1``.
  """

  name: str
  framework: str
  families: frozenset[str]
  devices: tuple[str, ...]
  slow: tuple[tuple[str, str], ...] = ()

  @property
  def slow_workloads(self) -> frozenset[str]:
    return frozenset(w for w, _ in self.slow)


_CPU = ("cpu",)
_CPU_CUDA = ("cpu", "cuda")
_CUDA = ("cuda",)

# Cases whose first call alone takes more than ~10 s in every process on a CPU (measured on a
# 2-core machine, jax 0.12); asv would spend minutes on each of them.
_SLOW_OWN_JAX = tuple(
    (w, "our exact JAX kernel compiles for about a minute per 200 leaves (W1), far longer for "
     "W4's 10,000") for w in ("W1-model", "W1-model-p1", "W1-model-p3", "W1-model-pinf",
                              "W4-many-small"))
_SLOW_KUPS_W4 = (("W4-many-small", "its eager call takes 17 s on W4's 10,000 leaves (jitted, "
                  "XLA does not compile them within 8 minutes)"),)
_SLOW_BRAINSTATE_W4 = (("W4-many-small", "its first call compiles for 16 s on W4's 10,000 "
                        "leaves"),)

IMPLS: tuple[ImplGrid, ...] = (
    ImplGrid("clipbench.jax", "jax", ALL_FAMILIES, _CPU, _SLOW_OWN_JAX),
    ImplGrid("clipbench.numba", "numpy", ALL_FAMILIES, _CPU),
    ImplGrid("clipbench.torch", "torch", ALL_FAMILIES, _CPU_CUDA),
    ImplGrid("clipbench.torch-compile", "torch", ALL_FAMILIES, _CPU_CUDA),
    ImplGrid("clipbench.triton", "torch", ALL_FAMILIES, _CUDA),
    ImplGrid("optax.clip_by_global_norm", "jax", _GLOBAL, _CPU),
    ImplGrid("torch.clip_grad_norm_", "torch", _GLOBAL_AND_P, _CPU_CUDA),
    ImplGrid("torch.clip_grad_norm_.foreach", "torch", _GLOBAL_AND_P, _CPU_CUDA),
    ImplGrid("torch.clip_grads_with_norm_", "torch", _GLOBAL_AND_P, _CPU_CUDA),
    ImplGrid("tensorflow.clip_by_global_norm", "tensorflow", _GLOBAL, _CPU),
    ImplGrid("kups.ClipByGlobalNorm", "jax", frozenset({"global", "per_system"}), _CPU,
             _SLOW_KUPS_W4),
    ImplGrid("kups.MaxStepSize", "jax", frozenset({"max_step"}), _CPU),
    ImplGrid("brainstate.clip_grad_norm", "jax", _GLOBAL_AND_P, _CPU, _SLOW_BRAINSTATE_W4),
    ImplGrid("jax_privacy.clip_pytree", "jax", _GLOBAL, _CPU),
    ImplGrid("jax_privacy.clip_pytree.nan_unsafe", "jax", _GLOBAL, _CPU),
    ImplGrid("declearn.L2GlobalClipping", "numpy", _GLOBAL, _CPU),
    ImplGrid("declearn.L2GlobalClipping.torch", "torch", _GLOBAL, _CPU),
    # The bar of the per-system workloads only, though it also clips globally (jitted over
    # W4's 10,000 leaves it would compile for minutes). This table is where that is decided.
    ImplGrid("baseline.jax-segment-sum", "jax", frozenset({"per_system", "max_step"}), _CPU),
)

_BY_NAME = {entry.name: entry for entry in IMPLS}
_FAMILY_OF = {w: f.name for f in FAMILIES for w in f.workloads}

_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0", "")


def family(name: str) -> Family:
  for f in FAMILIES:
    if f.name == name:
      return f
  raise ValueError(f"family: expected one of {FAMILY_NAMES}, got {name!r}")


def entry(impl: str) -> ImplGrid | None:
  """The table entry of ``impl``, or None for an implementation outside the table."""
  return _BY_NAME.get(impl)


def family_of(workload: str) -> str | None:
  return _FAMILY_OF.get(workload)


def impls_for(family_name: str, device: str) -> list[str]:
  """Implementations providing ``family_name`` on ``device``, in table order."""
  family(family_name)  # validates the name
  return [e.name for e in IMPLS if family_name in e.families and device in e.devices]


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
  """Whether the cases the table marks slow run too (``CLIPBENCH_ASV_SLOW=1``)."""
  return _env_flag(SLOW_ENV)


def jax_x64_from_env() -> bool:
  """JAX's x64 flag as a fresh process gets it: from ``JAX_ENABLE_X64`` (jax's own parsing)."""
  text = os.environ.get("JAX_ENABLE_X64", "0").strip().lower()
  return text in _TRUE


def params(family_name: str, device: str) -> list[list[str]]:
  """asv ``params`` of one family on one device: impl x workload x dtype x (device,)."""
  return [impls_for(family_name, device), list(family(family_name).workloads), list(dtypes()),
          [device]]


def static_skip_reason(impl: str, workload: str, dtype: str, device: str) -> str | None:
  """Why a grid point cannot run, decided from the table alone (no import), or None.

  Covers the table's own limits (device, family), JAX float64 without x64 (JAX turns float64
  into float32 then, and its implementations do not declare it) and the slow cases. The
  CUDA hardware check is ``cases.early_skip_reason``; everything else needs the loaded
  implementation (``cases.skip_reason``).
  """
  e = entry(impl)
  if e is None:
    return None  # an implementation outside the table: only the loaded one can tell
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


def grid_size(family_name: str, device: str) -> int:
  """Number of parameter combinations (processes per metric) of one family on one device."""
  return (len(impls_for(family_name, device)) * len(family(family_name).workloads)
          * len(dtypes()))
