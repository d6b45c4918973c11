"""Adapters: kups' per-system ``ClipByGlobalNorm`` and ``MaxStepSize`` relaxation transforms.

Library calls, as a kups user writes them (``kups.relaxation.transforms``)::

  index_prefix = [Index.integer(ids, n=num_systems) for ids in segments]   # or None
  opt = ClipByGlobalNorm(max_norm=max_norm)        # or MaxStepSize(max_step_size=max_step)
  updates, _ = opt.update(updates, opt.init(updates, index_prefix))

``Index`` (``kups.core.data.index``) maps each leading-axis row of a leaf to a system; every
leaf gets its own ``Index`` over the same vocabulary ``0..num_systems-1`` (so a system may have
no rows). With ``segments=None`` the adapter passes ``index_prefix=None``, kups' own
single-system path (every leaf gets ``Index.new((0,) * len(leaf))``), as its users do.

Scale formulas (kups 1.0.8, ``relaxation/transforms/*.py`` and ``_segmented_tree.py``, measured)::

  ClipByGlobalNorm: n_k = sqrt(sum over leaves, in leaf order, of segment_sum(row . row))
                    out = x * minimum(1.0, max_norm / (n_k + 1e-12))
  MaxStepSize:      m_k = segment_max(jnp.linalg.norm(x, axis=-1))     # over all leaves
                    out = x * minimum(1.0, max_step_size / (m_k + 1e-12))

Every element is multiplied (by 1 when not clipped). ``segment_sum`` accumulates in a wider
float when there are two or more systems but natively with one, so a single-system call takes a
different summation path from a batched one. ``jnp.linalg.norm(axis=-1)`` on a 1-D leaf is the
norm of the whole leaf. kups returns no norms: the adapters return ``None``
(``returns_norm=False``). The limit is a static float dataclass field, so there is no per-system
threshold array. jit, vmap and grad run through ``update`` unchanged (checked with jax 0.12).
"""

from __future__ import annotations

from typing import Any, Sequence

from kups.core.data.index import Index
from kups.relaxation import transforms

from clipbench.impls.adapters import _common, _jax_common


def _description(transform: str) -> str:
  return (f"kups.relaxation.transforms.{transform}.update with "
          "Index.integer(segments[i], n=num_systems) per leaf (None without segments)")


def _reproducer(transform: str) -> str:
  """The library call a bug report would show (the suite's reproducer appends it)."""
  return ("import jax.numpy as jnp\nfrom kups.core.data.index import Index\n"
          "from kups.relaxation import transforms\n"
          "updates = [jnp.asarray(x) for x in leaves]\n"
          "prefix = None if segments is None else [Index.integer(s, n=num_systems) "
          "for s in segments]\n"
          f"opt = transforms.{transform}\n"
          "out, _ = opt.update(updates, opt.init(updates, prefix))\nprint(out)")


def _index_prefix(segments: Sequence[Any] | None, num_systems: int | None) -> list[Index] | None:
  """One kups ``Index`` per leaf; ``None`` (kups' one-system path) without segments."""
  if segments is None:
    return None
  return [Index.integer(ids, n=num_systems) for ids in segments]


def _run(opt: Any, leaves: Sequence[Any], segments: Sequence[Any] | None,
         num_systems: int | None) -> tuple[list[Any], None]:
  updates = list(leaves)
  clipped, _ = opt.update(updates, opt.init(updates, _index_prefix(segments, num_systems)))
  return list(clipped), None


class KupsClipByGlobalNorm:
  """``kups.relaxation.transforms.ClipByGlobalNorm(max_norm=...)`` through kups' ``Index``."""

  framework = "jax"
  library = "kups"
  description = _description("ClipByGlobalNorm(max_norm)")
  reproducer = _reproducer("ClipByGlobalNorm(max_norm=threshold)")
  capabilities = _jax_common.capabilities(per_system=True, returns_norm=False)

  def clip_by_global_norm(self, leaves: Sequence[Any], max_norm: Any, *,
                          segments: Sequence[Any] | None = None, num_systems: int | None = None,
                          norm_type: float = 2.0,
                          nonfinite: str = "propagate") -> tuple[list[Any], None]:
    _common.require_l2_propagate(norm_type, nonfinite, "kups ClipByGlobalNorm")
    return _run(transforms.ClipByGlobalNorm(max_norm=max_norm), leaves, segments, num_systems)


class KupsMaxStepSize:
  """``kups.relaxation.transforms.MaxStepSize(max_step_size=...)`` through kups' ``Index``."""

  framework = "jax"
  library = "kups"
  description = _description("MaxStepSize(max_step_size)")
  reproducer = _reproducer("MaxStepSize(max_step_size=threshold)")
  capabilities = _jax_common.capabilities(per_system=True, returns_norm=False)

  def clip_by_max_step(self, leaves: Sequence[Any], max_step: Any, *,
                       segments: Sequence[Any] | None = None, num_systems: int | None = None,
                       nonfinite: str = "propagate") -> tuple[list[Any], None]:
    _common.require_mode(nonfinite, ("propagate",), "kups MaxStepSize")
    return _run(transforms.MaxStepSize(max_step_size=max_step), leaves, segments, num_systems)


clip_by_global_norm = KupsClipByGlobalNorm()
max_step_size = KupsMaxStepSize()
