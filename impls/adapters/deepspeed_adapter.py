"""Adapters: DeepSpeed's gradient clipping, ``deepspeed.runtime.utils`` (DeepSpeed 0.19.8).

Library calls, as DeepSpeed's engine and its users write them::

  total_norm = clip_grad_norm_(parameters, max_norm, norm_type)      # on the .grad of each
  global_norm = clip_tensors_by_global_norm(tensors, max_norm)       # on the tensors themselves

Rules (``deepspeed/runtime/utils.py``)::

  clip_grad_norm_:
    p = inf: n = max over grads of max|g| (each in float32)
    else:    n = (sum over grads of ||float32(g)||_p ** p) ** (1/p)   # #8313 fixed: ** p, not ** 2
    n   = all_reduce(n / world_size)          # over the data-parallel group: needs a process group
    s   = min(1, max_norm / (n + 1e-6))       # float32, always multiplied (ties scaled below 1)
    g  *= s                                   # in place
  clip_tensors_by_global_norm (L2 only, eps = 1e-6):
    n   = sqrt(sum over tensors of ||float32(t)||_2 ** 2), and -1 where n is inf or NaN
    s   = max_norm / (n + eps)
    if s < 1: t *= s                          # in place; a non-finite norm (-1) gives s < 0

``clip_grad_norm_`` averages the norm over the data-parallel group, so it asserts that DeepSpeed's
communication backend is initialized. The adapter does what a one-process user does: the first
call runs ``deepspeed.init_distributed`` with the gloo backend, rank 0 of world size 1 and a
file rendezvous in a temporary folder (no port to collide with other processes), unless the
process has initialized it already. On the CPU that first call also JIT-builds DeepSpeed's
shared-memory communication op with ninja and the C++ compiler (about half a minute once; torch
caches it in ``~/.cache/torch_extensions``). ``clip_tensors_by_global_norm`` needs none of it.

``DS_ACCELERATOR`` defaults to ``cpu`` here (DeepSpeed's documented selector; an explicit setting
wins): the adapters are declared and timed on the CPU, and DeepSpeed otherwise guesses with a
warning. Nothing of DeepSpeed is patched; whatever it does with a threshold, a p, a dtype or a
non-finite value (including raising) is what the conformance suite sees.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any, Sequence

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402  (after choosing the accelerator)
import deepspeed.comm  # noqa: E402
import torch  # noqa: E402
from deepspeed.runtime import utils as ds_utils  # noqa: E402

from clipbench.impls import frameworks  # noqa: E402
from clipbench.impls.adapters._torch_parameters import ParametersHolding  # noqa: E402
from clipbench.protocol import ANY_NORM_TYPE, Capabilities  # noqa: E402


def _as_tensor(leaf: Any) -> torch.Tensor:
  # A torch tensor is used as is (DeepSpeed clips it in place); a numpy array is converted exactly.
  if isinstance(leaf, torch.Tensor):
    return leaf
  return frameworks.to_framework(leaf, "torch")


def _check_nonfinite(library_call: str, nonfinite: str) -> None:
  # DeepSpeed has one behaviour for NaN/inf; "zero" cannot be expressed with its public API, so
  # the adapter refuses rather than emulates it.
  if nonfinite != "propagate":
    raise NotImplementedError(
        f"nonfinite: {library_call} has one non-finite behaviour, got {nonfinite!r}")


def init_single_process_group() -> None:
  """Initialize DeepSpeed's communication backend as one gloo process, unless it already is."""
  if deepspeed.comm.is_initialized():
    return
  folder = tempfile.mkdtemp(prefix="clipbench-deepspeed-")
  # The rendezvous file is read while the group lives: removed with the process, not before.
  atexit.register(shutil.rmtree, folder, ignore_errors=True)
  rendezvous = os.path.join(folder, "rendezvous")
  deepspeed.init_distributed(
      dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
      init_method="file://" + rendezvous, rank=0, world_size=1)


_TORCH_TENSORS = (
    "import torch\n"
    "torch.set_printoptions(precision=10)\n"
    "grads = [torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16) "
    "if x.dtype.name == 'bfloat16' else torch.from_numpy(x.copy()) for x in leaves]\n")


class DeepSpeedClipGradNorm:
  """``deepspeed.runtime.utils.clip_grad_norm_(params, max_norm, norm_type)`` on ``.grad``."""

  framework = "torch"
  library = "deepspeed"
  version = deepspeed.__version__
  name = "deepspeed.clip_grad_norm_"
  description = ("deepspeed.runtime.utils.clip_grad_norm_ on the .grad of parameters, one "
                 "gloo process (in place; min(1, max/(norm+1e-6)); float32 norm of norms)")
  # Any float p (the per-tensor norms are torch's ``Tensor.norm(p)``), every float dtype and
  # mixtures (each gradient's norm taken in float32), in place.
  capabilities = Capabilities(norm_types=ANY_NORM_TYPE, in_place=True, devices=("cpu",))
  # The library call a bug report would show (the suite's reproducer appends it).
  reproducer = _TORCH_TENSORS + (
      "import os, tempfile\nos.environ.setdefault('DS_ACCELERATOR', 'cpu')\nimport deepspeed\n"
      "from deepspeed.runtime.utils import clip_grad_norm_\n"
      "deepspeed.init_distributed(dist_backend='gloo', auto_mpi_discovery=False, "
      "init_method='file://' + tempfile.mkdtemp() + '/rendezvous', rank=0, world_size=1)\n"
      "params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]\n"
      "for p, g in zip(params, grads):\n  p.grad = g\n"
      "norm = clip_grad_norm_(params, threshold, norm_type=norm_type)\n"
      "print([p.grad for p in params], norm)")

  def __init__(self) -> None:
    self._holding = ParametersHolding()  # built once per set of gradient tensors

  def clip_grad_norm(self, leaves: Sequence[Any], max_norm: float, *, norm_type: float = 2.0,
                     nonfinite: str = "propagate") -> tuple[list[torch.Tensor], torch.Tensor]:
    _check_nonfinite("deepspeed.runtime.utils.clip_grad_norm_", nonfinite)
    init_single_process_group()
    grads = [_as_tensor(x) for x in leaves]
    # Each parameter's ``.grad`` is the very tensor, as after a backward pass.
    params = self._holding(grads)
    total_norm = ds_utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    return grads, total_norm


class DeepSpeedClipTensorsByGlobalNorm:
  """``deepspeed.runtime.utils.clip_tensors_by_global_norm(tensors, max_norm)`` (L2, eps 1e-6)."""

  framework = "torch"
  library = "deepspeed"
  version = deepspeed.__version__
  name = "deepspeed.clip_tensors_by_global_norm"
  description = ("deepspeed.runtime.utils.clip_tensors_by_global_norm (in place; L2; scaled by "
                 "max/(norm+1e-6) only when below 1; a non-finite norm returned as -1)")
  # L2 only (it takes no norm_type), every float dtype and mixtures, in place.
  capabilities = Capabilities(norm_types=(2.0,), in_place=True, devices=("cpu",))
  reproducer = _TORCH_TENSORS + (
      "import os\nos.environ.setdefault('DS_ACCELERATOR', 'cpu')\n"
      "from deepspeed.runtime.utils import clip_tensors_by_global_norm\n"
      "norm = clip_tensors_by_global_norm(grads, threshold)\nprint(grads, norm)")

  def clip_grad_norm(self, leaves: Sequence[Any], max_norm: float, *, norm_type: float = 2.0,
                     nonfinite: str = "propagate") -> tuple[list[torch.Tensor], torch.Tensor]:
    # The function has no norm_type: refuse other p instead of emulating.
    if norm_type != 2.0:
      raise NotImplementedError(
          f"norm_type: deepspeed clip_tensors_by_global_norm is L2 only, got {norm_type!r}")
    _check_nonfinite("deepspeed.runtime.utils.clip_tensors_by_global_norm", nonfinite)
    tensors = [_as_tensor(x) for x in leaves]
    global_norm = ds_utils.clip_tensors_by_global_norm(tensors, max_norm)
    return tensors, global_norm


clip_grad_norm_ = DeepSpeedClipGradNorm()
clip_tensors_by_global_norm = DeepSpeedClipTensorsByGlobalNorm()
