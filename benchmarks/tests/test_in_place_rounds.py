"""torch's in-place clipping timed as a training loop calls it: the same gradient tensors every
round, refilled untimed, and the parameters holding them built once."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
# pylint: disable=wrong-import-position
from clipbench.benchmarks import timing, workloads
from clipbench.impls import calling, frameworks, registry
from clipbench.impls.adapters._torch_parameters import ParametersHolding


def test_a_refill_writes_the_inputs_back_into_the_same_tensors():
  impl = registry.load("torch.clip_grad_norm_.foreach")
  workload = workloads.get("W1-model")
  inputs = workload.build(1 / 256, "float32")
  prepared = timing.prepare(impl, workload, inputs, "cpu")
  leaves = list(prepared.leaves)
  calling.run(impl, prepared)  # clips the leaves in place (the threshold is half the norm)
  assert not all(np.array_equal(frameworks.to_numpy(x), y)
                 for x, y in zip(prepared.leaves, inputs.leaves))
  timing.refill_in_place(prepared, inputs)
  assert all(a is b for a, b in zip(prepared.leaves, leaves))
  assert all(np.array_equal(frameworks.to_numpy(x), y)
             for x, y in zip(prepared.leaves, inputs.leaves))


def test_parameters_are_built_once_per_set_of_gradient_tensors():
  holding = ParametersHolding()
  grads = [torch.ones(3), torch.zeros(2, 2)]
  first = holding(grads)
  assert len(first) == 2 and all(p.grad is g for p, g in zip(first, grads))
  assert holding(grads) is first  # the same tensors: the same parameters
  others = [torch.ones(3), torch.zeros(2, 2)]  # equal values, other tensors: new parameters
  second = holding(others)
  assert second is not first and all(p.grad is g for p, g in zip(second, others))
  assert holding(grads[:1]) is not second
