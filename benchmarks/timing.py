"""Timing one benchmark case (implementation x workload x dtype x device): can it run here,
its prepared arguments, the call that is timed and its median time.

Shared by asv (``bench_clipping``) and pytest-benchmark (``bench_workloads``) so both skip the
same cases for the same reasons and time the same call. A case that cannot run here (library
missing, operation, p, dtype or device not declared, no GPU) gets a reason string; each runner
turns it into its own skip.

Global workloads use ``clip_grad_norm``; an implementation that only provides
``clip_by_global_norm`` runs them through it with ``segments=None``, which is the same
computation (one system) under the canonical API.

A JAX implementation that declares ``jit`` is timed under ``jax.jit`` (``timed_runner``), as
its users call it inside a jitted step: the threshold, segments and options are constants of
the compiled function, the leaves its arguments. Called eagerly, optax and the other JAX
libraries dispatch (and compile) one small XLA program per operation and leaf shape, which
would time JAX's dispatcher rather than the clipping (about 110 s for optax's first W1 call).
Past ``JIT_MAX_LEAVES`` leaves they run eagerly: XLA's compile time grows faster than linearly
with the number of leaves (W4's 10,000 leaves did not compile within 8 minutes), while eager
dispatch compiles each operation once per leaf shape (W4's leaves share one shape).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

from clipbench.benchmarks import workloads
from clipbench.devices import cuda_device_node_present
from clipbench.impls import calling, frameworks
from clipbench.impls.registry import DEVICES, Implementation, load

JIT_MAX_LEAVES = 1000


def early_skip_reason(device: str) -> str | None:
  """A reason decidable without importing any implementation (keeps skips cheap in asv)."""
  if device not in DEVICES:
    return f"unknown device {device!r}"
  if device == "cuda" and not cuda_device_node_present():
    return "no CUDA device on this machine"
  return None


def resolve_op(impl: Implementation, workload: workloads.Workload) -> str | None:
  """The operation ``impl`` runs ``workload`` with, or None when it has none."""
  ops = impl.ops
  if workload.op in ops:
    return workload.op
  if workload.op == "clip_grad_norm" and "clip_by_global_norm" in ops:
    return "clip_by_global_norm"
  return None


def _framework_device_reason(impl: Implementation, device: str) -> str | None:
  if device == "cpu":
    return None
  if impl.framework == "torch":
    import torch
    return None if torch.cuda.is_available() else "torch sees no CUDA device"
  if impl.framework == "jax":
    import jax
    try:
      jax.devices("gpu")
    except RuntimeError:
      return "jax has no GPU backend"
    return None
  return f"{impl.framework} implementations run on the CPU only here"


def skip_reason(impl: Implementation, workload: workloads.Workload, dtype: str,
                device: str) -> str | None:
  """Why the case cannot run here, or None when it can."""
  reason = early_skip_reason(device)
  if reason:
    return reason
  if not impl.available:
    return f"{impl.name} unavailable: {impl.reason}"
  op = resolve_op(impl, workload)
  if op is None:
    return f"{impl.name} does not provide {workload.op}"
  caps = impl.capabilities
  if workload.per_system and not caps.per_system:
    return f"{impl.name} has no per-system (segments) support"
  if op != "clip_by_max_step" and not caps.supports_norm_type(workload.norm_type):
    return f"{impl.name} does not support norm_type={workload.norm_type}"
  if dtype not in caps.dtypes:
    return f"{impl.name} does not support {dtype}"
  if device not in caps.devices:
    return f"{impl.name} does not run on {device}"
  return _framework_device_reason(impl, device)


def load_case(impl_name: str, workload_name: str, dtype: str,
              device: str) -> tuple[Implementation | None, workloads.Workload, str | None]:
  """Loads the implementation (unless an early reason applies) and says why it cannot run."""
  workload = workloads.get(workload_name)
  workloads.numpy_dtype(dtype)  # validates the name
  reason = early_skip_reason(device)
  if reason:
    return None, workload, reason
  impl = load(impl_name)
  return impl, workload, skip_reason(impl, workload, dtype, device)


def prepare(impl: Implementation, workload: workloads.Workload, inputs: workloads.WorkloadInputs,
            device: str) -> calling.Prepared:
  """Framework-side arguments of the case, built outside any timed region."""
  op = resolve_op(impl, workload)
  if op is None:
    raise ValueError(f"impl: {impl.name} cannot run {workload.name}")
  return calling.prepare(impl, op, inputs.leaves, inputs.threshold, segments=inputs.segments,
                         num_systems=inputs.num_systems, norm_type=inputs.norm_type,
                         device=device)


def refill_in_place(prepared: calling.Prepared, inputs: workloads.WorkloadInputs) -> None:
  """Writes the workload's values back into ``prepared``'s leaves, untimed.

  An in-place implementation (torch's ``clip_grad_norm_``) is timed as a training loop calls
  it: on the same gradient tensors every step, freshly written, so the parameters that hold
  them are built once, outside the timed calls.
  """
  for leaf, values in zip(prepared.leaves, inputs.leaves):
    frameworks.copy_into(leaf, values)


def timed_runner(impl: Implementation,
                 prepared: calling.Prepared) -> Callable[[calling.Prepared], object]:
  """The call that is timed: ``runner(prepared)`` runs the case and waits for its result.

  JAX implementations declaring ``jit`` run under ``jax.jit`` (up to ``JIT_MAX_LEAVES``
  leaves) with the threshold and keyword arguments of ``prepared`` baked in, so the runner
  only accepts preparations of the same case; every other one runs through ``calling.run``.
  """
  if (impl.framework != "jax" or
      "jit" not in impl.capabilities.transforms or len(prepared.leaves) > JIT_MAX_LEAVES):
    return lambda p: calling.run(impl, p)
  import jax
  function = impl.function(prepared.op)
  threshold, kwargs = prepared.threshold, dict(prepared.kwargs)
  jitted = jax.jit(lambda leaves: function(leaves, threshold, **kwargs))
  return lambda p: jax.block_until_ready(jitted(p.leaves))


def median_call_seconds(call: Callable[[], object], reset: Callable[[], None] | None = None, *,
                        min_calls: int = 3, max_calls: int = 25,
                        budget_seconds: float = 0.5) -> float:
  """Median wall time of ``call()``; ``reset()`` (untimed) runs before each call when given.

  Calls stop after ``max_calls`` or once ``budget_seconds`` is spent and ``min_calls`` ran.
  """
  samples: list[float] = []
  spent = 0.0
  while len(samples) < max_calls and (len(samples) < min_calls or spent < budget_seconds):
    if reset is not None:
      reset()
    start = time.perf_counter()
    call()
    samples.append(time.perf_counter() - start)
    spent += samples[-1]
  return statistics.median(samples)
