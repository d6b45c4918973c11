"""The registry of implementations: built-in ones, entry points, and any ``package.module:attr``.

An implementation is any object (a module, an instance) with a ``framework`` attribute
(``"numpy"``, ``"jax"``, ``"torch"`` or ``"tensorflow"``) and any subset of the canonical
functions ``clip_by_global_norm``, ``clip_by_max_step`` and ``clip_grad_norm``. It may also
declare ``capabilities`` (see :mod:`clipbench.protocol`), ``version`` and ``library``.
Nothing of clipbench needs importing to write one.

A missing library makes its implementations *unavailable* (with the reason), never a crash.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import traceback
from typing import Any, Callable, Iterable

from clipbench.protocol import FRAMEWORKS, OPS, Capabilities, as_capabilities

ENTRY_POINT_GROUP = "clipbench.impls"


@dataclasses.dataclass(frozen=True)
class Entry:
  """A registered implementation: where it lives and what it is."""

  name: str
  target: str  # "package.module:attr"
  library: str  # distribution whose version is reported
  kind: str  # "reference", "own", "library", "baseline" or "outside"
  description: str = ""


_A = "clipbench.impls.adapters."
_O = "clipbench.impls.own."

BUILTIN: tuple[Entry, ...] = (
    Entry("reference", "clipbench.reference:implementation", "clipbench", "reference",
          "exact rational/mpmath reference; it is the spec"),
    # Our own implementations (issue: fully conformant, batch-invariant, at the roofline).
    Entry("clipbench.jax", _O + "jax_kernels:implementation", "jax", "own",
          "jit-compiled JAX/XLA"),
    Entry("clipbench.numba", _O + "numba_kernels:implementation", "numba", "own",
          "compiled CPU kernel, parallel over systems"),
    Entry("clipbench.torch", _O + "torch_kernels:eager", "torch", "own", "torch eager"),
    Entry("clipbench.torch-compile", _O + "torch_kernels:compiled", "torch", "own",
          "torch.compile (inductor)"),
    Entry("clipbench.triton", _O + "triton_kernels:implementation", "triton", "own",
          "Triton kernels on torch tensors (CUDA; TRITON_INTERPRET=1 on CPU)"),
    # Thin adapters over the libraries' public APIs.
    Entry("optax.clip_by_global_norm", _A + "optax_adapter:clip_by_global_norm", "optax",
          "library", "optax.clip_by_global_norm(max_norm).update"),
    Entry("torch.clip_grad_norm_", _A + "torch_adapter:clip_grad_norm_", "torch", "library",
          "torch.nn.utils.clip_grad_norm_(foreach=False) on .grad of parameters"),
    Entry("torch.clip_grad_norm_.foreach", _A + "torch_adapter:clip_grad_norm_foreach", "torch",
          "library", "torch.nn.utils.clip_grad_norm_(foreach=True)"),
    Entry("torch.clip_grads_with_norm_", _A + "torch_adapter:clip_grads_with_norm_", "torch",
          "library", "torch.nn.utils.get_total_norm + clip_grads_with_norm_"),
    Entry("tensorflow.clip_by_global_norm", _A + "tensorflow_adapter:clip_by_global_norm",
          "tensorflow-cpu", "library", "tf.clip_by_global_norm"),
    Entry("kups.ClipByGlobalNorm", _A + "kups_adapter:clip_by_global_norm", "kups", "library",
          "kups.relaxation.transforms.ClipByGlobalNorm through kups' Index"),
    Entry("kups.MaxStepSize", _A + "kups_adapter:max_step_size", "kups", "library",
          "kups.relaxation.transforms.MaxStepSize through kups' Index"),
    Entry("brainstate.clip_grad_norm", _A + "brainstate_adapter:clip_grad_norm", "brainstate",
          "library", "brainstate.nn.clip_grad_norm(return_norm=True)"),
    Entry("jax_privacy.clip_pytree", _A + "jax_privacy_adapter:clip_pytree_nan_safe",
          "jax-privacy", "library", "jax_privacy.clipping.clip_pytree(nan_safe=True)"),
    Entry("jax_privacy.clip_pytree.nan_unsafe", _A + "jax_privacy_adapter:clip_pytree_nan_unsafe",
          "jax-privacy", "library", "jax_privacy.clipping.clip_pytree(nan_safe=False)"),
    Entry("declearn.L2GlobalClipping", _A + "declearn_adapter:l2_global_clipping_numpy",
          "declearn", "library", "declearn L2GlobalClipping on a NumpyVector"),
    Entry("declearn.L2GlobalClipping.torch", _A + "declearn_adapter:l2_global_clipping_torch",
          "declearn", "library", "declearn L2GlobalClipping on a TorchVector"),
    # Plain code a user would write first: the speed bar of issue 4 on W2/W3.
    Entry("baseline.jax-segment-sum", "clipbench.impls.baselines.jax_segment_sum", "jax",
          "baseline", "plain jax.ops.segment_sum / segment_max clipping under jax.jit"),
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
        "an outside one is named as package.module:attr")
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
