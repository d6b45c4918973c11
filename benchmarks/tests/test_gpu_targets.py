"""The timed targets script: a CPU smoke run gives each time over its peer's, the peer's 1."""

from __future__ import annotations

import types

import pandas as pd

from clipbench.benchmarks import gpu_targets


def test_the_peer_is_foreach_for_one_system_and_the_baseline_per_system():
  assert gpu_targets.peer_of("W1-model") == "torch.clip_grad_norm_.foreach"
  assert gpu_targets.peer_of("W2-relax-max-step") == gpu_targets.BASELINE


def test_a_cpu_smoke_run_writes_ratios_against_the_peer(tmp_path):
  out = tmp_path / "targets.csv"
  assert gpu_targets.main(["--device", "cpu", "--scale", "0.002", "--workload", "W2-relax",
                           "--impl", "clipbench.torch", "--impl", gpu_targets.BASELINE,
                           "--output", str(out)]) == 0
  frame = pd.read_csv(out).set_index("impl")
  assert frame.loc[gpu_targets.BASELINE, "vs_peer"] == 1.0
  mine = frame.loc["clipbench.torch"]
  assert mine["median_ms"] > 0 and mine["vs_peer"] > 0 and mine["target"] == 1.3


def _event(name, start, end):
  return types.SimpleNamespace(name=name, time_range=types.SimpleNamespace(
      start=start, end=end, elapsed_us=lambda: end - start))


def test_device_activity_counts_kernels_copies_and_the_busy_time():
  events = [_event("measure_items", 10.0, 14.0), _event("Memset (Device)", 14.0, 15.0),
            _event("Memcpy DtoH (Device -> Pinned)", 20.0, 22.0),
            _event("apply_items", 30.0, 33.0)]
  assert gpu_targets.device_activity(events) == {
      "kernels": 2, "copies": 1, "to_host": 1, "device_us": 10.0, "device_span_us": 23.0}
  assert gpu_targets.device_activity([])["device_span_us"] == 0.0
