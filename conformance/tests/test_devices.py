"""The device axis without a GPU: the spelling, the placement, and the suite's device path.

``--device cpu`` takes the path a GPU takes (explicit placement, the output-device check, the
transforms on placed inputs); a second JAX host device (``cpu:1``, in a process started with
two, as the sharding tests do) is a device other than the default one, where a planted
implementation that returns its outputs elsewhere is caught; one that deletes (donates) its
inputs is caught on any device, one that moves them to the host on a GPU (where there is one).
``--device cuda`` here is a usage error before any work.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest

from clipbench import devices
from clipbench.conformance import draft_deviations, manifest, results, running
from clipbench.conformance.cases import case_named
from clipbench.impls import registry


@pytest.mark.parametrize("spec, spelled", [
    ("cpu", "cpu"), ("cpu:0", "cpu"), ("CPU:1", "cpu:1"), ("cuda", "cuda"), ("cuda:3", "cuda:3"),
])
def test_one_spelling_for_every_framework(spec: str, spelled: str) -> None:
  assert str(devices.parse(spec)) == spelled
  assert devices.parse(spelled) == devices.parse(spec)


@pytest.mark.parametrize("spec", ["tpu", "gpu", "cuda:", "cuda:-1", "cpu:x", "", None, 3])
def test_a_device_that_is_not_cpu_or_cuda_is_refused_naming_the_option(spec) -> None:
  with pytest.raises(ValueError, match=r"^device: expected cpu\[:N\] or cuda\[:N\]"):
    devices.parse(spec)


def test_cuda_without_a_gpu_is_refused_before_anything_loads(monkeypatch) -> None:
  monkeypatch.setattr(devices, "cuda_device_node_present", lambda: False)
  with pytest.raises(ValueError, match="device cuda: no CUDA GPU on this machine"):
    devices.requested("cuda")


def test_what_a_process_on_a_device_sets_before_its_frameworks_start() -> None:
  assert devices.environment(devices.parse("cpu"), {}) == {}
  flags = devices.environment(devices.parse("cpu:2"), {"XLA_FLAGS": "--xla_a=1 "
                              "--xla_force_host_platform_device_count=8"})["XLA_FLAGS"]
  assert flags.split() == ["--xla_a=1", "--xla_force_host_platform_device_count=3"]
  assert devices.environment(devices.parse("cuda"), {}) == {
      "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}
  # The caller's own settings win.
  assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in devices.environment(
      devices.parse("cuda:1"), {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"})


@pytest.mark.parametrize("framework, spec, reason", [
    ("numpy", "cpu:1", "numpy arrays live on the host"),
    ("torch", "cpu:1", "torch has one host device"),
    ("jax", "cpu:1", "xla_force_host_platform_device_count=2"),  # this process has one
])
def test_a_device_a_framework_cannot_reach_says_why(framework, spec, reason) -> None:
  with pytest.raises(devices.DeviceUnavailable, match=reason):
    devices.framework_device(devices.parse(spec), framework)


@pytest.mark.parametrize("framework", ["numpy", "torch", "jax", "tensorflow"])
def test_arrays_are_placed_on_the_host_and_found_there(framework) -> None:
  from clipbench.impls import frameworks
  x = frameworks.to_framework(np.arange(3, dtype=np.float32), framework)
  placed = devices.put(x, devices.HOST, framework)
  assert devices.where(placed, framework) == "cpu" and devices.is_on(placed, devices.HOST,
                                                                      framework)
  assert devices.count("cpu", framework) == 1
  assert devices.where(1.5, framework) is None  # a host scalar is no array of the framework


def test_the_suite_places_inputs_and_reads_outputs_on_the_session_device() -> None:
  impl = registry.load("optax.clip_by_global_norm")
  inputs = running.SESSION.inputs(case_named("clip_3_4_to_1"), "clip_grad_norm")
  prepared = running.prepare(impl, "clip_grad_norm", inputs.leaves, inputs.threshold)
  assert all(x.committed and devices.where(x, "jax") == "cpu" for x in prepared.leaves)
  outcome = running.call(impl, "clip_grad_norm", inputs)
  assert outcome.error is None and outcome.misplaced == ""
  with running.on_device("cpu:1"):  # this process has one JAX host device
    missing = running.call(impl, "clip_grad_norm", inputs)
    assert running.device() == devices.parse("cpu:1")
  assert running.device() == devices.HOST
  assert isinstance(missing.error, devices.DeviceUnavailable)


def test_a_deleted_input_is_found_by_the_device_check_on_any_device() -> None:
  impl = registry.load("clipbench.conformance.broken:donates_inputs")
  outcome = running.call(impl, "clip_grad_norm",
                         running.SESSION.inputs(case_named("random_float32"), "clip_grad_norm"))
  assert outcome.error is None and outcome.leaves  # right outputs...
  assert outcome.misplaced == "deleted its input leaves[0] (donated it to a computation?)"
  assert outcome.mutated == [0, 1, 2]  # ...but the caller's arrays are gone


def _conform(tmp_path, *args: str) -> tuple[int, str, pd.DataFrame | None]:
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
  env.pop("XLA_FLAGS", None)
  done = subprocess.run([sys.executable, "-m", "clipbench", "conform", "--results",
                         str(tmp_path / "out.csv"), *args], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600, check=False)
  table = (pd.read_csv(tmp_path / "out.csv", dtype=str, keep_default_na=False)
           if (tmp_path / "out.csv").exists() else None)
  return done.returncode, done.stdout + done.stderr, table


def test_on_a_second_jax_host_device_the_wrong_device_is_caught(tmp_path) -> None:
  rc, out, table = _conform(
      tmp_path, "--device", "cpu:1", "--impl", "optax.clip_by_global_norm",
      "--impl", "clipbench.conformance.broken:returns_on_another_device",
      "--", "-k", "(rule12 and random_float32) or jit-clip_3_4 or vmap-clip_3_4 or "
      "(rule4 and clip_3_4_to_1)")
  assert rc == 1, out
  assert set(table["device"]) == {"cpu:1"}
  optax = table[table["impl"] == "optax.clip_by_global_norm"]
  assert dict(zip(optax["case"], optax["outcome"])) == {
      "random_float32": "pass", "device-random_float32": "pass", "jit-clip_3_4_to_1": "pass",
      "vmap-clip_3_4_to_1": "pass",
      "clip_3_4_to_1": "deviation"}  # its listed rounding, on this device as on the first
  planted = table[table["impl"] == "clipbench.conformance.broken:returns_on_another_device"]
  caught = planted[planted["case"] == "device-random_float32"]
  assert set(caught["outcome"]) == {"fail"}
  assert set(caught["observed"]) == {
      "on cpu:1: returned leaves[0] on cpu, not on cpu:1 where its inputs were"}
  # Its values are right: only the device check sees it.
  assert set(planted.loc[planted["rule"] == "4", "outcome"]) == {"pass"}


def test_on_a_gpu_an_input_moved_to_the_host_is_caught(tmp_path) -> None:
  if not devices.cuda_device_node_present():
    pytest.skip("needs a GPU: a host tensor has no other device to be moved to")
  rc, out, table = _conform(tmp_path, "--device", "cuda", "--impl",
                            "clipbench.conformance.broken:moves_inputs", "--", "-k",
                            "rule12 and device-clip_3_4_to_1")
  assert rc == 1, out
  assert set(table.loc[table["outcome"] == "fail", "observed"]) == {
      "on cuda: moved its input leaves[0] from cuda to cpu"}, table


def test_device_cuda_without_a_gpu_exits_2_in_one_line(tmp_path) -> None:
  if devices.cuda_device_node_present():
    pytest.skip("this machine has a GPU")
  rc, out, table = _conform(tmp_path, "--impl", "torch.clip_grad_norm_", "--device", "cuda")
  assert rc == 2 and table is None
  assert out.strip().splitlines() == [
      "clipbench: error: --device cuda: no CUDA GPU on this machine (no /dev/nvidia* device "
      "node)"]


def test_a_manifest_entry_may_name_the_device_kind_it_holds_on(tmp_path) -> None:
  path = tmp_path / "m.toml"
  path.write_text(textwrap.dedent('''
      [[deviation]]
      impl = "mylib"
      rule = 4
      cases = ["subnormals_clipped"]
      reason = "a GPU keeps subnormals its CPU flushes"
      severity = "rounding-level"
      device = "cuda"
      '''))
  (entry,) = manifest.load(str(path))
  assert entry.device == "cuda"
  found = lambda device: manifest.find([entry], "mylib", "clip_grad_norm", 4,
                                       "subnormals_clipped", devices.parse(device))
  assert found("cuda") is entry and found("cuda:1") is entry
  assert found("cpu") is None and found("cpu:1") is None
  path.write_text(path.read_text().replace('"cuda"', '"gpu"'))
  with pytest.raises(ValueError, match=r'device must be one of cpu, cuda \(or "\*"\)'):
    manifest.load(str(path))


def test_draft_entries_from_a_gpu_run_name_the_device(tmp_path) -> None:
  rows = [dict(impl="mylib", op="clip_grad_norm", rule=4, case="clip_3_4_to_1", outcome="fail",
               device=device) for device in ("cuda", "cpu")]
  table = tmp_path / "r.csv"
  table.write_text(results.to_csv(rows))
  text = draft_deviations.draft(str(table))
  assert text.count("[[deviation]]") == 2 and text.count('device = "cuda"') == 1
