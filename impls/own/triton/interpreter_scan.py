"""The kernels' segmented scans under Triton's interpreter, as a log-step scan over whole arrays.

Triton's interpreter runs ``tl.associative_scan`` with a combine function of the kernel's own
(``ScanOps.generic_scan``) as a Python loop that calls the combine function once per element,
with scalars. In a per-system measure launch that loop was nine tenths of the interpreter's
time, and the interpreter is how CI runs these kernels (``docs/gpu.md``, section 19).

Here the combine function is applied to whole arrays, ``log2(n)`` times (Hillis and Steele's
scan: at step ``d`` each element ``i >= d`` becomes ``combine(x[i - d], x[i])``). For an
associative combine this is one valid order of the scan, as the GPU's tree is another and the
interpreter's left-to-right loop a third; what ``tl.associative_scan`` promises holds for each.
The measure kernels are written not to depend on the order (see :mod:`.kernels`: maxima and the
extracted float64 pieces are exact in any order, the compensated run totals stay within their
certified bound whatever the tree). So running them in a tree order under the interpreter tests
that claim, where the left-to-right loop could not: the one scan bug found on the GPU so far
(``docs/gpu.md``, section 10) was an order that only a tree takes.

Only the combine functions given to :func:`install` take this path; every other scan in the
process is Triton's own loop, unchanged. On CUDA nothing here runs: Triton compiles the scan.
"""

from __future__ import annotations

import numpy as np

_installed: set = set()


def _log_step_scan(self, input):  # pylint: disable=redefined-builtin
  """``ScanOps.generic_scan``'s contract (tensors in, a list of tensors out, along
  ``self.axis``; a reversed scan is flipped by the caller), computed in ``log2(n)`` calls of
  the combine function on whole arrays. The outputs never share the inputs' memory, as with
  Triton's loop (hence the copy, which only a one-element axis would otherwise return)."""
  if self.combine_fn not in _installed:
    return _TRITON_GENERIC_SCAN(self, input)
  axis = self.axis
  data = [np.array(arg.handle.data, copy=True) for arg in input]
  dtypes = [arg.dtype for arg in input]
  shape = data[0].shape
  n = shape[axis]
  # Each element's index along the scan axis, broadcast over the later axes.
  position = np.arange(n).reshape((n,) + (1,) * (len(shape) - axis - 1))
  step = 1
  while step < n:
    # Whole arrays keep the interpreter's power-of-two shapes; the first ``step`` elements
    # combine with wrapped-around ones, and keep their own values.
    earlier = tuple(self.to_tensor(np.roll(a, step, axis=axis), t) for a, t in zip(data, dtypes))
    current = tuple(self.to_tensor(a, t) for a, t in zip(data, dtypes))
    combined = self.combine_fn.fn(*earlier, *current)
    if not isinstance(combined, tuple):
      combined = (combined,)
    reached = position >= step
    data = [np.where(reached, c.handle.data if isinstance(c, core.tensor) else c, a)
            .astype(a.dtype, copy=False) for c, a in zip(combined, data)]
    step *= 2
  return [self.to_tensor(a, t) for a, t in zip(data, dtypes)]


try:
  from triton.language import core
  from triton.runtime.interpreter import ScanOps
except ImportError:  # pragma: no cover - triton is installed in this project
  core = ScanOps = None
  _TRITON_GENERIC_SCAN = None
else:
  _TRITON_GENERIC_SCAN = ScanOps.generic_scan


def install(combine_fns) -> bool:
  """Scans with these combine functions (the kernels' ``@triton.jit`` functions) run as the
  log-step scan under the interpreter from now on. False, and nothing changed, where this
  Triton's interpreter has no ``ScanOps.generic_scan`` to take over (its internals moved):
  Triton's own loop then runs them, slower, and the tests of this module fail."""
  if ScanOps is None or not callable(_TRITON_GENERIC_SCAN):
    return False
  _installed.update(combine_fns)
  ScanOps.generic_scan = _log_step_scan
  return True


def triton_generic_scan():
  """Triton's own element-by-element scan (for the tests that compare the two)."""
  return _TRITON_GENERIC_SCAN
