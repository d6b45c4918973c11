"""numba's cache is cleared when a source a kernel can inline changed (``cache_guard``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from clipbench.impls.own.numba import cache_guard

_CACHE_FILES = ("fused.systems_loop-103.py312.nbi", "fused.systems_loop-103.py312.1.nbc")
_OTHER_FILES = ("fused.cpython-312.pyc", "notes.txt")


def _make(folder, names):
  folder.mkdir(parents=True, exist_ok=True)
  for name in names:
    (folder / name).write_text("x")


def test_cache_files_are_removed_only_when_the_digest_changes(tmp_path):
  _make(tmp_path, _CACHE_FILES + _OTHER_FILES)
  assert cache_guard.clear_if_stale(tmp_path, "first")  # no stamp yet
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(_OTHER_FILES + (cache_guard.STAMP,))
  assert (tmp_path / cache_guard.STAMP).read_text() == "first"

  _make(tmp_path, _CACHE_FILES)  # compiled under the stamped sources: kept
  assert not cache_guard.clear_if_stale(tmp_path, "first")
  assert all((tmp_path / name).exists() for name in _CACHE_FILES)

  assert cache_guard.clear_if_stale(tmp_path, "second")
  assert not any((tmp_path / name).exists() for name in _CACHE_FILES)
  assert all((tmp_path / name).exists() for name in _OTHER_FILES)
  assert (tmp_path / cache_guard.STAMP).read_text() == "second"
  assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_missing_directory_is_made_and_stamped(tmp_path):
  folder = tmp_path / "not" / "yet"
  assert not cache_guard.clear_if_stale(folder, "d")
  assert (folder / cache_guard.STAMP).read_text() == "d"
  assert not cache_guard.clear_if_stale(None, "d")


def test_the_digest_follows_every_source_under_the_package(tmp_path, monkeypatch):
  sources = tmp_path / "own"
  (sources / "numba").mkdir(parents=True)
  (sources / "decision.py").write_text("U64 = 2.0 ** -53\n")
  (sources / "numba" / "short_sums.py").write_text("SHORT = 32\n")
  monkeypatch.setattr(cache_guard, "_SOURCES", sources)
  digests = []
  for edit in (None, ("numba/short_sums.py", "SHORT = 16\n"), ("decision.py", "U64 = 1.0\n"),
               ("numba/new.py", "")):
    if edit:
      (sources / edit[0]).write_text(edit[1])
    cache_guard.sources_digest.cache_clear()
    digests.append(cache_guard.sources_digest())
  cache_guard.sources_digest.cache_clear()
  assert len(set(digests)) == len(digests)


_IMPORT_TWICE = r"""
import json, sys
import clipbench.impls.own.numba as package
from numba.core.dispatcher import Dispatcher
from clipbench.impls.own.numba import cache_guard, fused
compiled = [f"{name}.{key}" for name, module in list(sys.modules.items())
            if name.startswith("clipbench") for key, value in vars(module).items()
            if isinstance(value, Dispatcher) and value.overloads]
print(json.dumps({"dir": cache_guard.cache_dir_of(fused._in_groups), "compiled": compiled,
                  "digest": cache_guard.sources_digest()}))
"""


def test_importing_the_package_clears_a_stale_cache_before_any_kernel_runs(tmp_path):
  env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))

  def import_package():
    done = subprocess.run([sys.executable, "-c", _IMPORT_TWICE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])

  first = import_package()
  folder = first["dir"]
  assert folder.startswith(str(tmp_path))
  assert first["compiled"] == []  # nothing could have been loaded before the guard ran
  # A kernel cached under other sources, as after an edit of a module it inlines.
  with open(os.path.join(folder, cache_guard.STAMP), "w") as f:
    f.write("sources of an older tree")
  for name in _CACHE_FILES:
    with open(os.path.join(folder, name), "w") as f:
      f.write("stale")
  second = import_package()
  assert not any(os.path.exists(os.path.join(folder, name)) for name in _CACHE_FILES)
  with open(os.path.join(folder, cache_guard.STAMP)) as f:
    assert f.read() == second["digest"]
