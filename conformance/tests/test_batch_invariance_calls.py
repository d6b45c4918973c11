"""Rule 11 calls an implementation on its batch once for every variant but ``repeated_call``.

The variants of one dtype compare with the same batched call, which under Triton's interpreter
costs seconds, so it is made once and shared; ``repeated_call`` makes two calls of its own,
since it is the check that a second call gives the same bits.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from clipbench.conformance import test_batch_invariance as batch_invariance
from clipbench.impls import registry

OP = "clip_by_global_norm"


def _call_key(leaves, segments) -> bytes:
  return b"|".join(np.ascontiguousarray(a).tobytes() for a in [leaves[0]] + list(segments or []))


class _CountingReference:
  """The reference, counting its calls by their first leaf's bytes and their segments'."""

  framework = "numpy"

  def __init__(self, reference):
    self._reference = reference
    self.calls: collections.Counter = collections.Counter()

  def clip_by_global_norm(self, leaves, max_norm, *, segments=None, **kwargs):
    self.calls[_call_key(leaves, segments)] += 1
    return self._reference.clip_by_global_norm(leaves, max_norm, segments=segments, **kwargs)


def test_the_batch_is_called_once_per_dtype_and_twice_more_for_repeated_call():
  reference = registry.load("reference")
  counting = _CountingReference(reference.obj)
  impl = dataclasses.replace(reference, name="counting-reference", target="counting-reference",
                             obj=counting)
  dtypes = set()
  for _, (variant, inputs), reason, dtype in batch_invariance.variants(impl, OP):
    if reason is None:
      batch_invariance.verify(impl, OP, variant, inputs)
      dtypes.add(dtype)
  assert dtypes == {"float32", "float64", "bfloat16"}
  batches = {dtype: counting.calls[_call_key(inputs.leaves, inputs.segments)]
             for dtype in dtypes for inputs in [batch_invariance.batch(dtype, OP)]}
  # One call shared by six variants, and repeated_call's two.
  assert batches == {dtype: 3 for dtype in dtypes}, batches
