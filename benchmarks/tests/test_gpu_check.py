"""``make gpu-check`` where it can be tested: without a GPU, the peak table, the report it runs.

The report itself (``clipbench report --device cuda``) needs a GPU and is not run here; its
device path runs on the CPU in the conformance suite's own tests (``--device cpu``, ``cpu:1``)
and its GPU section in ``reports/tests``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from clipbench.benchmarks import gpu_check


@pytest.mark.parametrize("args, status", [([], 0), (["--present"], 1)])
def test_without_a_gpu_it_says_so_in_one_line(args: list[str], status: int) -> None:
  # An empty CUDA_VISIBLE_DEVICES hides any GPU from torch, so this holds on a GPU machine too.
  env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
  done = subprocess.run([sys.executable, "-m", "clipbench.benchmarks.gpu_check", *args],
                        env=env, capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == status, done.stderr
  lines = done.stdout.strip().splitlines()
  assert len(lines) == 1
  assert lines[0].startswith("gpu-check: no CUDA GPU") and "nothing checked" in lines[0]


def test_no_gpu_reason_names_the_missing_device_node(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setattr(gpu_check.devices, "cuda_device_node_present", lambda: False)
  assert "no /dev/nvidia" in gpu_check.no_gpu_reason()
  assert gpu_check.main([]) == 0 and gpu_check.main(["--present"]) == 1


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 3350.0),
    ("NVIDIA H100 PCIe", 2000.0),
    ("NVIDIA H100 NVL", 3900.0),
    ("NVIDIA H200", 4800.0),
    ("NVIDIA H200 NVL", 4800.0),
    ("NVIDIA A100-SXM4-80GB", 2039.0),
    ("NVIDIA A100-SXM4-40GB", 1555.0),
    ("NVIDIA A100-PCIE-40GB", 1555.0),
    ("NVIDIA A100 80GB PCIe", 1935.0),
    ("NVIDIA GH200 480GB", None),  # not an H200
    ("NVIDIA A100", None),          # 40 or 80 GB: not guessed
    ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_bandwidth_by_device_name(name: str, peak: float | None) -> None:
  assert gpu_check.peak_bandwidth_gbs(name) == peak


def _option(cmd: list[str], name: str) -> str | None:
  return cmd[cmd.index(name) + 1] if name in cmd else None


def test_the_report_runs_on_cuda_beside_the_cpu_report_within_its_budget() -> None:
  cmd = gpu_check.report_command([])
  assert cmd[:6] == [sys.executable, "-m", "clipbench", "report", "--device", "cuda"]
  assert _option(cmd, "--latest") == "latest-gpu"  # reports/latest/ stays the CPU's
  assert _option(cmd, "--results-dir") == os.path.join("results", "gpu")
  assert float(_option(cmd, "--budget")) > 0 and int(_option(cmd, "--jobs")) >= 1
  assert "--quick" in cmd


def test_report_options_given_replace_the_defaults() -> None:
  cmd = gpu_check.report_command(["--jobs", "3", "--budget=30", "--scale", "0.5",
                                  "--impl", "torch.clip_grad_norm_"])
  assert cmd.count("--jobs") == 1 and _option(cmd, "--jobs") == "3"
  assert "--budget=30" in cmd and "--budget" not in cmd
  assert "--quick" not in cmd  # a scale given is the benchmarks' size
  assert cmd[-2:] == ["--impl", "torch.clip_grad_norm_"]
  assert "--quick" not in gpu_check.report_command(["--profile", "thorough"])


def test_with_a_gpu_it_runs_the_report_compiled_and_returns_its_status(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
  calls = []

  def report(cmd, env):
    calls.append((cmd, env))
    return 1  # a failed report fails the check

  monkeypatch.setattr(gpu_check, "no_gpu_reason", lambda: None)
  monkeypatch.setattr(gpu_check.subprocess, "call", report)
  monkeypatch.setenv("TRITON_INTERPRET", "1")
  assert gpu_check.main(["--present"]) == 0 and not calls
  assert gpu_check.main(["--jobs", "2"]) == 1
  (cmd, env), = calls
  assert cmd == gpu_check.report_command(["--jobs", "2"])
  assert "TRITON_INTERPRET" not in env  # on a GPU the Triton kernels are compiled
  assert capsys.readouterr().out.startswith("$ ")
