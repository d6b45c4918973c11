"""Triton kernels for the three clipping operations, on torch tensors.

CUDA tensors run compiled Triton kernels; with ``TRITON_INTERPRET=1`` set before triton is
first imported, the same kernels run on CPU tensors in Triton's interpreter (that is how CI
tests them: no GPU here). The numerics and the host-side decisions are those of
:mod:`clipbench.impls.own.torch` (see its docstring): the kernels compute per-system power
sums, maxima and step norms with rigorous error bounds, the host takes each decision from the
certified interval or, for near-ties, from an exact recomputation of that system alone, and a
last kernel writes the outputs. ``kernels`` holds the Triton programs, ``passes`` their
launches.

Determinism and batch invariance on hardware
--------------------------------------------
* No atomics. Rows are visited in the order of a stable sort by system (none is needed when
  the segments are already sorted: the contiguous fast path). The rows of each system are cut
  into *work items* of a fixed number of rows, aligned to the system's own first row; one
  program reduces one item with fixed ``BLOCK`` sizes that depend only on the leaf's row
  width, and a second kernel, one program per system, adds its items' partial results in item
  order. No split reductions, no atomics, no batch-dependent launch configuration: a system's
  partial sums are computed by the same instructions in the same order whatever the other
  systems are, so the kernels are run-to-run deterministic and batch-invariant by themselves
  (as ``batch_invariant_ops`` does for matmul rows).
* On top of that, every output bit is a function of the exact values of the system's elements
  (the canonical definitions in :mod:`clipbench.impls.own.torch`): a different summation order
  could only change which systems take the exact path, never a result bit. So the Triton
  results equal the eager torch results bit for bit, which is what the CPU tests check.
* Fused multiply-add contraction (on by default in Triton) is harmless here: squares of
  <= 32-bit values are exact in float64, and the error-free extraction ``(t + s) - s`` only
  ever contracts with an exact product.

What was verified where: every kernel ran under ``TRITON_INTERPRET=1`` on CPU (conformance
suite and bit-for-bit comparisons with the eager implementation), and compiled on one NVIDIA
H200 (Triton 3.6.0, 2026-11-26) through the conformance suite's rules 3, 8 and 14 and, before a
proxy fix, the whole suite with no failure of its own (``docs/gpu.md``, section 8).

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
    TritonKernels(), "Triton kernels: one program per (system, fixed-size row chunk), no atomics",
    devices=(("cuda",) if torch.cuda.is_available() else ()) + (("cpu",) if INTERPRET else ()),
    cpu_kernels=False)  # on the CPU it is Triton's interpreter, run for the tests
implementation.available = available
implementation.unavailable_reason = unavailable_reason

__all__ = ["available", "implementation", "unavailable_reason"]
