"""Standalone reproducers: a few lines of numpy that rebuild an input and make the call.

Small inputs are written inline with exact float64 literals (``repr`` round-trips, and every
leaf dtype converts exactly to float64 and back); large ones are saved next to the results as
``.npz`` and loaded by the snippet.
"""

from __future__ import annotations

import math
import os
import re

import numpy as np

from clipbench.conformance.cases import Inputs

INLINE_LIMIT = 64


def _literal(a: np.ndarray) -> str:
  dtype = a.dtype.name
  ctor = "ml_dtypes.bfloat16" if dtype == "bfloat16" else f"np.{dtype}"
  if a.dtype.kind in "iu":
    return f"np.array({a.tolist()!r}, dtype={ctor})"
  values = [_float(v) for v in a.astype(np.float64).ravel().tolist()]
  body = f"np.array([{', '.join(values)}])"
  if a.ndim != 1:
    body += f".reshape({tuple(a.shape)!r})"
  return f"{body}.astype({ctor})"


def _float(v: float) -> str:
  if math.isnan(v):
    return "np.nan"
  if math.isinf(v):
    return "np.inf" if v > 0 else "-np.inf"
  return repr(v)


def snippet(impl_name: str, description: str, op: str, inputs: Inputs,
            directory: str | None = None, stem: str = "case", library_call: str | None = None) -> str:
  """The reproducer text for calling ``impl_name``'s ``op`` on ``inputs``.

  ``library_call`` is the implementation's own code for the call (an adapter's
  ``reproducer``), written against the names ``leaves``, ``threshold``, ``segments``,
  ``num_systems`` and ``norm_type``; without it the snippet calls through clipbench.
  """
  size = sum(x.size for x in inputs.leaves)
  lines = ["import math", "import ml_dtypes", "import numpy as np"]
  if not library_call:
    lines.append("from clipbench.impls import calling, registry")
  lines.append("")
  if size <= INLINE_LIMIT or directory is None:
    lines.append("leaves = [" + ", ".join(_literal(x) for x in inputs.leaves) + "]")
    if inputs.segments is not None and op != "clip_grad_norm":
      lines.append("segments = [" + ", ".join(_literal(s) for s in inputs.segments) + "]")
  else:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, re.sub(r"[^A-Za-z0-9_.-]+", "_", stem) + ".npz")
    arrays = {f"leaf{i}": (x.view(np.uint16) if x.dtype.name == "bfloat16" else x)
              for i, x in enumerate(inputs.leaves)}
    if inputs.segments is not None:
      arrays.update({f"segments{i}": s for i, s in enumerate(inputs.segments)})
    np.savez(path, **arrays)
    shown = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
    lines.append(f"data = np.load({shown!r})  # saved by the conformance run")
    casts = [(".view(ml_dtypes.bfloat16)" if x.dtype.name == "bfloat16" else "")
             for x in inputs.leaves]
    lines.append("leaves = [" + ", ".join(f"data['leaf{i}']{c}" for i, c in enumerate(casts)) +
                 "]")
    if inputs.segments is not None and op != "clip_grad_norm":
      lines.append("segments = [" + ", ".join(
          f"data['segments{i}']" for i in range(len(inputs.segments))) + "]")
  threshold = inputs.threshold
  if isinstance(threshold, np.ndarray) and threshold.ndim:
    lines.append(f"threshold = {_literal(threshold)}")
  else:
    lines.append(f"threshold = {_float(float(threshold)).replace('np.', 'math.')}")
  if library_call:
    if inputs.segments is None or op == "clip_grad_norm":
      lines += ["segments = None", "num_systems = None"]
    else:
      lines.append(f"num_systems = {inputs.num_systems}")
    lines.append(f"norm_type = {_float(inputs.norm_type).replace('np.', 'math.')}")
    lines.append(f"# {impl_name}: {description}")
    lines += library_call.splitlines()
    return "\n".join(lines)
  kwargs = []
  if inputs.segments is not None and op != "clip_grad_norm":
    kwargs += ["segments=segments", f"num_systems={inputs.num_systems}"]
  if op != "clip_by_max_step" and inputs.norm_type != 2.0:
    kwargs.append(f"norm_type={_float(inputs.norm_type).replace('np.', 'math.')}")
  if inputs.nonfinite != "propagate":
    kwargs.append(f"nonfinite={inputs.nonfinite!r}")
  lines += [f"impl = registry.load({impl_name!r})  # {description}",
            f"out, norms = calling.call(impl, {op!r}, leaves, threshold"
            + "".join(", " + k for k in kwargs) + ")",
            "print(out, norms)"]
  return "\n".join(lines)
