"""``make gpu-check`` where it can be tested: without a GPU, its report section, its proxies.

The GPU path itself (conformance children on CUDA, the CUDA benchmarks, the copy-bandwidth
probe) needs a GPU and is not run here.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from clipbench.benchmarks import gpu_check, workloads
from clipbench.impls import calling, registry


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0() -> None:
  # An empty CUDA_VISIBLE_DEVICES hides any GPU from torch, so this holds on a GPU machine too.
  env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
  done = subprocess.run([sys.executable, "-m", "clipbench.benchmarks.gpu_check"], env=env,
                        capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr
  lines = done.stdout.strip().splitlines()
  assert len(lines) == 1
  assert lines[0].startswith("gpu-check: no CUDA GPU") and "nothing checked" in lines[0]


def test_no_gpu_reason_names_the_missing_device_node(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setattr(gpu_check.timing, "cuda_device_node_present", lambda: False)
  assert "no /dev/nvidia" in gpu_check.no_gpu_reason()
  assert gpu_check.main([]) == 0


def test_bad_scale_is_a_usage_error_naming_it(capsys: pytest.CaptureFixture) -> None:
  with pytest.raises(SystemExit) as exit_info:
    gpu_check.main(["--scale", "-1"])
  assert exit_info.value.code == 2
  assert "--scale" in capsys.readouterr().err


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


def _fake_measurements():
  device = gpu_check.Device("NVIDIA H100 80GB HBM3", 3350.0, 2680.0, "torch 2.9, CUDA 13.0")
  conformance = [
      gpu_check.ConformanceRun("clipbench.torch@cuda", {"pass": 420, "not-applicable": 10}),
      gpu_check.ConformanceRun("clipbench.triton@cuda",
                               {"pass": 400, "fail": 3, "error": 1, "not-applicable": 26}, "", 1),
      gpu_check.ConformanceRun("clipbench.jax@cuda", {}, "jax has no GPU backend"),
  ]
  timings = [gpu_check.Timing("W1-model", "clipbench.triton", "float32", 0.0000670, 3000.0),
             gpu_check.Timing("W3-relax-large", "baseline.torch-index-add", "float32", 0.125,
                              1340.0)]
  return device, conformance, timings


def test_report_section_gives_achieved_bandwidth_against_peak_and_copy() -> None:
  device, conformance, timings = _fake_measurements()
  text = gpu_check.report_section(device, conformance, timings, scale=1.0)
  assert text.startswith("## GPU check: NVIDIA H100 80GB HBM3\n")
  assert ("torch 2.9, CUDA 13.0; peak 3,350 GB/s (datasheet); measured copy bandwidth "
          "2,680 GB/s (80% of peak).") in text
  assert "| W1-model | float32 | clipbench.triton | 0.067 ms | 3,000 | 90% | 112% |" in text
  assert ("| W3-relax-large | float32 | baseline.torch-index-add | 125 ms | 1,340 | 40% | 50% |"
          in text)
  assert "| clipbench.torch@cuda | conforms | 420 | 0 | 0 | 0 | 0 | 10 |" in text
  assert "| clipbench.triton@cuda | 4 failing | 400 | 0 | 3 | 0 | 1 | 26 |" in text
  assert ("| clipbench.jax@cuda | not run: jax has no GPU backend | – | – | – | – | – | – |"
          in text)


def test_report_section_on_an_unknown_card_says_unknown_peak() -> None:
  _, conformance, timings = _fake_measurements()
  device = gpu_check.Device("NVIDIA GeForce RTX 4090", None, 900.0)
  text = gpu_check.report_section(device, conformance, timings[:1], scale=0.1)
  assert "unknown peak (the card is not in gpu_check.PEAK_BANDWIDTH_GBS)" in text
  assert "measured copy bandwidth 900 GB/s." in text
  assert "| 3,000 | unknown peak | 333% |" in text
  assert "### CUDA benchmarks (scale 0.1)" in text


def test_report_section_without_timings_says_none_ran() -> None:
  device, conformance, _ = _fake_measurements()
  assert "No CUDA benchmark ran." in gpu_check.report_section(device, conformance, [], 1.0)


def test_verdicts_fail_on_the_exit_status_but_not_on_runs_that_could_not_start() -> None:
  assert not gpu_check.ConformanceRun("a", {}, "no backend").failed
  # A failed preflight leaves passes of the other operation and no failing row.
  preflight = gpu_check.ConformanceRun("a", {"pass": 117}, exit_status=1)
  assert preflight.failed and preflight.verdict == "clipbench conform exited 1"
  assert gpu_check.ConformanceRun("a", {"pass": 3, "error": 2}, exit_status=1).verdict == (
      "2 failing")
  assert gpu_check.ConformanceRun("a", {"deviation": 2}).verdict == "nothing passed"
  assert gpu_check.ConformanceRun("a", {"pass": 2}).verdict == "conforms"


def test_cuda_benchmarks_cover_the_baseline_and_the_own_gpu_kernels() -> None:
  names = gpu_check.cuda_benchmarked_impls()
  assert {"clipbench.torch", "clipbench.triton", "baseline.torch-index-add"} <= set(names)
  assert "clipbench.numba" not in names


def test_on_device_proxy_returns_the_implementations_bits_on_the_host() -> None:
  proxy = gpu_check.OnDevice("baseline.torch-index-add", "cpu")
  impl = registry.load("baseline.torch-index-add")
  assert proxy.name == "baseline.torch-index-add@cpu" and proxy.capabilities.transforms == ()
  inputs = workloads.get("W2-relax").build(0.002, "float32")
  kwargs = dict(segments=inputs.segments, num_systems=inputs.num_systems)
  direct = calling.call(impl, "clip_by_global_norm", inputs.leaves, inputs.threshold, **kwargs)
  wrapped = registry.load("baseline.torch-index-add")
  wrapped.obj = proxy
  through = calling.call(wrapped, "clip_by_global_norm", inputs.leaves, inputs.threshold,
                         **kwargs)
  for a, b in zip(direct[0], through[0]):
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
  np.testing.assert_array_equal(direct[1], through[1])


def test_on_device_proxy_refuses_outputs_left_off_the_device(
    monkeypatch: pytest.MonkeyPatch) -> None:
  proxy = gpu_check.OnDevice("baseline.torch-index-add", "cpu")
  monkeypatch.setattr(proxy, "_on_device", lambda x: False)
  leaves = [np.ones((2, 3), np.float32)]
  import torch
  with pytest.raises(RuntimeError, match="off cpu"):
    proxy.clip_by_global_norm([torch.from_numpy(leaves[0])], 1.0)


def test_on_device_proxy_lets_norms_of_no_leaves_stay_on_the_host(
    monkeypatch: pytest.MonkeyPatch) -> None:
  # With no leaves nothing tells the implementation the device: host norms are no fault.
  proxy = gpu_check.OnDevice("baseline.torch-index-add", "cpu")
  monkeypatch.setattr(proxy, "_on_device", lambda x: False)
  out, norms = proxy.clip_by_global_norm([], 1.0)
  assert list(out) == [] and np.asarray(norms).tolist() == [0.0]


def test_on_device_proxy_declares_only_its_device_so_sharded_runs_skip_it() -> None:
  from clipbench.conformance.sharding import checks  # pylint: disable=import-outside-toplevel
  proxy = gpu_check.OnDevice("clipbench.torch", "cpu")
  assert proxy.capabilities.devices == ("cpu",) and checks.off_host_reason(proxy) is None
  on_cuda = types.SimpleNamespace(capabilities=dataclasses.replace(proxy.capabilities,
                                                                  devices=("cuda",)))
  assert "cuda only" in checks.off_host_reason(on_cuda)


def test_outcomes_are_counted_past_the_csv_modules_field_limit(tmp_path) -> None:
  table = tmp_path / "results.csv"
  table.write_text("impl,outcome,reproducer\n"
                   f"a@cuda,pass,\"{'x' * 200_000}\"\n"
                   "a@cuda,fail,short\nb@cuda,pass,short\n")
  assert gpu_check.count_outcomes(str(table), "a@cuda") == {"pass": 1, "fail": 1}


@pytest.mark.parametrize("bad,match", [
    (dict(impl_name="baseline.torch-index-add", device="tpu"), "device"),
    (dict(impl_name="clipbench.numba"), "impl_name: clipbench.numba is a numpy"),
    (dict(impl_name="torch.clip_grad_norm_"), "impl_name: .*in place"),
])
def test_on_device_proxy_refuses_what_it_cannot_run(bad: dict, match: str) -> None:
  with pytest.raises(ValueError, match=match):
    gpu_check.OnDevice(**bad)


def test_conformance_children_run_concurrently_each_with_its_own_log(
    monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture) -> None:
  # Stand-in children: each waits until all of them have started (so --jobs 5 must run them
  # at once), writes a result table and exits; the jax child fails.
  started = tmp_path / "started"
  started.mkdir()
  child = (
      "import csv, os, sys, time\n"
      "attr, results, impl, rc = sys.argv[1:5]\n"
      "open(os.path.join(sys.argv[5], attr), 'w').close()\n"
      "deadline = time.time() + 120\n"
      "while len(os.listdir(sys.argv[5])) < 5 and time.time() < deadline: time.sleep(0.05)\n"
      "print('child', attr, 'saw', len(os.listdir(sys.argv[5])), 'started')\n"
      "with open(results, 'w', newline='') as f:\n"
      "  w = csv.DictWriter(f, ['impl', 'outcome']); w.writeheader()\n"
      "  w.writerow({'impl': impl, 'outcome': 'pass'})\n"
      "  w.writerow({'impl': impl, 'outcome': 'fail' if rc != '0' else 'pass'})\n"
      "sys.exit(int(rc))\n")

  def command(attr: str, results_csv: str) -> list[str]:
    rc = "1" if attr == "jax_on_cuda" else "0"
    return [sys.executable, "-c", child, attr, results_csv, f"{gpu_check.ON_CUDA[attr]}@cuda",
            rc, str(started)]

  monkeypatch.setattr(gpu_check, "conformance_command", command)
  available = types.SimpleNamespace(available=True, reason="", framework="torch")
  monkeypatch.setattr(gpu_check.registry, "load", lambda name: available)
  runs = gpu_check.run_conformance(str(tmp_path), jobs=5)
  assert [r.impl for r in runs] == [f"{n}@cuda" for n in gpu_check.ON_CUDA.values()]
  by_impl = {r.impl: r for r in runs}
  assert by_impl["clipbench.jax@cuda"].failed
  assert by_impl["clipbench.jax@cuda"].counts == {"pass": 1, "fail": 1}
  assert [r.verdict for r in runs if r.impl != "clipbench.jax@cuda"] == ["conforms"] * 4
  for attr in gpu_check.ON_CUDA:
    log = (tmp_path / f"conformance-{attr}.log").read_text()
    assert f"child {attr} saw 5 started" in log
  assert capsys.readouterr().out.count("--- clipbench.") == 5


def test_bad_jobs_is_a_usage_error_naming_it(capsys: pytest.CaptureFixture) -> None:
  with pytest.raises(SystemExit) as exit_info:
    gpu_check.main(["--jobs", "0"])
  assert exit_info.value.code == 2
  assert "--jobs" in capsys.readouterr().err


def test_children_import_the_proxies_by_the_module_name_even_when_run_as_main(
    monkeypatch: pytest.MonkeyPatch) -> None:
  # `python -m clipbench.benchmarks.gpu_check` runs this module as "__main__", which a child
  # process cannot import the proxies from.
  monkeypatch.setattr(gpu_check, "__name__", "__main__")
  cmd = gpu_check.conformance_command("torch_on_cuda", "out.csv")
  assert cmd[cmd.index("--impl") + 1] == "clipbench.benchmarks.gpu_check:torch_on_cuda"


def test_an_unreadable_result_table_fails_its_run_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
  # The first run on a GPU lost a child still running when one table could not be read.
  def command(attr: str, results_csv: str) -> list[str]:
    body = "no header at all\n" if attr == "torch_on_cuda" else "impl,outcome\nx@cuda,pass\n"
    return [sys.executable, "-c", f"open({results_csv!r}, 'w').write({body!r})"]

  monkeypatch.setattr(gpu_check, "conformance_command", command)
  available = types.SimpleNamespace(available=True, reason="", framework="torch")
  monkeypatch.setattr(gpu_check.registry, "load", lambda name: available)
  runs = gpu_check.run_conformance(str(tmp_path), jobs=2)
  assert [r.failed for r in runs] == [True, False, False, False, False]
  assert runs[0].verdict == "clipbench conform exited 1"


def test_an_interrupted_check_leaves_no_child_running(
    monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
  started = []
  real_popen = subprocess.Popen

  def popen(*args, **kwargs):
    started.append(real_popen(*args, **kwargs))
    return started[-1]

  def interrupted(running):
    raise KeyboardInterrupt  # Ctrl-C while the children run

  monkeypatch.setattr(gpu_check, "conformance_command",
                      lambda attr, csv: [sys.executable, "-c", "import time; time.sleep(600)"])
  monkeypatch.setattr(gpu_check.registry, "load", lambda name: types.SimpleNamespace(
      available=True, reason="", framework="torch"))
  monkeypatch.setattr(gpu_check.subprocess, "Popen", popen)
  monkeypatch.setattr(gpu_check, "_first_done", interrupted)
  monkeypatch.setattr(gpu_check.child_run, "CHILD_STOP_GRACE_S", (0.1, 0.5, 0.5))
  with pytest.raises(KeyboardInterrupt):
    gpu_check.run_conformance(str(tmp_path), jobs=2)
  assert len(started) == 2 and all(p.poll() is not None for p in started)
