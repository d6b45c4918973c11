"""The GPU-sized workloads: their stated sizes, and a CPU run that leaves them out unless shrunk."""

from __future__ import annotations

import pytest

from clipbench.benchmarks import workloads

GPU_SIZED = [w for w in workloads.WORKLOADS if w.gpu_sized]


def test_the_gpu_sized_workloads_are_a_large_model_and_a_million_systems():
  by_name = {w.name: w for w in GPU_SIZED}
  assert set(by_name) == {"W7-model-gpu", "W8-relax-gpu", "W8-relax-gpu-max-step"}
  model = by_name["W7-model-gpu"]
  assert model.full_elements == 1_500_000_000 and not model.per_system
  inputs = model.build(0.0005, "float32")
  assert len(inputs.leaves) == 400 and inputs.num_elements == 750_000
  relax = by_name["W8-relax-gpu"].build(0.001, "bfloat16")
  assert relax.num_systems == 1000  # 1,000,000 at full size


@pytest.mark.parametrize("workload", GPU_SIZED, ids=lambda w: w.name)
def test_a_cpu_run_leaves_them_out_at_full_size_and_runs_them_shrunk(workload):
  reason = workloads.host_skip_reason(workload, "cpu", 1.0)
  assert reason and workload.name in reason and "GPU" in reason
  limit = workloads.host_scale_limit(workload)
  assert workload.full_elements * limit <= workloads.HOST_MAX_ELEMENTS
  assert workloads.host_skip_reason(workload, "cpu", limit) is None
  assert workloads.host_skip_reason(workload, "cuda", 1.0) is None


def test_every_other_workload_runs_on_the_cpu_at_full_size():
  for workload in workloads.WORKLOADS:
    if not workload.gpu_sized:
      assert workload.full_elements <= workloads.HOST_MAX_ELEMENTS
      assert workloads.host_skip_reason(workload, "cpu", 1.0) is None
