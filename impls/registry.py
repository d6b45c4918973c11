"""The registry of implementations: built-in ones, entry points, and any ``package.module:attr``.

An implementation is any object (a module, an instance) with a ``framework`` attribute
(``"numpy"``, ``"jax"``, ``"torch"`` or ``"tensorflow"``) and any subset of the canonical
functions ``clip_by_global_norm``, ``clip_by_max_step`` and ``clip_grad_norm``. It may also
declare ``capabilities`` (see :mod:`clipbench.protocol`), ``version`` and ``library``.
Nothing of clipbench needs importing to write one.

A missing library makes its implementations *unavailable* (with the reason), never a crash.

``BUILTIN`` is the one table of built-in implementations: each :class:`Entry` also carries
the static facts the benchmark grid is derived from. Adding a library takes an adapter
(``impls/adapters``), one entry here and its entries in ``conformance/deviations.toml``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import traceback
from typing import Any, Callable, Iterable

from clipbench.protocol import FRAMEWORKS, OPS, Capabilities, as_capabilities

ENTRY_POINT_GROUP = "clipbench.impls"


KINDS = ("reference", "own", "library", "baseline", "outside")
DEVICES = ("cpu", "cuda")
# The operation families of the benchmark grid an implementation can be timed on (the grid,
# ``clipbench.benchmarks.grid``, gives each its workloads).
FAMILIES = ("global", "pnorm", "per_system", "max_step")


@dataclasses.dataclass(frozen=True)
class Entry:
  """A registered implementation: where it lives, what it is, and where it is timed.

  The facts after ``description`` are static, known without importing the implementation
  (the benchmark grid is built from them in processes that load no framework); the
  benchmarks' tests hold them against what the loaded implementation declares.

  Attributes:
    name: the registered name.
    target: ``"package.module:attr"`` of the implementation object.
    library: the distribution whose version is reported.
    kind: one of ``KINDS``.
    description: one line for listings.
    framework: its ``framework`` attribute; empty where only loading tells (entry points).
    devices: the devices it runs on where the hardware exists (``"cuda"`` even here).
    families: the operation families it is timed on (names from ``FAMILIES``); none: never
      timed.
    slow: ``(workload, why)`` pairs of cases too slow to set up or call within an asv run's
      budget on a CPU; skipped with ``why`` unless asked for.
    tracked: in the default asv grid, the one sized for tracking commits (``benchmarks/grid.py``):
      our own implementations, and per framework and family the library or plain code users
      would pick instead. The others are timed by ``clipbench bench`` and ``clipbench report``,
      and by asv with ``CLIPBENCH_ASV_IMPLS``.
  """

  name: str
  target: str
  library: str
  kind: str
  description: str = ""
  framework: str = ""
  devices: tuple[str, ...] = ("cpu",)
  families: frozenset[str] = frozenset()
  slow: tuple[tuple[str, str], ...] = ()
  tracked: bool = False

  def __post_init__(self) -> None:
    if self.kind not in KINDS:
      raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r} ({self.name})")
    if self.framework and self.framework not in FRAMEWORKS:
      raise ValueError(
          f"framework: expected one of {FRAMEWORKS}, got {self.framework!r} ({self.name})")
    if not set(self.devices) <= set(DEVICES):
      raise ValueError(f"devices: expected a subset of {DEVICES}, got {self.devices!r} "
                       f"({self.name})")
    if not set(self.families) <= set(FAMILIES):
      raise ValueError(f"families: expected a subset of {FAMILIES}, got "
                       f"{sorted(self.families)!r} ({self.name})")
    if self.tracked and not self.families:
      raise ValueError(f"tracked: an entry timed on no family has no point in the asv grid "
                       f"({self.name})")

  @property
  def slow_workloads(self) -> frozenset[str]:
    return frozenset(workload for workload, _ in self.slow)


_ALL = frozenset(FAMILIES)
_GLOBAL = frozenset({"global"})
_GLOBAL_AND_P = frozenset({"global", "pnorm"})
_PER_SYSTEM = frozenset({"per_system", "max_step"})
_CPU = ("cpu",)
_CPU_CUDA = ("cpu", "cuda")

# First calls of more than ~10 s in every process on a CPU (a 2-core machine, jax 0.12).
_SLOW_JAX_GRAPH = tuple(
    (w, "the exact XLA graph compiles for about a minute per 200 leaves (W1), far longer for "
     "W4's 10,000") for w in ("W1-model", "W1-model-p1", "W1-model-p3", "W1-model-pinf",
                              "W4-many-small"))
_SLOW_KUPS_W4 = (("W4-many-small", "its eager call takes 17 s on W4's 10,000 leaves (jitted, "
                  "XLA does not compile them within 8 minutes)"),)
_SLOW_PER_EXAMPLE = tuple(
    (w, "the adapter makes one call per system (a batch of one example each), 2,000 on W2, "
     "20,000 on W3 and 100,000 on W5") for w in ("W2-relax", "W3-relax-large", "W5-many-tiny"))
_SLOW_TORCH_SIM = (
    ("W5-many-tiny", "a call takes about 2 s on W5's 100,000 systems"),
    ("W6-one-giant", "a call takes about 8 s on W6's 4M atoms"))
_SLOW_KERAS_W4 = (("W4-many-small", "each call builds an optimizer over 10,000 variables: about 9 s "
                   "a call here"),)
_SLOW_BRAINSTATE_W4 = (("W4-many-small", "its first call compiles for 16 s on W4's 10,000 "
                        "leaves"),)


def _own(name: str, target: str, library: str, framework: str, description: str, *,
         devices: tuple[str, ...] = _CPU_CUDA, slow: tuple[tuple[str, str], ...] = ()) -> Entry:
  """One of our implementations: timed on every family, tracked by asv."""
  return Entry(name, target, library, "own", description, framework=framework,
               devices=devices, families=_ALL, slow=slow, tracked=True)


def _adapter(name: str, target: str, library: str, framework: str, description: str, *,
             families: frozenset[str] = _GLOBAL, devices: tuple[str, ...] = _CPU,
             slow: tuple[tuple[str, str], ...] = (), tracked: bool = False) -> Entry:
  """A thin adapter over a library's public API; ``target`` within ``impls/adapters``."""
  return Entry(name, "clipbench.impls.adapters." + target, library, "library", description,
               framework=framework, devices=devices, families=families, slow=slow,
               tracked=tracked)


BUILTIN: tuple[Entry, ...] = (
    Entry("reference", "clipbench.reference:implementation", "clipbench", "reference",
          "exact rational/mpmath reference; it is the spec", framework="numpy"),
    # Our own implementations (issue: fully conformant, batch-invariant, at the roofline).
    _own("clipbench.jax", "clipbench.impls.own.jax:implementation", "jax", "jax",
         "JAX: the numba kernels through XLA FFI on the CPU, inside jax.jit", devices=_CPU),
    _own("clipbench.jax-xla", "clipbench.impls.own.jax:xla_graph", "jax", "jax",
         "JAX: the exact XLA graph (the route of other backends), on the CPU", devices=_CPU,
         slow=_SLOW_JAX_GRAPH),
    _own("clipbench.numba", "clipbench.impls.own.numba:implementation", "numba",
         "numpy", "compiled CPU kernel, parallel over systems", devices=_CPU),
    _own("clipbench.torch", "clipbench.impls.own.torch:eager", "torch", "torch",
         "torch eager"),
    _own("clipbench.torch-compile", "clipbench.impls.own.torch:compiled", "torch",
         "torch", "torch.compile (inductor)"),
    # Timed on CUDA only: its CPU mode is Triton's interpreter, for tests.
    _own("clipbench.triton", "clipbench.impls.own.triton:implementation", "triton",
         "torch", "Triton kernels on torch tensors (CUDA; TRITON_INTERPRET=1 on CPU)",
         devices=("cuda",)),
    # Thin adapters over the libraries' public APIs.
    _adapter("optax.clip_by_global_norm", "optax_adapter:clip_by_global_norm", "optax", "jax",
             "optax.clip_by_global_norm(max_norm).update", tracked=True),
    _adapter("torch.clip_grad_norm_", "torch_adapter:clip_grad_norm_", "torch", "torch",
             "torch.nn.utils.clip_grad_norm_(foreach=False) on .grad of parameters",
             families=_GLOBAL_AND_P, devices=_CPU_CUDA),
    _adapter("torch.clip_grad_norm_.foreach", "torch_adapter:clip_grad_norm_foreach", "torch",
             "torch", "torch.nn.utils.clip_grad_norm_(foreach=True)", families=_GLOBAL_AND_P,
             devices=_CPU_CUDA, tracked=True),
    _adapter("torch.clip_grads_with_norm_", "torch_adapter:clip_grads_with_norm_", "torch",
             "torch", "torch.nn.utils.get_total_norm + clip_grads_with_norm_",
             families=_GLOBAL_AND_P, devices=_CPU_CUDA),
    _adapter("tensorflow.clip_by_global_norm", "tensorflow_adapter:clip_by_global_norm",
             "tensorflow-cpu", "tensorflow", "tf.clip_by_global_norm"),
    _adapter("kups.ClipByGlobalNorm", "kups_adapter:clip_by_global_norm", "kups", "jax",
             "kups.relaxation.transforms.ClipByGlobalNorm through kups' Index",
             families=frozenset({"global", "per_system"}), slow=_SLOW_KUPS_W4, tracked=True),
    _adapter("kups.MaxStepSize", "kups_adapter:max_step_size", "kups", "jax",
             "kups.relaxation.transforms.MaxStepSize through kups' Index",
             families=frozenset({"max_step"}), tracked=True),
    _adapter("brainstate.clip_grad_norm", "brainstate_adapter:clip_grad_norm", "brainstate",
             "jax", "brainstate.nn.clip_grad_norm(return_norm=True)", families=_GLOBAL_AND_P,
             slow=_SLOW_BRAINSTATE_W4),
    _adapter("jax_privacy.clip_pytree", "jax_privacy_adapter:clip_pytree_nan_safe",
             "jax-privacy", "jax", "jax_privacy.clipping.clip_pytree(nan_safe=True)"),
    _adapter("jax_privacy.clip_pytree.nan_unsafe", "jax_privacy_adapter:clip_pytree_nan_unsafe",
             "jax-privacy", "jax", "jax_privacy.clipping.clip_pytree(nan_safe=False)"),
    _adapter("declearn.L2GlobalClipping", "declearn_adapter:l2_global_clipping_numpy",
             "declearn", "numpy", "declearn L2GlobalClipping on a NumpyVector"),
    _adapter("declearn.L2GlobalClipping.torch", "declearn_adapter:l2_global_clipping_torch",
             "declearn", "torch", "declearn L2GlobalClipping on a TorchVector"),
    _adapter("keras.SGD.global_clipnorm.tensorflow", "keras_adapter:global_clipnorm_tensorflow",
             "keras", "tensorflow", "keras SGD(global_clipnorm=c).apply_gradients, tensorflow backend",
             slow=_SLOW_KERAS_W4),
    _adapter("keras.SGD.global_clipnorm.jax", "keras_adapter:global_clipnorm_jax", "keras", "jax",
             "keras SGD(global_clipnorm=c).apply_gradients, jax backend (KERAS_BACKEND=jax)",
             slow=_SLOW_KERAS_W4),
    _adapter("keras.SGD.global_clipnorm.torch", "keras_adapter:global_clipnorm_torch", "keras",
             "torch", "keras SGD(global_clipnorm=c).apply_gradients, torch backend "
             "(KERAS_BACKEND=torch)", slow=_SLOW_KERAS_W4),
    _adapter("mlx.clip_grad_norm", "mlx_adapter:clip_grad_norm", "mlx", "numpy",
             "mlx.optimizers.clip_grad_norm on MLX's CPU device"),
    _adapter("deepspeed.clip_grad_norm_", "deepspeed_adapter:clip_grad_norm_", "deepspeed",
             "torch", "deepspeed.runtime.utils.clip_grad_norm_ on .grad, one gloo process",
             families=_GLOBAL_AND_P),
    _adapter("deepspeed.clip_tensors_by_global_norm",
             "deepspeed_adapter:clip_tensors_by_global_norm", "deepspeed", "torch",
             "deepspeed.runtime.utils.clip_tensors_by_global_norm (L2, in place)"),
    _adapter("optax.per_example_global_norm_clip",
             "optax_per_example_adapter:per_example_global_norm_clip", "optax", "jax",
             "optax.per_example_global_norm_clip per system, a batch of one example",
             families=frozenset({"global", "per_system"}), slow=_SLOW_PER_EXAMPLE),
    # Atomistic optimizers' step caps: ASE takes one system (Atoms) per call, float64 only.
    _adapter("ase.BFGS.maxstep", "ase_adapter:bfgs_max_step", "ase", "numpy",
             "ase.optimize.BFGS(atoms, maxstep).determine_step on one Atoms (float64)",
             families=frozenset()),
    _adapter("ase.LBFGS.maxstep", "ase_adapter:lbfgs_max_step", "ase", "numpy",
             "ase.optimize.LBFGS(atoms, maxstep).determine_step on one Atoms (float64)",
             families=frozenset()),
    _adapter("ase.FIRE.maxstep", "ase_adapter:fire_max_step", "ase", "numpy",
             "ase.optimize.FIRE(atoms, dt=1, maxstep).step(): whole-step L2 cap, one Atoms"),
    _adapter("torch_sim.fire_step.ase_fire", "torch_sim_adapter:ase_fire", "torch-sim-atomistic",
             "torch", "torch_sim fire_step(fire_flavor='ase_fire') per system on a SimState",
             families=frozenset({"global", "per_system"}), slow=_SLOW_TORCH_SIM),
    # Plain code a user would write first: the speed bar of issue 4 on W2/W3, timed on those
    # only (it also clips globally, but jitted over W4's 10,000 leaves it compiles for minutes).
    Entry("baseline.jax-segment-sum", "clipbench.impls.baselines.jax_segment_sum", "jax",
          "baseline", "plain jax.ops.segment_sum / segment_max clipping under jax.jit",
          framework="jax", families=_PER_SYSTEM, tracked=True),
    # Its torch twin, eager: the bar of the own torch kernels on W2/W3 and max-step (issue 17).
    Entry("baseline.torch-index-add", "clipbench.impls.baselines.torch_index_add", "torch",
          "baseline", "plain torch index_add_ / scatter_reduce_ clipping, eager",
          framework="torch", devices=_CPU_CUDA, families=_PER_SYSTEM, tracked=True),
)


@dataclasses.dataclass
class Implementation:
  """A loaded (or unavailable) implementation with its declared capabilities."""

  name: str
  target: str
  kind: str
  library: str
  description: str = ""
  available: bool = False
  reason: str = ""  # why it is unavailable
  obj: Any = None
  framework: str = ""
  version: str = ""
  capabilities: Capabilities = dataclasses.field(default_factory=Capabilities)

  @property
  def ops(self) -> tuple[str, ...]:
    if not self.available:
      return ()
    return tuple(op for op in OPS if callable(getattr(self.obj, op, None)))

  def function(self, op: str) -> Callable[..., Any]:
    if op not in self.ops:
      raise ValueError(f"op: implementation {self.name!r} does not provide {op!r}")
    return getattr(self.obj, op)


def _distribution_version(library: str) -> str:
  try:
    return importlib.metadata.version(library)
  except importlib.metadata.PackageNotFoundError:
    return ""


def resolve_target(target: str) -> Any:
  """Imports ``package.module:attr`` (or a bare module path) and returns the object."""
  if not isinstance(target, str) or not target:
    raise ValueError(f"impl: expected a name or 'package.module:attr', got {target!r}")
  module_name, _, attr = target.partition(":")
  module = importlib.import_module(module_name)
  obj = module
  for part in filter(None, attr.split(".")):
    obj = getattr(obj, part)
  return obj


def _check_protocol(obj: Any, label: str) -> None:
  framework = getattr(obj, "framework", None)
  if framework not in FRAMEWORKS:
    raise ValueError(
        f"impl {label}: 'framework' attribute must be one of {FRAMEWORKS}, got {framework!r}")
  if not any(callable(getattr(obj, op, None)) for op in OPS):
    raise ValueError(f"impl {label}: provides none of {OPS}")


def load_entry(entry: Entry) -> Implementation:
  impl = Implementation(name=entry.name, target=entry.target, kind=entry.kind,
                        library=entry.library, description=entry.description)
  try:
    obj = resolve_target(entry.target)
  except ModuleNotFoundError as e:
    impl.reason = f"not installed: {e.name}" if e.name else str(e)
    return impl
  except Exception as e:  # pylint: disable=broad-except
    # A library that fails to import is reported, not fatal: the rest of the suite still runs.
    impl.reason = f"import failed: {type(e).__name__}: {e}"
    impl.reason += " | " + traceback.format_exc(limit=1).strip().splitlines()[-1]
    return impl
  available = getattr(obj, "available", True)
  if available is not True:
    impl.reason = str(getattr(obj, "unavailable_reason", "") or available or "unavailable")
    return impl
  _check_protocol(obj, entry.name)
  impl.obj = obj
  impl.available = True
  impl.framework = obj.framework
  impl.capabilities = as_capabilities(getattr(obj, "capabilities", None))
  impl.version = str(getattr(obj, "version", "") or _distribution_version(entry.library))
  impl.description = getattr(obj, "description", "") or entry.description
  return impl


def entry_point_entries() -> list[Entry]:
  entries = []
  for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
    dist = ep.dist.name if ep.dist is not None else ep.value.split(".")[0]
    entries.append(Entry(ep.name, ep.value, dist, "outside", f"entry point of {dist}"))
  return entries


def all_entries() -> list[Entry]:
  return list(BUILTIN) + entry_point_entries()


def names() -> list[str]:
  return [e.name for e in all_entries()]


def kind_of(name: str) -> str:
  """The kind of the registered implementation ``name`` (``"outside"`` if unregistered)."""
  return next((e.kind for e in all_entries() if e.name == name), "outside")


def framework_of(name: str) -> str:
  """The framework of the registered implementation ``name`` (``""`` if unregistered)."""
  return next((e.framework for e in all_entries() if e.name == name), "")


def load(spec: str) -> Implementation:
  """Loads an implementation by registered name or by ``package.module:attr``.

  Raises:
    ValueError: ``spec`` is neither a registered name nor an importable target.
  """
  for entry in all_entries():
    if entry.name == spec:
      return load_entry(entry)
  if ":" not in spec and "." not in spec:
    raise ValueError(
        f"impl: unknown implementation {spec!r}; registered: {', '.join(names())}; "
        "an outside one is named as package.module:attr (a module that is the "
        f"implementation itself: {spec}:)")
  module_name = spec.partition(":")[0]
  try:
    obj = resolve_target(spec)
  except ModuleNotFoundError as e:
    raise ValueError(f"impl: cannot import {module_name!r} for {spec!r}: {e}") from e
  except AttributeError as e:
    raise ValueError(f"impl: {spec!r}: {e}") from e
  _check_protocol(obj, spec)
  library = getattr(obj, "library", "") or module_name.split(".")[0]
  impl = Implementation(name=getattr(obj, "name", "") or spec, target=spec, kind="outside",
                        library=library, available=True, obj=obj, framework=obj.framework)
  impl.capabilities = as_capabilities(getattr(obj, "capabilities", None))
  impl.version = str(getattr(obj, "version", "") or _distribution_version(library))
  impl.description = getattr(obj, "description", "") or ""
  return impl


def load_many(specs: Iterable[str] | None = None) -> list[Implementation]:
  """Loads the named implementations, or every registered one when ``specs`` is None."""
  if specs is None:
    return [load_entry(e) for e in all_entries()]
  return [load(s) for s in specs]
