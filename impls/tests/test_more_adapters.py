"""The issue-19 adapters really call their libraries: each test checks a result that the
library's own rule gives and the reference does not (ties scaled, epsilons, a lost -0.0, a
refused threshold), computed by hand from that rule.
"""

from __future__ import annotations

import numpy as np
import pytest


def _signbit(x) -> np.ndarray:
  return np.signbit(np.asarray(x))


class TestAse:
  """ASE 3.29: BFGS/LBFGS scale by maxstep/longest atom when longest >= maxstep; FIRE by
  maxstep/|step| when |step| > maxstep, after ``vel = 0 + dt * f`` (which turns -0.0 to +0.0)."""

  @pytest.fixture(autouse=True)
  def _ase(self):
    pytest.importorskip("ase")

  def test_bfgs_scales_the_whole_step_by_the_longest_atom(self):
    from clipbench.impls.adapters import ase_adapter
    # Atoms (3, 4, 0) of length 5 and (0, 0, 1): longest 5 >= 2.5, so everything times 0.5.
    out, norms = ase_adapter.bfgs_max_step.clip_by_max_step(
        [np.array([[3.0, 4.0, 0.0], [0.0, 0.0, 1.0]])], 2.5)
    np.testing.assert_array_equal(out[0], [[1.5, 2.0, 0.0], [0.0, 0.0, 0.5]])
    assert norms is None

  def test_bfgs_pads_short_vectors_without_changing_their_length(self):
    from clipbench.impls.adapters import ase_adapter
    out, _ = ase_adapter.bfgs_max_step.clip_by_max_step([np.array([[3.0, 4.0]])], 2.5)
    np.testing.assert_array_equal(out[0], [[1.5, 2.0]])
    assert out[0].shape == (1, 2)

  def test_bfgs_refuses_vectors_longer_than_an_atom(self):
    from clipbench.impls.adapters import ase_adapter
    with pytest.raises(NotImplementedError, match=r"leaves\[0\]"):
      ase_adapter.bfgs_max_step.clip_by_max_step([np.ones((2, 4))], 1.0)

  def test_lbfgs_refuses_a_maxstep_above_one_angstrom(self):
    from clipbench.impls.adapters import ase_adapter
    # LBFGS.__init__ raises for maxstep > 1.0 (BFGS only warns): ASE's own check, not ours.
    with pytest.raises(ValueError, match="too large"):
      ase_adapter.lbfgs_max_step.clip_by_max_step([np.array([[3.0, 4.0, 0.0]])], 2.0)
    out, _ = ase_adapter.lbfgs_max_step.clip_by_max_step([np.array([[3.0, 4.0, 0.0]])], 0.5)
    np.testing.assert_array_equal(out[0], np.array([[3.0, 4.0, 0.0]]) * (0.5 / 5.0))

  def test_fire_clips_the_whole_step_and_loses_negative_zero(self):
    from clipbench.impls.adapters import ase_adapter
    # |(3, 4, -0)| = 5 > 2.5: 2.5 * (3, 4) / 5 = (1.5, 2); -0.0 comes back +0.0 (vel = 0 + f).
    out, _ = ase_adapter.fire_max_step.clip_by_global_norm(
        [np.array([3.0, 4.0]), np.array([-0.0])], 2.5)
    np.testing.assert_array_equal(out[0], [1.5, 2.0])
    assert out[1][0] == 0.0 and not _signbit(out[1][0])
    unchanged, _ = ase_adapter.fire_max_step.clip_by_global_norm([np.array([3.0, 4.0])], 5.0)
    np.testing.assert_array_equal(unchanged[0], [3.0, 4.0])


class TestMlx:
  """MLX 0.32: ``min(max / (norm + 1e-6), 1)`` always multiplied; negative max raises."""

  @pytest.fixture(autouse=True)
  def _mlx(self):
    pytest.importorskip("mlx.core")

  def test_tie_is_scaled_by_the_epsilon(self):
    from clipbench.impls.adapters import mlx_adapter
    out, norm = mlx_adapter.clip_grad_norm.clip_grad_norm([np.array([3.0, 4.0], np.float32)], 5.0)
    assert float(norm) == 5.0
    # The scale below 1 is MLX's epsilon at work: 5 / (5 + 1e-6), formed in float32.
    scale = np.float32(5.0) / (np.float32(5.0) + np.float32(1e-6))
    np.testing.assert_array_equal(out[0], np.array([3.0, 4.0], np.float32) * scale)
    assert out[0][0] < 3.0

  def test_bfloat16_and_float64_round_trip_and_negative_max_raises(self):
    import ml_dtypes
    from clipbench.impls.adapters import mlx_adapter
    leaves = [np.array([1e-300, 2.0]), np.array([0.5], ml_dtypes.bfloat16)]
    out, _ = mlx_adapter.clip_grad_norm.clip_grad_norm(leaves, 1e9)
    assert out[0].dtype == np.float64 and out[1].dtype == leaves[1].dtype
    with pytest.raises(ValueError, match="max_norm"):
      mlx_adapter.clip_grad_norm.clip_grad_norm([np.ones(2, np.float32)], -1.0)


class TestOptaxPerExample:
  """optax 0.2.8: ``per_example_global_norm_clip`` per system, each system one example."""

  def test_each_system_is_clipped_by_its_own_norm_and_threshold(self):
    pytest.importorskip("optax")
    from clipbench.impls.adapters import optax_per_example_adapter as adapter
    x = np.array([3.0, 0.3, 4.0, 0.4], np.float32)  # system 0: (3, 4); system 1: (0.3, 0.4)
    segments = [np.array([0, 1, 0, 1], np.int32)]
    out, _ = adapter.per_example_global_norm_clip.clip_by_global_norm(
        [x], np.array([1.0, 2.0]), segments=segments, num_systems=2)
    got = np.asarray(out[0])
    np.testing.assert_allclose(got[[0, 2]], [0.6, 0.8], rtol=1e-6)
    np.testing.assert_array_equal(got[[1, 3]], x[[1, 3]])  # multiplier exactly 1

  def test_float16_mixed_with_float32_comes_back_float32(self):
    pytest.importorskip("optax")
    from clipbench.impls.adapters import optax_per_example_adapter as adapter
    # The example's norm is float32 (promoted across leaves), so optax's tensordot of float32
    # multipliers with the float16 rows returns float32: the library's, not the adapter's.
    alone, _ = adapter.per_example_global_norm_clip.clip_by_global_norm(
        [np.array([3.0, 4.0], np.float16)], 1.0)
    mixed, _ = adapter.per_example_global_norm_clip.clip_by_global_norm(
        [np.array([3.0, 4.0], np.float16), np.array([1.0], np.float32)], 1.0)
    assert np.asarray(alone[0]).dtype == np.float16
    assert np.asarray(mixed[0]).dtype == np.float32

  def test_bad_segments_raise_naming_the_leaf(self):
    pytest.importorskip("optax")
    from clipbench.impls.adapters import optax_per_example_adapter as adapter
    with pytest.raises(ValueError, match=r"segments\[0\]"):
      adapter.per_example_global_norm_clip.clip_by_global_norm(
          [np.ones(3, np.float32)], 1.0, segments=[np.array([0, 2, 0])], num_systems=2)


class TestKeras:
  """Keras 3.15: ``scale = c * min(1/n, 1/c) + (n - n)`` always multiplied; c = 0 turns it off."""

  @pytest.fixture
  def adapter(self):
    # Imported through the adapter, never bare: keras imports tensorflow, and triton imported
    # after tensorflow crashes the process (the adapter orders them).
    keras_adapter = pytest.importorskip("clipbench.impls.adapters.keras_adapter")
    from clipbench.impls import frameworks
    impl = getattr(keras_adapter, f"global_clipnorm_{keras_adapter.BACKEND}")
    return impl, lambda x: frameworks.to_framework(x, impl.framework)

  def test_below_the_threshold_is_still_multiplied(self, adapter):
    impl, convert = adapter
    from clipbench.impls import frameworks
    out, _ = impl.clip_grad_norm([convert(np.array([3.0, 4.0], np.float32))], 41.0)
    one = np.float32(41.0) * np.float32(np.float32(1.0) / np.float32(41.0))  # 0.99999994
    assert one != 1.0
    np.testing.assert_array_equal(frameworks.to_numpy(out[0]),
                                  np.array([3.0, 4.0], np.float32) * one)

  def test_zero_threshold_turns_clipping_off_and_keeps_negative_zero(self, adapter):
    impl, convert = adapter
    from clipbench.impls import frameworks
    out, _ = impl.clip_grad_norm([convert(np.array([3.0, -0.0], np.float32))], 0.0)
    got = frameworks.to_numpy(out[0])
    np.testing.assert_array_equal(got, [3.0, 0.0])
    assert _signbit(got[1])

  def test_only_the_process_backend_is_available(self):
    keras_adapter = pytest.importorskip("clipbench.impls.adapters.keras_adapter")
    for backend in ("tensorflow", "jax", "torch"):
      impl = getattr(keras_adapter, f"global_clipnorm_{backend}")
      assert impl.available == (backend == keras_adapter.BACKEND)
      assert impl.available or "KERAS_BACKEND" in impl.unavailable_reason


class TestTorchSim:
  """torch-sim 0.6.2 ase_fire: per system, ``max * dr / (n + eps)`` when ``n > max``."""

  def test_systems_are_clipped_apart_and_negative_zero_is_lost(self):
    pytest.importorskip("torch_sim")
    import torch
    from clipbench.impls.adapters import torch_sim_adapter
    positions = torch.tensor([[3.0, 4.0, 0.0], [0.0, -0.0, 1.0], [6.0, 8.0, 0.0]],
                             dtype=torch.float64)
    original = positions.clone()
    out, _ = torch_sim_adapter.ase_fire.clip_by_global_norm(
        [positions], 2.5, segments=[torch.tensor([1, 0, 1])], num_systems=2)
    got = out[0].numpy()
    # System 1: |(3,4,0,6,8,0)| = sqrt(125); 2.5 * x / (sqrt(125) + 1e-16), 1e-16 lost in float64.
    np.testing.assert_allclose(got[[0, 2]], 2.5 * positions.numpy()[[0, 2]] / np.sqrt(125.0),
                               rtol=1e-15)
    np.testing.assert_array_equal(got[1], [0.0, 0.0, 1.0])  # |(0, 0, 1)| = 1 <= 2.5
    assert not _signbit(got[1, 1])  # velocities start at +0.0: 0 + (-0) = +0
    assert torch.equal(positions, original)  # the input is untouched
