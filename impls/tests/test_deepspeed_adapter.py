"""The DeepSpeed adapters really call DeepSpeed 0.19: each test checks a result that DeepSpeed's
own rule gives and the reference does not (the 1e-6 epsilon, a tie scaled, a non-finite norm
returned as -1 and the tensors scaled by a negative factor), computed by hand from that rule.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

from clipbench.impls.adapters import deepspeed_adapter  # noqa: E402


def _leaves() -> list[torch.Tensor]:
  return [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]


class TestClipGradNorm:
  """``clip_grad_norm_``: n = (sum ||g_i||_p ** p) ** (1/p), g *= min(1, max / (n + 1e-6))."""

  def test_p3_total_raises_per_tensor_norms_to_p(self):
    # deepspeedai/DeepSpeed#8313 (fixed before 0.19.8): the per-tensor norms were squared, which
    # gives (91 ** (2/3) + 12 ** 2) ** (1/3) ~ 5.48 here instead of the p-norm ~ 12.207.
    leaves = _leaves()
    out, norm = deepspeed_adapter.clip_grad_norm_.clip_grad_norm(leaves, 1.0, norm_type=3.0)
    expected_norm = (3.0 ** 3 + 4.0 ** 3 + 12.0 ** 3) ** (1 / 3)
    assert norm.dtype == torch.float32
    assert float(norm) == pytest.approx(expected_norm, rel=1e-6)
    squared_norm = ((3.0 ** 3 + 4.0 ** 3) ** (2 / 3) + 12.0 ** 2) ** (1 / 3)
    assert not math.isclose(float(norm), squared_norm, rel_tol=1e-3)
    scale = 1.0 / (expected_norm + 1e-6)
    assert out[0] is leaves[0] and out[1] is leaves[1]  # in place, on the .grad tensors
    torch.testing.assert_close(out[0], torch.tensor([3.0 * scale, 4.0 * scale]))
    torch.testing.assert_close(out[1], torch.tensor([12.0 * scale]))

  def test_a_tie_is_scaled_below_one(self):
    # |(3, 4)| = 5 = max: min(1, 5 / (5 + 1e-6)) < 1 still multiplies every value.
    leaf = torch.tensor([3.0, 4.0], dtype=torch.float64)
    out, norm = deepspeed_adapter.clip_grad_norm_.clip_grad_norm([leaf], 5.0)
    assert float(norm) == 5.0
    coefficient = torch.tensor(5.0, dtype=torch.float32) / torch.tensor(5.0 + 1e-6,
                                                                          dtype=torch.float32)
    assert coefficient < 1
    assert torch.equal(out[0], torch.tensor([3.0, 4.0], dtype=torch.float64) * coefficient.double())


class TestClipTensorsByGlobalNorm:
  """``clip_tensors_by_global_norm``: n = ||t||_2 (-1 when not finite), t *= s only if s < 1,
  with s = max / (n + 1e-6)."""

  def test_scales_by_max_over_norm_plus_eps(self):
    leaves = _leaves()
    out, norm = deepspeed_adapter.clip_tensors_by_global_norm.clip_grad_norm(leaves, 6.5)
    assert float(norm) == 13.0
    scale = 6.5 / (13.0 + 1e-6)
    torch.testing.assert_close(out[1], torch.tensor([12.0 * scale]))
    assert out[1] is leaves[1]

  def test_leaves_untouched_when_the_coefficient_reaches_one(self):
    leaves = _leaves()
    out, _ = deepspeed_adapter.clip_tensors_by_global_norm.clip_grad_norm(leaves, 13.1)
    assert torch.equal(out[0], torch.tensor([3.0, 4.0]))
    assert torch.equal(out[1], torch.tensor([12.0]))

  def test_a_nonfinite_norm_is_minus_one_and_flips_the_signs(self):
    # get_global_norm_of_tensors masks a NaN/inf norm to -1; max / (-1 + 1e-6) < 1 is applied.
    leaves = [torch.tensor([3.0, float("nan")]), torch.tensor([12.0])]
    out, norm = deepspeed_adapter.clip_tensors_by_global_norm.clip_grad_norm(leaves, 1.0)
    assert float(norm) == -1.0
    scale = 1.0 / (-1.0 + 1e-6)
    torch.testing.assert_close(out[0][:1], torch.tensor([3.0 * scale]))
    assert torch.isnan(out[0][1])
    torch.testing.assert_close(out[1], torch.tensor([12.0 * scale]))

  def test_refuses_other_norm_types(self):
    with pytest.raises(NotImplementedError, match="norm_type"):
      deepspeed_adapter.clip_tensors_by_global_norm.clip_grad_norm(_leaves(), 1.0, norm_type=3.0)
