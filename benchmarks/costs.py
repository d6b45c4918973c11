"""What one call costs a GPU, counted on any machine: operators, Triton launches, host transfers.

  python -m clipbench.benchmarks.costs [--impl NAME ...] [--workload NAME ...]
                                       [--dtype float32 ...] [--scale 1.0] [--output costs.csv]

On a GPU, at the sizes people clip, a call's time is its launches and its host round trips,
not its bytes. Both are exact counts, the same on a machine without a GPU, so CI holds them to
budgets (``benchmarks/tests/test_costs.py``, the budgets in :data:`BUDGETS`) where no timing
could be trusted. Counted per call, after one untimed warm-up call:

* ``operators``: aten operators dispatched (each a kernel launch on CUDA), as
  ``TorchDispatchMode`` sees them, except those that launch no work: views (``is_view``
  overloads) and the metadata-only operators of :data:`NO_WORK`. Operators dispatched while a
  Triton kernel runs (its interpreter's own, under ``TRITON_INTERPRET=1``) are not counted,
  nor the host's work on copies it read (``branches.on_host_copies``: a near-tie's exact sums);
* ``views``: the views and metadata operators left out above;
* ``launches``: Triton kernel launches (``kernel[grid](...)``);
* ``transfers``: reads of device values on the host, each a device synchronization on CUDA:
  ``aten._local_scalar_dense`` (``.item()``, ``bool()``, ``int()``, ``float()`` of a tensor),
  the operators whose output shape depends on the values (:data:`VALUE_SHAPED`), and the
  Python calls ``Tensor.cpu()``, ``.tolist()`` and ``.numpy()``. A ``.numpy()`` or
  ``.tolist()`` of the tensor that a ``.cpu()`` returned is the same transfer, counted once.
  Uploads (host to device) are not counted: they do not wait for the device.

One more figure is a time, for the implementations whose kernels are Triton's:
``host_us_per_leaf``, the host's own work per call and leaf. The implementation's call alone
is timed (not the harness's wait over its outputs), with every Triton launch replaced by one
that does nothing: no kernel, compiled or interpreted, runs, and the call's Python, its
operators around the launches and its outputs are what is timed. It is the best of
:data:`HOST_REPEATS` calls, each call's outputs held until its time is taken. Issue 30's
budget for it is 1 us a leaf on W4. It is a timing, so it is a benchmark's figure, never a
test's.

Our torch implementations are counted on their CUDA route: CPU tensors take the accelerator's
branches (``impls/own/torch/branches.py``) and never the numba host route. ``torch.compile``d
kernels cannot be counted without a driver (inductor's launches are not Triton's
``kernel[grid]``), so ``clipbench.torch-compile`` is counted on a GPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from clipbench.benchmarks import script_args, timing, workloads

# The implementations counted by default: our torch routes and the torch peers they answer to.
DEFAULT_IMPLS: tuple[str, ...] = (
    "clipbench.torch", "clipbench.triton", "torch.clip_grad_norm_.foreach",
    "torch.clip_grad_norm_", "baseline.torch-index-add")
DEFAULT_WORKLOADS: tuple[str, ...] = (
    "W1-model", "W4-many-small", "W2-relax", "W2-relax-max-step")

# Operators that only read or set metadata: no kernel runs on any device.
NO_WORK: frozenset[str] = frozenset({
    "aten.detach.default", "aten.alias.default", "aten.sym_size.int", "aten.sym_stride.int",
    "aten.sym_numel.default", "aten.sym_storage_offset.default", "aten.is_same_size.default",
    "aten.set_.source_Tensor", "aten.empty.memory_format", "aten.empty_strided.default",
    "aten.empty_like.default", "aten.resize_.default", "aten.lift_fresh.default",
})
# Operators whose output shape depends on the input values: the host waits for the device.
VALUE_SHAPED: frozenset[str] = frozenset({
    "aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
    "aten.unique_dim.default", "aten.unique_consecutive.default", "aten.argwhere.default",
    "aten.repeat_interleave.Tensor",
})
SCALAR_READ = "aten._local_scalar_dense.default"
HOST_REPEATS = 7


@dataclasses.dataclass
class Costs:
  """What one call dispatched (the module docstring states what each count includes)."""

  operators: int = 0
  views: int = 0
  launches: int = 0
  transfers: int = 0

  @property
  def launched(self) -> int:
    """Operators plus Triton launches: the launches of the call on a GPU."""
    return self.operators + self.launches


class _Counter:
  """The counts of one region; the hooks below add to the active one."""

  def __init__(self) -> None:
    self.costs = Costs()
    self.in_kernel = 0  # >0 while a Triton kernel (or the counter itself) runs
    self.read_on_host: set[int] = set()  # ids of the live tensors a .cpu() returned


_ACTIVE: list[_Counter] = []


def _dispatch_mode_class() -> type:
  # pylint: disable-next=import-outside-toplevel
  from torch.utils._python_dispatch import TorchDispatchMode

  from clipbench.impls.own.torch import branches  # pylint: disable=import-outside-toplevel

  class _CountingMode(TorchDispatchMode):
    """Counts every aten operator dispatched while it is active."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
      counter = _ACTIVE[-1] if _ACTIVE else None
      if counter is not None and not counter.in_kernel and not branches.host_copies_only():
        name = str(func)
        if name == SCALAR_READ or name in VALUE_SHAPED:
          counter.costs.transfers += 1
          counter.costs.operators += name in VALUE_SHAPED
        elif name in NO_WORK or getattr(func, "is_view", False):
          counter.costs.views += 1
        else:
          counter.costs.operators += 1
      return func(*args, **(kwargs or {}))

  return _CountingMode


@functools.cache
def _counting_mode_class() -> type:
  return _dispatch_mode_class()


@contextlib.contextmanager
def _patched(owner: Any, name: str, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
  original = getattr(owner, name)
  setattr(owner, name, wrap(original))
  try:
    yield
  finally:
    setattr(owner, name, original)


def _host_read(method: Callable, marks_result: bool) -> Callable:
  """A Tensor method that reads values on the host, counted as one transfer per tensor read
  (not a read of the host's own copies: :func:`clipbench.impls.own.torch.branches.on_host_copies`)."""
  from clipbench.impls.own.torch import branches  # pylint: disable=import-outside-toplevel

  @functools.wraps(method)
  def counted(self, *args, **kwargs):
    counter = _ACTIVE[-1] if _ACTIVE else None
    if counter is None or counter.in_kernel or branches.host_copies_only():
      return method(self, *args, **kwargs)
    if id(self) not in counter.read_on_host:
      counter.costs.transfers += 1
    result = method(self, *args, **kwargs)
    if marks_result:
      if result is self:
        # A CPU tensor's .cpu() is itself; on a GPU it is a new host tensor, whose reads are
        # this transfer while the device tensor's later reads are new ones: an alias stands in.
        counter.in_kernel += 1  # the counter's own view is not the call's
        try:
          result = self.view_as(self)
        finally:
          counter.in_kernel -= 1
      counter.read_on_host.add(id(result))
      # An id is reused once its tensor is freed: the mark goes with the tensor.
      weakref.finalize(result, counter.read_on_host.discard, id(result))
    return result

  return counted


def _kernel_run(run: Callable) -> Callable:
  """A Triton ``run`` (what ``kernel[grid](...)`` calls) counted as one launch."""

  @functools.wraps(run)
  def counted(self, *args, **kwargs):
    counter = _ACTIVE[-1] if _ACTIVE else None
    if counter is None or kwargs.get("warmup"):
      return run(self, *args, **kwargs)
    counter.costs.launches += 1
    counter.in_kernel += 1
    try:
      return run(self, *args, **kwargs)
    finally:
      counter.in_kernel -= 1

  return counted


def _triton_runners() -> list[Any]:
  """The classes whose ``run`` launches a Triton kernel (compiled, and the interpreter's)."""
  try:
    from triton.runtime import interpreter, jit  # pylint: disable=import-outside-toplevel
  except ImportError:
    return []
  return [jit.JITFunction, interpreter.InterpretedFunction]


@contextlib.contextmanager
def counting() -> Iterator[Costs]:
  """Counts what the block dispatches; the yielded ``Costs`` holds the totals at its end.

  The accelerator's branches of our torch route are taken inside the block (CPU tensors count
  as device tensors). Not reentrant across threads: count one call at a time.
  """
  import torch  # pylint: disable=import-outside-toplevel
  from clipbench.impls.own.torch import branches  # pylint: disable=import-outside-toplevel

  counter = _Counter()
  with contextlib.ExitStack() as stack:
    stack.enter_context(_patched(torch.Tensor, "cpu",
                                 lambda m: _host_read(m, marks_result=True)))
    for name in ("tolist", "numpy"):
      stack.enter_context(_patched(torch.Tensor, name,
                                   lambda m: _host_read(m, marks_result=False)))
    for runner in _triton_runners():
      stack.enter_context(_patched(runner, "run", _kernel_run))
    stack.enter_context(branches.accelerator_branches())
    stack.enter_context(_counting_mode_class()())
    _ACTIVE.append(counter)
    try:
      yield counter.costs
    finally:
      _ACTIVE.pop()


@dataclasses.dataclass(frozen=True)
class Row:
  """One counted case."""

  impl: str
  workload: str
  dtype: str
  leaves: int
  systems: int
  costs: Costs | None
  skip: str = ""
  host_us_per_leaf: float | None = None  # Triton implementations only (module docstring)


def count_case(impl_name: str, workload_name: str, dtype: str = "float32",
               scale: float = 1.0) -> Row:
  """The costs of one call of ``impl_name`` on the workload (warmed up once, uncounted)."""
  workload = workloads.get(workload_name)
  host_reason = workloads.host_skip_reason(workload, "cpu", scale)
  if host_reason:
    return Row(impl_name, workload_name, dtype, 0, 0, None, host_reason)
  impl, workload, reason = timing.load_case(impl_name, workload_name, dtype, "cpu")
  inputs = workload.build(scale, dtype)
  systems = inputs.num_systems or 1
  if reason is None and impl.framework != "torch":
    reason = f"{impl_name} is a {impl.framework} implementation: only torch calls are counted"
  if reason is None and impl_name == "clipbench.torch-compile":
    reason = "torch.compile'd kernels are counted on a GPU only (their launches need a driver)"
  if reason is not None:
    return Row(impl_name, workload_name, dtype, len(inputs.leaves), systems, None, reason)
  in_place = impl.capabilities.in_place
  prepared = timing.prepare(impl, workload, inputs, "cpu")
  runner = timing.timed_runner(impl, prepared)
  with counting():
    runner(prepared)  # the warm-up: parameters, caches and compilations, uncounted
  if in_place:
    timing.refill_in_place(prepared, inputs)
  with counting() as costs:
    runner(prepared)
  host = None
  if _runs_triton(impl):
    # The implementation's call alone: not the harness's wait, which walks every output.
    function = impl.function(prepared.op)
    host = host_seconds(lambda: function(prepared.leaves, prepared.threshold,
                                         **prepared.kwargs)) * 1e6 / max(1, len(inputs.leaves))
  return Row(impl_name, workload_name, dtype, len(inputs.leaves), systems, costs,
             host_us_per_leaf=host)


def cannot_count_here(impl_name: str) -> str | None:
  """Why ``impl_name`` cannot be counted on this machine, or None: Triton's kernels run on a
  GPU or under its interpreter (``TRITON_INTERPRET=1``, read when the kernels are defined)."""
  if impl_name != "clipbench.triton":
    return None
  import torch  # pylint: disable=import-outside-toplevel
  from triton import knobs  # pylint: disable=import-outside-toplevel
  if knobs.runtime.interpret or torch.cuda.is_available():
    return None
  return "Triton's kernels need a GPU or TRITON_INTERPRET=1"


def _runs_triton(impl: Any) -> bool:
  from clipbench.impls.own.triton.passes import TritonKernels  # pylint: disable=C0415
  return isinstance(getattr(impl.obj, "kernels", None), TritonKernels)


def _launch_nothing(run: Callable) -> Callable:
  @functools.wraps(run)
  def skipped(self, *args, **kwargs):  # pylint: disable=unused-argument
    return None
  return skipped


@contextlib.contextmanager
def launches_skipped() -> Iterator[None]:
  """Every Triton launch inside the block does nothing (for timing the host's part)."""
  with contextlib.ExitStack() as stack:
    for runner in _triton_runners():
      stack.enter_context(_patched(runner, "run", _launch_nothing))
    yield


def host_seconds(call: Callable[[], object], repeats: int = HOST_REPEATS) -> float:
  """The best time of ``call()`` with its Triton launches skipped (one untimed call first);
  each call's result is released only after its time is taken."""
  import time  # pylint: disable=import-outside-toplevel
  best = float("inf")
  with launches_skipped():
    call()
    for _ in range(repeats):
      start = time.perf_counter()
      result = call()
      best = min(best, time.perf_counter() - start)
      del result
  return best


def rows_frame(rows: Sequence[Row]):
  """The rows as a pandas frame (one row per case; counts empty where skipped)."""
  import pandas as pd  # pylint: disable=import-outside-toplevel
  records = []
  for r in rows:
    c = r.costs
    records.append({
        "impl": r.impl, "workload": r.workload, "dtype": r.dtype, "leaves": r.leaves,
        "systems": r.systems, "operators": None if c is None else c.operators,
        "launches": None if c is None else c.launches,
        "transfers": None if c is None else c.transfers,
        "views": None if c is None else c.views,
        "host_us_per_leaf": (None if r.host_us_per_leaf is None else
                             round(r.host_us_per_leaf, 3)), "skip": r.skip})
  return pd.DataFrame.from_records(records).astype(
      {k: "Int64" for k in ("operators", "launches", "transfers", "views")})


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m clipbench.benchmarks.costs",
      description="Operators, Triton launches and host transfers per call (see the module doc).")
  parser.add_argument("--impl", action="append", help="implementation (repeatable; default: "
                      + ", ".join(DEFAULT_IMPLS) + ")")
  script_args.add_workloads_and_scale(parser, DEFAULT_WORKLOADS)
  parser.add_argument("--dtype", action="append", help="leaf dtype (repeatable; default float32)")
  parser.add_argument("--output", help="also write the table as CSV to this path")
  args = parser.parse_args(argv)
  names = script_args.checked_workloads(parser, args, DEFAULT_WORKLOADS)
  impls = args.impl or list(DEFAULT_IMPLS)
  dtypes = args.dtype or ["float32"]
  try:
    for dtype in dtypes:
      workloads.numpy_dtype(dtype)
    from clipbench.impls import registry  # pylint: disable=import-outside-toplevel
    for name in impls:
      if name not in registry.names() and ":" not in name:
        raise ValueError(f"impl: unknown implementation {name!r}")
  except ValueError as e:
    parser.error(str(e))
  rows = [count_case(i, w, d, args.scale) for w in names for d in dtypes for i in impls]
  frame = rows_frame(rows)
  with np.printoptions(linewidth=200):
    print(frame.to_string(index=False, na_rep="-"))
  if args.output:
    from clipbench import files  # pylint: disable=import-outside-toplevel
    files.write_text(args.output, frame.to_csv(index=False))
  return 0


if __name__ == "__main__":
  sys.exit(main())
