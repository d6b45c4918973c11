"""asv's configuration: the benchmark folder it imports, the launch method that relies on it,
and the peak memory measured under it.

asv's forkserver imports every module of the benchmark folder once and forks each benchmark
process from that process: what those modules load, every process starts with. They import the
frameworks (``grid_point.PRELOADED_MODULES``) so that no process pays for that, and nothing
that starts a thread, a process or a CUDA context: a fork carries none of those along.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from clipbench.benchmarks import grid_point

REPO = pathlib.Path(__file__).resolve().parents[2]
NOT_PRELOADED = ("tensorflow", "keras", "mlx", "deepspeed", "optax", "kups", "numba.cuda")


def _asv_conf() -> dict:
  from asv import util  # pylint: disable=import-outside-toplevel
  return util.load_json(str(REPO / "asv.conf.json"), js_comments=True)


def _benchmark_dir() -> pathlib.Path:
  return REPO / _asv_conf()["benchmark_dir"]


# What asv's forkserver runs before it forks anything (asv_runner.server, "preimport"), with
# numpy imported first: its BLAS thread pool is the one thread the suite had before preloading.
# COMMAND is the asv command the process was started for (`benchmark.py COMMAND DIR ...`).
_PREIMPORT = """
import json, os, sys
import numpy
sys.argv = ["benchmark.py", COMMAND, BENCHMARK_DIR, "socket"]

def threads():
  return len(os.listdir("/proc/self/task"))

def children():
  return sum(len(open(f"/proc/self/task/{t}/children").read().split())
             for t in os.listdir("/proc/self/task"))

threads_before = threads()
from asv_runner._aux import update_sys_path
from asv_runner.discovery import disc_benchmarks
update_sys_path(BENCHMARK_DIR)
names = [b.name for b in disc_benchmarks(BENCHMARK_DIR)]
modules = sorted(sys.modules)
import torch
from jax._src import xla_bridge
server = {"names": names, "modules": modules,
          "threads": [threads_before, threads()], "children": children(),
          "torch_cuda_initialized": torch.cuda.is_initialized(),
          "jax_backends_initialized": xla_bridge.backends_are_initialized()}
"""


def _run_preimported(code: str, command: str = grid_point.ASV_FORKSERVER_COMMAND) -> dict:
  """Runs ``code`` after the suite's import by an asv process started for ``command`` (the
  forkserver by default), in a process of its own; its last line printed is JSON."""
  source = (_PREIMPORT.replace("BENCHMARK_DIR", repr(str(_benchmark_dir())))
            .replace("COMMAND", repr(command)) + code)
  out = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                       check=True, timeout=300)
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def forkserver_state() -> dict:
  return _run_preimported("print(json.dumps(server))\n")


def test_asv_forks_from_a_server_that_imported_the_suite() -> None:
  from asv import benchmark  # pylint: disable=import-outside-toplevel
  from asv_runner import server  # pylint: disable=import-outside-toplevel
  conf = _asv_conf()
  assert conf["launch_method"] == "forkserver"
  assert _benchmark_dir().is_dir()
  # The command asv starts its forkserver with, as the suite recognizes it.
  assert benchmark.commands[grid_point.ASV_FORKSERVER_COMMAND] is server._run_server
  assert grid_point.in_asv_forkserver(["benchmark.py", "run_server", "dir", "socket"])
  assert not grid_point.in_asv_forkserver(["benchmark.py", "discover", "dir", "out.json"])


def test_asv_processes_that_fork_nothing_import_no_framework() -> None:
  # Discovery, `asv check` and setup_cache import the suite once each: preloading there would
  # only add the frameworks' import to each of them.
  for command in ("discover", "check", "setup_cache"):
    modules = set(_run_preimported("print(json.dumps(server))\n", command)["modules"])
    assert not modules & {"torch", "jax", "numba", *NOT_PRELOADED}, command


def test_forkserver_imports_the_suite_and_the_preloaded_frameworks(forkserver_state: dict) -> None:
  names, modules = forkserver_state["names"], set(forkserver_state["modules"])
  assert "bench_clipping.GlobalCpu.time_clip" in names
  assert "bench_clipping.Machine.track_bandwidth_gbs" in names
  assert {f"bench_clipping.CudaRouteCosts.track_{m}" for m in
          ("operators", "triton_launches", "host_transfers")} <= set(names)
  assert all(name.startswith("bench_clipping.") for name in names)
  assert set(grid_point.PRELOADED_MODULES) <= modules
  assert not modules & set(NOT_PRELOADED)


def test_preloaded_frameworks_start_no_thread_process_or_cuda(forkserver_state: dict) -> None:
  # A fork copies the calling thread alone, and a CUDA context not at all.
  threads_before, threads_after = forkserver_state["threads"]
  assert threads_after == threads_before
  assert forkserver_state["children"] == 0
  assert not forkserver_state["torch_cuda_initialized"]
  assert not forkserver_state["jax_backends_initialized"]


def test_a_forked_process_runs_torch_jax_and_numba_points(tmp_path: pathlib.Path) -> None:
  # As asv does: fork the server, then run a speed class's setup and timed call in the child.
  code = f"""
import os, signal, traceback
os.environ["{grid_point.SCALE_ENV}"] = "0.001"
os.environ["{grid_point.JAX_CACHE_ENV}"] = {str(tmp_path / "jax-cache")!r}
from clipbench.benchmarks import bench_clipping
outcomes = {{}}
for impl in IMPLS:
  read, write = os.pipe()
  pid = os.fork()
  if pid == 0:
    signal.alarm(120)  # a child that hangs (a lock held at the fork) dies instead
    try:
      os.close(read)
      run = {{"bandwidth_bytes": 1e10, "run_dir": None}}
      point = (impl, "W1-model", "float32", "cpu")
      speed = bench_clipping.GlobalCpu()
      speed.setup(run, *point)
      speed.time_clip(run, *point)
      os.write(write, b"ran")
    except BaseException:
      os.write(write, traceback.format_exc().encode())
    finally:
      os._exit(0)
  os.close(write)
  with os.fdopen(read) as f:
    outcomes[impl] = f.read()
  os.waitpid(pid, 0)
print(json.dumps(outcomes))
"""
  impls = ("torch.clip_grad_norm_.foreach", "optax.clip_by_global_norm", "clipbench.numba")
  outcomes = _run_preimported(code.replace("IMPLS", repr(impls)))
  assert outcomes == dict.fromkeys(impls, "ran")


_LINUX_PROC = pathlib.Path("/proc/self/clear_refs").exists()


@pytest.mark.skipif(not _LINUX_PROC, reason="the peak RSS is reset through Linux's /proc")
def test_peak_rss_growth_counts_what_came_after_the_reset() -> None:
  # In a process of its own: memory freed by the test process would be reused without growth.
  code = """
import json, numpy as np
from clipbench.benchmarks import grid_point
before = np.ones(256 << 17)  # 256 MiB, touched, then freed: a peak before the reset
del before
start = grid_point.reset_peak_rss()
after = np.ones(64 << 17)  # 64 MiB
print(json.dumps([start, grid_point.peak_rss_growth_bytes(start)]))
"""
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       timeout=120)
  start, growth = json.loads(out.stdout.strip().splitlines()[-1])
  assert start > 0
  assert 64 << 20 <= growth < 128 << 20
  assert grid_point.peak_rss_growth_bytes(None) is None
