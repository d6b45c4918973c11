"""asv's configuration: the benchmark folder it imports, and the launch method that relies on it.

asv's forkserver imports every module of the benchmark folder once and forks each benchmark
process from that process: what those modules load, every process starts with. With no
framework there, no CUDA context is ever forked and each process loads only its point's
framework, as a process of its own would.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
FRAMEWORKS = ("torch", "jax", "tensorflow", "triton", "numba", "keras", "mlx", "deepspeed")


def _asv_conf() -> dict:
  from asv import util  # pylint: disable=import-outside-toplevel
  return util.load_json(str(REPO / "asv.conf.json"), js_comments=True)


def test_forkserver_imports_the_suite_and_no_framework() -> None:
  conf = _asv_conf()
  assert conf["launch_method"] == "forkserver"
  benchmark_dir = REPO / conf["benchmark_dir"]
  # What asv's forkserver runs before it forks anything (asv_runner.server, "preimport").
  code = ("import json, sys\n"
          "from asv_runner._aux import update_sys_path\n"
          "from asv_runner.discovery import disc_benchmarks\n"
          f"update_sys_path({str(benchmark_dir)!r})\n"
          f"names = [b.name for b in disc_benchmarks({str(benchmark_dir)!r})]\n"
          f"loaded = [m for m in {FRAMEWORKS!r} if m in sys.modules]\n"
          "print(json.dumps([names, loaded]))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       timeout=300)
  names, loaded = json.loads(out.stdout.strip().splitlines()[-1])
  assert loaded == []
  assert "bench_clipping.GlobalCpu.time_clip" in names
  assert "bench_clipping.Machine.track_bandwidth_gbs" in names
  assert all(name.startswith("bench_clipping.") for name in names)
