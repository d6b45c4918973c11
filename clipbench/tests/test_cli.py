"""The ``clipbench`` command: exit codes, errors, outside implementations, results handling.

Most tests call ``main(argv)`` in this process with pytest runs replaced by a fake that writes
what the real suite would (a results table, a benchmark JSON); three run for real in a
subprocess: ``clipbench list --json`` over every registered implementation, a short
``clipbench conform`` on an outside module, and the progress bar around a tiny pytest run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pandas as pd
import pytest

from clipbench import (child_run, cli, conform_command, files, loading, outputs, safe_range_run,
                       terminal)
from clipbench.impls import registry

REPORT_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "reports", "tests", "data")

OUTSIDE_MODULE = textwrap.dedent('''\
    """A tiny outside implementation: global L2 clip_grad_norm in numpy."""
    import numpy as np


    class _Impl:
      framework = "numpy"
      version = "0.0.1"
      # Declared, so the suite does not probe (and test) more than this sketch does.
      capabilities = {"norm_types": (2.0,), "dtypes": ("float32", "float64"),
                      "nonfinite": ("propagate",)}

      def clip_grad_norm(self, leaves, max_norm, *, norm_type=2.0, nonfinite="propagate"):
        if not max_norm >= 0:
          raise ValueError(f"max_norm: expected >= 0, got {max_norm}")
        wide = any(x.dtype == np.float64 for x in leaves)
        total = np.sqrt(sum(float(np.sum(np.square(x.astype(np.float64)))) for x in leaves))
        scale = 1.0 if total <= max_norm else max_norm / total
        out = [x if scale == 1.0 else (x.astype(np.float64) * scale).astype(x.dtype)
               for x in leaves]
        return out, (np.float64 if wide else np.float32)(total)


    impl = _Impl()
    ''')


@pytest.fixture
def outside(tmp_path, monkeypatch):
  """A working directory holding ``tmpmod.py`` (an outside implementation ``tmpmod:impl``)."""
  (tmp_path / "tmpmod.py").write_text(OUTSIDE_MODULE)
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(tmp_path))
  yield tmp_path
  sys.modules.pop("tmpmod", None)


class FakePytest:
  """Stands in for ``child_run.run_pytest``: records the command and its environment, writes the
  outputs the real run would, returns the given exit status."""

  def __init__(self, rc: int = 0, write=None):
    self.rc = rc
    self.write = write
    self.calls: list[tuple[list[str], dict[str, str]]] = []

  def __call__(self, cmd, label, log_path, *, progress=None, env_defaults=None,
               shown_paths=None):
    self.calls.append((list(cmd), child_run.child_env(env_defaults)))
    if self.write is not None:
      self.write(cmd)
    return self.rc


def _option(cmd: list[str], name: str) -> str:
  for i, arg in enumerate(cmd):
    if arg == name:
      return cmd[i + 1]
    if arg.startswith(name + "="):
      return arg.split("=", 1)[1]
  raise AssertionError(f"{name} not in {cmd}")


def write_conformance(cmd):
  shutil.copy(os.path.join(REPORT_DATA, "conformance.csv"), _option(cmd, "--results"))


def write_benchmarks(cmd):
  shutil.copy(os.path.join(REPORT_DATA, "benchmarks.json"), _option(cmd, "--benchmark-json"))


def fake_scan(impls, profile, results_path, env_defaults, **kwargs) -> int:
  """Stands in for ``safe_range_run.run_safe_range``: the recorded scan, exit status 0."""
  shutil.copy(os.path.join(REPORT_DATA, "safe_range.csv"), results_path)
  return 0


@pytest.fixture
def fake_run(monkeypatch):
  def install(rc=0, write=None) -> FakePytest:
    fake = FakePytest(rc, write)
    monkeypatch.setattr(child_run, "run_pytest", fake)
    monkeypatch.setattr(safe_range_run, "run_safe_range", fake_scan)
    return fake
  return install


# --- list ------------------------------------------------------------------------------------

def test_list_every_implementation_json():
  # A subprocess: importing every framework into the test process could clash (triton/tf).
  proc = subprocess.run([sys.executable, "-m", "clipbench.cli", "list", "--json"],
                        capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr
  rows = {r["name"]: r for r in json.loads(proc.stdout)}
  assert set(rows) == set(registry.names())
  ref = rows["reference"]
  assert ref["available"] and ref["kind"] == "reference" and ref["framework"] == "numpy"
  assert set(ref["ops"]) == {"clip_by_global_norm", "clip_by_max_step", "clip_grad_norm"}
  assert "per-system" in ref["capabilities_summary"]
  for row in rows.values():
    assert row["available"] or row["reason"], row  # unavailable always says why


def test_list_table(capsys):
  assert cli.main(["list", "--impl", "reference"]) == 0
  out = capsys.readouterr().out
  assert "reference" in out and "clip_by_max_step" in out and "any p" in out


def test_list_outside_module(outside, capsys):
  assert cli.main(["list", "--impl", "tmpmod:impl", "--json"]) == 0
  (row,) = json.loads(capsys.readouterr().out)
  assert (row["name"], row["kind"], row["framework"], row["ops"]) == (
      "tmpmod:impl", "outside", "numpy", ["clip_grad_norm"])
  assert row["available"] and row["version"] == "0.0.1"


def test_outside_module_found_from_working_directory_without_sys_path(outside, monkeypatch):
  # The console script's sys.path lacks the working directory; clipbench adds it.
  monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(outside))])
  sys.modules.pop("tmpmod", None)
  (impl,) = loading.load_requested(["tmpmod:impl"], require_available=True)
  assert impl.kind == "outside"


@pytest.mark.parametrize("argv", [
    ["list", "--impl", "no_such_impl"],
    ["conform", "--impl", "no_such_impl"],
    ["bench", "--impl", "no_such_impl"],
    ["report", "--impl", "no_such_impl"],
])
def test_unknown_impl_exits_2_with_message(argv, capsys, fake_run):
  fake = fake_run()
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert "unknown implementation 'no_such_impl'" in err and "registered:" in err
  assert not fake.calls  # nothing was run


def test_unimportable_outside_module_exits_2(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  assert cli.main(["conform", "--impl", "nosuchpkg.mod:impl"]) == 2
  assert "cannot import 'nosuchpkg.mod'" in capsys.readouterr().err


def test_unavailable_library_requested_by_name_exits_2(monkeypatch, capsys, fake_run):
  missing = registry.Implementation(name="optax.clip_by_global_norm", target="x:y",
                                    kind="library", library="optax",
                                    reason="not installed: optax")
  monkeypatch.setattr(registry, "load", lambda spec: missing)
  fake = fake_run()
  for command in ("conform", "bench", "report"):
    assert cli.main([command, "--impl", "optax.clip_by_global_norm"]) == 2
    assert "unavailable here: not installed: optax" in capsys.readouterr().err
  assert not fake.calls
  assert cli.main(["list", "--impl", "optax.clip_by_global_norm"]) == 0  # list just shows it


@pytest.mark.parametrize("argv, message", [
    (["conform", "--ops", "clip_everything"], "--ops: unknown operation(s) clip_everything"),
    (["conform", "--quick", "--profile", "thorough"], "contradicts --profile thorough"),
    (["conform", "--profile", "slow"], "invalid choice: 'slow'"),
    (["bench", "--workload", "W9-nope"], "unknown workload 'W9-nope'"),
    (["bench", "--scale", "-1"], "--scale: expected a positive number"),
    (["report", "--reuse", "-3"], "--reuse: expected a number of hours >= 0"),
    (["list", "--", "-x"], "list takes no pytest arguments"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "the following arguments are required"),
])
def test_bad_options_exit_2(argv, message, capsys, fake_run):
  fake = fake_run()
  assert cli.main(argv) == 2
  assert message in capsys.readouterr().err
  assert not fake.calls


def test_help_exits_0(capsys):
  assert cli.main(["--help"]) == 0
  assert "conform" in capsys.readouterr().out


# --- conform ---------------------------------------------------------------------------------

def test_conform_outside_module_command_and_results(outside, fake_run, capsys):
  fake = fake_run(rc=0, write=write_conformance)
  results = outside / "out" / "conformance.csv"
  rc = cli.main(["conform", "--impl", "tmpmod:impl", "--ops", "clip_grad_norm", "--quick",
                 "--results", str(results), "--", "-k", "rule3"])
  assert rc == 0
  (cmd, env), = fake.calls
  assert cmd[:3] == [sys.executable, "-m", "pytest"]
  assert cmd[3] == conform_command.conformance_dir() and os.path.isdir(cmd[3])
  assert _option(cmd, "--impl") == "tmpmod:impl"
  assert _option(cmd, "--ops") == "clip_grad_norm"
  assert _option(cmd, "--profile") == "ci"
  assert cmd[-2:] == ["-k", "rule3"]
  assert env["PYTHONPATH"].split(os.pathsep)[0] == str(outside)
  assert results.exists() and "rows" in capsys.readouterr().out
  assert _option(cmd, "--results") != str(results)  # the run writes beside, then it is moved


@pytest.mark.parametrize("device, gpu, caller, expected", [
    ("cpu", False, None, "1"),   # no GPU: the Triton kernels are checked through the interpreter
    ("cpu", False, "0", "0"),    # the caller's own setting wins
    ("cpu", True, None, "1"),    # host tensors: interpreted, whatever the machine has
    ("cuda", True, None, None),  # a GPU: compiled kernels on CUDA tensors, nothing set
])
def test_conform_runs_triton_interpreted_on_the_host(tmp_path, fake_run, monkeypatch, device,
                                                     gpu, caller, expected):
  from clipbench import devices
  monkeypatch.setattr(devices, "cuda_device_node_present", lambda: gpu)
  monkeypatch.setattr(devices, "framework_device", lambda device, framework: None)
  for name in devices.SHARED_CARD_ENVIRONMENT:  # restored after the test, as they were
    monkeypatch.delenv(name, raising=False)
  if caller is None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
  else:
    monkeypatch.setenv("TRITON_INTERPRET", caller)
  fake = fake_run(rc=0, write=write_conformance)
  assert cli.main(["conform", "--impl", "reference", "--device", device, "--results",
                   str(tmp_path / "conformance.csv")]) == 0
  (cmd, env), = fake.calls
  assert env.get("TRITON_INTERPRET") == expected
  if device == "cuda":
    # JAX and TensorFlow grow their memory on the card as they need it, beside torch.
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert _option(cmd, "--device") == "cuda"
  else:
    assert "--device" not in cmd and "XLA_PYTHON_CLIENT_PREALLOCATE" not in env


def test_conform_failures_keep_new_results_and_pytest_status(tmp_path, fake_run):
  fake_run(rc=1, write=write_conformance)
  results = tmp_path / "conformance.csv"
  assert cli.main(["conform", "--impl", "reference", "--results", str(results)]) == 1
  assert results.exists()


@pytest.mark.parametrize("rc, write, expected_rc, message", [
    (3, write_conformance, 3, "did not complete (pytest exit status 3)"),
    (4, None, 4, "did not complete (pytest exit status 4)"),
    (0, None, 1, "wrote no results table"),
    (0, lambda cmd: open(_option(cmd, "--results"), "w").write("garbage\n"), 1,
     "the new results table is unreadable"),
])
def test_failed_conform_run_never_overwrites_good_results(tmp_path, fake_run, capsys, rc, write,
                                                          expected_rc, message):
  results = tmp_path / "conformance.csv"
  shutil.copy(os.path.join(REPORT_DATA, "conformance.csv"), results)
  good = results.read_bytes()
  fake_run(rc=rc, write=write)
  assert cli.main(["conform", "--impl", "reference", "--results", str(results)]) == expected_rc
  assert results.read_bytes() == good
  err = capsys.readouterr().err
  assert message in err and "left as it was" in err
  assert os.listdir(tmp_path) == ["conformance.csv"]  # no temporary file left behind


def _console_script() -> list[str]:
  """The installed ``clipbench`` script (its sys.path lacks the working directory, unlike
  ``python -m``), or ``python -m clipbench.cli`` where it is not installed."""
  script = os.path.join(os.path.dirname(sys.executable), "clipbench")
  return [script] if os.access(script, os.X_OK) else [sys.executable, "-m", "clipbench.cli"]


def test_conform_outside_module_for_real(tmp_path):
  """The whole path: console script, pytest child, outside module from the working dir."""
  (tmp_path / "tmpmod.py").write_text(OUTSIDE_MODULE)
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  proc = subprocess.run(
      [*_console_script(), "conform", "--impl", "tmpmod:impl", "--ops", "clip_grad_norm",
       "--results", "res/conformance.csv", "--", "-k", "rule3"],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  from clipbench.reports import results
  table = results.read_conformance(tmp_path / "res" / "conformance.csv")
  assert set(table["impl"]) == {"tmpmod:impl"} and (table["outcome"] == "pass").any()
  # Past the command line, the output names the results where they are, never the staged file.
  printed = proc.stdout.split("\n", 1)[1]
  assert "res/conformance.csv" in printed and ".tmp" not in printed


# --- bench -----------------------------------------------------------------------------------

def test_bench_command_and_summary(tmp_path, fake_run, capsys):
  fake = fake_run(rc=0, write=write_benchmarks)
  out = tmp_path / "benchmarks.json"
  assert cli.main(["bench", "--impl", "reference", "--workload", "W1-model", "--quick",
                   "--json", str(out)]) == 0
  (cmd, _), = fake.calls
  assert cmd[3].endswith("bench_workloads.py")
  assert _option(cmd, "--bench-impl") == "reference"
  assert _option(cmd, "--bench-workload") == "W1-model"
  assert float(_option(cmd, "--bench-scale")) == cli.QUICK_SCALE
  assert out.exists()
  printed = capsys.readouterr().out
  assert "W4-many-small" in printed and "roofline ratio" in printed and "1.88x" in printed


@pytest.mark.parametrize("rc, write", [(1, write_benchmarks), (0, None),
                                       (0, lambda cmd: open(_option(cmd, "--benchmark-json"),
                                                            "w").write("{"))])
def test_failed_bench_keeps_old_results(tmp_path, fake_run, capsys, rc, write):
  out = tmp_path / "benchmarks.json"
  out.write_text('{"benchmarks": []}')
  fake_run(rc=rc, write=write)
  assert cli.main(["bench", "--impl", "reference", "--json", str(out)]) != 0
  assert out.read_text() == '{"benchmarks": []}'
  assert "left as it was" in capsys.readouterr().err
  assert os.listdir(tmp_path) == ["benchmarks.json"]



def _bench_table_rows(printed: str) -> dict[tuple[str, str, str], str]:
  """Each row of the printed bench tables by (workload, dtype, implementation): its line."""
  import re
  rows, title, in_body = {}, None, False
  for line in printed.splitlines():
    heading = re.fullmatch(r"\s*(W[\w-]+), (\w+)\s*", line)
    if heading:
      title, in_body = heading.groups(), False
    elif line.strip().startswith("─"):  # the rule under a table's header
      in_body = True
    elif not line.strip():
      in_body = False
    elif in_body and not line.startswith(" " * 8):  # not a wrapped verdict's second line
      rows[(*title, line.split()[0])] = line
  return rows


@pytest.mark.parametrize("checked", [True, False], ids=["after-conform", "never-conformed"])
def test_bench_table_shows_spread_roofline_and_the_last_conform_verdict(
    tmp_path, monkeypatch, fake_run, capsys, checked):
  from clipbench.reports import results, tables
  from clipbench.reports.build import fmt_number, fmt_seconds
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("COLUMNS", "200")  # every column shown, no verdict wrapped
  conformance = os.path.join(REPORT_DATA, "conformance.csv")
  if checked:  # what `clipbench conform` leaves in the working directory
    os.mkdir(tmp_path / "results")
    shutil.copy(conformance, tmp_path / "results" / "conformance.csv")
  fake_run(rc=0, write=write_benchmarks)
  assert cli.main(["bench", "--impl", "reference", "--json", str(tmp_path / "b.json")]) == 0
  printed = capsys.readouterr().out
  rows = _bench_table_rows(printed)
  table = results.read_conformance(conformance)
  with open(os.path.join(REPORT_DATA, "benchmarks.json"), encoding="utf-8") as f:
    recorded = json.load(f)["benchmarks"]
  assert len(rows) == len(recorded)
  for bench in recorded:
    info, stats = bench["extra_info"], bench["stats"]
    row = rows[(info["workload"], info["dtype"], info["impl"])]
    mine = table[table["impl"] == info["impl"]]
    verdict = (tables.verdict(mine)[0]
               if checked and len(mine) else "not checked")
    expected = [fmt_seconds(stats["median"]), fmt_seconds(stats["iqr"]), str(stats["rounds"]),
                fmt_number(stats["median"] / info["roofline_seconds"]), verdict]
    assert all(text in row for text in expected), (row, expected)
  assert "clipbench.numba" not in set(table["impl"])  # timed, never checked:
  assert all(row.rstrip().endswith("not checked") for key, row in rows.items()
             if key[2] == "clipbench.numba")
  # Which way is better, in the header of every table.
  tables_printed = len({key[:2] for key in rows})
  assert printed.count("lower") >= 2 * tables_printed and printed.count("higher") >= tables_printed


def test_bench_table_fits_an_80_column_terminal_with_names_and_verdicts_whole(
    tmp_path, monkeypatch, fake_run, capsys):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("COLUMNS", "80")
  os.mkdir(tmp_path / "results")
  shutil.copy(os.path.join(REPORT_DATA, "conformance.csv"), tmp_path / "results")
  fake_run(rc=0, write=write_benchmarks)
  assert cli.main(["bench", "--impl", "reference", "--json", str(tmp_path / "b.json")]) == 0
  printed = capsys.readouterr().out.split("\nresults: ")[0]  # the tables, not the file's path
  assert max(len(line) for line in printed.splitlines()) <= 80
  rows = _bench_table_rows(printed)
  assert ("W1-model", "float32", "optax.clip_by_global_norm") in rows  # the name not cut
  assert "GB/s" not in printed and "…" not in printed


def test_bench_table_says_why_verdicts_are_missing_when_the_table_is_unreadable(tmp_path,
                                                                                 capsys):
  from clipbench import bench_table
  broken = tmp_path / "conformance.csv"
  broken.write_text("not,a,results,table\n")
  assert bench_table.conformance_verdicts(str(broken)) == {}
  assert bench_table.conformance_verdicts(str(tmp_path / "absent.csv")) == {}
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "conformance verdicts not shown" in err and str(broken) in err


# --- report ----------------------------------------------------------------------------------

@pytest.fixture
def results_dir(tmp_path):
  folder = tmp_path / "results"
  folder.mkdir()
  shutil.copy(os.path.join(REPORT_DATA, "conformance.csv"), folder / "conformance.csv")
  shutil.copy(os.path.join(REPORT_DATA, "benchmarks.json"), folder / "benchmarks.json")
  shutil.copy(os.path.join(REPORT_DATA, "safe_range.csv"), folder / "safe_range.csv")
  return folder


def test_report_reuses_fresh_results(tmp_path, results_dir, fake_run, monkeypatch, capsys):
  monkeypatch.setattr(loading, "load_all", lambda progress=None: [])
  fake = fake_run()
  out = tmp_path / "reports"
  assert cli.main(["report", "--reuse", "--results-dir", str(results_dir), "--out", str(out),
                   "--asv-results", os.path.join(REPORT_DATA, "asv_results")]) == 0
  assert not fake.calls
  dated = [d for d in os.listdir(out) if d != "latest"]
  assert len(dated) == 1 and len(dated[0]) == len("2026-11-22_010203")
  html_text = (out / "latest" / "index.html").read_text()
  assert "History across commits" in html_text and "clipbench report --reuse" in html_text
  assert (out / "latest" / "REPORT.md").exists()
  captured = capsys.readouterr()
  assert "reusing" in captured.out and "conformance case(s) fail" in captured.err


def test_report_reruns_stale_results(tmp_path, results_dir, fake_run, monkeypatch):
  monkeypatch.setattr(loading, "load_all", lambda progress=None: [])
  old = time.time() - 48 * 3600
  os.utime(results_dir / "conformance.csv", (old, old))
  fake = fake_run(rc=0, write=lambda cmd: (write_conformance(cmd) if "--results" in cmd
                                           else write_benchmarks(cmd)))
  assert cli.main(["report", "--reuse", "24", "--quick", "--results-dir", str(results_dir),
                   "--out", str(tmp_path / "reports"), "--asv-results", str(tmp_path / "no-asv")]) == 0
  (cmd, _), = fake.calls  # only the stale conformance results were produced again
  assert _option(cmd, "--profile") == "ci"
  assert time.time() - os.path.getmtime(results_dir / "conformance.csv") < 3600


def test_report_passes_profile_and_scale(tmp_path, fake_run, monkeypatch):
  fake = fake_run(rc=0, write=lambda cmd: (write_conformance(cmd) if "--results" in cmd
                                           else write_benchmarks(cmd)))
  assert cli.main(["report", "--impl", "reference", "--profile", "thorough", "--scale", "0.1",
                   "--results-dir", str(tmp_path / "r"), "--out", str(tmp_path / "reports"),
                   "--asv-results", str(tmp_path / "no-asv")]) == 0
  (conform, _), (bench, _) = fake.calls
  assert _option(conform, "--profile") == "thorough"
  assert float(_option(bench, "--bench-scale")) == 0.1
  assert "--benchmark-max-time=0.2" not in bench  # not a quick run


def test_report_with_corrupt_results_exits_2_naming_the_file(tmp_path, results_dir, fake_run,
                                                              capsys):
  (results_dir / "benchmarks.json").write_text('{"benchmarks": [')
  fake_run()
  out = tmp_path / "reports"
  assert cli.main(["report", "--reuse", "--results-dir", str(results_dir),
                   "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert str(results_dir / "benchmarks.json") in err and "not valid JSON" in err
  assert not out.exists()


def test_report_stops_when_a_run_fails(tmp_path, fake_run, capsys):
  fake_run(rc=4)
  out = tmp_path / "reports"
  assert cli.main(["report", "--impl", "reference", "--results-dir", str(tmp_path / "r"),
                   "--out", str(out)]) == 4
  assert "no report written" in capsys.readouterr().err
  assert not out.exists()


def test_report_for_named_impls_only(tmp_path, results_dir, fake_run):
  fake_run()
  out = tmp_path / "reports"
  assert cli.main(["report", "--reuse", "--impl", "reference", "--results-dir",
                   str(results_dir), "--out", str(out), "--asv-results", str(tmp_path / "no-asv")]) == 0
  md = (out / "latest" / "REPORT.md").read_text()
  assert "| reference |" in md and "optax" not in md.split("## Machine")[0]


# --- progress --------------------------------------------------------------------------------

def test_progress_bar_run(tmp_path):
  (tmp_path / "test_tiny.py").write_text(
      "import pytest\n@pytest.mark.parametrize('i', range(3))\ndef test_a(i):\n  assert i < 2\n")
  log = tmp_path / "run.log"
  rc = child_run.run_pytest([sys.executable, "-m", "pytest", str(tmp_path / "test_tiny.py"), "-q",
                       "-p", "no:cacheprovider"], "tiny", str(log), progress=True)
  assert rc == 1
  text = log.read_text()
  assert "1 failed, 2 passed" in text and "-p clipbench.progress_plugin" in text


# --- nothing lost: Ctrl-C, temporary files, unwritable folders -------------------------------

def _leftovers(folder) -> list[str]:
  """Temporary files or folders anywhere under ``folder`` (hidden ones included)."""
  found = []
  for root, dirs, names in os.walk(folder):
    found += [os.path.join(root, n) for n in dirs + names if n.endswith(".tmp")]
  return found


def _group_gone(pgid: int, timeout_s: float) -> bool:
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    try:
      os.killpg(pgid, 0)
    except ProcessLookupError:
      return True
    time.sleep(0.1)
  return False


def test_ctrl_c_during_conform_leaves_no_temporary_file_and_keeps_old_results(tmp_path):
  """Ctrl-C at a terminal: SIGINT to the whole process group (clipbench and its pytest child)
  while the progress bar runs; every process of the group must be gone once clipbench exits."""
  import pty
  import re
  import signal
  import threading
  results_dir = tmp_path / "res"
  results_dir.mkdir()
  previous = results_dir / "conformance.csv"
  shutil.copy(os.path.join(REPORT_DATA, "conformance.csv"), previous)
  good = previous.read_bytes()
  master, terminal = pty.openpty()  # a terminal: clipbench runs pytest behind its progress bar
  proc = subprocess.Popen(
      [*_console_script(), "conform", "--impl", "clipbench.numba", "--ops", "clip_grad_norm",
       "--profile", "thorough", "--results", str(previous)],
      cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal,
      start_new_session=True, env={**os.environ, "COLUMNS": "100"},
      # As at a terminal: a run started in the background (`make test &`) inherits SIGINT
      # ignored, and Python then never raises KeyboardInterrupt.
      preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  os.close(terminal)
  screen = bytearray()

  def drain() -> None:
    with contextlib.suppress(OSError):
      while chunk := os.read(master, 4096):
        screen.extend(chunk)

  reader = threading.Thread(target=drain, daemon=True)
  reader.start()
  try:
    deadline = time.monotonic() + 240
    # The bar's "done/total" once a case has finished: the run is under way.
    # (Colour codes stripped: rich colours the count when the terminal says it can.)
    while not re.search(rb"\b[1-9]\d*/\d+\b",
                        re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b" ", bytes(screen))):
      assert proc.poll() is None, bytes(screen).decode(errors="replace")[-2000:]
      assert time.monotonic() < deadline, "no progress within 240 s"
      time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    rc = proc.wait(timeout=120)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
  assert _group_gone(proc.pid, 30), "the pytest child outlived clipbench"
  reader.join(timeout=5)
  os.close(master)
  output = bytes(screen).decode(errors="replace")
  assert rc == cli.EXIT_INTERRUPTED, output[-2000:]
  assert "interrupted" in output and "Traceback" not in output
  assert _leftovers(tmp_path) == []
  assert previous.read_bytes() == good


def test_staged_output_removed_on_ctrl_c_with_what_the_child_left(tmp_path):
  final = tmp_path / "conformance.csv"
  final.write_text("old\n")
  with pytest.raises(KeyboardInterrupt):
    with outputs.staged(str(final)) as staged:
      with open(staged, "w") as f:
        f.write("half")
      # What a child killed mid-write leaves: its own temporary file beside the staged one.
      open(os.path.join(os.path.dirname(staged), ".conformance.csv.x1y2.tmp"), "w").close()
      raise KeyboardInterrupt
  assert os.listdir(tmp_path) == ["conformance.csv"] and final.read_text() == "old\n"


@pytest.mark.parametrize("write", [
    lambda path: files.write_text(path, "new\n"),
    lambda path: files.write_bytes(path, b"new\n"),
    lambda path: files.write_csv(path, __import__("pandas").DataFrame({"a": [1]})),
])
def test_file_writers_remove_their_temporary_file_on_ctrl_c(tmp_path, monkeypatch, write):
  target = tmp_path / "table.csv"
  target.write_text("old\n")

  def interrupted(fd):
    raise KeyboardInterrupt  # Ctrl-C while the new file is being flushed to disk

  monkeypatch.setattr(os, "fsync", interrupted)
  with pytest.raises(KeyboardInterrupt):
    write(str(target))
  assert os.listdir(tmp_path) == ["table.csv"] and target.read_text() == "old\n"


def test_atomic_open_removes_its_temporary_file_when_interrupted_mid_write(tmp_path):
  target = tmp_path / "REPORT.md"
  target.write_text("old\n")
  with pytest.raises(KeyboardInterrupt):
    with files.atomic_open(target) as f:
      f.write("new, half written")
      raise KeyboardInterrupt
  assert os.listdir(tmp_path) == ["REPORT.md"] and target.read_text() == "old\n"


@pytest.fixture
def blocked(tmp_path):
  """A path no one can create folders under, root included: it lies under a regular file."""
  (tmp_path / "file").write_text("not a folder\n")
  return tmp_path / "file" / "sub"


@pytest.mark.parametrize("argv", [
    ["conform", "--impl", "reference", "--results", "{blocked}/conformance.csv"],
    ["bench", "--impl", "clipbench.numba", "--json", "{blocked}/benchmarks.json"],
    ["report", "--impl", "reference", "--out", "{blocked}", "--results-dir", "{tmp}/r"],
    ["report", "--impl", "reference", "--results-dir", "{blocked}", "--out", "{tmp}/reports"],
])
def test_unwritable_output_folder_exits_2_before_any_work(argv, blocked, tmp_path, fake_run,
                                                          capsys):
  fake = fake_run(rc=0, write=lambda cmd: (write_conformance(cmd) if "--results" in cmd
                                           else write_benchmarks(cmd)))
  argv = [a.format(blocked=blocked, tmp=tmp_path) for a in argv]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "Traceback" not in err
  assert f"cannot write to {blocked}" in err and "is not a folder" in err
  assert not fake.calls  # nothing was run
  assert sorted(os.listdir(tmp_path)) == ["file"]  # and nothing written


def test_read_only_output_folder_exits_2(tmp_path, fake_run, capsys):
  read_only = tmp_path / "ro"
  read_only.mkdir()
  read_only.chmod(0o555)
  try:
    try:
      with open(read_only / "probe", "w"):
        pass
    except PermissionError:
      pass
    else:  # root (CAP_DAC_OVERRIDE) writes anyway: the not-a-folder test covers root
      pytest.skip("this user can write into a read-only folder")
    fake = fake_run(rc=0, write=write_conformance)
    assert cli.main(["conform", "--impl", "reference",
                     "--results", str(read_only / "res" / "conformance.csv")]) == 2
    err = capsys.readouterr().err
    assert f"cannot write to {read_only / 'res'}" in err and "Permission denied" in err
    assert not fake.calls
  finally:
    read_only.chmod(0o755)


def test_check_writable_accepts_a_folder_to_be_created(tmp_path):
  files.check_writable(tmp_path / "a" / "b")  # created later, under a writable folder
  assert os.listdir(tmp_path) == []  # the check itself leaves nothing behind


def test_results_path_that_is_a_folder_exits_2(tmp_path, fake_run, capsys):
  fake = fake_run()
  assert cli.main(["conform", "--impl", "reference", "--results", str(tmp_path)]) == 2
  assert "is a folder; expected a file path" in capsys.readouterr().err
  assert not fake.calls


# --- report --reuse never leaves out a requested implementation ------------------------------

def test_report_reuse_without_a_requested_impl_exits_2_and_writes_nothing(
    outside, results_dir, fake_run, capsys):
  (outside / "othermod.py").write_text(OUTSIDE_MODULE)
  fake = fake_run()
  out = outside / "reports"
  try:
    rc = cli.main(["report", "--reuse", "--impl", "othermod:impl", "--impl", "reference",
                   "--results-dir", str(results_dir), "--out", str(out),
                   "--asv-results", str(outside / "no-asv")])
  finally:
    sys.modules.pop("othermod", None)
  assert rc == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1
  assert (f"{results_dir / 'conformance.csv'} has no conformance results for othermod:impl;"
          in err)
  assert "clipbench report --impl othermod:impl` without --reuse" in err
  assert not fake.calls and not out.exists()


def test_report_whose_run_lacks_a_requested_impl_writes_nothing(tmp_path, fake_run, capsys):
  # A run that (wrongly) wrote results for other implementations only.
  fake_run(rc=0, write=write_conformance)
  out = tmp_path / "reports"
  assert cli.main(["report", "--impl", "clipbench.numba", "--results-dir", str(tmp_path / "r"),
                   "--out", str(out)]) == 1
  assert "wrote no results for clipbench.numba" in capsys.readouterr().err
  assert not out.exists()


# --- --ops an implementation lacks -----------------------------------------------------------

@pytest.mark.parametrize("command", ["conform", "bench"])
def test_ops_an_implementation_lacks_exits_2_naming_both(command, outside, fake_run, capsys):
  fake = fake_run()
  assert cli.main([command, "--impl", "tmpmod:impl", "--ops", "clip_by_max_step"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1
  assert "implementation 'tmpmod:impl' has no clip_by_max_step" in err
  assert "(it provides: clip_grad_norm)" in err
  assert not fake.calls


def test_bench_ops_selects_the_workloads_of_those_ops(outside, fake_run, tmp_path):
  from clipbench.benchmarks import workloads
  fake = fake_run(rc=0, write=write_benchmarks)
  assert cli.main(["bench", "--impl", "tmpmod:impl", "--ops", "clip_grad_norm",
                   "--json", str(tmp_path / "b.json")]) == 0
  (cmd, _), = fake.calls
  chosen = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--bench-workload"]
  assert chosen == [w.name for w in workloads.WORKLOADS if w.op == "clip_grad_norm"]


# --- --version, list -------------------------------------------------------------------------

def test_version(capsys):
  from clipbench import __version__
  assert cli.main(["--version"]) == 0
  assert capsys.readouterr().out.strip() == f"clipbench {__version__}"
  proc = subprocess.run([sys.executable, "-m", "clipbench", "--version"], capture_output=True,
                        text=True, timeout=120, check=False)
  assert (proc.returncode, proc.stdout.strip()) == (0, f"clipbench {__version__}")


def test_list_fits_the_terminal_width(outside, monkeypatch, capsys):
  monkeypatch.setenv("COLUMNS", "80")
  assert cli.main(["list", "--impl", "reference", "--impl", "clipbench.numba",
                   "--impl", "tmpmod:impl", "--impl", "torch.clip_grad_norm_.foreach"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert max(len(line) for line in lines) <= 80
  assert lines[-1].endswith("┘")  # the table's last column is not cut off
  text = "\n".join(lines)
  assert "torch.clip_grad" in text and "clip_by_max_step" in text


def test_list_shows_clipbench_version_for_its_own_implementations(outside, capsys):
  from clipbench import __version__
  assert cli.main(["list", "--json", "--impl", "reference", "--impl", "clipbench.numba",
                   "--impl", "tmpmod:impl"]) == 0
  rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
  assert rows["reference"]["version"] == f"clipbench {__version__}"
  numba = rows["clipbench.numba"]
  assert numba["version"] == f"clipbench {__version__} (numba {numba['library_version']})"
  assert rows["tmpmod:impl"]["version"] == "0.0.1"  # an outside library keeps its own


# --- options passed to the suite, and its short summary --------------------------------------

@pytest.mark.parametrize("command", ["conform", "report"])
def test_deviations_and_timeout_passed_to_the_suite(command, tmp_path, fake_run):
  mine, theirs = tmp_path / "mine.toml", tmp_path / "theirs.toml"
  mine.write_text("")
  theirs.write_text("")
  fake = fake_run(rc=0, write=lambda cmd: (write_conformance(cmd) if "--results" in cmd
                                           else write_benchmarks(cmd)))
  argv = [command, "--impl", "reference", "--deviations", str(mine), "--deviations",
          str(theirs), "--timeout", "2.5"]
  argv += (["--results", str(tmp_path / "c.csv")] if command == "conform" else
           ["--results-dir", str(tmp_path / "r"), "--out", str(tmp_path / "reports"),
            "--asv-results", str(tmp_path / "no-asv")])
  assert cli.main(argv) == 0
  cmd = fake.calls[0][0]
  given = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--deviations"]
  assert given == [str(mine), str(theirs)]
  assert _option(cmd, "--clipbench-timeout") == "2.5"


@pytest.mark.parametrize("argv, message", [
    (["conform", "--deviations", "no-such.toml"], "--deviations: no such file: no-such.toml"),
    (["report", "--deviations", "no-such.toml"], "--deviations: no such file: no-such.toml"),
    (["conform", "--timeout", "0"], "--timeout: expected a positive number of seconds"),
    (["conform", "--timeout", "nan"], "--timeout: expected a positive number of seconds"),
])
def test_bad_suite_options_exit_2(argv, message, tmp_path, monkeypatch, fake_run, capsys):
  monkeypatch.chdir(tmp_path)
  fake = fake_run()
  assert cli.main(argv) == 2
  assert message in capsys.readouterr().err
  assert not fake.calls


PYTEST_LOG = """\
$ python -m pytest conformance --impl x
..F.F                                                                    [100%]
=================================== FAILURES ===================================
___________________________ test_rule[x-op-rule3-a] ____________________________
    def fixture_source_line_one():
E   AssertionError: long failure text
----------------------------- Captured stdout call -----------------------------
captured output line
=============================== warnings summary ===============================
some warning
---------------------------- clipbench conformance -----------------------------
rule 3: 2 failures
  x clip_grad_norm a: leaves changed
1 pass, 2 fail
=========================== short test summary info ============================
FAILED test_rule[x-op-rule3-a] - AssertionError: long failure text
========================= 2 failed, 1 passed in 0.50s ==========================
"""


def test_summary_tail_keeps_the_short_summary_not_the_failure_text():
  tail = child_run.summary_tail(PYTEST_LOG)
  assert "x clip_grad_norm a: leaves changed" in tail and "2 failed, 1 passed" in tail
  assert "fixture_source_line_one" not in tail and "some warning" not in tail
  assert "captured output line" not in tail
  assert "FAILED test_rule[x-op-rule3-a]" in tail
  assert len(child_run.summary_tail(PYTEST_LOG, limit=3).splitlines()) == 4


BROKEN_OUTSIDE_MODULE = OUTSIDE_MODULE.replace(
    "return out, (np.float64 if wide else np.float32)(total)",
    "return [np.zeros_like(x) for x in out], (np.float64 if wide else np.float32)(total)")


def test_conform_terminal_output_is_short_and_names_the_final_results(tmp_path, monkeypatch,
                                                                      capsys):
  """A real run behind the progress bar of an implementation that zeroes every leaf: the
  terminal gets one line per failure and the results' final path, never the staged one."""
  (tmp_path / "tmpmod.py").write_text(BROKEN_OUTSIDE_MODULE)
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(terminal, "interactive", lambda: True)
  try:
    rc = cli.main(["conform", "--impl", "tmpmod:impl", "--ops", "clip_grad_norm",
                   "--results", "res/conformance.csv", "--", "-k", "rule3"])
  finally:
    sys.modules.pop("tmpmod", None)
  out = capsys.readouterr().out
  assert rc == 1, out
  tail = out[out.index("clipbench conformance"):]
  assert "result table: res/conformance.csv" in tail and ".tmp" not in tail
  assert "Traceback" not in out and "def " not in out  # no fixture source, no tracebacks
  failing = sum(1 for line in tail.splitlines() if "tmpmod:impl clip_grad_norm" in line)
  assert failing >= 1 and len(tail.splitlines()) < failing + 15


# --- implementations side by side (--jobs) -----------------------------------------------------

def test_children_run_side_by_side_each_with_its_own_log(tmp_path, capsys):
  # Each child waits until all have started (so jobs=3 must run them at once), then exits
  # with its own status; each log holds its own child's output.
  started = tmp_path / "started"
  started.mkdir()
  child = textwrap.dedent(f"""\
      import os, sys, time
      open(os.path.join({str(started)!r}, sys.argv[1]), 'w').close()
      deadline = time.time() + 120
      while len(os.listdir({str(started)!r})) < 3 and time.time() < deadline:
        time.sleep(0.05)
      print('child', sys.argv[1], 'saw', len(os.listdir({str(started)!r})), 'started')
      sys.exit(int(sys.argv[2]))
      """)
  cmds = [[sys.executable, "-c", child, name, rc] for name, rc in (("a", "0"), ("b", "1"),
                                                                    ("c", "0"))]
  logs = [str(tmp_path / f"{name}.log") for name in "abc"]
  assert child_run.run_side_by_side(cmds, logs, jobs=3) == [0, 1, 0]
  for name, log in zip("abc", logs):
    assert f"child {name} saw 3 started" in open(log, encoding="utf-8").read()
  assert capsys.readouterr().out.count("--- exit status") == 3


def test_an_interrupted_side_by_side_run_leaves_no_child_running(tmp_path, monkeypatch):
  started = []
  real_popen = subprocess.Popen

  def popen(*args, **kwargs):
    started.append(real_popen(*args, **kwargs))
    return started[-1]

  def interrupted(running):
    raise KeyboardInterrupt  # Ctrl-C while the children run

  monkeypatch.setattr(child_run.subprocess, "Popen", popen)
  monkeypatch.setattr(child_run, "_first_ended", interrupted)
  monkeypatch.setattr(child_run, "CHILD_STOP_GRACE_S", (0.1, 0.5, 0.5))
  with pytest.raises(KeyboardInterrupt):
    child_run.run_side_by_side([[sys.executable, "-c", "import time; time.sleep(600)"]] * 3,
                               [str(tmp_path / f"{i}.log") for i in range(3)], jobs=2)
  assert len(started) == 2 and all(p.poll() is not None for p in started)


def test_conform_jobs_runs_one_child_per_implementation_and_joins_their_tables(
    tmp_path, monkeypatch, capsys):
  calls = []

  def side_by_side(cmds, logs, jobs, *, env_defaults=None, shown_paths=None):
    calls.append((cmds, logs, jobs))
    for cmd in cmds:  # each child's table: the recorded one, of its implementation only
      frame = pd.read_csv(os.path.join(REPORT_DATA, "conformance.csv"), dtype=str,
                          keep_default_na=False)
      frame[frame["impl"] == _option(cmd, "--impl")].to_csv(_option(cmd, "--results"),
                                                             index=False)
    return [0, 1]

  monkeypatch.setattr(child_run, "run_side_by_side", side_by_side)
  results = tmp_path / "conformance.csv"
  assert cli.main(["conform", "--impl", "reference", "--impl", "optax.clip_by_global_norm",
                   "--jobs", "4", "--budget", "30", "--results", str(results)]) == 1
  (cmds, logs, jobs), = calls
  assert jobs == 4 and [_option(c, "--impl") for c in cmds] == ["reference",
                                                               "optax.clip_by_global_norm"]
  assert all(_option(c, "--budget") == "30" for c in cmds)
  assert logs == [str(tmp_path / "conformance-reference.log"),
                  str(tmp_path / "conformance-optax.clip_by_global_norm.log")]
  from clipbench.reports import results as read
  joined = read.read_conformance(results)
  assert set(joined["impl"]) == {"reference", "optax.clip_by_global_norm"}
  assert os.listdir(tmp_path) == ["conformance.csv"]  # the children's tables went with the run


@pytest.mark.parametrize("argv, message", [
    (["conform", "--jobs", "0"], "--jobs: expected a positive number of children, got 0"),
    (["conform", "--budget", "-5"], "--budget: expected a positive number of seconds"),
    (["conform", "--device", "tpu"], "--device: expected cpu[:N] or cuda[:N], got 'tpu'"),
    (["bench", "--device", "cpu:1"], "--device cpu:1: the benchmarks run on cpu or cuda"),
    (["report", "--device", "cpu:1"], "--device cpu:1: a report runs on cpu or cuda"),
    (["report", "--latest", "../x"], "--latest: expected a folder name"),
    (["conform", "--impl", "clipbench.numba", "--device", "cpu:1"],
     "--device cpu:1: impl 'clipbench.numba' cannot run there: numpy arrays live on the host"),
])
def test_bad_device_options_exit_2_in_one_line_before_any_work(argv, message, capsys,
                                                              fake_run, monkeypatch):
  from clipbench import devices
  # A cpu:N accepted sets JAX's host device count for this process: restored after the test.
  for name in ("XLA_FLAGS", *devices.SHARED_CARD_ENVIRONMENT):
    monkeypatch.delenv(name, raising=False)
  fake = fake_run()
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and message in err[0], err
  assert not fake.calls


def test_cuda_without_a_gpu_is_a_usage_error_for_every_command(capsys, fake_run, monkeypatch):
  from clipbench import devices
  monkeypatch.setattr(devices, "cuda_device_node_present", lambda: False)
  fake = fake_run()
  for command in ("conform", "bench", "report"):
    assert cli.main([command, "--device", "cuda"]) == 2
    assert capsys.readouterr().err == ("clipbench: error: --device cuda: no CUDA GPU on this "
                                       "machine (no /dev/nvidia* device node)\n")
  assert not fake.calls


def test_a_side_by_side_child_that_crashes_leaves_the_others_results(tmp_path, monkeypatch,
                                                                      capsys):
  def side_by_side(cmds, logs, jobs, *, env_defaults=None, shown_paths=None):
    shutil.copy(os.path.join(REPORT_DATA, "conformance.csv"), _option(cmds[0], "--results"))
    return [1, -11]  # the second child died (SIGSEGV) before writing its table

  monkeypatch.setattr(child_run, "run_side_by_side", side_by_side)
  results = tmp_path / "conformance.csv"
  assert cli.main(["conform", "--impl", "reference", "--impl", "optax.clip_by_global_norm",
                   "--jobs", "2", "--results", str(results)]) == 1
  assert results.exists()  # the first child's table stands
  err = capsys.readouterr().err
  assert ("the conformance run of optax.clip_by_global_norm did not complete (pytest exit "
          "status -11)") in err
