"""numba's on-disk cache, cleared where it may hold kernels compiled from older sources.

numba keys a cached kernel on the modification time and size of the one file that defines
it: its cache invalidation "fails to recognize changes in symbols defined in a different
file", and globals are saved as the constants they were at compile time (numba's "Notes on
Caching", "Caching Limitations"; the pull requests that would follow a kernel's dependencies,
numba/numba#8396 and #9563, are not merged). The kernels here inline intrinsics, helpers and
constants of other modules: ``fused``'s loops inline ``short_sums``, ``masked_apply``,
``lane_decisions`` and ``intrinsics``, and they freeze ``decision``'s constants. After an edit of
``short_sums.py`` alone, numba would load ``fused``'s kernels as compiled from the old code,
silently: the tests, benchmarks and reports of a working tree would run code that is no
longer there. A fresh clone has no cache, so CI never sees it; a developer's tree does.

``clear_if_stale(cache_dir)`` compares a digest of every source under ``impls/own`` (all that
a kernel can inline) with the one stamped in ``cache_dir``. When they differ, or there is no
stamp, it removes the numba cache files there (``*.nbi``, ``*.nbc``) and then writes the new
stamp (atomically, with ``clipbench.files``: an interrupted run leaves the old stamp or none,
and the next import clears again). The package calls it for its kernels' cache directories at
import, before any kernel runs; modules and tests that define cached kernels of their own call
it for theirs.
Two processes that clear at once both remove and both stamp; numba then compiles afresh.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

STAMP = "clipbench-sources.sha256"
_SOURCES = Path(__file__).resolve().parents[1]  # impls/own: everything a kernel can inline
_CACHE_SUFFIXES = (".nbi", ".nbc")


@functools.lru_cache(maxsize=1)
def sources_digest() -> str:
  """SHA-256 of the path and contents of every ``.py`` file under ``impls/own``."""
  digest = hashlib.sha256()
  for path in sorted(_SOURCES.rglob("*.py")):
    digest.update(path.relative_to(_SOURCES).as_posix().encode() + b"\0")
    digest.update(path.read_bytes() + b"\0")
  return digest.hexdigest()


def cache_dir_of(dispatcher: Any) -> str | None:
  """Where numba caches ``dispatcher``'s kernels (a ``cache=True`` function), or None when
  this numba does not say (then nothing is cleared)."""
  return getattr(getattr(dispatcher, "_cache", None), "_cache_path", None)


def clear_if_stale(cache_dir: str | os.PathLike | None, digest: str | None = None) -> bool:
  """Removes the numba cache files in ``cache_dir`` unless it is stamped with ``digest`` (by
  default ``sources_digest()``), then stamps it; True when files were removed. A directory
  that does not exist yet is made and stamped (numba would make it); one that cannot be
  written is left alone (a read-only install's kernels are cached in numba's user directory)."""
  if cache_dir is None:
    return False
  digest = sources_digest() if digest is None else digest
  folder = Path(cache_dir)
  stamp = folder / STAMP
  try:
    if stamp.read_text() == digest:
      return False
  except OSError:  # no stamp yet: whatever is cached there may be stale
    pass
  removed = False
  try:
    folder.mkdir(parents=True, exist_ok=True)
    for entry in folder.iterdir():
      if entry.suffix in _CACHE_SUFFIXES:
        entry.unlink(missing_ok=True)
        removed = True
    # Imported here: it imports pandas, a cost only the rare clearing import should pay.
    from clipbench import files  # pylint: disable=import-outside-toplevel
    files.write_text(stamp, digest)
  except OSError:
    return removed
  return removed
