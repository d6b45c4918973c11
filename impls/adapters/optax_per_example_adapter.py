"""Adapter: ``optax.per_example_global_norm_clip``, per-system clipping one example at a time.

Library call, as a differential-privacy user writes it (a batch of examples on axis 0)::

  clipped_sum, num_clipped = optax.per_example_global_norm_clip(grads, l2_norm_clip)

Rule (optax 0.2.8, ``optax/transforms/_clipping.py``)::

  n_e = jax.vmap(optax.tree.norm)(grads)                 # each example's global L2 norm
  m_e = nan_to_num(minimum(l2_norm_clip / n_e, 1.0), nan=1.0)
  out = tensordot(m_e, g, axes=1)                        # the clipped examples, SUMMED

Per-example clipping is per-system clipping, but the function returns the sum over the
examples, which the canonical API has no place for. The adapter takes the sum away without
touching a value: it calls the function once per system, on a batch of exactly one example
(that system's rows of every leaf, with a leading batch axis of 1), so the sum has one term and
the library's output is that system's clipped rows; each call gets that system's threshold.
What is tested is therefore optax's per-example step (norm, multiplier, the one-term
``tensordot``), not the batching by ``vmap`` nor the summation across examples. The rows come
back to their places by a gather; each leaf keeps whatever dtype optax returned. The systems
are the adapter's grouping, so bad ``segments`` are refused by the spec's own check (rule 13
says nothing about optax here).

optax returns the number of clipped examples, not the norms: ``returns_norm=False``. Plain
``optax.tree.norm(ord=...)`` computes a norm and clips nothing, so it implements none of the
three operations and has no adapter.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
import optax

from clipbench.impls.adapters import _common, _jax_common
from clipbench.protocol import Capabilities
from clipbench.reference import validation

_LIBRARY = "optax.per_example_global_norm_clip"


def _one_example(leaves: Sequence[Any], rows: Sequence[np.ndarray] | None) -> list[Any]:
  """A batch of one example: the given rows of each leaf (all rows when ``rows`` is None)."""
  if rows is None:
    return [jnp.asarray(x)[None] for x in leaves]
  return [jnp.asarray(x)[r][None] for x, r in zip(leaves, rows)]


def _threshold_of(max_norm: Any, system: int) -> Any:
  """System ``system``'s threshold as a Python float, as optax's examples pass it (a numpy
  float64 scalar would not be weakly typed and would promote float16 rows to float32)."""
  return float(max_norm[system]) if np.ndim(max_norm) > 0 else max_norm


class OptaxPerExampleGlobalNormClip:
  """``optax.per_example_global_norm_clip`` called once per system on a batch of one."""

  framework = "jax"
  library = "optax"
  name = "optax.per_example_global_norm_clip"
  description = ("optax.per_example_global_norm_clip(grads, c_k) per system on a batch of one "
                 "example (the sum over examples has one term)")
  capabilities = Capabilities(per_system=True, per_system_max=True,
                              dtypes=_jax_common.supported_dtypes(), returns_norm=False)
  # The library call a bug report would show for one system (the suite's reproducer appends
  # it): every row of system 0, one example.
  reproducer = ("import jax.numpy as jnp\nimport optax\n"
                "rows = [np.arange(len(x)) if segments is None else np.flatnonzero(s == 0) "
                "for x, s in zip(leaves, segments or [None] * len(leaves))]\n"
                "example = [jnp.asarray(x)[r][None] for x, r in zip(leaves, rows)]\n"
                "c = threshold[0] if np.ndim(threshold) else threshold\n"
                "out, num_clipped = optax.per_example_global_norm_clip(example, c)\nprint(out)")

  def clip_by_global_norm(self, leaves: Sequence[Any], max_norm: Any, *,
                          segments: Sequence[Any] | None = None, num_systems: int | None = None,
                          norm_type: float = 2.0,
                          nonfinite: str = "propagate") -> tuple[list[Any], None]:
    _common.require_l2_propagate(norm_type, nonfinite, _LIBRARY)
    if segments is None:
      clipped, _ = optax.per_example_global_norm_clip(_one_example(leaves, None),
                                                      _threshold_of(max_norm, 0))
      return [jnp.reshape(c, jnp.shape(x)) for c, x in zip(clipped, leaves)], None
    # The systems are the adapter's grouping, not optax's (which has no segments), so the
    # adapter checks them with the spec's own rule-13 check: rule 13 describes the adapter.
    ids, num_systems = validation.check_segments([np.asarray(x) for x in leaves],
                                                 [np.asarray(s) for s in segments], num_systems)
    # Each leaf's rows in system order (stable, so a system's rows keep their order), and the
    # gather that puts them back.
    order = [np.argsort(s, kind="stable") for s in ids]
    back = [np.argsort(o, kind="stable") for o in order]
    pieces: list[list[Any]] = [[] for _ in leaves]
    for system in range(num_systems):
      rows = [np.flatnonzero(s == system) for s in ids]
      clipped, _ = optax.per_example_global_norm_clip(_one_example(leaves, rows),
                                                      _threshold_of(max_norm, system))
      for i, c in enumerate(clipped):
        pieces[i].append(c)
    out = []
    for x, leaf_pieces, inverse in zip(leaves, pieces, back):
      stacked = jnp.concatenate(leaf_pieces) if leaf_pieces else jnp.asarray(x)
      out.append(stacked[inverse])
    return out, None


per_example_global_norm_clip = OptaxPerExampleGlobalNormClip()
