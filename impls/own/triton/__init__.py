"""Triton kernels for the three clipping operations, on torch tensors.

CUDA tensors run compiled Triton kernels; with ``TRITON_INTERPRET=1`` set before triton is
first imported, the same kernels run on CPU tensors in Triton's interpreter (that is how CI
tests them; ``ahead_of_time`` compiles them for sm_90 without a GPU). The numerics are those
of :mod:`clipbench.impls.own.torch` (see its docstring): the measure kernels compute per-system
power sums, maxima and step norms with rigorous error bounds, one decision kernel takes every
system's decisions from its certified interval (the torch package's tensor operations,
statement for statement), the host reads the call's summary once and recomputes near-ties
exactly, and an apply kernel writes the outputs.

A call is a fixed number of launches, whatever its leaves and systems: one per pass and dtype
group over a table of leaf addresses (``tables``), one decision launch, one apply launch per
dtype, and one operator zeroing the call's scratch buffer (``scratch``). ``kernels`` holds the
measure and apply programs, ``decision_kernel`` the decisions, ``passes`` the launches.

Determinism and batch invariance
--------------------------------
Per system, a program reduces each tile of its work item with a segmented scan over runs of
equal system ids and adds each run's total into its system atomically; one system's item
partials are added in item order. Atomic float64 adds land in a run-dependent order, but the
sums stay within their certified bounds in any order (the extracted float64 pieces are exact
in any order, maxima order-free), and every output bit is a function of the exact values of
the system's elements (the canonical definitions), so the outputs are run-to-run
deterministic and batch-invariant all the same: the Triton results equal the eager torch
results bit for bit, which the CPU tests check. Every kernel is launched with
``enable_fp_fusion=False``: no multiply-add is contracted (the double-double products need
that), as in the interpreter.

What was verified where: the whole conformance suite on the CPU under the interpreter, and on
one NVIDIA H200 (Triton 3.6.0, 2026-11-27: 430 pass, 0 fail, after a fix of the scan that only
the GPU showed; ``docs/gpu.md``, section 10). Under the interpreter the segmented scans run in
a tree order, as on a GPU, not left to right (``interpreter_scan``; section 19).

General p uses ``exp2(p * log2(y))`` (the interpreter has no ``pow``); its error is bounded
per term (``POW_REL_ERR``, ``POW_ABS_ERR``) and the same certification applies.
"""

from __future__ import annotations

import torch

from clipbench.impls.own.torch.api import TorchClipping
from clipbench.impls.own.triton.kernels import IMPORT_ERROR, triton
from clipbench.impls.own.triton.passes import INTERPRET, TritonKernels


def _availability() -> tuple[bool, str]:
  if triton is None:
    return False, IMPORT_ERROR
  if torch.cuda.is_available() or INTERPRET:
    return True, ""
  return False, "no CUDA device, and TRITON_INTERPRET=1 is not set (CPU runs need the interpreter)"


available, unavailable_reason = _availability()
implementation = TorchClipping(
    TritonKernels(), "Triton kernels: one launch per pass over a table of leaf addresses, "
    "decisions in one kernel",
    devices=(("cuda",) if torch.cuda.is_available() else ()) + (("cpu",) if INTERPRET else ()),
    cpu_kernels=False)  # on the CPU it is Triton's interpreter, run for the tests
implementation.available = available
implementation.unavailable_reason = unavailable_reason

__all__ = ["available", "implementation", "unavailable_reason"]
