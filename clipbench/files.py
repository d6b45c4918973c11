"""Writing files and folders so that a reader never sees a half-written one.

A file is written to a temporary file in the same folder and moved over the target with
``os.replace``, which is atomic on POSIX and Windows when both are on one file system: a crash
or an exception mid-write leaves the previous file intact. A folder is built under a temporary
name and renamed into place; replacing an existing folder takes two renames (old out of the way,
new in), so a reader may briefly find it missing but never finds it half-written.

Every temporary file or folder is removed on any exception, ``KeyboardInterrupt`` (Ctrl-C)
included, so an interrupted run leaves only what was there before it.
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


class UnwritableFolderError(Exception):
  """Files cannot be created in a folder (or in the folder that would hold it once created)."""


def check_writable(folder: str | os.PathLike[str]) -> None:
  """Raises UnwritableFolderError unless files can be created in ``folder``.

  A folder that does not exist yet is checked where it would be created: its nearest existing
  parent must be a folder in which this process can create files. The check creates an
  anonymous temporary file there rather than asking ``os.access``, which answers for root as if
  permissions did not apply and knows nothing of read-only file systems.
  """
  folder = os.fspath(folder)
  existing = os.path.abspath(folder)
  while not os.path.lexists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise UnwritableFolderError(f"cannot write to {folder}: {existing} is not a folder")
  try:
    with tempfile.TemporaryFile(dir=existing):
      pass
  except OSError as e:
    raise UnwritableFolderError(
        f"cannot write to {folder}: {e.strerror or e} ({existing})") from None


def temporary_dir(parent: str | os.PathLike[str], name: str) -> str:
  """A fresh hidden folder in ``parent`` (same file system as the final place)."""
  os.makedirs(parent, exist_ok=True)
  path = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
  os.chmod(path, 0o777 & ~_umask())  # mkdtemp creates 0700
  return path


@contextlib.contextmanager
def staging_dir(target: str | os.PathLike[str]) -> Iterator[str]:
  """A fresh hidden folder beside ``target`` for output that may be moved onto it.

  The folder, and whatever was left in it (by this process or a child it started), is removed
  on the way out, however the block ends; ``os.replace`` from it onto ``target`` is atomic, as
  both are on one file system.
  """
  target = os.fspath(target)
  tmp = temporary_dir(os.path.dirname(os.path.abspath(target)), os.path.basename(target))
  try:
    yield tmp
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


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
