"""Writing files and folders so that a reader never sees a half-written one.

A file is written to a temporary file in the same folder and moved over the target with
``os.replace``, which is atomic on POSIX and Windows when both are on one file system: a crash
or an exception mid-write leaves the previous file intact. A folder is built under a temporary
name and renamed into place; replacing an existing folder takes two renames (old out of the way,
new in), so a reader may briefly find it missing but never finds it half-written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

import pandas as pd


def _umask() -> int:
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "w", **kwargs) -> Iterator:
  """Opens a temporary file next to ``path``; moves it onto ``path`` only on success."""
  path = os.fspath(path)
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp",
                             dir=folder)
  try:
    # mkstemp creates 0600; a report is for everyone who may read the folder.
    os.fchmod(fd, 0o666 & ~_umask())
    with os.fdopen(fd, mode, **kwargs) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)
    raise


def write_text(path: str | os.PathLike[str], text: str) -> None:
  with atomic_open(path, "w", encoding="utf-8", newline="\n") as f:
    f.write(text)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
  with atomic_open(path, "wb") as f:
    f.write(data)


def write_csv(path: str | os.PathLike[str], frame: pd.DataFrame, *, index: bool = False) -> None:
  # Rendering first: an exception from to_csv must not leave even an empty temporary file.
  write_text(path, frame.to_csv(index=index, lineterminator="\n"))


def temporary_dir(parent: str | os.PathLike[str], name: str) -> str:
  """A fresh hidden folder in ``parent`` (same file system as the final place)."""
  os.makedirs(parent, exist_ok=True)
  path = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
  os.chmod(path, 0o777 & ~_umask())  # mkdtemp creates 0700
  return path


def move_dir_into_place(tmp_dir: str, target: str) -> None:
  """Renames the finished ``tmp_dir`` to ``target``, replacing any folder already there."""
  if not os.path.exists(target):
    os.rename(tmp_dir, target)
    return
  parent = os.path.dirname(os.path.abspath(target))
  old = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old.", dir=parent)
  os.rmdir(old)  # only its unique name is wanted: rename needs a free target
  os.rename(target, old)
  try:
    os.rename(tmp_dir, target)
  except BaseException:
    os.rename(old, target)
    raise
  shutil.rmtree(old, ignore_errors=True)


def copy_dir_atomically(source: str, target: str) -> None:
  """Makes ``target`` a copy of ``source``, swapped in whole once the copy is complete."""
  parent = os.path.dirname(os.path.abspath(target))
  tmp = temporary_dir(parent, os.path.basename(target))
  try:
    shutil.copytree(source, tmp, dirs_exist_ok=True)
    move_dir_into_place(tmp, target)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
