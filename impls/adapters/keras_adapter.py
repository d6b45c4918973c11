"""Adapters: Keras 3 ``Optimizer(global_clipnorm=c)``, on the backend this process runs.

Library call, as a Keras user writes it (the clipping happens inside ``apply_gradients``)::

  opt = keras.optimizers.SGD(learning_rate=1.0, global_clipnorm=c)
  opt.apply_gradients(zip(grads, variables))

Rule (Keras 3.15, ``keras/src/optimizers/base_optimizer.py``, one code for every backend)::

  n     = sqrt(sum(stack([sum(square(g)) for g in grads])))    # in each gradient's dtype
  scale = c * minimum(1 / n, 1 / c) + (n - n)                  # no epsilon; a non-finite n
  out   = g * scale                                            # makes every value NaN

and ``global_clipnorm = 0`` (or None) turns clipping off (``if self.global_clipnorm and ...``).

Keras hands the clipped gradients only to the update rule, so the adapter reads them from a
plain SGD step: learning rate 1.0 (``g * 1`` is exact), momentum 0, each variable starting at
-0.0, the additive identity, so ``variable = -0.0 - g * 1`` is exactly ``-g`` for every ``g``
(signed zeros included), and the adapter returns ``-variable``. Keras returns no norm.

The backend: Keras reads ``KERAS_BACKEND`` once, at its first import, and cannot switch within
a process (``keras.config.set_backend`` re-imports Keras and invalidates every object built
before). So one adapter per backend is defined here, and only the one matching this process's
backend is available; the others say how to select theirs (``KERAS_BACKEND=jax clipbench
conform --impl keras.SGD.global_clipnorm.jax``). Leaves arrive as arrays of that backend's
framework; Keras is imported through ``frameworks.import_tensorflow`` first, since importing
triton after tensorflow crashes the process.
"""

from __future__ import annotations

from typing import Any, Sequence

from clipbench.impls import frameworks
from clipbench.impls.adapters import _common
from clipbench.protocol import DTYPES, Capabilities

frameworks.import_tensorflow()
import keras  # noqa: E402  (after tensorflow's import order fix)

BACKEND: str = keras.backend.backend()


def _dtypes(backend: str) -> tuple[str, ...]:
  """Leaf dtypes the backend's framework holds as given (JAX: float64 only with x64)."""
  if backend == "jax":
    from clipbench.impls.adapters import _jax_common
    return _jax_common.supported_dtypes()
  return DTYPES


class KerasGlobalClipnorm:
  """``keras.optimizers.SGD(learning_rate=1.0, global_clipnorm=c).apply_gradients``."""

  library = "keras"
  version = keras.__version__

  def __init__(self, backend: str):
    self.backend = backend
    self.framework = backend
    self.name = f"keras.SGD.global_clipnorm.{backend}"
    self.available = backend == BACKEND
    self.unavailable_reason = (
        "" if self.available else
        f"Keras runs the {BACKEND} backend in this process (KERAS_BACKEND is read once, at "
        f"import); run with KERAS_BACKEND={backend} for this one")
    self.description = (
        f"keras.optimizers.SGD(learning_rate=1.0, global_clipnorm=c).apply_gradients on the "
        f"{backend} backend: scale c*min(1/n, 1/c) + (n-n), no epsilon")
    # Global L2 only. Every float dtype is a Keras variable dtype; mixed dtypes meet in one
    # ops.stack of the per-leaf sums, which the tensorflow backend refuses.
    self.capabilities = Capabilities(
        per_system=False,
        per_system_max=False,
        norm_types=(2.0,),
        dtypes=_dtypes(backend) if self.available else DTYPES,
        nonfinite=("propagate",),
        returns_norm=False,
        in_place=False,
        transforms=(),
        devices=("cpu",),
        mixed_dtypes=backend != "tensorflow",
    )
    # The library call a bug report would show (the suite's reproducer appends it).
    self.reproducer = (
        f"import os\nos.environ['KERAS_BACKEND'] = {backend!r}\n"
        "from clipbench.impls import frameworks\n"
        "frameworks.import_tensorflow()  # triton first: importing it after tensorflow crashes\n"
        "import keras\n"
        "grads = [keras.ops.convert_to_tensor(x) for x in leaves]\n"
        "variables = [keras.Variable(keras.ops.negative(keras.ops.zeros_like(g)), "
        "dtype=g.dtype) for g in grads]\n"
        "opt = keras.optimizers.SGD(learning_rate=1.0, global_clipnorm=threshold)\n"
        "opt.apply_gradients(zip(grads, variables))\n"
        "print([-keras.ops.convert_to_numpy(v) for v in variables])")

  def clip_grad_norm(self, leaves: Sequence[Any], max_norm: float, *, norm_type: float = 2.0,
                     nonfinite: str = "propagate") -> tuple[list[Any], None]:
    # Neither option exists in Keras' API: refuse instead of emulating.
    _common.require_l2_propagate(norm_type, nonfinite, "Keras global_clipnorm")
    grads = [keras.ops.convert_to_tensor(x) for x in leaves]
    variables = [keras.Variable(keras.ops.negative(keras.ops.zeros_like(g)), dtype=g.dtype,
                                trainable=True) for g in grads]
    opt = keras.optimizers.SGD(learning_rate=1.0, global_clipnorm=max_norm)
    opt.apply_gradients(zip(grads, variables))
    return [keras.ops.negative(v.value) for v in variables], None


global_clipnorm_tensorflow = KerasGlobalClipnorm("tensorflow")
global_clipnorm_jax = KerasGlobalClipnorm("jax")
global_clipnorm_torch = KerasGlobalClipnorm("torch")
