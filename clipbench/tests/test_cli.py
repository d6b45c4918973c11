"""The ``clipbench`` command: exit codes, errors, outside implementations, results handling.

Most tests call ``main(argv)`` in this process with pytest runs replaced by a fake that writes
what the real suite would (a results table, a benchmark JSON); three run for real in a
subprocess: ``clipbench list --json`` over every registered implementation, a short
``clipbench conform`` on an outside module, and the progress bar around a tiny pytest run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from clipbench import cli
from clipbench.impls import registry

REPORT_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "reports", "tests", "data")

OUTSIDE_MODULE = textwrap.dedent('''\
    """A tiny outside implementation: global L2 clip_grad_norm in numpy."""
    import numpy as np


    class _Impl:
      framework = "numpy"
      version = "0.0.1"

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
  """Stands in for ``cli.run_pytest``: records the command and its environment, writes the
  outputs the real run would, returns the given exit status."""

  def __init__(self, rc: int = 0, write=None):
    self.rc = rc
    self.write = write
    self.calls: list[tuple[list[str], dict[str, str]]] = []

  def __call__(self, cmd, label, log_path, *, progress=None, env_defaults=None):
    self.calls.append((list(cmd), cli._child_env(env_defaults)))  # pylint: disable=protected-access
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


@pytest.fixture
def fake_run(monkeypatch):
  def install(rc=0, write=None) -> FakePytest:
    fake = FakePytest(rc, write)
    monkeypatch.setattr(cli, "run_pytest", fake)
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
  (impl,) = cli.load_requested(["tmpmod:impl"], require_available=True)
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
  assert cmd[3] == cli.conformance_dir() and os.path.isdir(cmd[3])
  assert _option(cmd, "--impl") == "tmpmod:impl"
  assert _option(cmd, "--ops") == "clip_grad_norm"
  assert _option(cmd, "--profile") == "ci"
  assert cmd[-2:] == ["-k", "rule3"]
  assert env["PYTHONPATH"].split(os.pathsep)[0] == str(outside)
  assert results.exists() and "rows" in capsys.readouterr().out
  assert _option(cmd, "--results") != str(results)  # the run writes beside, then it is moved


@pytest.mark.parametrize("gpu, caller, expected", [
    (False, None, "1"),     # no GPU: the Triton kernels are checked through the interpreter
    (False, "0", "0"),      # the caller's own setting wins
    (True, None, None),     # a GPU: compiled kernels on CUDA tensors, nothing set
])
def test_conform_runs_triton_interpreted_without_gpu(tmp_path, fake_run, monkeypatch, gpu,
                                                     caller, expected):
  from clipbench.benchmarks import cases
  monkeypatch.setattr(cases, "cuda_device_node_present", lambda: gpu)
  if caller is None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
  else:
    monkeypatch.setenv("TRITON_INTERPRET", caller)
  fake = fake_run(rc=0, write=write_conformance)
  assert cli.main(["conform", "--impl", "reference", "--results",
                   str(tmp_path / "conformance.csv")]) == 0
  (_, env), = fake.calls
  assert env.get("TRITON_INTERPRET") == expected


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


# --- report ----------------------------------------------------------------------------------

@pytest.fixture
def results_dir(tmp_path):
  folder = tmp_path / "results"
  folder.mkdir()
  shutil.copy(os.path.join(REPORT_DATA, "conformance.csv"), folder / "conformance.csv")
  shutil.copy(os.path.join(REPORT_DATA, "benchmarks.json"), folder / "benchmarks.json")
  return folder


def test_report_reuses_fresh_results(tmp_path, results_dir, fake_run, monkeypatch, capsys):
  monkeypatch.setattr(cli, "load_all", lambda progress=None: [])
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
  monkeypatch.setattr(cli, "load_all", lambda progress=None: [])
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
  rc = cli.run_pytest([sys.executable, "-m", "pytest", str(tmp_path / "test_tiny.py"), "-q",
                       "-p", "no:cacheprovider"], "tiny", str(log), progress=True)
  assert rc == 1
  text = log.read_text()
  assert "1 failed, 2 passed" in text and "-p clipbench.cli" in text
