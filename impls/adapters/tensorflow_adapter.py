"""Thin adapter over TensorFlow's ``tf.clip_by_global_norm``.

TensorFlow computes ``norm = sqrt(2 * sum_i l2_loss(t_i))`` with ``l2_loss(t) = sum(t**2) / 2``
in each tensor's own dtype, then multiplies every tensor by
``scale = clip_norm * min(1 / norm, 1 / clip_norm) + (norm - norm)``: there is no epsilon, and
the ``(norm - norm)`` term makes the scale NaN as soon as the norm is not finite. It is an L2
clipper only (no ``norm_type``), returns ``(list_clipped, global_norm)`` and is functional.

The adapter calls it exactly as users do, ``tf.clip_by_global_norm(t_list, clip_norm)`` with
the threshold as a Python float, and validates nothing: TF's own errors (integer or mixed dtypes
raise ``InvalidArgumentError``) and results are what the conformance suite sees.

TensorFlow is imported through ``clipbench.impls.frameworks.import_tensorflow`` because
importing triton after tensorflow crashes the process.
"""

from __future__ import annotations

from typing import Any, Sequence

from clipbench.impls import frameworks
from clipbench.impls.adapters import _common
from clipbench.protocol import Capabilities

tf = frameworks.import_tensorflow()


def _as_tensor(leaf: Any) -> Any:
  # A TF tensor is passed as is; a numpy array is converted exactly (bfloat16 included).
  if tf.is_tensor(leaf):
    return leaf
  return frameworks.to_framework(leaf, "tensorflow")


class ClipByGlobalNorm:
  """``tf.clip_by_global_norm(t_list, clip_norm)`` as a ``clip_grad_norm`` (p = 2 only)."""

  framework = "tensorflow"
  version = tf.__version__
  # Global L2 only. All four float dtypes run; mixing dtypes raises InvalidArgumentError in
  # tf.stack of the per-tensor l2_loss values, hence mixed_dtypes=False. tf.function is not one
  # of the suite's transforms.
  capabilities = Capabilities(mixed_dtypes=False)
  description = ("tf.clip_by_global_norm(t_list, clip_norm): scale "
                 "clip_norm*min(1/norm, 1/clip_norm) + (norm-norm), norm in the leaf dtype")

  # The library call a bug report would show (the suite's reproducer appends it).
  reproducer = ("import tensorflow as tf\n"
                "t_list = [tf.cast(tf.constant(x.astype(np.float32)), tf.bfloat16) "
                "if x.dtype.name == 'bfloat16' else tf.constant(x) for x in leaves]\n"
                "out, norm = tf.clip_by_global_norm(t_list, threshold)\nprint(out, norm)")

  def clip_grad_norm(self, leaves: Sequence[Any], max_norm: float, *, norm_type: float = 2.0,
                     nonfinite: str = "propagate") -> tuple[list[Any], Any]:
    # Neither option exists in TensorFlow's API: refuse instead of emulating.
    _common.require_l2_propagate(norm_type, nonfinite, "tf.clip_by_global_norm")
    t_list = [_as_tensor(x) for x in leaves]
    clipped, global_norm = tf.clip_by_global_norm(t_list, max_norm)
    return list(clipped), global_norm


clip_by_global_norm = ClipByGlobalNorm()
