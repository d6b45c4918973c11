"""The Triton kernels compiled for a CUDA target without a GPU: what a card would compile.

  python -m clipbench.impls.own.triton.ahead_of_time [--arch 90] [--all]

CI has no GPU and runs the kernels in Triton's interpreter, which accepts programs the compiler
rejects (a method called on an integer argument that Triton specializes as a constant) and
shows none of the compiler's choices. This compiles every kernel for ``sm_<arch>`` with
Triton's own compiler (its bundled ``ptxas``), as a launch on a card would: a representative
set of specializations, or with ``--all`` every dtype, mode and flag the route launches,
including integer arguments equal to 1 (compiled as constants on a GPU). It then checks the
PTX of the decision kernel: no fused multiply-add outside libdevice's ``log`` and ``exp2``
(general p; their error bound is their own) -- the double-double products need none -- and the
float64 constants exactly (``1 + 2**-50`` would become 1 as a float32 constant), and that no
kernel reads a global that Triton compares with its compiled value at each launch (a host
cost per launch; ``scratch.Words``).

Run it with ``TRITON_INTERPRET`` unset (under the interpreter there is nothing to compile).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import struct
import sys
from typing import Iterator, Sequence

from clipbench.impls.own.triton import decision_kernel as dk
from clipbench.impls.own.triton import kernels, passes

# float64 constants the decision kernel must hold exactly, as PTX writes them.
EXACT_CONSTANTS = {"1 + 2**-50": 1 + 2.0 ** -50, "1 - 2**-50": 1 - 2.0 ** -50,
                   "0.5001": 0.5001, "Dekker's splitter": 134217729.0}


def _ptx_double(value: float) -> str:
  return "0d%016X" % struct.unpack("<Q", struct.pack("<d", value))[0]


def _specializations(everything: bool) -> Iterator[tuple[object, dict, dict]]:
  """(kernel, signature, constants) of the launches to compile."""
  tl = kernels.tl
  dtypes = ("float32", "bfloat16", "float16", "float64") if everything else ("float32",
                                                                              "bfloat16")
  measure_sig = {"table": "*i64", "scratch": "*i64", "base": "i64", "K": "i64",
                 "n_total": "i64", "slot0": "i64", "p_bits": "i64"}
  modes = kernels.MODES
  chosen_modes = modes if everything else (modes.SQUARES, modes.STEPS, modes.PIECES)
  for dtype, mode, per_system, aligned in itertools.product(dtypes, chosen_modes,
                                                           (True, False), (True, False)):
    # Rows read at a time: step vectors (longer ones in parts of 1,024, one row a tile), and
    # per system the short rows of sums; elements otherwise.
    if mode == modes.STEPS:
      vecs = (4, 1024) if everything else (4,)
    elif per_system and mode in (modes.SQUARES, modes.MAGNITUDES):
      vecs = (1, 4)
    else:
      vecs = (1,)
    for vec in vecs:
      full = max(1, (passes.SYSTEM_BLOCK if per_system else passes.BLOCK) // vec)
      # Per system, a launch of short items scans a narrower tile, down to MIN_SYSTEM_TILE
      # (passes._measure_tile): that narrowest tile is compiled too.
      for block in (full, passes.MIN_SYSTEM_TILE) if per_system and (
          everything or mode == modes.SQUARES) and full > passes.MIN_SYSTEM_TILE else (full,):
        yield kernels.measure_items, measure_sig, {
            "DTYPE": getattr(tl, dtype), "MODE": mode, "PER_SYSTEM": per_system,
            "COUNTS": per_system, "FLAG_LOW": per_system and dtype != "float64",
            "SQUARE": True, "VEC": vec, "ALIGNED": aligned, "BLOCK": block}
  pointer = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16", "float64": "*fp64"}
  ints = {"float32": "int32", "float64": "int64", "bfloat16": "int16", "float16": "int16"}
  for dtype, per_system, aligned in itertools.product(dtypes, (True, False), (True, False)):
    yield kernels.apply_items, {"table": "*i64", "out": pointer[dtype], "scratch": "*i64",
                                "base": "i64", "K": "i64"}, {
        "DTYPE": getattr(tl, dtype), "INT": getattr(tl, ints[dtype]),
        "PER_SYSTEM": per_system, "ALIGNED": aligned, "BLOCK": 1024}
  decide_sig = {"scratch": "*i64", "base": "i64", "K": "i64", "n_leaves": "i64",
                "n_items": "i64", "n_total": "i64", "thr": "*fp64", "thr_bits": "i64",
                "p_bits": "i64", "depth_bits": "i64", "rel_bits": "i64"}
  kinds = dk.KINDS
  chosen_kinds = kinds if everything else (kinds.SUM, kinds.PIECES)
  for kind, per_system, ones in itertools.product(chosen_kinds, (True, False), (False, True)):
    norm64 = kind in (kinds.PIECES, kinds.EXACT) or (kind in (kinds.MAX, kinds.MIN) and per_system)
    signature, constants = dict(decide_sig), {}
    if ones:  # every integer argument equal to 1: Triton compiles them as constants
      constants = {name: 1 for name in ("K", "n_leaves", "n_total", "thr_bits", "p_bits",
                                        "depth_bits", "rel_bits")}
      signature = {k: v for k, v in signature.items() if k not in constants}
    constants.update(KIND=kind, P=2 if kind in (kinds.SUM, kinds.PIECES) else 1,
                     PER_SYSTEM=per_system, NORM64=norm64, PREC=0 if norm64 else 24,
                     THRESHOLD=0, CHECK_THRESHOLD=False, CERTIFIED=True, HAS32=True,
                     HAS64=norm64, BLOCK=256)
    yield dk.decide_systems, signature, constants


def compile_all(arch: int = 90, everything: bool = False) -> dict[str, int]:
  """Compiles the kernels for ``sm_<arch>``; returns counts; raises on a failure."""
  import triton  # pylint: disable=import-outside-toplevel
  from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel
  from triton.compiler import ASTSource  # pylint: disable=import-outside-toplevel
  target = GPUTarget("cuda", arch, 32)
  compiled = fused = 0
  missing: set[str] = set()
  for kernel, signature, constants in _specializations(everything):
    constants = {**_defaults(kernel), **constants}  # as a launch's binder fills them in
    full = {**signature, **{name: "constexpr" for name in constants}}
    binary = triton.compile(ASTSource(kernel, full, constants), target=target,
                            options={"enable_fp_fusion": False})
    compiled += 1
    if kernel is dk.decide_systems:
      ptx = binary.asm["ptx"]
      if constants["KIND"] != dk.KINDS.POWER:  # log and exp2 come from libdevice, which fuses
        fused += ptx.count("fma.rn")
      if constants["KIND"] == dk.KINDS.SUM and constants["PER_SYSTEM"] and constants["P"] == 2:
        missing |= {name for name, value in EXACT_CONSTANTS.items()
                    if name != "Dekker's splitter" and _ptx_double(value) not in ptx}
      if constants["KIND"] == dk.KINDS.PIECES and _ptx_double(134217729.0) not in ptx:
        missing.add("Dekker's splitter")
  if fused or missing:
    raise AssertionError(f"decision kernel PTX: {fused} fused multiply-adds; float64 "
                         f"constants missing: {sorted(missing) or 'none'}")
  checked = {kernel.fn.__name__: sorted(name for name, _ in kernel.used_global_vals)
             for kernel in (kernels.measure_items, kernels.apply_items, dk.decide_systems)}
  if any(checked.values()):
    raise AssertionError(f"globals Triton compares at each launch: {checked} (pass them as a "
                         "constexpr argument's default: scratch.Words says why)")
  return {"compiled": compiled, "triton": triton.__version__}


def _defaults(kernel) -> dict:
  """The kernel's constexpr arguments left to their defaults (the constants' tuples)."""
  return {name: p.default for name, p in kernel.signature.parameters.items()
          if p.default is not inspect.Parameter.empty}


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m clipbench.impls.own.triton.ahead_of_time",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--arch", type=int, default=90, help="compute capability (90: sm_90)")
  parser.add_argument("--all", action="store_true", help="every specialization the route "
                      "launches (slower)")
  args = parser.parse_args(argv)
  if kernels.triton is None:
    print(f"ahead_of_time: {kernels.IMPORT_ERROR}")
    return 1
  result = compile_all(args.arch, args.all)
  print(f"compiled {result['compiled']} specializations for sm_{args.arch} with Triton "
        f"{result['triton']}: the decision kernel has no fused multiply-add and its float64 "
        "constants; no kernel reads a global that Triton compares at each launch")
  return 0


if __name__ == "__main__":
  sys.exit(main())
