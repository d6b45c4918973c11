"""The framework helpers the harness times through: waiting for a result's device work."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
# pylint: disable=wrong-import-position
from clipbench.impls import frameworks  # noqa: E402


class _CudaTensor:
  """What the wait reads of a CUDA tensor: its module, ``is_cuda`` and ``device``."""

  is_cuda = True

  def __init__(self, device: str):
    self.device = device


_CudaTensor.__module__ = "torch.cuda_stand_in"


class _TensorOnCuda(torch.Tensor):
  """A torch tensor (on the CPU) that says it is on a CUDA device."""

  is_cuda = True

  @property
  def device(self):
    return "cuda:2"


class _JaxArray:
  waited = 0

  def block_until_ready(self):
    _JaxArray.waited += 1
    return self


def test_each_cuda_device_is_synchronized_once_and_each_jax_array_waited(monkeypatch):
  # A W4 result is 10,000 tensors: one synchronization each would time host round trips.
  synchronized = []
  monkeypatch.setattr(torch.cuda, "synchronize", synchronized.append)
  outputs = [_CudaTensor("cuda:0") for _ in range(1000)] + [_CudaTensor("cuda:1")]
  result = (outputs, _CudaTensor("cuda:0"))
  assert frameworks.block_until_ready(result) is result
  assert sorted(synchronized) == ["cuda:0", "cuda:1"]
  synchronized.clear()
  frameworks.block_until_ready(([torch.zeros(2)] * 3, torch.zeros(())))  # CPU: nothing to wait
  assert not synchronized
  # torch tensors themselves, in a list (the read that spares W4 its 10,000 attribute tests).
  frameworks.block_until_ready(([torch.zeros(2).as_subclass(_TensorOnCuda)] * 3, torch.ones(())))
  assert synchronized == ["cuda:2"]
  synchronized.clear()
  frameworks.block_until_ready(torch.zeros(2).as_subclass(_TensorOnCuda))  # alone, not in a list
  assert synchronized == ["cuda:2"]
  synchronized.clear()
  assert not synchronized
  _JaxArray.waited = 0
  frameworks.block_until_ready([_JaxArray(), (_JaxArray(), _JaxArray())])
  assert _JaxArray.waited == 3
